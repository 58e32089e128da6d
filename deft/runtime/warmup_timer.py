"""Warm-up timing: per-bucket forward, backward and per-link all-reduce times -> a ``Profile``.

The runtime's own measurement when no profile is given (the profiler package parses richer ones
from Kineto / Nsight traces). It lives in the runtime because it drives the live run: it hooks the
module, decides which link each bucket's real all-reduce takes in the *profile iterations* that follow
the warm-up, and watches those all-reduces complete. Nothing is sent that training does not need
and nothing is waited for early, so a profile iteration costs about what a torch DDP iteration does.

* **links** (:func:`link_rotation`): in profile iteration ``j`` bucket ``b`` is all-reduced on link
  ``(b + j) mod L`` (a synchronous schedule, :meth:`WarmupTimer.schedule`). Every link carries real
  traffic at the same time as the others and as the compute, as it will under a plan; each bucket
  is sent once per iteration, and over ``L`` iterations on every link. A link lost in a profile
  iteration (:mod:`deft.runtime.failover`) leaves the rotation from the next one on.
* **forward**: forward pre/post hooks on every module that owns trainable parameters measure its
  *exclusive* time (time inside nested owners is charged to them); a module's time is split over the
  buckets holding its parameters in proportion to element counts. The rest of the forward (modules
  without parameters, Python glue) is spread in proportion to the attributed time, so the bucket
  times sum to the measured forward.
* **backward**: the backward starts when the gradient of the module output arrives (a tensor hook on
  the outputs); bucket ``b``'s backward time is the time from the previous bucket-ready event (or
  backward start) to ``b``'s ready event, less deft's own launch calls in between. The collectives
  launched before run beside it (on a CPU machine the gloo threads share the cores with the model),
  except in the held iteration (next item), whose backward times are the profile's where the
  contention is priced.
* **the held iteration** (``DeftConfig.contention`` or ``DeftConfig.drag``, CPU links, two profile
  iterations or more): the last profile iteration holds its backward's sends until the last bucket is
  ready (``Executor.install(hold=True)``), so its backward runs beside no collective and its sends
  beside no compute.
* **contention** (``DeftConfig.contention``): the profile's backward times are the held iteration's.
  Each other iteration's backward ran beside its sends: the slowdown per busy link that
  explains the difference (:func:`contention`, over the time ``k`` links were busy in it,
  :func:`busy_counts`) is every gloo link's ``contention`` (:class:`deft.profile.Link`), the median
  over iterations and then over ranks; the simulator slows the compute beside a send by it. An NCCL
  link's is 0 (its copies leave the cores alone).
* **drag** (``DeftConfig.drag``): each busy group (below) carries its time beside the rank's compute
  (forward and backward, :func:`common_busy_groups`); the held iteration's groups ran beside none, the
  others' beside the backward, and :func:`deft.profiler.drag.fit_drag` fits the gloo links' drag and
  their transfer times with the cores free from both kinds. On CUDA none (the compute is the device's).
* **communication**: each launch records its launch time ``L`` (the executor's clock before the
  call) and its completion time ``C``, stamped by the link's waiting thread as the Work's future
  completes (:mod:`deft.runtime.completions`, waited for before the sample is read): gloo marks the
  future complete on its worker thread the moment the collective finishes, just before it closes its
  ``gloo:all_reduce`` profiler range.
  (NCCL futures complete at launch, with stream semantics; on an NCCL link the timer waits for the
  collective and synchronizes the device, so there it serializes as before.)

Transfer times. A link is *busy* while any of its collectives is in flight (launched, not
complete); a *busy period* (:func:`busy_periods`) is a maximal run of overlapping ``[L, C]``
intervals. The link is work-conserving (never idle while a collective is in flight: collectives
launched together take about the time they take one after another), so a busy period's length is
the transfer time of its collectives together. Single collectives are not separable inside a
period: gloo runs two collectives of a group at once and their bytes interleave on the socket (a
small collective launched behind a large one can complete long after its own transfer would have
ended), so the interval between consecutive completions says little about one bucket. What is
measured:

* per iteration and link, the ranks' busy periods are joined (buckets in one period on any rank are
  in one *group*, :func:`common_busy_groups`), and a group's time is the *minimum over ranks* of the
  total length of that rank's periods inside it. A collective launched on an idle link waits there
  for the slowest rank to reach it; the last rank to launch waits for nobody, so the minimum drops the
  ranks' compute skew (a bucket launched on a busy link adds only link time on every rank);
* what that skew costs where the compute priced is not the last rank's: each send's *lag*, how long
  after the paced rank (each iteration's rank with the most compute, :mod:`deft.profiler.pace`)
  launched it the last rank did (:func:`send_lags`), the mean per link its ``lag_s``
  (``DeftConfig.rank_wait``);
* each link's model is ``T = alpha * m + beta * B`` (``m`` collectives of ``B`` bytes in a group), for
  the planner's buckets and the pieces it cuts them into (each piece pays ``alpha`` once,
  :mod:`deft.solver.partition`). ``alpha``, the per-message start-up, is *measured*, not fitted
  (:func:`probe_alpha`): right after the last profile iteration (every link idle: the synchronous
  step waited for its collectives) each rank runs ``PROBE_WARMUP + PROBE_REPEATS`` synchronous
  all-reduces of one element on each link, in link order (collectives: every rank issues the same
  calls in the same order on each link's group); a link's ``alpha`` is the median of the timed ones,
  then the *maximum over ranks* (the control plane). A one-element message is all start-up (its 4
  bytes' own transfer time is negligible on any link). A non-primary link's probe waits for its
  deadline, and the ranks then agree which links are lost (:meth:`WarmupTimer._probe`); the profile is
  made on the links left. Then ``beta`` is the one-parameter
  least-squares fit with ``alpha`` fixed (:func:`fit_group_beta`)::

      minimize_{beta >= 0}  sum_i (T_i - alpha m_i - beta B_i)^2
      =>  beta = max(0, sum_i B_i (T_i - alpha m_i) / sum_i B_i^2)

  (the derivative ``-2 sum_i B_i (T_i - alpha m_i - beta B_i)`` vanishes there; the objective is a
  parabola in ``beta``, so clamping at 0 gives the constrained minimum). ``alpha`` is probed, not
  fitted with ``beta``: the busy groups are megabytes each, so a fitted intercept drowns in their
  noise and can come out 0, and the planner would then split buckets into pieces that cost nothing
  per message (the probe against the two-parameter fit: ``benchmarks/results/replay.md``). Pieces
  queued back to back on a busy link pay less than an idle link's start-up (the link pipelines them;
  what an extra piece costs: the same file), so the probed ``alpha`` charged per piece is an upper
  bound. A link that carried nothing gets ``beta`` from all links' groups (named in
  ``meta["unmeasured_links"]``); ``meta["alpha_probe"]`` records the probe;
* a bucket that was alone in its group has a direct time on that link: the median over the
  iterations in which it was alone. Any other bucket has no ``comm_s`` entry on that link and falls
  back to the link's model (the ``Profile`` contract).

Compression (a comm hook, DESIGN.md "Compression in the profile"). Hooked sends run one at a time
in launch order (the executor chains them), so a send's interval starts when the chain reaches it
(:meth:`WarmupTimer.hook_started`), not at deft's launch call, and ends at the hook's future: the
codec's encode, the hook's collectives and its decode, alone on the links. The codec's compute
``codec_s[b]`` (timed apart, :func:`deft.runtime.codecs.timing.time_hook`) is taken out of each group's
time (never below 0) and the links are fitted over *wire* bytes (the hook's compressed sizes, from its
maths): ``comm_s`` and alpha-beta are then what the wire costs, and the profile carries
``codec``, ``wire_nbytes`` and ``codec_s`` for the planner and the simulator.

Forward and backward reduce to the ranks' *pace* (:func:`deft.profiler.pace.paced_compute`): the
slowest rank's compute of each profile iteration, its median over iterations, spread over the buckets
as their median over ranks (in synchronous data parallelism the slowest rank sets the pace). Every
rank gathers every rank's compute times and launch and completion times and computes the same profile.
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypedDict

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from deft._json import JsonDict
from deft.errors import CommunicationError
from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.profiler.drag import DragFit, DragGroup, fit_drag, group_beta
from deft.profiler.pace import paced_compute
from deft.runtime.buckets import FlatLayout
from deft.runtime.codecs.timing import Codec
from deft.runtime.completions import Completions, wait_stamped
from deft.runtime.control import FUTURE_TYPES, Collective, ControlPlane, wait_work
from deft.runtime.eager import ForwardHooks
from deft.runtime.failover import ALPHA_PROBE, LinkFailover, Stopwatch
from deft.runtime.links import CommLink
from deft.runtime.tensors import tensors_in
from deft.schedule import Schedule, synchronous_schedule

#: Untimed, then timed one-element all-reduces per link in :func:`probe_alpha` (median of the timed ones).
PROBE_WARMUP, PROBE_REPEATS = 2, 9


def link_rotation(n_buckets: int, links: Sequence[str], j: int) -> tuple[str, ...]:
    """Each bucket's link in profile iteration ``j``: bucket ``b`` on ``links[(b + j) % len(links)]``.

    Every bucket is on exactly one link per iteration; over any ``len(links)`` consecutive
    iterations every bucket has been on every link once, and within one iteration neighbouring
    buckets are on different links (all links busy at once, beside the compute).
    """
    if not links:
        raise ValueError("link_rotation: expected at least one link")
    return tuple(links[(b + j) % len(links)] for b in range(n_buckets))


def busy_periods(spans: Sequence[tuple[float, float]]) -> list[tuple[list[int], float]]:
    """The busy periods of one link: maximal runs of overlapping (closed) ``[launch, completion]``
    intervals, as ``(indices into spans, length)``, in time order. The lengths sum to the length of
    the union of the intervals."""
    out: list[tuple[list[int], float]] = []
    start = end = -math.inf
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        lo, hi = spans[i]
        if out and lo <= end:
            out[-1][0].append(i)
            end = max(end, hi)
        else:
            if out:
                out[-1] = (out[-1][0], end - start)
            out.append(([i], 0.0))
            start, end = lo, hi
    if out:
        out[-1] = (out[-1][0], end - start)
    return out


@dataclass(frozen=True)
class BusyGroup:
    """Buckets one link carried together in one iteration, the seconds it was busy with them and how
    many of those were beside the compute (on the rank whose seconds they are)."""

    buckets: tuple[int, ...]
    seconds: float
    beside: float = 0.0


def common_busy_groups(per_rank: Sequence[Mapping[int, tuple[float, float]]],
                       compute: Sequence[Sequence[tuple[float, float]]] = ()) -> list[BusyGroup]:
    """Join the ranks' busy periods of one link in one iteration; each group's time, min over ranks.

    ``per_rank[r]`` maps bucket -> ``(launch, completion)`` on rank ``r``'s clock. Two buckets are in
    one group when they are in one busy period on *some* rank (the finest partition that every
    rank's periods refine). A group's seconds: on each rank, the total length of that rank's periods
    inside the group; then the minimum over ranks. A bucket missing on some rank (its collective
    failed) takes its whole group out. Groups are returned in bucket order. ``compute[r]``: rank
    ``r``'s compute spans in the iteration (none given: none); a group's ``beside`` is how long the
    periods of the rank with the least seconds overlapped them.
    """
    parent: dict[int, int] = {}

    def find(b: int) -> int:
        while parent[b] != b:
            parent[b] = parent[parent[b]]
            b = parent[b]
        return b

    periods = []
    for spans in per_rank:
        keys = list(spans)
        for b in keys:
            parent.setdefault(b, b)
        rank_periods = []
        for idx, length in busy_periods([spans[b] for b in keys]):
            lo = min(spans[keys[i]][0] for i in idx)
            rank_periods.append(([keys[i] for i in idx], length, (lo, lo + length)))
        for members, _, _ in rank_periods:
            for b in members[1:]:
                parent[find(b)] = find(members[0])
        periods.append(rank_periods)
    common = set.intersection(*(set(spans) for spans in per_rank)) if per_rank else set()
    groups: dict[int, list[int]] = {}
    for b in sorted(parent):
        groups.setdefault(find(b), []).append(b)
    out = []
    for members in sorted(groups.values()):
        if not set(members) <= common:
            continue
        root = find(members[0])
        per = [[span for ms, _, span in rank_periods if find(ms[0]) == root] for rank_periods in periods]
        busy = [(sum(hi - lo for lo, hi in spans), r) for r, spans in enumerate(per)]
        seconds, r = min(busy)
        beside = sum(_overlap(span, c) for span in per[r] for c in (compute[r] if r < len(compute) else ()))
        out.append(BusyGroup(tuple(members), seconds, beside))
    return out


def send_lags(per_rank: Sequence[Mapping[int, tuple[float, float]]], pace: int) -> list[float]:
    """How long after rank ``pace`` launched each send the last rank launched it, in bucket order.

    ``per_rank[r]`` maps bucket -> ``(launch, completion)`` on rank ``r``'s clock; buckets not on every
    rank are left out. A collective completes on every rank at once, so with ``D_r = C_r - L_r`` a
    send's duration on rank ``r``, ``D_pace - min_r D_r = L_last - L_pace`` (>= 0): the last rank's
    launch after the paced rank's, read off each rank's own clock (the ranks' clocks need not agree).

    Note [the paced rank]: the profile's compute is the ranks' pace, the slowest rank's
    (:func:`deft.profiler.pace.paced_compute`); where that rank is also the last to send, the others'
    waits for it are its compute, already priced. Only what the paced rank's own sends wait for a
    rank behind it (one that started the iteration late, or was slower in part of it) is not: the
    ranks' busy time in a group, largest less smallest, would charge the fastest rank's whole wait
    again on top of the slowest rank's compute.
    """
    common = set.intersection(*(set(spans) for spans in per_rank)) if per_rank else set()
    return [max(0.0, (per_rank[pace][b][1] - per_rank[pace][b][0])
                - min(spans[b][1] - spans[b][0] for spans in per_rank)) for b in sorted(common)]


def paced_step(rows: Sequence[Sequence[float | None]]) -> float:
    """The profile's ``step_s`` from ``rows[r][i]``, rank ``r``'s loop seconds in profile iteration ``i``
    (None: not timed): the median over the iterations every rank timed of the slowest rank's, as the
    compute is paced (:mod:`deft.profiler.pace`); 0 where no iteration was timed on every rank."""
    timed = [max(x for x in col if x is not None) for col in zip(*rows, strict=True) if None not in col]
    return statistics.median(timed) if timed else 0.0


def rank_compute(spans: Sequence[Sequence[Sequence[Sequence[float]]]]) -> dict[str, list[list[float]]]:
    """Each rank's forward and backward seconds per profile iteration (``forward[r][i]``), from
    ``spans[r][i]``, rank ``r``'s compute spans of iteration ``i`` (:func:`_compute_spans`: its forward,
    then its backward where timed; a backward not timed is 0.0)."""
    def length(span: Sequence[float]) -> float:
        return round(span[1] - span[0], 4)
    return {"forward": [[length(it[0]) for it in rank] for rank in spans],
            "backward": [[length(it[1]) if len(it) > 1 else 0.0 for it in rank] for rank in spans]}


def _compute_spans(s: Sample) -> list[list[float]]:
    """One profile iteration's compute spans on this rank: its forward and its backward (start to the
    last bucket ready)."""
    spans = [[s["fwd_start"], s["fwd_start"] + s["fwd_total"]]]
    if s["bwd_start"] is not None and "bwd_end" in s:
        spans.append([s["bwd_start"], s["bwd_end"]])
    return spans


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


@dataclass
class _Launch:
    """One bucket's real all-reduce in a profile iteration; ``stamps`` get one completion per Work."""

    bucket: int
    link: str
    launched: float
    works: int
    stamps: list[float] = field(default_factory=list)
    stamped: list[threading.Event] = field(default_factory=list)  # set once a collective is stamped
    sources: list[torch._C.Future[object]] = field(default_factory=list)  # the collectives' futures

    @property
    def completed(self) -> float | None:
        return max(self.stamps) if len(self.stamps) == self.works else None


