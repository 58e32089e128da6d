"""The lag-free forward stage in the planner and the simulator, checked against hand timelines.

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

from dataclasses import replace

import pytest

from deft import Bucket, BucketTimes, DeftConfig, Link, Profile
from deft.errors import ContractError
from deft.runtime.planning import make_schedule
from deft.schedule import CommTask, Schedule, StagePlan, Update
from deft.solver.lagfree import (
    SIM_ITERATIONS,
    SearchBudget,
    candidate,
    deadline_first,
    lagfree_plan,
    needed_deferred,
    spread,
)
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


def five_pieces() -> Profile:
    """``three_buckets`` with buckets 0 and 1 cut in halves (the link's fitted latency is 0: every
    bucket has the same size, so the fit goes through the origin and a half costs half): pieces
    0, 1 of bucket 0 (5 + 5 ms compute, 12.5 ms all-reduce), 2, 3 of bucket 1 (5 + 5, 10) and 4 = bucket 2
    (10 + 10, 5)."""
    spec = ((500, 5, 12.5), (500, 5, 12.5), (500, 5, 10), (500, 5, 10), (1000, 10, 5))
    buckets = tuple(Bucket(i, (f"piece{i}",), n, 4 * n) for i, (n, _, _) in enumerate(spec))
    times = tuple(BucketTimes(c * MS, c * MS, {"net": a * MS}) for _, c, a in spec)
    return Profile(buckets, times, (Link("net", "gloo"),), 2, "synthetic", model="five")


def early_five() -> Schedule:
    """Every piece sent in the backward in the order 0, 2, 4, 3, 1; pieces 1, 3, 4 deferred."""
    p = five_pieces()
    order = tuple(CommTask(b, 0, "net") for b in (0, 2, 4, 3, 1))
    return Schedule(cycle=1, links=("net",), bucket_numel=tuple(b.numel for b in p.buckets),
                    bucket_nbytes=tuple(b.nbytes for b in p.buckets),
                    stages=(StagePlan(0, "forward"), StagePlan(0, "backward", order)),
                    updates=(Update((0,), 0, finish_in_forward=True, deferred=(1, 3, 4)),))


def test_early_sends_hand_timeline() -> None:
    """Times from a forward start (F4 0-10, F3 .. F0 5 ms each to 30, B0 .. B3 5 ms each to 50, B4 50-60).
    First iteration: c0 35-47.5, c2 47.5-57.5, c4 60-65, c3 65-75, c1 75-87.5; the step waits for c0
    and c2 only (60). Next forward: F4 waits for c4 (65-75), F3 for c3 (75-80), F2 80-85, F1 waits for
    c1 (87.5-92.5), F0 92.5-97.5, backward 97.5-127.5; c0 102.5-115, c2 115-125, c4 127.5-132.5,
    c3 132.5-142.5, c1 142.5-155: F4 starts at 132.5, 67.5 ms after the previous 65, and the pattern
    repeats (every send ends the same 67.5 ms later)."""
    res = simulate_schedule(five_pieces(), early_five())
    assert res.iteration_s == pytest.approx(67.5 * MS)
    assert res.iteration_starts[1:3] == pytest.approx((65 * MS, 132.5 * MS))
    # Without the deferral the step waits for c1 (87.5): F4 starts at 87.5, not 65.
    whole = replace(early_five(), updates=(Update((0,), 0),))
    assert simulate_schedule(five_pieces(), whole).iteration_starts[1] == pytest.approx(87.5 * MS)


def test_deadline_first_by_hand() -> None:
    """Ready times from the backward start: 5, 10, 15, 20, 30. At 5 only piece 0 (link busy to 17.5);
    at 17.5 pieces 1 and 2 are ready and 2 is needed first (to 27.5); at 27.5 pieces 1 and 3: 3 (to
    37.5); at 37.5 pieces 1 and 4: 4 first, then 1."""
    assert [t.bucket for t in deadline_first(five_pieces())] == [0, 2, 3, 4, 1]


def test_deadline_first_two_links_by_hand() -> None:
    """Ready 10, 20, 30 ms; link a 25, 20, 5 ms, link b 30, 10, 10 ms. Bucket 0 ends at 35 on a, 40 on b:
    a. Bucket 1 at 20: a would end at 55, b at 30: b. Bucket 2 at 30: a ends at 40, b at 40: a tie, the
    first link (a)."""
    comm = ({"a": 25 * MS, "b": 30 * MS}, {"a": 20 * MS, "b": 10 * MS}, {"a": 5 * MS, "b": 10 * MS})
    buckets = tuple(Bucket(i, (f"layer{i}",), 1000, 4000) for i in range(3))
    times = tuple(BucketTimes(10 * MS, 10 * MS, comm[i]) for i in range(3))
    p = Profile(buckets, times, (Link("a", "gloo"), Link("b", "gloo")), 2, "synthetic", model="two links")
    assert deadline_first(p) == [CommTask(0, 0, "a"), CommTask(1, 0, "b"), CommTask(2, 0, "a")]


def test_only_buckets_in_flight_at_the_step_are_deferred() -> None:
    """In the hand timeline c0 and c2 end before the step (57.5 and 125 against 60 and 127.5), c4, c3
    and c1 after it."""
    every = replace(early_five(), updates=(Update((0,), 0, finish_in_forward=True, deferred=(0, 1, 2, 3, 4)),))
    assert needed_deferred(five_pieces(), every) == (1, 3, 4)


def test_planner_sends_early_when_it_is_faster() -> None:
    """On ``three_buckets`` the best hand plan of the forward-set family takes 80 ms; the planner also
    tries the partition at half the capacity (30 ms: buckets 0 and 1 exceed 15 ms and are halved into
    the sizes and times of ``five_pieces``, but pieces 0, 1 are halves of ``layer2`` and 2, 3 of
    ``layer1``: a half's gradient appears with its layer's, at the end of the second half's backward)
    and finds an early-send plan at 70 ms: order 1, 3, 4, 2, 0 (the planner's ready times are the
    layers' too, so the two halves of a layer tie), everything but piece 1 deferred.

    Its timeline: F4 0-10, F3 .. F0 5 ms each to 30, B0 .. B3 5 ms each to 50, B4 50-60; pieces 0, 1
    ready at 40, 2, 3 at 50, 4 at 60: c1 40-52.5, c3 52.5-62.5, c4 62.5-67.5, c2 67.5-77.5, c0 77.5-90;
    the step at 60 (c1 ended; c3 is in flight, so it is deferred too). F4 waits for c4 (67.5-77.5), F3
    for c2 and c3 (77.5-82.5), F2 82.5-87.5, F1 for c0 and c1 (90-95), F0 95-100, backward 100-130;
    c1 110-122.5, c3 122.5-132.5, c4 132.5-137.5: F4 starts at 137.5, then at 207.5 (c0 now ends at
    160 while F1 is ready at 157.5: F1 160-165, backward 170-200, c4 ends 207.5): 70 ms."""
    sched = lagfree_plan(three_buckets(), DeftConfig())
    assert sched.predicted_iteration_s == pytest.approx(70 * MS)
    assert sched.bucket_numel == (500, 500, 500, 500, 1000)
    # the two halves of a layer tie (same size, time and ready time): the order is fixed layer by layer
    order = [t.bucket for t in sched.stage(0, "backward").comms]
    layer = {0: 2, 1: 2, 2: 1, 3: 1, 4: 0}  # piece -> layer of three_buckets (0 and 1 halve layer2, ...)
    assert sorted(order) == [0, 1, 2, 3, 4] and [layer[b] for b in order] == [2, 1, 0, 1, 2]
    (update,) = sched.updates
    assert update.positions == (0,) and update.apply_after == 0 and update.finish_in_forward
    assert update.deferred == tuple(sorted(set(range(5)) - {order[0]}))  # all but the piece sent first, once each
    assert sched.batch_sequence == (1,)  # one update per iteration: what epsilon == 0 allows
    # the simulator finds the partition again from the schedule (the capacity is in its meta)
    part = profile_for_schedule(three_buckets(), sched, DeftConfig())
    res = simulate_schedule(part, sched)
    assert res.iteration_s == pytest.approx(70 * MS)
    assert res.iteration_starts[1:4] == pytest.approx((67.5 * MS, 137.5 * MS, 207.5 * MS))


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


def two_pieces(names: tuple[str, str]) -> Profile:
    """Two buckets of ``names``, one link, 10 ms forward and backward each, all-reduces 30 and 5 ms."""
    buckets = tuple(Bucket(i, (names[i],), 1, 4) for i in range(2))
    times = (BucketTimes(10 * MS, 10 * MS, {"net": 30 * MS}), BucketTimes(10 * MS, 10 * MS, {"net": 5 * MS}))
    return Profile(buckets, times, (Link("net", "gloo"),), 2, "synthetic", model="pieces")


def test_forward_gates_by_hand() -> None:
    buckets = tuple(Bucket(i, names, 1, 4) for i, names in enumerate(
        [("head.bias",), ("fc.weight[0:5]",), ("fc.weight[5:9]", "fc.bias"), ("conv.weight",), ("a|b[0:3]",),
         ("b[3:7]",)]))
    times = tuple(BucketTimes(MS, MS, {"net": MS}) for _ in buckets)
    p = Profile(buckets, times, (Link("net", "gloo"),), 2, "synthetic", model="gates")
    assert p.forward_gates == (0, 2, 2, 3, 5, 5)


def test_a_module_waits_for_every_piece_of_its_parameter() -> None:
    """Both buckets sent in backward (1 then 0) and deferred. F1 0-10, F0 10-20, B0 20-30, B1 30-40;
    c1 40-45, c0 45-75 (listed after c1); the step at 40 waits for nothing.

    * Pieces of one parameter ``w``: its module runs when bucket 1's forward does, after c1 and c0:
      F1 75-85, F0 85-95, B0, B1 to 115, c1 115-120, c0 120-150: forwards start at 75, 150.
    * Two parameters: F1 waits for c1 only (45-55), F0 for c0 (75-85), B0, B1 to 105, c1 105-110,
      c0 110-140: forwards start at 45, 110.
    """
    order = (CommTask(1, 0, "net"), CommTask(0, 0, "net"))
    sched = Schedule(cycle=1, links=("net",), bucket_numel=(1, 1), bucket_nbytes=(4, 4),
                     stages=(StagePlan(0, "forward"), StagePlan(0, "backward", order)),
                     updates=(Update((0,), 0, finish_in_forward=True, deferred=(0, 1)),))
    one = simulate_schedule(two_pieces(("w[1:2]", "w[0:1]")), sched)
    assert one.iteration_starts[1:3] == pytest.approx((75 * MS, 150 * MS))
    two = simulate_schedule(two_pieces(("a", "b")), sched)
    assert two.iteration_starts[1:3] == pytest.approx((45 * MS, 110 * MS))


@pytest.mark.parametrize("warmup", [0, True, 1.5])
def test_simulate_schedule_rejects_a_bad_warmup(warmup: object) -> None:
    p = three_buckets()
    with pytest.raises(ContractError, match=r"warmup: expected an integer >= 1"):
        simulate_schedule(p, no_delay_plan(p, DeftConfig()), warmup=warmup)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [(), (0.0,), (1.0, -2.0), (float("inf"),)])
def test_partition_scales_must_be_positive_multiples(bad: tuple[float, ...]) -> None:
    with pytest.raises(ContractError, match="scales"):
        lagfree_plan(three_buckets(), DeftConfig(epsilon=0.0), scales=bad)


def test_gradient_ready_by_hand() -> None:
    """A bucket's gradient is complete with its parameters': at the backward of the last bucket holding a
    piece of any of them (directly: not through a third parameter), unlike the forward's gate, which
    follows the run of shared parameters to its first bucket in the forward."""
    def profile(names: list[tuple[str, ...]]) -> Profile:
        buckets = tuple(Bucket(i, n, 1, 4) for i, n in enumerate(names))
        times = tuple(BucketTimes(MS, MS, {"net": MS}) for _ in buckets)
        return Profile(buckets, times, (Link("net", "gloo"),), 2, "synthetic", model="ready")

    gates = profile([("head.bias",), ("fc.weight[0:5]",), ("fc.weight[5:9]", "fc.bias"), ("conv.weight",),
                     ("a|b[0:3]",), ("b[3:7]",)])
    assert gates.gradient_ready == (0, 2, 2, 3, 5, 5)
    assert gates.ready_s == pytest.approx([x * MS for x in (1, 3, 3, 4, 6, 6)])
    chain = profile([("a[0:10]",), ("a[10:20]", "c[0:5]"), ("c[5:10]",), ("d",)])
    assert chain.gradient_ready == (1, 2, 2, 3)
    assert chain.forward_gates == (2, 2, 2, 3)


def test_a_piece_is_sent_when_its_whole_parameter_has_its_gradient() -> None:
    """No delay, both buckets sent in backward (0 then 1), the step waits for both. F1 0-10, F0 10-20,
    B0 20-30, B1 30-40; all-reduces 30 and 5 ms.

    * Two parameters: c0 30-60, c1 60-65, step at 65: 65 ms per iteration.
    * Pieces of one parameter ``w`` (its layer's backward is B0 + B1, its gradient appears at 40):
      c0 40-70, c1 70-75, step at 75: 75 ms per iteration.
    """
    order = (CommTask(0, 0, "net"), CommTask(1, 0, "net"))
    sched = Schedule(cycle=1, links=("net",), bucket_numel=(1, 1), bucket_nbytes=(4, 4),
                     stages=(StagePlan(0, "forward"), StagePlan(0, "backward", order)),
                     updates=(Update((0,), 0),))
    assert simulate_schedule(two_pieces(("a", "b")), sched).iteration_s == pytest.approx(65 * MS)
    assert simulate_schedule(two_pieces(("w[0:1]", "w[1:2]")), sched).iteration_s == pytest.approx(75 * MS)


def many_buckets(n: int = 40) -> Profile:
    """``n`` equal buckets on two links, each all-reduce twice its bucket's backward: a search with
    ``n`` forward sets and three partitions of many pieces."""
    buckets = tuple(Bucket(i, (f"layer{n - 1 - i}",), 1000, 4000) for i in range(n))
    times = tuple(BucketTimes(MS, MS, {"a": 2 * MS, "b": 3 * MS}) for _ in range(n))
    return Profile(buckets, times, (Link("a", "gloo"), Link("b", "gloo")), 2, "synthetic", model="many")


def test_spread_by_hand() -> None:
    assert spread(10, 4) == [0, 3, 6, 9]
    assert spread(5, 2) == [0, 4]
    assert spread(5, 1) == [4]
    assert spread(5, 0) == []
    assert spread(5, 9) == [0, 1, 2, 3, 4]


def test_without_a_budget_every_forward_set_is_simulated() -> None:
    p = many_buckets()
    cfg = DeftConfig(epsilon=0.0)
    n = profile_for_schedule(p, no_delay_plan(p, cfg), cfg).n
    sets = [c for c, _ in lagfree_plan(p, cfg).meta["candidates"] if isinstance(c, int)]
    assert sets == list(range(n))


def test_a_search_budget_is_never_overspent_and_bounds_the_simulations() -> None:
    p = many_buckets()
    cfg = DeftConfig(epsilon=0.0)
    n = profile_for_schedule(p, no_delay_plan(p, cfg), cfg).n
    budget = SearchBudget(units=10 * SIM_ITERATIONS * n)  # ten simulations of the no-delay partition
    sched = lagfree_plan(p, cfg, budget=budget)
    assert 0 < budget.spent <= budget.units
    sets = [c for c, _ in sched.meta["candidates"] if isinstance(c, int)]
    assert sets == spread(n, 5)  # half the budget: five of the n forward sets, evenly spaced
    # the plan is no slower than the no-delay plan, and no faster than the whole search's
    assert sched.predicted_iteration_s <= no_delay_plan(p, cfg).predicted_iteration_s
    assert sched.predicted_iteration_s >= lagfree_plan(p, cfg).predicted_iteration_s * (1 - 1e-9)


def test_an_empty_search_budget_gives_the_no_delay_plan() -> None:
    p = many_buckets()
    cfg = DeftConfig(epsilon=0.0)
    sched = lagfree_plan(p, cfg, budget=SearchBudget(units=0.0))
    assert sched.meta["mode"] == "no_delay" and sched.meta["candidates"] == []
    assert sched.predicted_iteration_s == no_delay_plan(p, cfg).predicted_iteration_s


def test_a_budget_the_whole_search_fits_in_gives_the_unbudgeted_plan() -> None:
    p = three_buckets()
    cfg = DeftConfig(epsilon=0.0)
    assert lagfree_plan(p, cfg, budget=SearchBudget(units=1e9)).digest() == lagfree_plan(p, cfg).digest()


def test_the_search_budget_of_a_window_grows_with_it() -> None:
    assert SearchBudget.for_window(0.0).units == 0.0
    assert SearchBudget.for_window(2.0).units == pytest.approx(2 * SearchBudget.for_window(1.0).units)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ContractError, match="window_s"):
            SearchBudget.for_window(bad)


def test_a_background_decision_searches_less_than_one_in_the_iteration() -> None:
    """``make_schedule`` with ``lag_iters``: the lag-free search within its window's budget (a window of
    one iteration here: fewer forward sets simulated than the no-delay partition has)."""
    p = many_buckets()
    cfg = DeftConfig(epsilon=0.0)
    n = profile_for_schedule(p, no_delay_plan(p, cfg), cfg).n
    whole = make_schedule(cfg, p, None, None).schedule.meta["candidates"]
    windowed = make_schedule(cfg, p, None, None, lag_iters=1).schedule.meta["candidates"]
    assert len([c for c, _ in whole if isinstance(c, int)]) == n
    assert 0 < len([c for c, _ in windowed if isinstance(c, int)]) < n
