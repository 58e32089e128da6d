"""Discrete-event simulator: what a scheduling scheme does to an iteration, scheme by scheme.

This module is the engine and the baselines' adapters; it knows nothing of the DeFT planner. A DeFT
:class:`~deft.schedule.Schedule` is simulated by :func:`simulate_schedule` whoever made it, and
:mod:`deft.solver.compare` is the front end that plans DeFT and runs every scheme side by side.

Model
-----
* One **compute stream** runs, for each iteration, the forward of buckets ``n-1 .. 0`` (input side first)
  then the backward of buckets ``0 .. n-1`` (bucket 0, nearest the output, is ready first), then the
  optimizer step (the profile's ``step_s``, the loop's work outside the forward and the backward; it
  starts once the sends it waits for have ended). Tasks start as soon as the stream is free and their
  dependencies are met.
* One **queue per link**: all-reduces run one at a time. The schemes use two disciplines:
  *ordered* (a fixed launch order, each all-reduce waiting for its gradient and its predecessor, the way
  NCCL streams and DeFT's schedules behave) and *priority + credit* (ByteScheduler's Algorithm 1: ready
  pieces wait in a priority queue; the highest-priority one is handed to the link's FIFO when the
  remaining credit (credit minus the bytes in flight) is *greater* than its size. The paper's rule
  waits forever for a piece at least as large as the whole credit; here such a piece goes when nothing
  is in flight).
* **Dependencies** (the true ones of each scheme):
  - ``ddp``, ``wfbp``, ``mgwfbp``: synchronous, the optimizer step waits for every all-reduce of the
    iteration (torch DDP's ``finalize_backward``), so the next forward waits for all of them;
  - ``bytescheduler``, ``usbyte``: synchronous per layer, the forward of bucket ``i`` in the next
    iteration waits for the all-reduce(s) of bucket ``i`` (ByteScheduler's dependency proxy);
  - a :class:`~deft.schedule.Schedule` (DeFT): delayed update, the next forward waits for nothing;
    the optimizer step after position ``p`` waits for all all-reduces of the update groups due there.
    A stage's all-reduces are launched at the start of the stage (forward) or when their gradient is
    ready (backward, ``origin == 0``), in the schedule's order on each link.
* **Costs**: bucket ``i``'s measured all-reduce time ``T_i`` on a link splits into a start-up part
  ``a_i = min(alpha, T_i)`` and a transfer part ``T_i - a_i`` (``alpha`` from the link's fitted model,
  see :func:`link_model`). A message made of fractions ``f_i`` of buckets costs
  ``max_i a_i + sum_i f_i (T_i - a_i)``: fusing saves start-ups, partitioning pays more of them
  (MG-WFBP eq. 11).
* **Compression** (a profile with a ``codec``): measured times and the links' models are wire times
  (:attr:`deft.profile.Bucket.wire`), and every send of bucket ``b`` first runs a ``codec`` task of
  ``codec_s(b)`` (the codec's encode + decode, charged up front) on the compute stream, where it
  competes with the model's compute; the send waits for it. Where it sits: after the backward that
  completes ``b``'s gradient (``b``'s own, or that of the last piece of a parameter ``b`` cuts) for a
  send of this iteration's gradient (``origin == 0``; in synchronous schemes after the
  message's last bucket, ``sum f_i codec_s(b_i)`` for a message of fractions), before the stage's
  compute for a send of an earlier group launched at a stage start, after the launch marker for a
  lag-free update's sends. The runtime runs hooked sends one at a time in launch order, on all links
  together (``deft.runtime.executor``: a hook's state is shared by every bucket), so under such a codec
  the links' queues are *serial*: a send starts when no send is in flight on any link
  (:func:`serial_codec`; fp16 and bf16 start one collective per send and share no state, so their
  sends overlap across links as plain all-reduces do). Without a codec no such task exists and
  nothing changes.
* **A shared processor** (:class:`deft.profile.Link`'s ``contention`` and ``drag``): where the links'
  work runs on the cores the model computes on (gloo), the compute stream runs at
  ``1 / (1 + sum_l rho_l)`` of its speed while links ``l`` have a send in flight (``rho_l`` their
  contention), and a send on link ``l`` at ``1 / (1 + d_l)`` of its speed while the compute stream is
  busy (``d_l`` its drag). Speeds change only when a task starts or ends; each running task's end is
  projected again then (``_EventLoop``'s Note [shared processor]). Compute with no send beside it,
  sends with no compute beside them, and links with neither run as measured.
* **The last rank's lag** (:class:`deft.profile.Link`'s ``lag_s``): the compute simulated is the
  ranks' pace, and a send starts when the last rank reaches it, ``lag_l`` after the paced rank handed
  it to link ``l``; a link's measured times are the last rank's, who waits for nobody. A send handed at
  ``h`` that its link would start at ``s`` holds the link ``max(0, h + lag_l - s)`` longer: on an idle
  link every send waits the lag, on a link that is the bound only the sends that find it idle do (a
  queued send was handed long before it starts).
* **The ranks' verdict on a guarded link** (:class:`deft.profile.Link`'s ``guarded``: the runtime's
  link-failover guard): a result sent on such a link is used only once the ranks agree the link stands,
  a message on the primary link, handed to it once the sends it judges have ended and lasting the
  primary's start-up ``alpha``. Its flags go over a gloo group of its own, which shares the NIC with
  what the primary's group has on the wire, not with that group's queue: it waits for the send the
  primary carries then and for the queued sends its group runs beside that one (``Link.at_once``: gloo
  runs two of a group's collectives at once, one with deft's ``link_queue``), and goes ahead of the
  rest, which it delays by its ``alpha``. The step waits for the
  verdict on the guarded sends it needs; a lag-free forward's first layer whose deferred bucket went on a
  guarded link waits for the one on all the sends in flight after the step before it
  (``deft.runtime.verdicts``).
* **Steady state**: iteration time is averaged over whole cycles after a warm-up, between forward
  starts; bubble ratio = compute idle time / window; link utilisation = busy time / window.

Baseline knobs (``DeftConfig.extra``): ``bytescheduler_partition_numel`` and ``usbyte_partition_numel``
(default ``partition_numel``, 6.5M elements as in the DeFT paper's comparison),
``bytescheduler_credit_bytes`` (default two partitions, about ByteScheduler's tuned NCCL ratio, its
Table 1) and ``mgwfbp_method`` (``"paper"``, default: MG-WFBP's Algorithm 1; or ``"optimal"``: the
exact optimum of its timing model, see :func:`deft.solver.baselines.mgwfbp_merge`).

Scaling out (:func:`scale_workers`): ring all-reduce costs ``a = 2(N-1) alpha`` and
``b = 2(N-1)/N beta`` (MG-WFBP Table 2, the reduction term ``gamma`` folded into ``beta``). Assumption:
the profile's fitted ``alpha_s`` is the whole start-up term ``a`` at the measured world size ``P`` and
the rest of each measured time is the transfer term, so at ``N`` workers start-ups scale by
``(N-1)/(P-1)`` and transfers by ``((N-1)/N) / ((P-1)/P)`` (:func:`ring_factors`). gloo runs that ring
on CPU tensors, and the model holds where every rank has a core of its own. Where ``N`` ranks share
``cores`` cores (the testbed's hosts on one machine), each of the ring's ``2 (N - 1)`` steps waits for
its ranks to be scheduled: ``cores`` given, start-ups are also multiplied by ``c(N) / c(P)``,
``c(k) = max(1, k / cores)²``, the growth gloo showed on loopback (benchmarks/results/allreduce_n.md).
A profile coded in int8 is not rescaled: that codec's
bytes per element depend on the world size (``deft.runtime.codecs.wire.int8_nbytes``), so the exact
profile is rescaled and the codec chosen again at ``N``.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import overload

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError
from deft.profile import Profile, fit_alpha_beta
from deft.schedule import CommTask, Schedule
from deft.solver import baselines

#: The schemes simulated from the profile alone (each as its paper defines it); DeFT's schedules go
#: through :func:`simulate_schedule`.
BASELINES = ("ddp", "wfbp", "mgwfbp", "bytescheduler", "usbyte")


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimEvent:
    """One bar of the timeline: a compute task on ``row == "compute"`` or an all-reduce on a link row.

    ``iteration`` is the iteration computed (compute) or the last iteration of the gradients sent (comm);
    ``stage_iteration`` is the iteration during whose stage an all-reduce was launched.
    """

    row: str
    # forward | backward | update (an optimizer step applying an update) | step (no update) | comm | verdict
    kind: str
    bucket: int
    iteration: int
    start_s: float
    end_s: float
    label: str
    stage_iteration: int = -1


@dataclass(frozen=True)
class SimResult:
    scheme: str
    iteration_s: float
    compute_bound_s: float
    bubble_ratio: float
    updates_per_iteration: float
    link_utilization: dict[str, float]
    events: Sequence[SimEvent]  # the timeline's bars, in the engine's task order (built on first read)
    window: tuple[float, float]  # the steady-state window the figures are measured on
    iteration_starts: tuple[float, ...]  # forward start of every simulated iteration
    cycle: int = 1
    #: How the figures were obtained (window convergence, messages, links, ...); the front ends add the
    #: objects they simulated (:func:`deft.solver.compare.simulate`: ``"schedule"``, ``"profile"``).
    meta: dict[str, object] = field(default_factory=dict)

    def speedup_over(self, other: SimResult) -> float:
        """Throughput ratio: ``other.iteration_s / self.iteration_s`` (> 1: this one is faster)."""
        return other.iteration_s / self.iteration_s if self.iteration_s > 0 else math.inf


# --------------------------------------------------------------------------------------------------
# Cost model helpers
# --------------------------------------------------------------------------------------------------
def _engine(profile: Profile, credit: dict[str, int] | None = None) -> _Engine:
    """An empty engine for ``profile``'s links, their codec discipline and how they share the processor."""
    return _Engine(profile.link_names, credit, serial=serial_codec(profile),
                   contention={lk.name: lk.contention for lk in profile.links},
                   drag={lk.name: lk.drag for lk in profile.links})


