"""One rank of tests/test_testbed_ranks_per_host.py, started by torchrun (``--nnodes 2 --nproc-per-node 2``)
inside a testbed host's namespace; the testbed's environment names the links and the deft config.

It all-reduces a known size between barriers, on the default group (gloo's flat ring) and on deft's
primary link (hierarchical: the config's ``hierarchical`` is left at ``"auto"``), and reads the bytes the
host's ``nic0`` and loopback sent meanwhile (``/sys/class/net`` of its namespace); then trains the same model
with torch DDP and with deft (epsilon 0, the config's two links) and writes its report to
``<argv[1]>/rank<N>.json`` (a file each: the two ranks of a host share torchrun's stdout, where their lines
can interleave): the bytes sent as multiples of the size, the largest parameter difference after
``ddp.flush()`` and every iteration deft's updates merged."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

STEPS = 6
LR = 0.05
PROBE_BYTES = 4 * 2**20


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def train(wrapped: nn.Module, model: nn.Module, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for t in range(STEPS):
        g = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()


def sent_bytes() -> dict[str, int]:
    return {dev: int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text()) for dev in ("nic0", "lo")}


def probe(all_reduce: Callable[[torch.Tensor], object]) -> dict[str, float]:
    """Bytes each device of this host sent during one ``all_reduce`` of ``PROBE_BYTES``, over that size."""
    buf = torch.ones(PROBE_BYTES // 4)
    all_reduce(buf)  # connections made, off the count
    dist.barrier()
    before = sent_bytes()
    # every rank of the host has read its count before any sends: without this barrier the host's other
    # rank could already be sending the probe over the NIC while this one reads "before"
    dist.barrier()
    all_reduce(buf)
    dist.barrier()
    after = sent_bytes()
    return {dev: (after[dev] - before[dev]) / PROBE_BYTES for dev in before}


def deft_probe() -> tuple[dict[str, float], float]:
    """:func:`probe` on deft's primary link as training builds it from ``$DEFT_CONFIG``, and the sum it
    gives (every rank sends ones: the world size)."""
    from deft.config import DeftConfig
    from deft.runtime.links import make_links

    link = make_links(DeftConfig.resolve(None), False, None)["primary"]
    out = torch.ones(3)
    link.all_reduce(out).wait()
    return probe(lambda buf: link.all_reduce(buf).wait()), out[0].item()


def main() -> None:
    import deft

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: notes.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deft.runtime").addHandler(handler)
    logging.getLogger("deft.runtime").setLevel(logging.INFO)
    sent = probe(dist.all_reduce)
    deft_sent, deft_sum = deft_probe()
    ref = make_model()
    train(nn.parallel.DistributedDataParallel(ref), ref, rank)
    ours = make_model()
    ddp = deft.DistributedDataParallel(ours)  # the config: $DEFT_CONFIG
    train(ddp, ours, rank)
    ddp.flush()
    worst = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    report = json.dumps({"rank": rank, "host": int(os.environ["GROUP_RANK"]),
                         "local_rank": int(os.environ["LOCAL_RANK"]), "world": dist.get_world_size(),
                         "sent": sent, "deft_sent": deft_sent, "deft_sum": deft_sum,
                         "hierarchical": [n for n in notes if "hierarchically" in n], "worst": worst,
                         "merged": sorted(i for _, its in ddp.update_log for i in its),
                         "t0": ddp.plan_info.get("t0")})
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(report, encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch's gloo can abort a process at interpreter teardown (tests/_dist.py)


if __name__ == "__main__":
    main()
