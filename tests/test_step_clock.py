"""The loop's own time per iteration (deft.runtime.step_clock), by hand."""

from __future__ import annotations

import pytest

from deft.runtime.step_clock import StepClock


def test_the_loops_work_between_deft_hooks_adds_up_per_iteration() -> None:
    c = StepClock()
    c.resume(3, 10.0)   # iteration 3's backward-end callback returns
    c.pause(10.5)       # the step's pre hook: 0.5 s of clipping
    c.resume(3, 11.0)   # the pre hook returns (1 s of deft's own work left out)
    c.pause(11.25)      # the post hook: the optimizer's own step
    c.resume(3, 12.0)
    c.pause(12.25)      # the next forward
    c.pause(13.0)       # a pause without a resume counts nothing
    assert c.row([2, 3, 4]) == [None, pytest.approx(1.0), None]
    c.resume(4, 14.0)
    c.pause(13.5)       # a clock read out of order counts nothing, never less than nothing
    assert c.row([4]) == [0.0]
