"""The preserver's feedback loop and re-check, driven by a fake planner that returns real Schedules."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

from deft.config import DeftConfig, LinkConfig
from deft.errors import ContractError
from deft.preserver.feedback import (
    REJECTIONS,
    STALENESS_MARGIN,
    PreserveResult,
    Recheck,
    WalkStats,
    passes,
    prefer_lag_free,
    preserve,
    progress_kept,
    schedule_ratio,
)
from deft.preserver.gaussian_walk import convergence_ratio, expected_loss_after
from deft.preserver.noise import NoiseEstimate
from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.runtime.planning import make_schedule
from deft.schedule import CommTask, Schedule, StagePlan, Update
from deft.solver.plan import EXACT_BUDGET_LIMITS, WORK_PER_SECOND, ExactBudget, no_delay_plan, plan

N_BUCKETS = 3
LINKS = ("primary", "second")


def profile() -> Profile:
    return Profile(
        buckets=tuple(Bucket(i, (f"p{i}",), 1000, 4000) for i in range(N_BUCKETS)),
        times=tuple(BucketTimes(0.01, 0.02, {"primary": 0.05, "second": 0.08}) for _ in range(N_BUCKETS)),
        links=(Link("primary", "gloo"), Link("second", "gloo")),
        world_size=2, source="synthetic")


def schedule_with(k: tuple[int, ...], delayed: bool = False) -> Schedule:
    """A valid cyclic schedule with batch sequence ``k``.

    Each group's buckets go out in the backward of its last iteration, or (``delayed``) bucket 0
    there and the others in the next iteration's forward, with the update one iteration later.
    """
    cycle = sum(k)
    groups, start = [], 0
    for x in k:
        groups.append(tuple(range(start, start + x)))
        start += x
    comms: dict[tuple[int, str], list[CommTask]] = {(p, s): [] for p in range(cycle) for s in ("forward", "backward")}
    updates = []
    for pos in groups:
        last = pos[-1]
        if delayed:
            comms[(last, "backward")].append(CommTask(0, 0, "primary"))
            for b in range(1, N_BUCKETS):
                comms[((last + 1) % cycle, "forward")].append(CommTask(b, 1, LINKS[b % 2]))
            updates.append(Update(pos, last + 1))
        else:
            for b in range(N_BUCKETS):
                comms[(last, "backward")].append(CommTask(b, 0, LINKS[b % 2]))
            updates.append(Update(pos, last))
    stages = tuple(StagePlan(p, s, tuple(comms[(p, s)])) for p in range(cycle) for s in ("forward", "backward"))
    return Schedule(cycle=cycle, links=LINKS, bucket_numel=(1000,) * N_BUCKETS, bucket_nbytes=(4000,) * N_BUCKETS,
                    stages=stages, updates=tuple(updates), meta={"solver": "fake"})


class FakePlanner:
    """Returns the given batch sequences in order, one per call, and records the capacity scales."""

    def __init__(self, sequences: list[tuple[int, ...]], delayed: bool = False) -> None:
        self.sequences = sequences
        self.delayed = delayed
        self.scales: list[float] = []
        self.no_delay_calls = 0

    def plan(self, profile: Profile, config: DeftConfig, *, capacity_scale: float = 1.0) -> Schedule:
        assert isinstance(profile, Profile) and isinstance(config, DeftConfig)
        self.scales.append(capacity_scale)
        k = self.sequences[min(len(self.scales) - 1, len(self.sequences) - 1)]
        return schedule_with(k, delayed=self.delayed and any(x > 1 for x in k))

    def no_delay(self, profile: Profile, config: DeftConfig) -> Schedule:
        self.no_delay_calls += 1
        return schedule_with((1,))


# Far from S*: lr*mu = 0.002 against a loss of 1, so the walk is nearly deterministic and a cycle that
# merges j extra iterations loses about j * lr * mu of progress: ratio ~ 1 - 0.002 j.
STATS = WalkStats(loss=1.0, mu=0.2, sigma=5.0, lr=0.01, batch=256)


def run(sequences, **cfg) -> tuple[PreserveResult, FakePlanner]:
    fp = FakePlanner(sequences)
    config = DeftConfig(**cfg)
    return preserve(profile(), config, STATS, planner=fp.plan, no_delay_planner=fp.no_delay), fp


def test_first_try_accepted_records_meta():
    res, fp = run([(1, 2, 1)], epsilon=0.01)
    ratio = convergence_ratio(1.0, 0.2, 5.0, 0.01, 256, (1, 2, 1))
    assert 0.99 < ratio < 1.0  # ~0.998: within the default tolerance
    # the no-delay plan is asked once, for the comparison of predicted times (both unknown here: 0)
    assert res.accepted and fp.scales == [1.0] and fp.no_delay_calls == 1
    assert res.schedule.batch_sequence == (1, 2, 1)
    rec = res.schedule.meta["preserver"]
    assert rec["ratio"] == pytest.approx(ratio) and rec["tries"] == 1 and rec["accepted"] is True
    assert rec["capacity_scale"] == 1.0 and rec["stats"]["mu"] == 0.2
    assert res.schedule.meta["solver"] == "fake"  # the planner's own meta is kept


def test_grows_capacity_until_a_try_passes():
    # epsilon 0.003: (4,) and (3, 1) lose 3 and 2 steps' progress (ratios ~0.994, ~0.996): rejected;
    # (1, 2, 1) loses one (~0.998): accepted at the third try. ((2, 2) would be (2,) written twice: one
    # step lost per 2 iterations, the steady state of a 2-cycle, see test_ratio_and_decision_do_not_...)
    seqs = [(4,), (3, 1), (1, 2, 1), (1, 1, 1, 1)]
    res, fp = run(seqs, epsilon=0.003, capacity_growth=1.5)
    assert fp.scales == pytest.approx([1.0, 1.5, 2.25])
    deft_tries = [t for t in res.tries if t.kind == "deft"]
    assert [t.k for t in deft_tries] == seqs[:3]
    for t in deft_tries:
        r = convergence_ratio(1.0, 0.2, 5.0, 0.01, 256, t.k)
        assert t.ratio == pytest.approx(r)
        assert t.accepted == (0.997 <= r <= 1.003)
    assert [t.accepted for t in deft_tries] == [False, False, True]
    # Lag-free merges (real accumulate_plan on this profile) are tried first, up to MAX_MERGE = 2
    # iterations: (2,) passes; the fake DeFT schedule, predicted no slower, is kept.
    assert [(t.k, t.accepted) for t in res.tries if t.kind == "accumulate"] == [((2,), True)]
    assert res.accepted and res.schedule.batch_sequence == (1, 2, 1)
    rec = res.schedule.meta["preserver"]
    assert rec["tries"] == 3 and rec["capacity_scale"] == pytest.approx(2.25) and len(rec["log"]) == 4


def test_falls_back_to_no_delay_after_max_tries(caplog):
    caplog.set_level(logging.INFO, logger="deft.preserver")
    res, fp = run([(4,)], epsilon=0.003, preserver_max_tries=10)
    assert len(fp.scales) == 10
    assert fp.scales == pytest.approx([1.25 ** i for i in range(10)])
    assert fp.no_delay_calls == 1
    assert not res.accepted and res.schedule.batch_sequence == (1,)
    assert len(res.tries) == 12 and res.tries[-1].kind == "no_delay"  # 10 deft, 1 lag-free merge, 1 fallback
    rec = res.schedule.meta["preserver"]
    assert rec["accepted"] is False and rec["tries"] == 10 and "no schedule within" in rec["reason"]
    assert sum("preserver try" in r.message for r in caplog.records) == 10
    assert any(r.levelno == logging.WARNING and "falling back" in r.message for r in caplog.records)


def test_epsilon_zero_uses_no_delay_without_solving():
    res, fp = run([(2, 2)], epsilon=0.0)
    assert fp.scales == [] and fp.no_delay_calls == 1
    assert res.accepted and res.schedule.batch_sequence == (1,)
    assert res.schedule.meta["preserver"]["ratio"] == 1.0


def test_epsilon_zero_accepts_only_all_ones():
    # With mu = sigma = 0 every sequence has ratio exactly 1, but epsilon = 0 still forbids merging.
    flat = WalkStats(loss=0.5, mu=0.0, sigma=0.0, lr=0.1, batch=64)
    assert schedule_ratio(schedule_with((2, 1)), flat) == 1.0
    assert not passes((2, 1), 1.0, 0.0)
    assert passes((1, 1, 1), 1.0, 0.0)
    assert passes((2, 1), 1.0, 1e-9)


def test_epsilon_zero_wins_over_disabled_preserver():
    res, fp = run([(2, 2)], epsilon=0.0, preserver=False)
    assert fp.scales == [] and res.schedule.batch_sequence == (1,)


def test_preserver_disabled_takes_first_plan_untested():
    res, fp = run([(4,), (1, 1)], epsilon=0.003, preserver=False)
    assert fp.scales == [1.0] and fp.no_delay_calls == 0
    assert res.accepted and res.schedule.batch_sequence == (4,)
    rec = res.schedule.meta["preserver"]
    assert rec["reason"] == "preserver disabled" and rec["ratio"] < 0.997  # it would have failed


def test_unknown_stats_keeps_no_delay_then_recheck_asks_to_replan():
    fp = FakePlanner([(2, 2)])
    config = DeftConfig(epsilon=0.01, recheck_every=50)
    res = preserve(profile(), config, None, planner=fp.plan, no_delay_planner=fp.no_delay)
    assert fp.scales == [] and not res.accepted and res.stats_were_unknown
    assert res.schedule.batch_sequence == (1,)
    rc = Recheck(config, res)
    assert rc.check(50, None) is None
    d = rc.check(100, STATS)
    assert d is not None and d.replan and "known now" in d.reason


def test_recheck_detects_drift_out_of_tolerance():
    config = DeftConfig(epsilon=0.01, recheck_every=100)
    res, _ = run([(1, 2, 1)], epsilon=0.01, recheck_every=100)
    rc = Recheck(config, res)
    assert rc.check(99, STATS) is None and rc.check(0, STATS) is None
    d = rc.check(100, STATS)
    assert d is not None and not d.replan and d.ratio == pytest.approx(schedule_ratio(res.schedule, STATS))
    # Later the loss has fallen to 0.2 with the same gradient: one step's progress lr*mu = 0.002 is now
    # 1% of the loss, and (1, 2, 1) loses ~1.1% > epsilon.
    later = WalkStats(loss=0.2, mu=0.2, sigma=5.0, lr=0.01, batch=256)
    assert schedule_ratio(res.schedule, later) < 0.99
    d = rc.check(200, later)
    assert d is not None and d.replan and "outside" in d.reason


def test_recheck_finds_faster_sequence_that_now_passes():
    res, _ = run([(4,), (1, 2, 1)], epsilon=0.003)
    config = DeftConfig(epsilon=0.003, recheck_every=10)
    assert res.accepted and res.schedule.batch_sequence == (1, 2, 1)
    rc = Recheck(config, res)
    d = rc.check(10, STATS)
    assert d is not None and not d.replan
    # The gradient weakened (mu 10x smaller): merging 3 iterations costs ~0.06%, (4,) passes now.
    weak = WalkStats(loss=1.0, mu=0.02, sigma=5.0, lr=0.01, batch=256)
    d = rc.check(20, weak)
    assert d is not None and d.replan and "(4,)" in d.reason


def test_recheck_after_failed_fallback_retries_rejected_sequences():
    res, _ = run([(4,)], epsilon=0.003, preserver_max_tries=2)
    assert not res.accepted and not res.stats_were_unknown
    rc = Recheck(DeftConfig(epsilon=0.003, recheck_every=5), res)
    assert not rc.check(5, STATS).replan  # type: ignore[union-attr]
    assert rc.check(10, WalkStats(loss=1.0, mu=0.02, sigma=5.0, lr=0.01, batch=256)).replan  # type: ignore[union-attr]


def test_recheck_inactive_without_preserver_or_at_epsilon_zero():
    for cfg in ({"epsilon": 0.0}, {"preserver": False}):
        res, _ = run([(4,)], **cfg)
        rc = Recheck(DeftConfig(recheck_every=1, **cfg), res)
        assert rc.check(1, WalkStats(loss=0.01, mu=1.0, sigma=1.0, lr=0.5, batch=8)) is None


def test_meta_is_strict_json_and_round_trips():
    res, _ = run([(4,)], epsilon=0.003, preserver_max_tries=3)
    doc = res.schedule.to_dict()
    text = json.dumps(doc, allow_nan=False)
    back = Schedule.from_dict(json.loads(text))
    assert back.meta["preserver"] == res.schedule.meta["preserver"]
    assert back.digest() == res.schedule.digest()


def test_planner_returning_garbage_is_rejected():
    config = DeftConfig()
    fp = FakePlanner([(1,)])
    with pytest.raises(ContractError, match="plan"):
        preserve(profile(), config, STATS, planner=lambda p, c, **kw: "nope", no_delay_planner=fp.no_delay)
    with pytest.raises(ContractError, match="no_delay_plan"):
        preserve(profile(), DeftConfig(epsilon=0.0), STATS, planner=fp.plan,
                 no_delay_planner=lambda p, c: schedule_with((2,)))


def test_walk_stats_validation_and_from_estimate():
    with pytest.raises(ContractError) as e:
        WalkStats(loss=1.0, mu=0.1, sigma=1.0, lr=0.0, batch=32)
    assert e.value.field == "lr"
    with pytest.raises(ContractError) as e:
        WalkStats(loss=1.0, mu=0.1, sigma=1.0, lr=0.1, batch=-32)
    assert e.value.field == "batch"
    est = NoiseEstimate(mu=0.3, sigma=2.0, trace=5.0, rho=4.0 / 0.3, mu_stderr=0.01, rho_stderr=0.1,
                        steps=20.0, samples=5120.0, unknown_steps=0)
    ws = WalkStats.from_estimate(0.7, est, lr=0.05, batch=256)
    assert ws == WalkStats(loss=0.7, mu=0.3, sigma=2.0, lr=0.05, batch=256)
    assert WalkStats.from_estimate(0.7, None, 0.05, 256) is None
    no_sigma = NoiseEstimate(mu=0.3, sigma=None, trace=5.0, rho=None, mu_stderr=0.01, rho_stderr=None,
                             steps=1.0, samples=256.0, unknown_steps=0)
    assert WalkStats.from_estimate(0.7, no_sigma, 0.05, 256) is None


def test_default_planner_is_the_solver():
    res = preserve(profile(), DeftConfig(epsilon=0.0), STATS)
    assert res.accepted and all(k == 1 for k in res.schedule.batch_sequence)
    assert math.isclose(res.schedule.meta["preserver"]["ratio"], 1.0)


# mu = 10: one lost step is 10% of the loss, no merged update survives the walk's ratio; mu = 0.5:
# lr * mu = 0.005 against a loss of 1, merging pairs loses ~0.5%, within epsilon, but the walk is
# deterministic there (one step's progress instead of two), so the merge (predicted 0.80 of the no-delay
# plan's time) is slower to a target, and a stale DeFT try (its lag an offset, not a rate) passes; mu =
# 0.05, sigma = 50: noise dominates, a faster DeFT try passes.
@pytest.mark.slow
@pytest.mark.parametrize(("mu", "sigma", "rejections"),
                         [(0.5, 5.0, {"walk ratio", "slower to target"}),
                          (10.0, 5.0, {"no faster", "walk ratio"}),
                          (0.05, 50.0, {"slower to target"})])
def test_loop_with_the_real_solver(mu, sigma, rejections):
    res = real_solver_loop(mu, sigma)
    assert {t.rejected_on for t in res.tries} - {None} == rejections  # each rule was exercised


def real_solver_loop(mu: float, sigma: float = 5.0) -> PreserveResult:
    """Communication-bound profile (comm/compute ~2 on the primary link) through deft.solver.plan.

    Only invariants are asserted, not the solver's particular K: capacities grow geometrically, each
    try's verdict follows the rules in their order (no faster than the no-delay plan; the walk's
    ratio; the walk's progress per second), recomputed here from the walk's primitives, the loop stops
    at the first accepted try, and the result is that try, a lag-free merge or the no-delay plan.
    """
    n = 6
    prof = Profile(buckets=tuple(Bucket(i, (f"p{i}",), 10**6, 4 * 10**6) for i in range(n)),
                   times=tuple(BucketTimes(0.01, 0.02, {"primary": 0.06, "second": 0.09}) for _ in range(n)),
                   links=(Link("primary", "gloo"), Link("second", "gloo")), world_size=2, source="synthetic")
    # No curvature here: opted in to stale schedules judged by the walk alone, whose rules this exercises
    # (without the opt-in they are refused: tests/test_preserver_safe_path.py).
    config = DeftConfig(epsilon=0.01, links=(LinkConfig("primary"), LinkConfig("second")), stale_unchecked=True)
    stats = WalkStats(loss=1.0, mu=mu, sigma=sigma, lr=0.01, batch=256)
    res = preserve(prof, config, stats)
    nd = no_delay_plan(prof, config).predicted_iteration_s
    assert res.no_delay_s == nd > 0
    tried = [t for t in res.tries if t.capacity_scale is not None]
    assert [t.capacity_scale for t in tried] == pytest.approx([1.25 ** i for i in range(len(tried))])
    for t in [*tried, *(t for t in res.tries if t.kind == "accumulate")]:
        # The ratio counts only the updates applied within the cycle (stale ones lag behind).
        ratio = convergence_ratio(1.0, mu, sigma, 0.01, 256, t.applied, window=t.window)
        assert t.ratio == pytest.approx(ratio)
        # progress: every update of the period, a rate (the lag is an offset), over as many plain steps
        period = t.window
        ups = [u for u in t.schedule.updates if min(u.positions) < period]
        mine = expected_loss_after(1.0, [len(u.positions) * 256 for u in ups], mu, sigma, 0.01)
        base = expected_loss_after(1.0, [256] * period, mu, sigma, 0.01)
        assert t.progress == pytest.approx((1.0 - mine) / (1.0 - base))
        t_s = t.schedule.predicted_iteration_s
        expected = ("no faster" if t_s >= nd else "walk ratio" if not passes(t.k, ratio, 0.01)
                    else "slower to target" if t.progress < t_s / nd else None)
        assert (t.rejected_on, t.accepted) == (expected, expected is None)
    assert all(not t.accepted for t in tried[:-1]) and len(tried) <= config.preserver_max_tries
    # every rejected try says why, in the preserver's own words
    assert all(t.rejected_on in REJECTIONS for t in res.tries if not t.accepted and t.kind != "no_delay")
    merges = [t for t in res.tries if t.kind == "accumulate" and t.accepted]
    assert res.accepted
    # The accepted DeFT try, a passing lag-free merge preferred to it, or the no-delay plan when every
    # try the walk would pass was no faster than it.
    assert res.schedule.batch_sequence in [t.k for t in tried if t.accepted] + [t.k for t in merges] + [(1,)]
    assert res.schedule.predicted_iteration_s <= nd
    assert 0.99 <= schedule_ratio(res.schedule, stats) <= 1.01
    return res


@pytest.mark.slow
def test_strong_gradient_keeps_every_update():
    # mu = 10 (one lost step is 10% of the loss): not merged, not delayed
    res = real_solver_loop(10.0)
    assert set(res.schedule.batch_sequence) == {1}


def test_stale_updates_lower_the_ratio():
    """K = (1, 1) with every update one iteration late: the paper's K-only ratio is exactly 1, but the
    cycle applies one update fewer within itself than plain DDP, and the walk sees that lag."""
    stale = schedule_with((1, 1), delayed=True)
    assert stale.batch_sequence == (1, 1) and stale.updates[-1].apply_after == stale.cycle
    assert convergence_ratio(1.0, 0.2, 5.0, 0.01, 256, (1, 1)) == 1.0
    lagged = schedule_ratio(stale, STATS)
    # Its steady state repeats every iteration: one step of B for DDP, none landing within it here.
    assert lagged == pytest.approx(convergence_ratio(1.0, 0.2, 5.0, 0.01, 256, (), window=1))
    assert lagged < 1.0
    # A gradient ten times stronger makes the lag cost ten times more progress.
    strong = WalkStats(loss=1.0, mu=2.0, sigma=5.0, lr=0.01, batch=256)
    assert 1.0 - schedule_ratio(stale, strong) > 5 * (1.0 - lagged)
    # Same K without the lag: ratio 1, accepted at any epsilon > 0, rejected at epsilon 0 only if merged.
    assert schedule_ratio(schedule_with((1, 1)), STATS) == 1.0
    assert not passes((1, 1), lagged, 0.0)


def test_lag_free_merge_preferred_unless_stale_is_much_faster():
    merged = dataclasses.replace(schedule_with((2,)), predicted_iteration_s=1.0)
    stale = schedule_with((1, 1), delayed=True)
    assert prefer_lag_free(merged, dataclasses.replace(stale, predicted_iteration_s=0.9))
    assert not prefer_lag_free(merged, dataclasses.replace(stale, predicted_iteration_s=0.99 - STALENESS_MARGIN))
    # Between lag-free schedules only speed counts.
    fresh = schedule_with((1, 2, 1))
    assert prefer_lag_free(merged, dataclasses.replace(fresh, predicted_iteration_s=1.01))
    assert not prefer_lag_free(merged, dataclasses.replace(fresh, predicted_iteration_s=0.99))


# ------------------------------------------------------------------------------------------------
# A re-check after an accepted lag-free merge, and ratios that do not depend on how a cycle is written

VGG19 = Path(__file__).resolve().parents[1] / "examples" / "profiles" / "vgg19.json"


def test_recheck_after_a_lag_free_merge_accepted_when_every_deft_try_failed() -> None:
    """Every DeFT try fails and the lag-free merge K = (2,) is accepted: the re-check is still built
    from that result (no DeFT schedule to take its timing from) and later re-plans once the rejected
    tries pass."""
    from deft.preserver.stability import OptimizerSpec

    # Noise-dominated (sigma 400 at batch 512): a merge keeps its progress (a deterministic walk would
    # find it slower to a target than the no-delay plan). The DeFT tries are stale, and plain SGD at lr
    # 0.05 one iteration late has the edge 1 / 0.05 = 20 (delayed GD x' = x - a x_prev, a < 1), lag-free
    # 2 / 0.05 = 40: curvature 20 rejects every stale try as unstable and keeps the lag-free merge.
    config = DeftConfig(preserver_max_tries=2)
    stats = WalkStats(loss=2.0, mu=0.3, sigma=400.0, lr=0.05, batch=512, curvature=20.0,
                      optimizer=OptimizerSpec("sgd", 0.05))
    res = preserve(Profile.load(VGG19), config, stats)
    deft_tries = [t for t in res.tries if t.kind == "deft"]
    assert len(deft_tries) == 2 and [t.rejected_on for t in deft_tries] == ["unstable", "unstable"]
    assert res.accepted and res.schedule.meta["mode"] == "accumulate" and res.schedule.batch_sequence == (2,)
    rc = Recheck(config, res)
    same = rc.check(config.recheck_every, stats)
    assert same is not None and not same.replan  # the rejected DeFT tries still fail
    # The sharpest curvature fell to 1: the rejected stale DeFT schedules pass now.
    calm = dataclasses.replace(stats, curvature=1.0)
    later = rc.check(2 * config.recheck_every, calm)
    assert later is not None and later.replan and "previously rejected" in later.reason


def unrolled(s: Schedule, times: int) -> Schedule:
    """The same steady state written as a cycle ``times`` times as long: every stage and update repeated,
    shifted by whole cycles (an origin still names the group that many iterations back)."""
    n = s.cycle
    stages = tuple(StagePlan(r * n + sp.position, sp.stage, sp.comms) for r in range(times) for sp in s.stages)
    updates = tuple(Update(tuple(p + r * n for p in u.positions), u.apply_after + r * n)
                    for r in range(times) for u in s.updates)
    return dataclasses.replace(s, cycle=n * times, stages=stages, updates=updates)


def test_ratio_and_decision_do_not_depend_on_unrolling_a_cycle() -> None:
    """The VGG-19 plan (cycle 3, K = (2, 1), both updates one or two iterations late) and the same plan
    written as cycle 6 are one steady state; they must get one ratio and one decision. A ratio counting
    only the updates applied inside the written cycle would give 0.99247 (passes at epsilon 0.01) at
    cycle 3 and 0.98862 (fails) at cycle 6 with these statistics."""
    stats = WalkStats(loss=2.0, mu=0.3, sigma=20.0, lr=0.025, batch=512)
    s = plan(Profile.load(VGG19), DeftConfig())
    for sched in (s, schedule_with((1, 2, 1), delayed=True), schedule_with((2, 1))):
        for times in (2, 3):
            longer = unrolled(sched, times)
            assert longer.batch_sequence == sched.batch_sequence * times
            r1, r2 = schedule_ratio(sched, stats), schedule_ratio(longer, stats)
            assert abs(r1 - r2) <= 1e-12
            assert passes(sched.batch_sequence, r1, 0.01) == passes(longer.batch_sequence, r2, 0.01)


def test_accepted_schedule_no_faster_than_no_delay_gives_way() -> None:
    # The knapsack at a large capacity ends with K = [1] sending everything in backward (predicted 520
    # ms, the testbed case), while the no-delay plan (lag-free forward stage) is predicted 460 ms: the
    # preserver runs the no-delay plan. Faster DeFT schedules keep their place.
    slow_k1 = dataclasses.replace(schedule_with((1,)), predicted_iteration_s=0.520, meta={"solver": "k1"})
    nd = dataclasses.replace(schedule_with((1,)), predicted_iteration_s=0.460)

    def slow_merge(p: Profile, c: DeftConfig, k: int) -> Schedule:  # lag-free merges, predicted slower
        return dataclasses.replace(schedule_with((k,)), predicted_iteration_s=10.0)

    res = preserve(profile(), DeftConfig(epsilon=0.01), STATS, planner=lambda p, c, capacity_scale=1.0: slow_k1,
                   no_delay_planner=lambda p, c: nd, accumulate_planner=slow_merge)
    assert res.accepted and res.schedule.predicted_iteration_s == 0.460 and "no faster" in res.reason
    assert res.tries[-1].kind == "no_delay" and res.tries[-1].accepted
    fast = dataclasses.replace(schedule_with((1, 2, 1)), predicted_iteration_s=0.300)
    res = preserve(profile(), DeftConfig(epsilon=0.01), STATS, planner=lambda p, c, capacity_scale=1.0: fast,
                   no_delay_planner=lambda p, c: nd, accumulate_planner=slow_merge)
    assert res.accepted and res.schedule.batch_sequence == (1, 2, 1)


def test_unstable_stale_schedule_is_rejected_whatever_its_ratio():
    from deft.preserver.stability import OptimizerSpec

    # SGD lr 0.02 momentum 0.9: one iteration late the edge is (1 - 0.9) / 0.02 = 5 (closed form in
    # deft.preserver.stability); without delay 2 (1 + 0.9) / 0.02 = 190. Curvature 20 > 0.5 x 5.
    spec = OptimizerSpec.sgd(0.02, momentum=0.9)
    fp = FakePlanner([(1, 2, 1)], delayed=True)
    stats = WalkStats(loss=1.0, mu=0.2, sigma=5.0, lr=0.01, batch=256, curvature=20.0, optimizer=spec)
    res = preserve(profile(), DeftConfig(epsilon=0.2, preserver_max_tries=2), stats, planner=fp.plan,
                   no_delay_planner=fp.no_delay)
    deft_tries = [t for t in res.tries if t.kind == "deft"]
    assert [t.accepted for t in deft_tries] == [False, False]
    assert all(t.stability is not None and not t.stability.stable for t in deft_tries)
    assert res.schedule.batch_sequence != (1, 2, 1)
    logged = res.schedule.meta["preserver"]["log"]
    assert [e["stability"]["stable"] for e in logged if e["kind"] == "deft"] == [False, False]
    calm = dataclasses.replace(stats, curvature=1.0)  # below half of every edge: the walk decides
    res = preserve(profile(), DeftConfig(epsilon=0.2, preserver_max_tries=2), calm,
                   planner=FakePlanner([(1, 2, 1)], delayed=True).plan, no_delay_planner=fp.no_delay)
    assert [t.accepted for t in res.tries if t.kind == "deft"] == [True]
    with pytest.raises(ContractError, match="optimizer"):
        WalkStats(loss=1.0, mu=0.2, sigma=5.0, lr=0.01, batch=256, curvature=20.0)


def test_lag_free_merge_is_never_rejected_on_stability():
    from deft.preserver.stability import OptimizerSpec

    # Curvature 150 is beyond half of DDP's edge of 190, yet a lag-free merge has DDP's edge: kept.
    spec = OptimizerSpec.sgd(0.02, momentum=0.9)
    stats = WalkStats(loss=1.0, mu=0.2, sigma=5.0, lr=0.01, batch=256, curvature=150.0, optimizer=spec)
    res = preserve(profile(), DeftConfig(epsilon=0.2, preserver_max_tries=1), stats,
                   planner=FakePlanner([(2, 2)]).plan, no_delay_planner=FakePlanner([(1,)]).no_delay)
    deft_try = next(t for t in res.tries if t.kind == "deft")
    assert deft_try.accepted and deft_try.stability is not None and deft_try.stability.stable
    assert deft_try.stability.radius < 1.0


def test_disabled_preserver_records_but_does_not_enforce_stability():
    from deft.preserver.stability import OptimizerSpec

    spec = OptimizerSpec.sgd(0.02, momentum=0.9)
    stats = WalkStats(loss=1.0, mu=0.2, sigma=5.0, lr=0.01, batch=256, curvature=20.0, optimizer=spec)
    res = preserve(profile(), DeftConfig(epsilon=0.2, preserver=False), stats,
                   planner=FakePlanner([(1, 2, 1)], delayed=True).plan)
    assert res.schedule.batch_sequence == (1, 2, 1)
    assert res.tries[0].stability is not None and not res.tries[0].stability.stable


def test_recheck_replans_a_stale_schedule_that_became_unstable():
    from deft.preserver.stability import OptimizerSpec

    fp = FakePlanner([(1, 2, 1)], delayed=True)
    config = DeftConfig(epsilon=0.2, recheck_every=10, stale_unchecked=True)
    res = preserve(profile(), config, STATS, planner=fp.plan, no_delay_planner=fp.no_delay)
    assert res.accepted and res.schedule.batch_sequence == (1, 2, 1)  # no curvature, opted in: the walk decides
    rc = Recheck(config, res)
    spec = OptimizerSpec.sgd(0.02, momentum=0.9)
    calm = dataclasses.replace(STATS, curvature=1.0, optimizer=spec)
    d = rc.check(10, calm)
    assert d is not None and not d.replan
    sharp = dataclasses.replace(STATS, curvature=20.0, optimizer=spec)
    d = rc.check(20, sharp)
    assert d is not None and d.replan and "unstable" in d.reason


def stale_planner(profile: Profile, config: DeftConfig, *, capacity_scale: float = 1.0) -> Schedule:
    """K = (1, 1), every update one iteration late, at any capacity."""
    return schedule_with((1, 1), delayed=True)


def test_with_the_stability_check_the_walk_stops_charging_the_lag() -> None:
    """Staleness is priced once. Without a curvature the walk counts a stale update's lag as
    missing progress; with the curvature and the optimizer known the stability check prices it, and the
    walk counts every update of the period: a stale-by-one ``K = (1, 1)`` makes as many steps of ``B``
    as DDP (ratio exactly 1), and a stale ``K = (1, 2, 1)`` gets the ratio of its merges alone."""
    from deft.preserver.stability import OptimizerSpec

    spec = OptimizerSpec.sgd(0.02, momentum=0.9)
    calm = dataclasses.replace(STATS, curvature=1.0, optimizer=spec)  # every edge far above 1
    stale = schedule_with((1, 1), delayed=True)
    assert schedule_ratio(stale, STATS) < 1.0  # lag priced (test_stale_updates_lower_the_ratio)
    assert schedule_ratio(stale, calm) == 1.0
    # (1, 2, 1) delayed: four steps of B against B, 2B, B, all counted.
    merged = schedule_with((1, 2, 1), delayed=True)
    expected = convergence_ratio(1.0, 0.2, 5.0, 0.01, 256, (1, 2, 1))
    assert schedule_ratio(merged, calm) == pytest.approx(expected)
    assert schedule_ratio(merged, STATS) < expected  # the lag priced on top of the merge
    # So at epsilon 0.01 the stable stale-by-one schedule is accepted, and rejected once the curvature
    # is beyond half its delayed edge (1 - 0.9) / 0.02 = 5.
    nd = FakePlanner([(1,)]).no_delay
    res = preserve(profile(), DeftConfig(epsilon=0.01, preserver_max_tries=1), calm,
                   planner=stale_planner, no_delay_planner=nd)
    deft_try = next(t for t in res.tries if t.kind == "deft")
    assert deft_try.accepted and deft_try.ratio == 1.0 and deft_try.rejected_on is None
    sharp = dataclasses.replace(calm, curvature=3.0)
    res = preserve(profile(), DeftConfig(epsilon=0.01, preserver_max_tries=1), sharp,
                   planner=stale_planner, no_delay_planner=nd)
    deft_try = next(t for t in res.tries if t.kind == "deft")
    assert not deft_try.accepted and deft_try.rejected_on == "unstable"
    assert res.schedule.meta["preserver"]["log"][-2]["rejected_on"] == "unstable"


@pytest.mark.parametrize(("opted_in", "rejected_on"), [(True, "walk ratio"), (False, "stability unchecked")])
def test_recheck_judges_rejected_tries_on_the_statistics_of_the_time(opted_in: bool, rejected_on: str) -> None:
    """A stale try rejected while the curvature was unknown (on its walk ratio, the lag priced, when
    opted in to unchecked stale schedules; else as unchecked) is found passing at the re-check once a
    stable curvature is known (the lag no longer charged)."""
    from deft.preserver.stability import OptimizerSpec

    strong = WalkStats(loss=1.0, mu=2.0, sigma=5.0, lr=0.01, batch=256)  # one lagged step: 2% of the loss
    config = DeftConfig(epsilon=0.01, recheck_every=10, preserver_max_tries=1, stale_unchecked=opted_in)
    res = preserve(profile(), config, strong, planner=stale_planner, no_delay_planner=FakePlanner([(1,)]).no_delay)
    assert [t.rejected_on for t in res.tries if t.kind == "deft"] == [rejected_on]
    assert res.schedule.batch_sequence == (1,)
    rc = Recheck(config, res)
    d = rc.check(10, strong)
    assert d is not None and not d.replan
    calm = dataclasses.replace(strong, curvature=1.0, optimizer=OptimizerSpec.sgd(0.02, momentum=0.9))
    d = rc.check(20, calm)
    assert d is not None and d.replan and "previously rejected K=(1, 1)" in d.reason


# ------------------------------------------------------------------------------------------------
# A schedule must not be slower to a target than the no-delay plan by the walk's own account

# Deterministic walk far from S* (sigma = 0): every step takes lr * mu = 0.002 off the loss of 1. Over a
# period of 2 iterations plain DDP reaches 0.996 and a merge of 2 (one step) 0.998: ratio 0.996 / 0.998
# (passes epsilon 0.01), progress kept 0.002 / 0.004 = 1/2.
DETERMINISTIC = WalkStats(loss=1.0, mu=0.2, sigma=0.0, lr=0.01, batch=256)


def _merge_against_no_delay(t_merge: float, epsilon: float, stats: WalkStats = DETERMINISTIC) -> PreserveResult:
    nd = dataclasses.replace(schedule_with((1,)), predicted_iteration_s=1.0)
    slow_deft = dataclasses.replace(schedule_with((1,)), predicted_iteration_s=1.2)

    def merge(p: Profile, c: DeftConfig, k: int) -> Schedule:
        return dataclasses.replace(schedule_with((k,)), predicted_iteration_s=t_merge)

    return preserve(profile(), DeftConfig(epsilon=epsilon, preserver_max_tries=1), stats,
                    planner=lambda p, c, capacity_scale=1.0: slow_deft, no_delay_planner=lambda p, c: nd,
                    accumulate_planner=merge)


def test_a_merge_the_walk_finds_slower_to_a_target_is_not_taken() -> None:
    merge = schedule_with((2,))
    assert schedule_ratio(merge, DETERMINISTIC) == pytest.approx(0.996 / 0.998)
    assert progress_kept(merge, DETERMINISTIC) == pytest.approx(0.5)
    # Half the progress per iteration in 0.51 of the time: behind the no-delay plan at any wall time.
    for eps in (0.01, 0.5):  # whatever epsilon allows
        res = _merge_against_no_delay(0.51, eps)
        (m,) = [t for t in res.tries if t.kind == "accumulate"]
        assert (m.accepted, m.rejected_on) == (False, "slower to target")
        assert res.accepted and res.schedule.batch_sequence == (1,) and res.schedule.predicted_iteration_s == 1.0
    # In 0.49 of the time it is ahead: taken.
    res = _merge_against_no_delay(0.49, 0.01)
    assert res.accepted and res.schedule.batch_sequence == (2,)
    # Noise-dominated (tau = lr sigma / sqrt(B) = 0.375 against lr mu = 0.002, near the rebound): one
    # step of the doubled batch rebounds less and keeps nearly all the progress of two (the walk: 0.91),
    # so the 0.51-time merge is taken.
    noisy = dataclasses.replace(DETERMINISTIC, sigma=600.0)
    assert progress_kept(merge, noisy) > 0.9
    assert _merge_against_no_delay(0.51, 0.01, noisy).schedule.batch_sequence == (2,)


def test_a_try_no_faster_than_the_no_delay_plan_is_not_judged_on_accuracy() -> None:
    from deft.preserver.stability import OptimizerSpec

    # The stale K = (1, 2, 1) is unstable at curvature 20 (edge 5 one iteration late, see
    # test_unstable_stale_schedule_is_rejected_whatever_its_ratio) but predicted slower than the
    # no-delay plan: it is dropped for that, the no-delay plan runs, accepted.
    spec = OptimizerSpec.sgd(0.02, momentum=0.9)
    stats = WalkStats(loss=1.0, mu=0.2, sigma=5.0, lr=0.01, batch=256, curvature=20.0, optimizer=spec)
    stale = dataclasses.replace(schedule_with((1, 2, 1), delayed=True), predicted_iteration_s=1.1)
    nd = dataclasses.replace(schedule_with((1,)), predicted_iteration_s=1.0)
    res = preserve(profile(), DeftConfig(epsilon=0.2, preserver_max_tries=2), stats,
                   planner=lambda p, c, capacity_scale=1.0: stale, no_delay_planner=lambda p, c: nd,
                   accumulate_planner=lambda p, c, k: dataclasses.replace(schedule_with((k,)),
                                                                         predicted_iteration_s=1.5))
    assert [t.rejected_on for t in res.tries] == ["no faster", "no faster", "no faster", None]
    assert res.tries[1].stability is not None and not res.tries[1].stability.stable  # still recorded
    assert res.accepted and res.schedule.predicted_iteration_s == 1.0 and "no faster" in res.reason
    assert [e["rejected_on"] for e in res.schedule.meta["preserver"]["log"]][:3] == ["no faster"] * 3
    # ... and the re-check does not offer it again: predicted times do not change.
    rc = Recheck(DeftConfig(epsilon=0.2), res)
    calm = dataclasses.replace(stats, curvature=0.1)
    decision = rc.check(rc.config.recheck_every, calm)
    assert decision is not None and not decision.replan


def test_recheck_replans_a_merge_the_walk_now_finds_slower_to_a_target() -> None:
    noisy = dataclasses.replace(DETERMINISTIC, sigma=600.0)  # as in the test above
    res = _merge_against_no_delay(0.51, 0.01, noisy)
    assert res.schedule.batch_sequence == (2,) and res.no_delay_s == 1.0
    rc = Recheck(DeftConfig(epsilon=0.01), res)
    still = rc.check(rc.config.recheck_every, noisy)
    assert still is not None and not still.replan
    later = rc.check(2 * rc.config.recheck_every, DETERMINISTIC)  # the gradient now dominates the noise
    assert later is not None and later.replan and "slower to a target" in later.reason


def test_a_stale_update_keeps_its_rate() -> None:
    # One iteration late, every update: the walk without a curvature charges the lag to the ratio, but
    # in the steady state the lag is an offset, so the progress per period (the rate) is plain DDP's.
    stale = schedule_with((1, 1), delayed=True)
    assert schedule_ratio(stale, STATS) < 1.0
    assert progress_kept(stale, STATS) == 1.0


def test_recheck_offers_a_merge_again_once_noise_dominates() -> None:
    # Rejected as slower to a target while the gradient dominates (progress 1/2 in 0.51 of the time);
    # once the walk is noise-dominated (as in the tests above) the merge keeps its progress: re-plan.
    res = _merge_against_no_delay(0.51, 0.01)
    assert res.schedule.batch_sequence == (1,)
    rc = Recheck(DeftConfig(epsilon=0.01), res)
    still = rc.check(rc.config.recheck_every, DETERMINISTIC)
    assert still is not None and not still.replan
    noisy = dataclasses.replace(DETERMINISTIC, sigma=600.0)
    later = rc.check(2 * rc.config.recheck_every, noisy)
    assert later is not None and later.replan and "previously rejected K=(2,)" in later.reason
    # A merge predicted slower than the running schedule is never offered, whatever the statistics.
    slow = _merge_against_no_delay(1.05, 0.01)
    rc = Recheck(DeftConfig(epsilon=0.01), slow)
    decision = rc.check(rc.config.recheck_every, noisy)
    assert decision is not None and not decision.replan


def test_tries_stop_at_one_that_delays_nothing_and_is_no_faster() -> None:
    # Capacity only grows from try to try, so after a try that delays and merges nothing every later try
    # delays nothing either: at one no faster than the no-delay plan the loop stops there (the no-delay
    # plan runs), even where a later try, planned, would have been faster.
    nd = dataclasses.replace(schedule_with((1,)), predicted_iteration_s=0.460)
    plans = {1.0: dataclasses.replace(schedule_with((1,)), predicted_iteration_s=0.520),
             1.25: dataclasses.replace(schedule_with((1, 2, 1)), predicted_iteration_s=0.300)}
    asked: list[float] = []

    def planner(p: Profile, c: DeftConfig, capacity_scale: float = 1.0) -> Schedule:
        asked.append(capacity_scale)
        return plans[capacity_scale]

    def slow_merge(p: Profile, c: DeftConfig, k: int) -> Schedule:
        return dataclasses.replace(schedule_with((k,)), predicted_iteration_s=10.0)

    res = preserve(profile(), DeftConfig(epsilon=0.01), STATS, planner=planner, no_delay_planner=lambda p, c: nd,
                   accumulate_planner=slow_merge)
    assert asked == [1.0]
    assert res.accepted and res.schedule.predicted_iteration_s == 0.460 and "no faster" in res.reason
    assert [t.kind for t in res.tries] == ["accumulate", "deft", "no_delay"]
    # A try no faster that delays (a stale schedule) does not stop them: the next capacity may delay less.
    asked.clear()
    plans[1.0] = dataclasses.replace(schedule_with((1, 2, 1), delayed=True), predicted_iteration_s=0.520)
    res = preserve(profile(), DeftConfig(epsilon=0.01), STATS, planner=planner, no_delay_planner=lambda p, c: nd,
                   accumulate_planner=slow_merge)
    assert asked == [1.0, 1.25]
    assert res.accepted and res.schedule.batch_sequence == (1, 2, 1) and res.schedule.predicted_iteration_s == 0.300
    # Nor does one that merges (K = 2) without staleness: it does not keep torch DDP's maths either.
    asked.clear()
    plans[1.0] = dataclasses.replace(schedule_with((2,)), predicted_iteration_s=0.520)
    res = preserve(profile(), DeftConfig(epsilon=0.01), STATS, planner=planner, no_delay_planner=lambda p, c: nd,
                   accumulate_planner=slow_merge)
    assert asked == [1.0, 1.25] and res.schedule.batch_sequence == (1, 2, 1)


def _cp_sat_work(res: PreserveResult) -> float:
    """CP-SAT work (deterministic units) the DeFT tries of a decision spent, from their schedules' records."""
    return sum(t.schedule.meta["solver_work"] for t in res.tries if t.kind == "deft" and t.schedule is not None)


