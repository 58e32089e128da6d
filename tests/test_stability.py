"""The delayed-update recurrence's spectral radius, against closed forms and torch's own optimizers.

Expected values are derived by hand (module docstring of deft.preserver.stability and below) or
measured by a second method: iterating torch.optim.SGD / Adam / AdamW on one scalar parameter whose
gradient is ``lam * w`` at the point where each iteration computed it, with the gradients queued and
applied exactly when ``Schedule.updates_due`` says, and reading the growth rate off the iterates.

Delayed GD with delay ``d`` (``w_{t+1} = w_t - h w_{t-d}``): on the unit circle ``z = e^{iθ}`` the
characteristic equation ``z^d (z - 1) = -h`` needs ``|z - 1| = h``, i.e. ``h = 2 sin(θ/2)``, and
``dθ + arg(z - 1) = π`` with ``arg(e^{iθ} - 1) = π/2 + θ/2``, so ``θ = π / (2d + 1)``: the edge is
``h = 2 sin(π / (2 (2d + 1)))`` (2, 1, 0.618…, …).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq

from deft.errors import ContractError
from deft.preserver.stability import (
    DEFAULT_MARGIN,
    AppliedUpdate,
    OptimizerSpec,
    applied_updates,
    check_stability,
    cycle_radius,
    delayed_plan,
    is_stable,
    schedule_radius,
    stability_edge,
    transfer_matrix,
)
from deft.schedule import Schedule, synchronous_schedule, update_pattern_schedule

NO_DELAY = synchronous_schedule((1,), (4,), ("l0",))
MERGED_2 = update_pattern_schedule(2, [((0, 1), 1)])  # K = [2], lag-free
LATE_1 = update_pattern_schedule(2, [((0,), 1), ((1,), 2)])  # K = [1, 1], each update one iteration late
LATE_121 = update_pattern_schedule(4, [((0,), 1), ((1, 2), 3), ((3,), 4)])  # K = [1, 2, 1], one iteration late
LATE_2 = update_pattern_schedule(3, [((0,), 2), ((1,), 3), ((2,), 4)])  # K = [1, 1, 1], two iterations late
SCHEDULES = {"no delay": NO_DELAY, "K=[2]": MERGED_2, "late 1": LATE_1, "K=[1,2,1] late": LATE_121,
             "late 2": LATE_2}


# -- the schedule -> delay mapping ------------------------------------------------------------------
def test_mapping_no_delay() -> None:
    assert applied_updates(NO_DELAY) == ((AppliedUpdate(lags=(0,), group=0),),)


def test_mapping_merged_lag_free() -> None:
    # Nothing after position 0; after position 1 the pair: position 0's gradient 1 iteration old, 1's fresh.
    plan = applied_updates(MERGED_2)
    assert plan == ((), (AppliedUpdate(lags=(1, 0), group=0),))
    assert plan[1][0].staleness == 0 and plan[1][0].k == 2


def test_mapping_one_iteration_late() -> None:
    # After position 0: the previous cycle's group 1 (position 1, apply_after 2 = next cycle's 0): 1 late.
    plan = applied_updates(LATE_1)
    assert plan == ((AppliedUpdate(lags=(1,), group=1),), (AppliedUpdate(lags=(1,), group=0),))
    assert all(u.staleness == 1 for due in plan for u in due)


def test_mapping_merged_and_late() -> None:
    plan = applied_updates(LATE_121)
    assert plan == ((AppliedUpdate(lags=(1,), group=2),), (AppliedUpdate(lags=(1,), group=0),), (),
                    (AppliedUpdate(lags=(2, 1), group=1),))


def test_delayed_plan_matches_a_schedule_with_the_same_delays() -> None:
    spec = OptimizerSpec.sgd(0.1, momentum=0.9)
    for lam in (0.5, 1.0, 3.0):
        assert cycle_radius(delayed_plan(1), lam, spec) == pytest.approx(schedule_radius(LATE_1, lam, spec), rel=1e-12)
        assert cycle_radius(delayed_plan(2), lam, spec) == pytest.approx(schedule_radius(LATE_2, lam, spec), rel=1e-12)
        assert cycle_radius(delayed_plan(0, k=2), lam, spec) == pytest.approx(
            schedule_radius(MERGED_2, lam, spec), rel=1e-12)


# -- closed forms ---------------------------------------------------------------------------------
GD = OptimizerSpec.sgd(1.0)  # step 1: h = lam


@pytest.mark.parametrize("h", [0.3, 1.0, 1.5, 2.5])
def test_gd_no_delay_radius(h: float) -> None:
    assert schedule_radius(NO_DELAY, h, GD) == pytest.approx(abs(1 - h), rel=1e-12)


@pytest.mark.parametrize("h", [0.1, 0.25, 0.5, 0.99, 1.0, 1.5])
def test_delayed_gd_radius_by_hand(h: float) -> None:
    # z² - z + h = 0: real roots (1 ± √(1-4h))/2 for h <= 1/4, else |z| = √h.
    expected = (1 + math.sqrt(1 - 4 * h)) / 2 if h <= 0.25 else math.sqrt(h)
    assert schedule_radius(LATE_1, h, GD) == pytest.approx(expected, rel=1e-7)
    assert (schedule_radius(LATE_1, h, GD) < 1) == (h < 1)


@pytest.mark.parametrize("d", [0, 1, 2, 3, 4])
def test_delayed_gd_edge(d: int) -> None:
    assert stability_edge(delayed_plan(d), GD) == pytest.approx(2 * math.sin(math.pi / (2 * (2 * d + 1))), rel=1e-9)


@pytest.mark.parametrize("beta", [0.5, 0.9, 0.99])
def test_heavy_ball_no_delay(beta: float) -> None:
    spec = OptimizerSpec.sgd(1.0, momentum=beta)
    lo, hi = (1 - math.sqrt(beta)) ** 2, (1 + math.sqrt(beta)) ** 2
    for h in np.linspace(lo, hi, 7)[1:-1]:  # complex roots: |z| = √β
        assert schedule_radius(NO_DELAY, h, spec) == pytest.approx(math.sqrt(beta), rel=1e-9)
    h = 2 * (1 + beta) + 0.5  # real roots beyond the edge: the quadratic formula
    b = 1 + beta - h
    assert schedule_radius(NO_DELAY, h, spec) == pytest.approx((abs(b) + math.sqrt(b * b - 4 * beta)) / 2, rel=1e-9)
    edge = 2 * (1 + beta)
    assert stability_edge(NO_DELAY, spec) == pytest.approx(edge, rel=1e-9)
    assert schedule_radius(NO_DELAY, edge * (1 - 1e-3), spec) < 1 < schedule_radius(NO_DELAY, edge * (1 + 1e-3), spec)


@pytest.mark.parametrize("beta", [0.5, 0.9, 0.99])
def test_heavy_ball_one_iteration_late(beta: float) -> None:
    # z² - (1+β) z + (β+h) = 0: complex for h > (1-β)²/4 with |z|² = β + h; edge h = 1 - β.
    spec = OptimizerSpec.sgd(1.0, momentum=beta)
    for h in ((1 - beta) ** 2 / 4 * 1.5, (1 - beta) / 2, 1 - beta, 2 * (1 - beta)):
        assert schedule_radius(LATE_1, h, spec) == pytest.approx(math.sqrt(beta + h), rel=1e-7)
    assert stability_edge(LATE_1, spec) == pytest.approx(1 - beta, rel=1e-9)


def test_nesterov_no_delay_edge() -> None:
    # z² - (1+β)(1-h) z + β(1-h) = 0 (torch's Nesterov); the root z = -1 at h = 2(1+β)/(1+2β).
    for beta in (0.5, 0.9):
        spec = OptimizerSpec.sgd(1.0, momentum=beta, nesterov=True)
        assert stability_edge(NO_DELAY, spec) == pytest.approx(2 * (1 + beta) / (1 + 2 * beta), rel=1e-9)


def test_lag_free_merge_keeps_the_edge() -> None:
    for spec in (GD, OptimizerSpec.sgd(1.0, momentum=0.9)):
        assert stability_edge(MERGED_2, spec) == pytest.approx(stability_edge(NO_DELAY, spec), rel=1e-9)
    for h in (0.3, 1.7):  # one step of |1 - h| every 2 iterations
        assert schedule_radius(MERGED_2, h, GD) == pytest.approx(math.sqrt(abs(1 - h)), rel=1e-12)


def test_sgd_weight_decay_on_current_parameters() -> None:
    # w_{t+1} = w_t - eta (lam w_{t-1} + wd w_t):  z² - (1 - eta wd) z + eta lam = 0.
    eta, wd, lam = 0.1, 0.5, 4.0
    spec = OptimizerSpec.sgd(eta, weight_decay=wd)
    b, c = 1 - eta * wd, eta * lam
    disc = b * b - 4 * c
    expected = math.sqrt(c) if disc < 0 else (abs(b) + math.sqrt(disc)) / 2
    assert schedule_radius(LATE_1, lam, spec) == pytest.approx(expected, rel=1e-9)


def test_adam_is_heavy_ball_in_ema_form() -> None:
    # m ← β₁m + (1-β₁) lam w, w ← w - P m: heavy ball with step P(1-β₁), momentum β₁.
    beta1, p = 0.9, 1.0
    spec = OptimizerSpec.adam(lr=1.0, beta1=beta1, scale=p)
    assert stability_edge(NO_DELAY, spec) == pytest.approx(2 * (1 + beta1) / (1 - beta1), rel=1e-9)
    assert stability_edge(LATE_1, spec) == pytest.approx(1.0, rel=1e-9)
    # AdamW without momentum: w' = (1 - lr wd) w - step lam w.
    lr, scale, wd, lam = 0.01, 30.0, 2.0, 1.5
    adamw = OptimizerSpec.adam(lr=lr, beta1=0.0, scale=scale, weight_decay=wd, decoupled_weight_decay=True)
    assert schedule_radius(NO_DELAY, lam, adamw) == pytest.approx(abs(1 - lr * wd - lr * scale * lam), rel=1e-12)


# -- a second method: torch's optimizers on the scalar recurrence ----------------------------------
def simulate(schedule: Schedule, lam: float, opt_factory, iters: int) -> np.ndarray:
    """|w_t| for ``iters`` iterations: gradients ``lam * w`` queued per (cycle, group), applied when due."""
    w = torch.ones(1, dtype=torch.float64, requires_grad=True)
    opt = opt_factory([w])
    pending: dict[tuple[int, int], list[torch.Tensor]] = {}
    out = np.empty(iters)
    for t in range(iters):
        c, p = divmod(t, schedule.cycle)
        pending.setdefault((c, schedule.group_of(p)), []).append(lam * w.detach().clone())
        for g, back in schedule.updates_due(p):
            grads = pending.pop((c - back, g), None)
            if grads is None:  # the first cycle has no previous-cycle group
                continue
            w.grad = torch.stack(grads).mean(0)
            opt.step()
        out[t] = abs(float(w.detach()))
    return out


def growth_rate(absw: np.ndarray, window: int = 480, gap: int = 960) -> float:
    """log growth per iteration from the RMS of two windows ``gap`` apart at the end.

    Both windows have the same length (a multiple of every cycle here), so ``ρ^t`` inside them cancels;
    what is left is phase: a dominant complex pair whose angle per cycle is near 0 or π beats slowly
    and the two windows catch different parts of the beat. Over the draws below that costs at most
    2e-4 (a K = [1, 2, 1] case beating every ~280 iterations); the tolerance is 3e-4 against
    ``|log ρ| >= 3e-3``.
    """
    a = absw[-window - gap:-gap]
    b = absw[-window:]
    return (math.log(math.sqrt(np.mean(b ** 2))) - math.log(math.sqrt(np.mean(a ** 2)))) / gap


def steady(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Adam state as after many steps: bias corrections 1 (the model's steady state, no start-up transient)."""
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {"step": torch.tensor(1e6), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
    return opt


TORCH_SPECS = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), OptimizerSpec.sgd(0.1)),
    "heavy ball": (lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9), OptimizerSpec.sgd(0.02, momentum=0.9)),
    "nesterov": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
                 OptimizerSpec.sgd(0.05, momentum=0.8, nesterov=True)),
    "dampened, decay": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.7, dampening=0.3, weight_decay=0.4),
                        OptimizerSpec.sgd(0.05, momentum=0.7, dampening=0.3, weight_decay=0.4)),
    # eps far above √v̂: the per-coordinate step is lr / eps (the linearisation's frozen v̂).
    "adam": (lambda ps: steady(torch.optim.Adam(ps, lr=0.01 * 1e20, betas=(0.9, 0.999), eps=1e20)),
             OptimizerSpec.adam(lr=0.01 * 1e20, beta1=0.9, scale=1e-20)),
    "adamw": (lambda ps: steady(torch.optim.AdamW(ps, lr=0.01 * 1e20, betas=(0.8, 0.999), eps=1e20,
                                                  weight_decay=1e-21)),
              OptimizerSpec.adam(lr=0.01 * 1e20, beta1=0.8, scale=1e-20, weight_decay=1e-21,
                                 decoupled_weight_decay=True)),
}


