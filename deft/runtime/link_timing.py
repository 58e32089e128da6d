"""Each link's time in the running schedule, and the rule that re-opens a settled adaptation.

For :mod:`deft.runtime.adapt`:

* **A link's time per byte** (:class:`LinkClock`, an executor observer). Every send of the running
  schedule on a gloo link is stamped at launch and at completion (by the link's waiting thread,
  :mod:`deft.runtime.completions`, as the warm-up timer stamps the profile iterations' sends). A link's
  *busy time* in a window is the length of the union of its sends' intervals
  (:func:`deft.runtime.warmup_timer.busy_periods`: a link carries overlapping sends in about the time
  it takes them one after another), its *time per byte* the busy time over the bytes sent. The ranks
  reduce it with a minimum: a send launched on an idle link waits there for the slowest rank, and the
  last rank to launch waits for nobody. NCCL links are not timed (their futures complete at launch):
  there the iteration time alone is watched.
* **Where the sends fell** (:class:`SendTimes`, for the adaptation's record only): each send's
  bucket ready, start and end against the forward start of the iteration that launched it, the
  medians per link and bucket over the window; set beside the simulated plan's timeline, they tell a
  send handed over late from one carried slowly.
* **Per-link calibration** (:func:`link_factors`, :func:`scale_links`). A link's factor is its measured
  busy time over the time the running profile models for the same sends, divided by the primary's
  (the first link timed): ``s_l = (measured_l / modelled_l) / (measured_ref / modelled_ref)``. The
  calibration scales link ``l`` by ``f * s_l``, so one link can be priced slower than another (one
  factor ``f`` for all links keeps the split of the bytes between them). A factor within
  :data:`LINK_DRIFT` of 1 (either way) is set to 1: the links' times measured beside the model's
  compute wander by that much without any link changing, and such noise must not move bytes.
* **Re-opening** (:class:`Watch`, :func:`drift`). Once the adaptation has settled, every window is still
  measured and compared with the window it settled on (its *baseline*; settled by going back to a
  schedule measured before, the last window measured on it; by a switch to one not measured yet, the
  first window after the switch). A window *drifts* when a link's time per byte against the primary's
  moved by more than :data:`LINK_DRIFT` either way, or when its median iteration moved by more than
  ``adapt_tolerance`` and by more than :data:`NOISE_K` times the windows' spread (the median absolute
  deviation of their iterations: a shift that large is not the window's own noise). Only
  :data:`REOPEN_WINDOWS` drifting windows in a row re-open the adaptation (hysteresis: a one-off spike,
  a window straddling a change, do not). Every rank holds the same :class:`Watch` fed the same reduced
  figures, so every rank decides alike without a word from rank 0.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from deft.profile import Profile
from deft.runtime.completions import Completions, wait_stamped
from deft.runtime.control import FUTURE_TYPES, Collective
from deft.runtime.warmup_timer import busy_periods

#: A link's time per byte against the primary's must change by this factor (either way) to count: its
#: busy time in the running schedule carries the waits for peers and the CPU the model's compute takes
#: from the transport threads (benchmarks/results/faults.md, "A link that slows").
LINK_DRIFT = 1.5
#: Drifting windows in a row that re-open the adaptation.
REOPEN_WINDOWS = 2
#: An iteration shift counts when larger than this many times the windows' spread.
NOISE_K = 2.0


# -- measuring ----------------------------------------------------------------------------------------
@dataclass
class _Send:
    """One bucket's collectives on one link: launch time and one completion stamp per Work."""

    bucket: int
    link: str
    launched: float
    works: int
    stamps: list[float] = field(default_factory=list)
    started: float | None = None  # a hooked send: when the hook really ran (a chained one waits for its turn)
    since: float | None = None  # the forward start of the iteration that launched it (None: not seen)
    ready: float | None = None  # when its bucket's gradient was last complete before the launch
    sources: list[torch._C.Future[object]] = field(default_factory=list)  # the Works' futures
    stamped: list[threading.Event] = field(default_factory=list)  # set once each is stamped

    @property
    def span(self) -> tuple[float, float] | None:
        if len(self.stamps) != self.works:
            return None
        end = max(self.stamps)
        return min(max(self.launched, self.started or self.launched), end), end


@dataclass(frozen=True)
class SendTimes:
    """Where a bucket's sends on a link fell in the iterations that launched them, the medians over a
    window of seconds after the iteration's forward began: its gradient complete (``ready_s``; negative
    for a send launched in the iteration after its backward's), its send begun (``start_s``: the later of
    its launch and its hook's start) and ended (``end_s``, its last Work's completion)."""

    ready_s: float | None
    start_s: float
    end_s: float


