"""Python's GIL switch interval held short while deft's threads need the GIL (deft.runtime.switch_interval):
the shortest hold wins, the caller's own comes back after the last; a scheduled run with gloo links holds
``switch_interval_ms`` until ``close()``, and 0 (the default) leaves Python's own."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from deft.config import DeftConfig
from deft.errors import ContractError
from deft.runtime.switch_interval import SwitchInterval
from tests._dist import run_ranks, values


@pytest.fixture
def caller_interval() -> Iterator[float]:
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    yield 0.004
    sys.setswitchinterval(saved)


def test_the_shortest_hold_wins_and_the_callers_interval_comes_back(caller_interval: float) -> None:
    s = SwitchInterval()
    a = s.hold(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001, abs=2e-6)
    b = s.hold(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005, abs=2e-6)
    s.release(b)
    assert sys.getswitchinterval() == pytest.approx(0.001, abs=2e-6)  # a still holds
    s.release(a)
    assert sys.getswitchinterval() == pytest.approx(caller_interval, abs=2e-6)
    s.release(a)  # twice: nothing
    assert sys.getswitchinterval() == pytest.approx(caller_interval, abs=2e-6)


def test_holding_releases_on_leaving_the_block_even_by_an_error(caller_interval: float) -> None:
    s = SwitchInterval()
    with pytest.raises(RuntimeError, match="planner failed"), s.holding(0.0005):
        assert sys.getswitchinterval() == pytest.approx(0.0005, abs=2e-6)
        raise RuntimeError("planner failed")
    assert sys.getswitchinterval() == pytest.approx(caller_interval, abs=2e-6)


def test_a_hold_never_lengthens_the_callers_interval(caller_interval: float) -> None:
    s = SwitchInterval()
    token = s.hold(0.005)  # longer than the caller's 4 ms
    assert sys.getswitchinterval() == pytest.approx(caller_interval, abs=2e-6)
    s.release(token)
    assert sys.getswitchinterval() == pytest.approx(caller_interval, abs=2e-6)


def test_a_switch_interval_out_of_range_is_refused_by_name() -> None:
    with pytest.raises(ContractError, match=r"switch_interval_ms: expected a number of milliseconds in \[0, 5\]"):
        DeftConfig.from_dict({"switch_interval_ms": -1.0})
    assert DeftConfig().switch_interval_ms == 0.0  # opt-in: Python's own unless asked for


def _intervals(rank: int, world: int, ms: float) -> dict[str, Any]:
    import deft

    before = sys.getswitchinterval()
    model = nn.Linear(8, 4)
    # plan_lag_iters 0: no planner thread, whose own hold would outlive close() until it has planned
    ddp = deft.DistributedDataParallel(model, config={"switch_interval_ms": ms, "warmup_iters": 1,
                                                      "profile_iters": 2, "plan_lag_iters": 0})
    during = sys.getswitchinterval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        ddp(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    ddp.flush()
    ddp.close()
    return {"before": before, "during": during, "after": sys.getswitchinterval()}


@pytest.mark.slow
@pytest.mark.parametrize("ms", [0.5, 0.0])
def test_a_scheduled_run_on_gloo_holds_its_interval_until_close(ms: float) -> None:
    for r in values(run_ranks(_intervals, world=2, args=(ms,), timeout=90)):
        assert r["before"] == pytest.approx(0.005, abs=2e-6), r  # Python's own
        assert r["during"] == pytest.approx(ms / 1000 if ms else 0.005, abs=2e-6), r
        assert r["after"] == pytest.approx(0.005, abs=2e-6), r
