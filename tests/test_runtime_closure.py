"""``optimizer.step(closure)``: forward and backward inside the step, against torch DDP (2 gloo ranks).

torch's documented closure form (and Lightning's precision plugins) runs the closure inside the step,
after the optimizer's step pre hooks: deft's hook must apply the update the closure's backward made
due, not the one before it. At epsilon 0 the parameters must equal torch DDP's, with the closure
passed positionally or by keyword, alone or after an accumulated micro-batch (Lightning's
``accumulate_grad_batches``: earlier micro-batches run the closure outside the step). LBFGS, which
evaluates its closure several times per step, is refused at its first step with nothing applied.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values

STEPS = 8


def make_model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def train(wrapped: nn.Module, opt: torch.optim.Optimizer, rank: int, style: str) -> list[float]:
    """``style``: "positional", "keyword", or "accumulate" (one micro-batch before the step's closure)."""
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        xs, ys = torch.randn(2, 8, 16, generator=g), torch.randint(0, 4, (2, 8), generator=g)
        scale = 0.5 if style == "accumulate" else 1.0

        def closure(micro: int = 1, xs: torch.Tensor = xs, ys: torch.Tensor = ys, scale: float = scale
                    ) -> torch.Tensor:
            if style != "accumulate":
                opt.zero_grad()
            loss = loss_fn(wrapped(xs[micro]), ys[micro]) * scale
            loss.backward()
            return loss

        if style == "accumulate":
            closure(0)
            losses.append(float(opt.step(closure=closure)))  # type: ignore[arg-type]
            opt.zero_grad()
        elif style == "keyword":
            losses.append(float(opt.step(closure=closure)))  # type: ignore[arg-type]
        else:
            losses.append(float(opt.step(closure)))  # type: ignore[arg-type]
    return losses


def closure_worker(rank: int, world: int, style: str, epsilon: float) -> dict[str, Any]:
    import deft

    ours = make_model()
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    ddp = deft.DistributedDataParallel(ours, config={"epsilon": epsilon, "warmup_iters": 1, "profile_iters": 2,
                                                     "timeout_s": 30, "solver_time_limit_s": 0.1})
    losses = train(ddp, opt, rank, style)
    ddp.flush()
    ref = make_model()
    ref_losses = train(nn.parallel.DistributedDataParallel(ref),
                       torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), rank, style)
    worst = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    return {"worst": worst, "losses": losses, "ref_losses": ref_losses,
            "applied": sorted(t for _, its in ddp.update_log for t in its),
            "params": [p.detach().flatten().tolist()[:20] for p in ours.parameters()]}


@pytest.mark.slow
@pytest.mark.parametrize("style", ["positional", "keyword", "accumulate"])
def test_step_with_a_closure_matches_torch_ddp(style: str) -> None:
    per_step = 2 if style == "accumulate" else 1
    for v in values(run_ranks(closure_worker, 2, (style, 0.0), timeout=120)):
        assert v["worst"] < 1e-5, v
        assert v["losses"] == pytest.approx(v["ref_losses"], rel=1e-5, abs=1e-6)  # the step returns the loss
        assert v["applied"] == list(range(per_step * STEPS)), v["applied"]


@pytest.mark.slow
def test_step_with_a_closure_at_the_default_epsilon_applies_each_gradient_once() -> None:
    out = values(run_ranks(closure_worker, 2, ("accumulate", 0.01), timeout=240))
    for v in out:
        assert v["applied"] == list(range(2 * STEPS)), v["applied"]
        assert all(abs(x) < 1e6 for p in v["params"] for x in p)
    assert out[0]["params"] == out[1]["params"]


def lbfgs_worker(rank: int, world: int) -> dict[str, Any]:
    import deft
    from deft.errors import DeftError

    ours = make_model()
    before = [p.detach().clone() for p in ours.parameters()]
    opt = torch.optim.LBFGS(ours.parameters(), lr=0.5, max_iter=4)
    ddp = deft.DistributedDataParallel(ours, config={"epsilon": 0.0, "timeout_s": 30})
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        return loss

    try:
        opt.step(closure)  # type: ignore[no-untyped-call]
        error = ""
    except DeftError as e:
        error = str(e)
    return {"error": error, "unchanged": all(torch.equal(a, b) for a, b in zip(before, ours.parameters(), strict=True))}


@pytest.mark.slow
def test_lbfgs_is_refused_before_anything_is_applied() -> None:
    for v in values(run_ranks(lbfgs_worker, 2, timeout=120)):
        assert "LBFGS" in v["error"], v
        assert v["unchanged"], v