@dataclass(frozen=True)
class LinkLoad:
    """One rank's completed sends on one link in a window: busy seconds, bytes, sends per bucket, and
    where each bucket's sends fell in their iterations (``timeline``)."""

    busy_s: float
    nbytes: int
    sends: Mapping[int, int]
    timeline: Mapping[int, SendTimes] = field(default_factory=dict)

    @property
    def per_byte_s(self) -> float | None:
        return self.busy_s / self.nbytes if self.nbytes > 0 and self.busy_s > 0 else None


class LinkClock:
    """An executor observer timing the running schedule's sends per link (module docstring). Records only
    while ``on``; :meth:`take` hands over the completed sends, :meth:`reset` forgets everything."""

    def __init__(self, backends: Mapping[str, str]) -> None:
        self.names = tuple(backends)
        self._timed = {n for n, b in backends.items() if b != "nccl"}
        self.on = False
        self._sends: list[_Send] = []
        # Which send a hook's start belongs to (Note below); hook_started may run on a gloo thread.
        self._lock = threading.Lock()
        self._early: dict[int, float] = {}              # bucket -> its hook ran inside the launch call
        self._awaiting: dict[int, list[_Send]] = {}     # bucket -> its sends launched before their hook ran
        self._stamps = Completions()
        self._began: float | None = None  # the running iteration's forward start
        self._ready: dict[int, float] = {}  # bucket -> when its gradient was last complete

    # Note: a hooked send's start is stamped per send, not per bucket. A window spans several
    # iterations, each sending every bucket: one start per bucket, overwritten by the next iteration's,
    # put every earlier send's start after its own end and its busy time at zero, so the links of a coded
    # plan counted only their last iteration's sends and one link's calibration factor priced it nearly
    # free. An unchained hook runs inside the launch call (its start comes just before ``launched``, on
    # the same thread); a chained one runs when the sends before it end, after ``launched``, in launch
    # order.

    def iteration_started(self, now: float) -> None:
        """The running iteration's forward began at ``now``: its sends' times are read from it."""
        if self.on:
            self._began = now

    def bucket_ready(self, b: int) -> None:
        if self.on:
            self._ready[b] = time.perf_counter()

    def hook_started(self, b: int, t: float) -> None:
        if not self.on:
            return
        with self._lock:
            waiting = self._awaiting.get(b)
            if waiting:
                waiting.pop(0).started = t  # a chained hook's send, launched earlier, starts now
            else:
                self._early[b] = t  # the hook runs inside the launch call: ``launched`` takes it

    def launched(self, b: int, link: str, works: list[Collective], t_start: float) -> None:
        with self._lock:
            early = self._early.pop(b, None)
            if not self.on or link not in self._timed:
                return
            rec = _Send(b, link, t_start, len(works), started=early, since=self._began, ready=self._ready.get(b))
            if early is None and any(isinstance(w, FUTURE_TYPES) for w in works):  # a chained hook's: later
                self._awaiting.setdefault(b, []).append(rec)
            self._sends.append(rec)
        for w in works:
            fut = w if isinstance(w, FUTURE_TYPES) else w.get_future()
            rec.sources.append(fut)
            rec.stamped.append(self._stamps.watch(link, fut, rec.stamps))

    def settle(self) -> None:
        """Wait until every completed send is stamped (its waiting thread may lag its completion)."""
        with self._lock:
            sends = list(self._sends)
        wait_stamped((s.link, s.sources, s.stamped) for s in sends)

    def reset(self) -> None:
        with self._lock:
            self._sends, self._early, self._awaiting = [], {}, {}
            self._began, self._ready = None, {}

    def take(self, nbytes: Sequence[int]) -> dict[str, LinkLoad]:
        """The completed sends since the last call, per link (``nbytes[b]``: bucket ``b``'s bytes); the
        ones still in flight count in the next window."""
        self.settle()
        spans: dict[str, list[tuple[float, float]]] = {}
        sent: dict[str, Counter[int]] = {}
        placed: dict[str, dict[int, list[tuple[float | None, float, float]]]] = {}
        left = []
        with self._lock:
            for s in self._sends:
                span = s.span
                if span is None:
                    left.append(s)
                    continue
                spans.setdefault(s.link, []).append(span)
                sent.setdefault(s.link, Counter())[s.bucket] += 1
                if s.since is not None:
                    ready = None if s.ready is None else s.ready - s.since
                    placed.setdefault(s.link, {}).setdefault(s.bucket, []).append(
                        (ready, span[0] - s.since, span[1] - s.since))
            self._sends = left
            # an ended send's hook has run: only sends still in flight may still await theirs
            flying = {id(s) for s in left}
            self._awaiting = {b: [s for s in w if id(s) in flying] for b, w in self._awaiting.items()}
        return {n: LinkLoad(sum(length for _, length in busy_periods(spans[n])),
                            sum(nbytes[b] * k for b, k in sent[n].items()), dict(sent[n]),
                            {b: send_times(v) for b, v in placed.get(n, {}).items()}) for n in spans}