class _SampleEnd(TypedDict, total=False):
    """The keys of a :class:`Sample` set after the forward (``bwd_mark``) or at the iteration's end."""

    bwd_mark: float  # fallback backward start if no output tensor gets a gradient hook
    bwd_end: float  # the last bucket ready
    launch: dict[str, list[float | None]]  # per link and bucket: when its send really started
    comm: dict[str, list[float | None]]  # per link and bucket: start to completion


class Sample(_SampleEnd):
    """One profile iteration's timings (:attr:`WarmupTimer.samples`): a dict, so tests and tools read
    it as the JSON-like record it is; per-bucket lists are indexed by bucket."""

    fwd: list[float]
    bwd: list[float]
    fwd_total: float
    fwd_start: float
    bwd_start: float | None
    held: bool  # its backward's sends waited for its end (WarmupTimer.holds_next)


class _RankCompute(TypedDict):
    """One rank's compute times of the profile iterations, gathered (:meth:`WarmupTimer._compute_times`)."""

    fwd: list[list[float]]
    bwd: list[list[float]]
    held: list[bool]
    rho: float | None
    alone_s: float | None  # the median backward of the held iterations
    beside_s: float | None  # the median backward of the others
    steps: list[float | None]  # the loop's own seconds per iteration timed whole (deft.runtime.step_clock)


