"""``no_sync()`` decided by the forward, as in torch DDP, against torch DDP (2 gloo ranks on CPU).

torch DDP prepares its reducer in the forward: a forward outside ``no_sync()`` makes a backward that
communicates wherever that backward runs, a forward inside makes one that only accumulates. Accelerate's
``trigger_sync_in_backward`` (its documented way to run two forwards under ``no_sync`` and synchronise
the second backward) forces the communication for the backwards inside it; torch's own flag behind
``no_sync()``, ``require_backward_grad_sync``, set by hand, does what the context does. deft follows all, and
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


def reverse_loop(wrapped: Any, opt: torch.optim.Optimizer, rank: int, trigger: Callable[[], Any]) -> list[float]:
    """The forward outside no_sync(), its backward inside: it communicates (the forward decided)."""
    for t in range(STEPS):
        x, _ = _batches(rank, t)
        loss = wrapped(x).pow(2).mean()
        with wrapped.no_sync():
            loss.backward()
        opt.step()
        opt.zero_grad()
    return []


def trigger_loop(wrapped: Any, opt: torch.optim.Optimizer, rank: int,
                 trigger: Callable[[], AbstractContextManager[None]]) -> list[float]:
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
    return []


def flag_loop(wrapped: Any, opt: torch.optim.Optimizer, rank: int, trigger: Callable[[], Any]) -> list[float]:
    """torch DDP's flag behind no_sync() set by hand: the first micro-batch's forward with
    ``require_backward_grad_sync`` False only accumulates, the second's with it True communicates both."""
    for t in range(STEPS):
        a, b = _batches(rank, t)
        wrapped.require_backward_grad_sync = False
        wrapped(a).pow(2).mean().backward()
        wrapped.require_backward_grad_sync = True
        wrapped(b).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return []


def micro_batch_loop(wrapped: Any, opt: torch.optim.Optimizer, rank: int, trigger: Callable[[], Any]) -> list[float]:
    """A micro-batch under no_sync(), then each parameter's gradient norm logged: this rank's own
    accumulated gradient under torch DDP."""
    norms = []
    for t in range(STEPS):
        a, b = _batches(rank, t)
        with wrapped.no_sync():
            wrapped(a).pow(2).mean().backward()
        norms += [float("nan") if p.grad is None else float(p.grad.norm()) for p in opt.param_groups[0]["params"]]
        wrapped(b).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return norms


LOOPS = {"reverse": reverse_loop, "trigger": trigger_loop, "flag": flag_loop}


def worker(rank: int, world: int, loops: tuple[str, ...] = tuple(LOOPS)) -> dict[str, Any]:
    import accelerate

    import deft
    from deft.integrations.accelerate import Accelerator

    plain_acc = accelerate.Accelerator(cpu=True)
    deft_acc = Accelerator(cpu=True)
    cfg = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2}
    out: dict[str, Any] = {}
    for name in loops:
        loop = {**LOOPS, "micro_batch": micro_batch_loop}[name]
        runs, logged = {}, {}
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
            logged[kind] = loop(ddp, opt, rank, trigger)
            if kind != "torch":
                out.setdefault(f"{name}_iterations", {})[kind] = len(ddp.update_log)  # one per communicating backward
                ddp.flush()
                ddp.close()
            runs[kind] = torch.cat([p.detach().flatten() for p in model.parameters()])
        out[name] = {k: (v - runs["torch"]).abs().max().item() for k, v in runs.items() if k != "torch"}
        out[f"{name}_logged"] = {k: max((abs(a - b) for a, b in zip(v, logged["torch"], strict=True)), default=0.0)
                                 for k, v in logged.items() if k != "torch"}  # nan where deft's p.grad was None
    if "micro_batch" in loops:
        return out
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
        assert v["flag"] == {"deft": pytest.approx(0.0, abs=1e-6), "deft_accelerate": pytest.approx(0.0, abs=1e-6)}
        # the flag obeyed: one communicating backward a step. Ignored, every micro-batch would communicate
        # (2 x STEPS iterations) and, the average being linear, end on the same parameters.
        assert v["flag_iterations"] == {"deft": STEPS, "deft_accelerate": STEPS}
        assert v["refused"] is not None and "under no_sync()" in v["refused"], v["refused"]
        assert "trigger_sync_in_backward" in v["refused"] and "local_steps" in v["refused"]
        assert v["untouched"]


@pytest.mark.slow
def test_a_micro_batchs_gradient_is_in_p_grad_as_under_torch_ddp() -> None:
    """After a backward under no_sync() ``p.grad`` holds this rank's gradient summed so far, as torch
    DDP's does (code logging or clipping per micro-batch reads it)."""
    for v in values(run_ranks(worker, 2, args=(("micro_batch",),), timeout=180)):
        assert v["micro_batch"] == {"deft": pytest.approx(0.0, abs=1e-6),
                                    "deft_accelerate": pytest.approx(0.0, abs=1e-6)}
        assert v["micro_batch_logged"] == {"deft": pytest.approx(0.0, abs=1e-6),
                                           "deft_accelerate": pytest.approx(0.0, abs=1e-6)}
