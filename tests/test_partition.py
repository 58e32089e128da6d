"""Bucket partition and fusion (DeFT section III.D): order, contiguity, sums and caps."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deft import Bucket, BucketTimes, ContractError, DeftConfig, Link, Profile
from deft.schedule import synchronous_schedule
from deft.solver.partition import BEST_EFFORT_MAX_PIECES, default_capacity, partition, profile_for_schedule
from deft.solver.simulate import simulate_schedule
from tests._profiles import VGG_BWD_US, VGG_NUMEL, vgg19

MS = 1e-3
US = 1e-6
# VGG-19 (DeFT paper, Table II): tests/_profiles.py


def uniform(n: int, comm_s: float, *, alpha_s: float = 0.0, numel: int = 1000, fwd_s: float = MS,
            bwd_s: float = 2 * MS, params: tuple[str, ...] | None = None) -> Profile:
    buckets = tuple(Bucket(i, params or (f"l{i}.weight",), numel, 4 * numel) for i in range(n))
    times = tuple(BucketTimes(fwd_s, bwd_s, {"nccl": comm_s}) for _ in range(n))
    return Profile(buckets, times, (Link("nccl", "nccl", None, alpha_s, 0.0),), 2, "synthetic")


def assert_tiles(orig: Profile, part: Profile) -> None:
    """New buckets are contiguous element ranges of the old ones, in order, covering everything once."""
    segs = [s for bucket_segs in part.meta["partition"]["segments"] for s in bucket_segs]
    cursor = (0, 0)  # (old bucket, next element)
    for b, start, stop in segs:
        if cursor[0] != b:  # moved to the next old bucket: the previous one must be complete
            assert cursor == (b - 1, orig.buckets[b - 1].numel) or (cursor == (0, 0) and b == 0)
            cursor = (b, 0)
        assert start == cursor[1] and (stop > start or orig.buckets[b].numel == 0)
        cursor = (b, stop)
    assert cursor == (orig.n - 1, orig.buckets[-1].numel)
    for new, bucket_segs in zip(part.buckets, part.meta["partition"]["segments"], strict=True):
        assert new.numel == sum(stop - start for _, start, stop in bucket_segs)


def assert_conserved(orig: Profile, part: Profile) -> None:
    assert sum(b.numel for b in part.buckets) == sum(b.numel for b in orig.buckets)
    assert sum(b.nbytes for b in part.buckets) == sum(b.nbytes for b in orig.buckets)
    assert math.isclose(part.forward_s, orig.forward_s, rel_tol=1e-12, abs_tol=1e-15)
    assert math.isclose(part.backward_s, orig.backward_s, rel_tol=1e-12, abs_tol=1e-15)


def test_vgg19_split_meets_both_caps_and_keeps_order() -> None:
    prof = vgg19()
    cfg = DeftConfig()
    part = partition(prof, cfg)
    cap = default_capacity(prof)
    assert cap == pytest.approx(37.166 * MS)  # forward (37 ms) < backward (93 ms): the smallest knapsack
    assert all(b.numel <= cfg.partition_numel for b in part.buckets)
    assert all(part.comm_time(b, "nccl") <= cap for b in range(part.n))
    assert_tiles(prof, part)
    assert_conserved(prof, part)
    # Paper bucket #4 (the 102.8M-element classifier.0, 178.6 ms): the numel cap asks for 16 pieces,
    # more than the 5 the time cap needs; without latency its time splits exactly in proportion.
    pieces = [i for i, segs in enumerate(part.meta["partition"]["segments"]) if segs[0][0] == 2]
    assert len(pieces) == math.ceil(VGG_NUMEL[2] / cfg.partition_numel) == 16
    assert math.fsum(part.comm_time(i, "nccl") for i in pieces) == pytest.approx(178643 * US)
    # Ready times are preserved at old bucket boundaries (the last piece is ready with its bucket).
    ready_old = [sum(VGG_BWD_US[: i + 1]) * US for i in range(6)]
    ready_new = part.ready_s
    ends = [max(i for i, segs in enumerate(part.meta["partition"]["segments"]) if segs[-1][0] == b) for b in range(6)]
    assert [ready_new[i] for i in ends] == pytest.approx(ready_old)
    assert part.buckets[pieces[0]].params == ("vgg.b4[0:6422784]",)


def test_cap_is_the_smallest_knapsack_in_primary_link_units() -> None:
    """Paper III.D: a bucket's time must stay under the smallest knapsack, "typically the
    forward time divided by mu": with gloo 1.65x slower, its knapsack holds F / 1.65 of NCCL time.

    By hand: F = 2 x 10 = 20 ms < B = 40 ms; the cap is 20 / 1.65 = 12.12 ms. Bucket 0 (15 ms on NCCL,
    under F but over F / mu) is split into two 7.5 ms halves; bucket 1 (5 ms) stays whole.
    """
    links = (Link("nccl", "nccl"), Link("gloo", "gloo"))
    buckets = tuple(Bucket(i, (f"l{i}.weight",), 1000, 4000) for i in range(2))
    times = tuple(BucketTimes(10 * MS, 20 * MS, {"nccl": c * MS, "gloo": 1.65 * c * MS}) for c in (15.0, 5.0))
    prof = Profile(buckets, times, links, 2, "synthetic")
    assert default_capacity(prof) == pytest.approx(20 * MS / 1.65)
    part = partition(prof, DeftConfig())
    assert part.meta["partition"]["segments"] == [[[0, 0, 500]], [[0, 500, 1000]], [[1, 0, 1000]]]
    assert [part.comm_time(i, "nccl") for i in range(3)] == pytest.approx([7.5 * MS, 7.5 * MS, 5 * MS])
    assert [part.comm_time(i, "gloo") for i in range(3)] == pytest.approx([12.375 * MS, 12.375 * MS, 8.25 * MS])
    # The primary link alone: its knapsack is the smallest, F = 20 ms; nothing to split.
    one = Profile(buckets, tuple(BucketTimes(t.forward_s, t.backward_s, {"nccl": t.comm_s["nccl"]}) for t in times),
                  links[:1], 2, "synthetic")
    assert default_capacity(one) == pytest.approx(20 * MS)
    assert partition(one, DeftConfig()) is one


def test_time_cap_alone_splits_with_latency_paid_per_piece() -> None:
    # One bucket of 50 ms comm, capacity 12 ms, alpha 2 ms: pieces pay 2 ms + a share of 48 ms.
    prof = uniform(1, 50 * MS, alpha_s=2 * MS, numel=1000)
    part = partition(prof, DeftConfig(), capacity_s=12 * MS)
    m = part.n
    assert m == math.ceil(48 / 10) == 5  # smallest m with 2 + 48/m <= 12
    times = [part.comm_time(i, "nccl") for i in range(m)]
    assert max(times) <= 12 * MS
    assert math.fsum(times) == pytest.approx(50 * MS + (m - 1) * 2 * MS)
    assert part.buckets[0].params == ("l0.weight[0:200]",)


@pytest.mark.parametrize("alpha_ms", [2.0, 0.0])
def test_simulated_pieces_pay_the_start_up_each(alpha_ms: float) -> None:
    # One bucket: forward 1 ms, backward 1 ms, all-reduce measured 10 ms, start-up alpha. Capacity 6 ms:
    # each piece pays alpha and half the rest: with alpha = 2 ms, two pieces of 2 + 8 / 2 = 6 ms (one
    # piece of 10 ms is over the cap); with alpha = 0 (a fit that finds no start-up cost), two of 5 ms.
    # Sent on one link in their own backward: both are pieces of one parameter, whose gradient appears
    # at the end of its layer's 1 ms backward (not piece 0 after its 0.5 ms share); the link runs them
    # back to back from 1 ms: the iteration is 1 + 1 + 2 * (alpha + (10 - alpha) / 2) = 14 ms with
    # alpha = 2 ms (more than the unsplit bucket's 1 + 1 + 10), 12 ms with alpha = 0.
    prof = uniform(1, 10 * MS, alpha_s=alpha_ms * MS, numel=1000, fwd_s=MS, bwd_s=MS)
    part = partition(prof, DeftConfig(), capacity_s=6 * MS)
    assert part.n == 2
    sched = synchronous_schedule(tuple(b.numel for b in part.buckets), tuple(b.nbytes for b in part.buckets),
                                 ("nccl",))
    piece_ms = alpha_ms + (10 - alpha_ms) / 2
    assert simulate_schedule(part, sched).iteration_s == pytest.approx((2 + 2 * piece_ms) * MS)
    # the schedule refers to the partition (its sizes and capacity): the same piece times are recovered
    again = profile_for_schedule(prof, replace(sched, meta={"capacity_s": 6 * MS}), DeftConfig())
    assert [again.comm_time(b, "nccl") for b in range(2)] == pytest.approx([piece_ms * MS] * 2)


def test_exact_parameter_ranges_when_sizes_are_known() -> None:
    buckets = (Bucket(0, ("fc.bias", "fc.weight"), 10 + 90, 400),)
    times = (BucketTimes(MS, MS, {"nccl": 40 * MS}),)
    prof = Profile(buckets, times, (Link("nccl", "nccl"),), 2, "synthetic",
                   meta={"param_numel": {"fc.bias": 10, "fc.weight": 90}})
    part = partition(prof, DeftConfig(partition_numel=30), capacity_s=1.0)
    assert [b.numel for b in part.buckets] == [25, 25, 25, 25]
    assert [b.params for b in part.buckets] == [
        ("fc.bias", "fc.weight[0:15]"), ("fc.weight[15:40]",), ("fc.weight[40:65]",), ("fc.weight[65:90]",),
    ]
    # Re-partitioning a piece composes its range instead of nesting brackets.
    again = partition(part, DeftConfig(partition_numel=10), capacity_s=1.0)
    assert [b.params for b in again.buckets[:4]] == [
        ("fc.bias[0:8]",), ("fc.bias[8:10]", "fc.weight[0:6]"), ("fc.weight[6:15]",), ("fc.weight[15:23]",),
    ]


def test_unknown_parameter_sizes_name_the_range_of_the_concatenation() -> None:
    prof = uniform(1, 10 * MS, numel=100, params=("a.w", "a.b"))
    part = partition(prof, DeftConfig(partition_numel=50), capacity_s=1.0)
    assert [b.params for b in part.buckets] == [("a.w|a.b[0:50]",), ("a.w|a.b[50:100]",)]


def test_fuses_latency_dominated_runs_and_saves_one_alpha_per_merge() -> None:
    # Ten buckets of 1.2 ms with alpha = 1 ms: bandwidth part 0.2 ms each, so five fit in one alpha.
    prof = uniform(10, 1.2 * MS, alpha_s=1 * MS, numel=100)
    part = partition(prof, DeftConfig())
    assert part.n == 2
    assert [part.comm_time(i, "nccl") for i in range(2)] == pytest.approx([2 * MS, 2 * MS])
    assert_tiles(prof, part)
    assert_conserved(prof, part)
    assert part.buckets[0].params == tuple(f"l{i}.weight" for i in range(5))
    # The numel cap stops fusion: at most 3 buckets of 100 elements fit in 300.
    capped = partition(prof, DeftConfig(partition_numel=300))
    assert [b.numel for b in capped.buckets] == [300, 300, 300, 100]
    # The time cap stops it too: 1.6 ms allows 2 buckets (1.2 + 1.2 - 1 = 1.4 ms), not 3 (1.6 + eps).
    timed = partition(prof, DeftConfig(), capacity_s=1.5 * MS)
    assert [b.numel for b in timed.buckets] == [200] * 5


def test_no_latency_means_no_fusion_and_unchanged_profile_is_returned_as_is() -> None:
    prof = uniform(4, 0.1 * MS)  # tiny but no alpha: fusing saves nothing
    assert partition(prof, DeftConfig()) is prof


def test_partition_is_idempotent() -> None:
    for prof in (vgg19(), vgg19(alpha_s=0.5 * MS), uniform(10, 1.2 * MS, alpha_s=1 * MS)):
        part = partition(prof, DeftConfig(), capacity_s=default_capacity(prof))
        assert partition(part, DeftConfig(), capacity_s=default_capacity(prof)) is part


def test_unmeasured_link_falls_back_to_its_model_on_the_piece_bytes() -> None:
    links = (Link("nccl", "nccl"), Link("gloo", "gloo", None, 1 * MS, 1e-9))
    buckets = (Bucket(0, ("w",), 1_000_000, 4_000_000),)
    prof = Profile(buckets, (BucketTimes(MS, MS, {"nccl": 40 * MS}),), links, 2, "synthetic")
    part = partition(prof, DeftConfig(partition_numel=250_000), capacity_s=1.0)
    assert part.n == 4
    for i in range(4):
        assert "gloo" not in part.times[i].comm_s
        assert part.comm_time(i, "gloo") == pytest.approx(1 * MS + 1e-9 * 1_000_000)
        assert part.comm_time(i, "nccl") == pytest.approx(10 * MS)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bad_capacity_is_rejected(bad: object) -> None:
    with pytest.raises(ContractError, match="capacity_s"):
        partition(vgg19(), DeftConfig(), capacity_s=bad)  # type: ignore[arg-type]


def test_latency_above_capacity_cannot_be_partitioned() -> None:
    prof = uniform(1, 50 * MS, alpha_s=20 * MS)
    with pytest.raises(ContractError, match=r"links\[0\] \(nccl\).*alpha_s"):
        partition(prof, DeftConfig(), capacity_s=10 * MS)


def test_wrong_argument_types_and_empty_compute() -> None:
    with pytest.raises(ContractError, match="profile"):
        partition("vgg.json", DeftConfig())  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="config"):
        partition(vgg19(), {"solver": "exact"})  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="forward_s and backward_s are all 0"):
        partition(uniform(2, MS, fwd_s=0.0, bwd_s=0.0), DeftConfig())


@st.composite
def profiles(draw: st.DrawFn) -> tuple[Profile, int, float]:
    n = draw(st.integers(1, 6))
    alpha = draw(st.sampled_from([0.0, 0.2 * MS]))
    buckets, times = [], []
    for i in range(n):
        numel = draw(st.integers(0, 5000))
        itemsize = draw(st.sampled_from([2, 4]))
        buckets.append(Bucket(i, tuple(f"p{i}.{k}" for k in range(draw(st.integers(1, 3)))), numel, numel * itemsize))
        comm = draw(st.floats(0.0, 30.0)) * MS
        times.append(BucketTimes(draw(st.floats(0, 5)) * MS, draw(st.floats(0, 5)) * MS, {"nccl": comm}))
    prof = Profile(tuple(buckets), tuple(times), (Link("nccl", "nccl", None, alpha, 0.0),), 2, "synthetic")
    return prof, draw(st.integers(10, 3000)), draw(st.floats(0.5, 20.0)) * MS


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profiles())
def test_partition_invariants_on_random_profiles(case: tuple[Profile, int, float]) -> None:
    prof, numel_cap, cap = case
    cfg = DeftConfig(partition_numel=numel_cap)
    try:
        part = partition(prof, cfg, capacity_s=cap)
    except ContractError as e:
        # Only legitimate failure: some bucket cannot be brought under the time cap.
        assert "cannot be split" in str(e) or "one element" in str(e)
        return
    if part is prof:
        assert all(b.numel <= numel_cap and prof.comm_time(b.id, "nccl") <= cap for b in prof.buckets)
        return
    assert_tiles(prof, part)
    assert_conserved(prof, part)
    assert all(b.numel <= numel_cap for b in part.buckets)
    assert all(part.comm_time(i, "nccl") <= cap for i in range(part.n))
    assert [b.id for b in part.buckets] == list(range(part.n))


def test_best_effort_leaves_unsplittable_buckets_over_the_cap() -> None:
    latency_bound = uniform(2, 50 * MS, alpha_s=20 * MS, numel=100)
    assert partition(latency_bound, DeftConfig(), capacity_s=10 * MS, best_effort=True) is latency_bound
    split_by_numel = partition(latency_bound, DeftConfig(partition_numel=50), capacity_s=10 * MS, best_effort=True)
    assert [b.numel for b in split_by_numel.buckets] == [50, 50, 50, 50]
    # Without latency, single elements are as far as splitting goes: 4 elements of 12.5 ms each.
    tiny = uniform(1, 50 * MS, numel=4)
    with pytest.raises(ContractError, match="one element"):
        partition(tiny, DeftConfig(), capacity_s=10 * MS)
    assert [b.numel for b in partition(tiny, DeftConfig(), capacity_s=10 * MS, best_effort=True).buckets] == [1] * 4


def test_best_effort_cuts_no_latency_bound_pieces_when_the_capacity_is_under_two_alphas() -> None:
    # 50 ms on the wire, 10 of them latency; a capacity of 11 ms is reachable only with 40 pieces of
    # 11 ms (440 ms on the wire). Pieces with a bandwidth part of at least alpha: 4 of 20 ms (80 ms).
    prof = uniform(1, 50 * MS, alpha_s=10 * MS, numel=1000)
    assert partition(prof, DeftConfig(), capacity_s=11 * MS).n >= 40  # strict rule 3 still cuts them
    part = partition(prof, DeftConfig(), capacity_s=11 * MS, best_effort=True)
    assert [b.numel for b in part.buckets] == [250] * 4
    assert [part.comm_time(b, "nccl") for b in range(part.n)] == pytest.approx([20 * MS] * 4)
    assert_tiles(prof, part)
    # 8 pieces of 15 ms would fit a 15 ms capacity, with 5 ms of bandwidth each: 4 again, over the cap
    assert partition(prof, DeftConfig(), capacity_s=15 * MS, best_effort=True).n == 4
    # From a capacity of 2 alpha on the rule changes nothing: pieces of 10 ms of bandwidth fit 21 ms
    assert partition(prof, DeftConfig(), capacity_s=21 * MS, best_effort=True).n == 4
    assert partition(prof, DeftConfig(), capacity_s=21 * MS, best_effort=True).n \
        == partition(prof, DeftConfig(), capacity_s=21 * MS).n


def test_best_effort_bounds_the_pieces_when_the_capacity_is_near_zero() -> None:
    prof = uniform(1, 10 * MS, numel=1_000_000)
    part = partition(prof, DeftConfig(), capacity_s=1e-300, best_effort=True)
    assert part.n == BEST_EFFORT_MAX_PIECES
    assert_tiles(prof, part)
