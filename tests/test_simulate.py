"""The simulator on hand-computable cases, its invariants, the reference profiles and worker scaling."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest

from deft.config import DeftConfig
from deft.errors import ContractError
from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.schedule import CommTask, Schedule, StagePlan, Update, synchronous_schedule
from deft.solver.baselines import mgwfbp_merge, mgwfbp_time
from deft.solver.compare import SCHEMES, simulate
from deft.solver.simulate import (
    BASELINES,
    link_model,
    message_time,
    ring_factors,
    scale_workers,
    simulate_schedule,
    usbyte_plan_for,
)

PROFILES = Path(__file__).resolve().parents[1] / "examples" / "profiles"


def make_profile(fwd: list[float], bwd: list[float], comm: list[dict[str, float]], nbytes: list[int] | None = None,
                 links: tuple[Link, ...] = (Link("a", "nccl"),), world_size: int = 4) -> Profile:
    n = len(fwd)
    sizes = nbytes or [1000] * n
    return Profile(
        buckets=tuple(Bucket(i, (f"p{i}",), sizes[i] // 4, sizes[i]) for i in range(n)),
        times=tuple(BucketTimes(fwd[i], bwd[i], comm[i]) for i in range(n)),
        links=links, world_size=world_size, source="synthetic",
    )


def linear_profile(fwd: list[float], bwd: list[float], nbytes: list[int], alpha: float, beta: float) -> Profile:
    comm = [{"a": alpha + beta * x} for x in nbytes]
    return make_profile(fwd, bwd, comm, nbytes, (Link("a", "nccl", None, alpha, beta),))


def vgg19() -> Profile:
    return Profile.load(PROFILES / "vgg19.json")


# ------------------------------------------------------------------------------------------------- hand cases
def test_one_bucket_exposes_its_whole_all_reduce() -> None:
    # The only bucket is ready at the end of backward: nothing can overlap its all-reduce.
    p = make_profile([2.0], [3.0], [{"a": 1.5}])
    for scheme in BASELINES:
        r = simulate(p, scheme)
        assert r.iteration_s == pytest.approx(6.5), scheme
        assert r.bubble_ratio == pytest.approx(1.5 / 6.5)
        assert r.link_utilization["a"] == pytest.approx(1.5 / 6.5)


def test_comm_shorter_than_backward_leaves_only_the_tail() -> None:
    # Bucket 0 ready at 1, its all-reduce (2) hides under bucket 1's backward (4); bucket 1's (3) is
    # the exposed tail: iteration = forward 2 + backward 5 + 3.
    p = make_profile([1.0, 1.0], [1.0, 4.0], [{"a": 2.0}, {"a": 3.0}])
    assert simulate(p, "wfbp").iteration_s == pytest.approx(10.0)
    r = simulate(p, "ddp")  # 1000-byte buckets fuse into one bucket under DDP's 1 MiB first cap
    assert r.meta["messages"] == 1
    assert r.iteration_s == pytest.approx(7.0 + 5.0)  # sum of measured times (no alpha to save)


def test_ddp_fusion_saves_startups_wfbp_overlaps_more() -> None:
    # Two 0.6 MB buckets, alpha 1, beta 1e-6 s/B: alone 1.6 each, fused 2.2.
    p = linear_profile([1.0, 1.0], [1.0, 0.5], [600_000, 600_000], 1.0, 1e-6)
    assert message_time(p, "a", [(0, 1.0), (1, 1.0)]) == pytest.approx(2.2)
    # WFBP: bucket 0 at [1, 2.6], bucket 1 (ready 1.5) at [2.6, 4.2]; iteration 2 + 4.2.
    assert simulate(p, "wfbp").iteration_s == pytest.approx(6.2)
    # DDP: one fused bucket (first cap 1 MiB), sent when bucket 1 is ready at 1.5: [1.5, 3.7].
    assert simulate(p, "ddp").iteration_s == pytest.approx(5.7)


def test_layerwise_dependency_lets_forward_start_early() -> None:
    # Input-side bucket 1 has a long forward (3); 1 MB buckets in 250 kB basic blocks, alpha 0.01.
    p = linear_profile([0.5, 3.0], [1.0, 1.0], [1_000_000, 1_000_000], 0.01, 2e-6)
    cfg = {"partition_numel": 62_500}
    # WFBP: bucket 0 [4.5, 6.51], bucket 1 [6.51, 8.52], then the next forward.
    assert simulate(p, "wfbp", cfg).iteration_s == pytest.approx(8.52)
    # ByteScheduler: bucket 1's pieces overtake bucket 0's, whose rest overlaps bucket 1's forward.
    assert simulate(p, "bytescheduler", cfg).iteration_s < 8.52 - 0.1
    # US-Byte (backward from 0): Case 2 sends 2 blocks of bucket 0 in [1, 2.01] during bucket 1's
    # backward; phase 2 sends bucket 1 [2.01, 4.02] then the rest of bucket 0 [4.02, 5.03]; forward
    # of bucket 1 4.02-7.02, of bucket 0 7.02-7.52.
    assert simulate(p, "usbyte", cfg).iteration_s == pytest.approx(7.52)


@pytest.mark.parametrize(("credit", "order", "ready", "period"), [
    # Stop-and-wait: bucket 1 overtakes as soon as a piece ends; bucket 0's last piece then delays
    # the next forward of bucket 0 by 0.2, so bucket 0 is ready at 3.2 instead of 3.
    (250_000, "0 0 1 1 1 1 0 0", 3.2, 6.8),
    # ByteScheduler's Algorithm 1 sends a piece only while the remaining credit is *greater* than its
    # size: with a credit of exactly two pieces, 250 kB remain beside a running piece, not more, so
    # this is stop-and-wait too.
    (500_000, "0 0 1 1 1 1 0 0", 3.2, 6.8),
    # A credit above two pieces: the piece queued behind the running one cannot be overtaken.
    (500_001, "0 0 0 1 1 1 1 0", 3.0, 7.2),
    # Everything handed to the link's FIFO at once: no preemption, plain WFBP order.
    (10**9, "0 0 0 0 1 1 1 1", 3.0, 7.8),
])
def test_bytescheduler_priority_and_credit(credit: int, order: str, ready: float, period: float) -> None:
    # Buckets of four 250 kB pieces (0.6 s each); bucket 1 (the input side) is ready 1 s after bucket 0.
    p = linear_profile([1.0, 1.0], [1.0, 1.0], [1_000_000, 1_000_000], 0.1, 2e-6)
    r = simulate(p, "bytescheduler", {"partition_numel": 62_500, "extra": {"bytescheduler_credit_bytes": credit}})
    assert r.iteration_s == pytest.approx(period)
    t = 6
    comms = sorted((e for e in r.events if e.kind == "comm" and e.iteration == t), key=lambda e: e.start_s)
    assert " ".join(str(e.bucket) for e in comms) == order
    start = r.iteration_starts[t]
    assert comms[0].start_s == pytest.approx(start + ready)
    assert comms[-1].end_s == pytest.approx(start + ready + 4.8)  # the link never idles once started
    # The next forward (bucket 1 first) starts as soon as bucket 1's last piece is done.
    assert r.iteration_starts[t + 1] == pytest.approx(max(e.end_s for e in comms if e.bucket == 1))


def test_mgwfbp_is_compared_as_its_paper_defines_it() -> None:
    """The scheme named "mgwfbp" is MG-WFBP's Algorithm 1; the exact optimum of its timing
    model is the named option ``extra.mgwfbp_method = "optimal"``.

    Buckets 0 (output side), 1, 2: backward 0.5, 0.5 and 1 s (ready at 0.5, 1 and 2 s), 1 MB each, alpha
    1 s, beta 1e-6 s/B: 2 s alone, 3 s for two merged; forward 0.1 s each.
    Algorithm 1 from the output: bucket 0's all-reduce would start at 0.5 and bucket 1 is ready at 1.0,
    1.0 - 0.5 < alpha: merge. Buckets 0+1 then start at 1.0; bucket 2 is ready at 2.0, 2.0 - 1.0 is not
    < alpha: alone. So [1, 4] and [4, 6]: iteration 0.3 + 6 = 6.3 s. The optimum sends bucket 0 alone
    at [0.5, 2.5] and 1+2 at [2.5, 5.5]: 5.8 s.
    """
    p = linear_profile([0.1] * 3, [0.5, 0.5, 1.0], [1_000_000] * 3, 1.0, 1e-6)
    assert simulate(p, "mgwfbp").iteration_s == pytest.approx(6.3)
    assert simulate(p, "mgwfbp", {"extra": {"mgwfbp_method": "optimal"}}).iteration_s == pytest.approx(5.8)


def test_mgwfbp_and_usbyte_simulations_match_their_models() -> None:
    fwd, bwd = [0.5, 3.0, 1.0, 0.2], [4.0, 1.0, 0.5, 0.3]
    nbytes = [3_000_000, 2_000_000, 9_000_000, 500_000]
    p = linear_profile(fwd, bwd, nbytes, 0.3, 1e-6)
    # MG-WFBP indexes layers from the input: layer l = bucket n-1-l.
    back_l, size_l = bwd[::-1], [float(x) for x in nbytes[::-1]]
    # Compared under MG-WFBP's name: its Algorithm 1; the exact optimum of its model is a named option.
    for method in ("paper", "optimal"):
        groups = mgwfbp_merge(back_l, size_l, 0.3, 1e-6, method=method)
        cfg = {"extra": {"mgwfbp_method": method}}
        assert simulate(p, "mgwfbp", cfg).iteration_s == pytest.approx(
            sum(fwd) + mgwfbp_time(back_l, size_l, 0.3, 1e-6, groups))
    paper = mgwfbp_merge(back_l, size_l, 0.3, 1e-6, method="paper")
    assert simulate(p, "mgwfbp").iteration_s == pytest.approx(sum(fwd) + mgwfbp_time(back_l, size_l, 0.3, 1e-6, paper))
    plan = usbyte_plan_for(p, "a", DeftConfig(partition_numel=250_000))
    r = simulate(p, "usbyte", DeftConfig(partition_numel=250_000))
    assert r.iteration_s == pytest.approx(plan.iteration_s)


# ------------------------------------------------------------------------------------------------- schedules
def two_bucket_delayed(link_of_bucket0: str) -> tuple[Profile, Schedule]:
    """Cycle 2, one update merging both iterations, all-reduced during the next cycle's position 0."""
    p = make_profile([1.0, 2.0], [2.0, 1.0], [{"a": 3.0, "b": 3.0}, {"a": 4.0, "b": 4.0}],
                     links=(Link("a", "nccl"), Link("b", "gloo")))
    s = Schedule(cycle=2, links=("a", "b"), bucket_numel=(250, 250), bucket_nbytes=(1000, 1000),
                 stages=(StagePlan(0, "forward", (CommTask(1, 1, "a"),)),
                         StagePlan(0, "backward", (CommTask(0, 1, link_of_bucket0),)),
                         StagePlan(1, "forward"), StagePlan(1, "backward")),
                 updates=(Update((0, 1), 2),))
    return p, s