def serial_codec(profile: Profile) -> bool:
    """Whether the profile's codec makes the runtime send one bucket at a time over all links
    (every codec but an element-wise one: :attr:`deft.profile.Profile.elementwise_codec`)."""
    return profile.compressed and not profile.elementwise_codec


def link_model(profile: Profile, link: str) -> tuple[float, float]:
    """``(alpha_s, beta_s_per_byte)`` of ``link``: the profile's fitted model, else a fit of the buckets.

    The fallback is a least-squares line through (nbytes, measured time) with ``alpha >= 0`` (a line
    through the origin when the free fit's intercept is negative or there are fewer than two sizes).
    """
    lk = profile.link(link)
    if lk.alpha_s > 0 or lk.beta_s_per_byte > 0:
        return lk.alpha_s, lk.beta_s_per_byte
    xs = [float(b.wire) for b in profile.buckets]
    ys = [profile.comm_time(b.id, link) for b in profile.buckets]
    fit = fit_alpha_beta(xs, ys, source=f"profile link {link!r}")
    return fit.alpha, fit.beta


def _startup(profile: Profile, link: str, alpha: float, bucket: int) -> tuple[float, float]:
    t = profile.comm_time(bucket, link)
    a = min(alpha, t)
    return a, t - a


def message_time(profile: Profile, link: str, parts: Sequence[tuple[int, float]],
                 alpha: float | None = None) -> float:
    """All-reduce time of one message made of ``(bucket, fraction)`` parts (see the module docstring)."""
    if alpha is None:
        alpha = link_model(profile, link)[0]
    start, transfer = 0.0, 0.0
    for b, frac in parts:
        a, rest = _startup(profile, link, alpha, b)
        start = max(start, a)
        transfer += frac * rest
    return start + transfer


def ring_factors(measured: int, workers: int, cores: int | None = None) -> tuple[float, float]:
    """``(start-up, transfer)``: what a ring all-reduce's two terms fitted at ``measured`` ranks are
    multiplied by at ``workers`` ranks (module docstring): ``(N-1)/(P-1)`` and ``((N-1)/N) / ((P-1)/P)``;
    ``cores``: the ranks share that many cores, and start-ups grow with the crowding too."""
    if measured < 2 or workers < 1 or (cores is not None and cores < 1):
        raise ContractError("<workers>", "workers", f"expected a fit at >= 2 ranks rescaled to >= 1 (on >= 1 "
                            f"core), got {measured} -> {workers} (cores {cores})")
    start = (workers - 1) / (measured - 1)
    if cores is not None:
        start *= max(1.0, workers / cores) ** 2 / max(1.0, measured / cores) ** 2
    return start, ((workers - 1) / workers) / ((measured - 1) / measured)