def curvature_with_radius(schedule: Schedule, spec: OptimizerSpec, target: float) -> float:
    """A curvature at which the radius is ``target`` (near 1, so 2400 iterations neither over- nor underflow)."""
    edge = stability_edge(schedule, spec)
    grid = edge * (np.linspace(0.05, 1.0, 400) if target < 1 else np.geomspace(1.0, 100.0, 400))
    radii = [schedule_radius(schedule, lam, spec) - target for lam in grid]
    i = next(i for i in range(len(grid) - 1) if radii[i] * radii[i + 1] <= 0)
    return brentq(lambda lam: schedule_radius(schedule, lam, spec) - target, grid[i], grid[i + 1])


@pytest.mark.slow  # 64 cases of 2400 torch optimizer steps each
@pytest.mark.parametrize("opt_name", sorted(TORCH_SPECS))
@pytest.mark.parametrize("sched_name", sorted(SCHEDULES))
@pytest.mark.parametrize("target", [0.99, 1.01])
def test_radius_matches_torch_optimizer_growth(opt_name: str, sched_name: str, target: float) -> None:
    factory, spec = TORCH_SPECS[opt_name]
    schedule = SCHEDULES[sched_name]
    lam = curvature_with_radius(schedule, spec, target)
    assert (lam < stability_edge(schedule, spec)) == (target < 1)
    rate = growth_rate(simulate(schedule, lam, factory, 2400))
    assert rate == pytest.approx(math.log(target), abs=3e-4)