def test_delayed_update_schedule_hand_computed() -> None:
    # Position 0 (iteration start S): bucket 1 of the previous group on link a at [S, S+4]; bucket 0
    # launched at backward start S+3 queues behind it: [S+4, S+7]; the update after position 0 waits
    # for both: 7. Position 1 sends nothing and waits for nothing: 6. Cycle 13, 6.5 per iteration.
    p, s = two_bucket_delayed("a")
    r = simulate_schedule(p, s)
    assert r.iteration_s == pytest.approx(6.5)
    assert r.bubble_ratio == pytest.approx(1 / 13)
    assert r.link_utilization == pytest.approx({"a": 7 / 13, "b": 0.0})
    assert r.updates_per_iteration == pytest.approx(0.5)
    assert r.meta["converged"]
    # Bucket 0 on the second link runs [S+3, S+6]: everything hides, the compute bound (6) is reached.
    p, s = two_bucket_delayed("b")
    r = simulate_schedule(p, s)
    assert r.iteration_s == pytest.approx(6.0)
    assert r.bubble_ratio == pytest.approx(0.0, abs=1e-12)
    # Synchronous WFBP on one link: bucket 0 [5, 8], bucket 1 [8, 12]: 12.
    assert simulate(p, "wfbp").iteration_s == pytest.approx(12.0)


