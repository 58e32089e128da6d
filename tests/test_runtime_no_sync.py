"""``no_sync()`` decided by the forward, as in torch DDP, against torch DDP (2 gloo ranks on CPU).

torch DDP prepares its reducer in the forward: a forward outside ``no_sync()`` makes a backward that
communicates wherever that backward runs, a forward inside makes one that only accumulates. Accelerate's
``trigger_sync_in_backward`` (its documented way to run two forwards under ``no_sync`` and synchronise
the second backward) forces the communication for the backwards inside it. deft follows both, and
refuses a step that follows only no_sync() micro-batches (torch DDP would step every rank on its own
gradient: the ranks drift apart) before it applies anything.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values

STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _batches(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * t + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def reverse_loop(wrapped: Any, opt: torch.optim.Optimizer, rank: int, trigger: Callable[[], Any]) -> None:
    """The forward outside no_sync(), its backward inside: it communicates (the forward decided)."""
    for t in range(STEPS):
        x, _ = _batches(rank, t)
        loss = wrapped(x).pow(2).mean()
        with wrapped.no_sync():
            loss.backward()
        opt.step()
        opt.zero_grad()


def trigger_loop(wrapped: Any, opt: torch.optim.Optimizer, rank: int,
                 trigger: Callable[[], AbstractContextManager[None]]) -> None:
    """Accelerate's documented pattern: two forwards under no_sync(), the first backward accumulates,
    the second runs under trigger_sync_in_backward and communicates both."""
    for t in range(STEPS):
        a, b = _batches(rank, t)
        with wrapped.no_sync():
            loss_a = wrapped(a).pow(2).mean()
            loss_b = wrapped(b).pow(2).mean()
        loss_a.backward()
        with trigger():
            loss_b.backward()
        opt.step()
        opt.zero_grad()


def worker(rank: int, world: int) -> dict[str, Any]:
    import accelerate

    import deft
    from deft.integrations.accelerate import Accelerator

    plain_acc = accelerate.Accelerator(cpu=True)
    deft_acc = Accelerator(cpu=True)
    cfg = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2}
    out: dict[str, Any] = {}
    for name, loop in (("reverse", reverse_loop), ("trigger", trigger_loop)):
        runs = {}
        for kind in ("torch", "deft", "deft_accelerate"):
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if kind == "torch":
                ddp: Any = nn.parallel.DistributedDataParallel(model)
                trigger = lambda d=ddp: plain_acc.trigger_sync_in_backward(d)  # noqa: E731
            else:
                ddp = deft.DistributedDataParallel(model, config=cfg)
                trigger = (ddp.trigger_sync_in_backward if kind == "deft"
                           else lambda d=ddp: deft_acc.trigger_sync_in_backward(d))
            loop(ddp, opt, rank, trigger)
            if kind != "torch":
                ddp.flush()
                ddp.close()
            runs[kind] = torch.cat([p.detach().flatten() for p in model.parameters()])
        out[name] = {k: (v - runs["torch"]).abs().max().item() for k, v in runs.items() if k != "torch"}
    # forward and backward under no_sync(), then the step: refused before anything is applied
    model = make_model()
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = deft.DistributedDataParallel(model, config=cfg)
    x, _ = _batches(rank, 0)
    with ddp.no_sync():
        ddp(x).pow(2).mean().backward()
    try:
        opt.step()
        out["refused"] = None
    except deft.DeftError as e:
        out["refused"] = str(e)
    out["untouched"] = torch.equal(before, torch.cat([p.detach().flatten() for p in model.parameters()]))
    return out


@pytest.mark.slow
def test_the_forward_decides_and_a_step_after_only_micro_batches_is_refused() -> None:
    for v in values(run_ranks(worker, 2, timeout=180)):
        assert v["reverse"] == {"deft": pytest.approx(0.0, abs=1e-6), "deft_accelerate": pytest.approx(0.0, abs=1e-6)}
        assert v["trigger"] == {"deft": pytest.approx(0.0, abs=1e-6), "deft_accelerate": pytest.approx(0.0, abs=1e-6)}
        assert v["refused"] is not None and "under no_sync()" in v["refused"], v["refused"]
        assert "trigger_sync_in_backward" in v["refused"]
        assert v["untouched"]
