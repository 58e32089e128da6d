"""One rank of tests/test_failover_hier_netns.py, started by torchrun (``--nnodes 2 --nproc-per-node 2``)
inside a testbed host's namespace; the testbed's environment names the links and the deft config, whose
links all-reduce hierarchically (``hierarchical`` left at ``"auto"``).

It trains torch DDP on the default group, then deft on the config's two links from the same seed and data.
At the start of deft's iteration ``DEFT_TEST_DOWN_AT`` it writes ``<dir>/ready<rank>`` and waits for the
file ``<dir>/go`` (the test takes a NIC down in every host, then writes it); ``DEFT_TEST_DUMP_AFTER_S``
later, a rank still running prints every thread's stack to its stderr. Its report goes to
``<dir>/rank<rank>.json`` (``<dir>`` is ``argv[1]``; a file each: two ranks of a host share torchrun's
stdout): the largest difference to torch DDP's parameters (relative to each parameter's largest element),
the iterations the applied updates merged, ``plan_info["link_failures"]`` and the parameters' sums; or,
where deft raised, the error. A rank that raised exits with status 1 at once (deft's error is the
report); one that finished closes the wrapper and destroys the process groups, which must not wait for the
collectives stuck on the lost link's groups, writes ``<dir>/closed<rank>`` and exits with status 0 (by
``os._exit``: torch's gloo can abort a process at interpreter teardown)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

STEPS = 14


def make_model() -> nn.Module:
    """A few thousand parameters: a handful of 4 kB buckets on each link."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 4))


def train(wrapped: nn.Module, model: nn.Module, rank: int, out: Path | None = None, down_at: int = -1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for t in range(STEPS):
        if out is not None and t == down_at:
            (out / f"ready{rank}").write_text("ready\n", encoding="utf-8")
            while not (out / "go").exists():
                time.sleep(0.05)
            # a rank still running when the test gives up has told it where every thread waits
            faulthandler.dump_traceback_later(float(os.environ["DEFT_TEST_DUMP_AFTER_S"]), exit=False)
        g = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()


def main() -> None:
    import deft

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ref = make_model()
    train(nn.parallel.DistributedDataParallel(ref), ref, rank)
    ours = make_model()
    ddp = deft.DistributedDataParallel(ours)  # the config: $DEFT_CONFIG (links nic0 and nic1)
    try:
        train(ddp, ours, rank, out, int(os.environ["DEFT_TEST_DOWN_AT"]))
        ddp.flush()
    except Exception as e:
        report = {"rank": rank, "error": f"{type(e).__name__}: {e}", "at": time.time()}
        (out / f"rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
        os._exit(1)
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    report = {"rank": rank, "worst": worst, "merged": sorted(t for _, its in ddp.update_log for t in its),
              "failures": ddp.plan_info.get("link_failures", []), "links": list(ddp.schedule.links),
              "sums": [p.detach().double().sum().item() for p in ours.parameters()], "at": time.time()}
    (out / f"rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    ddp.close()
    dist.destroy_process_group()
    (out / f"closed{rank}").write_text("closed\n", encoding="utf-8")
    os._exit(0)  # torch's gloo can abort a process at interpreter teardown (tests/_dist.py)


if __name__ == "__main__":
    main()
