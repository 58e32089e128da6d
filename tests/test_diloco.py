"""examples/diloco.py: DiLoCo's outer step is the paper's maths (Douillard et al. 2023, Algorithm 1).

The reference here is written out by hand, apart from the code under test: both ranks' inner SGD is
replayed in this process (inner steps communicate nothing), the pseudo-gradients are averaged, and
the outer SGD with Nesterov momentum is spelled out (and, separately, checked against
``torch.optim.SGD(nesterov=True)``). With outer lr 1 and momentum 0 DiLoCo is post-local SGD's model
averaging: checked against torch's own ``PeriodicModelAverager``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from diloco import DiLoCo, outer_step

H, ROUNDS, INNER_LR, INNER_MOMENTUM = 3, 2, 0.1, 0.9


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank and in the reference
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _inner_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _state(model: nn.Module) -> dict[str, list[Any]]:
    return {"params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
            "buffers": [b.detach().reshape(-1).tolist() for b in model.buffers()]}


def diloco_worker(rank: int, world: int, outer_lr: float, outer_momentum: float,
                  bucket_cap_mb: float | None) -> list[dict[str, list[Any]]]:
    """ROUNDS x H inner steps under DiLoCo; the model's state after each outer step."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM)
    opt = DiLoCo(model, inner, h=H, outer_lr=outer_lr, outer_momentum=outer_momentum, bucket_cap_mb=bucket_cap_mb)
    out = []
    for i, (x, y) in enumerate(_batches(rank, ROUNDS * H)):
        _inner_step(model, opt, x, y)
        if (i + 1) % H == 0:
            out.append(_state(model))
    assert opt.outer_steps == ROUNDS
    return out


def averager_worker(rank: int, world: int) -> list[dict[str, list[Any]]]:
    """The same inner steps under torch's post-local SGD averager (a model average every H-th step)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM)
    # torch averages at its step counter s >= warmup_steps with (s - warmup_steps) % period == 0, counting
    # from 0: warmup_steps = H - 1 puts the averages after the H-th, 2H-th, ... step, where DiLoCo's outer
    # steps are
    averager = PeriodicModelAverager(period=H, warmup_steps=H - 1)
    out = []
    for i, (x, y) in enumerate(_batches(rank, ROUNDS * H)):
        nn.functional.cross_entropy(model(x), y).backward()
        inner.step()
        # as PostLocalSGDOptimizer.step does: after the step, while the gradients are set (torch averages
        # only parameters that have a gradient)
        averager.average_parameters(model.parameters())
        inner.zero_grad()
        if (i + 1) % H == 0:
            out.append(_state(model))
    return out


def reference(outer_lr: float, outer_momentum: float) -> list[dict[str, list[Any]]]:
    """Algorithm 1 of the paper for 2 ranks, by hand, in one process."""
    models = [_model(), _model()]
    inners = [torch.optim.SGD(m.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM) for m in models]
    data = [_batches(r, ROUNDS * H) for r in range(2)]
    theta = [p.detach().clone() for p in models[0].parameters()]  # the global parameters
    velocity: list[torch.Tensor] | None = None
    out = []
    for t in range(ROUNDS):
        for r in range(2):
            for x, y in data[r][t * H:(t + 1) * H]:
                _inner_step(models[r], inners[r], x, y)
        locals_ = [[p.detach() for p in m.parameters()] for m in models]
        delta = [(theta[k] - locals_[0][k] + theta[k] - locals_[1][k]) / 2 for k in range(len(theta))]
        # outer SGD, Nesterov: v <- mu v + Delta (v <- Delta at the first step); theta <- theta - lr (Delta + mu v)
        velocity = [d.clone() for d in delta] if velocity is None else [
            outer_momentum * v + d for v, d in zip(velocity, delta, strict=True)]
        theta = [th - outer_lr * (d + outer_momentum * v) for th, d, v in zip(theta, delta, velocity, strict=True)]
        with torch.no_grad():
            for m in models:
                for p, th in zip(m.parameters(), theta, strict=True):
                    p.copy_(th)
            for b1, b0 in zip(models[1].buffers(), models[0].buffers(), strict=True):
                b1.copy_(b0)  # rank 0's BatchNorm statistics
        out.append(_state(models[0]))
    return out


def _close(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest absolute difference; asserts the shapes agree."""
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(u - v) for xa, xb in zip(a, b, strict=True) for u, v in zip(xa, xb, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("bucket_cap_mb", [None, 1e-4])  # one flat all-reduce; one bucket per tensor
def test_outer_steps_equal_the_papers_maths_on_two_ranks(bucket_cap_mb: float | None) -> None:
    got = values(run_ranks(diloco_worker, 2, (0.7, 0.9, bucket_cap_mb), timeout=120))
    ref = reference(0.7, 0.9)
    for rnd in range(ROUNDS):
        for rank in range(2):
            assert _close(got[rank][rnd]["params"], ref[rnd]["params"]) < 1e-6, (rnd, rank)
            assert _close(got[rank][rnd]["buffers"], ref[rnd]["buffers"]) < 1e-6, (rnd, rank)
    # the outer steps moved the model off plain averaging (else the test could not tell them apart)
    avg = reference(1.0, 0.0)
    assert _close(got[0][-1]["params"], avg[-1]["params"]) > 1e-3


@pytest.mark.slow
def test_outer_lr_one_without_momentum_is_post_local_sgd_averaging() -> None:
    got = values(run_ranks(diloco_worker, 2, (1.0, 0.0, None), timeout=120))
    torch_avg = values(run_ranks(averager_worker, 2, (), timeout=120))
    for rnd in range(ROUNDS):
        for rank in range(2):
            assert _close(got[rank][rnd]["params"], torch_avg[rank][rnd]["params"]) < 1e-6, (rnd, rank)
    # and both are the average of the two ranks' parameters replayed by hand in this process
    assert _close(torch_avg[0][0]["params"], reference(1.0, 0.0)[0]["params"]) < 1e-6


def test_outer_step_is_torch_sgd_with_nesterov_momentum() -> None:
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    deltas = [[torch.randn(4, 3, generator=g), torch.randn(5, generator=g)] for _ in range(3)]
    params = [nn.Parameter(t.clone()) for t in start]
    sgd = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    snap, buf = [t.clone() for t in start], None
    for d in deltas:
        for p, dk in zip(params, d, strict=True):
            p.grad = dk.clone()
        sgd.step()
        snap, buf = outer_step(snap, d, buf, lr=0.7, momentum=0.9)
        for p, s in zip(params, snap, strict=True):
            torch.testing.assert_close(s, p.detach(), rtol=0, atol=1e-6)


def test_outer_step_is_pure_and_plain_sgd_without_momentum() -> None:
    snap, delta = [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, -1.0])]
    new, buf = outer_step(snap, delta, None, lr=1.0, momentum=0.0)
    assert new[0].tolist() == [0.5, 3.0]  # theta - Delta: the average of the ranks' parameters
    assert snap[0].tolist() == [1.0, 2.0] and delta[0].tolist() == [0.5, -1.0]  # inputs untouched
    assert buf[0].tolist() == [0.5, -1.0]
    with pytest.raises(ValueError, match="one tensor per parameter"):
        outer_step(snap, [*delta, delta[0]], None, lr=1.0, momentum=0.0)