def test_next_forward_does_not_wait_for_old_gradients() -> None:
    p, s = two_bucket_delayed("a")
    r = simulate_schedule(p, s)
    t = 4  # position 0 of a steady-state cycle
    fwd = next(e for e in r.events if e.kind == "forward" and e.iteration == t and e.bucket == 1)
    comm = next(e for e in r.events if e.kind == "comm" and e.stage_iteration == t and e.bucket == 1)
    assert comm.iteration == t - 1  # the group that ended in the previous iteration
    assert comm.start_s == pytest.approx(fwd.start_s)  # launched at the forward stage's start
    assert fwd.end_s < comm.end_s  # bucket 1's forward ran without waiting for its gradient's all-reduce
    step = next(e for e in r.events if e.kind == "update" and e.iteration == t)
    assert step.start_s == pytest.approx(max(c.end_s for c in r.events if c.kind == "comm" and c.iteration == t - 1))


def test_synchronous_schedule_equals_wfbp() -> None:
    p = vgg19()
    sched = synchronous_schedule(tuple(b.numel for b in p.buckets), tuple(b.nbytes for b in p.buckets), ("nccl",))
    assert simulate_schedule(p, sched).iteration_s == pytest.approx(simulate(p, "wfbp").iteration_s)


def test_schedule_must_match_profile() -> None:
    p = vgg19()
    sched = synchronous_schedule((1, 2), (4, 8), ("nccl",))
    with pytest.raises(ContractError, match="bucket_nbytes"):
        simulate_schedule(p, sched)
    sched = synchronous_schedule(tuple(b.numel for b in p.buckets), tuple(b.nbytes for b in p.buckets), ("ib0",))
    with pytest.raises(ContractError, match="ib0"):
        simulate_schedule(p, sched)


# ------------------------------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("name", ["vgg19", "resnet101", "gpt2"])
def test_invariants_on_reference_profiles(name: str) -> None:
    p = Profile.load(PROFILES / f"{name}.json")
    bound = p.forward_s + p.backward_s
    results = {s: simulate(p, s) for s in SCHEMES}
    for scheme, r in results.items():
        assert r.compute_bound_s == pytest.approx(bound)
        assert r.iteration_s >= bound * (1 - 1e-9), scheme
        assert 0.0 <= r.bubble_ratio < 1.0
        assert r.bubble_ratio == pytest.approx(1 - bound / r.iteration_s, abs=1e-6)
        for link, u in r.link_utilization.items():
            assert 0.0 <= u <= 1.0 + 1e-9, (scheme, link)
        # One all-reduce at a time per link.
        for link in p.link_names:
            bars = sorted((e.start_s, e.end_s) for e in r.events if e.row == link)
            assert all(b[0] >= a[1] - 1e-12 for a, b in itertools.pairwise(bars))
        if scheme != "deft":
            # Synchronous schemes send all gradients every iteration on the primary link.
            assert r.iteration_s >= p.total_comm_s() * 0.99
            assert r.link_utilization[p.links[1].name] == 0.0
    ddp = results["ddp"].iteration_s
    assert results["deft"].iteration_s <= min(r.iteration_s for r in results.values()) + 1e-9
    assert results["deft"].iteration_s <= bound * 1.02  # at (or within 2% of) the compute bound
    assert results["deft"].iteration_s < ddp


