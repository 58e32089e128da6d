"""The executor: runs a cyclic :class:`~deft.schedule.Schedule` on real buckets and real links.

Iteration ``t`` (counted from 0 over training iterations only) sits at position
``p = (t - t0) % cycle`` of the schedule installed at iteration ``t0``. Its gradient is added into the
flat buffers of its *update group instance*, named by the global index of the group's last iteration
``last = t - p + updates[group_of(p)].last``. The buffers of a group instance therefore hold the local
sum of the gradients of its ``k`` iterations (the paper's future task queue, merged); the instances
whose buckets are being sent are the current task queue.

Launch rules (every rank executes the same ones, so each link sees the same collectives in the same
order everywhere):

* forward stage of ``t``: at forward start, launch ``stage(p, "forward").comms`` (all ``origin >= 1``:
  their group finished, nothing to wait for);
* backward stage of ``t``: at the first gradient of the backward, queue ``stage(p, "backward").comms``;
  a task of ``origin == 0`` becomes ready when its bucket's gradient of this iteration is complete, an
  ``origin >= 1`` task is ready at once; per link, a task launches only after every task listed before
  it on that link (strict listed order);
* at the end of backward, parameters that got no gradient count as zero contribution, completing every
  bucket, and whatever remains is launched; a group instance that ends with ``t`` also launches the
  all-reduce of its *used map* (how many iterations each parameter got a gradient, torch DDP's
  ``find_unused_parameters`` bookkeeping) on the primary link, so that a parameter no rank used in any
  merged iteration keeps ``grad = None`` as under torch DDP;
* an update finishing in the forward (``Update.finish_in_forward``) then launches its next forward
  stage's sends (behind the backward's on each link). At its step only the parameters outside those
  buckets and outside ``Update.deferred`` (buckets sent in the backward, waited for later) are waited
  for and applied; the rest are waited for and applied in :meth:`Executor.finish`, called just before
  their module's forward. When every parameter got a gradient on this rank the step does not wait for
  the used map either (it cannot say "unused" for any of them).

A task whose group instance ends before ``t0`` (the cycle that ran before this schedule) is skipped, as
is its update: those gradients were applied by the previous schedule.

Waiting happens only in :meth:`Executor.take_update`, :meth:`Executor.finish` (and
:meth:`Executor.drain`), i.e. where the update's averaged gradient is needed, and in
:meth:`Executor.settle_all` before a checkpoint. Every wait is bounded by ``timeout_s`` and a failure
becomes a :class:`~deft.errors.CommunicationError` naming this rank, the link and the collective.

Sends on a non-primary link are *guarded* (:mod:`deft.runtime.failover`, :meth:`Executor.guard_links`):
they run on a copy of the bucket, and a result is copied into the buffers only once the ranks' verdict
on its send is reached (:mod:`deft.runtime.verdicts`): a lost link's buckets are summed again from the
buffers' local gradients, and its later sends go on the primary. Every rank opens verdicts on the same
sends at the same points (in a backward, once the last send its step settles is launched; the step; right
after it :meth:`Executor.open_pending`), so they match.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from deft.errors import CommunicationError, DeftError
from deft.profiler import nvtx
from deft.runtime.buckets import FlatLayout
from deft.runtime.checkpoint import GroupState
from deft.runtime.codecs.hooks import CommHook, hook_bucket, hook_result
from deft.runtime.control import FUTURE_TYPES, Collective, wait_work
from deft.runtime.failover import LinkFailover
from deft.runtime.hierarchy import HierarchicalWork
from deft.runtime.links import CommLink
from deft.runtime.verdicts import Verdict
from deft.schedule import CommTask, Schedule


class ExecutorObserver(Protocol):
    """Who watches the executor (the warm-up timer, the preserver's statistics, the backward trace
    ranges). Called on the training thread, except :meth:`hook_started`, which a chained comm hook may
    call from a gloo thread."""

    def bucket_ready(self, b: int) -> None:
        """Bucket ``b``'s gradient of this iteration is complete (before its send is launched)."""

    def hook_started(self, b: int, t: float) -> None:
        """A chained comm hook's send of bucket ``b`` really starts (``time.perf_counter()``)."""

    def launched(self, b: int, link: str, works: list[Collective], t_start: float) -> None:
        """Bucket ``b``'s collectives (``works``) were launched on ``link``; the launch began at ``t_start``."""


class SendJudge(Protocol):
    """Called at one iteration's first gradient and at the end of its backward, around its sends (the
    first iteration's codec, :mod:`deft.runtime.codecs.first_iteration`). Both calls are collective;
    every rank makes them. The judge decides; the executor only sends with the hooks it is given."""

    def at_first_gradient(self, executor: Executor) -> bool:
        """At the iteration's first gradient, before any of its sends: whether :meth:`at_backward_end` is
        wanted (meanwhile the judge may :meth:`Executor.use_hooks`); False: the sends go as they are."""

    def at_backward_end(self, executor: Executor) -> None:
        """At the end of the backward, every one of its sends launched (it may
        :meth:`Executor.send_again` them)."""


T = TypeVar("T")


@dataclass
class Pending:
    """One launched collective (a Work, or a comm hook's Future) and what it was, for error messages.

    ``post``: run once with the future's value after it completes (a hook's result into the buffer).
    ``resend``: a guarded send's bucket (:mod:`deft.runtime.failover`), this rank's local gradient, which
    the collective runs on a copy of: all-reduced again if its link is lost. ``verdict``: the ranks'
    verdict on it once opened (:mod:`deft.runtime.verdicts`), ``index`` its place there."""

    work: Collective
    link: str
    what: str
    post: Callable[[object], None] | None = None
    resend: torch.Tensor | None = None
    verdict: Verdict | None = None
    index: int = -1