class _RankSends(TypedDict):
    """One rank's sends and compute spans of the profile iterations, gathered (:meth:`WarmupTimer._busy_groups`)."""

    iterations: list[dict[str, list[list[float]]]]  # per iteration, per link: [bucket, launch, completion]
    compute: list[list[list[float]]]  # per iteration: its forward's and backward's [start, end]
    pace: list[float]  # per iteration: its forward's and backward's seconds (as paced_compute sums them)


@dataclass
class _Frame:
    """A parameter-owning module whose forward is running: ``spent`` is its exclusive time so far,
    ``since`` when it last resumed (a nested owner's time is not charged to it)."""

    module: int  # id() of the module
    since: float
    spent: float


class WarmupTimer:
    """Collects one set of timings per profile iteration; :meth:`profile` reduces them.

    ``samples`` holds one dict per finished profile iteration: ``fwd`` and ``bwd`` (seconds per
    bucket), and per link ``launch`` (``perf_counter`` at launch) and ``comm`` (launch to
    completion), each a list per bucket with ``None`` where the bucket was not sent on that link in
    that iteration.
    """

    def __init__(self, module: nn.Module, params: Sequence[torch.Tensor], layout: FlatLayout,
                 links: dict[str, CommLink], cuda: bool, wait: Callable[[Collective, str, int], None],
                 hooks: ForwardHooks, failover: LinkFailover | None = None, held: int | None = None,
                 contention: bool = False, drag: bool = False, rank_wait: bool = False) -> None:
        self.held = held  # the profile iteration whose backward runs alone (holds_next), None: none
        self.contention = contention  # price the links' contention (needs ``held``)
        self.drag = drag  # fit the gloo links' drag (deft.profiler.drag)
        self.rank_wait = rank_wait  # price the last rank's lag (deft.profile.Link.lag_s)
        self._wait = wait  # waits for a launched collective (NCCL's completion is stamped after it)
        self._failover = failover  # the links lost (none: every link lives); the probe's agreement
        self.layout = layout
        self.links = links
        self.cuda = cuda
        self.n = layout.n_buckets
        self.samples: list[Sample] = []
        self._cur: Sample | None = None
        self._launches: list[_Launch] = []
        self._started: dict[int, float] = {}  # bucket -> when its chained hooked send really started
        self._stack: list[_Frame] = []
        self._stamps = Completions()
        self._mark = 0.0
        self._handles: list[RemovableHandle] = []
        index = {id(p): i for i, p in enumerate(params)}
        # Per owning module: bucket shares of its parameters' elements.
        self._shares: dict[int, list[tuple[int, float]]] = {}
        for m in module.modules():
            own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
            if not own:
                continue
            per_bucket: dict[int, int] = {}
            for i in own:
                slot = layout.slots[i]
                for b in layout.param_buckets[i]:
                    lo = sum(layout.bucket_numel[:b])
                    hi = lo + layout.bucket_numel[b]
                    overlap = max(0, min(hi, slot.flat_offset + slot.numel) - max(lo, slot.flat_offset))
                    per_bucket[b] = per_bucket.get(b, 0) + max(overlap, 1 if slot.numel == 0 else 0)
            total = sum(per_bucket.values()) or 1
            self._shares[id(m)] = [(b, c / total) for b, c in per_bucket.items()]
        # the forward per module, from the wrapper's hooks (deft.runtime.eager: they outlive this timer)
        self._handles.append(hooks.listen(pre=self._pre, post=self._post))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def live(self) -> list[str]:
        """The links not lost (:mod:`deft.runtime.failover`), in link order."""
        names = list(self.links)
        return names if self._failover is None else self._failover.live(names)

    def schedule(self) -> Schedule:
        """The synchronous schedule of the next profile iteration: buckets on :func:`link_rotation`'s
        links, the links left after a loss."""
        names = tuple(self.live())
        return synchronous_schedule(self.layout.bucket_numel, self.layout.bucket_nbytes(), names,
                                    link_rotation(self.n, names, len(self.samples)))

    def holds_next(self) -> bool:
        """Whether the next profile iteration's backward sends wait for its end (``Executor.install``'s
        ``hold``): its backward is then timed alone, the others' beside their sends (:func:`contention`)."""
        return self.held is not None and len(self.samples) == self.held

    # -- forward -------------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        self._cur = {"fwd": [0.0] * self.n, "bwd": [0.0] * self.n, "fwd_total": 0.0, "fwd_start": self._now(),
                     "bwd_start": None, "held": self.holds_next()}
        self._launches = []
        self._started = {}
        self._stack.clear()

    def _pre(self, m: nn.Module) -> None:
        if self._cur is None or id(m) not in self._shares:
            return
        now = self._now()
        if self._stack:
            top = self._stack[-1]
            top.spent += now - top.since
        self._stack.append(_Frame(id(m), now, 0.0))

    def _post(self, m: nn.Module) -> None:
        if self._cur is None or not self._stack or id(m) not in self._shares:
            return
        now = self._now()
        frame = self._stack.pop()
        acc = frame.spent + (now - frame.since)
        for b, share in self._shares.get(frame.module, []):
            self._cur["fwd"][b] += acc * share
        if self._stack:
            self._stack[-1].since = now

    def end_forward(self, output: object) -> None:
        if self._cur is None:
            return
        cur = self._cur
        now = self._now()
        cur["fwd_total"] += now - cur["fwd_start"]
        cur["bwd_mark"] = now  # fallback backward start if no output tensor gets a gradient hook

        def start(_grad: torch.Tensor) -> None:
            if cur["bwd_start"] is None:
                cur["bwd_start"] = self._mark = self._now()

        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(start)

    # -- backward and communication ------------------------------------------------------------
    def bucket_ready(self, b: int) -> None:
        cur = self._cur
        if cur is None:
            return
        now = self._now()
        if cur["bwd_start"] is None:
            cur["bwd_start"] = self._mark = cur.get("bwd_mark", now)
        cur["bwd"][b] += max(now - self._mark, 0.0)
        cur["bwd_end"] = self._mark = now

    def hook_started(self, b: int, t: float) -> None:
        """A hooked send of bucket ``b`` really started at ``t`` (it waited for the sends chained before
        it); may be called on a gloo thread (one dict store)."""
        if self._cur is not None:
            self._started[b] = t

    def launched(self, b: int, link: str, works: Sequence[Collective], t_start: float) -> None:
        """Bucket ``b``'s real all-reduce went out on ``link`` at ``t_start``: stamp its completion.

        gloo: the link's waiting thread stamps each Work's completion (:mod:`deft.runtime.completions`);
        nothing waits here. NCCL (its future completes at launch): ``wait`` for it, then synchronize.
        """
        if self._cur is None:
            return
        rec = _Launch(b, link, t_start, len(works))
        self._launches.append(rec)
        if self.links[link].backend == "nccl":
            for w in works:
                self._wait(w, link, b)
            done = self._now()
            rec.stamps.extend(done for _ in works)
        else:
            for w in works:
                # the step's wait returns once the collective is marked complete, possibly before its
                # stamp: end_iteration waits for these
                fut = w if isinstance(w, FUTURE_TYPES) else w.get_future()  # a comm hook's Future, or a Work
                rec.sources.append(fut)
                rec.stamped.append(self._stamps.watch(link, fut, rec.stamps))
        self._mark = self._now()  # deft's launch call is not backward time

    def end_iteration(self) -> None:
        """After the step (which waited for every collective): complete the iteration's sample."""
        if self._cur is not None:
            # Forward time outside parameter-owning modules is spread like the attributed time.
            cur = self._cur
            attributed = sum(cur["fwd"])
            rest = max(cur["fwd_total"] - attributed, 0.0)
            weights = cur["fwd"] if attributed > 0 else [float(n) for n in self.layout.bucket_numel]
            wsum = sum(weights) or 1.0
            cur["fwd"] = [f + rest * w / wsum for f, w in zip(cur["fwd"], weights, strict=True)]
            cur["launch"] = {name: [None] * self.n for name in self.links}
            cur["comm"] = {name: [None] * self.n for name in self.links}
            # the step waited for the collectives: a complete one's stamp follows; one on a lost link may
            # never complete (deft.runtime.failover), and stamps nothing
            wait_stamped((r.link, r.sources, r.stamped) for r in self._launches)
            for r in self._launches:
                done = r.completed
                if done is not None:  # a failed collective stamps nothing
                    start = max(r.launched, self._started.get(r.bucket, r.launched))
                    cur["launch"][r.link][r.bucket] = start
                    cur["comm"][r.link][r.bucket] = done - start
            self.samples.append(cur)
        self._cur = None
        self._launches = []

    # -- reduction -----------------------------------------------------------------------------
    def profile(self, control: ControlPlane, world: int, link_backends: dict[str, str], model: str,
                codec: Codec | None = None, t: int = -1, steps: Sequence[float | None] = ()) -> Profile:
        """Reduce the samples (module docstring); collective on the control group. ``codec``: the comm
        hook's bytes on the wire and compute per bucket (None: no hook). ``steps``: this rank's seconds
        of the loop's own work in each profile iteration timed whole (:mod:`deft.runtime.step_clock`;
        None: not timed), the profile's ``step_s`` their median over iterations of the slowest rank's. A
        bucket names its parameters as the layout does (:meth:`~deft.runtime.buckets.FlatLayout.bucket_names`:
        a piece of a cut one by its range). The profile is on the links left: one lost before or in the
        probe (at iteration ``t``, :meth:`_probe`) is not in it, whatever it measured before."""
        if not self.samples:
            raise RuntimeError("internal: no profile iteration was timed")
        n = self.n
        fwd, bwd, rho, rank_contention, step_rows = self._compute_times(control, steps)
        nbytes = list(self.layout.bucket_nbytes())
        wire = list(codec.wire_nbytes) if codec is not None else nbytes
        codec_s = list(codec.codec_s) if codec is not None else [0.0] * n
        every_link, lags, ranks = self._busy_groups(control, codec_s)
        alphas = self._probe(control, t)
        link_names = list(alphas)
        loads = {k: every_link[k] for k in link_names}
        pooled = [g for k in link_names for g in loads[k]]
        if not pooled:
            raise RuntimeError("internal: no all-reduce of the profile iterations completed")
        drag = self._drag(loads, alphas, wire, link_backends)
        links, comm = self._fit_links(loads, pooled, alphas, wire, link_backends, drag, lags)
        links = [replace(lk, contention=rho) if lk.backend == "gloo" else lk for lk in links]
        buckets = tuple(Bucket(id=b, params=self.layout.bucket_names(b),
                               numel=self.layout.bucket_numel[b], nbytes=nbytes[b],
                               wire_nbytes=wire[b] if codec is not None else None) for b in range(n))
        times = tuple(BucketTimes(forward_s=fwd[b], backward_s=bwd[b],
                                  comm_s={k: c[b] for k, c in zip(link_names, comm, strict=True) if b in c},
                                  codec_s=codec_s[b])
                      for b in range(n))
        return Profile(buckets=buckets, times=times, links=tuple(links), world_size=world, source="timing",
                       versions={"torch": torch.__version__}, model=model,
                       meta=self._meta(loads, alphas, comm, codec, rank_contention, drag, lags, step_rows, ranks),
                       codec=codec.name if codec is not None else "", step_s=paced_step(step_rows))

    def _probe(self, control: ControlPlane, t: int) -> dict[str, float]:
        """Each link's per-message start-up (:func:`probe_alpha`), the maximum over ranks, for the links
        left. Collective on every link left and the control group. A guarded link's probe waits for
        the link's deadline (:mod:`deft.runtime.failover`); one that fails or misses it on any rank is
        lost for every rank (the agreement) and has no start-up; the primary's failure raises."""
        fo = self._failover
        names = self.live()
        deadlines = {k: fo.deadline(k, 4) for k in names if fo.guards(k)} if fo is not None else {}  # 4 B: a float
        mine: dict[str, float] = {}
        failed: dict[str, str] = {}
        watch = Stopwatch()
        for k in names:
            began = time.perf_counter()
            try:
                mine[k] = probe_alpha({k: self.links[k]}, self.cuda, control.rank,
                                      deadlines.get(k, control.timeout_s))[k]
            except CommunicationError as e:
                if k not in deadlines:
                    raise
                watch.failed_wait(began)
                failed[k] = str(e)
        if fo is not None and deadlines:
            before = set(fo.dead)
            for k in sorted(fo.agree(failed) - before):
                fo.lost(k, t, 0, watch.seconds(), failed.get(k, ""), ALPHA_PROBE)
            names = fo.live(names)
        rows = control.max_rows([[mine[k] for k in names]], "per-message start-up (one-element all-reduces)")
        return dict(zip(names, rows[0], strict=True))

    def _compute_times(self, control: ControlPlane, steps: Sequence[float | None]
                       ) -> tuple[list[float], list[float], float, list[JsonDict], list[list[float | None]]]:
        """Each bucket's forward and backward seconds at the ranks' pace
        (:func:`~deft.profiler.pace.paced_compute`) from every rank's profile iterations, and the links'
        contention: the median over ranks of :meth:`_contention`, 0 without a held iteration, and each
        rank's estimate with its backward alone and beside its sends (for the profile's ``meta``). The
        forward ran beside no collective in any of them (the synchronous step waited for every one); the
        backward is the held iterations' where there are some and the contention is priced. Collective on
        the control group. And every rank's ``steps`` (the loop's own seconds per iteration,
        :mod:`deft.runtime.step_clock`), for :func:`paced_step`."""
        alone = [sum(s["bwd"]) for s in self.samples if s["held"]]
        beside = [sum(s["bwd"]) for s in self.samples if not s["held"]]
        mine: _RankCompute = {"fwd": [list(s["fwd"]) for s in self.samples],
                              "bwd": [list(s["bwd"]) for s in self.samples],
                              "held": [s["held"] for s in self.samples], "rho": self._contention(),
                              "alone_s": statistics.median(alone) if alone else None,
                              "beside_s": statistics.median(beside) if beside else None, "steps": list(steps)}
        every = control.all_gather_json(mine, "compute times of the profile iterations")
        fwd, bwd = paced_compute([d["fwd"] for d in every], [d["bwd"] for d in every])
        held = [[x for x, h in zip(d["bwd"], d["held"], strict=True) if h] for d in every]
        if all(held) and self.contention:
            bwd = paced_compute([[x for x, h in zip(d["fwd"], d["held"], strict=True) if h] for d in every], held)[1]
        rhos = [d["rho"] for d in every if d["rho"] is not None]
        ranks: list[JsonDict] = [{"rho": d["rho"], "alone_s": d["alone_s"], "beside_s": d["beside_s"]} for d in every]
        return fwd, bwd, statistics.median(rhos) if rhos else 0.0, ranks, [d["steps"] for d in every]

    def _contention(self) -> float | None:
        """This rank's estimate of the links' contention (:func:`contention`): each profile iteration's
        backward beside its sends against the held iterations' (median) backward alone, the median over
        those iterations; None without both kinds, or on CUDA (NCCL's copies leave the cores alone)."""
        alone = [sum(s["bwd"]) for s in self.samples if s["held"]]
        beside = [s for s in self.samples if not s["held"] and s.get("bwd_start") is not None and "bwd_end" in s]
        if self.cuda or not self.contention or not alone or not beside:
            return None
        pure = statistics.median(alone)
        rhos = []
        for s in beside:
            start, end = s["bwd_start"], s["bwd_end"]
            assert start is not None
            spans = [[(lo, lo + c) for lo, c in zip(s["launch"][k], s["comm"][k], strict=True)
                      if lo is not None and c is not None] for k in s["comm"]]
            rhos.append(contention(pure, busy_counts(spans, start, end), sum(s["bwd"])))
        return statistics.median(rhos)

    def _busy_groups(self, control: ControlPlane, codec_s: Sequence[float]
                     ) -> tuple[dict[str, list[BusyGroup]], dict[str, list[float]], dict[str, list[list[float]]]]:
        """Per link, the busy groups of every profile iteration (:func:`common_busy_groups`, each with its
        time beside the compute: the iteration's forward and backward), each less the codec compute of
        its buckets (never below 0), so that the links are fitted over wire time; its sends' lags
        behind each iteration's paced rank, the one with the most compute (:func:`send_lags`); and each
        rank's own compute per iteration (:func:`rank_compute`), gathered with the sends.

        Collective on the control group: every rank gathers every rank's send intervals, so every rank
        forms the same groups (and so computes the same profile)."""
        link_names = list(self.links)
        # A bucket's launch and comm entries are set together (end_iteration): both or neither.
        mine = [{k: [[b, lo, lo + c] for b, (lo, c) in enumerate(zip(s["launch"][k], s["comm"][k], strict=True))
                     if lo is not None and c is not None] for k in link_names} for s in self.samples]
        doc: _RankSends = {"iterations": mine, "compute": [_compute_spans(s) for s in self.samples],
                           "pace": [sum(s["fwd"]) + sum(s["bwd"]) for s in self.samples]}
        every = control.all_gather_json(doc, "all-reduce times of the profile iterations")
        loads: dict[str, list[BusyGroup]] = {k: [] for k in link_names}
        lags: dict[str, list[float]] = {k: [] for k in link_names}
        for i in range(len(self.samples)):
            compute = [[(lo, hi) for lo, hi in d["compute"][i]] for d in every]
            paced = max(range(len(every)), key=lambda r: every[r]["pace"][i])
            for k in link_names:
                per_rank = [{int(b): (lo, hi) for b, lo, hi in d["iterations"][i][k]} for d in every]
                for g in common_busy_groups(per_rank, compute):
                    wire_s = max(0.0, g.seconds - sum(codec_s[b] for b in g.buckets))
                    loads[k].append(BusyGroup(g.buckets, wire_s, min(g.beside, wire_s)))
                lags[k].extend(send_lags(per_rank, paced))
        return loads, lags, rank_compute([d["compute"] for d in every])

    def _drag(self, loads: Mapping[str, list[BusyGroup]], alphas: Mapping[str, float], wire: Sequence[int],
              link_backends: Mapping[str, str]) -> DragFit:
        """The gloo links' drag (:func:`deft.profiler.drag.fit_drag`) over their busy groups; 0 unless
        ``drag`` was asked for, and on CUDA (the model's compute leaves gloo's threads the cores)."""
        if not self.drag or self.cuda:
            return DragFit(0.0, "not measured" if not self.drag else "CUDA: the compute is on the device")
        gloo = {k: _drag_groups(loads[k], wire) for k in alphas if link_backends[k] == "gloo"}
        return fit_drag(gloo, alphas)

    def _fit_links(self, loads: Mapping[str, list[BusyGroup]], pooled: Sequence[BusyGroup],
                   alphas: Mapping[str, float], wire: Sequence[int], link_backends: Mapping[str, str],
                   drag: DragFit, lags: Mapping[str, list[float]]) -> tuple[list[Link], list[dict[int, float]]]:
        """Per link (in link order), its model and its buckets' direct times (module docstring).

        ``beta`` is fitted over the link's own busy groups with its probed ``alpha`` fixed, or over
        ``pooled`` (every link's groups) when the link carried nothing, because every link must have a
        model; a bucket alone in a group on the link gets the median of those groups' times. On a link
        with ``drag``, ``beta`` is fitted with the drag's share fixed and a time is the group's with the
        cores free (:meth:`~deft.profiler.drag.DragFit.free_seconds`). Its ``lag_s`` (where
        ``rank_wait``) is the mean of its sends' lags behind the paced rank (:func:`send_lags`): a send
        an iteration late costs its lag, one in step none. Local only: every rank holds the same groups,
        lags and alphas, so every rank gets the same result."""
        links: list[Link] = []
        comm: list[dict[int, float]] = []
        for k in alphas:
            groups = loads[k] or pooled
            alpha = alphas[k]
            fit = drag if link_backends[k] == "gloo" else DragFit(0.0)
            rows = _drag_groups(groups, wire)
            beta = group_beta(rows, alpha, fit.k)
            lk = self.links[k]
            lag = statistics.fmean(lags[k]) if self.rank_wait and lags.get(k) else 0.0
            links.append(Link(name=k, backend=link_backends[k], ifname=lk.ifname, alpha_s=alpha, beta_s_per_byte=beta,
                              drag=fit.drag, lag_s=lag))
            alone: dict[int, list[float]] = {}
            for g, row in zip(groups, rows, strict=True):
                if loads[k] and len(g.buckets) == 1:
                    alone.setdefault(g.buckets[0], []).append(fit.free_seconds(row))
            comm.append({b: statistics.median(v) for b, v in alone.items()})
        return links, comm

    def _meta(self, loads: Mapping[str, list[BusyGroup]], alphas: Mapping[str, float],
              comm: Sequence[dict[int, float]], codec: Codec | None, rank_contention: list[JsonDict],
              drag: DragFit, lags: Mapping[str, list[float]], step_rows: list[list[float | None]],
              ranks: Mapping[str, list[list[float]]]) -> JsonDict:
        """The profile's ``meta``: how it was reduced, so that a reader can tell measured times from
        modelled ones (the probe, the busy groups per link, which buckets were measured alone, the
        codec's sources, the links that carried nothing and took ``beta`` from all links, the links
        lost before the profile was made, the drag's fit, per link its sends' lags behind the paced
        rank, priced as the links' ``lag_s`` where asked, and each rank's own compute per iteration,
        :func:`rank_compute`, which the profile reduces to the slowest rank's)."""
        link_names = list(alphas)
        meta: JsonDict = {
            "profile_iterations": len(self.samples),
            "reduction": "forward/backward: the slowest rank's total per iteration, median over iterations, "
                         "shared by the buckets' medians over ranks; comm: per link, the busy periods of the "
                         "ranks joined into groups, each group's busy time the min over ranks; "
                         "alpha: one-element all-reduces, median, max over ranks; beta fitted over the groups "
                         "with alpha fixed; a bucket alone in its group: median of its times",
            "alpha_probe": {"warmup": PROBE_WARMUP, "repeats": PROBE_REPEATS,
                            "alpha_s": {k: alphas[k] for k in link_names}},
            "busy_groups": {k: len(loads[k]) for k in link_names},
            "step_s": {"ranks": step_rows,
                       "reduction": "the loop's own seconds per profile iteration timed whole, per rank "
                                    "(deft.runtime.step_clock); the median over iterations of the max over ranks"},
            "contention": {"held_iteration": self.held, "ranks": rank_contention,
                           "reduction": "per rank: the median over the iterations beside their sends; "
                                        "the median over ranks"},
            "drag": {"drag": drag.drag, "why_none": drag.reason} if drag.reason else
                    {"drag": drag.drag, "reduction": "one drag for the gloo links, least squares over their busy "
                                                      "groups with each link's beta (deft.profiler.drag)"},
            "buckets_measured_alone": {k: sorted(c) for k, c in zip(link_names, comm, strict=True)},
            # what the paced rank's sends wait for the last rank to reach them, which the groups' times
            # (the minimum over ranks) leave out: priced as each link's lag_s where DeftConfig.rank_wait is on
            "rank_lag_s": {k: {"mean": statistics.fmean(lags[k]), "median": statistics.median(lags[k]),
                               "max": max(lags[k]), "sends": len(lags[k])}
                           for k in link_names if lags.get(k)},
            # each rank's own: where ranks outnumber the cores, some run at a core's speed while others wait
            "rank_compute_s": {**ranks,
                               "reduction": "per rank and profile iteration, its forward and its backward (start "
                                            "to the last bucket ready), each on its own clock"}}
        if codec is not None:
            meta["codec"] = {"wire_nbytes": "the hook's maths" if codec.wire_known else
                             "unknown for this hook: the bucket's size assumed",
                             "codec_s": "timed on a one-rank group, max over ranks, taken out of the comm times"
                             if codec.timed else "not timed (a hook state deft cannot copy): 0"}
        unmeasured = [k for k in link_names if not loads[k]]
        if unmeasured:
            meta["unmeasured_links"] = unmeasured
        lost = [k for k in self.links if k not in alphas]
        if lost:
            meta["lost_links"] = lost
        return meta


