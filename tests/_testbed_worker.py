"""One rank of tests/test_testbed_first_iteration.py, started inside a testbed host's namespace
(``python -m tests._testbed_worker``; the testbed's environment names the rank, the rendezvous and the
deft config). It trains the same model with deft (the config's links, its settings) and one iteration of torch
DDP + torch's ``fp16_compress_hook``, and prints one JSON line: deft's ``plan_info["profile_codec"]``
and the largest difference of the parameters after the first iteration, relative to the parameter's
largest element. With ``DEFT_TEST_PLAN=1`` it trains deft alone past its plan (``PLAN_STEPS``) and
prints ``plan_info["codecs"]``, the schedule's codecs and the parameters' sums (the ranks must agree)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

STEPS = 4
PLAN_STEPS = 14


def make_model() -> nn.Module:
    """2.2 M parameters (8.8 MB of float32 gradient): over a 50 Mbit/s link the all-reduce, not the
    forward and backward of a 16-sample batch, is the bound."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 1024), nn.Tanh(), nn.Linear(1024, 10))


def train(wrapped: nn.Module, model: nn.Module, rank: int, steps: int = STEPS,
          first: list[torch.Tensor] | None = None, codecs: list[list[str]] | None = None) -> list[float]:
    """``steps`` iterations; ``first`` receives the parameters after the first step, ``codecs`` the codecs
    of the schedule each iteration ran (deft only)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for t in range(steps):
        g = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 10, generator=g)  # noisy: the codec passes
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if codecs is not None:
            codecs.append(sorted(set(wrapped.schedule.codecs)))
        if t == 0 and first is not None:
            first.extend(p.detach().clone() for p in model.parameters())
    return losses


def main() -> None:
    import deft

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ours = make_model()
    ddp = deft.DistributedDataParallel(ours)  # torch DDP's line; the config: $DEFT_CONFIG
    if os.environ.get("DEFT_TEST_PLAN") == "1":
        seen: list[list[str]] = []
        losses = train(ddp, ours, rank, PLAN_STEPS, codecs=seen)
        ddp.flush()
        print(json.dumps({"rank": rank, "codecs": ddp.plan_info.get("codecs"), "t0": ddp.plan_info.get("t0"),
                          "schedule_codecs": sorted(set(ddp.schedule.codecs)), "losses": losses,
                          "codecs_seen": seen, "profile_codec": ddp.plan_info["profile_codec"]["codec"],
                          "sums": [p.detach().double().sum().item() for p in ours.parameters()]}), flush=True)
        os._exit(0)
    after_first: list[torch.Tensor] = []
    train(ddp, ours, rank, first=after_first)
    ddp.flush()
    # the first iteration's update against torch DDP + fp16's (the profile iterations after it may send
    # int8, whose rounding torch DDP's buckets would draw differently)
    ref = make_model()
    tddp = nn.parallel.DistributedDataParallel(ref)
    tddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    train(tddp, ref, rank, steps=1)
    worst = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(after_first, ref.parameters(), strict=True))
    print(json.dumps({"rank": rank, "record": ddp.plan_info["profile_codec"], "vs_fp16": worst}), flush=True)
    os._exit(0)  # torch 2.13's gloo can abort at teardown (tests/_dist.py)


if __name__ == "__main__":
    main()