@pytest.mark.slow
def test_the_tries_share_one_cp_sat_budget() -> None:
    """The default planner's tries share one ExactBudget: a decision's exact knapsacks spend at most
    EXACT_BUDGET_LIMITS knapsack budgets (plus the one solve that crosses the line), however many tries
    it takes; past that the later tries' knapsacks are the greedy's. With a budget per try (the
    planner given as plain ``plan``, the behaviour before) the same decision spends several times that.
    The stdlib char LM's profile (49 buckets) is one whose knapsacks CP-SAT cannot certify quickly;
    a small per-knapsack budget keeps the test short, a gap of 0.1 % makes CP-SAT search."""
    prof = Profile.load(Path(__file__).resolve().parents[1] / "examples" / "profiles" / "gpt2_stdlib_testbed.json")
    # stale tries judged by the walk alone: none is refused on the greedy's packing before CP-SAT
    cfg = DeftConfig(epsilon=0.01, solver_time_limit_s=0.02, solver_relative_gap=1e-3, stale_unchecked=True)
    stats = WalkStats(loss=2.0, mu=1.0, sigma=20.0, lr=0.05, batch=512)
    budget = ExactBudget.for_config(cfg)
    per_knapsack = WORK_PER_SECOND * cfg.solver_time_limit_s
    assert budget.units == pytest.approx(EXACT_BUDGET_LIMITS * per_knapsack)

    shared = preserve(prof, cfg, stats)
    own = preserve(prof, cfg, stats, planner=plan)
    deft_tries = [t for t in shared.tries if t.kind == "deft"]
    assert len(deft_tries) >= 2
    assert 0 < _cp_sat_work(shared) <= budget.units + per_knapsack
    assert any(t.schedule is not None and t.schedule.meta["exact_budget_exhausted"] for t in deft_tries)
    assert _cp_sat_work(own) > 2 * (budget.units + per_knapsack)