#: The largest contention a profile carries (compute at a fifth of its speed beside each busy link):
#: beyond it the backward beside the sends and the one alone differ for another reason (a stall).
MAX_CONTENTION = 4.0


def _drag_groups(groups: Sequence[BusyGroup], wire: Sequence[int]) -> list[DragGroup]:
    """The busy groups as the fits read them: sends, wire bytes, seconds and seconds beside the compute."""
    return [DragGroup(len(g.buckets), sum(wire[b] for b in g.buckets), g.seconds, g.beside) for g in groups]


def busy_counts(spans: Sequence[Sequence[tuple[float, float]]], lo: float, hi: float) -> dict[int, float]:
    """``{k: seconds}``: how long, within ``[lo, hi]``, exactly ``k`` links had a collective in flight;
    ``spans[l]`` holds link ``l``'s ``(launch, completion)`` intervals. The values sum to ``hi - lo``."""
    edges = sorted({lo, hi, *(x for link in spans for a, b in link for x in (a, b) if lo < x < hi)})
    out: dict[int, float] = {}
    for a, b in itertools.pairwise(edges):
        mid = 0.5 * (a + b)
        k = sum(1 for link in spans if any(s <= mid < e for s, e in link))
        out[k] = out.get(k, 0.0) + (b - a)
    return out


