"""The compute's drift between the profile iterations and those run while rank 0 plans
(:mod:`deft.runtime.compute_drift`): the reduction by hand, and two ranks whose compute drops after the
profile iterations (the first plan priced on the drifted compute) or stays (priced as profiled)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from deft.runtime.compute_drift import ComputeClock, drift, wants_another
from tests._dist import run_ranks, slow_first_planner, values


def test_drift_is_the_ratio_of_the_lag_and_profile_medians_of_the_slowest_ranks_compute() -> None:
    # profile: 2.0 and 2.4 timed, one iteration timed on no rank (0.0): median 2.2; lag: 1.5, 1.6, 1.7 and
    # one slow iteration (5.0): median (1.6 + 1.7) / 2 = 1.65; g = 1.65 / 2.2 = 0.75, beyond 0.1
    d = drift([2.0, 0.0, 2.4], [1.5, 1.6, 5.0, 1.7], tolerance=0.1, min_samples=3)
    assert d is not None
    assert (d.profile_s, d.lag_s, d.samples, d.applied) == (pytest.approx(2.2), pytest.approx(1.65), 4, True)
    assert d.factor == pytest.approx(0.75)


def test_a_drift_within_the_tolerance_is_recorded_not_applied() -> None:
    d = drift([2.0, 2.0, 2.0], [2.1, 2.1, 2.1], tolerance=0.1, min_samples=3)  # g = 1.05
    assert d is not None and d.factor == pytest.approx(1.05) and not d.applied



def test_a_slowdown_is_recorded_not_applied() -> None:
    # g = 1.25, beyond the tolerance and the profile's spread: rank 0's planner ran beside the lag
    # iterations and may be all of it (compute_drift's Note)
    slower = drift([2.0, 1.9, 2.1], [2.5, 2.5, 2.5], tolerance=0.1, min_samples=3)
    assert slower is not None and slower.factor == pytest.approx(1.25) and not slower.applied


def test_a_drift_within_the_profile_iterations_own_spread_is_not_applied() -> None:
    # profile 1.0, 2.0, 1.5 (median 1.5), lag 1.2 and 1.1 (median 1.15): g = 0.767, beyond 0.1, but the lag's
    # median is no faster than the profile's fastest iteration (1.0): chance, not drift
    d = drift([1.0, 2.0, 1.5], [1.2, 1.1], tolerance=0.1)
    assert d is not None and d.factor == pytest.approx(1.15 / 1.5) and not d.applied
    # the lag's median below the fastest profile iteration: applied, one slow lag iteration or not
    d = drift([1.0, 2.0, 1.5], [0.9, 0.95, 3.0], tolerance=0.1)
    assert d is not None and d.applied


def test_too_few_lag_iterations_or_no_profile_iteration_read_no_drift() -> None:
    assert drift([2.0, 2.0], [1.0, 1.0, 0.0], tolerance=0.1, min_samples=3) is None
    assert drift([0.0, 0.0], [1.0, 1.0, 1.0], tolerance=0.1, min_samples=3) is None
    # by default two lag iterations are enough (a plan is often collected after two), one is not
    two = drift([2.0], [1.0, 1.2], tolerance=0.1)
    assert two is not None and two.factor == pytest.approx(0.55) and two.to_dict()["lag_iterations_s"] == [1.0, 1.2]
    assert drift([2.0], [1.0, 0.0], tolerance=0.1) is None


def test_one_lag_iteration_that_reads_a_speed_up_asks_for_a_second_reading() -> None:
    # one lag iteration 1.0 against a profile of 2.0, 1.9, 2.1: a speed-up the rule would apply
    assert wants_another([2.0, 1.9, 2.1], [1.0], tolerance=0.1)
    # 1.2 against 1.0, 2.0, 1.5: within the profile's spread, which the two readings then judge
    assert wants_another([1.0, 2.0, 1.5], [1.2], tolerance=0.1)
    # ... a slowdown, or one within the tolerance: nothing two readings could apply, no hold
    assert not wants_another([2.0, 1.9, 2.1], [2.5], tolerance=0.1)
    assert not wants_another([2.0, 1.9, 2.1], [1.95], tolerance=0.1)
    # two readings are the drift's own (no hold); none timed, or no profile iteration: nothing to hold for
    assert not wants_another([2.0, 1.9, 2.1], [1.0, 1.0], tolerance=0.1)
    assert not wants_another([2.0, 1.9, 2.1], [0.0], tolerance=0.1)
    assert not wants_another([0.0], [1.0], tolerance=0.1)


def test_the_clock_times_an_iteration_from_its_forward_to_its_last_autograd_pass() -> None:
    clock = ComputeClock()
    clock.backward_ends(0.5)  # no forward began: nothing timed
    clock.forward(4, 10.0)
    clock.backward_ends(10.3)  # a micro-batch's pass
    clock.backward_ends(10.7)  # the iteration's last
    clock.forward(5, 11.0)
    clock.backward_ends(11.2)
    assert clock.row([3, 4, 5]) == [0.0, pytest.approx(0.7), pytest.approx(0.2)]


# -- two ranks ------------------------------------------------------------------------------------------
PROFILED = (1, 2, 3)  # warmup_iters 1, profile_iters 3
PLAN_AT = 4  # the first lag iteration
ITERS = 18  # the plan collected at iteration 10 (6 lag iterations), its first window 10-15


class Sleepy(nn.Module):
    """A small MLP whose forward also sleeps ``delay`` seconds: compute the loop slows or speeds up."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 4))
        self.delay = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        out: torch.Tensor = self.net(x)
        return out