@pytest.mark.slow
def test_a_decision_trained_through_spends_no_more_cp_sat_than_half_its_window() -> None:
    """The first plan in the background (``lag_iters`` > 0) gets the CP-SAT work of half its plan-lag
    window, priced at the no-delay plan's iteration; planned in the iteration (0) the config's whole
    budget. On the stdlib char LM's profile the window's budget is the smaller one, so the decision
    made in the background spends less, within its window's units plus the one solve that crosses (a
    gap of 0.1 % makes CP-SAT search there)."""
    prof = Profile.load(Path(__file__).resolve().parents[1] / "examples" / "profiles" / "gpt2_stdlib_testbed.json")
    cfg = DeftConfig(epsilon=0.01, solver_time_limit_s=0.05, solver_relative_gap=1e-3, stale_unchecked=True)
    stats = WalkStats(loss=2.0, mu=1.0, sigma=20.0, lr=0.05, batch=512)
    window_s = 1 * no_delay_plan(prof, cfg).predicted_iteration_s
    units = WORK_PER_SECOND * 0.5 * window_s
    per_knapsack = WORK_PER_SECOND * cfg.solver_time_limit_s
    assert units < ExactBudget.for_config(cfg).units  # the window is the bound here

    background = make_schedule(cfg, prof, stats, None, None, lag_iters=1).preserved
    inline = make_schedule(cfg, prof, stats, None, None).preserved
    assert background is not None and inline is not None
    assert 0 < _cp_sat_work(background) <= units + per_knapsack
    assert _cp_sat_work(inline) > units + per_knapsack