def test_epsilon_zero_keeps_one_update_per_iteration() -> None:
    r = simulate(vgg19(), "deft", DeftConfig(epsilon=0.0))
    assert r.updates_per_iteration == 1.0
    assert r.meta["schedule"].batch_sequence == (1,)
    # Two links and no hard barrier on reordering still beat DDP's single link.
    assert r.iteration_s < simulate(vgg19(), "ddp").iteration_s


def test_unknown_scheme() -> None:
    with pytest.raises(ContractError, match="scheme"):
        simulate(vgg19(), "horovod")


def test_bad_extra_setting_names_the_field() -> None:
    with pytest.raises(ContractError, match=r"extra\.bytescheduler_credit_bytes"):
        simulate(vgg19(), "bytescheduler", {"extra": {"bytescheduler_credit_bytes": -1}})


# ------------------------------------------------------------------------------------------------- scaling
def test_scale_workers_follows_the_ring_model() -> None:
    alpha, beta, p_ws = 1e-3, 1e-9, 4
    p = linear_profile([1.0], [1.0], [8_000_000], alpha, beta)
    # Per-hop costs behind the fitted model at P = 4 workers: a = 2(P-1) al, b = 2(P-1)/P be.
    al, be = alpha / (2 * (p_ws - 1)), beta * p_ws / (2 * (p_ws - 1))
    for n in (2, 4, 16, 1024):
        q = scale_workers(p, n)
        a_n, b_n = 2 * (n - 1) * al, 2 * (n - 1) / n * be
        assert q.world_size == n
        assert q.comm_time(0, "a") == pytest.approx(a_n + b_n * 8_000_000)
        assert link_model(q, "a") == pytest.approx((a_n, b_n))
    assert scale_workers(p, 4) is p
    one = make_profile([1.0], [1.0], [{"a": 0.0}], world_size=1)
    with pytest.raises(ContractError, match="world_size"):
        scale_workers(one, 8)


def test_ring_factors_at_n_and_int8_profiles_are_not_rescaled() -> None:
    # from two ranks: start-ups x (N - 1), transfers x 2 (N - 1) / N
    assert ring_factors(2, 4) == pytest.approx((3.0, 1.5))
    assert ring_factors(2, 8) == pytest.approx((7.0, 1.75))
    assert ring_factors(4, 8) == pytest.approx((7 / 3, 1.75 / 1.5))
    assert ring_factors(4, 4) == (1.0, 1.0)
    with pytest.raises(ContractError):
        ring_factors(1, 4)
    # eight ranks on two cores: each of the 14 steps waits for its ranks, (8 / 2)² as long as at two
    assert ring_factors(2, 8, cores=2) == pytest.approx((7.0 * 16, 1.75))
    assert ring_factors(2, 2, cores=2) == (1.0, 1.0)
    assert ring_factors(4, 8, cores=8) == ring_factors(4, 8)  # a core each: the plain ring
    # int8's bytes per element change with the world size (its gather path grows with N): not rescaled
    coded = dataclasses.replace(linear_profile([1.0], [1.0], [8_000_000], 1e-3, 1e-9), codec="int8")
    with pytest.raises(ContractError, match="int8"):
        scale_workers(coded, 8)


def test_more_workers_never_faster_for_ddp() -> None:
    p = vgg19()
    times = [simulate(p, "ddp", workers=n).iteration_s for n in (2, 16, 128, 1024)]
    assert times == sorted(times)
    assert simulate(p, "ddp", workers=16).iteration_s == pytest.approx(simulate(p, "ddp").iteration_s)


# ------------------------------------------------------------------------------------------------- profiles
def test_vgg19_reference_profile_is_table_ii() -> None:
    doc = json.loads((PROFILES / "vgg19.json").read_text())
    assert doc["source"] == "reference" and doc["world_size"] == 16
    p = vgg19()
    us = 1e6
    # Table II totals (microseconds), Table I's 37 / 93 / 258 ms.
    assert round(p.forward_s * us) == 37166
    assert round(p.backward_s * us) == 93119
    assert round(p.total_comm_s("nccl") * us) == 257725
    # Our bucket 0 is the paper's bucket 6 (nearest the output).
    assert [round(t.backward_s * us) for t in p.times] == [162, 484, 2319, 4872, 12786, 72496]
    assert p.total_comm_s("gloo") == pytest.approx(1.65 * p.total_comm_s("nccl"))
    assert sum(b.numel for b in p.buckets) == 143_667_240  # torchvision's vgg19


# ------------------------------------------------------------------------------------------------- contention
def _contending(p: Profile, rho: dict[str, float]) -> Profile:
    return dataclasses.replace(p, links=tuple(dataclasses.replace(lk, backend="gloo", contention=rho.get(lk.name, 0.0))
                                              for lk in p.links))