def contention(alone_s: float, busy: Mapping[int, float], beside_s: float) -> float:
    """The contention ``rho`` (:class:`deft.profile.Link`) that makes a backward of ``alone_s`` seconds
    of work, run while ``k`` links are busy for ``busy[k]`` seconds, take ``beside_s``.

    The busy times are rescaled to sum to ``beside_s`` (the interval also holds deft's launch calls,
    which neither time counts). At speed ``1 / (1 + rho k)`` the work done is
    ``W(rho) = sum_k busy[k] / (1 + rho k)``, decreasing from ``beside_s`` at ``rho = 0`` towards
    ``busy[0]``; ``rho`` solves ``W(rho) = alone_s`` by bisection. 0 where the backward beside the
    sends took no longer than alone, or no link was busy beside it (nothing to charge the links with);
    :data:`MAX_CONTENTION` where no ``rho`` up to it explains the difference.
    """
    total = sum(busy.values())
    if beside_s <= alone_s or total <= busy.get(0, 0.0):
        return 0.0
    scaled = {k: t * beside_s / total for k, t in busy.items()}

    def work(rho: float) -> float:
        return sum(t / (1.0 + rho * k) for k, t in scaled.items())

    if work(MAX_CONTENTION) >= alone_s:
        return MAX_CONTENTION
    lo, hi = 0.0, MAX_CONTENTION
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if work(mid) > alone_s else (lo, mid)
    return 0.5 * (lo + hi)


