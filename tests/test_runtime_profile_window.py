"""The profile iterations' window (:mod:`deft.runtime.profile_window`): the settle rule by hand, the
calendar's slide, and two ranks whose compute settles only after the first profile iterations (the window
slides past them and the profile prices the settled compute) or is steady from the start (no slide)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from deft.config import DeftConfig
from deft.errors import ContractError
from deft.runtime.calendar import Calendar
from deft.runtime.profile_window import settled
from tests._dist import run_ranks, values


def test_a_window_whose_iterations_agree_with_their_median_is_settled() -> None:
    assert settled([1.0, 1.02, 0.99], tolerance=0.1)
    # one slow iteration moves neither the median nor the verdict
    assert settled([0.40, 0.90, 0.41], tolerance=0.1)


def test_two_of_three_iterations_apart_from_their_median_are_not_settled() -> None:
    # the CNN at 2 hosts x 2 ranks: median 1.03; 0.92 is 10.7 % under it, 1.33 29 % over
    assert not settled([0.92, 1.33, 1.03], tolerance=0.1)
    # a machine still speeding up: 1.33 and 1.03 both more than 10 % from 1.15
    assert not settled([1.33, 1.15, 1.03], tolerance=0.1)
    # the same spread within a wider tolerance
    assert settled([1.33, 1.15, 1.03], tolerance=0.2)


def test_a_spread_of_milliseconds_is_within_the_floor_and_untimed_iterations_are_left_out() -> None:
    assert settled([0.002, 0.009, 0.004], tolerance=0.1)  # every one within 10 ms of 4 ms
    assert not settled([0.002, 0.009, 0.004], tolerance=0.1, floor_s=0.001)
    assert settled([0.0, 1.0, 1.05], tolerance=0.1)
    assert settled([], tolerance=0.1) and settled([0.0, 0.0], tolerance=0.1)


def test_the_calendar_slides_by_one_iteration_and_keeps_its_statistics_window() -> None:
    cal = Calendar(warm_end=1, plan_at=4, stats_window=(0, 4))
    assert cal.slid() == Calendar(warm_end=2, plan_at=5, stats_window=(0, 4))
    assert cal.slid().profiling(4) and not cal.slid().profiling(1)


def test_a_negative_number_of_slides_is_refused() -> None:
    with pytest.raises(ContractError, match="profile_settle_iters"):
        DeftConfig(profile_settle_iters=-1)


# -- two ranks ------------------------------------------------------------------------------------------
ITERS = 12


class Sleepy(nn.Module):
    """A small MLP whose forward also sleeps ``delay`` seconds: compute the loop sets per iteration."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 4))
        self.delay = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        out: torch.Tensor = self.net(x)
        return out


def window_worker(rank: int, world: int, delays: tuple[float, ...], settle_iters: int = 6) -> dict[str, Any]:
    """Iteration ``t`` sleeps ``delays[t]`` (the last one after them); warm-up 1, profile 3, the plan made
    at once (``plan_lag_iters = 0``): it runs from the iteration after the window's last."""
    import deft

    torch.manual_seed(0)
    model = Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = deft.DistributedDataParallel(model, config={
        "epsilon": 0.0, "warmup_iters": 1, "profile_iters": 3, "plan_lag_iters": 0, "adapt": False,
        "profile_settle_iters": settle_iters, "timeout_s": 60})
    g = torch.Generator().manual_seed(rank)
    for t in range(ITERS):
        model.delay = delays[min(t, len(delays) - 1)]
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    ddp.flush()
    profile = ddp.profile
    assert profile is not None
    return {"plan": ddp.plan_info, "forward_s": profile.forward_s}


SETTLING = (0.05, 0.40, 0.25, 0.10, 0.10)  # profile iterations 1-3 speed up; steady from iteration 3


@pytest.mark.slow
def test_a_profile_whose_compute_settles_late_slides_past_its_first_iterations() -> None:
    """Profile iterations 1-3 sleep 0.40, 0.25, 0.10 s (two of three far from their median): the window
    slides once, to iterations 2-4 (0.25, 0.10, 0.10: settled), the plan runs from iteration 5, and the
    profile's forward is the settled iterations' (about 0.1 s), not the first window's median (0.25 s)."""
    out = values(run_ranks(window_worker, 2, (SETTLING,), timeout=180))
    plan = out[0]["plan"]
    assert plan["t0"] == 5, plan["t0"]
    window = plan["profile_window"]
    assert window["slides"] == 1 and len(window["compute_s"]) == 2, window
    assert 0.08 < out[0]["forward_s"] < 0.18, out[0]["forward_s"]
    assert out[0]["plan"]["t0"] == out[1]["plan"]["t0"]


@pytest.mark.slow
def test_a_steady_profile_does_not_slide_nor_does_one_with_slides_turned_off() -> None:
    """0.1 s of sleep in every forward: settled at the first reading (its one reading recorded), the plan
    from iteration 4; the settling compute above with ``profile_settle_iters = 0``: no window read, no
    slide, its profile priced on the three first iterations (their median forward, about 0.25 s)."""
    steady = values(run_ranks(window_worker, 2, ((0.1,),), timeout=180))[0]
    assert steady["plan"]["t0"] == 4 and steady["plan"]["profile_window"]["slides"] == 0, steady["plan"]
    assert len(steady["plan"]["profile_window"]["compute_s"]) == 1
    off = values(run_ranks(window_worker, 2, (SETTLING, 0), timeout=180))[0]
    assert off["plan"]["t0"] == 4 and "profile_window" not in off["plan"], off["plan"]
    assert 0.2 < off["forward_s"] < 0.32, off["forward_s"]