def test_a_contending_link_slows_the_compute_it_overlaps_by_hand() -> None:
    # two_bucket_delayed("b"), link a contending (1: compute at half speed while a is busy). Position 0
    # starts at S: bucket 1's send on a runs [S, S+4] beside bucket 1's forward (2 s of work at half
    # speed: [S, S+4]); bucket 0's forward [S+4, S+5]; the backward starts at S+5 and launches bucket
    # 0's send on b [S+5, S+8] (b does not contend): backward [S+5, S+8]; the update waits for b: S+8.
    # Position 1 sends nothing: 6. Cycle 14, 7 per iteration (6 without contention).
    p, s = two_bucket_delayed("b")
    r = simulate_schedule(_contending(p, {"a": 1.0}), s)
    assert r.iteration_s == pytest.approx(7.0)
    fwd = next(e for e in r.events if e.kind == "forward" and e.iteration == 4 and e.bucket == 1)
    assert fwd.end_s - fwd.start_s == pytest.approx(4.0)
    # both links contending: the backward runs beside b's send [S+5, S+8]: bucket 0's 2 s of work
    # take [S+5, S+8.5] (1.5 done by S+8, 0.5 at full speed), bucket 1's [S+8.5, S+9.5]. Cycle 15.5.
    r = simulate_schedule(_contending(p, {"a": 1.0, "b": 1.0}), s)
    assert r.iteration_s == pytest.approx(7.75)


def test_contention_costs_nothing_where_no_send_overlaps_the_compute() -> None:
    # one bucket: its all-reduce runs after the backward, beside no compute (test above: 6.5)
    p = _contending(make_profile([2.0], [3.0], [{"a": 1.5}]), {"a": 5.0})
    for scheme in BASELINES:
        assert simulate(p, scheme).iteration_s == pytest.approx(6.5), scheme


def test_contention_round_trips_and_is_checked() -> None:
    p = _contending(make_profile([2.0], [3.0], [{"a": 1.5}]), {"a": 0.25})
    assert Profile.from_dict(p.to_dict()).links[0].contention == 0.25
    plain = _contending(p, {})
    assert "contention" not in plain.to_dict()["links"][0]  # absent when 0: older profiles' digests stand
    with pytest.raises(ContractError, match=r"links\[0\]\.contention"):
        _contending(p, {"a": -1.0})


# ------------------------------------------------------------------------------------------------------- drag
def _sharing(p: Profile, contention: dict[str, float], drag: dict[str, float]) -> Profile:
    return dataclasses.replace(p, links=tuple(dataclasses.replace(
        lk, backend="gloo", contention=contention.get(lk.name, 0.0), drag=drag.get(lk.name, 0.0)) for lk in p.links))


def test_a_dragged_link_sends_slower_beside_the_compute_by_hand() -> None:
    # two_bucket_delayed("a"), link a dragged by 1 (its sends at half speed while the compute runs).
    # Position 0 starts at S and computes without a wait until S+6; bucket 1's send on a (4 s) does 3 s
    # of its work by S+6 and the last 1 s alone: [S, S+7]; bucket 0's (3 s), queued behind it, runs with
    # the compute waiting for it: [S+7, S+10]; the update at S+10. Position 1 sends nothing: 6. Cycle 16,
    # 8 per iteration (6.5 without drag).
    p, s = two_bucket_delayed("a")
    r = simulate_schedule(_sharing(p, {}, {"a": 1.0}), s)
    assert r.iteration_s == pytest.approx(8.0)
    sends = sorted((e for e in r.events if e.kind == "comm" and e.stage_iteration == 4), key=lambda e: e.start_s)
    assert [e.end_s - e.start_s for e in sends] == pytest.approx([7.0, 3.0])
    # bucket 0 on b, both dragged: b's send from S+3 does 1.5 s by S+6 and 1.5 s alone: the update at S+7.5
    # (a's send ends at S+7). Cycle 13.5.
    p, s = two_bucket_delayed("b")
    assert simulate_schedule(_sharing(p, {}, {"a": 1.0, "b": 1.0}), s).iteration_s == pytest.approx(6.75)


def test_drag_and_contention_together_slow_both_sides_by_hand() -> None:
    # two_bucket_delayed("b"), link b contending and dragged by 1. The backward (3 s of work) starts at
    # S+3 beside b's send of bucket 0 (3 s): each runs at half speed beside the other and both end at
    # S+9; the update at S+9. Position 1: 6. Cycle 15, 7.5 per iteration (contention alone: 7.75, the
    # send's end at S+8 leaving the backward's last half second at full speed).
    p, s = two_bucket_delayed("b")
    r = simulate_schedule(_sharing(p, {"b": 1.0}, {"b": 1.0}), s)
    assert r.iteration_s == pytest.approx(7.5)
    send = next(e for e in r.events if e.kind == "comm" and e.stage_iteration == 4 and e.row == "b")
    last = next(e for e in r.events if e.kind == "backward" and e.iteration == 4 and e.bucket == 1)
    assert (send.end_s - send.start_s, last.end_s) == pytest.approx((6.0, send.end_s))


def test_drag_costs_nothing_where_no_send_overlaps_the_compute() -> None:
    p = _sharing(make_profile([2.0], [3.0], [{"a": 1.5}]), {}, {"a": 5.0})
    for scheme in BASELINES:
        assert simulate(p, scheme).iteration_s == pytest.approx(6.5), scheme


def test_drag_round_trips_and_is_checked() -> None:
    p = _sharing(make_profile([2.0], [3.0], [{"a": 1.5}]), {}, {"a": 0.5})
    assert Profile.from_dict(p.to_dict()).links[0].drag == 0.5
    assert "drag" not in _sharing(p, {}, {}).to_dict()["links"][0]  # absent when 0: older digests stand
    with pytest.raises(ContractError, match=r"links\[0\]\.drag"):
        _sharing(p, {}, {"a": math.inf})


