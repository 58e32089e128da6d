"""The runtime's inputs to the preserver's stability check: secant curvature and the optimizer's rule."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from deft.runtime.grad_stats import GradStats, stability_inputs


def test_secant_from_observed_points_recovers_an_isotropic_quadratic() -> None:
    # Loss 1/2 * 3 |x|^2: the gradient is 3 x, so |g - g'| / |x - x'| = 3 exactly (by hand).
    stats = GradStats()
    x = [torch.tensor([1.0, -2.0]), torch.tensor([[0.5]])]
    for step in range(3):
        grads = [3.0 * t for t in x]
        stats.observe_point(x, grads)
        x = [t - 0.1 * (step + 1) * g for t, g in zip(x, grads, strict=True)]
    assert stats.secant.value == pytest.approx(3.0, rel=1e-6)  # float32 tensors


def test_secant_skips_parameters_without_gradient() -> None:
    stats = GradStats()
    stats.observe_point([torch.tensor([1.0]), torch.tensor([5.0])], [torch.tensor([2.0]), None])
    stats.observe_point([torch.tensor([2.0]), torch.tensor([7.0])], [torch.tensor([4.0]), None])
    assert stats.secant.value == pytest.approx(2.0)  # (4 - 2) / (2 - 1); the gradient-less tensor is ignored


def _sgd(**kw) -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], **kw)


def test_sgd_spec_and_calibrated_value_wins() -> None:
    opt = _sgd(lr=0.02, momentum=0.9, nesterov=True)
    lam, spec, how = stability_inputs(opt, secant=30.0, calibrated=None)
    assert (lam, how) == (30.0, "secant")
    assert spec is not None and (spec.kind, spec.lr, spec.momentum, spec.nesterov) == ("sgd", 0.02, 0.9, True)
    lam, _, how = stability_inputs(opt, secant=30.0, calibrated=70.0)
    assert (lam, how) == (70.0, "lanczos (calibrate)")


def test_no_estimate_or_unsupported_optimizer_gives_none_and_why() -> None:
    assert stability_inputs(_sgd(lr=0.1), None, None)[:2] == (None, None)
    rms = torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    lam, spec, why = stability_inputs(rms, 5.0, None)
    assert lam is None and spec is None and "RMSprop" in why
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    lam, spec, why = stability_inputs(adam, 5.0, None)  # no step yet: no second moment
    assert lam is None and "second moment" in why


def test_adam_scale_is_the_median_inverse_root_second_moment() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([p], lr=0.001, betas=(0.8, 0.999), eps=1e-8)
    p.grad = torch.tensor([1.0, 2.0, 4.0])
    opt.step()
    # After one step v_hat = g^2 (bias-corrected), so 1 / (|g| + eps) = 1, 1/2, 1/4: the median is 1/2.
    lam, spec, _ = stability_inputs(opt, secant=10.0, calibrated=None)
    assert lam == 10.0
    assert spec is not None and spec.kind == "adam" and spec.momentum == 0.8
    assert spec.scale == pytest.approx(0.5, rel=1e-6)
    assert math.isclose(spec.step, 0.0005, rel_tol=1e-6)
    _, spec, _ = stability_inputs(opt, secant=10.0, calibrated=3.0, preconditioned=True)
    assert spec is not None and spec.scale == 1.0  # the calibrated value already includes D


def _x(rank: int) -> torch.Tensor:
    return torch.randn(16, 4, generator=torch.Generator().manual_seed(100 + rank))


def calibrate_worker(rank: int, world: int) -> dict[str, Any]:
    import deft
    from deft.profile import Bucket, BucketTimes, Link, Profile

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    prof = Profile((Bucket(0, ("weight",), 4, 16),), (BucketTimes(1e-3, 2e-3, {"primary": 5e-3}),),
                   (Link("primary", "gloo", None, 5e-3, 0.0),), 2, "synthetic")
    ddp = deft.DistributedDataParallel(model, optimizer=opt, profile=prof, config={
        "epsilon": 0.05, "warmup_iters": 6, "timeout_s": 30, "adapt": False, "links": [{"name": "primary"}]})
    x0 = _x(rank)
    record = ddp.calibrate(lambda: 0.5 * (ddp.module(x0) ** 2).mean(), tol=1e-6)
    for t in range(6 + 6):  # warm-up, then at most plan_lag_iters (6) while rank 0 plans in the background
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * t + rank))
        loss = 0.5 * (ddp(x) ** 2).mean() + (ddp.module.weight.sum() * 0.3)
        loss.backward()
        ddp.observe_loss(loss)
        opt.step()
        opt.zero_grad()
    info = ddp.plan_info
    return {"record": record, "curvature": (info.get("stats") or {}).get("curvature"),
            "reason": info.get("stats_reason"), "try_log": info.get("try_log")}


@pytest.mark.slow
def test_calibrate_probes_on_rank_0_and_feeds_the_preserver() -> None:
    from tests._dist import run_ranks, values

    a, b = values(run_ranks(calibrate_worker, 2, timeout=120))
    # Loss 1/2 mean((x w)^2) on rank 0's batch: the Hessian is X0^T X0 / n (by hand), its top
    # eigenvalue computed here by numpy's dense solver, a second method.
    x0 = _x(0).double().numpy()
    expected = float(np.linalg.eigvalsh(x0.T @ x0 / len(x0))[-1])
    assert a["record"]["value"] == pytest.approx(expected, rel=1e-5)
    assert b["record"] == a["record"]  # rank 0's probe, broadcast
    assert a["curvature"] == pytest.approx(expected, rel=1e-5) and b["curvature"] == a["curvature"]
    assert "lanczos (calibrate)" in a["reason"]
    checked = [t for t in a["try_log"] if t["kind"] != "no_delay"]
    assert checked and all(t["stability"] is not None for t in checked)
