"""The walk in the optimizer's geometry (Adam's preconditioned metric) and lr scaling of merged updates.

Hand-derived values throughout:

* Adam after one step with gradient ``c`` per element (``betas = (0.9, 0.99)``): ``exp_avg_sq =
  0.01 c²``, bias-corrected ``v̂ = c²``, so ``P = 1 / (|c| + eps)``.
* 100 elements, step gradient 0.01 each: ``P = 100`` (to 1e-6). A current gradient of 0.01 per element
  (the same on both ranks: no noise) has ``|g|² = 100 x 1e-4 = 0.01`` and ``gᵀ P g = 100 x 100 x 1e-4 = 1``.
* Walk with ``sigma = 0``, loss ``s``, a merge of two (``K = [2]``) against two steps:
  ``ratio = (s - 2 lr mu) / (s - lr mu)`` (no rebound while ``s > 2 lr mu``). At ``s = 0.1``,
  ``lr = 0.003``: Euclidean ``mu = 0.01`` gives ``0.09994 / 0.09997 = 0.99970`` (the merge looks free);
  Adam's ``mu_P = 1`` gives ``0.094 / 0.097 = 0.96907`` (below ``1 - 0.01``: rejected).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from deft.config import DeftConfig
from deft.errors import ContractError
from deft.preserver.curvature import adam_denominator
from deft.preserver.feedback import WalkStats, passes, preserve, schedule_ratio
from deft.preserver.gaussian_walk import convergence_ratio, merge_lr_factor
from deft.preserver.noise import local_stats, step_estimate, walk_geometry
from deft.runtime.optimizer_hooks import merged_lr, restore_lr, scale_lr
from tests.test_feedback import profile, schedule_with

N = 100


def adam_after_one_step(step_grad: float, lr: float = 0.003) -> tuple[torch.nn.Parameter, torch.optim.Adam]:
    w = torch.nn.Parameter(torch.zeros(N))
    opt = torch.optim.Adam([w], lr=lr, betas=(0.9, 0.99), eps=1e-8)
    w.grad = torch.full((N,), step_grad)
    opt.step()
    opt.zero_grad()
    return w, opt


def test_adam_roots_are_the_bias_corrected_preconditioner() -> None:
    a = torch.nn.Parameter(torch.zeros(1))
    b = torch.nn.Parameter(torch.zeros(1))
    unused = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([a, b, unused], lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    before = walk_geometry(opt)
    assert before.metric == "euclidean" and before.roots is None and "first step" in before.why
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    opt.step()
    geo = walk_geometry(opt)
    assert geo.metric == "adam" and geo.lr == 0.1  # Adam's lr: no momentum factor
    assert geo.roots is not None
    assert (geo.roots[0] ** 2).item() == pytest.approx(1 / 3, rel=1e-6)  # v̂ = 0.01 * 9 / (1 - 0.99) = 9
    assert (geo.roots[1] ** 2).item() == pytest.approx(1 / 4, rel=1e-6)
    assert geo.roots[2].tolist() == [0.0, 0.0]  # never stepped: no contribution


def test_sgd_walk_lr_keeps_the_momentum_factor() -> None:
    w = torch.nn.Parameter(torch.zeros(3))
    geo = walk_geometry(torch.optim.SGD([w], lr=0.02, momentum=0.9))
    assert geo.metric == "euclidean" and geo.roots is None and geo.lr == pytest.approx(0.2)


def test_preconditioned_mu_by_hand() -> None:
    w, opt = adam_after_one_step(0.01)
    geo = walk_geometry(opt, [w])
    assert geo.roots is not None
    g = torch.full((N,), 0.01)
    scaled = [g * geo.roots[0]]
    parts = [local_stats(scaled, None, 16), local_stats(scaled, None, 16)]  # two ranks, no noise
    est = step_estimate(parts, float(scaled[0].double().pow(2).sum()))
    assert est is not None
    assert est.mu == pytest.approx(1.0, rel=1e-5)  # gᵀPg = 100 * 100 * 1e-4
    raw = step_estimate([local_stats([g], None, 16)] * 2, float(g.double().pow(2).sum()))
    assert raw is not None and raw.mu == pytest.approx(0.01, rel=1e-5)


def test_preconditioned_trace_and_mu_with_noise_by_hand() -> None:
    """Two ranks at (1 ± a, 2) per-rank batch 1, P = (1/3, 1/4): the scaled pieces give
    mu_P = 4/3 - a²/3 (the unbiased estimate from one step), tr(PΣ) = 2 a² / 3."""
    a_, b_ = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([a_, b_], lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    a_.grad, b_.grad = torch.tensor([3.0]), torch.tensor([4.0])
    opt.step()
    geo = walk_geometry(opt)
    assert geo.roots is not None
    a = 0.5
    ranks = [[torch.tensor([1 + a]), torch.tensor([2.0])], [torch.tensor([1 - a]), torch.tensor([2.0])]]
    scaled = [[t * r for t, r in zip(gr, geo.roots, strict=True)] for gr in ranks]
    mean = [(x + y) / 2 for x, y in zip(*scaled, strict=True)]
    est = step_estimate([local_stats(s, None, 1) for s in scaled], sum(float(t.double().pow(2).sum()) for t in mean))
    assert est is not None
    assert est.mu == pytest.approx(4 / 3 - a * a / 3, rel=1e-5)
    assert est.trace == pytest.approx(2 * a * a / 3, rel=1e-5)


def test_adam_walk_rejects_a_merge_of_two_the_euclidean_walk_accepted() -> None:
    w, opt = adam_after_one_step(0.01, lr=0.003)
    geo = walk_geometry(opt, [w])
    assert geo.roots is not None and geo.lr is not None
    g = torch.full((N,), 0.01)
    mu_p = float((g * geo.roots[0]).double().pow(2).sum())
    adam = WalkStats(loss=0.1, mu=mu_p, sigma=0.0, lr=geo.lr, batch=32, metric="adam")
    euclid = WalkStats(loss=0.1, mu=0.01, sigma=0.0, lr=0.003, batch=32)
    merge = schedule_with((2,))
    assert schedule_ratio(merge, euclid) == pytest.approx(0.09994 / 0.09997, rel=1e-9)
    assert schedule_ratio(merge, adam) == pytest.approx(0.094 / 0.097, rel=1e-5)
    assert passes((2,), schedule_ratio(merge, euclid), 0.01)
    assert not passes((2,), schedule_ratio(merge, adam), 0.01)
    # The preserver's decision: the merge (predicted faster) with the Euclidean walk, the no-delay plan with Adam's.
    fast = dataclasses.replace(merge, predicted_iteration_s=0.1)
    nd = dataclasses.replace(schedule_with((1,)), predicted_iteration_s=0.2)
    kw = {"planner": lambda p, c, capacity_scale=1.0: fast, "no_delay_planner": lambda p, c: nd,
          "accumulate_planner": lambda p, c, k: dataclasses.replace(schedule_with((k,)), predicted_iteration_s=0.1)}
    cfg = DeftConfig(epsilon=0.01, preserver_max_tries=2)
    assert preserve(profile(), cfg, euclid, **kw).schedule.batch_sequence == (2,)
    res = preserve(profile(), cfg, adam, **kw)
    assert res.schedule.batch_sequence == (1,) and not res.accepted


def test_amsgrad_roots_use_the_running_maximum_of_the_second_moment() -> None:
    """AMSGrad steps with ``max_exp_avg_sq``: after a gradient of 3 then 0 (betas (0.9, 0.99)), the
    plain second moment is 0.99 * 0.01 * 9 = 0.0891 but its running maximum stays 0.09; both bias-
    corrected by 1 - 0.99². The walk's roots and Adam's preconditioner (one formula) use the maximum."""
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([w], lr=0.1, betas=(0.9, 0.99), amsgrad=True)
    for grad in (3.0, 0.0):
        w.grad = torch.tensor([grad])
        opt.step()
    geo = walk_geometry(opt)
    assert geo.metric == "adam" and geo.roots is not None
    bc2 = 1 - 0.99**2
    expected = 1 / (math.sqrt(0.09 / bc2) + 1e-8)
    assert (geo.roots[0] ** 2).item() == pytest.approx(expected, rel=1e-6)
    assert (geo.roots[0] ** 2).item() != pytest.approx(1 / (math.sqrt(0.0891 / bc2) + 1e-8), rel=1e-4)
    group, state = opt.param_groups[0], opt.state[w]
    assert adam_denominator(group, state, torch.float64).item() == pytest.approx(expected, rel=1e-6)
    assert adam_denominator(group, {}) is None  # never stepped


def test_walk_stats_metric_is_validated() -> None:
    with pytest.raises(ContractError, match="metric"):
        WalkStats(loss=1.0, mu=1.0, sigma=0.0, lr=0.1, batch=8, metric="riemann")


# -- learning-rate scaling of merged updates --------------------------------------------------------
def test_merge_lr_factor_values() -> None:
    assert [merge_lr_factor(4, s) for s in ("none", "linear", "sqrt")] == [1.0, 4.0, 2.0]
    assert merge_lr_factor(1, "linear") == 1.0
    with pytest.raises(ContractError, match="merge_lr_scaling"):
        merge_lr_factor(2, "cubic")


def test_walk_prices_the_scaled_merged_step() -> None:
    """sigma = 0, s = 1, lr mu = 0.1 per step: two steps end at 0.8; one merged step with lr x 2 (linear)
    also ends at 0.8 (ratio 1), with lr x sqrt 2 at 1 - 0.1 sqrt 2."""
    args = (1.0, 10.0, 0.0, 0.01, 32, [2])
    assert convergence_ratio(*args) == pytest.approx(0.8 / 0.9)
    assert convergence_ratio(*args, merge_lr_scaling="linear") == pytest.approx(1.0)
    assert convergence_ratio(*args, merge_lr_scaling="sqrt") == pytest.approx(0.8 / (1 - 0.1 * math.sqrt(2)))
    assert schedule_ratio(schedule_with((2,)), WalkStats(1.0, 10.0, 0.0, 0.01, 32), "linear") == pytest.approx(1.0)


def test_merged_step_scales_lr_exactly_once_and_restores_it() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    w.grad = torch.tensor([0.5])
    with merged_lr(opt, 4, "sqrt") as factor:
        assert factor == 2.0 and opt.param_groups[0]["lr"] == pytest.approx(0.2)
        opt.step()
    assert w.item() == pytest.approx(1.0 - 0.1 * 2.0 * 0.5)  # 0.9
    assert opt.param_groups[0]["lr"] == 0.1
    sched.step()  # the scheduler sees (and sets) its own values
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    w.grad = torch.tensor([0.5])
    with merged_lr(opt, 1, "linear"):  # a single iteration is never scaled
        opt.step()
    assert w.item() == pytest.approx(0.9 - 0.05 * 0.5)


def test_scale_lr_restores_a_tensor_lr_object() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    lr = torch.tensor(0.01)
    opt = torch.optim.Adam([w], lr=lr)
    saved = scale_lr(opt, 3.0)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.03)
    restore_lr(opt, saved)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.01)
    assert scale_lr(opt, 1.0) is None


def test_merge_lr_scaling_config(tmp_path: Path) -> None:
    path = tmp_path / "deft.toml"
    path.write_text('merge_lr_scaling = "sqrt"\n')
    assert DeftConfig.load(path).merge_lr_scaling == "sqrt"
    assert DeftConfig().merge_lr_scaling == "none"
    for text in ('merge_lr_scaling = "cubic"', "merge_lr_scaling = 2"):
        path.write_text(text + "\n")
        with pytest.raises(ContractError) as e:
            DeftConfig.load(path)
        assert str(path) in str(e.value) and "merge_lr_scaling" in str(e.value)
    with pytest.raises(ContractError, match="merge_lr_scaling: expected one of none, linear, sqrt"):
        DeftConfig(merge_lr_scaling="linear ")


# -- the runtime's side (two gloo ranks) -------------------------------------------------------------
def merged_lr_worker(rank: int, world: int, schedule_path: str) -> dict[str, object]:
    import deft
    from tests.test_runtime_delayed import ITERS, LR, MOMENTUM, Linear, coefficients

    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ddp = deft.DistributedDataParallel(model, config={
        "epsilon": 0.1, "warmup_iters": 1, "schedule_path": schedule_path, "timeout_s": 30,
        "merge_lr_scaling": "linear", "links": [{"name": "primary"}, {"name": "second"}]})
    lrs = []
    for t in range(ITERS):
        ddp(coefficients(rank, t)).backward()
        opt.step()
        lrs.append(opt.param_groups[0]["lr"])  # after every step, merged or not: the user's lr
        opt.zero_grad()
    ddp.flush()
    return {"log": [[t, list(its)] for t, its in ddp.update_log], "lrs": lrs,
            "params": {n: p.detach().double().tolist() for n, p in model.named_parameters()}}


@pytest.mark.slow
def test_runtime_steps_merged_updates_with_the_scaled_lr(tmp_path: Path) -> None:
    """The delayed schedule of tests/test_runtime_delayed.py merges pairs; with merge_lr_scaling = "linear"
    each merged step moves by 2 x lr x the momentum buffer (closed form), single ones by lr, and the
    param group's lr reads LR after every step."""
    from tests._closed_form import sgd_replay
    from tests._dist import run_ranks, values
    from tests.test_runtime_delayed import LR, MOMENTUM, SHAPES, coefficients, delayed_schedule

    path = tmp_path / "schedule.json"
    delayed_schedule().save(path)
    out = values(run_ranks(merged_lr_worker, 2, (str(path),), timeout=120))
    log = out[0]["log"]
    assert [tuple(its) for _, its in log] == [(0,), (1, 2), (3, 4), (5, 6), (7, 8), (9,)]
    assert out[0]["lrs"] == [LR] * len(out[0]["lrs"])
    shapes = {n: shape for n, (shape, _) in SHAPES.items()}
    scaled = sgd_replay(log, 2, shapes, coefficients, LR, MOMENTUM, lr_factor=float)
    plain = sgd_replay(log, 2, shapes, coefficients, LR, MOMENTUM)
    for n, (_, dtype) in SHAPES.items():
        got = torch.tensor(out[0]["params"][n], dtype=torch.float64)
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, scaled[n], rtol=0, atol=tol)
        assert not torch.allclose(got, plain[n], rtol=0, atol=10 * tol)
        assert out[1]["params"][n] == out[0]["params"][n]


