"""Closing the loop: the running schedule's measured iteration time against the plan's prediction.

The warm-up profile measures each bucket's compute and each link's all-reduce, but not how they slow
each other down when they run together (on a CPU the gloo threads and the model share the cores; on
a GPU NCCL kernels share the SMs and memory bandwidth), so a plan can be right about torch DDP and
far off about itself. After a schedule is installed every rank times its iterations (forward start
to forward start) and its backward passes (:class:`Adaptation`); every ``adapt_window`` iterations
rank 0 gets the slowest rank's medians (one max-reduction) and decides (:class:`Adapter`):

1. **Calibrate** when the measured iteration is slower than the prediction by more than
   ``adapt_tolerance`` (a schedule measured faster than predicted settles: the note in
   :meth:`Adapter.decide`): compute is scaled by
   ``g = measured backward / profiled backward`` (both timed from the gradient of the module's output:
   :meth:`Adaptation.forward_ends`; the codec compute the hooks run inside the backward counted in
   both: :func:`backward_codec_s`), then
   communication by the factor ``f`` for which the simulator predicts exactly the measured iteration
   (``scipy.optimize.brentq``; the simulated time rises with ``f``); a link whose measured time per byte
   left the others' has its own factor ``s_l`` on top (:func:`deft.runtime.link_timing.link_factors`:
   link ``l`` is scaled by ``f * s_l``). The corrected profile is planned
   again; a different schedule is tried (all ranks switch at a cycle boundary) only when predicted
   at least ``SWITCH_GAIN`` faster than the running one on the same corrected profile, since a
   re-plan predicted slower than what runs would be a step back. A calibration that cannot reproduce
   the measurement (the factor at an end of its range: :func:`solved`) settles instead: its
   corrected profile would misprice every plan made on it; so does one that prices the links faster
   than profiled for a window slower than predicted, no link with a factor of its own and the
   adaptation not re-opened by a drift nor weighing a codec measured since its last choice (the
   compute factor took more than the slowdown: the two
   factors do not tell which to plan around, and such re-plans measured slower and went back:
   benchmarks/results/peers_lm_hosts.md, "int8 against fp16"); and, the mirror, one that prices the
   links slower by more than ``adapt_tolerance`` beyond what the window timed them at (the miss is not
   the links'; such re-plans measured slower too: benchmarks/results/prices_lag.md). Where deft
   chose the plan's codecs itself (``compression = "auto"``: :class:`deft.runtime.codecs.choice.Recoding`),
   the choice is made again on the measured exact profile corrected by the same factors; a different
   choice is planned on that profile instead. Why: the choice priced each bucket on the profiled
   links, and a bucket whose exact all-reduce looked hidden behind the compute is not hidden where the
   links run slower beside it (benchmarks/results/slow_links.md). int8 is weighed only where it was
   measured; where the first plan did not measure it (its links were not the bound in 16 bits) and the
   corrected exact profile says they are now, the decision asks every rank to measure it
   (:meth:`Adaptation._int8_measured`, once a run) and the next window's choice weighs it.
2. **Keep the fastest**: a schedule tried after a re-plan that measures slower than the best one
   measured so far is abandoned for that one, and adaptation settles (where a codec was measured since
   the last choice, it goes on: the next window chooses again). The schedule returned to carries
   its measured time as its prediction (it was planned on another partition of the buckets, so the
   corrected profile cannot simulate it; and a measurement is the better prediction anyway), and the
   running profile becomes the one it ran on, as its own calibration corrected it: a later calibration
   of it needs its buckets.
3. **Settle, watch, re-open**: adaptation settles when the prediction is within tolerance, when a
   re-plan yields the running schedule again, or after ``adapt_max_replans`` re-plans. It never
   oscillates within an *episode*: a schedule abandoned once is not tried again. Settled, it keeps
   measuring; links that drift from the window it settled on (:mod:`deft.runtime.link_timing`: a link
   slowed or recovered, or the iteration moved beyond its noise) re-open it, for ``REOPEN_WINDOWS``
   windows in a row: a new episode (:meth:`Adapter.reopen`) that calibrates each link with its own
   factor and re-plans as in step 1, with its own bound. Where a link was slowed, one factor for every
   link would re-plan on a profile in which both slowed alike and keep the split of the bytes.
4. **Never slower than the warm-up**: the synchronous schedule deft warmed up and profiled with is a
   measured candidate too (:class:`Synchronous`). When the running schedule measures more than
   ``SWITCH_GAIN`` slower than it (and it is the fastest measured so far), every rank switches back
   to it on the layout it was measured on, and adaptation settles. The simulator does not model every
   contention (a comm hook's compute on the gloo threads against the model's), so a plan can lose
   to the warm-up in ways no calibration of two factors sees. Back on it, the running profile is the
   measured one priced as it sends (``candidate_profile``: the plan's prices codecs it does not run),
   and its first windows are compared with the time it was chosen on
   (:class:`deft.runtime.link_timing.Watch`, ``chosen_on``): links that slowed after that time was
   taken made every plan lose to it, and a watch of link against link does not see them all slow alike.

   Which iterations count (:class:`SynchronousClock`): forward to next forward, less the time deft
   spends planning. When deft measures its profile, the profile iterations ``warm_end <= t <
   plan_at``: the warm-up iterations before them run another bucket layout on cold caches, a comm
   hook's plain iterations cost something else, and with several links the warm-up runs every bucket
   on the first link while the profile iterations rotate them (the warm-up timer's own overhead is
   within the noise). The candidate is the first profile iteration's schedule
   (:func:`synchronous_candidate`) and its time the median over the rotations. With a given profile
   the warm-up iterations ``1 <= t < warm_end`` count. Where rank 0 planned in the background, the
   iterations that ran meanwhile count instead (``deft.runtime.course.LAG_SAMPLES`` of them at least,
   the last, which may wait for the plan, left out), and their schedule is the candidate: the
   synchronous schedule with the codec the preserver accepted so far, on the profile's layout. That is
   what the plan must beat: where the links are the bound the profile iterations run exact and
   rotate their buckets, slower than that schedule, and a plan slower than it stayed. The figures
   behind these choices: benchmarks/RESULTS.md, "Figures behind the runtime's constants".

At ``epsilon == 0`` every candidate is a lag-free plan or the synchronous schedule and every switch
flushes, so the parameters stay torch DDP's. Each decision is recorded in ``plan_info["adapt"]`` (its
``settled``: whether the episode ended there, the adaptation then watching the links; false while it
goes on, and after a decision that failed, which turns it off), each re-planned schedule offered in
``plan_info["replans"]``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import DeftError
from deft.preserver.feedback import WalkStats
from deft.profile import Profile
from deft.runtime.background import Background, JobSlot
from deft.runtime.buckets import FlatLayout
from deft.runtime.codecs.choice import Recoding
from deft.runtime.control import ControlPlane
from deft.runtime.link_timing import (
    LinkClock,
    SendTimes,
    Watch,
    WindowFigures,
    link_factors,
    link_ratios,
    scale_links,
    spread,
    timeline_record,
)
from deft.runtime.planning import Planning, Switch, make_schedule
from deft.runtime.records import as_object
from deft.runtime.tensors import tensors_in
from deft.schedule import Schedule, synchronous_schedule
from deft.solver.codecs import CodecCost
from deft.solver.partition import profile_for_schedule
from deft.solver.simulate import simulate_schedule

log = logging.getLogger("deft.runtime")

F_RANGE = (0.05, 50.0)  # search interval of the communication factor
#: A re-planned schedule is tried only when predicted at least this much faster than the running one.
SWITCH_GAIN = 0.03


@dataclass(frozen=True)
class Calibration:
    compute: float   # g: measured / profiled compute
    comm: float      # f: the communication factor that makes the simulation match
    predicted_s: float  # the running schedule simulated on the corrected profile
    links: Mapping[str, float] = field(default_factory=dict)  # s_l: link l's own factor, on top of f

    def corrected(self, part: Profile) -> Profile:
        """``part`` (in the running schedule's buckets) corrected by these factors."""
        return scale_links(part, self.links).scaled(self.compute, self.comm)


@dataclass(frozen=True)
class LinkWindow:
    """A window's link timing for a calibration: each link's time per byte (reduced over the ranks) and
    rank 0's sends per link and bucket (:mod:`deft.runtime.link_timing`); for the record only, each link's
    time per byte on the rank that timed it slowest (``slowest_per_byte``: the least, the calibration's,
    plus what that rank's sends waited there for the others to reach them) and where rank 0's sends fell
    in their iterations (``timeline``)."""

    per_byte: Mapping[str, float]
    sends: Mapping[str, Mapping[int, int]]
    slowest_per_byte: Mapping[str, float] = field(default_factory=dict)
    timeline: Mapping[str, Mapping[int, SendTimes]] = field(default_factory=dict)  # rank 0's own


def backward_codec_s(part: Profile, schedule: Schedule) -> float:
    """The codec compute an iteration's backward carries on average: ``codec_s`` of every send of the
    iteration's own gradient launched in a backward stage (``part``: the profile in the schedule's
    buckets). The hooks encode as the buckets become ready, inside the measured backward, and the
    simulator charges that compute on the compute stream beside the backward's; leaving it out of the
    expected backward put it twice into ``g`` (once in the measured backward, once in ``codec_s x g``),
    and the links came out priced at the end of their range (benchmarks/results/peers_lm_hosts.md, "int8
    against fp16")."""
    coded = sum(part.times[t.bucket].codec_s for st in schedule.stages if st.stage == "backward"
                for t in st.comms if t.origin == 0)
    return coded / max(1, schedule.cycle)


def against_profile(profile: Profile, schedule: Schedule, config: DeftConfig, measured_backward_s: float,
                    links: LinkWindow | None, measured_forward_s: float = 0.0) -> JsonDict:
    """Where a window's time went against the profile it was priced on, for its record: the measured
    forward over the profiled one (``forward_vs_profile``: above 1 where the forward waited, for the
    sends of updates applied in it as much as for its compute), the measured backward over the profiled
    one (``backward_vs_profile``, the ``g`` of :func:`calibrate`) and each timed link's busy time over
    the profile's price of the same sends (``links_vs_profile``:
    :func:`deft.runtime.link_timing.link_ratios`; ``links_slowest_vs_profile``: the same on the rank
    whose sends waited longest for the others, whose excess over ``links_vs_profile`` is the ranks' skew
    in the window, against the profile's ``lag_s`` priced in the simulation). 1 is as priced; above 1,
    slower. Empty where the schedule's buckets are not a partition of the profile's: a record, never a
    reason to fail."""
    try:
        part = profile_for_schedule(profile, schedule, config)
    except DeftError:
        return {}
    expected = part.backward_s + backward_codec_s(part, schedule)
    out: JsonDict = {}
    if part.forward_s > 0 and measured_forward_s > 0:
        out["forward_vs_profile"] = round(measured_forward_s / part.forward_s, 4)
    if expected > 0 and measured_backward_s > 0:
        out["backward_vs_profile"] = round(measured_backward_s / expected, 4)
    ratios = {} if links is None else link_ratios(part, links.per_byte, links.sends)
    if ratios:
        out["links_vs_profile"] = {k: round(v, 4) for k, v in ratios.items()}
    slowest = {} if links is None else link_ratios(part, links.slowest_per_byte, links.sends)
    if slowest:
        out["links_slowest_vs_profile"] = {k: round(v, 4) for k, v in slowest.items()}
    return out


def calibrate(profile: Profile, schedule: Schedule, config: DeftConfig, measured_s: float,
              measured_backward_s: float, links: LinkWindow | None = None) -> Calibration:
    """The factors (module docstring, step 1) that make the simulator reproduce ``measured_s``; with
    ``links``, each link's own factor first (:func:`deft.runtime.link_timing.link_factors`)."""
    part = profile_for_schedule(profile, schedule, config)
    expected = part.backward_s + backward_codec_s(part, schedule)
    g = measured_backward_s / expected if expected > 0 and measured_backward_s > 0 else 1.0
    factors = {} if links is None else link_factors(part, links.per_byte, links.sends)
    shaped = scale_links(part, factors)

    def predicted(f: float) -> float:
        return float(simulate_schedule(shaped.scaled(g, f), schedule).iteration_s)

    lo, hi = F_RANGE
    p_lo, p_hi = predicted(lo), predicted(hi)
    if measured_s <= p_lo:
        f = lo
    elif measured_s >= p_hi:
        f = hi
    else:
        from scipy.optimize import brentq  # scipy only when a calibration is solved: fresh ranks start sooner

        f = float(brentq(lambda x: predicted(x) - measured_s, lo, hi, xtol=1e-3, rtol=1e-4))
    return Calibration(g, f, predicted(f), factors)


@dataclass
class Adapter:
    """Rank 0's adaptation state: what was tried, what it measured, whether to go on."""

    config: DeftConfig
    replans: int = 0
    done: bool = False
    best: tuple[float, Schedule, Profile] | None = None  # fastest measured schedule so far, its running profile
    tried: set[str] = field(default_factory=set)  # digests already run
    synchronous: Synchronous | None = None        # the warm-up's schedule and its measured time (step 4)
    recoding: Recoding | None = None              # deft's own codec choice, made again on a calibration
    wants_int8: bool = False                      # every rank is to measure int8 before the next window
    asked_int8: bool = False                      # ... asked once a run (a failed measurement is not retried)
    rechoose: bool = False                        # int8 measured since: the next window chooses again

    def forget_best(self) -> None:
        """Forget the fastest schedule measured so far (a re-check replaced it, for accuracy)."""
        self.best = None

    def know_synchronous(self, synchronous: Synchronous) -> None:
        """The warm-up's synchronous schedule and its measured time: a candidate from now on."""
        self.synchronous = synchronous

    def know_int8(self, cost: CodecCost) -> None:
        """int8's cost, measured since the first plan: the codec choice made again weighs it."""
        if self.recoding is not None:
            self.recoding, self.rechoose = self.recoding.with_int8(cost), True

    def reopen(self) -> None:
        """A settled adaptation re-opens (:mod:`deft.runtime.link_timing`): a new episode, with its own
        ``adapt_max_replans``. What was measured before is forgotten (the schedules tried, the fastest,
        the warm-up's candidate): those times were taken on links as they were."""
        self.replans, self.done, self.best, self.synchronous = 0, False, None, None
        self.tried = set()

    def decide(self, running: Schedule, profile: Profile, measured_s: float, measured_backward_s: float,
               replan: Callable[[Profile], Schedule], links: LinkWindow | None = None,
               reopened: bool = False, measured_forward_s: float = 0.0
               ) -> tuple[Schedule | None, Profile | None, JsonDict]:
        """After a measurement window: the schedule to switch to (or None), the corrected profile (or
        None) and the record. ``replan(profile) -> Schedule`` plans on a corrected profile; ``links``:
        the window's link timing; ``reopened``: the window that re-opened a settled adaptation (its drift
        is the reason to calibrate, even with the iteration's prediction within tolerance);
        ``measured_forward_s``: the window's forward, for the record only (:func:`against_profile`)."""
        predicted = running.predicted_iteration_s
        error = (predicted - measured_s) / measured_s if measured_s > 0 else 0.0
        record: JsonDict = {"schedule": running.digest(), "predicted_s": predicted, "measured_s": measured_s,
                            "error": error, "backward_s": measured_backward_s,
                            **against_profile(profile, running, self.config, measured_backward_s, links,
                                              measured_forward_s),
                            **({"sends_timed": timeline_record(links.timeline)} if links and links.timeline else {})}
        self.tried.add(running.digest())
        back = self._back(running, measured_s, record)
        if back is not None:
            return back[0], back[1], record
        if self.best is None or measured_s < self.best[0]:
            self.best = (measured_s, running, profile)
        # a codec measured since the last choice is weighed whatever the prediction's error
        calibrate_anyway = reopened or self.rechoose
        if abs(error) <= self.config.adapt_tolerance and not calibrate_anyway:
            return self._settle(record, "prediction within tolerance: settled")
        if error > 0 and not calibrate_anyway:
            # Note: however much faster. The corrected profile would credit the compute with what the
            # profile iterations lost to their exact sends; of the re-plans tried for such schedules on
            # the testbed few measured faster, and each cost a background plan on the cores the model
            # uses and a window on a slower schedule (benchmarks/results/peers_lm_adapt.md, "The
            # adaptation's tries").
            return self._settle(record, f"measured {error:.0%} faster than predicted: settled")
        if self.replans >= self.config.adapt_max_replans:
            return self._settle(record, f"{self.replans} re-plans made: settled")
        return self._replan(running, profile, measured_s, measured_backward_s, replan, record, links, reopened)

    def _settle(self, record: JsonDict, why: str,
                corrected: Profile | None = None) -> tuple[None, Profile | None, JsonDict]:
        self.done = True
        record["decision"] = why
        return None, corrected, record

    def _back(self, running: Schedule, measured_s: float,
              record: JsonDict) -> tuple[Schedule, Profile | None] | None:
        """Steps 4 and 2 (module docstring): back to the warm-up's synchronous schedule, or to the fastest
        measured one, where the running schedule measures slower, with the running profile that one was
        measured with (the synchronous schedule's is the run's: ``Adaptation.start``); None: keep going."""
        sync = self.synchronous
        if sync is not None:
            record["synchronous_s"] = sync.measured_s
            fastest = self.best is None or sync.measured_s <= self.best[0]
            if (fastest and measured_s > (1.0 + SWITCH_GAIN) * sync.measured_s
                    and plan_digest(running) != plan_digest(sync.schedule)):
                self.done = True
                record["decision"] = (f"slower than the warm-up's synchronous schedule {sync.schedule.digest()} "
                                      f"({measured_s * 1e3:.1f} ms against {sync.measured_s * 1e3:.1f} ms): back to it")
                return replace(sync.schedule, predicted_iteration_s=sync.measured_s), None
        if self.best is not None and measured_s > self.best[0] and self.best[1].digest() != running.digest():
            # back first; where a codec was measured since the last choice, the next window weighs it
            self.done = not self.rechoose
            record["decision"] = (f"slower than {self.best[1].digest()} ({self.best[0] * 1e3:.1f} ms): back to it"
                                  + ("; the codecs are chosen again on the next window" if self.rechoose else ""))
            # measured: module docstring, step 2; its profile, since a later calibration of it needs its buckets
            return replace(self.best[1], predicted_iteration_s=self.best[0]), self.best[2]
        return None

    def _replan(self, running: Schedule, profile: Profile, measured_s: float, measured_backward_s: float,
                replan: Callable[[Profile], Schedule], record: JsonDict,
                links: LinkWindow | None, reopened: bool = False) -> tuple[Schedule | None, Profile | None, JsonDict]:
        """Step 1 (module docstring): calibrate, choose the codecs again, re-plan, and try the new
        schedule where it is predicted at least :data:`SWITCH_GAIN` faster."""
        cfg = self.config
        cal = calibrate(profile, running, cfg, measured_s, measured_backward_s, links)
        # Corrected in the buckets the running schedule refers to (its partition of ``profile``): then the
        # corrected profile and the running schedule always fit together (`deft simulate` on it, the
        # timeline of the run, a later calibration), even when adaptation keeps that schedule; a
        # re-plan partitions it again as any profile.
        corrected = cal.corrected(profile_for_schedule(profile, running, cfg))
        if self.best is not None and self.best[1].digest() == running.digest():
            self.best = (self.best[0], running, corrected)  # going back to it, the calibration goes with it
        record.update(compute_factor=cal.compute, comm_factor=cal.comm, calibrated_s=cal.predicted_s)
        if any(v != 1.0 for v in cal.links.values()):
            record["link_factors"] = dict(cal.links)
        if not solved(cal):
            # f at an end of F_RANGE: no factor reproduces the window (compute alone, scaled by g, is
            # already slower or faster than it), so the corrected profile would misprice every choice.
            return self._settle(record, f"no calibration reproduces the measured {measured_s * 1e3:.1f} ms "
                                f"(communication x {cal.comm:g} predicts {cal.predicted_s * 1e3:.1f} ms): settled")
        if (measured_s > running.predicted_iteration_s and cal.comm < 1.0 and not (reopened or self.rechoose)
                and all(v == 1.0 for v in cal.links.values())):
            # slower than predicted, yet the links priced faster than profiled: g took more than the
            # whole slowdown, and the two factors do not say which of compute and links to plan around
            # (a link's own factor, or a drift that re-opened the adaptation, says it: that re-plans;
            # so does a codec measured since the last choice, for which the measurement was made)
            return self._settle(record, f"measured slower than predicted but calibrated with the links x "
                                f"{cal.comm:.3g}, faster than profiled: settled")
        timed = record.get("links_vs_profile")
        if (isinstance(timed, dict) and timed and measured_s > running.predicted_iteration_s
                and not (reopened or self.rechoose) and all(v == 1.0 for v in cal.links.values())
                and cal.comm > (1.0 + cfg.adapt_tolerance) * max(float(v) for v in timed.values())):
            # The mirror: the calibration puts the miss on the links, but the window timed every link at
            # about its price. The miss lies where the two factors do not reach (the forward beside the
            # sends, the loop's step), and a plan around links slower than they run was measured slower
            # than the one it replaced (benchmarks/results/prices_lag.md).
            return self._settle(record, f"measured slower than predicted, calibrated with the links x "
                                f"{cal.comm:.3g} while the window timed them at x "
                                f"{max(float(v) for v in timed.values()):.3g}: settled")
        self.replans += 1
        target, chosen = self._recode(cal, corrected, record)
        new = replan(target)
        record["new_schedule"] = new.digest()
        record["new_predicted_s"] = new.predicted_iteration_s
        if new.digest() in self.tried:
            return self._settle(record, "the corrected profile gives a schedule already run: settled", corrected)
        if new.predicted_iteration_s >= (1.0 - SWITCH_GAIN) * cal.predicted_s:
            return self._settle(record, f"the corrected profile's plan is not predicted faster "
                                f"({new.predicted_iteration_s * 1e3:.1f} ms against {cal.predicted_s * 1e3:.1f} ms "
                                "for the running schedule): settled", corrected)
        if self.recoding is not None and chosen is not None and target is not corrected:
            # new codecs: the profile the new schedule was planned on, in its buckets
            record["decision"] = "try the schedule planned on the corrected profile with the codecs chosen again"
            self.recoding = replace(self.recoding, chosen=chosen)
            return new, profile_for_schedule(target, new, cfg), record
        record["decision"] = "try the schedule planned on the corrected profile"
        return new, corrected, record

    def _recode(self, cal: Calibration, corrected: Profile,
                record: JsonDict) -> tuple[Profile, tuple[str, tuple[int, ...]] | None]:
        """The profile to re-plan on: ``corrected``, or where the codec choice made again on the exact
        profile (corrected alike) differs, that coded profile; and the choice (None: deft chose none)."""
        if self.recoding is None:
            return corrected, None
        # the running profile becomes ``corrected``: the exact one follows it, so the factors of later
        # calibrations, measured against it, compose
        self.recoding = replace(self.recoding, base=scale_links(self.recoding.base, cal.links)).scaled(
            cal.compute, cal.comm)
        coded, chosen, codec_record = self.recoding.choose(self.config)
        self.rechoose = False
        changed = chosen != self.recoding.chosen
        codecs: JsonDict = {**codec_record, "changed": changed}  # the choice made again, kept or not
        if not self.asked_int8 and self.recoding.int8_wanted():
            self.wants_int8 = self.asked_int8 = True
            codecs["int8"] = "not weighed for the first plan, the links now the bound in 16 bits: measured next"
        record["codecs"] = codecs
        return (coded if changed else corrected), chosen


def solved(cal: Calibration) -> bool:
    """Whether ``cal``'s communication factor reproduces the measured iteration (it lies inside
    :data:`F_RANGE`, where :func:`calibrate` solved for it): only then do its factors describe the run.
    At an end of the range they do not (the compute alone, scaled by ``g``, predicts more or less than
    was measured), and a plan or codec choice made on them can be far off: links priced nearly free
    had their codecs dropped where they were the bound (benchmarks/results/peers_lm_hosts.md, "int8
    against fp16")."""
    return F_RANGE[0] < cal.comm < F_RANGE[1]


def plan_digest(schedule: Schedule) -> str:
    """The digest of what a schedule does (its prediction left out)."""
    return replace(schedule, predicted_iteration_s=0.0).digest()


def window_medians(iteration_s: list[float], backward_s: list[float]) -> list[float]:
    """This rank's medians of one window (the max over ranks is taken by the caller)."""
    return [statistics.median(iteration_s) if iteration_s else 0.0,
            statistics.median(backward_s) if backward_s else 0.0]


# -- the warm-up's synchronous schedule as a measured candidate (module docstring, step 4) -------------
@dataclass(frozen=True)
class Synchronous:
    """The synchronous schedule deft warmed up with, on the warm-up's bucket layout, and its measured
    iteration time (slowest rank's median over the counted iterations)."""

    schedule: Schedule
    measured_s: float


def synchronous_candidate(layout: FlatLayout, links: tuple[str, ...]) -> Schedule:
    """The schedule the counted iterations ran: every bucket of ``layout`` in its own backward, bucket
    ``b`` on ``links[b mod L]`` (the first profile iteration's links; all on the first with one link)."""
    n = layout.n_buckets
    return synchronous_schedule(layout.bucket_numel, layout.bucket_nbytes(), links,
                                tuple(links[b % len(links)] for b in range(n)))


@dataclass
class SynchronousClock:
    """Forward-to-forward times of the iterations ``first <= t < end`` (module docstring, step 4), less
    the time deft spent on its own work in them (:meth:`exclude`: planning)."""

    seconds: list[float] = field(default_factory=list)
    start: tuple[int, float] | None = None  # (iteration, its forward start)
    excluded_s: float = 0.0

    def forward(self, t: int, now: float, first: int, end: int) -> None:
        """Iteration ``t`` begins at ``now``: iteration ``t - 1``, if it counts, lasted until now."""
        if self.start is not None and self.start[0] == t - 1 and first <= t - 1 < end:
            self.seconds.append(now - self.start[1] - self.excluded_s)
        self.start, self.excluded_s = (t, now), 0.0

    def exclude(self, seconds: float) -> None:
        """``seconds`` of the running iteration were deft's own work, not the schedule's."""
        self.excluded_s += seconds

    def counted(self) -> int:
        """How many iterations were counted (the same on every rank: they run the same iterations)."""
        return len(self.seconds)

    def median(self) -> float:
        """This rank's median (0.0: nothing counted; the max over ranks is taken by the caller)."""
        return statistics.median(self.seconds) if self.seconds else 0.0


# -- the loop in a live run --------------------------------------------------------------------------
#: Rank 0's decision as a JSON document: ``record``, ``done``, and ``schedule``/``profile`` when it
#: switches or corrects the profile (``{"error": ...}`` from :class:`Background` when its thread failed).
Decision = JsonDict


@dataclass(frozen=True)
class Outcome:
    """An adaptation decision as every rank applied it: its record for ``plan_info["adapt"]``, the
    profile rank 0 corrected (None: unchanged) and, when it offered a re-planned schedule, the re-plan's
    record for ``plan_info["replans"]``."""

    record: JsonDict
    profile: Profile | None
    replan: JsonDict | None = None


class Adaptation:
    """The adaptation of one run: the measurement window, rank 0's :class:`Adapter`, the decision in
    flight (in the run's :class:`JobSlot`), the warm-up's synchronous candidate, the links' clock and,
    once settled, the watch that re-opens it (:mod:`deft.runtime.link_timing`).

    The runtime calls the timing events (:meth:`forward_begins`, :meth:`forward_ends`,
    :meth:`backward_begins`, :meth:`backward_ends`), :meth:`start` when the first plan is installed,
    and :meth:`after_step` between iterations; a new schedule goes to :class:`Planning` as a
    :class:`Switch`. ``links``
    (a :class:`LinkClock`) is the executor's observer; ``backends``: link name -> backend."""

    def __init__(self, config: DeftConfig, control: ControlPlane, planning: Planning, jobs: JobSlot,
                 backends: Mapping[str, str] | None = None,
                 measure_int8: Callable[[FlatLayout], CodecCost | None] | None = None) -> None:
        self.config, self._control, self._planning, self._jobs = config, control, planning, jobs
        self._measure_int8 = measure_int8  # collective: int8's cost on a layout (rank 0's codec choice asks)
        self.on = False
        self.clock = SynchronousClock()
        self.links = LinkClock(backends or {})
        self.walk: WalkStats | None = None  # the preserver's statistics at the last plan (rank 0 re-plans with them)
        self.warm_layout: FlatLayout | None = None  # the warm-up's layout, which the candidate runs on
        self._adapter: Adapter | None = None  # rank 0
        self._candidate: Schedule | None = None
        self._candidate_profile: Profile | None = None  # the measured profile, priced as the candidate sends
        self._fwd_start: float | None = None
        self._bwd_start: float | None = None
        self._output_grad_at: float | None = None  # when this iteration's output got its gradient
        self._iter_s: list[float] = []
        self._bwd_s: list[float] = []
        self._fwd_s: list[float] = []  # the model's forward, from its start to its output
        self._from = ""  # the digest of the schedule the decision in flight was measured on
        self._watch: Watch | None = None  # settled: the watch that re-opens the adaptation
        self._fallen_back = False  # the last schedule offered is the warm-up's synchronous one
        self._figures: WindowFigures | None = None  # the last window measured, reduced over the ranks
        self._episode = 0  # re-openings so far
        self._reason = ""  # why the running episode opened (recorded with its re-plans)
        self._backward_s = 0.0  # the last window's slowest-rank median backward
        self._forward_s = 0.0  # ... and forward
        self._links_window: LinkWindow | None = None  # the last window's link timing
        self._synchronous: WindowFigures | None = None  # the warm-up's candidate as measured (every rank)
        self._measured: dict[str, WindowFigures] = {}  # plan_digest -> its last window (every rank)

    @property
    def watching(self) -> bool:
        """Settled, and watching for a drift that re-opens the adaptation."""
        return self.on and self._watch is not None

    # -- timing events -------------------------------------------------------------------------------
    def forward_begins(self, t: int, now: float, first: int, end: int) -> None:
        if self.config.adapt:
            self.clock.forward(t, now, first, end)
        self.links.iteration_started(now)
        if self.on:
            if self._fwd_start is not None:
                self._iter_s.append(now - self._fwd_start)
            self._fwd_start = now

    def forward_ends(self, output: object) -> None:
        """The backward is timed from the gradient of the module's output, as the profile's is
        (:mod:`deft.runtime.warmup_timer`), not from the first parameter's: whatever runs before that
        (a language model's output projection onto a tied embedding) is compute the profile counts in
        the backward, and timing it out priced the compute too low and the links too high."""
        self._output_grad_at = None
        if not self.on:
            return
        if self._fwd_start is not None:
            self._fwd_s.append(time.perf_counter() - self._fwd_start)

        def start(_grad: torch.Tensor) -> None:
            if self._output_grad_at is None:
                self._output_grad_at = time.perf_counter()

        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(start)

    def backward_begins(self, now: float) -> None:
        """The first parameter's gradient of the iteration (``now``): the backward began when the
        output's gradient arrived, or here where no output tensor got one."""
        if self.on:
            self._bwd_start = now if self._output_grad_at is None else min(self._output_grad_at, now)

    def backward_ends(self, now: float) -> None:
        if self.on and self._bwd_start is not None:
            self._bwd_s.append(now - self._bwd_start)
            self._bwd_start = None

    def reset_window(self) -> None:
        """Start a new measurement window at the next forward (the iteration now is not counted)."""
        self._fwd_start = self._bwd_start = None
        self._iter_s, self._bwd_s, self._fwd_s = [], [], []
        self.links.reset()

    # -- the loop ------------------------------------------------------------------------------------
    def start(self, on: bool, warm_layout: FlatLayout | None, candidate: Schedule | None,
              recoding: Recoding | None = None, clock: SynchronousClock | None = None,
              candidate_profile: Profile | None = None) -> None:
        """The first plan is installed: adapt it (``on``) against the warm-up's ``candidate`` (run on
        ``warm_layout``); ``recoding``: deft's own codec choice, made again on each calibration (rank 0's;
        None: none); ``clock``: the candidate's iterations where they were not the profile's (the
        schedule that ran while rank 0 planned); ``candidate_profile``: the measured profile priced as the
        candidate sends (None: not priced), the running profile once the run goes back to it."""
        self.on, self.warm_layout = on, warm_layout
        if clock is not None:
            self.clock = clock
        self.links.on = on
        if on:
            self._adapter = Adapter(self.config, recoding=recoding) if self._control.rank == 0 else None
            self.reset_window()
            self._candidate, self._candidate_profile = candidate, candidate_profile
            self._watch, self._episode, self._reason, self._fallen_back = None, 0, "", False
            self._synchronous = None
            self._measured = {}

    def stop(self) -> None:
        """A link was lost (:mod:`deft.runtime.failover`): the schedules measured, the candidate and the
        profile all used it; adaptation ends on every rank at once (a decision in flight is dropped)."""
        self.on = self.links.on = False
        self.links.reset()

    def forget_measured(self) -> None:
        """A re-check replaced the schedule, for accuracy: adaptation must not go back to one measured
        before (it may be what the re-check rejected); the warm-up's synchronous schedule stays."""
        if self._adapter is not None:
            self._adapter.forget_best()
        if self._watch is not None:
            self._watch = Watch(self.config.adapt_tolerance)  # the new schedule's first window: the baseline

    def after_step(self, t: int, running: Schedule, profile: Profile | None) -> Outcome | None:
        """Collective, between iterations while adapting or watching: collect a decision in flight, or end
        a full window with a decision (in the background with ``plan_lag_iters`` > 0); while watching, a
        window that re-opens the adaptation starts one. Returns the decision every rank applied, if one
        was made now."""
        if self._jobs.holds("adapt"):
            if not self._jobs.ready(t):
                return None
            job = self._jobs.take()
            doc: Decision = {}
            if job is not None:
                out, waited = job.result()
                # Background's own error document: the adaptation stops, with the reason
                doc = {"record": {"error": str(out["error"])}, "done": True} if "error" in out else _decided(out)
                doc["record"] = {**as_object(doc, "record"), "background": {
                    "lag_iters": self.config.plan_lag_iters, "plan_s": round(job.seconds, 4),
                    "waited_s": round(waited, 4)}}
            return self._apply(t, doc, running)
        if self._planning.switch_waiting or len(self._iter_s) < self.config.adapt_window:
            return None
        decide = self._measure(running, profile)
        if self._watch is not None:
            if not self._reopens(t, running):
                return None
            decide = self._decide(running, profile, reopened=True)
        lag = self.config.plan_lag_iters
        if lag > 0:
            job = None if decide is None else Background(decide, "deft-adapter", self.config.planner_nice)
            self._jobs.hold("adapt", job, t + lag)
            return None
        return self._apply(t, decide() if decide is not None else {}, running)

    def _reopens(self, t: int, running: Schedule) -> bool:
        """Every rank alike (the same reduced figures): does this window re-open a settled adaptation?"""
        assert self._watch is not None and self._figures is not None
        why = self._watch.observe(self._figures)
        if why is None:
            return False
        self._watch, self._reason = None, why
        self._episode += 1
        if self._adapter is not None:
            self._adapter.reopen()
        log.info("deft: rank %d re-opens the adaptation at iteration %d on schedule %s: %s", self._control.rank,
                 t, running.digest(), why)
        return True

    def _measure(self, running: Schedule, profile: Profile | None) -> Callable[[], Decision] | None:
        """Collective: the window's figures reduced over the ranks (the slowest rank's medians, each
        link's least time per byte and, for the record, its most); rank 0's decision to make (None
        elsewhere)."""
        loads = self.links.take(running.bucket_nbytes)
        names = self.links.names
        per_byte = [loads[n].per_byte_s if n in loads else None for n in names]
        row = [*window_medians(self._iter_s, self._bwd_s), self.clock.median(), spread(self.clock.seconds),
               spread(self._iter_s), statistics.median(self._fwd_s) if self._fwd_s else 0.0,
               *(-pb if pb is not None else 0.0 for pb in per_byte),  # max(-x) = -min(x)
               *(pb if pb is not None else 0.0 for pb in per_byte)]
        reduced = self._control.max_rows([row], "iteration times")[0]
        measured, self._backward_s, synchronous_s, synchronous_spread_s, spread_s, self._forward_s = reduced[:6]
        least, most = reduced[6:6 + len(names)], reduced[6 + len(names):]
        self._figures = WindowFigures(measured, spread_s, {n: -v for n, v in zip(names, least, strict=True) if v < 0})
        if self._synchronous is None and synchronous_s > 0 and self._episode == 0:
            self._synchronous = WindowFigures(synchronous_s, synchronous_spread_s)
        self._links_window = LinkWindow(self._figures.per_byte, {n: ld.sends for n, ld in loads.items()},
                                        {n: v for n, v in zip(names, most, strict=True) if v > 0},
                                        {n: ld.timeline for n, ld in loads.items()})
        self._measured[plan_digest(running)] = self._figures
        self.reset_window()
        self._from = running.digest()
        if self._adapter is None:
            return None
        if (self._adapter.synchronous is None and self._candidate is not None and self._synchronous is not None
                and self._episode == 0):
            self._adapter.know_synchronous(Synchronous(self._candidate, self._synchronous.iteration_s))
        return self._decide(running, profile)

    def _decide(self, running: Schedule, profile: Profile | None,
                reopened: bool = False) -> Callable[[], Decision] | None:
        """Rank 0's decision on the window just measured (None elsewhere)."""
        if self._adapter is None or self._figures is None:
            return None
        return _decision(self.config, self._adapter, running, profile, self._figures.iteration_s,
                         self._backward_s, self.walk, self._links_window, reopened, self._forward_s)

    def _apply(self, t: int, doc: Decision, running: Schedule) -> Outcome:
        """Collective: rank 0's decision to every rank; a new schedule waits for a boundary."""
        doc = self._control.broadcast_json(doc, "adaptation decision")
        self.reset_window()  # the iterations beside the planner's thread are not the schedule's own
        record: JsonDict = {"iteration": t, **as_object(doc, "record")}
        if doc.get("measure") == "int8":
            record["int8_measured"] = self._int8_measured()
        if self._episode:
            record.update(episode=self._episode, reopened=self._reason)
        # A re-check may have switched schedules while rank 0 decided in the background: the decision, and
        # the profile it corrected in the old schedule's buckets, are about a schedule no longer running.
        moved = running.digest() != self._from
        superseded = moved and ("schedule" in doc or "profile" in doc)
        if superseded:
            record["superseded"] = (f"the running schedule changed from {self._from} to "
                                    f"{running.digest()} while rank 0 decided; adaptation goes on with it")
        corrected = None
        if "profile" in doc and not moved:
            corrected = Profile.from_dict(as_object(doc, "profile"), "profile corrected by rank 0")
            out = os.environ.get("DEFT_PROFILE_OUT")
            if out and self._control.rank == 0:  # `deft simulate` on it predicts what this run measures
                corrected.save(out)
        record["profile_corrected"] = corrected is not None  # the calibration's is the running profile from here
        offered = (Schedule.from_dict(as_object(doc, "schedule"), "schedule re-planned by rank 0")
                   if "schedule" in doc and not moved else None)
        replan = self._offer(t, offered, record) if offered is not None else None
        if replan is not None and self._fallen_back and corrected is None:
            # the plan's profile prices its codecs: a later calibration of the warm-up's schedule needs its own
            corrected = self._candidate_profile
        # A superseded decision is void, "done" with it: the schedule the re-check chose is measured next.
        self._settled(doc, superseded, None if replan is None or offered is None else plan_digest(offered))
        record["settled"] = self._watch is not None  # the episode ended here: only a watch re-opens it
        return Outcome(record, corrected, replan)

    def _int8_measured(self) -> bool:
        """Collective, on every rank alike: int8's cost on the candidate's layout (the exact profile's
        buckets), weighed by rank 0's next codec choice (:meth:`Recoding.int8_wanted`). Whether it was
        measured (the same on every rank; what it took is logged: each rank's own)."""
        if self._measure_int8 is None or self.warm_layout is None:
            return False
        started = time.perf_counter()
        try:
            cost = self._measure_int8(self.warm_layout)
        except DeftError as e:  # raised on every rank alike (measure_codec): the choice goes on without int8
            log.warning("deft: rank %d could not measure int8 for the codec choice: %s", self._control.rank, e)
            return False
        log.info("deft: rank %d measured int8 for the codec choice in %.3f s", self._control.rank,
                 time.perf_counter() - started)
        if cost is not None and self._adapter is not None:
            self._adapter.know_int8(cost)
        return cost is not None

    def _offer(self, t: int, schedule: Schedule, record: JsonDict) -> JsonDict | None:
        """Every rank: ``schedule``, re-planned by rank 0, offered for the next cycle boundary; its record
        for ``plan_info["replans"]`` (None: a re-check's switch went first)."""
        self._control.check_agreement("schedule", schedule.digest())
        back = self._candidate is not None and plan_digest(schedule) == plan_digest(self._candidate)
        self._fallen_back = back  # settled on it, only a link's drift re-opens (link_timing.Watch)
        # a re-check's re-plan, made during the lag, goes first
        info: JsonDict = {"source": "adapt", **({"layout": "warm-up"} if back else {})}
        if not self._planning.offer(Switch(schedule, info, warm_layout=back)):
            record["superseded"] = "a re-check's re-planned schedule was already waiting"
            return None
        error = record.get("error")
        why = self._reason or (f"prediction error {float(error):+.0%} against the measured iteration"
                               if isinstance(error, (int, float)) else "")
        cost = as_object(record, "background")
        return {"iteration": t, "episode": self._episode, "reason": why, "decision": record.get("decision"),
                "from": self._from, "to": schedule.digest(), "predicted_s": schedule.predicted_iteration_s,
                **({"link_factors": record["link_factors"]} if "link_factors" in record else {}),
                **({"plan_s": cost.get("plan_s"), "waited_s": cost.get("waited_s")} if cost else {})}

    def _settled(self, doc: Decision, superseded: bool, to: str | None) -> None:
        """After a decision: adapting on, or settled and watching, or off after a failed decision. The
        watch's baseline: the window decided on when the running schedule stays; switching to ``to`` (a
        :func:`plan_digest`), the last window measured on it, else (one not measured yet) the next window.

        Note:
            Going back to a schedule measured earlier in the episode, the next window is not its
            baseline: a link that changed since that measurement (a slowed link recovering while the
            episode still decided) is already in the next window, and a watch taking it as the
            baseline never sees the change that left the plan priced for links that are gone. The
            window that measured it is the one the decision to go back was made on."""
        if superseded or not doc["done"]:
            self.on, self._watch = True, None
            return
        failed = isinstance(as_object(doc, "record").get("error"), str)  # rank 0's decision raised
        self.on = self.links.on = not failed
        # back on the warm-up's schedule in the first episode: it was chosen on its time then (Watch)
        chosen_on = self._synchronous if self._fallen_back and self._episode == 0 else None
        baseline = self._figures if "schedule" not in doc else None if to is None else self._measured.get(to)
        self._watch = None if failed else Watch(self.config.adapt_tolerance, baseline,
                                                links_only=self._fallen_back, chosen_on=chosen_on)


def _decided(out: Mapping[str, object]) -> Decision:
    """A decision document back from rank 0's thread (built by :func:`_decision`: JSON throughout)."""
    doc: Decision = {}
    for key, value in out.items():
        assert value is None or isinstance(value, (str, int, float, dict, list)), (key, value)
        doc[key] = value
    return doc


def _decision(cfg: DeftConfig, adapter: Adapter, running: Schedule, profile: Profile | None, measured: float,
              backward: float, walk: WalkStats | None, links: LinkWindow | None = None,
              reopened: bool = False, forward: float = 0.0) -> Callable[[], Decision]:
    """Rank 0's decision as a function of its inputs only (it may run on a background thread)."""
    def decide() -> Decision:
        try:
            assert profile is not None

            # Re-plans solve their knapsacks with the paper's greedy, close to the optimum
            # (benchmarks/results/knapsack.md): the preserver's tries with exact knapsacks can take longer
            # than every rank can wait for an adaptation (benchmarks/results/planner.md).
            quick = replace(cfg, solver="greedy")

            def replan(corrected: Profile) -> Schedule:  # within the window it is made in, as the first plan
                return make_schedule(quick, corrected, None if cfg.epsilon == 0 else walk, None,
                                     lag_iters=cfg.plan_lag_iters).schedule

            new, corrected, record = adapter.decide(running, profile, measured, backward, replan, links, reopened,
                                                    forward)
            doc: Decision = {"record": record, "done": adapter.done}
            if adapter.wants_int8:  # every rank measures it (Adaptation._apply); the next window decides with it
                adapter.wants_int8 = adapter.done = False
                doc.update(measure="int8", done=False)
            if new is not None:
                doc["schedule"] = new.to_dict()
            if corrected is not None:
                doc["profile"] = corrected.to_dict()
            return doc
        except Exception as e:  # adaptation never ends a run: keep the running schedule, stop adapting
            log.exception("deft: adaptation failed")
            return {"record": {"error": f"{type(e).__name__}: {e}"}, "done": True}
    return decide