@pytest.mark.parametrize("scheme", ["usbyte", "mgwfbp", "bytescheduler"])
def test_more_drag_is_never_faster(scheme: str) -> None:
    p = vgg19()
    times = [simulate(_sharing(p, {}, {lk.name: d for lk in p.links}), scheme).iteration_s for d in (0.0, 0.3, 1.5)]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(times)), times
    assert times[-1] > times[0], times
    assert times[0] == pytest.approx(simulate(p, scheme).iteration_s)


@pytest.mark.parametrize("scheme", ["usbyte", "mgwfbp"])
def test_more_contention_is_never_faster(scheme: str) -> None:
    # schemes whose all-reduces overlap VGG19's compute: slower as the links contend more
    p = vgg19()
    times = [simulate(_contending(p, {lk.name: rho for lk in p.links}), scheme).iteration_s
             for rho in (0.0, 0.2, 1.0)]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(times)), times
    assert times[-1] > times[0], times
    assert times[0] == pytest.approx(simulate(p, scheme).iteration_s)  # 0: as without the field


# -------------------------------------------------------------------------------------------- the last rank's lag
def _lagging(p: Profile, lag: float) -> Profile:
    return dataclasses.replace(p, links=tuple(dataclasses.replace(lk, lag_s=lag) for lk in p.links))


def test_a_send_on_an_idle_link_waits_the_whole_lag() -> None:
    # the only send is the exposed tail (test above: 6.5); the last rank reaches it 0.5 after this one
    p = _lagging(make_profile([2.0], [3.0], [{"a": 1.5}]), 0.5)
    for scheme in BASELINES:
        assert simulate(p, scheme).iteration_s == pytest.approx(7.0), scheme


def test_every_send_that_finds_its_link_idle_waits_the_lag() -> None:
    # bucket 0's send (2 + 1 from t = 3) still ends under bucket 1's backward (until 7); bucket 1's,
    # handed at 7 to an idle link, waits its 1 too: 7 + 1 + 3. DDP fuses both buckets into one message,
    # which waits once: 7 + 1 + 5.
    p = _lagging(make_profile([1.0, 1.0], [1.0, 4.0], [{"a": 2.0}, {"a": 3.0}]), 1.0)
    assert simulate(p, "wfbp").iteration_s == pytest.approx(11.0)
    assert simulate(p, "ddp").iteration_s == pytest.approx(13.0)
    # a schedule's sends as well: each bucket on its own when ready, the step after both (10 without the lag)
    s = synchronous_schedule((250, 250), (1000, 1000), ("a",), ("a", "a"))
    assert simulate_schedule(_lagging(p, 0.0), s).iteration_s == pytest.approx(10.0)
    assert simulate_schedule(p, s).iteration_s == pytest.approx(11.0)


def test_a_send_queued_behind_another_has_met_its_lag_before_it_starts() -> None:
    # the link is the bound: bucket 0's send is handed at 3 and held 1 + 3 (until 7); bucket 1's, handed at
    # 3.5, starts at 7, when the last rank reached it long ago: 7 + 3 = 10, one lag over the 9 without it
    # (a lag added to every send's length would give 11).
    p = make_profile([1.0, 1.0], [1.0, 0.5], [{"a": 3.0}, {"a": 3.0}])
    assert simulate(p, "wfbp").iteration_s == pytest.approx(9.0)
    assert simulate(_lagging(p, 1.0), "wfbp").iteration_s == pytest.approx(10.0)


def test_the_lag_round_trips_and_is_checked(caplog: pytest.LogCaptureFixture) -> None:
    p = _lagging(make_profile([2.0], [3.0], [{"a": 1.5}]), 0.25)
    assert Profile.from_dict(p.to_dict()).links[0].lag_s == 0.25
    assert "lag_s" not in _lagging(p, 0.0).to_dict()["links"][0]  # absent when 0: older profiles' digests stand
    with pytest.raises(ContractError, match=r"links\[0\]\.lag_s"):
        _lagging(p, -0.1)
    # an older deft's wait per iteration is not a lag per send: read, said, and not priced
    doc = _lagging(p, 0.0).to_dict()
    doc["links"][0]["wait_s"] = 0.5
    with caplog.at_level("WARNING", logger="deft.profile"):
        old = Profile.from_dict(doc, "old.json")
    assert old.links[0].lag_s == 0.0 and "old.json: links[0].wait_s" in caplog.text