@dataclass
class GroupInstance:
    """The merged local gradient of one update group instance and its collectives in flight."""

    last: int
    k: int
    iterations: list[int]
    buffers: dict[torch.dtype, torch.Tensor]
    local_used: list[int]  # per trainable parameter: iterations of this group it got a gradient here
    launched: set[int] = field(default_factory=set)
    used_launched: bool = False
    pending: dict[int, list[Pending]] = field(default_factory=dict)  # bucket (-1: used map) -> in flight
    finish_in_forward: bool = False
    deferred: set[int] | None = None  # finishing: parameters applied at the next forward, not yet applied
    used: list[int] | None = None     # the all-reduced used map, once waited for (finishing groups)
    all_used_locally: bool = False    # every parameter got a gradient on this rank (then on some rank)
    used_map: torch.Tensor | None = None  # int32 on the device: local_used, all-reduced once launched

    @property
    def complete(self) -> bool:
        """All ``k`` iterations have contributed."""
        return len(self.iterations) == self.k


@dataclass
class DueUpdate:
    """The gradients of one due update, ready for the optimizer: averaged per parameter (None: no rank
    used it). What the schedule says of the update (positions, when it is applied) is
    :class:`deft.schedule.Update`; this is its gradient at application time."""

    iterations: tuple[int, ...]
    grads: list[torch.Tensor | None]


@dataclass(frozen=True)
class PendingUpdate:
    """A queued update as a user sees it: the iterations merged so far (of ``k``) and the buckets sent."""

    iterations: tuple[int, ...]
    k: int
    buckets_sent: tuple[int, ...]
    finishing: bool = False  # applied at its step except parameters that get it just before their forward


