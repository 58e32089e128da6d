"""The warm-up timer: its pure parts on hand timelines, its profile iterations on two real gloo links.

* :func:`busy_periods`: maximal runs of overlapping ``[launch, completion]`` intervals of one link;
  by hand, and for random timelines against a second method (the lengths sum to the measure of the
  union of the intervals, every collective in exactly one period).
* :func:`common_busy_groups`: the ranks' periods joined, each group's time the minimum over ranks
  of that rank's busy time inside it; by hand.
* :func:`common_busy_groups` with compute spans: a group's time beside the compute, on the rank whose
  time is the group's; by hand.
* :func:`fit_group_beta`: the one-parameter least squares with the measured ``alpha`` fixed; worked by
  hand (exact data, noisy data, start-ups that already exceed a group's time).
* :func:`busy_counts` and :func:`contention`: how long k links were busy in an interval, and the
  compute slowdown per busy link that makes the backward alone take what it took beside the sends;
  by hand (both branches: none, bisected, beyond the cap).
* :func:`link_rotation`: each bucket on one link per iteration, on every link over ``L`` iterations.
* :func:`deft.profiler.pace.paced_compute` (the timer's reduction over ranks): two ranks descheduled
  in different buckets are charged the slower rank's iteration, not the sum of the per-bucket maxima
  (that variant, kept as a test, fails the check); one slow iteration does not move it; the buckets
  keep the typical rank's proportions; by hand.
* Two ranks, two links (loopback gloo), each parameter its own bucket: in the warm-up only the
  primary link carries traffic; in each profile iteration every bucket is sent exactly once (the
  bytes over both links are the model's gradient bytes plus the used-parameter map, counted by hand),
  and both links carry buckets; the measured profile models both links and every bucket, and each
  link's ``alpha`` is the probe's (one-element all-reduces: positive on a real link), the same on both
  ranks; the probe does not count as link traffic.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from deft.profiler.pace import paced_compute
from deft.runtime.warmup_timer import (
    MAX_CONTENTION,
    PROBE_REPEATS,
    PROBE_WARMUP,
    busy_counts,
    busy_periods,
    common_busy_groups,
    contention,
    fit_group_beta,
    link_rotation,
    paced_step,
    probe_alpha,
    rank_compute,
    send_lags,
)
from tests._dist import run_ranks, values


def test_busy_periods_by_hand() -> None:
    # 0-10 and 2-15 overlap: one period of 15; 20-23 and 21-22 (inside it): one period of 3
    assert busy_periods([(0.0, 10.0), (2.0, 15.0), (20.0, 23.0), (21.0, 22.0)]) == [([0, 1], 15.0), ([2, 3], 3.0)]
    assert busy_periods([(1.0, 2.0), (0.0, 1.0)]) == [([1, 0], 2.0)]  # touching intervals: one period
    assert busy_periods([]) == []


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 300)), max_size=12))
def test_busy_periods_cover_the_union(raw: list[tuple[int, int]]) -> None:
    spans = [(float(lo), float(lo + dur)) for lo, dur in raw]
    got = busy_periods(spans)
    assert sorted(i for idx, _ in got for i in idx) == list(range(len(spans)))
    assert sum(length for _, length in got) == pytest.approx(_union_length(spans))


def test_common_busy_groups_join_the_ranks_periods() -> None:
    # rank 0: {0} alone (10), {1, 2} together (12..30: 18); rank 1 (other clock): {0, 1} together
    # (3..20.5: 17.5), {2} alone (9.2). Joined: one group {0, 1, 2}; busy 28 on rank 0, 26.7 on rank 1.
    rank0 = {0: (0.0, 10.0), 1: (12.0, 20.0), 2: (15.0, 30.0)}
    rank1 = {0: (3.0, 10.5), 1: (9.0, 20.5), 2: (21.0, 30.2)}
    (g,) = common_busy_groups([rank0, rank1])
    assert g.buckets == (0, 1, 2) and g.seconds == pytest.approx(26.7)
    # separable on both ranks: each bucket its own group, the rank that launched last sets its time
    got = common_busy_groups([{0: (0.0, 5.0), 1: (6.0, 9.0)}, {0: (1.0, 5.1), 1: (7.0, 9.2)}])
    assert [x.buckets for x in got] == [(0,), (1,)]
    assert [x.seconds for x in got] == pytest.approx([4.1, 2.2])
    # bucket 1's collective failed on rank 1: its group is left out
    (only,) = common_busy_groups([{0: (0.0, 5.0), 1: (6.0, 9.0)}, {0: (1.0, 5.1)}])
    assert only.buckets == (0,) and only.seconds == pytest.approx(4.1)


def test_a_groups_time_beside_the_compute_is_that_of_the_rank_whose_time_it_is() -> None:
    # rank 1 sets both groups' times (4.1 and 2.2); its compute spans [0, 2] and [8, 20]: bucket 0's
    # [1, 5.1] overlaps 1 s of them, bucket 1's [7, 9.2] 1.2 s. Rank 0's compute [0, 4] does not count.
    got = common_busy_groups([{0: (0.0, 5.0), 1: (6.0, 9.0)}, {0: (1.0, 5.1), 1: (7.0, 9.2)}],
                             [[(0.0, 4.0)], [(0.0, 2.0), (8.0, 20.0)]])
    assert [x.seconds for x in got] == pytest.approx([4.1, 2.2])
    assert [x.beside for x in got] == pytest.approx([1.0, 1.2])


def test_the_profiles_step_is_the_median_of_the_slowest_ranks_over_iterations_every_rank_timed() -> None:
    # iterations: (0.1, 0.3) -> 0.3, (0.2, 0.1) -> 0.2, (None, 0.5) not timed on rank 0: median 0.25
    assert paced_step([[0.1, 0.2, None], [0.3, 0.1, 0.5]]) == pytest.approx(0.25)
    assert paced_step([[None], [0.4]]) == 0.0 and paced_step([]) == 0.0


def test_a_sends_lag_is_the_last_ranks_launch_after_the_paced_ranks_by_each_ranks_clock() -> None:
    # bucket 0 completes at once on both ranks; rank 0 held it 5 s, rank 1 4.1 s: rank 1 launched it 0.9 s
    # after rank 0, and bucket 1 2.2 s against 3: 0.8 s. Rank 1's clock runs 100 s ahead of rank 0's: the
    # durations do not care. Paced on rank 1 (the last to launch) neither send waits.
    rank0 = {0: (0.0, 5.0), 1: (6.0, 9.0)}
    rank1 = {0: (101.0, 105.1), 1: (107.0, 109.2)}
    assert send_lags([rank0, rank1], 0) == pytest.approx([0.9, 0.8])
    assert send_lags([rank0, rank1], 1) == pytest.approx([0.0, 0.0])
    # a bucket that failed on rank 1 has no lag
    assert send_lags([rank0, {0: (101.0, 105.1)}], 0) == pytest.approx([0.9])


def test_each_ranks_forward_and_backward_per_iteration_on_its_own_clock() -> None:
    # rank 0: forward 0.0-0.15, backward 0.15-0.45; its second iteration's backward not timed. Rank 1's clock
    # runs 100 s ahead: a forward of 0.5 and a backward of 0.3, whatever the clock.
    rank0 = [[[0.0, 0.15], [0.15, 0.45]], [[1.0, 1.12]]]
    rank1 = [[[100.0, 100.5], [100.5, 100.8]], [[101.0, 101.52], [101.52, 101.8]]]
    assert rank_compute([rank0, rank1]) == {"forward": [[0.15, 0.12], [0.5, 0.52]],
                                            "backward": [[0.3, 0.0], [0.3, 0.28]]}


def test_fit_beta_with_alpha_fixed_by_hand() -> None:
    # alpha = 1 ms measured; groups (1 collective, 1 MB, 11 ms) and (2, 3 MB, 32 ms): less the start-ups
    # 10 and 30 ms, exactly 10 ms per MB: beta = (1 * 0.010 + 3 * 0.030) / (1 + 9) = 0.010 s per MB
    assert fit_group_beta([1, 2], [1_000_000, 3_000_000], [0.011, 0.032], 1e-3) == pytest.approx(1e-8, rel=1e-12)
    # noisy: alpha = 2 ms, (1, 1 MB, 12 ms) and (1, 2 MB, 20 ms) -> 10 and 18 ms left:
    # beta = (1 * 0.010 + 2 * 0.018) / (1 + 4) = 0.0092 s per MB
    assert fit_group_beta([1, 1], [1_000_000, 2_000_000], [0.012, 0.020], 2e-3) == pytest.approx(9.2e-9, rel=1e-12)
    # the start-up alone (50 ms) exceeds the 10 ms the group took: beta clamps to 0, alpha carries the model
    assert fit_group_beta([1], [1_000_000], [0.010], 0.05) == 0.0
    assert fit_group_beta([1], [10], [0.0], 0.0) == 1e-12  # nothing took time: still a model
    with pytest.raises(ValueError, match="equally long"):
        fit_group_beta([1, 2], [10], [0.1], 0.0)
    with pytest.raises(ValueError, match="alpha >= 0"):
        fit_group_beta([1], [10], [0.1], -1e-3)


def _per_bucket_max(fwd: list[list[list[float]]], bwd: list[list[list[float]]]) -> tuple[list[float], list[float]]:
    """The reduction paced_compute replaces: per bucket, the median over iterations, then the maximum over ranks."""
    def red(x: list[list[list[float]]]) -> list[float]:
        return [max(sorted(it[b] for it in r)[len(r) // 2] for r in x) for b in range(len(x[0][0]))]
    return red(fwd), red(bwd)


@pytest.mark.parametrize("reduce", [paced_compute, pytest.param(_per_bucket_max, marks=pytest.mark.xfail(
    strict=True, reason="the per-bucket maxima add both ranks' stalls"))])
def test_ranks_stalled_in_different_buckets_are_charged_the_slower_ranks_iteration(reduce: Any) -> None:
    # Two buckets, forward 1 + 1 and backward 2 + 2 on both ranks; rank 0 loses 3 in bucket 0's backward,
    # rank 1 loses 2 in bucket 1's backward, in every iteration. The slower rank computes 9 an
    # iteration; the per-bucket maxima would charge 1 + 1 + 5 + 4 = 11, more than either rank spends.
    fwd = [[[1.0, 1.0]] * 3, [[1.0, 1.0]] * 3]
    bwd = [[[5.0, 2.0]] * 3, [[2.0, 4.0]] * 3]
    f, b = reduce(fwd, bwd)
    assert sum(f) + sum(b) == pytest.approx(9.0)
    # the buckets share it as their medians over ranks (of two: the mean): 1, 1, 3.5, 3 of 8.5
    assert f == pytest.approx([9 / 8.5, 9 / 8.5])
    assert b == pytest.approx([3.5 * 9 / 8.5, 3.0 * 9 / 8.5])


def test_one_slow_iteration_does_not_set_the_pace() -> None:
    # one rank, three iterations of totals 4, 4 and 40 (a stall in the last): the pace is the median, 4
    fwd = [[[1.0], [1.0], [10.0]]]
    bwd = [[[3.0], [3.0], [30.0]]]
    f, b = paced_compute(fwd, bwd)
    assert (f, b) == (pytest.approx([1.0]), pytest.approx([3.0]))


def test_the_pace_is_the_slowest_rank_of_each_iteration() -> None:
    # iteration 0: rank 1 slower (6 against 4); iteration 1: rank 0 slower (8 against 4);
    # iteration 2: rank 1 (7 against 4). Per iteration the slowest: 6, 8, 7; median 7.
    fwd = [[[1.0], [2.0], [1.0]], [[2.0], [1.0], [2.0]]]
    bwd = [[[3.0], [6.0], [3.0]], [[4.0], [3.0], [5.0]]]
    f, b = paced_compute(fwd, bwd)
    assert f[0] + b[0] == pytest.approx(7.0)
    # shape: forward medians 1 and 2 (mean 1.5), backward medians 3 and 4 (mean 3.5): 1.5 : 3.5
    assert f[0] / b[0] == pytest.approx(1.5 / 3.5)


def test_busy_counts_by_hand() -> None:
    spans = [[(0.0, 2.0)], [(1.0, 3.0)]]  # link 0 busy [0, 2], link 1 [1, 3]
    assert busy_counts(spans, 0.0, 4.0) == pytest.approx({0: 1.0, 1: 2.0, 2: 1.0})
    assert busy_counts(spans, 1.5, 2.5) == pytest.approx({2: 0.5, 1: 0.5})  # clipped to the interval
    assert busy_counts([[], []], 0.0, 1.0) == {0: 1.0}


def test_contention_by_hand() -> None:
    # 2 s of work took 3 s with one link busy for 2 of them: 1 + 2 / (1 + rho) = 2, rho = 1
    assert contention(2.0, {0: 1.0, 1: 2.0}, 3.0) == pytest.approx(1.0)
    # the same with two links busy together: 1 + 2 / (1 + 2 rho) = 2, rho = 0.5
    assert contention(2.0, {0: 1.0, 2: 2.0}, 3.0) == pytest.approx(0.5)
    # the busy times rescaled to the backward's (launch calls are in the interval, not in the times)
    assert contention(2.0, {0: 0.5, 1: 1.0}, 3.0) == pytest.approx(1.0)
    # no slower beside the sends: none
    assert contention(3.0, {0: 1.0, 1: 2.0}, 3.0) == 0.0
    # slower with no link busy at all: not the links' doing
    assert contention(2.0, {0: 3.0}, 3.0) == 0.0
    # a link busy for too short a time to explain it: the cap
    assert contention(2.0, {0: 2.9, 1: 0.1}, 3.0) == MAX_CONTENTION


def test_link_rotation() -> None:
    assert link_rotation(5, ("p", "s"), 0) == ("p", "s", "p", "s", "p")
    assert link_rotation(5, ("p", "s"), 1) == ("s", "p", "s", "p", "s")
    assert link_rotation(4, ("a", "b", "c"), 2) == ("c", "a", "b", "c")
    assert link_rotation(3, ("p",), 7) == ("p", "p", "p")
    with pytest.raises(ValueError, match="at least one link"):
        link_rotation(3, (), 0)


# -- two ranks, two links -------------------------------------------------------------------------------
WARMUP, PROFILE = 2, 2


def two_link_worker(rank: int, world: int) -> dict[str, Any]:
    import deft

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config={
        "warmup_iters": WARMUP, "profile_iters": PROFILE, "epsilon": 0.0, "bucket_cap_mb": 1e-6,
        "timeout_s": 60, "links": [{"name": "primary"}, {"name": "second"}]})
    g = torch.Generator().manual_seed(rank)
    per_iteration = []
    for _ in range(WARMUP + PROFILE):
        before = ddp.link_stats
        loss = ddp(torch.randn(32, 8, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        after = ddp.link_stats
        per_iteration.append({k: {f: after[k][f] - before[k][f] for f in ("calls", "bytes")} for k in after})
    prof = ddp.profile
    assert prof is not None
    return {"per_iteration": per_iteration, "profile": prof.to_dict()}


@pytest.mark.slow
@pytest.mark.serial
def test_profile_iterations_send_each_bucket_once_over_both_links() -> None:
    from deft.profile import Profile

    out = values(run_ranks(two_link_worker, 2, timeout=120))
    grad_bytes = 4 * (8 * 16 + 16 + 16 * 4 + 4)  # fp32 gradients of the two Linear layers
    used_map = 4 * 4  # one int32 per parameter, on the primary link
    for doc in out:
        its = doc["per_iteration"]
        # Every warm-up layout: buckets of 16, 256, 64, 512 bytes in registration order reversed (the
        # ready order here); over 848 / 4 = 212 bytes each is cut (256 -> 2 x 128, 512 -> 172 + 172 + 168).
        # The first iteration and the other warm-up ones send each piece to the link with the fewest
        # bytes so far: 16 p, 128 s, 128 p, 64 s, 172 p, 172 s, 168 p
        for t in range(WARMUP):
            assert its[t]["primary"] == {"calls": 4 + 1, "bytes": 16 + 128 + 172 + 168 + used_map}, its
            assert its[t]["second"] == {"calls": 3, "bytes": 128 + 64 + 172}, its
        # the profile iterations: each piece once, piece b on link (b + j) mod 2 in profile iteration j
        # (planning, with the alpha probe, runs in the last one's step)
        for j, t in enumerate(range(WARMUP, WARMUP + PROFILE)):
            assert its[t]["primary"]["bytes"] + its[t]["second"]["bytes"] == grad_bytes + used_map, its
            even, odd = {"calls": 4, "bytes": 16 + 128 + 172 + 168}, {"calls": 3, "bytes": 128 + 64 + 172}
            first, second = (even, odd) if j == 0 else (odd, even)
            assert its[t]["primary"] == {"calls": first["calls"] + 1, "bytes": first["bytes"] + used_map}, its
            assert its[t]["second"] == second, its
    assert out[0]["profile"] == out[1]["profile"]
    prof = Profile.from_dict(out[0]["profile"])
    assert prof.source == "timing" and prof.n == 7 and prof.link_names == ("primary", "second")
    # the pieces named by their element ranges, as the partition names them
    assert [b.params for b in prof.buckets] == [
        ("2.bias",), ("2.weight[0:32]",), ("2.weight[32:64]",), ("0.bias",),
        ("0.weight[0:43]",), ("0.weight[43:86]",), ("0.weight[86:128]",)]
    assert prof.gradient_ready == (0, 2, 2, 3, 6, 6, 6)  # a cut parameter's pieces are ready together
    assert prof.meta["profile_iterations"] == PROFILE
    for link in prof.links:  # a fitted model on each link, and a positive time for every bucket there
        assert link.time(1_000_000) > 0
        assert all(prof.comm_time(b, link.name) > 0 for b in range(prof.n))
    probe = prof.meta["alpha_probe"]
    assert (probe["warmup"], probe["repeats"]) == (PROBE_WARMUP, PROBE_REPEATS)
    for link in prof.links:  # the measured start-up, agreed by the ranks (the profiles are equal, above)
        assert link.alpha_s > 0
        assert link.alpha_s == probe["alpha_s"][link.name]
    # 3 or 4 pieces per link per iteration, in 1 to 4 busy groups each
    assert all(PROFILE <= prof.meta["busy_groups"][k] <= 4 * PROFILE for k in ("primary", "second"))
    assert sorted(prof.meta["rank_lag_s"]) == ["primary", "second"]  # measured below, with a late rank
    # the link-failover guard (on by default) judges the second link's sends over the primary
    assert [lk.guarded for lk in prof.links] == [False, True]


def held_worker(rank: int, world: int, contention: bool = True, drag: bool | None = None) -> dict[str, Any]:
    """Per profile iteration, the all-reduces issued during the backward (from the output's gradient to
    the last parameter's), counted by wrapping ``torch.distributed.all_reduce``; the links' contention
    and drag (both measured or neither)."""
    import time

    import torch.distributed as dist

    import deft

    calls: list[float] = []
    real = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.perf_counter())
        return real(*args, **kwargs)

    dist.all_reduce = counted  # type: ignore[assignment]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config={
        "warmup_iters": WARMUP, "profile_iters": 3, "epsilon": 0.0, "bucket_cap_mb": 1e-6, "timeout_s": 60,
        "contention": contention, "drag": contention if drag is None else drag,
        "links": [{"name": "primary"}, {"name": "second"}]})
    g = torch.Generator().manual_seed(rank)
    during = []
    for _ in range(WARMUP + 3):
        grads: list[float] = []
        handles = [p.register_hook(lambda grad, grads=grads: grads.append(time.perf_counter()) or grad)
                   for p in model.parameters()]
        out = ddp(torch.randn(64, 64, generator=g))
        begin: list[float] = []
        out.register_hook(lambda grad, begin=begin: begin.append(time.perf_counter()) or grad)
        out.square().mean().backward()
        during.append(sum(1 for c in calls if begin[0] <= c < max(grads)))
        opt.step()
        opt.zero_grad()
        for h in handles:
            h.remove()
    dist.all_reduce = real  # type: ignore[assignment]
    prof = ddp.profile
    assert prof is not None
    return {"during": during[WARMUP:], "contention": [lk.contention for lk in prof.links],
            "meta": prof.meta["contention"], "drag": [lk.drag for lk in prof.links], "drag_meta": prof.meta["drag"]}


@pytest.mark.slow
@pytest.mark.serial
def test_the_last_profile_iteration_runs_its_backward_beside_no_collective() -> None:
    # the other profile iterations send each bucket as its gradient is ready (during the backward);
    # the last holds every send to the backward's end: its backward is timed alone, and the links'
    # contention measured against it (its size on loopback is noise: not asserted)
    docs = values(run_ranks(held_worker, 2, timeout=120))
    for doc in docs:
        assert doc["during"][0] > 0 and doc["during"][1] > 0, doc
        assert doc["during"][2] == 0, doc
        # every rank timed a backward alone and beside its sends, and estimated a contention; both gloo
        # links carry the median of the estimates
        meta = doc["meta"]
        assert meta["held_iteration"] == 2, meta
        assert len(meta["ranks"]) == 2 and all(r["alone_s"] > 0 and r["beside_s"] > 0 and r["rho"] is not None
                                                for r in meta["ranks"]), meta
        median = sorted(r["rho"] for r in meta["ranks"])
        assert doc["contention"] == [pytest.approx(sum(median) / 2)] * 2, doc
        # the drag: one for both gloo links, fitted over groups beside the backward (the other
        # iterations') and after it (the held one's), so the groups differ in their share beside the
        # compute (its size on loopback is noise: not asserted)
        assert doc["drag"] == [doc["drag_meta"]["drag"]] * 2, doc
        assert "spread" not in doc["drag_meta"].get("why_none", ""), doc
    assert docs[0]["meta"] == docs[1]["meta"]  # the same profile on every rank
    assert docs[0]["drag_meta"] == docs[1]["drag_meta"]


@pytest.mark.slow
@pytest.mark.serial
def test_contention_off_holds_nothing_and_prices_none() -> None:
    for doc in values(run_ranks(held_worker, 2, (False,), timeout=120)):
        assert all(n > 0 for n in doc["during"]), doc
        assert doc["contention"] == [0.0, 0.0], doc
        assert doc["drag"] == [0.0, 0.0] and doc["drag_meta"] == {"drag": 0.0, "why_none": "not measured"}, doc
        assert doc["meta"]["held_iteration"] is None and all(r["rho"] is None for r in doc["meta"]["ranks"]), doc


@pytest.mark.slow
@pytest.mark.serial
def test_drag_alone_holds_the_last_iteration_and_prices_no_contention() -> None:
    # the held iteration's sends ran beside no compute: the drag is fitted against them; the contention
    # is neither estimated nor priced
    docs = values(run_ranks(held_worker, 2, (False, True), timeout=120))
    for doc in docs:
        assert doc["during"][0] > 0 and doc["during"][1] > 0 and doc["during"][2] == 0, doc
        assert doc["contention"] == [0.0, 0.0] and all(r["rho"] is None for r in doc["meta"]["ranks"]), doc
        assert doc["drag"] == [doc["drag_meta"]["drag"]] * 2, doc
        assert "spread" not in doc["drag_meta"].get("why_none", "") and "not measured" not in doc["drag_meta"].get(
            "why_none", ""), doc


LATE_S = 0.3  # rank 1 starts each profile iteration this late
SLOW_S = 0.3  # rank 0's forward is this much longer than rank 1's


def late_rank_worker(rank: int, world: int, late: float, slow: float) -> dict[str, Any]:
    """Rank 1 sleeps ``late`` before each profile iteration's forward (outside the compute timed), rank
    0 sleeps ``slow`` inside its forward (a parameter-free module's pre-hook: compute). The links'
    lags behind the paced rank, and their prices."""
    import time

    import deft

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    if rank == 0:
        model[1].register_forward_pre_hook(lambda module, args: time.sleep(slow))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config={
        "warmup_iters": WARMUP, "profile_iters": 3, "epsilon": 0.0, "bucket_cap_mb": 0.05, "timeout_s": 60,
        "links": [{"name": "primary"}, {"name": "second"}]})
    g = torch.Generator().manual_seed(rank)
    for t in range(WARMUP + 3):
        if rank == 1 and t >= WARMUP:
            time.sleep(late)
        ddp(torch.randn(64, 64, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    prof = ddp.profile
    assert prof is not None
    return {"meta": prof.meta["rank_lag_s"], "comm": [prof.comm_time(b, lk) for lk in prof.link_names
                                                      for b in range(prof.n)],
            "lag": {lk.name: lk.lag_s for lk in prof.links}, "ranks": prof.meta["rank_compute_s"]}


@pytest.mark.slow
@pytest.mark.serial
def test_a_late_rank_is_a_lag_not_the_links_price() -> None:
    # rank 0 computes 0.05 s longer (the paced rank) but rank 1 starts LATE_S later: every send of rank
    # 0 waits about LATE_S - 0.05 for rank 1. The links' prices (the groups' minimum over ranks) leave it
    # out; each link's lag prices it (rank_wait, default).
    a, b = values(run_ranks(late_rank_worker, 2, (LATE_S, 0.05), timeout=120))
    assert a == b
    assert set(a["lag"]) == {"primary", "second"} and min(a["lag"].values()) >= 0.5 * LATE_S, a["lag"]
    assert max(a["comm"]) < 0.5 * LATE_S, a["comm"]


@pytest.mark.slow
@pytest.mark.serial
def test_a_slower_ranks_compute_is_not_a_lag() -> None:
    # rank 0's forward is SLOW_S longer: rank 1's sends all wait for it, but that wait is rank 0's
    # compute, which the profile prices as the ranks' pace; rank 0's own sends wait for nobody.
    a, b = values(run_ranks(late_rank_worker, 2, (0.0, SLOW_S), timeout=120))
    assert a == b
    assert max(a["lag"].values()) < 0.1 * SLOW_S, (a["lag"], a["meta"])
    assert max(a["comm"]) < 0.5 * SLOW_S, a["comm"]
    # each rank's own compute per profile iteration is kept: rank 0's forward the longer by its sleep
    fwd = a["ranks"]["forward"]
    assert len(fwd) == 2 and len(fwd[0]) == len(fwd[1]) == 3, a["ranks"]
    assert all(f0 - f1 >= 0.9 * SLOW_S for f0, f1 in zip(*fwd, strict=True)), a["ranks"]


def probe_dead_peer_worker(rank: int, world: int) -> str:
    """Rank 1 never joins the alpha probe (a stalled peer); rank 0's error is what a user reads."""
    import time

    import torch.distributed as dist

    from deft.errors import CommunicationError
    from deft.runtime.links import CommLink

    lk = CommLink("wire", "gloo", None, dist.new_group(backend="gloo"))
    if rank == 1:
        time.sleep(4.0)
        return ""
    with pytest.raises(CommunicationError) as err:
        probe_alpha({"wire": lk}, False, rank, 1.0)
    return str(err.value)


@pytest.mark.slow
@pytest.mark.serial
def test_alpha_probe_names_rank_link_and_probe_when_a_peer_stalls() -> None:
    msg = values(run_ranks(probe_dead_peer_worker, 2, (), timeout=60))[0]
    assert msg.startswith("rank 0: alpha probe (one-element all-reduce 1 of ") and "on link 'wire'" in msg, msg


STEP_S = 0.2  # rank 1's loop works this long between its backward and its step


def loop_step_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's loop sleeps STEP_S after each backward (its own work: clipping, logging): the profile's
    ``step_s`` and each rank's seconds per profile iteration."""
    import time

    import deft

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config={
        "warmup_iters": WARMUP, "profile_iters": 3, "epsilon": 0.0, "bucket_cap_mb": 0.05, "timeout_s": 60})
    g = torch.Generator().manual_seed(rank)
    for _ in range(WARMUP + 3):
        ddp(torch.randn(64, 64, generator=g)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the loop's own work, as users write it
        if rank == 1:
            time.sleep(STEP_S)
        opt.step()
        opt.zero_grad()
    prof = ddp.profile
    assert prof is not None
    return {"step_s": prof.step_s, "ranks": prof.meta["step_s"]["ranks"]}


@pytest.mark.slow
@pytest.mark.serial
def test_the_loops_own_work_after_the_backward_is_the_profiles_step() -> None:
    # the two profile iterations timed whole: rank 1's carry its sleep, rank 0's only a small SGD step;
    # the profile takes the slowest rank's
    a, b = values(run_ranks(loop_step_worker, 2, timeout=120))
    assert a == b
    fast, slow = a["ranks"]
    assert len(fast) == len(slow) == 2 and None not in fast + slow, a
    assert max(fast) < 0.5 * STEP_S and min(slow) >= STEP_S, a
    assert STEP_S <= a["step_s"] < 2 * STEP_S, a