# ------------------------------------------------------------------------------------------------ the step
def test_the_step_runs_on_the_compute_stream_after_the_sends_it_waits_for() -> None:
    # 2 forward + 3 backward + the exposed 1.5 send, then a 0.5 s step before the next forward: 7.0 where
    # the step waits for every send (torch DDP); where only the next forward waits for its bucket's send
    # (ByteScheduler, US-Byte) the step runs beside it: 6.5
    p = dataclasses.replace(make_profile([2.0], [3.0], [{"a": 1.5}]), step_s=0.5)
    for scheme in ("ddp", "wfbp", "mgwfbp"):
        assert simulate(p, scheme).iteration_s == pytest.approx(7.0), scheme
    for scheme in ("bytescheduler", "usbyte"):
        assert simulate(p, scheme).iteration_s == pytest.approx(6.5), scheme
    assert simulate(p, "ddp").compute_bound_s == pytest.approx(5.5)
    # a lag-free update of the one bucket, waited for just before its forward: the step (5 -> 5.5) runs
    # beside the send (5 -> 6.5), and the next forward waits for the send: 6.5
    lagfree = Schedule(cycle=1, links=("a",), bucket_numel=(250,), bucket_nbytes=(1000,),
                       stages=(StagePlan(0, "forward"), StagePlan(0, "backward", (CommTask(0, 0, "a"),))),
                       updates=(Update((0,), 0, finish_in_forward=True, deferred=(0,)),))
    assert simulate_schedule(p, lagfree).iteration_s == pytest.approx(6.5)
    assert simulate_schedule(dataclasses.replace(p, step_s=2.0), lagfree).iteration_s == pytest.approx(7.0)


def test_the_step_scales_with_the_compute_round_trips_and_is_checked() -> None:
    p = dataclasses.replace(make_profile([2.0], [3.0], [{"a": 1.5}]), step_s=0.5)
    assert p.scaled(compute=2.0, comm=3.0).step_s == pytest.approx(1.0)
    assert Profile.from_dict(p.to_dict()).step_s == 0.5
    assert "step_s" not in make_profile([2.0], [3.0], [{"a": 1.5}]).to_dict()  # absent when 0: digests stand
    with pytest.raises(ContractError, match=r"step_s"):
        dataclasses.replace(p, step_s=-1.0)


def test_a_results_events_read_as_the_tuple_of_bars_they_stand_for() -> None:
    # the one bucket's timeline in torch DDP's scheme: forward, backward, the step, then its send
    r = simulate(make_profile([2.0], [3.0], [{"a": 1.5}]), "ddp")
    bars = tuple(r.events)
    assert r.events == bars and len(r.events) == len(bars) and r.events[0] == bars[0] and r.events[-1:] == bars[-1:]
    first = [e for e in bars if e.iteration == 0]
    assert [(e.row, e.kind) for e in first] == [("compute", "forward"), ("compute", "backward"),
                                                ("compute", "update"), ("a", "comm")]
    assert [(e.start_s, e.end_s) for e in first] == [(0.0, 2.0), (2.0, 5.0), (6.5, 6.5), (5.0, 6.5)]


# -------------------------------------------------------------------------------------- the ranks' verdict
def _guarded(fwd: list[float], bwd: list[float], comm: list[dict[str, float]], on: bool = True,
             step_s: float = 0.0) -> Profile:
    """A primary link ``a`` (start-up 0.25) and a second link ``b``, guarded where ``on``."""
    links = (Link("a", "gloo", None, 0.25, 0.0), Link("b", "gloo", guarded=on))
    return dataclasses.replace(make_profile(fwd, bwd, comm, links=links), step_s=step_s)


def test_the_step_waits_for_the_verdict_on_the_guarded_sends_it_needs() -> None:
    # bucket 0 on b (3 -> 5), bucket 1 on a (4 -> 4.5): the step at 5; guarded, the verdict is handed to
    # the idle primary at 5 and lasts its start-up: 5.25
    times = ([1.0, 1.0], [1.0, 1.0], [{"a": 0.5, "b": 2.0}, {"a": 0.5, "b": 2.0}])
    s = synchronous_schedule((250, 250), (1000, 1000), ("a", "b"), ("b", "a"))
    assert simulate_schedule(_guarded(*times, on=False), s).iteration_s == pytest.approx(5.0)
    assert simulate_schedule(_guarded(*times), s).iteration_s == pytest.approx(5.25)


def test_a_verdict_queues_behind_what_the_primary_carries() -> None:
    # bucket 1's send on a runs 4 -> 7; the verdict on bucket 0's (3 -> 5) waits behind it: 7 -> 7.25,
    # where a verdict beside the primary's sends would end at 5.25 and leave the step at 7
    times = ([1.0, 1.0], [1.0, 1.0], [{"a": 3.0, "b": 2.0}, {"a": 3.0, "b": 2.0}])
    s = synchronous_schedule((250, 250), (1000, 1000), ("a", "b"), ("b", "a"))
    assert simulate_schedule(_guarded(*times, on=False), s).iteration_s == pytest.approx(7.0)
    res = simulate_schedule(_guarded(*times), s)
    assert res.iteration_s == pytest.approx(7.25)
    verdicts = [e for e in res.events if e.kind == "verdict" and e.iteration == 0]
    assert [(e.row, e.start_s, e.end_s) for e in verdicts] == [("a", pytest.approx(7.0), pytest.approx(7.25))]