def scale_workers(profile: Profile, workers: int, cores: int | None = None) -> Profile:
    """The profile as it would be measured with ``workers`` ranks under the ring all-reduce model
    (``cores``: the ranks share that many cores, :func:`ring_factors`)."""
    if workers < 1:
        raise ContractError("<workers>", "workers", f"expected >= 1, got {workers}")
    p = profile.world_size
    if workers == p:
        return profile
    if p < 2:
        raise ContractError("<profile>", "world_size",
                            "a profile measured on 1 rank has no communication to rescale; profile with >= 2 ranks")
    if profile.codec == "int8":
        raise ContractError("<profile>", "codec", "int8's wire bytes depend on the world size: rescale the "
                            "exact profile and choose the codec at the new size")
    f_start, f_transfer = ring_factors(p, workers, cores)
    models = {lk.name: link_model(profile, lk.name) for lk in profile.links}
    links = tuple(replace(lk, alpha_s=models[lk.name][0] * f_start,
                          beta_s_per_byte=models[lk.name][1] * f_transfer) for lk in profile.links)
    times = []
    for b in profile.buckets:
        comm = {}
        for lk in profile.links:
            a, rest = _startup(profile, lk.name, models[lk.name][0], b.id)
            comm[lk.name] = a * f_start + rest * f_transfer
        t = profile.times[b.id]
        times.append(replace(t, comm_s=comm))
    meta = dict(profile.meta)
    meta["rescaled_from_world_size"] = p
    return replace(profile, links=links, times=tuple(times), world_size=workers, meta=meta)


# --------------------------------------------------------------------------------------------------
# The event engine
# --------------------------------------------------------------------------------------------------
@dataclass(slots=True)  # slots: the engine makes thousands of these per simulation
class _Compute:
    kind: str
    bucket: int
    iteration: int
    duration: float
    deps: list[int] = field(default_factory=list)  # comm ids that must have ended
    launches: list[int] = field(default_factory=list)  # comm ids launched when this task starts
    start: float = math.nan
    end: float = math.nan


@dataclass(slots=True)
class _Comm:
    link: str
    duration: float
    bucket: int
    iteration: int  # last iteration of the gradients sent
    stage_iteration: int
    label: str
    nbytes: int = 0
    priority: tuple[float, ...] = ()
    launched: bool = False
    grad_ready: bool = True
    lag: float = 0.0  # the last rank reaches it this long after it is handed to its link (link_lags)
    after: tuple[int, ...] = ()  # a verdict: the sends it judges, handed once they have all ended
    behind: int = 0  # a verdict: the queued sends it waits for, run beside the one in flight (Link.at_once)
    handed: float = math.nan
    start: float = math.nan
    end: float = math.nan


class _Engine:
    """Compute stream + one queue per link, advanced in time order (a plain discrete-event loop)."""

    def __init__(self, links: Sequence[str], credit: dict[str, int] | None = None, serial: bool = False,
                 contention: Mapping[str, float] | None = None, drag: Mapping[str, float] | None = None) -> None:
        self.serial = serial  # one send in flight over all links (hooked sends are chained)
        # link -> its contention (deft.profile.Link): compute slows while the link is busy
        self.contention = {lk: c for lk, c in (contention or {}).items() if c > 0}
        # link -> its drag (deft.profile.Link): the link's sends slow while the compute is busy
        self.drag = {lk: d for lk, d in (drag or {}).items() if d > 0}
        self.compute: list[_Compute] = []
        self.comms: list[_Comm] = []
        self.links = list(links)
        self.credit = credit or {}  # link -> credit bytes: priority + credit discipline
        self.order: dict[str, list[int]] = {lk: [] for lk in self.links}  # ordered discipline
        self.waiting_on_grad: dict[int, list[int]] = {}  # compute id -> comm ids it makes ready
        self.verdicts_of: dict[int, list[int]] = {}  # comm id -> the verdicts waiting for it (add_verdict)

    def add_comm(self, comm: _Comm, grad_after: int | None) -> int:
        cid = len(self.comms)
        if comm.link not in self.order:
            raise ContractError("<schedule>", "links", f"link {comm.link!r} is not a link of the profile")
        if grad_after is not None and math.isnan(self.compute[grad_after].end):
            comm.grad_ready = False
            self.waiting_on_grad.setdefault(grad_after, []).append(cid)
        self.comms.append(comm)
        self.order[comm.link].append(cid)
        return cid

    def add_verdict(self, link: str, duration: float, after: Sequence[int], iteration: int, behind: int = 0) -> int:
        """A verdict on the sends ``after`` (module docstring): handed to ``link`` once they have ended,
        outside the link's launch order, ahead of its queued sends but the first ``behind``."""
        cid = len(self.comms)
        self.comms.append(_Comm(link=link, duration=duration, bucket=-1, iteration=iteration, stage_iteration=iteration,
                                label="verdict", launched=True, after=tuple(after), behind=behind))
        for d in set(after):
            self.verdicts_of.setdefault(d, []).append(cid)
        return cid

    def add_compute(self, task: _Compute) -> int:
        self.compute.append(task)
        return len(self.compute) - 1

    def run(self) -> None:
        """Run every task: start what can start, then take the next instant's events; repeat until no
        event is left. Raises when a compute task is still waiting then (a dependency never sent)."""
        loop = _EventLoop(self)
        while True:
            loop.kick()
            if not loop.heap:
                break
            loop.handle_instant()
        if loop.ci < len(self.compute):
            task = self.compute[loop.ci]
            raise RuntimeError(f"simulation deadlocked at {task.kind} of bucket {task.bucket} in iteration "
                               f"{task.iteration}: a dependency is never communicated")