def probe_alpha(links: Mapping[str, CommLink], cuda: bool, rank: int, timeout_s: float,
                repeats: int = PROBE_REPEATS, warmup: int = PROBE_WARMUP) -> dict[str, float]:
    """This rank's per-message start-up of each link: the median time of ``repeats`` synchronous
    all-reduces of one element (after ``warmup`` untimed ones), link after link in ``links`` order.

    Collective on every link: every rank must call it at the same point with the same links. The
    links must be idle (nothing in flight), else the probe queues behind their traffic. The calls are
    training's all-reduce (``CommLink.launch``: hierarchical where training's is), uncounted: the links'
    traffic counters count training's all-reduces only. NCCL links
    use a device tensor and synchronize the device before reading the clock. A probe that fails or
    is not done after ``timeout_s`` (a dead or stalled peer) raises a
    :class:`~deft.errors.CommunicationError` naming ``rank`` (this rank), the link and the probe.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"probe_alpha: expected repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    out: dict[str, float] = {}
    for name, lk in links.items():
        on_device = lk.backend == "nccl"
        t = torch.zeros(1, device="cuda" if on_device else "cpu")
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            work = lk.launch(t)
            wait_work(work, name, f"alpha probe (one-element all-reduce {i + 1} of {warmup + repeats})", rank,
                      timeout_s)
            if on_device and cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def fit_group_beta(counts: Sequence[int], nbytes: Sequence[int], seconds: Sequence[float], alpha: float) -> float:
    """Least-squares ``beta >= 0`` of ``seconds ~ alpha * count + beta * nbytes`` with ``alpha`` fixed
    (module docstring): ``max(0, sum B_i (T_i - alpha m_i) / sum B_i^2)``.

    Row ``i``: ``counts[i]`` collectives of ``nbytes[i]`` bytes in total took ``seconds[i]``. When no
    row has bytes, or every time is already paid by the start-ups and ``alpha`` is 0 too, the link
    still gets a model (``beta = 1e-12``).
    """
    if not (len(counts) == len(nbytes) == len(seconds)) or not counts:
        raise ValueError("fit_group_beta: expected equally long, non-empty counts, nbytes and seconds")
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"fit_group_beta: expected a finite alpha >= 0, got {alpha!r}")
    return group_beta([DragGroup(m, b, t, 0.0) for m, b, t in zip(counts, nbytes, seconds, strict=True)], alpha)
