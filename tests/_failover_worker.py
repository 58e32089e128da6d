"""One rank of tests/test_runtime_failover_netns.py, started inside a testbed host's namespace
(``python -m tests._failover_worker``; the testbed's environment names the rank, the rendezvous and the
deft config). It trains torch DDP on the default group, then deft on the config's two links from the same
seed and data; at the start of deft's iteration ``DEFT_TEST_DOWN_AT`` it prints ``ready`` and waits for the
file ``DEFT_TEST_GO`` (the test takes the second link's NIC down in every host, then writes it). It prints
one JSON line: the largest difference to torch DDP's parameters (relative to each parameter's largest
element), the iterations the applied updates merged, ``plan_info["link_failures"]``, the links of the
schedule deft ends on and the parameters' sums."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

STEPS = 24


def make_model() -> nn.Module:
    """About 0.3 M parameters: a few buckets of each link's share at 250 Mbit/s."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 256),
                         nn.Tanh(), nn.Linear(256, 10))


def train(wrapped: nn.Module, model: nn.Module, rank: int, down_at: int | None = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for t in range(STEPS):
        if t == down_at:
            print("ready", flush=True)
            go = os.environ["DEFT_TEST_GO"]
            while not os.path.exists(go):
                time.sleep(0.05)
        g = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 10, generator=g)
        nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()


def main() -> None:
    import deft

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ref = make_model()
    train(nn.parallel.DistributedDataParallel(ref), ref, rank)
    ours = make_model()
    ddp = deft.DistributedDataParallel(ours)  # the config: $DEFT_CONFIG (links nic0 and nic1)
    train(ddp, ours, rank, int(os.environ["DEFT_TEST_DOWN_AT"]))
    ddp.flush()
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    print(json.dumps({"rank": rank, "worst": worst, "merged": sorted(t for _, its in ddp.update_log for t in its),
                      "failures": ddp.plan_info.get("link_failures", []), "links": list(ddp.schedule.links),
                      "sums": [p.detach().double().sum().item() for p in ours.parameters()]}), flush=True)
    sys.stdout.flush()
    # a collective stuck on the lost link's group ends only with gloo's own timeout: do not wait for it
    if os.environ.get("DEFT_TEST_EXIT") != "normal":
        os._exit(0)


if __name__ == "__main__":
    main()
