"""One rank of tests/test_testbed_first_iteration.py, started inside a testbed host's namespace
(``python -m tests._testbed_worker``; the testbed's environment names the rank, the rendezvous and the
deft config). It trains the same model with deft (the config's links, its settings) and one iteration of torch
DDP with the codec deft's first iteration went in (torch's ``fp16_compress_hook``; exact for int8, with
int8's error bound beside it), and prints one JSON line: deft's ``plan_info["profile_codec"]``
and the largest difference of the parameters after the first iteration, relative to the parameter's
largest element and absolute. With ``DEFT_TEST_PLAN=1`` it trains deft alone past its plan (``PLAN_STEPS``) and
prints ``plan_info["codecs"]``, the codecs each iteration ran and the parameters' sums (the ranks must agree).
With ``DEFT_TEST_OVERFLOW=1`` it runs torch's documented AMP loop (``tests._dist.amp_steps``) with
rank 0's first step overflowing, deft against torch DDP, and prints the record, the largest
difference, the final scales, the clipped norms and the skipped steps."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests._dist import amp_steps

STEPS = 2  # the first iteration and one profile iteration after it: what the tests judge
LR = 0.05
PLAN_STEPS = 22  # past the plan (t0 < 10) and the adaptation's first decision (a 2-iteration window, 6 of lag)


def make_model() -> nn.Module:
    """2.2 M parameters (8.8 MB of float32 gradient): over a 50 Mbit/s link the all-reduce, not the
    forward and backward of a 16-sample batch, is the bound."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 1024), nn.Tanh(), nn.Linear(1024, 10))


def train(wrapped: nn.Module, model: nn.Module, rank: int, steps: int = STEPS,
          first: list[torch.Tensor] | None = None, codecs: list[list[str]] | None = None) -> list[float]:
    """``steps`` iterations; ``first`` receives the parameters after the first step, ``codecs`` the codecs
    of the schedule each iteration ran (deft only)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
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
    if os.environ.get("DEFT_TEST_OVERFLOW") == "1":
        # autocast's first bfloat16 forward and backward on the CPU take ~1 s of one-off set-up, which the
        # first iteration's screen would count as compute (and send it exact, unjudged): pay it here
        warm = make_model()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = warm(torch.randn(16, 64))
        out.float().sum().backward()
    ours = make_model()
    ddp = deft.DistributedDataParallel(ours)  # torch DDP's line; the config: $DEFT_CONFIG
    if os.environ.get("DEFT_TEST_PLAN") == "1":
        seen: list[list[str]] = []
        losses = train(ddp, ours, rank, PLAN_STEPS, codecs=seen)
        ddp.flush()
        print(json.dumps({"rank": rank, "codecs": ddp.plan_info.get("codecs"), "t0": ddp.plan_info.get("t0"),
                          "losses": losses,
                          "codecs_seen": seen, "profile_codec": ddp.plan_info["profile_codec"]["codec"],
                          "adapt": ddp.plan_info.get("adapt", []),
                          "sums": [p.detach().double().sum().item() for p in ours.parameters()]}), flush=True)
        os._exit(0)
    if os.environ.get("DEFT_TEST_OVERFLOW") == "1":
        # torch's documented AMP loop (tests/_dist.amp_steps: GradScaler, unscale_, clip_grad_norm_ with
        # its norm kept), rank 0's first loss infinite
        scale, norms = amp_steps(ours, ddp, rank, STEPS, inf_at=0, batch=16, features=64, classes=10)
        ddp.flush()
        ref = make_model()
        ref_scale, ref_norms = amp_steps(ref, nn.parallel.DistributedDataParallel(ref), rank, STEPS, inf_at=0,
                                         batch=16, features=64, classes=10)
        worst = max(((a - b).abs().max() / b.abs().max()).item()
                    for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
        print(json.dumps({"rank": rank, "record": ddp.plan_info["profile_codec"], "vs_torch": worst,
                          "scales": [scale, ref_scale], "norms": [str(n) for n in norms],
                          "ref_norms": [str(n) for n in ref_norms],
                          "skipped": ddp.plan_info.get("skipped_steps", [])}), flush=True)
        os._exit(0)
    after_first: list[torch.Tensor] = []
    train(ddp, ours, rank, first=after_first)
    ddp.flush()
    record = ddp.plan_info["profile_codec"]
    # the first iteration's update against torch DDP's with the codec it went in: torch's fp16 hook; for
    # int8 (whose draws torch DDP's buckets would make in another order) the exact all-reduce, and the
    # bound on int8's error: each rank's element off by at most its block's largest element over 127
    # levels, so the average by at most the largest local gradient element over 127 (times the step)
    ref = make_model()
    tddp = nn.parallel.DistributedDataParallel(ref)
    if record["first"]["codec"] == "fp16":
        tddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    train(tddp, ref, rank, steps=1)
    worst = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(after_first, ref.parameters(), strict=True))
    worst_abs = max((a - b).abs().max().item() for a, b in zip(after_first, ref.parameters(), strict=True))
    local = make_model()
    g = torch.Generator().manual_seed(rank)  # the first step's batch (train: 1000 t + rank)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 10, generator=g)
    nn.functional.mse_loss(local(x), y).backward()
    largest = torch.stack([p.grad.abs().max() for p in local.parameters() if p.grad is not None]).max().reshape(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    print(json.dumps({"rank": rank, "record": record, "vs_ref": worst, "vs_ref_abs": worst_abs,
                      "int8_bound": LR * largest.item() / 127,
                      "first_sums": [p.double().sum().item() for p in after_first]}), flush=True)
    os._exit(0)  # torch 2.13's gloo can abort at teardown (tests/_dist.py)


if __name__ == "__main__":
    main()