@pytest.mark.slow
def test_monte_carlo_random_momentum_and_curvature() -> None:
    """Random (schedule, lr, momentum, Nesterov, radius) draws: torch SGD's growth rate is the radius's log."""
    rng = np.random.default_rng(12)
    names = sorted(SCHEDULES)
    for _ in range(25):
        schedule = SCHEDULES[names[rng.integers(len(names))]]
        lr, beta = float(rng.uniform(0.01, 0.1)), float(rng.uniform(0.0, 0.95))
        nesterov = bool(rng.integers(2)) and beta > 0
        spec = OptimizerSpec.sgd(lr, momentum=beta, nesterov=nesterov)
        target = float(rng.choice([-1, 1]) * rng.uniform(0.003, 0.015) + 1)
        lam = curvature_with_radius(schedule, spec, target)
        rate = growth_rate(simulate(
            schedule, lam, lambda ps, lr=lr, beta=beta, nesterov=nesterov: torch.optim.SGD(
                ps, lr=lr, momentum=beta, nesterov=nesterov), 2400))
        assert rate == pytest.approx(math.log(target), abs=3e-4), (schedule.batch_sequence, lr, beta, nesterov, lam)


# -- the decision ---------------------------------------------------------------------------------
def test_measured_setting_one_late_is_unstable_no_delay_is_not() -> None:
    # SGD lr 0.02 momentum 0.9: edges 2(1+β)/lr = 190 without delay, (1-β)/lr = 5 one iteration late.
    spec = OptimizerSpec.sgd(0.02, momentum=0.9)
    assert stability_edge(NO_DELAY, spec) == pytest.approx(190.0, rel=1e-9)
    assert stability_edge(LATE_1, spec) == pytest.approx(5.0, rel=1e-9)
    assert stability_edge(MERGED_2, spec) == pytest.approx(190.0, rel=1e-9)
    for lam in (20.0, 50.0):
        assert is_stable(NO_DELAY, lam, spec)
        assert is_stable(MERGED_2, lam, spec)
        assert not is_stable(LATE_1, lam, spec)
        assert not is_stable(LATE_121, lam, spec)