def send_times(placed: Sequence[tuple[float | None, float, float]]) -> SendTimes:
    """The medians of one bucket's sends' ``(ready, start, end)`` offsets (:class:`SendTimes`); the
    ready offset over the sends that have one (None: none has)."""
    ready = [r for r, _, _ in placed if r is not None]
    return SendTimes(statistics.median(ready) if ready else None, statistics.median(s for _, s, _ in placed),
                     statistics.median(e for _, _, e in placed))


def timeline_record(timeline: Mapping[str, Mapping[int, SendTimes]]) -> dict[str, dict[str, list[float | None]]]:
    """A window's :class:`SendTimes` per link and bucket for its record, in milliseconds:
    ``{link: {bucket: [ready, start, end]}}``."""
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 2)
    return {n: {str(b): [ms(t.ready_s), ms(t.start_s), ms(t.end_s)] for b, t in sorted(per.items())}
            for n, per in timeline.items() if per}


# -- per-link calibration -------------------------------------------------------------------------------
def link_ratios(part: Profile, per_byte: Mapping[str, float],
                sends: Mapping[str, Mapping[int, int]]) -> dict[str, float]:
    """Each timed link's ``measured_l / modelled_l`` (module docstring) for a profile ``part`` in the
    running schedule's buckets, from the ranks' reduced times per byte and one rank's sends per link and
    bucket: its busy time in the window over what ``part`` prices the same sends at (1: as profiled).
    Links not timed, or with nothing sent, are absent."""
    ratio: dict[str, float] = {}
    for lk in part.links:
        sent, pb = sends.get(lk.name, {}), per_byte.get(lk.name)
        modelled = sum(k * part.comm_time(b, lk.name) for b, k in sent.items())
        nbytes = sum(k * part.buckets[b].nbytes for b, k in sent.items())
        if pb is not None and modelled > 0 and nbytes > 0:
            ratio[lk.name] = pb * nbytes / modelled
    return ratio


def link_factors(part: Profile, per_byte: Mapping[str, float],
                 sends: Mapping[str, Mapping[int, int]]) -> dict[str, float]:
    """Each link's factor ``s_l`` (module docstring): :func:`link_ratios` over the first timed link's.
    Links not timed, and factors within :data:`LINK_DRIFT` of 1, get 1."""
    ratio = link_ratios(part, per_byte, sends)
    if not ratio:
        return {lk.name: 1.0 for lk in part.links}
    ref = ratio[next(iter(ratio))]
    out = {}
    for lk in part.links:
        s = ratio.get(lk.name, ref) / ref
        out[lk.name] = s if max(s, 1.0 / s) > LINK_DRIFT else 1.0
    return out


def scale_links(profile: Profile, factors: Mapping[str, float]) -> Profile:
    """``profile`` with link ``l``'s all-reduces (direct times and model) x ``factors[l]`` (1 if absent)."""
    if all(f == 1.0 for f in factors.values()):
        return profile
    times = tuple(replace(t, comm_s={k: v * factors.get(k, 1.0) for k, v in t.comm_s.items()}) for t in profile.times)
    links = tuple(replace(lk, alpha_s=lk.alpha_s * factors.get(lk.name, 1.0),
                          beta_s_per_byte=lk.beta_s_per_byte * factors.get(lk.name, 1.0)) for lk in profile.links)
    return replace(profile, times=times, links=links)


# -- re-opening ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WindowFigures:
    """One measurement window reduced over the ranks (every rank holds the same figures)."""

    iteration_s: float  # the slowest rank's median iteration
    spread_s: float     # the largest of the ranks' median absolute deviations of their iterations
    per_byte: Mapping[str, float] = field(default_factory=dict)  # link -> seconds per byte; absent: not timed


