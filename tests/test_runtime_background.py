"""Planning in the background (config.plan_lag_iters; deft.runtime.background.Background).

The collective side (every rank switches at the same iteration, rank 0's planning seconds recorded)
is checked end to end in tests/test_runtime_planned.py and tests/test_runtime_adapt.py; here the
thread wrapper's contract: the document comes back, an exception comes back as a document.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest

from deft.config import DeftConfig
from deft.errors import ContractError
from deft.runtime.background import SWITCH_INTERVAL_S, Background


def test_background_returns_the_document_computed_on_another_thread() -> None:
    release = threading.Event()
    seen: list[str] = []

    def decide() -> dict[str, object]:
        seen.append(threading.current_thread().name)
        release.wait(10)
        return {"schedule": "s"}

    job = Background(decide, "deft-planner-test")
    assert not job.done()  # the constructor returned while decide() waits on its own thread
    release.set()
    doc, _ = job.result()
    assert job.done() and doc == {"schedule": "s"} and seen == ["deft-planner-test"]
    assert job.seconds > 0


def test_an_exception_in_the_background_comes_back_as_an_error_document() -> None:
    def decide() -> dict[str, object]:
        raise ValueError("the knapsack is on fire")

    doc, _ = Background(decide, "deft-planner-test").result()
    assert doc == {"error": "ValueError: the knapsack is on fire"}


def test_a_base_exception_in_the_background_still_comes_back_as_an_error_document() -> None:
    class Stop(BaseException):  # not an Exception: it would end the thread without a document
        pass

    def decide() -> dict[str, object]:
        raise Stop("the thread was told to stop")

    job = Background(decide, "deft-planner-test")
    doc, _ = job.result()
    assert doc == {"error": "Stop: the thread was told to stop"} and job.done()


def test_the_switch_interval_is_short_while_any_job_runs_and_the_callers_afterwards() -> None:
    """The training thread takes the GIL back after every torch operation: while a job runs Python it
    waits at most the shortened interval. Overlapping jobs (the solver's preload and the first plan)
    keep it short until the last ends; a job that fails restores it too."""
    before = sys.getswitchinterval()
    assert before > SWITCH_INTERVAL_S  # Python's default (5 ms): the test would prove nothing otherwise
    release_a, release_b = threading.Event(), threading.Event()
    seen: dict[str, float] = {}

    def job_a() -> dict[str, object]:
        seen["a"] = sys.getswitchinterval()
        release_a.wait(10)
        seen["a_after_b"] = sys.getswitchinterval()
        return {}

    def job_b() -> dict[str, object]:
        seen["b"] = sys.getswitchinterval()
        release_b.wait(10)
        raise ValueError("b fails")

    a = Background(job_a, "deft-test-a")
    b = Background(job_b, "deft-test-b")
    release_b.set()
    assert b.result()[0] == {"error": "ValueError: b fails"}
    release_a.set()
    a.result()
    assert seen == pytest.approx({"a": SWITCH_INTERVAL_S, "b": SWITCH_INTERVAL_S, "a_after_b": SWITCH_INTERVAL_S},
                                 abs=2e-6)
    assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)


def test_a_shorter_switch_interval_of_the_callers_is_kept() -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S / 5)
    try:
        seen: list[float] = []
        Background(lambda: seen.append(sys.getswitchinterval()) or {}, "deft-test").result()
        assert seen == [pytest.approx(SWITCH_INTERVAL_S / 5, abs=2e-6)]
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S / 5, abs=2e-6)
    finally:
        sys.setswitchinterval(before)


def test_plan_lag_iters_is_validated() -> None:
    DeftConfig(plan_lag_iters=0)  # accepted: 0 plans inside the iteration, as before
    with pytest.raises(ContractError, match=r"plan_lag_iters.*expected an integer >= 0, got -1"):
        DeftConfig(plan_lag_iters=-1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities are set on Linux only")
def test_the_planner_thread_runs_at_its_nice_value_and_the_caller_keeps_its_own() -> None:
    def nice_here() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = nice_here()
    if mine >= 19:
        pytest.skip("this process already runs at the lowest priority (nice 19): no higher value to set")
    target = min(19, mine + 5)  # raising one's own nice value needs no privilege
    doc, _ = Background(lambda: {"nice": nice_here()}, "deft-planner-test", nice=target).result()
    assert doc == {"nice": target}  # setpriority sets the thread's value (it does not add to the caller's)
    assert nice_here() == mine


def test_planner_nice_is_validated() -> None:
    assert DeftConfig().planner_nice == 10
    with pytest.raises(ContractError, match=r"planner_nice.*expected an integer in \[0, 19\]"):
        DeftConfig(planner_nice=20)
    with pytest.raises(ContractError, match=r"planner_nice.*expected an integer in \[0, 19\].*got -1"):
        DeftConfig(planner_nice=-1)  # a negative nice value would need privilege and outrank training