def test_margin_is_a_fraction_of_the_edge() -> None:
    spec = OptimizerSpec.sgd(1.0, momentum=0.9)  # one iteration late: edge 0.1
    below, above = check_stability(LATE_1, 0.049, spec), check_stability(LATE_1, 0.051, spec)
    assert below.stable and not above.stable
    assert below.edge == pytest.approx(0.1, rel=1e-9) and below.margin == DEFAULT_MARGIN == 0.5
    assert below.radius == pytest.approx(math.sqrt(0.9 + 0.049), rel=1e-7)
    assert is_stable(LATE_1, 0.09, spec, margin=0.95) and not is_stable(LATE_1, 0.096, spec, margin=0.95)
    assert check_stability(LATE_1, -3.0, spec).stable  # negative curvature: nothing to oscillate
    assert check_stability(LATE_1, 0.2, spec).to_dict()["stable"] is False


def test_lag_free_schedules_are_never_rejected_on_stability() -> None:
    # Near torch DDP's own edge (190 here) a margin would reject DDP itself; lag-free schedules share it.
    spec = OptimizerSpec.sgd(0.02, momentum=0.9)
    for sched in (NO_DELAY, MERGED_2):
        chk = check_stability(sched, 0.9 * 190.0, spec)
        assert chk.stable and chk.as_stable_as_ddp and chk.ddp_edge == pytest.approx(190.0, rel=1e-9)
        assert chk.radius < 1
        beyond = check_stability(sched, 1.1 * 190.0, spec)
        assert beyond.stable and beyond.radius > 1  # unstable, but no schedule would do better
    late = check_stability(LATE_1, 0.9 * 190.0, spec)
    assert not late.stable and not late.as_stable_as_ddp