def spread(seconds: Sequence[float]) -> float:
    """The median absolute deviation of ``seconds`` from their median (0.0 for none)."""
    if not seconds:
        return 0.0
    m = statistics.median(seconds)
    return statistics.median(abs(s - m) for s in seconds)


def link_drifts(base: Mapping[str, float], now: Mapping[str, float]) -> dict[str, float]:
    """Per link timed in both windows (the first, the reference, left out): its time per byte against
    the reference's now, over the same ratio in ``base``."""
    common = [n for n in now if n in base and now[n] > 0 and base[n] > 0]
    if len(common) < 2:
        return {}
    ref = common[0]
    return {n: (now[n] / now[ref]) / (base[n] / base[ref]) for n in common[1:]}


def slowed_since(then: WindowFigures, now: WindowFigures, tolerance: float) -> str | None:
    """Why the schedule measured in ``then`` and again in ``now`` has slowed since: by more than
    :data:`LINK_DRIFT` times (and ``tolerance``) and :data:`NOISE_K` times the spread; None: it has not.
    Not by the tolerance alone: ``then`` was taken in other iterations (the warm-up's, the profile's),
    whose path through deft costs another overhead, tens of percent of a short iteration."""
    shift = now.iteration_s - then.iteration_s
    if (shift > max(tolerance, LINK_DRIFT - 1.0) * then.iteration_s
            and shift > NOISE_K * max(now.spread_s, then.spread_s)):
        return (f"the warm-up's schedule measures {now.iteration_s * 1e3:.1f} ms against the "
                f"{then.iteration_s * 1e3:.1f} ms it was chosen on")
    return None


def drift(base: WindowFigures, now: WindowFigures, tolerance: float, links_only: bool = False) -> str | None:
    """Why ``now`` is not the window the adaptation settled on (module docstring); None: it still is.
    ``links_only``: only a link's drift counts (:class:`Watch`)."""
    for name, d in link_drifts(base.per_byte, now.per_byte).items():
        if max(d, 1.0 / d) > LINK_DRIFT:
            return f"link {name!r}: its time per byte against the primary's is {d:.2f}x the settled window's"
    if links_only:
        return None
    shift = now.iteration_s - base.iteration_s
    if abs(shift) > tolerance * base.iteration_s and abs(shift) > NOISE_K * max(now.spread_s, base.spread_s):
        return (f"iteration {now.iteration_s * 1e3:.1f} ms against {base.iteration_s * 1e3:.1f} ms "
                "in the settled window")
    return None


@dataclass
class Watch:
    """A settled adaptation's watch (module docstring): ``observe`` each window; the reason to re-open
    after :data:`REOPEN_WINDOWS` drifting windows in a row, else None.

    Note:
        Settled back on the warm-up's synchronous schedule (``links_only``), only a link's drift re-opens.
        Every plan tried measured slower than that schedule; an iteration that moves while the links keep
        their relative speeds (the model's compute, the machine's load, noise on a short iteration) does
        not say that any of them would now win, and re-trying them on it repeats the loss just measured.
        A link that changes speed against the others does: it re-prices every plan.

        Except where that schedule was chosen on stale figures (``chosen_on``: its own time when the
        plans lost to it). The plans were measured after it, and links that slowed in between (every
        link alike: no link's drift shows it) made them lose to a time the schedule no longer runs in.
        The first windows back on it are therefore compared with that time, slower only and by more
        than :data:`LINK_DRIFT` times (the schedule is the same, so the links or the machine changed;
        less is the other path the time was taken on: :func:`slowed_since`); :data:`REOPEN_WINDOWS` of them re-open
        the adaptation, and the first that is not ends the comparison and becomes the baseline.
    """

    tolerance: float
    baseline: WindowFigures | None = None  # None: the next window becomes it
    streak: int = 0
    links_only: bool = False
    chosen_on: WindowFigures | None = None  # back on the warm-up's schedule: its time when chosen

    def observe(self, now: WindowFigures) -> str | None:
        why = None
        if self.chosen_on is not None:
            why = slowed_since(self.chosen_on, now, self.tolerance)
            if why is None:
                self.chosen_on = None  # not slower: the comparison ends, this window is the baseline
        elif self.baseline is not None:
            why = drift(self.baseline, now, self.tolerance, self.links_only)
        if why is None:
            self.streak = 0
            if self.baseline is None:
                self.baseline = now
            return None
        self.streak += 1
        if self.streak < REOPEN_WINDOWS:
            return None
        self.streak = 0
        return f"{why} ({REOPEN_WINDOWS} windows in a row)"