class _EventLoop:
    """The state of one :meth:`_Engine.run`: the clock, the event heap, the compute stream's next task
    and each link's queue.

    Events are ``(time, sequence, kind, id)``: at equal times they are handled in the order they were
    pushed, so a run is a function of the task graph alone. A send handed to its link waits in the
    link's queue (every link's, for a serial codec) until the link is free, then runs.

    Note [shared processor]
    Where links contend or drag (:class:`deft.profile.Link`), a running task's speed depends on what
    runs beside it: the compute stream's on the contending links with a send in flight, a send's on
    whether the compute stream is busy. Speeds change only when a task starts or ends, so between two
    such instants every running task's speed is constant: at each one the work done since the last is
    taken off each running task (:meth:`_settle`), the speeds are set again, and each running task's
    end is projected from its work left (:meth:`_project`). An end event pushed under an older
    projection is stale and skipped. Without contention or drag every speed is 1 and a task ends
    ``duration`` after it starts.
    """

    def __init__(self, eng: _Engine) -> None:
        self.eng = eng
        self.heap: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.now = 0.0
        self.ci = 0  # next compute task
        self.compute_busy = False
        self.head = {lk: 0 for lk in eng.links}  # ordered: next comm in launch order
        self.ready_q: dict[str, list[tuple[tuple[float, ...], int]]] = {lk: [] for lk in eng.links}
        self.in_flight = {lk: 0 for lk in eng.links}  # bytes handed to the link and not yet finished
        self.finished = [False] * len(eng.comms)
        self.queue: dict[str, deque[int]] = {}  # link (or "*": every link, serial) -> sends handed, not started
        self.handed: set[int] = set()  # sends handed to their link (queued or started)
        self.sending: dict[str, int] = {}  # link -> the send in flight on it
        self.shared = bool(eng.contention or eng.drag)  # Note [shared processor]
        self.work: dict[tuple[str, int], tuple[float, float]] = {}  # running task -> (work left, speed)
        self.work_at = 0.0  # when ``work`` was last settled
        # the links by discipline, fixed for the run: priority + credit, or launch order
        self.credited = [lk for lk in eng.links if lk in eng.credit]
        self.ordered = [(lk, eng.order[lk]) for lk in eng.links if lk not in eng.credit]

    def push(self, t: float, kind: str, idx: int) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, idx))
        self.seq += 1

    def available(self, cid: int) -> bool:
        """Launched by its stage, its gradient (or codec) done, and not yet handed to its link."""
        c = self.eng.comms[cid]
        return c.launched and c.grad_ready and cid not in self.handed

    def _key(self, link: str) -> str:
        return "*" if self.eng.serial else link

    def dispatch(self, cid: int) -> None:
        """Hand a send to its link: it starts when the link (for a serial codec, every link) is free. A
        verdict goes behind the verdicts handed before it and its ``behind`` first queued sends, ahead of
        the others (module docstring, "The ranks' verdict")."""
        c = self.eng.comms[cid]
        self.handed.add(cid)
        c.handed = self.now
        self.in_flight[c.link] += c.nbytes
        key = self._key(c.link)
        if (not self.sending if self.eng.serial else c.link not in self.sending) and not self.queue.get(key):
            self._start_comm(cid)
            return
        q = self.queue.setdefault(key, deque())
        if not c.after:
            q.append(cid)
            return
        at, sends = 0, 0
        while at < len(q) and (self.eng.comms[q[at]].after or sends < c.behind):
            sends += not self.eng.comms[q[at]].after
            at += 1
        q.insert(at, cid)

    def _start_comm(self, cid: int) -> None:
        c = self.eng.comms[cid]
        c.start = self.now
        self.sending[c.link] = cid
        # the link holds it until the last rank reaches it (module docstring, "The last rank's lag"); on a
        # shared processor that wait is run as work, so a link's drag slows it too (drag is opt-in)
        held = c.duration + max(0.0, c.handed + c.lag - self.now) if c.lag > 0 else c.duration
        if self.shared:
            self._settle()
            self.work[("comm", cid)] = (held, 1.0)
            self._project()
        else:
            c.end = self.now + held
            self.push(c.end, "comm", cid)

    # -- Note [shared processor] ----------------------------------------------------------------------
    def _settle(self) -> None:
        """Take the work done since the last change off every running task."""
        dt = self.now - self.work_at
        if dt > 0:
            self.work = {k: (left - dt * speed, speed) for k, (left, speed) in self.work.items()}
        self.work_at = self.now

    def _project(self) -> None:
        """Set every running task's speed from what runs beside it now and push its projected end."""
        eng = self.eng
        compute_speed = 1.0 / (1.0 + sum(eng.contention.get(lk, 0.0) for lk in self.sending))
        for (kind, idx), (left, _) in list(self.work.items()):
            task: _Compute | _Comm
            if kind == "compute":
                speed, task = compute_speed, eng.compute[idx]
            else:
                task = eng.comms[idx]
                speed = 1.0 / (1.0 + eng.drag.get(task.link, 0.0)) if self.compute_busy else 1.0
            end = self.now + max(0.0, left) / speed
            self.work[(kind, idx)] = (left, speed)
            if end != task.end:
                task.end = end
                self.push(end, kind, idx)

    def became_available(self, cid: int) -> None:
        c = self.eng.comms[cid]
        if c.link in self.eng.credit and self.available(cid):
            heapq.heappush(self.ready_q[c.link], (c.priority, cid))

    def kick(self) -> None:
        """Hand every send that may go to its link, then start the next compute task if it can, and
        hand the sends that task launched. Nothing more can happen at this instant then: handing a send
        ends none (so no compute task waiting on one can start), and the started task holds the stream."""
        self._dispatch_links()
        if self._start_compute():
            self._dispatch_links()

    def _dispatch_links(self) -> None:
        eng = self.eng
        for lk in self.credited:
            q = self.ready_q[lk]
            # ByteScheduler's Algorithm 1, line 16: remaining credit > size (strictly); a piece
            # no smaller than the whole credit goes alone rather than never.
            while q and (self.in_flight[lk] == 0
                         or eng.credit[lk] - self.in_flight[lk] > eng.comms[q[0][1]].nbytes):
                _, cid = heapq.heappop(q)
                self.dispatch(cid)
        comms, handed = eng.comms, self.handed
        for lk, order in self.ordered:
            head = self.head[lk]
            while head < len(order):
                c = comms[order[head]]  # available(): launched, its gradient done, not yet handed
                if not (c.launched and c.grad_ready and order[head] not in handed):
                    break
                self.dispatch(order[head])
                head += 1
            self.head[lk] = head

    def _start_compute(self) -> bool:
        """The compute stream runs its tasks in order, each once the sends it depends on have ended;
        starting one launches the sends it carries."""
        eng = self.eng
        if self.compute_busy or self.ci >= len(eng.compute):
            return False
        task = eng.compute[self.ci]
        finished = self.finished
        for d in task.deps:
            if not finished[d]:
                return False
        task.start = self.now
        if self.shared and task.duration > 0:
            self._settle()
            self.compute_busy = True
            self.work[("compute", self.ci)] = (task.duration, 1.0)
            self._project()
        else:
            self.compute_busy = True
            task.end = self.now + task.duration
            self.push(task.end, "compute", self.ci)
        for cid in task.launches:
            eng.comms[cid].launched = True
            self.became_available(cid)
        self.ci += 1
        return True

    def handle_instant(self) -> None:
        """Advance the clock to the next event and handle every event of that instant before deciding
        anything, so a priority queue sees all the pieces that become ready at the same time as a
        credit is returned."""
        heap = self.heap
        self.now = heap[0][0]
        changed = False
        while heap and heap[0][0] == self.now:
            t, _, kind, idx = heapq.heappop(heap)
            if kind == "compute":
                if t != self.eng.compute[idx].end or idx != self.ci - 1 or not self.compute_busy:
                    continue  # a projection that a later one replaced (Note [shared processor])
                if self.shared:
                    self._settle()
                    self.work.pop(("compute", idx), None)
                    changed = True
                self.compute_busy = False
                for cid in self.eng.waiting_on_grad.get(idx, ()):
                    self.eng.comms[cid].grad_ready = True
                    self.became_available(cid)
            else:
                c = self.eng.comms[idx]
                if self.finished[idx] or t != c.end:
                    continue  # likewise
                if self.shared:
                    self._settle()
                    self.work.pop(("comm", idx), None)
                    changed = True
                self.finished[idx] = True
                self.in_flight[c.link] -= c.nbytes
                del self.sending[c.link]
                q = self.queue.get(self._key(c.link))
                if q:
                    self._start_comm(q.popleft())
                for vid in self.eng.verdicts_of.get(idx, ()):
                    if all(self.finished[d] for d in self.eng.comms[vid].after) and vid not in self.handed:
                        self.dispatch(vid)
        if changed:
            self._project()