def test_each_try_records_its_predicted_iteration_and_its_cp_sat_work() -> None:
    # Where a decision's time went: every try's record carries its schedule's predicted iteration, and
    # each planner try the CP-SAT work its knapsacks spent. VGG-19 at a tight gap makes CP-SAT search
    # (stale tries judged by the walk alone, so none is refused on the greedy's packing first).
    config = DeftConfig(preserver_max_tries=2, solver_relative_gap=1e-3, stale_unchecked=True)
    stats = WalkStats(loss=2.0, mu=0.3, sigma=400.0, lr=0.05, batch=512)
    res = preserve(Profile.load(VGG19), config, stats)
    docs = json.loads(json.dumps([t.to_dict() for t in res.tries], allow_nan=False))
    assert docs and all(d["predicted_s"] > 0 for d in docs)
    planned = [d for d in docs if d["kind"] == "deft"]
    assert planned and all(d["solver_work"] >= 0 for d in planned)
    assert 0 < sum(d["solver_work"] for d in planned) <= ExactBudget.for_config(config).units + WORK_PER_SECOND


def test_a_try_refused_as_unstable_on_the_greedys_packing_spends_no_cp_sat_and_decides_the_same() -> None:
    # The stdlib char LM, whose knapsacks CP-SAT cannot certify quickly, with a curvature that makes
    # every stale schedule unstable: the default planner judges each try on the greedy's packing first,
    # so the stale tries spend no CP-SAT; the same decision with the exact planner on every try (given
    # explicitly: no screen) spends CP-SAT on them and ends the same, verdict for verdict (a screened
    # try's schedule is the greedy's, whose K may differ from the exact one's).
    from deft.preserver.stability import OptimizerSpec

    prof = Profile.load(Path(__file__).resolve().parents[1] / "examples" / "profiles" / "gpt2_stdlib_testbed.json")
    cfg = DeftConfig(epsilon=0.01, solver_time_limit_s=0.05, solver_relative_gap=1e-3)
    stats = WalkStats(loss=2.0, mu=1.0, sigma=20.0, lr=0.05, batch=512, curvature=50.0,
                      optimizer=OptimizerSpec("sgd", 0.05, momentum=0.9))
    screened = preserve(prof, cfg, stats)
    exact = preserve(prof, cfg, stats, planner=functools.partial(plan, budget=ExactBudget.for_config(cfg)))
    unstable = [t for t in screened.tries if t.rejected_on == "unstable"]
    assert unstable and all(t.to_dict()["solver_work"] == 0.0 for t in unstable)
    assert sum(t.to_dict()["solver_work"] for t in exact.tries if t.rejected_on == "unstable") > 0
    assert [(t.kind, t.rejected_on) for t in screened.tries] == [(t.kind, t.rejected_on) for t in exact.tries]
    assert screened.schedule.digest() == exact.schedule.digest()


def test_with_the_greedy_solver_each_try_is_planned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # solver "greedy": the greedy's packing is the plan itself, so no try is planned twice (screen, then
    # planner); with the exact solver a try the screen does not settle is planned both ways.
    import deft.preserver.feedback as fb

    calls: list[float] = []
    real = fb.plan

    def counted(*args: Any, **kwargs: Any) -> Schedule:
        calls.append(kwargs["capacity_scale"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fb, "plan", counted)
    prof = Profile.load(VGG19)
    stats = WalkStats(loss=2.0, mu=0.3, sigma=400.0, lr=0.05, batch=512)
    greedy = preserve(prof, DeftConfig(preserver_max_tries=2, solver="greedy", stale_unchecked=True), stats)
    assert len(calls) == len([t for t in greedy.tries if t.kind == "deft"]) > 0
    calls.clear()
    exact = preserve(prof, DeftConfig(preserver_max_tries=2, stale_unchecked=True), stats)
    assert len(calls) == 2 * len([t for t in exact.tries if t.kind == "deft"]) > 0