def test_transfer_matrix_shape_and_zero_curvature() -> None:
    # State (w, w_{t-1}, w_{t-2}, b) for a largest lag of 2; lam = 0 leaves w alone (eigenvalue 1).
    t = transfer_matrix(applied_updates(LATE_121), 0.0, OptimizerSpec.sgd(0.1, momentum=0.5))
    assert t.shape == (4, 4)
    assert max(abs(np.linalg.eigvals(t))) == pytest.approx(1.0, abs=1e-12)


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "field"), [
    ({"kind": "rmsprop", "lr": 0.1}, "kind"),
    ({"kind": "sgd", "lr": 0.0}, "lr"),
    ({"kind": "sgd", "lr": 0.1, "momentum": 1.0}, "momentum"),
    ({"kind": "sgd", "lr": 0.1, "momentum": 0.9, "dampening": 0.1, "nesterov": True}, "nesterov"),
    ({"kind": "sgd", "lr": 0.1, "scale": 2.0}, "scale"),
    ({"kind": "sgd", "lr": 0.1, "decoupled_weight_decay": True}, "decoupled_weight_decay"),
    ({"kind": "adam", "lr": 0.1, "nesterov": True}, "nesterov"),
    ({"kind": "adam", "lr": float("nan")}, "lr"),
])
def test_bad_spec_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ContractError) as e:
        OptimizerSpec(**kwargs)
    assert e.value.field == field


def test_from_torch() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.3}], lr=0.1, momentum=0.9,
                          nesterov=True, weight_decay=1e-4)
    assert OptimizerSpec.from_torch(sgd) == OptimizerSpec.sgd(0.3, momentum=0.9, nesterov=True, weight_decay=1e-4)
    adamw = torch.optim.AdamW([a], lr=1e-3, betas=(0.8, 0.99), weight_decay=0.01)
    assert OptimizerSpec.from_torch(adamw, scale=5.0) == OptimizerSpec.adam(1e-3, 0.8, 5.0, 0.01, True)
    with pytest.raises(ContractError, match="RMSprop"):
        OptimizerSpec.from_torch(torch.optim.RMSprop([a], lr=0.1))
    mixed = torch.optim.SGD([{"params": [a], "momentum": 0.5}, {"params": [b]}], lr=0.1, momentum=0.9)
    with pytest.raises(ContractError) as e:
        OptimizerSpec.from_torch(mixed)
    assert e.value.field == "param_groups[1].momentum"


def test_bad_plans_and_arguments() -> None:
    with pytest.raises(ContractError) as e:
        AppliedUpdate(lags=(-1,))
    assert e.value.field == "lags"
    with pytest.raises(ContractError, match="never move"):
        cycle_radius(((), ()), 1.0, GD)
    with pytest.raises(ContractError) as e:
        delayed_plan(-1)
    assert e.value.field == "delay"
    with pytest.raises(ContractError) as e:
        check_stability(NO_DELAY, 1.0, GD, margin=1.5)
    assert e.value.field == "margin"
    with pytest.raises(ContractError) as e:
        schedule_radius(NO_DELAY, float("inf"), GD)
    assert e.value.field == "lam"


@pytest.mark.parametrize(("make", "field"), [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize"),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), "amsgrad"),
])
def test_optimizers_the_recurrence_does_not_model_are_refused(make: object, field: str) -> None:
    opt = make([torch.nn.Parameter(torch.zeros(2))])  # type: ignore[operator]
    with pytest.raises(ContractError, match=rf"param_groups\[0\]\.{field}"):
        OptimizerSpec.from_torch(opt)