# --------------------------------------------------------------------------------------------------
# Building the task graph of each scheme
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Message:
    """One all-reduce of one iteration in a synchronous scheme."""

    link: str
    parts: tuple[tuple[int, float], ...]  # (bucket, fraction of it)
    nbytes: int
    priority: tuple[float, ...] = ()

    @property
    def ready_bucket(self) -> int:
        return max(b for b, _ in self.parts)  # the last of its buckets to finish backward


@dataclass
class _Tasks:
    """Compute task ids of one iteration: forward (buckets n-1..0), backward (0..n-1) and codec tasks."""

    fwd: list[int]
    bwd: list[int]
    pre_fwd: list[int] = field(default_factory=list)   # codecs before the forward, in the order asked
    pre_bwd: list[int] = field(default_factory=list)   # codecs between forward and backward
    after: dict[int, list[int]] = field(default_factory=dict)  # bucket -> codecs right after its backward


def _iteration_tasks(eng: _Engine, profile: Profile, t: int, fwd_deps: dict[int, list[int]], *,
                     pre_fwd: Sequence[tuple[int, float]] = (), pre_bwd: Sequence[tuple[int, float]] = (),
                     after: Sequence[tuple[int, float]] = ()) -> _Tasks:
    """The compute tasks of iteration ``t`` in stream order: codecs ``pre_fwd``, forward, codecs
    ``pre_bwd``, backward with each ``after`` codec ``(bucket, seconds)`` right after its bucket."""
    n = profile.n
    tasks = _Tasks([], [])
    tasks.pre_fwd = [eng.add_compute(_Compute("codec", b, t, d)) for b, d in pre_fwd]
    tasks.fwd = [eng.add_compute(_Compute("forward", b, t, profile.times[b].forward_s,
                                          deps=list(fwd_deps.get(b, ())))) for b in range(n - 1, -1, -1)]
    tasks.pre_bwd = [eng.add_compute(_Compute("codec", b, t, d)) for b, d in pre_bwd]
    codecs_after: dict[int, list[float]] = {}
    for bb, d in after:
        codecs_after.setdefault(bb, []).append(d)
    for b in range(n):
        tasks.bwd.append(eng.add_compute(_Compute("backward", b, t, profile.times[b].backward_s)))
        for d in codecs_after.get(b, ()):
            tasks.after.setdefault(b, []).append(eng.add_compute(_Compute("codec", b, t, d)))
    return tasks


def _message_codec_s(profile: Profile, parts: Sequence[tuple[int, float]]) -> float:
    """The codec's compute for one message of ``(bucket, fraction)`` parts: ``sum f_i codec_s(b_i)``."""
    return sum(frac * profile.codec_time(b) for b, frac in parts)


def link_lags(profile: Profile) -> dict[str, float]:
    """Per link, the seconds after its hand-over that a send waits for the last rank (the link's
    ``lag_s``; links without one absent)."""
    return {lk.name: lk.lag_s for lk in profile.links if lk.lag_s > 0}


def _run_synchronous(profile: Profile, messages: Sequence[_Message], iterations: int, *, barrier: bool,
                     credit: dict[str, int] | None = None) -> _Engine:
    """Every iteration sends ``messages`` (in this launch order) once its gradients are ready.

    ``barrier``: the optimizer step waits for all of them (DDP); otherwise the forward of each bucket in
    the next iteration waits for the messages containing it (ByteScheduler, US-Byte).
    """
    eng = _engine(profile, credit)
    alpha = {lk: link_model(profile, lk)[0] for lk in profile.link_names}
    lag = link_lags(profile)
    fwd_deps: dict[int, list[int]] = {}
    codecs = [(m.ready_bucket, _message_codec_s(profile, m.parts)) for m in messages]
    coded = [d > 0 for _, d in codecs]
    for t in range(iterations):
        tasks = _iteration_tasks(eng, profile, t, fwd_deps,
                                 after=[c for c, on in zip(codecs, coded, strict=True) if on])
        bwd = tasks.bwd
        codec_ids = {b: list(ids) for b, ids in tasks.after.items()}
        ids = []
        for m, on in zip(messages, coded, strict=True):
            grad_after = codec_ids[m.ready_bucket].pop(0) if on else bwd[m.ready_bucket]
            label = "+".join(str(b) for b in sorted({b for b, _ in m.parts}))
            if any(f < 1.0 for _, f in m.parts):
                label += "'"  # a piece of a partitioned bucket
            duration = message_time(profile, m.link, m.parts, alpha[m.link])
            cid = eng.add_comm(_Comm(link=m.link, duration=duration,
                                     bucket=m.ready_bucket, iteration=t, stage_iteration=t, label=label,
                                     nbytes=m.nbytes, priority=m.priority, lag=lag.get(m.link, 0.0)),
                               grad_after=grad_after)
            eng.comms[cid].launched = True
            ids.append(cid)
        fwd_deps = {}
        eng.add_compute(_Compute("update", -1, t, profile.step_s, deps=ids if barrier else []))
        if not barrier:
            for m, cid in zip(messages, ids, strict=True):
                for b, _ in m.parts:
                    fwd_deps.setdefault(b, []).append(cid)
    return eng


def _fused(profile: Profile, link: str, groups: Sequence[Sequence[int]]) -> list[_Message]:
    return [_Message(link, tuple((b, 1.0) for b in g), sum(profile.buckets[b].nbytes for b in g)) for g in groups]


def _bytes_per_element(profile: Profile, b: int) -> float:
    bk = profile.buckets[b]
    return bk.nbytes / bk.numel if bk.numel else 4.0