class Executor:
    """Launches the scheduled collectives of each stage and assembles the due updates."""

    def __init__(self, params: list[torch.Tensor], links: dict[str, CommLink], rank: int, world: int,
                 timeout_s: float, device: torch.device) -> None:
        self.params = params
        self.links = links
        self.primary = next(iter(links))
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.device = device
        self.schedule: Schedule | None = None
        self.layout: FlatLayout | None = None
        self.t0 = 0
        self.groups: dict[int, GroupInstance] = {}
        self._pool: list[dict[torch.dtype, torch.Tensor]] = []
        # id of a buffer set -> (the set, the layout, each parameter's slice of it); see _param_views
        self._views: dict[int, tuple[dict[torch.dtype, torch.Tensor], FlatLayout, list[torch.Tensor]]] = {}
        # Per-iteration state.
        self.t = -1
        self.in_backward = False
        self.backward_done = False
        self._captured: list[bool] = []  # gradient of this iteration complete (bucket readiness)
        self._touched: list[bool] = []   # got any gradient this iteration (the used map)
        self._bucket_missing: list[int] = []
        self._queues: dict[str, deque[CommTask]] = {}
        self._stage = ""
        self.observers: list[ExecutorObserver] = []
        # Set for one iteration (judge_backward): called around its backward sends.
        self._judge: SendJudge | None = None
        self._copies = False  # this iteration's hooks get copies of their buckets (use_hooks)
        # The hook of each bucket (None: a plain all-reduce; empty: none hooked), given with the schedule
        self._hooks: tuple[CommHook | None, ...] = ()
        self._chained_hooks = False  # some bucket's hook is chained (CommHook.chained): so is the used map
        # The last chained launch (_chained): a hook's bucket or the used map, so its value type is open.
        self._hook_tail: torch.futures.Future[Any] | None = None
        self.failover: LinkFailover | None = None  # guards the sends on non-primary links (guard_links)
        self._hold = False  # install(hold=True): this iteration's backward sends wait for its end
        # In a backward: the buckets its step will settle, per due group (last), until their verdict opens
        self._step_needs: dict[int, set[int]] | None = None

    # -- schedule ------------------------------------------------------------------------------
    def install(self, schedule: Schedule, layout: FlatLayout, t0: int, hooks: Sequence[CommHook | None] = (),
                hold: bool = False) -> None:
        """Run ``schedule`` from iteration ``t0`` on, bucket ``b`` sent by ``hooks[b]`` (None or no hooks: a
        plain all-reduce); no group instance may be pending. ``hold``: the backward stage's sends of this
        iteration's gradients wait for the end of the backward (a profile iteration that times the
        backward with no collective beside it, :mod:`deft.runtime.warmup_timer`)."""
        if self.groups:
            raise DeftError("internal: a schedule can only be installed when no update is pending")
        missing = [n for n in schedule.links if n not in self.links]
        if missing:
            raise DeftError(f"the schedule uses link(s) {missing} that the config does not define "
                            f"(config links: {list(self.links)})")
        if tuple(layout.bucket_numel) != tuple(schedule.bucket_numel):
            raise DeftError("internal: layout and schedule disagree on the buckets")
        if self.layout is None or self.layout.dtype_numel != layout.dtype_numel:
            self._pool.clear()
        self._views.clear()  # slices of the old layout (the buffers themselves may be reused)
        self.schedule, self.layout, self.t0 = schedule, layout, t0
        self._hold = hold
        self.use_hooks(hooks)

    def guard_links(self, failover: LinkFailover) -> None:
        """Sends on the links ``failover`` guards run on copies; a lost link's traffic goes on the primary."""
        self.failover = failover

    def observe(self, observer: ExecutorObserver) -> None:
        self.observers.append(observer)

    def unobserve(self, observer: ExecutorObserver) -> None:
        self.observers = [o for o in self.observers if o is not observer]

    def restart_cycle(self, t0: int) -> None:
        """No update pending (after :meth:`drain`): the schedule's cycle starts again at ``t0``."""
        if self.groups:
            raise DeftError("internal: the cycle can only restart when no update is pending")
        self.t0 = t0

    def forget_groups(self) -> None:
        """Drop every pending group instance unsent (a checkpoint's groups replace them)."""
        self.groups.clear()

    @property
    def idle(self) -> bool:
        """No update group is pending."""
        return not self.groups

    def local_gradient(self) -> dict[torch.dtype, torch.Tensor]:
        """This rank's summed gradient of the current iteration's group (its flat buffers, by dtype)."""
        return self.groups[self.group_last(self.t)].buffers

    def use_hooks(self, hooks: Sequence[CommHook | None], copies: bool = False) -> None:
        """Send every bucket not launched yet with ``hooks[b]`` (None or no hooks: a plain all-reduce).
        ``copies`` (for this iteration): each hook gets a copy of its bucket, so the buffers keep this
        rank's exact local gradient until the result is waited for (:meth:`send_again` may still send
        them otherwise)."""
        n = self.layout.n_buckets if self.layout is not None else 0
        if hooks and len(hooks) != n:
            raise DeftError(f"internal: {len(hooks)} hooks for {n} buckets")
        self._hooks = tuple(hooks)
        self._chained_hooks = any(h is not None and h.chained for h in self._hooks)
        self._copies = copies

    def judge_backward(self, judge: SendJudge) -> None:
        """Call ``judge`` around the next backward's sends (:class:`SendJudge`)."""
        self._judge = judge

    def send_again(self, hooks: Sequence[CommHook | None]) -> None:
        """At the end of a backward whose hooks got copies (:meth:`use_hooks`), every bucket of this
        iteration launched (on every rank, so each link has seen the same collectives everywhere): wait
        for those sends, drop their results, and send every bucket again with ``hooks``, in the stage's
        listed order. Only for an iteration whose sends are all its own (``origin == 0``), as the first is."""
        s, lay = self.schedule, self.layout
        assert s is not None and lay is not None and self._copies
        g = self.groups[self.group_last(self.t)]
        tasks = s.stage(self.position(self.t), "backward").comms
        if any(task.origin != 0 for task in tasks) or len(g.launched) != lay.n_buckets:
            raise DeftError(f"internal: iteration {self.t} cannot be sent again ({len(g.launched)} of "
                            f"{lay.n_buckets} buckets launched, tasks of earlier iterations: "
                            f"{[t.bucket for t in tasks if t.origin != 0]})")
        # the dropped results are not this iteration's: the buffer stays exact
        self._settle(g, sorted(g.launched), keep=False, collective=True)
        g.launched.clear()
        self.use_hooks(hooks)
        self._start_stage("backward")

    def current_group(self) -> GroupInstance | None:
        """The group instance iteration :attr:`t` contributes to, once all its iterations have."""
        g = self.groups.get(self.group_last(self.t))
        return g if g is not None and g.complete else None

    def finishes_in_forward(self, last: int) -> bool:
        """Is group instance ``last`` an update finishing in the next forward?"""
        return self.groups[last].finish_in_forward

    def is_pending(self, last: int) -> bool:
        """Is group instance ``last`` still queued (e.g. finishing in the next forward)?"""
        return last in self.groups

    def position(self, t: int) -> int:
        assert self.schedule is not None
        return (t - self.t0) % self.schedule.cycle

    def group_last(self, t: int) -> int:
        """Global index of the last iteration of the group instance that iteration ``t`` belongs to."""
        s = self.schedule
        assert s is not None
        p = self.position(t)
        return t - p + s.updates[s.group_of(p)].last

    # -- iteration -----------------------------------------------------------------------------
    def begin_iteration(self, t: int) -> None:
        """Forward start of iteration ``t``: open its group instance, launch the forward stage (less what
        a withdrawn begin of ``t`` launched already, here or before a checkpoint: :meth:`withdraw_iteration`)."""
        s, lay = self.schedule, self.layout
        assert s is not None and lay is not None
        self.t = t
        self.in_backward = self.backward_done = False
        self._captured = [False] * len(self.params)
        self._touched = [False] * len(self.params)
        self._bucket_missing = [len(ps) for ps in lay.bucket_params]
        last = self.group_last(t)
        g = self.groups.get(last)
        if g is None:
            k = s.updates[s.group_of(self.position(t))].k
            u = s.updates[s.group_of(self.position(t))]
            g = GroupInstance(last=last, k=k, iterations=[], buffers=self._buffers(),
                              local_used=[0] * len(self.params),
                              finish_in_forward=u.finish_in_forward)
            self.groups[last] = g
        g.iterations.append(t)
        self._start_stage("forward")

    def withdraw_iteration(self) -> None:
        """Iteration :attr:`t` was begun and no gradient of it reached deft (a forward with gradients enabled
        and no backward, or micro-batches under ``no_sync()`` so far), and the loop needs deft between
        iterations (a checkpoint, ``flush()``): it leaves its group instance, which is dropped if it opened
        it, and nothing of its forward stage stays queued. What that stage launched (sends of earlier
        groups) stays in flight: those groups record it, and every rank's forward launched it in the same
        order; a checkpoint saves it as sent, and the forward that begins the iteration again (here or
        after the checkpoint is loaded) skips it."""
        if self.in_backward or self.backward_done or any(self._touched):
            raise DeftError(f"internal: iteration {self.t} is withdrawn after a gradient of it arrived")
        last = self.group_last(self.t)
        g = self.groups[last]
        g.iterations.remove(self.t)
        if not g.iterations:
            del self.groups[last]
            self._release(g.buffers)
        self._queues = {}

    def begin_backward(self) -> None:
        if self.in_backward or self.backward_done:
            return
        self.in_backward = True
        if self._judge is not None and not self._judge.at_first_gradient(self):
            self._judge = None
        self._arm_step_verdict()
        self._start_stage("backward")
        for b, missing in enumerate(self._bucket_missing):
            if missing == 0:  # an empty bucket is ready at once
                self._bucket_ready(b)
        self._pump()

    def add_grad(self, index: int, grad: torch.Tensor) -> None:
        """Parameter ``index``'s gradient of this iteration, complete (micro-batches under ``no_sync()``
        included: they sum in ``p.grad``), into its group's buffer; its buckets launch when complete."""
        if self.backward_done:
            raise DeftError("deft runs one backward per iteration: a gradient arrived after the backward of "
                            f"iteration {self.t} had ended (use ddp.no_sync() for micro-batches, and call "
                            "optimizer.step() between iterations)")
        self.begin_backward()
        lay = self.layout
        assert lay is not None
        g = self.groups[self.group_last(self.t)]
        if grad.is_sparse:
            raise DeftError(f"parameter {lay.slots[index].name!r} has a sparse gradient; deft needs dense ones")
        self._param_views(g.buffers)[index].add_(grad.reshape(-1))
        if not self._touched[index]:
            self._touched[index] = True
            g.local_used[index] += 1  # counted on the host: a device tensor would cost a kernel per parameter
        if not self._captured[index]:
            self._captured[index] = True
            self._param_complete(index)
            self._pump()

    def end_backward(self) -> None:
        """Unused parameters count as zero; launch everything left of the backward stage."""
        if self.backward_done:
            return
        self.begin_backward()
        for i, done in enumerate(self._captured):
            if not done:
                self._captured[i] = True
                self._param_complete(i)
        self._pump()
        left = {n: list(q) for n, q in self._queues.items() if q}
        if left:
            raise DeftError(f"internal: tasks {left} of iteration {self.t} could not be launched")
        self._step_needs = None  # what is left of the step's sends is judged at the step
        if self._judge is not None:
            judge, self._judge = self._judge, None
            judge.at_backward_end(self)
        self._copies = False
        self.in_backward, self.backward_done = False, True
        g = self.groups[self.group_last(self.t)]
        if g.complete and not g.used_launched:
            self._launch_used(g)
        if g.complete and g.finish_in_forward:
            self._launch_ahead(g)

    def next_unready(self) -> int | None:
        """The lowest bucket of this iteration whose gradient is not complete yet (None: all are)."""
        return next((b for b, m in enumerate(self._bucket_missing) if m > 0), None)

    def _param_complete(self, index: int) -> None:
        assert self.layout is not None
        for b in self.layout.param_buckets[index]:
            self._bucket_missing[b] -= 1
            if self._bucket_missing[b] == 0:
                self._bucket_ready(b)

    def _bucket_ready(self, b: int) -> None:
        for o in self.observers:
            o.bucket_ready(b)

    # -- launching -----------------------------------------------------------------------------
    def _start_stage(self, stage: str) -> None:
        s = self.schedule
        assert s is not None
        self._stage = stage
        self._queues = {n: deque() for n in s.links}
        p = self.position(self.t)
        for task in s.stage(p, stage).comms:
            if stage == "forward" and self._ahead(p, task):
                continue  # launched at the end of its group's backward (_launch_ahead)
            if stage == "forward" and self._launched_before(task):
                continue  # launched when the iteration was first begun (withdraw_iteration)
            self._queues[task.link].append(task)
        self._pump()

    def _launched_before(self, task: CommTask) -> bool:
        g = self.groups.get(self.t - task.origin)
        return g is not None and task.bucket in g.launched

    def _ahead(self, position: int, task: CommTask) -> bool:
        """Is ``task`` (forward stage of ``position``) a send of an update finishing in the forward?"""
        s = self.schedule
        assert s is not None
        return task.origin == 1 and s.updates[s.group_of(position - 1)].finish_in_forward

    def _launch_ahead(self, g: GroupInstance) -> None:
        """An update finishing in the forward: its next-forward sends go right after its backward, in
        their listed order on each link (queued behind the backward stage's collectives there), so the
        link does not idle through the optimizer step and the data loading."""
        s = self.schedule
        assert s is not None
        nxt = self.position(g.last + 1)
        for task in s.stage(nxt, "forward").comms:
            if self._ahead(nxt, task) and task.bucket not in g.launched:
                self._launch(task, task.link, origin=0)

    def _ready(self, task: CommTask) -> bool:
        if task.origin >= 1:
            return True
        if self._hold and self.next_unready() is not None:
            return False
        return self._stage == "backward" and self.in_backward and self._bucket_missing[task.bucket] == 0

    def _pump(self) -> None:
        for name, q in self._queues.items():
            while q and self._ready(q[0]):
                self._launch(q.popleft(), name)

    def _launch(self, task: CommTask, link_name: str, origin: int | None = None) -> None:
        last = self.t - (task.origin if origin is None else origin)
        if last < self.t0:
            return  # belongs to the cycle before this schedule; already applied
        g = self.groups.get(last)
        if g is None or not g.complete:
            raise DeftError(f"internal: iteration {self.t} sends bucket {task.bucket} of the group ending at "
                            f"iteration {last}, which is not complete")
        if task.bucket in g.launched:
            raise DeftError(f"internal: bucket {task.bucket} of the group ending at {last} sent twice")
        what = (f"all-reduce of bucket {task.bucket} of the update merging iterations {g.iterations} "
                f"(launched in the {self._stage} stage of iteration {self.t})")
        t_start = time.perf_counter()
        tok = nvtx.push_range("comm", task.bucket, self.t, link_name, last)
        works = self._send(g, task.bucket, link_name, what)
        nvtx.pop_range(tok)
        for o in self.observers:
            o.launched(task.bucket, link_name, works, t_start)
        if self._step_needs is not None:
            self._open_step_verdict()

    def _send(self, g: GroupInstance, b: int, link_name: str, what: str) -> list[Collective]:
        """Launch bucket ``b`` of ``g`` on ``link_name``: one all-reduce per dtype segment, or the comm hook.
        A lost link's sends go on the primary; a guarded link's run on copies (:mod:`deft.runtime.failover`)."""
        assert self.layout is not None
        fo = self.failover
        if fo is not None and link_name in fo.dead:
            link_name = self.primary
        link = self.links[link_name]
        views = self.layout.bucket_views(g.buffers, b)
        hook = self._hook_for(b)
        guarded = fo is not None and fo.guards(link_name) and not (hook is not None and hook.chained)
        pending = g.pending.setdefault(b, [])
        works: list[Collective] = []
        if hook is None:
            for v in views:
                if not guarded:
                    works.append(link.all_reduce(v))
                    pending.append(Pending(works[-1], link_name, what))
                    continue
                staged = v.clone()
                works.append(_launched(link.all_reduce, staged))
                pending.append(Pending(works[-1], link_name, what, post=_copy_back(staged, v), resend=v))
        else:
            fut = self._hooked(g, b, link_name, views, what, hook, copy=guarded)
            works.append(fut)
            pending.append(Pending(fut, link_name, what, post=_hook_post(views[0], self.world),
                                   resend=views[0] if guarded else None))
        g.launched.add(b)
        return works

    def _hook_for(self, b: int) -> CommHook | None:
        """The hook that sends bucket ``b`` (:meth:`use_hooks`; None: a plain all-reduce)."""
        return self._hooks[b] if self._hooks else None

    def _hooked(self, g: GroupInstance, b: int, link_name: str, views: list[torch.Tensor], what: str,
                hook: CommHook, copy: bool = False) -> torch.futures.Future[torch.Tensor]:
        """Call ``hook`` on bucket ``b`` (one dtype), with the link's process group."""
        assert self.layout is not None
        where = f"comm hook {hook.name!r} on bucket {b} ({what}) on link {link_name!r}"
        if len(views) != 1:
            raise DeftError(f"{where}: the bucket mixes dtypes {[str(v.dtype) for v in views]}; comm hooks take "
                            "one flat tensor per bucket: keep the model in one dtype or plan single-dtype buckets")
        # torch's in-place hooks (CommHook.in_place) get deft's buffer itself, as a plain all-reduce
        # does: their result is left there (_hook_post then copies nothing). Any other hook gets its own
        # copy, as torch DDP's hooks get a standalone bucket tensor: hooks write into it and may even
        # resize it (batched PowerSGD pads it to a square); the result is copied back into deft's
        # buffer when it is waited for. Under use_hooks(copies=True) every hook gets a copy: the buffer
        # stays exact until the judge has spoken, who may send it again.
        view = views[0] if hook.in_place and not (self._copies or copy) else views[0].clone()
        bucket = hook_bucket(self.layout, self.params, b, view, is_last=len(g.launched) + 1 == self.layout.n_buckets)
        link = self.links[link_name]
        link.stats.calls += 1
        link.stats.bytes += view.numel() * view.element_size()
        observers = list(self.observers)

        def launch() -> torch.futures.Future[torch.Tensor]:
            now = time.perf_counter()
            for o in observers:
                o.hook_started(b, now)
            try:
                fut = hook.launch(link.group, bucket)
            except Exception as e:
                raise CommunicationError(f"rank {self.rank}: {where} raised {type(e).__name__}: {e}") from e
            if not isinstance(fut, FUTURE_TYPES):
                raise DeftError(f"{where} returned {type(fut).__name__}; a comm hook must return a "
                                "torch.futures.Future whose value is the bucket's averaged gradient")
            return fut
        if hook.chained:
            return self._chained(launch)
        return launch()

    def _chained(self, launch: Callable[[], torch.futures.Future[T]]) -> torch.futures.Future[T]:
        """Run ``launch`` (which starts collectives and returns their Future) once every earlier chained
        launch has completed: with a comm hook, one bucket is in flight at a time.

        A hook may start collectives from its futures' callbacks (PowerSGD all-reduces P, then Q when P
        is done), on gloo's threads: two hooks in flight on one link would interleave them in a
        different order on different ranks, and the group's collectives would no longer match. A hook's
        state is also shared by all buckets (PowerSGD's iteration counter decides whether to compress,
        its random generator seeds each bucket's first Q): two hooks in flight, even on two links, would
        read and change it in a racy order, and two runs of the same training would differ. So hooked
        buckets (and, on the primary link, the used-parameter map) run one after another, in launch
        order: every rank issues the same collectives in the same order, and runs are reproducible.
        The links still overlap communication with computation; compression has made it small."""
        # A Future that will hold CUDA tensors must name its devices (else set_result refuses them).
        outer: torch.futures.Future[T] = torch.futures.Future(
            devices=[self.device] if self.device.type == "cuda" else None)

        def run(_: object = None) -> None:
            try:
                inner = launch()
            except Exception as e:
                outer.set_exception(e)  # type: ignore[arg-type]  # torch types the exception as the value type T
                return

            def done(f: torch.futures.Future[T]) -> None:
                try:
                    outer.set_result(f.value())
                except Exception as e:
                    outer.set_exception(e)  # type: ignore[arg-type]  # (as above)
            inner.add_done_callback(done)

        tail, self._hook_tail = self._hook_tail, outer
        if tail is None:
            run()
        else:
            tail.add_done_callback(run)
        return outer

    def _launch_used(self, g: GroupInstance) -> None:
        link = self.links[self.primary]
        g.all_used_locally = all(c > 0 for c in g.local_used)
        # a pageable host tensor: the copy is staged at once, without waiting for the device
        used_map = torch.tensor(g.local_used, dtype=torch.int32).to(self.device, non_blocking=True)
        g.used_map = used_map
        if self._chained_hooks:  # the hooks' collectives are chained: join
            w: Collective = self._chained(lambda: link.all_reduce(used_map).get_future())
        else:
            w = link.all_reduce(used_map)
        g.pending.setdefault(-1, []).append(Pending(w, self.primary, "all-reduce of the used-parameter map of the "
                                                    f"update merging iterations {g.iterations}"))
        g.used_launched = True

    # -- waiting and updates -------------------------------------------------------------------
    def wait(self, pending: Pending) -> None:
        value = wait_work(pending.work, pending.link, pending.what, self.rank, self.timeout_s,
                          stream_ordered=self.links[pending.link].backend == "nccl")
        self._post(pending, value)

    def _post(self, pending: Pending, value: object) -> None:
        if pending.post is not None:
            post, pending.post = pending.post, None  # once, even if waited for again
            try:
                post(value)
            except Exception as e:
                raise CommunicationError(f"rank {self.rank}: the comm hook's result for the {pending.what} on link "
                                         f"{pending.link!r} is unusable: {e}") from e

    def _settle(self, g: GroupInstance, buckets: Iterable[int] | None = None, keep: bool = True,
                collective: bool = False) -> None:
        """Wait for the collectives of ``buckets`` of ``g`` (default: all, the used map included), in order;
        ``keep=False``: drop their results (the buffers keep the local gradients). A guarded send is taken
        once the ranks' verdict on it is reached (:meth:`_take`); ``collective``: every rank settles these
        sends here, so the links the verdicts found lost are recorded (:meth:`_record`)."""
        # bucket order, not launch order: a verdict's sends (and its resends) are listed alike on every
        # rank; the used map (-1) last, as it was launched
        order = sorted(g.pending, key=lambda b: (b < 0, b)) if buckets is None else list(buckets)
        waits = [p for b in order for p in g.pending.pop(b, ())]
        if not keep:
            for p in waits:
                p.post = None
        guarded = [p for p in waits if p.resend is not None]
        self._open_verdict([p for p in guarded if p.verdict is None])  # the same set on every rank
        for p in waits:
            if p.resend is None:
                self.wait(p)
            else:
                self._take(p)
        if collective:
            self._record()

    def open_pending(self) -> None:
        """Collective, between iterations (every rank after its step): open the ranks' verdict on every
        guarded send still in flight, and do not wait for it (:mod:`deft.runtime.verdicts`): the next
        forward's deferred parameters, or a ``state_dict()`` or an evaluation that one rank runs alone,
        wait for the verdict only where they use a result, and every rank reaches it without them.

        One verdict, not one per bucket: each is a message over the primary link's NIC queued behind its
        gradients, and gloo runs a group's collectives two at a time (benchmarks/results/failover_async.md)."""
        self._open_verdict([p for last in sorted(self.groups) for b in sorted(self.groups[last].pending)
                            for p in self.groups[last].pending[b] if p.resend is not None and p.verdict is None])

    def _arm_step_verdict(self) -> None:
        """At the first gradient of a backward: the buckets its step will settle (:meth:`take_update`), so
        that the verdict on their guarded sends opens as soon as the last of them is launched
        (:meth:`_open_step_verdict`). Not where a judge may send the iteration again (its first)."""
        self._step_needs = None
        fo, lay = self.failover, self.layout
        if fo is None or fo.verdicts is None or self._judge is not None or lay is None:
            return
        needs: dict[int, set[int]] = {}
        for last in self.due(self.t):
            g = self.groups.get(last)
            if g is not None:
                needs[last] = set(self._at_step(g)[1] if g.finish_in_forward else range(lay.n_buckets))
        self._step_needs = needs
        self._open_step_verdict()  # the forward stage may have launched all of them

    def _open_step_verdict(self) -> None:
        """Collective, at the same launch on every rank: once every bucket the step will settle is
        launched, open the ranks' verdict on their guarded sends.

        Note:
            Opened at the step, the verdict's flags would go out on the primary link's NIC behind the
            sends the backward launched there after the last guarded one (an update's deferred buckets),
            and the step would wait for those too. Opened here, the flags go out as soon as the judged
            sends end, which is what the simulator prices (:mod:`deft.solver.simulate`, "The ranks'
            verdict"). Every rank launches each link's sends in the same order and opens no other verdict
            between its last step and this one's, so the sets and their order match everywhere."""
        needs = self._step_needs
        assert needs is not None
        if any(not bs <= self.groups[last].launched for last, bs in needs.items()):
            return
        self._step_needs = None
        sends = [p for last in sorted(needs) for b in sorted(needs[last]) for p in self.groups[last].pending.get(b, ())]
        self._open_verdict([p for p in sends if p.resend is not None and p.verdict is None])

    def _open_verdict(self, sends: list[Pending]) -> None:
        """The ranks' verdict on ``sends``: reached in the background; a send not done within its link's
        deadline for every guarded byte in flight on that link counts as failed."""
        fo = self.failover
        if not sends:
            return
        assert fo is not None and fo.verdicts is not None
        in_flight = {id(p): p for g in self.groups.values() for ps in g.pending.values() for p in ps
                     if p.resend is not None}
        in_flight.update((id(p), p) for p in sends)  # a settle has taken its sends out of the groups
        ahead: dict[str, int] = {}
        for p in in_flight.values():
            assert p.resend is not None
            ahead[p.link] = ahead.get(p.link, 0) + p.resend.numel() * p.resend.element_size()
        deadline = max(fo.deadline(p.link, ahead.get(p.link, 0)) for p in sends)
        futures = [p.work if isinstance(p.work, FUTURE_TYPES) else p.work.get_future() for p in sends]
        local = [p.resend for p in sends if p.resend is not None]
        if len(local) != len(sends):
            raise DeftError("internal: a verdict on a send that is not guarded")
        v = fo.verdicts.open([p.link for p in sends], futures, local, [_describe(p) for p in sends], deadline,
                             set(fo.dead))
        for i, p in enumerate(sends):
            p.verdict, p.index = v, i

    def _take(self, p: Pending) -> None:
        """A guarded send's result, once the ranks' verdict is reached: its own if its link stands, else
        the ranks' sum of their local gradients, sent again (a dropped result, ``post`` None: neither)."""
        fo, v = self.failover, p.verdict
        assert fo is not None and fo.verdicts is not None and v is not None and p.resend is not None
        fo.verdicts.wait(v, f"{p.what} on link {p.link!r}")
        if p.link not in v.lost:
            self._post(p, wait_work(p.work, p.link, p.what, self.rank, self.timeout_s))
        elif p.post is not None:
            p.post = None
            p.resend.copy_(v.resent[p.index])

    def _record(self) -> None:
        """Where every rank is (a step): the links lost by the verdicts opened so far are recorded, from
        then on their sends go on the primary link and the course re-plans without them. The verdicts
        opened before this step are reached by now where a lag-free plan's forward used their sends."""
        fo = self.failover
        if fo is None or fo.verdicts is None:
            return
        for loss in fo.verdicts.losses():
            fo.lost(loss.link, self.t, loss.resent, loss.seconds, loss.why)

    def due(self, t: int) -> list[int]:
        """Last-iteration keys of the group instances whose update is applied after the step of ``t``."""
        s = self.schedule
        assert s is not None
        p = self.position(t)
        keys = []
        for gi, back in s.updates_due(p):
            last = t - p + s.updates[gi].last - back * s.cycle
            if last >= self.t0:
                keys.append(last)
        return keys

    def take_update(self, last: int, whole: bool = False) -> DueUpdate:
        """Wait for group instance ``last``'s collectives and return its averaged gradients.

        A group finishing in the forward (and not ``whole``) returns only the parameters whose buckets
        are all sent in backward stages; the others stay *deferred* (``None`` here) until
        :meth:`finish` applies them just before their module's forward.
        """
        g = self.groups[last]
        assert self.layout is not None
        n = self.layout.n_buckets
        if len(g.launched) != n or not g.used_launched:
            raise DeftError(f"internal: the update merging iterations {g.iterations} is due but only "
                            f"{len(g.launched)} of {n} buckets were sent")
        if not g.finish_in_forward or whole:
            self.groups.pop(last)
            self._settle(g, collective=True)
            grads = self._grads(g, range(len(self.params)))
            self._release(g.buffers)
            return DueUpdate(tuple(g.iterations), grads)
        now, now_buckets = self._at_step(g)
        if g.all_used_locally:
            # Every parameter got a gradient here, so some rank used it: the all-reduced used map says
            # nothing new and is not waited for now. It is queued on the primary link behind that link's
            # deferred sends (Update.deferred); waiting for it would wait for them at the step.
            self._settle(g, now_buckets, collective=True)
            g.used = [1] * len(self.params)
        else:
            self._settle(g, [-1, *now_buckets], collective=True)
            g.used = self._used(g)
        deferred = set(range(len(self.params))) - set(now)
        g.deferred = {i for i in deferred if g.used[i] > 0}  # unused parameters keep grad None anyway
        grads = self._grads(g, now)
        if not g.deferred:
            self._close(g, collective=True)
        return DueUpdate(tuple(g.iterations), grads)

    def _at_step(self, g: GroupInstance) -> tuple[list[int], list[int]]:
        """The parameters of ``g``, an update finishing in the forward, applied at its step (none of their
        buckets is applied in the next forward), and their buckets, in order."""
        assert self.layout is not None
        ahead = self._ahead_buckets(g)
        now = [i for i in range(len(self.params)) if not any(b in ahead for b in self.layout.param_buckets[i])]
        return now, sorted({b for i in now for b in self.layout.param_buckets[i]})

    def _ahead_buckets(self, g: GroupInstance) -> set[int]:
        """Buckets of ``g`` applied in the next forward: its next forward stage's sends and the buckets
        it sent in backward but defers (``Update.deferred``)."""
        s = self.schedule
        assert s is not None
        nxt = self.position(g.last + 1)
        deferred = set(s.updates[s.group_of(self.position(g.last))].deferred)
        return deferred | {t.bucket for t in s.stage(nxt, "forward").comms if self._ahead(nxt, t)}

    def _grads(self, g: GroupInstance, indices: Iterable[int]) -> list[torch.Tensor | None]:
        """Averaged gradients of ``indices`` (``None`` elsewhere, and where no rank used a parameter)."""
        assert self.layout is not None
        used = g.used if g.used is not None else self._used(g)
        scale = 1.0 / (self.world * len(g.iterations))
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        take = [i for i in indices if used[i] > 0]
        flat = self._param_views(g.buffers)
        views = [flat[i].view(self.params[i].shape) for i in take]
        # one fused launch for all parameters (the same rounding as a mul each): on CUDA a kernel per
        # parameter costs the host more than the arithmetic
        for i, grad in zip(take, torch._foreach_mul(views, scale) if views else [], strict=True):
            grads[i] = grad
        return grads

    @staticmethod
    def _used(g: GroupInstance) -> list[int]:
        """The all-reduced used map of ``g`` (waited for). Where every parameter got a gradient on this
        rank it is positive everywhere and not read: reading a device tensor waits for the device."""
        if g.all_used_locally:
            return [1] * len(g.local_used)
        assert g.used_map is not None
        return [int(c) for c in g.used_map.tolist()]

    def _close(self, g: GroupInstance, collective: bool = False) -> None:
        self._settle(g, collective=collective)
        self.groups.pop(g.last, None)
        self._release(g.buffers)

    @property
    def deferred(self) -> set[int]:
        """Parameters of updates finishing in the forward that are not applied yet."""
        return {i for g in self.groups.values() if g.deferred for i in g.deferred}

    def finish(self, indices: Iterable[int] | None = None) -> list[torch.Tensor | None]:
        """Deferred parameters among ``indices`` (default: all): wait for their buckets, return their
        averaged gradients (``None`` elsewhere) and forget them; a group whose last deferred parameter
        is returned closes (its buffers are reused)."""
        assert self.layout is not None
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        for g in [g for g in self.groups.values() if g.deferred]:
            assert g.deferred is not None
            take = sorted(g.deferred if indices is None else g.deferred.intersection(indices))
            if not take:
                continue
            self._settle(g, sorted({b for i in take for b in self.layout.param_buckets[i]}))
            for i, gr in enumerate(self._grads(g, take)):
                if gr is not None:
                    grads[i] = gr
            g.deferred.difference_update(take)
            if not g.deferred:
                self._close(g)
        return grads

    def peek(self, i: int) -> torch.Tensor | None:
        """Deferred parameter ``i``'s averaged gradient, waited for, while it stays deferred (a read after
        the step: the next forward still applies it); None if it is not deferred."""
        for g in [g for g in self.groups.values() if g.deferred and i in g.deferred]:
            assert self.layout is not None
            self._settle(g, sorted(self.layout.param_buckets[i]))
            return self._grads(g, [i])[i]
        return None

    def drain(self) -> list[DueUpdate]:
        """Send every bucket not yet sent (primary link, bucket order), wait, return all updates.

        Used by ``flush()``: every rank calls it at the same point, so the launch order matches.
        """
        if any(g.deferred is not None for g in self.groups.values()):
            raise DeftError("internal: drain() with an update still finishing: call finish() first")
        updates = []
        for last in sorted(self.groups):
            g = self.groups[last]
            g.k = len(g.iterations)  # a group cut short merges the iterations it has
            assert self.layout is not None
            for b in range(self.layout.n_buckets):
                if b not in g.launched:
                    tok = nvtx.push_range("comm", b, max(self.t, 0), self.primary, last)
                    self._send(g, b, self.primary, f"flush all-reduce of bucket {b} of the update merging "
                                                   f"iterations {g.iterations}")
                    nvtx.pop_range(tok)
            if not g.used_launched:
                self._launch_used(g)
        for last in sorted(self.groups):
            updates.append(self.take_update(last, whole=True))
        return updates

    def settle_all(self) -> None:
        """Wait for every collective in flight (before a checkpoint)."""
        for g in self.groups.values():
            self._settle(g)

    def pending(self) -> list[PendingUpdate]:
        """The queued update groups, oldest first."""
        return [PendingUpdate(tuple(g.iterations), g.k, tuple(sorted(g.launched)), g.deferred is not None)
                for _, g in sorted(self.groups.items())]

    # -- buffers -------------------------------------------------------------------------------
    def _buffers(self) -> dict[torch.dtype, torch.Tensor]:
        if self._pool:
            bufs = self._pool.pop()
            for b in bufs.values():
                b.zero_()
            return bufs
        assert self.layout is not None
        return self.layout.new_buffers(self.device)

    def _param_views(self, bufs: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Every parameter's slice of ``bufs`` under the current layout, made once per buffer set (the
        pool reuses the sets): slicing anew for each gradient costs the host more than the add."""
        assert self.layout is not None
        cached = self._views.get(id(bufs))
        if cached is None or cached[0] is not bufs or cached[1] is not self.layout:
            cached = (bufs, self.layout, [self.layout.param_view(bufs, i) for i in range(len(self.params))])
            self._views[id(bufs)] = cached
        return cached[2]

    def _release(self, bufs: dict[torch.dtype, torch.Tensor]) -> None:
        self._pool.append(bufs)

    # -- checkpoint ----------------------------------------------------------------------------
    def group_states(self) -> list[GroupState]:
        """Pending group instances as tensors and plain types (after :meth:`settle_all`)."""
        out = []
        for last in sorted(self.groups):
            g = self.groups[last]
            out.append(GroupState(
                last=g.last, k=g.k, iterations=list(g.iterations),
                buffers={str(d).removeprefix("torch."): b.detach().cpu().clone() for d, b in g.buffers.items()},
                used=(g.used_map.detach().cpu().clone() if g.used_map is not None
                      else torch.tensor(g.local_used, dtype=torch.int32)), launched=sorted(g.launched),
                used_launched=g.used_launched, finish_in_forward=g.finish_in_forward,
                deferred=None if g.deferred is None else sorted(g.deferred)))
        return out

    def restore_groups(self, states: list[GroupState], source: str) -> None:
        assert self.layout is not None
        self.groups.clear()
        self._views.clear()
        for st in states:
            bufs = self.layout.new_buffers(self.device)
            saved = st["buffers"]
            for d, b in bufs.items():
                key = str(d).removeprefix("torch.")
                if key not in saved or saved[key].shape != b.shape:
                    raise DeftError(f"{source}: pending gradient buffer {key} does not match this model")
                b.copy_(saved[key])
            used = [int(c) for c in st["used"].tolist()]
            launched_used = bool(st["used_launched"])
            # saved after the used map's all-reduce (launched): the reduced map; before it: this rank's counts
            g = GroupInstance(last=int(st["last"]), k=int(st["k"]), iterations=[int(i) for i in st["iterations"]],
                              buffers=bufs, local_used=[0] * len(used) if launched_used else used,
                              launched={int(b) for b in st["launched"]}, used_launched=launched_used,
                              finish_in_forward=bool(st.get("finish_in_forward", False)),
                              deferred=_int_set(st.get("deferred")),
                              used_map=torch.tensor(used, dtype=torch.int32, device=self.device) if launched_used
                              else None)
            if g.deferred is not None or launched_used:
                g.used = used
            self.groups[g.last] = g


def _hook_post(view: torch.Tensor, world: int) -> Callable[[object], None]:
    """The hook's averaged result into the bucket's buffer, as a sum over ranks (module docstring)."""
    def post(value: object) -> None:
        result = hook_result(value)
        if result.numel() != view.numel():
            raise ValueError(f"the result has {result.numel()} elements, the bucket {view.numel()}")
        if result.data_ptr() != view.data_ptr():
            view.copy_(result.reshape(-1))
        view.mul_(world)
    return post


def _describe(p: Pending) -> Callable[[], str]:
    """What a guarded send is, on which link, and (a hierarchical all-reduce) the step it is in."""
    def what() -> str:
        step = p.work.step if isinstance(p.work, HierarchicalWork) else ""
        return f"{p.what} on link {p.link!r}" + (f", {step}" if step else "")
    return what


def _copy_back(staged: torch.Tensor, view: torch.Tensor) -> Callable[[object], None]:
    """A guarded all-reduce's result (on its copy) into the bucket's buffer."""
    def post(_: object) -> None:
        view.copy_(staged)
    return post


def _launched(launch: Callable[[torch.Tensor], Collective], tensor: torch.Tensor) -> Collective:
    """``launch(tensor)``, or a failed future when it raises: a guarded send's failure is judged at its
    wait, where every rank agrees on it, not where this rank launched it."""
    try:
        return launch(tensor)
    except Exception as e:
        fut: torch.futures.Future[object] = torch.futures.Future()
        fut.set_exception(e)
        return fut


def _int_set(values: list[int] | None) -> set[int] | None:
    return None if values is None else {int(i) for i in values}