def grad_stats_worker(rank: int, world: int, delta: float) -> dict[str, object]:
    from deft.runtime.buckets import FlatLayout
    from deft.runtime.grad_stats import GradStats

    w = torch.nn.Parameter(torch.zeros(N))
    opt = torch.optim.Adam([w], lr=0.003, betas=(0.9, 0.99), eps=1e-8)
    layout = FlatLayout([0], ["w"], [w], [N])
    stats = GradStats()

    def measure(local: torch.Tensor, mean: torch.Tensor) -> None:
        stats.refresh(layout, [w], opt)
        buffers = layout.new_buffers(torch.device("cpu"))
        layout.param_view(buffers, 0).copy_(local)
        stats.bucket(0, 0, layout.bucket_views(buffers, 0), 16, 1)
        stats.update(0, layout, [mean], None, torch.device("cpu"))

    first = torch.full((N,), 0.01)
    measure(first, first)  # before Adam's first step: Euclidean
    before = stats.estimate()
    w.grad = first.clone()
    opt.step()
    sign = 1.0 if rank == 0 else -1.0
    measure(torch.full((N,), 0.01 + sign * delta), torch.full((N,), 0.01))
    est = stats.estimate()
    return {"metric_before": "euclidean" if before is not None else None, "metric": stats.geometry.metric,
            "mu_before": before.mu, "mu": est.mu, "trace": est.trace, "raw_trace": stats.raw_trace(),
            "steps": est.steps}