def _ddp_messages(profile: Profile, link: str, config: DeftConfig) -> list[_Message]:
    groups = baselines.ddp_buckets([b.nbytes for b in profile.buckets], int(config.bucket_cap_mb * 2**20))
    return _fused(profile, link, groups)


def _mgwfbp_messages(profile: Profile, link: str, config: DeftConfig) -> list[_Message]:
    n = profile.n
    alpha, beta = link_model(profile, link)
    # MG-WFBP indexes layers from the input: layer l is bucket n-1-l.
    back = [profile.times[n - 1 - layer].backward_s for layer in range(n)]
    size = [float(profile.buckets[n - 1 - layer].nbytes) for layer in range(n)]
    method = config.extra.get("mgwfbp_method", "paper")
    if method not in ("paper", "optimal"):
        raise ContractError("<config>", "extra.mgwfbp_method", f"expected 'paper' or 'optimal', got {method!r}")
    groups = baselines.mgwfbp_merge(back, size, alpha, beta, method=method)
    bucket_groups = sorted((sorted(n - 1 - layer for layer in g) for g in groups), key=lambda g: g[0])
    return _fused(profile, link, bucket_groups)


def _extra_int(config: DeftConfig, key: str, default: int) -> int:
    v = config.extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ContractError("<config>", f"extra.{key}", f"expected a positive number, got {v!r}")
    return int(v)


def _bytescheduler_messages(profile: Profile, link: str, config: DeftConfig) -> tuple[list[_Message], int]:
    numel = _extra_int(config, "bytescheduler_partition_numel", config.partition_numel)
    msgs = []
    for b in range(profile.n):
        unit = max(1, round(numel * _bytes_per_element(profile, b)))
        nb = profile.buckets[b].nbytes
        for j, size in enumerate(baselines.partition_sizes(nb, unit)):
            frac = size / nb if nb else 1.0
            # Priority: the input side (high bucket id) first, then the pieces in order.
            msgs.append(_Message(link, ((b, frac),), size, priority=(-b, j)))
    credit_default = 2 * max(1, round(numel * _bytes_per_element(profile, profile.n - 1)))
    credit = _extra_int(config, "bytescheduler_credit_bytes", credit_default)
    return msgs, credit


def usbyte_plan_for(profile: Profile, link: str, config: DeftConfig) -> baselines.UsbytePlan:
    """US-Byte's plan on ``profile``'s buckets as layers (layer l = bucket n-1-l), primary link model."""
    n = profile.n
    alpha, beta = link_model(profile, link)
    numel = _extra_int(config, "usbyte_partition_numel", config.partition_numel)
    bpe = sum(b.nbytes for b in profile.buckets) / max(1, sum(b.numel for b in profile.buckets)) or 4.0
    sp = max(1, round(numel * bpe))
    back = [profile.times[n - 1 - i].backward_s for i in range(n)]
    fwd = [profile.times[n - 1 - i].forward_s for i in range(n)]
    size = [profile.buckets[n - 1 - i].nbytes for i in range(n)]
    return baselines.usbyte_plan(back, fwd, size, alpha, beta, sp)


def _usbyte_messages(profile: Profile, link: str, config: DeftConfig) -> list[_Message]:
    plan = usbyte_plan_for(profile, link, config)
    n = profile.n
    msgs = []
    for op in plan.ops:
        b = n - 1 - op.layer
        nb = profile.buckets[b].nbytes
        msgs.append(_Message(link, ((b, op.nbytes / nb if nb else 1.0),), op.nbytes))
    return msgs


def _schedule_engine(profile: Profile, schedule: Schedule, iterations: int) -> _Engine:
    """The task graph of a cyclic schedule.

    An update finishing in the forward (``Update.finish_in_forward``) is applied at its step for the
    buckets sent in backward stages; its next-forward sends are launched right after its backward
    (as the runtime does), and the next iteration's forward of each such bucket waits for its send:
    the per-layer wait of a lag-free forward stage. Its ``deferred`` buckets are sent in the backward
    stage like any other, but the step does not wait for them; the next forward of each does. The
    runtime waits in a module's forward pre-hook, so a bucket holding a piece of a parameter is waited
    for by the forward of the first bucket holding that parameter
    (:attr:`~deft.profile.Profile.forward_gates`). Likewise a bucket's gradient is complete when its
    parameters' are: a send of this iteration's gradient of a piece of a cut parameter waits for the
    backward of the parameter's last piece (:attr:`~deft.profile.Profile.gradient_ready`, where the
    layer's backward ends), not for its own share of it.
    """
    graph = _ScheduleGraph(profile, schedule)
    for t in range(iterations):
        graph.add_iteration(t)
    return graph.eng


