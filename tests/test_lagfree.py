"""The lag-free forward stage in the planner and the simulator (issue 15), checked against hand timelines.

Three buckets, one link, forward = backward = 10 ms per bucket, all-reduces 25, 20, 5 ms (bucket 0 is
nearest the output: ready first in backward, needed last in forward). Times from the forward start of
an iteration, forward F2 0-10, F1 10-20, F0 20-30, backward B0 30-40, B1 40-50, B2 50-60:

* no delay (WFBP): c0 40-65, c1 65-85, c2 85-90, the step waits for all: 90 ms per iteration;
* bucket 0 finishing in the next forward: c1 50-70, c2 70-75, step at 75; c0 launched at the backward's
  end, 75-100 behind c2. Next forward from 75: F2 75-85, F1 85-95, F0 waits for c0 until 100:
  100-110, B0..B2 110-140, c1 130-150 (the link is free since 100), c2 150-155: next step 155, 80 ms;
* buckets 1 and 0 in the forward: step at 65 after c2 60-65, c1 65-85, c0 85-110; F1 waits until 85,
  F0 until 110: F0 110-120, backward 120-150, c2 150-155: 90 ms.
"""

from __future__ import annotations

import pytest

from deft import Bucket, BucketTimes, DeftConfig, Link, Profile
from deft.schedule import CommTask, Update
from deft.solver.lagfree import candidate, lagfree_plan
from deft.solver.partition import profile_for_schedule
from deft.solver.plan import no_delay_plan
from deft.solver.simulate import simulate_schedule

MS = 1e-3


def three_buckets() -> Profile:
    comm = (25 * MS, 20 * MS, 5 * MS)
    buckets = tuple(Bucket(i, (f"layer{2 - i}",), 1000, 4000) for i in range(3))
    times = tuple(BucketTimes(10 * MS, 10 * MS, {"net": comm[i]}) for i in range(3))
    return Profile(buckets, times, (Link("net", "gloo"),), 2, "synthetic", model="three")


def test_hand_timelines() -> None:
    p = three_buckets()
    cfg = DeftConfig()
    base = no_delay_plan(p, cfg)
    part = profile_for_schedule(p, base, cfg)
    assert part.n == 3  # no re-partition: the hand timelines apply
    assert simulate_schedule(part, base).iteration_s == pytest.approx(90 * MS)
    assert simulate_schedule(part, candidate(part, 0, base)).iteration_s == pytest.approx(80 * MS)
    assert simulate_schedule(part, candidate(part, 1, base)).iteration_s == pytest.approx(90 * MS)


def test_planner_picks_the_fastest_lag_free_plan() -> None:
    sched = lagfree_plan(three_buckets(), DeftConfig())
    assert sched.predicted_iteration_s == pytest.approx(80 * MS)
    assert sched.meta["forward_set"] == [0]
    assert sched.updates == (Update((0,), 0, finish_in_forward=True),)
    assert sched.stage(0, "forward").comms == (CommTask(0, 1, "net"),)
    assert sched.batch_sequence == (1,)  # one update per iteration: what epsilon == 0 allows


def test_forward_waits_only_for_its_own_bucket() -> None:
    """In steady state F2 and F1 run back to back while c0 is still on the link; F0 starts exactly when
    c0 (sent for the previous iteration) ends, 5 ms after F1 (95 -> 100 in the docstring's times)."""
    p = three_buckets()
    res = simulate_schedule(p, candidate(p, 0, no_delay_plan(p, DeftConfig())))
    fwd = {(e.iteration, e.bucket): e for e in res.events if e.kind == "forward"}
    c0 = {e.iteration: e for e in res.events if e.kind == "comm" and e.bucket == 0}
    for t in range(6, 10):
        assert fwd[(t, 1)].start_s == pytest.approx(fwd[(t, 2)].end_s)          # no wait for F1
        assert fwd[(t, 0)].start_s == pytest.approx(c0[t - 1].end_s)            # F0 waits for c0
        assert fwd[(t, 0)].start_s - fwd[(t, 1)].end_s == pytest.approx(5 * MS)