@pytest.mark.slow
def test_runtime_grad_stats_measure_in_adams_metric() -> None:
    """Two ranks (R = 2), 100 elements at 0.01 ± d, per-rank batch b = 16, then P = 100 per element
    (module docstring). In Adam's metric every element is scaled by sqrt(P) = 10:
    A_P = mean_r |g_r|²_P = 100 x 100 x (1e-4 + d²), G_P = |ḡ|²_P = 100 x 100 x 1e-4, so
    mu_P = (R G_P - A_P) / (R - 1) = 100 x 100 x (1e-4 - d²) and tr(PΣ) = b R (A_P - G_P) / (R - 1)
    = 16 x 2 x 100 x 100 d²; the raw tr Σ (the secant's correction) is 16 x 2 x 100 d². The Euclidean
    step measured before Adam's first step (|g|² = 100 x 1e-4) is dropped when the metric changes."""
    from tests._dist import run_ranks, values

    d = 1e-3
    out = values(run_ranks(grad_stats_worker, 2, (d,), timeout=120))
    for v in out:
        assert v["mu_before"] == pytest.approx(N * 1e-4, rel=1e-5)  # Euclidean |g|² before the first step
        assert v["metric"] == "adam"
        assert v["steps"] == pytest.approx(1.0)  # restarted: only the step measured in Adam's metric
        assert v["mu"] == pytest.approx(N * 100 * (1e-4 - d * d), rel=1e-4)
        assert v["trace"] == pytest.approx(16 * 2 * N * 100 * d * d, rel=1e-3)
        assert v["raw_trace"] == pytest.approx(16 * 2 * N * d * d, rel=1e-3)