class _ScheduleGraph:
    """Builds :func:`_schedule_engine`'s task graph one iteration at a time.

    Tasks are added in stream order (an iteration's codecs, forward, backward, launch marker, step) and
    each send right after the task that launches it, so task ids, and with them the engine's ordering
    of simultaneous events, follow the schedule.
    """

    def __init__(self, profile: Profile, schedule: Schedule) -> None:
        self.profile = profile
        self.schedule = schedule
        self.eng = _engine(profile)
        self.gate = profile.forward_gates
        self.ready = profile.gradient_ready
        self.bwd_of: dict[int, list[int]] = {}  # iteration -> its backward tasks' ids, by bucket
        self.comm_of: dict[tuple[int, int], int] = {}  # (group's last iteration, bucket) -> comm id
        # sends of updates finishing in the next forward: group's last iteration -> bucket -> comm id
        self.ahead: dict[int, dict[int, int]] = {}
        # each position's update group (looked up per send)
        self.update_at = tuple(schedule.updates[schedule.group_of(p)] for p in range(schedule.cycle))
        self.deferred_at = tuple(frozenset(u.deferred) for u in self.update_at)
        self.lag = link_lags(profile)
        self.guarded = {lk.name for lk in profile.links[1:] if lk.guarded}
        self.primary = profile.links[0].name
        self.verdict_s = link_model(profile, self.primary)[0] if self.guarded else 0.0
        self.verdict_behind = profile.links[0].at_once() - 1

    def _finishing(self, position: int) -> bool:
        return self.update_at[position % self.schedule.cycle].finish_in_forward

    def _deferred(self, position: int) -> frozenset[int]:
        return self.deferred_at[position % self.schedule.cycle]

    def _send_ahead(self, last: int, bucket: int, cid: int) -> None:
        """Send ``cid`` of ``bucket``'s update ending at ``last`` is waited for by the next forward."""
        self.ahead.setdefault(last, {})[bucket] = cid

    def _add(self, task_link: str, bucket: int, last: int, t: int, label: str, after: int | None = None) -> int:
        """A send of ``bucket`` of the group ending at ``last``, launched in iteration ``t``; it waits for
        ``after`` (its codec task) or else for the backward that completes its gradient."""
        profile = self.profile
        return self.eng.add_comm(_Comm(link=task_link, duration=profile.comm_time(bucket, task_link), bucket=bucket,
                                       iteration=last, stage_iteration=t, label=label,
                                       nbytes=profile.buckets[bucket].wire, lag=self.lag.get(task_link, 0.0)),
                                 grad_after=self.bwd_of[last][self.ready[bucket]] if after is None else after)

    def _sent(self, position: int, stage: str) -> list[CommTask]:
        """The stage's sends, less the forward sends of a lag-free update: those are launched right after
        their group's backward instead (:meth:`_launch_next_forward_sends`)."""
        comms = self.schedule.stage(position, stage).comms
        if stage == "forward" and self._finishing(position - 1):
            return [task for task in comms if task.origin != 1]
        return list(comms)

    def _codec(self, tasks: Sequence[CommTask]) -> list[tuple[int, float]]:
        profile = self.profile
        return [(task.bucket, profile.codec_time(task.bucket)) for task in tasks if profile.codec_time(task.bucket) > 0]

    def add_iteration(self, t: int) -> None:
        """Iteration ``t``'s compute, the sends its stages launch, and its optimizer step."""
        p = t % self.schedule.cycle
        # Sends that exist in this iteration (their group began after the simulation started).
        fwd_sent = [task for task in self._sent(p, "forward") if t - task.origin >= 0]
        bwd_sent = [task for task in self._sent(p, "backward") if t - task.origin >= 0]
        # a send of this iteration's gradient is encoded once its bucket's gradient is complete
        now_sent = [task for task in bwd_sent if task.origin == 0]
        tasks = _iteration_tasks(self.eng, self.profile, t, {}, pre_fwd=self._codec(fwd_sent),
                                 pre_bwd=self._codec([task for task in bwd_sent if task.origin >= 1]),
                                 after=[(self.ready[b], d) for b, d in self._codec(now_sent)])
        self.bwd_of[t] = tasks.bwd
        self._wait_for_forward_sends(t, tasks.fwd)
        self._launch_stage_sends(t, p, tasks, fwd_sent, bwd_sent)
        if self._finishing(p) and self.update_at[p].last == p:
            self._launch_next_forward_sends(t, p)
        self._optimizer_step(t, p)

    def _wait_for_forward_sends(self, t: int, fwd: list[int]) -> None:
        """The forward of bucket ``b``'s module (``fwd`` lists buckets ``n-1..0``) waits for the send of a
        lag-free update finishing in this forward: the runtime's wait in the module's pre-hook."""
        n, eng = self.profile.n, self.eng
        ahead = dict(sorted(self.ahead.get(t - 1, {}).items()))  # by bucket
        judged = [cid for cid in ahead.values() if eng.comms[cid].link in self.guarded]
        verdict = eng.add_verdict(self.primary, self.verdict_s, judged, t - 1, self.verdict_behind) if judged else None
        for b, cid in ahead.items():
            wait = verdict if verdict is not None and eng.comms[cid].link in self.guarded else cid
            eng.compute[fwd[n - 1 - self.gate[b]]].deps.append(wait)

    def _launch_stage_sends(self, t: int, p: int, tasks: _Tasks, fwd_sent: list[CommTask],
                            bwd_sent: list[CommTask]) -> None:
        """The forward and backward stages' sends, launched when their stage starts, in the schedule's
        order; a coded send takes its codec task in the order the codecs were added."""
        eng, profile, ready = self.eng, self.profile, self.ready
        pending = {"forward": list(tasks.pre_fwd), "backward": list(tasks.pre_bwd)}
        after = {b: list(ids) for b, ids in tasks.after.items()}
        for stage, first, stage_sent in (("forward", tasks.fwd[0], fwd_sent), ("backward", tasks.bwd[0], bwd_sent)):
            # (tasks not sent: before the simulation started, or launched after their group's backward)
            for task in stage_sent:
                last = t - task.origin
                label = str(task.bucket) + (f"({task.origin})" if task.origin else "")
                coded = profile.codec_time(task.bucket) > 0
                now = task.origin == 0 and stage == "backward"
                encode = None if not coded else (after[ready[task.bucket]].pop(0) if now else pending[stage].pop(0))
                cid = self._add(task.link, task.bucket, last, t, label, encode)
                eng.compute[first].launches.append(cid)
                self.comm_of[(last, task.bucket)] = cid
                if stage == "backward" and task.origin == 0 and task.bucket in self._deferred(p):
                    self._send_ahead(last, task.bucket, cid)  # sent now, waited for by the next forward

    def _launch_next_forward_sends(self, t: int, p: int) -> None:
        """A lag-free update ending at ``p``: its next-forward sends are launched right after this
        backward (a zero-time launch marker), each after its codec task, and waited for by the forward."""
        eng, profile = self.eng, self.profile
        marker = eng.add_compute(_Compute("launch", -1, t, 0.0))
        for task in self.schedule.stage(p + 1, "forward").comms:
            if task.origin == 1:
                d = profile.codec_time(task.bucket)
                encode = eng.add_compute(_Compute("codec", task.bucket, t, d)) if d > 0 else None
                cid = self._add(task.link, task.bucket, t, t + 1, f"{task.bucket}(f)", encode)
                eng.compute[marker].launches.append(cid)
                self._send_ahead(t, task.bucket, cid)

    def _optimizer_step(self, t: int, p: int) -> None:
        """The step after position ``p`` waits for every send of the updates due there, except those
        the next forward waits for (lag-free sends)."""
        schedule, c, n = self.schedule, self.schedule.cycle, self.profile.n
        deps: list[int] = []
        applied = False
        for g, back in schedule.updates_due(p):
            last = (t // c - back) * c + schedule.updates[g].last
            if last >= 0:
                ahead = self.ahead.get(last, {})
                deps.extend(self.comm_of[(last, b)] for b in range(n) if b not in ahead)
                applied = True
        judged = [cid for cid in deps if self.eng.comms[cid].link in self.guarded]
        if judged:
            deps.append(self.eng.add_verdict(self.primary, self.verdict_s, judged, t, self.verdict_behind))
        # "step": an optimizer step with no update due changes nothing and waits for nothing.
        self.eng.add_compute(_Compute("update" if applied else "step", -1, t, self.profile.step_s, deps=deps))


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------
def _result(scheme: str, profile: Profile, eng: _Engine, cycle: int, warm: int, measured: int,
            updates_per_iteration: float, meta: dict[str, object]) -> SimResult:
    starts: list[float] = []
    for task in eng.compute:
        if task.kind == "forward" and task.iteration == len(starts):
            starts.append(task.start)
    t0, t1 = starts[warm], starts[warm + measured]
    span = t1 - t0
    iteration_s = span / measured

    def overlap(s: float, e: float) -> float:
        return max(0.0, min(e, t1) - max(s, t0))

    busy = sum(overlap(x.start, x.end) for x in eng.compute)
    util = {lk: (sum(overlap(x.start, x.end) for x in eng.comms if x.link == lk) / span if span > 0 else 0.0)
            for lk in profile.link_names}
    # Convergence check: the two halves of the window (whole cycles each) should agree.
    half = (measured // cycle // 2) * cycle
    if half:
        first = (starts[warm + half] - t0) / half
        second = (t1 - starts[warm + measured - half]) / half
        meta = {**meta, "converged": abs(first - second) <= 1e-6 * max(first, second, 1e-12)}
    return SimResult(scheme=scheme, iteration_s=iteration_s,
                     compute_bound_s=profile.forward_s + profile.backward_s + profile.step_s,
                     # max: busy may exceed the span by rounding (codec tasks end where the span ends)
                     bubble_ratio=max(0.0, (span - busy) / span) if span > 0 else 0.0,
                     updates_per_iteration=updates_per_iteration, link_utilization=util,
                     events=_Events(eng.compute, eng.comms), window=(t0, t1), iteration_starts=tuple(starts),
                     cycle=cycle,
                     meta=meta)


class _Events(Sequence[SimEvent]):
    """A simulation's :class:`SimEvent` bars, made from the engine's tasks when first read: a planner
    prices many schedules by their figures alone and would otherwise make every bar of each."""

    def __init__(self, compute: Sequence[_Compute], comms: Sequence[_Comm]) -> None:
        self._compute, self._comms = compute, comms

    @functools.cached_property
    def _bars(self) -> tuple[SimEvent, ...]:
        bars = [SimEvent("compute", x.kind, x.bucket, x.iteration, x.start, x.end,
                         "" if x.kind in ("update", "step", "launch") else str(x.bucket), x.iteration)
                for x in self._compute]
        bars += [SimEvent(x.link, "verdict" if x.after else "comm", x.bucket, x.iteration, x.start, x.end, x.label,
                          x.stage_iteration)
                 for x in self._comms if not math.isnan(x.start)]
        return tuple(bars)

    @overload
    def __getitem__(self, i: int) -> SimEvent: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[SimEvent, ...]: ...

    def __getitem__(self, i: int | slice) -> SimEvent | tuple[SimEvent, ...]:
        return self._bars[i]

    def __len__(self) -> int:
        return len(self._bars)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]  # equal by value; unhashable, as SimResult is (its dicts)

    def __repr__(self) -> str:
        return f"<{len(self)} simulated events>"


def _window(cycle: int, iterations: int) -> tuple[int, int]:
    """(warm-up, measured) iteration counts, both whole cycles."""
    warm_cycles = max(4, math.ceil(16 / cycle))
    measured_cycles = max(2, math.ceil(iterations / cycle))
    return warm_cycles * cycle, measured_cycles * cycle


def simulate_schedule(profile: Profile, schedule: Schedule, *, iterations: int = 24,
                      scheme: str = "schedule", warmup: int | None = None) -> SimResult:
    """Simulate a DeFT :class:`Schedule` (delayed updates, every link it names) on ``profile``.

    ``profile`` must be the one the schedule was planned on (same buckets, after any partition).
    ``warmup``: iterations simulated before the measured window (rounded up to whole cycles; default
    at least 16 iterations and 4 cycles). A search that compares many cycle-1 candidates may take
    fewer; the result's ``meta["converged"]`` says whether the two halves of the window agreed.
    """
    if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1):
        raise ContractError("<simulate>", "warmup", f"expected an integer >= 1, got {warmup!r}")
    if schedule.n_buckets != profile.n or tuple(b.nbytes for b in profile.buckets) != schedule.bucket_nbytes:
        raise ContractError("<schedule>", "bucket_nbytes",
                            f"the schedule has {schedule.n_buckets} buckets of other sizes than the profile's "
                            f"{profile.n}: simulate it on the (partitioned) profile it was planned on")
    missing = [lk for lk in schedule.links if lk not in profile.link_names]
    if missing:
        raise ContractError("<schedule>", "links", f"links {missing} are not in the profile "
                            f"(profile links: {', '.join(profile.link_names)})")
    warm, measured = _window(schedule.cycle, iterations)
    if warmup is not None:
        warm = math.ceil(warmup / schedule.cycle) * schedule.cycle
    eng = _schedule_engine(profile, schedule, warm + measured + 1)
    eng.run()
    return _result(scheme, profile, eng, schedule.cycle, warm, measured, schedule.updates_per_iteration,
                   {"batch_sequence": list(schedule.batch_sequence), "links": list(schedule.links)})