@pytest.mark.parametrize(("backend", "at_once", "verdict", "second"), [
    ("gloo", 1, (8.0, 8.25), (8.25, 11.25)),  # one at a time (link_queue): ahead of bucket 2's send
    ("gloo", 0, (11.0, 11.25), (8.0, 11.0)),  # gloo's two at once: bucket 2's runs beside bucket 1's
    ("gloo", 2, (11.0, 11.25), (8.0, 11.0)),
    ("nccl", 0, (8.0, 8.25), (8.25, 11.25)),  # one stream per group
])
def test_a_verdict_waits_for_the_sends_the_primarys_group_runs_at_once(
        backend: str, at_once: int, verdict: tuple[float, float], second: tuple[float, float]) -> None:
    # bucket 0 on b (4 -> 6.5); buckets 1 and 2 on a, 3 each: 5 -> 8, and bucket 2's, handed at 6, queued
    # behind it. The verdict on bucket 0's send, handed at 6.5, waits for what a's group has on the wire:
    # bucket 1's send, and bucket 2's where the group runs two at once; it goes ahead of any other
    times = ([1.0] * 3, [1.0] * 3, [{"a": 3.0, "b": 2.5}] * 3)
    s = synchronous_schedule((250,) * 3, (1000,) * 3, ("a", "b"), ("b", "a", "a"))
    p = _guarded(*times)
    p = dataclasses.replace(p, links=(dataclasses.replace(p.links[0], backend=backend, sends_at_once=at_once),
                                      p.links[1]))
    res = simulate_schedule(p, s)
    on_a = sorted((e.kind, e.bucket, e.start_s, e.end_s) for e in res.events if e.row == "a" and e.iteration == 0)
    assert on_a == sorted([("comm", 1, 5.0, 8.0), ("verdict", -1, *verdict),
                           ("comm", 2, pytest.approx(second[0]), pytest.approx(second[1]))])


def test_verdicts_queued_on_the_primary_go_in_the_order_handed() -> None:
    # bucket 0's send holds a 4 -> 14; on b, bucket 1's (the step's) ends at 6 and bucket 2's (deferred to
    # the next forward) at 7: the step's verdict, handed first, runs first (14 -> 14.25) and the step
    # with it, the forward's after it (14.25 -> 14.5), before the next forward
    times = ([1.0] * 3, [1.0] * 3, [{"a": 10.0, "b": 1.0}] * 3)
    lagfree = Schedule(cycle=1, links=("a", "b"), bucket_numel=(250,) * 3, bucket_nbytes=(1000,) * 3,
                       stages=(StagePlan(0, "forward"), StagePlan(0, "backward", (
                           CommTask(0, 0, "a"), CommTask(1, 0, "b"), CommTask(2, 0, "b")))),
                       updates=(Update((0,), 0, finish_in_forward=True, deferred=(2,)),))
    res = simulate_schedule(_guarded(*times), lagfree)
    first = [(e.kind, e.start_s, e.end_s) for e in sorted(res.events, key=lambda e: e.start_s)
             if e.iteration == 0 and e.kind in ("verdict", "update")]
    assert first == [("verdict", 14.0, 14.25), ("update", 14.25, 14.25), ("verdict", 14.25, 14.5)]
    assert res.iteration_s == pytest.approx(14.5)


def test_a_lag_free_forward_waits_for_the_verdict_on_its_deferred_send() -> None:
    # the lag-free case of the step's test above: the next forward waits for the deferred send (6.5) and,
    # on a guarded link, for the verdict after it on the idle primary: 6.75
    times = ([2.0], [3.0], [{"a": 1.5, "b": 1.5}])
    lagfree = Schedule(cycle=1, links=("a", "b"), bucket_numel=(250,), bucket_nbytes=(1000,),
                       stages=(StagePlan(0, "forward"), StagePlan(0, "backward", (CommTask(0, 0, "b"),))),
                       updates=(Update((0,), 0, finish_in_forward=True, deferred=(0,)),))
    assert simulate_schedule(_guarded(*times, on=False, step_s=0.5), lagfree).iteration_s == pytest.approx(6.5)
    assert simulate_schedule(_guarded(*times, step_s=0.5), lagfree).iteration_s == pytest.approx(6.75)


def test_sends_at_once_round_trips_defaults_to_the_backends_and_is_checked() -> None:
    p = _guarded([2.0], [3.0], [{"a": 1.5, "b": 1.5}])
    assert [lk.at_once() for lk in p.links] == [2, 2]  # gloo's two worker threads per group
    assert Link("n", "nccl").at_once() == 1
    one = dataclasses.replace(p, links=(dataclasses.replace(p.links[0], sends_at_once=1), p.links[1]))
    assert [lk.at_once() for lk in Profile.from_dict(one.to_dict()).links] == [1, 2]
    assert "sends_at_once" not in p.to_dict()["links"][0]  # absent when 0: older profiles' digests stand
    with pytest.raises(ContractError, match=r"links\[0\]\.sends_at_once"):
        dataclasses.replace(p, links=(dataclasses.replace(p.links[0], sends_at_once=-1), p.links[1]))
    doc = one.to_dict()
    doc["links"][0]["sends_at_once"] = -2
    with pytest.raises(ContractError, match=r"^p\.json: links\[0\]\.sends_at_once: expected an integer >= 0"):
        Profile.from_dict(doc, "p.json")


def test_guarded_round_trips_and_never_marks_the_primary() -> None:
    p = _guarded([2.0], [3.0], [{"a": 1.5, "b": 1.5}])
    assert [lk.guarded for lk in Profile.from_dict(p.to_dict()).links] == [False, True]
    assert "guarded" not in p.to_dict()["links"][0]  # absent when False: older profiles' digests stand
    with pytest.raises(ContractError, match=r"links\[0\]\.guarded"):
        dataclasses.replace(p, links=(Link("a", "gloo", guarded=True), Link("b", "gloo")))