def drift_worker(rank: int, world: int, profiled_s: float, later_s: float, planner_s: float = 2.0,
                 pause_s: float = 0.0, lag_iters: int = 6) -> dict[str, Any]:
    """``planner_s``: rank 0's planner sleeps first (2 s: the six lag iterations all run before the plan
    is collected); ``pause_s``: the loop pauses after the last profile iteration's step, where rank 0's
    plan began (an evaluation), so that a quick plan is done after the first lag iteration;
    ``lag_iters``: ``plan_lag_iters``, the plan collected at that many lag iterations at the latest."""
    import deft

    slow_first_planner(rank, planner_s)
    torch.manual_seed(0)
    model = Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = deft.DistributedDataParallel(model, config={
        "epsilon": 0.0, "warmup_iters": 1, "profile_iters": 3, "plan_lag_iters": lag_iters, "adapt_window": 6,
        "timeout_s": 60})
    g = torch.Generator().manual_seed(rank)
    for t in range(ITERS):
        model.delay = profiled_s if t in PROFILED else later_s
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        if t == PROFILED[-1]:
            time.sleep(pause_s)
    ddp.flush()
    return {"plan": ddp.plan_info}


@pytest.mark.slow
def test_compute_faster_after_the_profile_prices_the_first_plan_on_the_lag_iterations_compute() -> None:
    """0.4 s of sleep in each profile iteration's forward, 0.1 s after: ``g`` about 0.25 (the MLP's own
    compute is milliseconds), and the plan's price moves towards what its first window measures."""
    plan = values(run_ranks(drift_worker, 2, (0.4, 0.1), timeout=180))[0]["plan"]
    found = plan["compute_drift"]
    assert found["applied"] is True and found["lag_samples"] == 6, found
    assert 0.15 < found["factor"] < 0.45, found
    first = plan["adapt"][0]
    before, priced, measured = found["predicted_before_s"], first["predicted_s"], first["measured_s"]
    assert priced < 0.6 * before, (priced, before)
    assert abs(priced - measured) < abs(before - measured), (priced, before, measured)


@pytest.mark.slow
def test_compute_as_profiled_keeps_the_first_plans_price() -> None:
    """0.2 s of sleep in every forward: ``g`` near 1, within the tolerance, recorded and not applied."""
    plan = values(run_ranks(drift_worker, 2, (0.2, 0.2), timeout=180))[0]["plan"]
    found = plan["compute_drift"]
    assert found["applied"] is False and "predicted_before_s" not in found, found
    assert 0.9 < found["factor"] < 1.1, found


@pytest.mark.slow
def test_a_plan_done_after_one_faster_lag_iteration_waits_for_the_second_reading() -> None:
    """A pause after the profile iterations gives the planner its time: the plan is done after one lag
    iteration, which reads a speed-up (0.4 s of sleep profiled, 0.1 s after), so the plan is collected
    after two and priced on both."""
    plan = values(run_ranks(drift_worker, 2, (0.4, 0.1, 0.0, 3.0), timeout=180))[0]["plan"]
    found = plan["compute_drift"]
    assert plan["t0"] == PLAN_AT + 2, plan["t0"]
    assert found["lag_samples"] == 2 and found["applied"] is True, found
    assert 0.15 < found["factor"] < 0.45, found


@pytest.mark.slow
def test_a_plan_done_after_one_slower_lag_iteration_is_installed_at_once() -> None:
    """As above with the compute slower after the profile (0.1 s, then 0.4 s): a slowdown is not applied,
    so the plan is not held for a second reading: installed after the one lag iteration, no drift read."""
    plan = values(run_ranks(drift_worker, 2, (0.1, 0.4, 0.0, 3.0), timeout=180))[0]["plan"]
    assert plan["t0"] == PLAN_AT + 1, plan["t0"]
    assert "compute_drift" not in plan, plan["compute_drift"]


@pytest.mark.slow
def test_a_plan_due_after_one_lag_iteration_is_not_held_past_it() -> None:
    """As the faster case, with ``plan_lag_iters = 1``: the one lag iteration is the plan's due one, so the
    plan is installed there, not held for a second reading past it; no drift is read from one."""
    plan = values(run_ranks(drift_worker, 2, (0.4, 0.1, 0.0, 3.0, 1), timeout=180))[0]["plan"]
    assert plan["t0"] == PLAN_AT + 1, plan["t0"]
    assert "compute_drift" not in plan, plan["compute_drift"]