def simulate_baseline(profile: Profile, scheme: str, config: DeftConfig | str | JsonDict | None = None, *,
                      iterations: int = 24) -> SimResult:
    """Steady-state iteration of baseline ``scheme`` (one of :data:`BASELINES`) on ``profile``.

    Baselines use the primary (first) link only, as their papers do (see the module docstring).
    """
    cfg = DeftConfig.resolve(config)
    if scheme not in BASELINES:
        raise ContractError("<scheme>", "scheme", f"expected one of {', '.join(BASELINES)}, got {scheme!r}")
    link = profile.links[0].name
    meta: dict[str, object] = {"link": link}
    credit = None
    barrier = scheme in ("ddp", "wfbp", "mgwfbp")
    if scheme == "ddp":
        msgs = _ddp_messages(profile, link, cfg)
    elif scheme == "wfbp":
        msgs = _fused(profile, link, [[b] for b in range(profile.n)])
    elif scheme == "mgwfbp":
        msgs = _mgwfbp_messages(profile, link, cfg)
    elif scheme == "bytescheduler":
        msgs, cr = _bytescheduler_messages(profile, link, cfg)
        credit = {link: cr}
        meta["credit_bytes"] = cr
    else:
        msgs = _usbyte_messages(profile, link, cfg)
    meta["messages"] = len(msgs)
    warm, measured = _window(1, iterations)
    eng = _run_synchronous(profile, msgs, warm + measured + 1, barrier=barrier, credit=credit)
    eng.run()
    return _result(scheme, profile, eng, 1, warm, measured, 1.0, meta)
