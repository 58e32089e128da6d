"""Each link's own factor, and the watch that re-opens a settled adaptation (deft.runtime.link_timing),
fed synthetic timings: no clock is read (the link clock reads one the tests move)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deft import DeftConfig
from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.runtime.adapt import Adapter, LinkWindow, Synchronous, calibrate
from deft.runtime.link_timing import (
    LINK_DRIFT,
    REOPEN_WINDOWS,
    LinkClock,
    SendTimes,
    Watch,
    WindowFigures,
    drift,
    link_factors,
    scale_links,
    timeline_record,
)
from deft.schedule import synchronous_schedule
from deft.solver.partition import profile_for_schedule
from deft.solver.plan import no_delay_plan
from deft.solver.simulate import simulate_schedule

MS = 1e-3
MB = 1_000_000
TOL = 0.10


def two_links() -> Profile:
    """Four 1 MB buckets; two gloo links of 10 ms per MB each (no direct times: the links' models)."""
    buckets = tuple(Bucket(i, (f"layer{3 - i}",), MB // 4, MB) for i in range(4))
    times = tuple(BucketTimes(5 * MS, 10 * MS, {}) for _ in range(4))
    links = (Link("primary", "gloo", None, 1e-4, 1e-8), Link("second", "gloo", None, 1e-4, 1e-8))
    return Profile(buckets, times, links, 2, "synthetic", model="four")


def alternating() -> tuple[Profile, object]:
    """The profile and torch DDP's schedule on it, buckets alternating between the links."""
    p = two_links()
    sched = synchronous_schedule(tuple(b.numel for b in p.buckets), tuple(b.nbytes for b in p.buckets),
                                 ("primary", "second"), ("primary", "second", "primary", "second"))
    return p, sched


def measured_on(truth: Profile, sends: dict[str, dict[int, int]]) -> dict[str, float]:
    """The seconds per byte a "machine" running ``truth`` shows for ``sends`` (its links' models)."""
    return {n: sum(k * truth.comm_time(b, n) for b, k in s.items()) / sum(k * truth.buckets[b].nbytes
                                                                          for b, k in s.items())
            for n, s in sends.items()}


SENDS = {"primary": {0: 3, 2: 3}, "second": {1: 3, 3: 3}}  # a window of 3 iterations of `alternating`


# -- per-link calibration ------------------------------------------------------------------------------------
def test_a_link_slower_than_its_profile_gets_its_own_factor() -> None:
    p, _ = alternating()
    truth = scale_links(p, {"second": 5.0}).scaled(1.0, 1.3)  # everything 1.3x, the second link 5x on top
    factors = link_factors(p, measured_on(truth, SENDS), SENDS)
    assert factors == {"primary": 1.0, "second": pytest.approx(5.0)}


def test_links_within_the_drift_band_share_one_factor() -> None:
    p, _ = alternating()
    truth = scale_links(p, {"second": 0.9 * LINK_DRIFT})
    assert link_factors(p, measured_on(truth, SENDS), SENDS) == {"primary": 1.0, "second": 1.0}
    faster = scale_links(p, {"second": 1.0 / (1.1 * LINK_DRIFT)})  # recovered: the factor goes below 1 too
    assert link_factors(p, measured_on(faster, SENDS), SENDS)["second"] == pytest.approx(1.0 / (1.1 * LINK_DRIFT))


def test_a_link_not_timed_keeps_the_common_factor() -> None:
    p, _ = alternating()
    only = {"primary": SENDS["primary"]}
    assert link_factors(p, measured_on(p.scaled(1.0, 3.0), only), only) == {"primary": 1.0, "second": 1.0}


def test_scale_links_scales_one_link_s_model_and_direct_times() -> None:
    p = two_links()
    direct = replace(p, times=tuple(replace(t, comm_s={"primary": 7 * MS, "second": 8 * MS}) for t in p.times))
    s = scale_links(direct, {"second": 4.0})
    assert s.comm_time(0, "second") == pytest.approx(32 * MS) and s.comm_time(0, "primary") == pytest.approx(7 * MS)
    assert s.link("second").beta_s_per_byte == pytest.approx(4e-8) and s.link("primary").beta_s_per_byte == 1e-8
    assert scale_links(p, {"primary": 1.0, "second": 1.0}) is p


def test_calibration_with_link_timing_recovers_the_slowed_link_and_the_measured_iteration() -> None:
    p, sched = alternating()
    cfg = DeftConfig()
    truth = scale_links(profile_for_schedule(p, sched, cfg), {"second": 5.0}).scaled(1.2, 1.5)
    measured = simulate_schedule(truth, sched).iteration_s
    window = LinkWindow(measured_on(truth, SENDS), SENDS)
    cal = calibrate(p, sched, cfg, measured, 1.2 * p.backward_s, window)
    assert cal.links == {"primary": 1.0, "second": pytest.approx(5.0)}
    assert cal.compute == pytest.approx(1.2) and cal.comm == pytest.approx(1.5, rel=2e-3)
    assert cal.predicted_s == pytest.approx(measured, rel=1e-3)
    corrected = cal.corrected(profile_for_schedule(p, sched, cfg))
    ratio = corrected.link("second").beta_s_per_byte / corrected.link("primary").beta_s_per_byte
    assert ratio == pytest.approx(5.0)  # the re-plan prices the second link 5x the primary
    # one factor for both links (no link timing) keeps them priced alike
    assert calibrate(p, sched, cfg, measured, 1.2 * p.backward_s).links == {}


# -- the watch -------------------------------------------------------------------------------------------------
BASE = WindowFigures(0.100, 0.002, {"primary": 1e-8, "second": 1e-8})


def window(iteration_s: float = 0.100, second: float = 1e-8, primary: float = 1e-8,
           spread_s: float = 0.002) -> WindowFigures:
    return WindowFigures(iteration_s, spread_s, {"primary": primary, "second": second})


def test_no_drift_stays_settled() -> None:
    w = Watch(TOL, BASE)
    noisy = [window(0.104, 1.2e-8), window(0.097, 0.9e-8, 1.1e-8), window(0.108, 1.3e-8)]
    assert [w.observe(x) for x in noisy * 5] == [None] * 15


def test_sustained_drift_on_one_link_reopens_naming_it() -> None:
    w = Watch(TOL, BASE)
    slowed = window(0.100, 5e-8)  # the iteration unchanged: only the link's time per byte
    whys = [w.observe(slowed) for _ in range(REOPEN_WINDOWS)]
    assert whys[:-1] == [None] * (REOPEN_WINDOWS - 1)
    assert whys[-1] is not None and "'second'" in whys[-1] and "5.00x" in whys[-1]


def test_a_one_off_spike_does_not_reopen() -> None:
    w = Watch(TOL, BASE)
    spikes = [window(0.250, 5e-8), window(), window(0.300), window(), window(second=8e-8), window()]
    assert [w.observe(x) for x in spikes] == [None] * len(spikes)


def test_recovery_reopens_back() -> None:
    # settled on the slow link (its window is the baseline); the link recovers: a drift the other way
    w = Watch(TOL, window(0.150, 5e-8))
    whys = [w.observe(window(0.150, 1e-8)) for _ in range(REOPEN_WINDOWS)]
    assert whys[-1] is not None and "'second'" in whys[-1] and "0.20x" in whys[-1]


def test_an_iteration_drift_reopens_only_beyond_the_window_s_own_noise() -> None:
    assert drift(BASE, window(0.130), TOL) is not None  # 30 % slower, spread 2 ms
    assert drift(BASE, window(0.130, spread_s=0.020), TOL) is None  # the same shift, within 2 x 20 ms of noise
    assert drift(BASE, window(0.108), TOL) is None  # within tolerance
    w = Watch(TOL, BASE)
    assert [w.observe(window(0.130)) for _ in range(REOPEN_WINDOWS)][-1] is not None


def test_settled_back_on_the_warm_up_only_a_link_reopens() -> None:
    # every plan measured slower than the warm-up's schedule: an iteration that moves with the links'
    # relative speeds unchanged re-opens a plain watch, not this one; a link that changes speed does
    plain, back = Watch(TOL, BASE), Watch(TOL, BASE, links_only=True)
    assert [plain.observe(window(0.250)) for _ in range(REOPEN_WINDOWS)][-1] is not None
    assert [back.observe(window(0.250)) for _ in range(3 * REOPEN_WINDOWS)] == [None] * (3 * REOPEN_WINDOWS)
    whys = [back.observe(window(0.250, 5e-8)) for _ in range(REOPEN_WINDOWS)]
    assert whys[-1] is not None and "'second'" in whys[-1]


def test_back_on_the_warm_up_chosen_on_faster_links_reopens_once_it_runs_slower_than_then() -> None:
    # every link slowed alike between the warm-up's measurement and the plans' windows: no link drifts
    # against another, but the warm-up's schedule itself now runs slower than the time it won on
    back = Watch(TOL, links_only=True, chosen_on=window(0.100))
    whys = [back.observe(window(0.250, 5e-8, 5e-8)) for _ in range(REOPEN_WINDOWS)]
    assert whys[:-1] == [None] * (REOPEN_WINDOWS - 1)
    assert whys[-1] is not None and "250.0 ms against the 100.0 ms it was chosen on" in whys[-1]


def test_back_on_the_warm_up_as_fast_as_chosen_the_comparison_ends() -> None:
    for first in (window(0.104), window(0.050)):  # within tolerance, or faster: not stale
        back = Watch(TOL, links_only=True, chosen_on=window(0.100))
        assert back.observe(first) is None and back.baseline == first and back.chosen_on is None
        # from then on only a link's drift re-opens, as for any settling back on the warm-up
        assert [back.observe(window(0.250)) for _ in range(3 * REOPEN_WINDOWS)] == [None] * (3 * REOPEN_WINDOWS)


def test_back_on_the_warm_up_a_slower_window_within_its_noise_is_not_stale() -> None:
    back = Watch(TOL, links_only=True, chosen_on=window(0.100, spread_s=0.050))
    assert [back.observe(window(0.180)) for _ in range(REOPEN_WINDOWS)] == [None] * REOPEN_WINDOWS


def test_back_on_the_warm_up_a_slowdown_its_other_path_explains_is_not_stale() -> None:
    # 40 % slower, beyond the tolerance and the noise, but within what the warm-up's iterations and the
    # running schedule's differ by on a short iteration (a link's drift, LINK_DRIFT, is what counts)
    back = Watch(TOL, links_only=True, chosen_on=window(0.100))
    assert [back.observe(window(0.140)) for _ in range(REOPEN_WINDOWS)] == [None] * REOPEN_WINDOWS


def test_without_a_baseline_the_first_window_becomes_it() -> None:
    w = Watch(TOL)
    assert w.observe(window(0.150, 5e-8)) is None and w.baseline == window(0.150, 5e-8)
    assert [w.observe(window(0.150, 5e-8)) for _ in range(4)] == [None] * 4


def test_links_timed_in_one_window_only_are_not_compared() -> None:
    one_link = WindowFigures(0.100, 0.002, {"primary": 1e-8})
    assert drift(BASE, one_link, TOL) is None and drift(one_link, window(second=9e-8), TOL) is None


# -- episodes ----------------------------------------------------------------------------------------------------
def test_a_reopened_episode_calibrates_within_tolerance_and_bounds_its_replans() -> None:
    p, sched = alternating()
    cfg = DeftConfig(adapt_max_replans=1)
    sched = replace(sched, predicted_iteration_s=simulate_schedule(p, sched).iteration_s)
    ad = Adapter(cfg, synchronous=Synchronous(sched, 0.5 * sched.predicted_iteration_s))
    ad.done = True  # settled (on the warm-up's schedule)
    ad.reopen()
    assert (ad.done, ad.replans, ad.best, ad.synchronous, ad.tried) == (False, 0, None, None, set())
    truth = scale_links(p, {"second": 5.0})
    window = LinkWindow(measured_on(truth, SENDS), SENDS)
    other = no_delay_plan(scale_links(p, {"second": 5.0}), cfg)
    plans = []

    def replan(q: Profile) -> object:
        plans.append(q)
        return replace(other, predicted_iteration_s=0.01)

    # the iteration within tolerance of its prediction: re-opened, it calibrates anyway
    new, corrected, rec = ad.decide(sched, p, sched.predicted_iteration_s, p.backward_s, replan, window,
                                    reopened=True)
    assert new is not None and rec["link_factors"]["second"] == pytest.approx(5.0)
    assert plans[0].link("second").beta_s_per_byte == pytest.approx(5 * plans[0].link("primary").beta_s_per_byte)
    assert corrected is not None and "synchronous_s" not in rec  # the stale warm-up time is not a candidate
    # the episode's bound: one re-plan, then it settles
    again, _, rec = ad.decide(new, p, 0.02, p.backward_s, replan, window)
    assert again is None and ad.done and "1 re-plans made" in rec["decision"]
    # a new episode has its own bound
    ad.reopen()
    assert not ad.done and ad.replans == 0


# -- the clock -------------------------------------------------------------------------------------------------
def test_the_clock_counts_completed_sends_only_and_only_while_on() -> None:
    clock = LinkClock({"primary": "gloo", "second": "gloo", "fast": "nccl"})
    f0, f1, f2, f3 = (torch.futures.Future() for _ in range(4))
    clock.launched(0, "primary", [f0], 0.0)  # off: not recorded
    clock.on = True
    clock.launched(1, "primary", [f1], 0.0)
    clock.launched(2, "second", [f2], 0.0)
    clock.launched(3, "fast", [f3], 0.0)  # NCCL: not timed
    f1.set_result(torch.zeros(1))
    loads = clock.take([10, 20, 30, 40])
    assert set(loads) == {"primary"} and loads["primary"].nbytes == 20 and loads["primary"].sends == {1: 1}
    f2.set_result(torch.zeros(1))  # in flight at the first window's end: counted in the next
    loads = clock.take([10, 20, 30, 40])
    assert set(loads) == {"second"} and loads["second"].sends == {2: 1} and loads["second"].busy_s > 0
    clock.reset()
    assert clock.take([10, 20, 30, 40]) == {}


class _Clock:
    """A clock the test moves: what ``time.perf_counter`` reads while a test runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_hooked_send_of_a_window_counts_its_own_busy_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three iterations of one coded bucket, its hook run inside the launch (fp16, int8): each send takes
    # 1 s, so the window's link was busy 3 s. One hook start kept per bucket put the first two sends'
    # starts after their ends (busy 1 s): the link's time per byte a third of the truth.
    clock = _Clock()
    monkeypatch.setattr("time.perf_counter", clock)
    lc = LinkClock({"primary": "gloo"})
    lc.on = True
    for t in (0.0, 2.0, 4.0):
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        lc.hook_started(0, t)
        lc.launched(0, "primary", [fut], t)
        clock.now = t + 1.0
        fut.set_result(torch.zeros(1))
        lc.settle()  # stamped before the test's clock moves on
    loads = lc.take([100])
    assert loads["primary"].sends == {0: 3} and loads["primary"].busy_s == pytest.approx(3.0)


def test_a_chained_hooks_send_is_busy_from_when_it_really_started(monkeypatch: pytest.MonkeyPatch) -> None:
    # A chained hook (PowerSGD) sends one bucket at a time over every link: bucket 1's send, launched at
    # 0 on the second link, starts only when bucket 0's ends at 1, and ends at 3; twice over. The second
    # link was busy 2 s of each iteration, not 3.
    clock = _Clock()
    monkeypatch.setattr("time.perf_counter", clock)
    lc = LinkClock({"primary": "gloo", "second": "gloo"})
    lc.on = True
    for t in (0.0, 10.0):
        f0: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        f1: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        lc.launched(0, "primary", [f0], t)
        lc.launched(1, "second", [f1], t)
        lc.hook_started(0, t)
        clock.now = t + 1.0
        f0.set_result(torch.zeros(1))
        lc.settle()
        lc.hook_started(1, t + 1.0)
        clock.now = t + 3.0
        f1.set_result(torch.zeros(1))
        lc.settle()
    loads = lc.take([100, 100])
    assert loads["primary"].busy_s == pytest.approx(2.0) and loads["second"].busy_s == pytest.approx(4.0)


def test_each_buckets_sends_are_placed_in_the_iterations_that_launched_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two iterations begun at 0 and 10. Bucket 0's gradient is complete 2 s in, its send launched 0.5 s
    # later and ended 4 s in (then 3 and 6 s in: medians 2.5 and 5); bucket 1's, complete at the end of the
    # first iteration (9 s), is sent in the next one's forward, 1 to 2 s in: ready 1 s before its iteration.
    clock = _Clock()
    monkeypatch.setattr("time.perf_counter", clock)
    lc = LinkClock({"primary": "gloo"})
    lc.on = True

    def send(b: int, at: float, ends: float) -> None:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        lc.launched(b, "primary", [fut], at)
        clock.now = ends
        fut.set_result(torch.zeros(1))
        lc.settle()

    for begin, end0 in ((0.0, 4.0), (10.0, 16.0)):
        lc.iteration_started(begin)
        if begin > 0:
            send(1, begin + 1.0, begin + 2.0)
        clock.now = begin + 2.0
        lc.bucket_ready(0)
        send(0, begin + 2.5, end0)
        clock.now = begin + 9.0
        lc.bucket_ready(1)
    placed = lc.take([100, 100])["primary"].timeline
    assert placed[0] == SendTimes(pytest.approx(2.0), pytest.approx(2.5), pytest.approx(5.0))
    assert placed[1] == SendTimes(pytest.approx(-1.0), pytest.approx(1.0), pytest.approx(2.0))
    assert timeline_record({"primary": placed}) == {"primary": {"0": [2000.0, 2500.0, 5000.0],
                                                                "1": [-1000.0, 1000.0, 2000.0]}}
