"""The ranks' verdict on guarded sends, reached off the training thread.

A guarded send (:mod:`deft.runtime.failover`) runs on a copy of its bucket, and its result may be used
only once every rank agrees that its link is not lost. A :class:`Verdict` covers a set of guarded sends,
the same set on every rank (the executor opens verdicts at the same points of the schedule everywhere),
and is reached in three steps that need no training thread:

1. *ready*: each of its sends has completed or failed on this rank, or runs on a link already lost, or
   the verdict's deadline has passed (a timer thread);
2. *flags*: this rank's flag per link, 1 where one of the verdict's sends on it failed or was not done
   when the verdict became ready or where the link was lost before, summed over the ranks; a link
   flagged on any rank is lost, on every rank alike;
3. *resends*: the sends on the lost links are all-reduced again, each from a copy of the local gradient
   its failed send never touched; their sums replace the dropped results.

Verdicts take these steps in the order they were opened, whichever thread runs them (a thread per link
waiting on its guarded sends, the timer, the training thread): their flags go out one behind the other, each as
soon as its own sends end, and are taken in that order, a link lost by one verdict lost in every later
one, the resends launched on a group of their own; so each group's collectives match on every rank.
The training thread waits for a verdict only where one of its results is used
(:meth:`VerdictChain.wait`), and hands out the losses where every rank is (:meth:`VerdictChain.losses`).

Note:
    Why off the training thread. An agreement the training thread launched and waited for would put a
    round trip over the primary link's NIC, queued behind that link's gradients, on the critical path of
    every step; and, to let one rank alone read a deferred result between iterations without a collective
    the others miss, it would have to judge every guarded send in flight right after the step, waiting
    for the sends a lag-free plan overlaps with the next forward. Here a verdict's flags go out as soon as
    its sends end, beside the compute, and since no rank's flags wait for its training thread, one rank
    alone (a ``state_dict()`` or an evaluation between iterations) may wait for a verdict: the other
    ranks' flags and resends go out without them.

    A guarded send's end is learnt by a thread per link waiting on the link's sends in launch order
    (:class:`deft.runtime.completions.Completions`), not by a callback on the send's future: that runs on
    the gloo thread that completed the send, which holds the link until it has the GIL, while the
    training thread runs the model's Python. A send that never completes holds that link's later ones;
    their verdicts wait for their deadline timers, as a lost link's sends do.

    The verdicts' groups are CPU gloo groups on the primary link's NIC, like the control group, so a
    verdict does not depend on the link it judges; they carry nothing else, so collectives launched
    from any thread keep one order. With several ranks per host the flags go up inside the host, across the
    hosts' first ranks and back (:class:`deft.runtime.hierarchy.HierarchicalAllReduce`, on groups of
    their own): a message queued behind the primary's gradients crosses a NIC twice, where gloo's ring
    over every rank crosses one at each of its ``2(N - 1)`` steps. A resend of a CUDA gradient copies
    the buffer on the launching thread's current stream (the device's default stream on a gloo thread):
    the bucket was last written when its send was launched, long before its verdict.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deft.errors import CommunicationError
from deft.runtime.completions import Completions

Future = torch._C.Future


@dataclass(frozen=True)
class Loss:
    """A link a verdict found lost: ``resent`` of its sends all-reduced again, ``seconds`` from this rank's
    verdict naming the failure to the resends' end, ``why`` what this rank saw (empty: another rank saw it)."""

    link: str
    resent: int
    seconds: float
    why: str


@dataclass(eq=False)
class Verdict:
    """The ranks' verdict on one set of guarded sends (module docstring). ``links[i]``: the link of send
    ``i``, ``futures[i]`` its future, ``local[i]`` its bucket's local gradient (what a resend sums),
    ``whats[i]()`` what it is and where it stands (for messages)."""

    links: tuple[str, ...]
    futures: tuple[Future[object], ...]
    local: tuple[torch.Tensor, ...]
    whats: tuple[Callable[[], str], ...]
    deadline_s: float
    lost_before: frozenset[str]
    opened: float = field(default_factory=time.perf_counter)
    lost: frozenset[str] = frozenset()       # the links lost, once reached (earlier losses included)
    resent: dict[int, torch.Tensor] = field(default_factory=dict)  # send -> the ranks' summed local gradients
    failed: dict[str, str] = field(default_factory=dict)           # this rank's failures, by link
    error: str | None = None                                      # the verdict could not be reached
    failed_at: float | None = None
    done_at: float | None = None
    expired: bool = False
    event: threading.Event = field(default_factory=threading.Event)
    timer: threading.Timer | None = None

    @property
    def done(self) -> bool:
        return self.event.is_set()

    def finish(self, error: str | None = None) -> None:
        self.error = error
        self.done_at = time.perf_counter()
        if self.timer is not None:
            self.timer.cancel()
        self.event.set()


class VerdictChain:
    """Verdicts in the order they were opened (module docstring). ``sum_flags``: the flags' asynchronous
    in-place sum over the ranks, on a group of its own; ``resend_group``: where a lost link's sends are
    summed again; ``links``: the run's links in config order (the flags' order); ``timeout_s``: the bound
    of a wait beyond a verdict's deadline."""

    def __init__(self, sum_flags: Callable[[torch.Tensor], dist.Work], resend_group: dist.ProcessGroup,
                 links: Sequence[str], rank: int, timeout_s: float) -> None:
        self._sum_flags, self.resend_group = sum_flags, resend_group
        self.links, self.rank, self.timeout_s = list(links), rank, timeout_s
        self._lock = threading.RLock()  # re-entered: a future already done runs its callback at once
        self._queue: deque[Verdict] = deque()  # opened, flags not launched yet
        # flags launched, not yet taken (in order: the losses before a verdict are part of it)
        self._agreeing: deque[tuple[Verdict, torch.Tensor, Future[object]]] = deque()
        self._lost: set[str] = set()  # links lost by the verdicts taken so far
        self._broken: str | None = None  # a group failed: every later verdict fails with this
        self._unrecorded: deque[Verdict] = deque()  # opened, losses not yet handed out (losses)
        self._recorded: set[str] = set()
        self._ended = Completions()  # one thread per link learns that its guarded sends ended

    def open(self, links: Sequence[str], futures: Sequence[Future[object]], local: Sequence[torch.Tensor],
             whats: Sequence[Callable[[], str]], deadline_s: float, lost_before: set[str]) -> Verdict:
        """Collective in order (every rank opens the same sets in the same order): a verdict on these
        sends, reached in the background. ``deadline_s`` from now, sends not done count as failed;
        ``lost_before``: links already lost (their sends are not waited for)."""
        v = Verdict(tuple(links), tuple(futures), tuple(local), tuple(whats), deadline_s, frozenset(lost_before))
        with self._lock:
            self._queue.append(v)
            self._unrecorded.append(v)
        v.timer = threading.Timer(deadline_s, self._expire, (v,))
        v.timer.daemon = True
        v.timer.start()
        for link, fut in zip(v.links, v.futures, strict=True):
            self._ended.watch(link, fut, then=self._pump)  # off gloo's thread (module docstring, Note)
        self._pump()
        return v

    def wait(self, v: Verdict, what: str) -> None:
        """Wait for ``v`` (bounded: its deadline and ``timeout_s`` beyond it); CommunicationError if it
        could not be reached. ``what``: one of its sends, for the message."""
        if not v.event.wait(v.deadline_s + self.timeout_s):
            self._fail_all(f"the ranks' verdict timed out after {v.deadline_s + self.timeout_s:g} s")
        if v.error is not None:
            seen = next(iter(v.failed.values()), f"rank {self.rank}: {what} completed here.")
            raise CommunicationError(f"{seen} The ranks could not agree whether the link is lost over the verdict "
                                     f"group, which runs on the primary link {self.links[0]!r}'s NIC ({v.error}): "
                                     "that NIC is down, or a peer rank probably died or stalled; check the other "
                                     "ranks' logs.")

    def losses(self) -> list[Loss]:
        """Collective in order: the links lost by every verdict opened so far (each waited for), not
        handed out before. Called where every rank is, it hands out every loss at the same point."""
        out: list[Loss] = []
        while self._unrecorded:
            u = self._unrecorded[0]
            self.wait(u, "a guarded send")
            self._unrecorded.popleft()
            for link in sorted(u.lost - self._recorded):
                self._recorded.add(link)
                seconds = (u.done_at or u.opened) - (u.failed_at or u.opened)
                out.append(Loss(link, sum(1 for i in u.resent if u.links[i] == link), seconds,
                                u.failed.get(link, "")))
        return out

    # -- the background steps (any thread) ------------------------------------------------------------
    def _expire(self, v: Verdict) -> None:
        with self._lock:
            v.expired = True
        self._pump()

    def _ready(self, v: Verdict) -> bool:
        gone = v.lost_before | self._lost
        return v.expired or all(f.done() or link in gone for link, f in zip(v.links, v.futures, strict=True))

    def _pump(self) -> None:
        """Launch the flags of every verdict at the head of the queue that is ready, in order (a flags sum
        needs no earlier one's result: they go out one behind the other, each as its sends end)."""
        with self._lock:
            if self._broken is not None:
                self._fail_pending()
                return
            while self._queue and self._ready(self._queue[0]):
                self._flags(self._queue.popleft())

    def _flags(self, v: Verdict) -> None:
        now = time.perf_counter()
        gone = v.lost_before | self._lost
        for link, fut, what in zip(v.links, v.futures, v.whats, strict=True):
            if link in gone or link in v.failed:
                continue
            if not fut.done():
                v.failed[link] = (f"rank {self.rank}: {what()} timed out: not done within the link's deadline "
                                  f"({v.deadline_s:g} s).")
                continue
            try:
                fut.value()
            except Exception as e:  # gloo raises RuntimeError or DistBackendError
                v.failed[link] = f"rank {self.rank}: {what()} failed: {e}."
        if v.failed:
            v.failed_at = now
        flags = torch.tensor([1 if (n in gone or n in v.failed) else 0 for n in self.links], dtype=torch.int32)
        try:
            fut = self._sum_flags(flags).get_future()
        except Exception as e:
            self._break(v, f"the flags' sum could not be launched: {e}")
            return
        self._agreeing.append((v, flags, fut))
        fut.add_done_callback(lambda _: self._agreed())

    def _agreed(self) -> None:
        """Take the verdicts whose flags are summed, in the order opened: a link lost by one is lost in
        every later one, and its resends go out in that order on every rank."""
        with self._lock:
            while self._agreeing and self._agreeing[0][2].done():
                v, flags, fut = self._agreeing.popleft()
                try:
                    fut.value()
                except Exception as e:
                    self._break(v, f"the flags' sum failed: {e}")
                    return
                lost = {n for n, f in zip(self.links, flags.tolist(), strict=True) if f} | self._lost
                self._lost |= lost
                v.lost = frozenset(lost)
                again = {i: v.local[i].detach().clone() for i, link in enumerate(v.links) if link in lost}
                try:
                    futs = [_all_reduce(c, self.resend_group).get_future() for c in again.values()]
                except Exception as e:
                    self._break(v, f"a resend could not be launched: {e}")
                    return
                v.resent = again
                if futs:
                    torch.futures.collect_all(futs).add_done_callback(functools.partial(self._resent, v))
                else:
                    v.finish()
            self._pump()  # a verdict waiting for a send on a link now lost waits no more

    def _resent(self, v: Verdict, fut: Future[list[Future[object]]]) -> None:
        try:
            for f in fut.value():
                f.value()
        except Exception as e:
            with self._lock:
                self._broken = self._broken or f"a resend failed: {e}"
            v.finish(self._broken)
            return
        v.finish()

    def _break(self, v: Verdict, why: str) -> None:
        """A group failed (lock held): ``v`` and every later verdict fail with ``why``."""
        self._broken = self._broken or why
        v.finish(self._broken)
        self._fail_pending()

    def _fail_pending(self) -> None:
        assert self._broken is not None
        for u in [*self._queue, *(a[0] for a in self._agreeing)]:
            u.finish(self._broken)
        self._queue.clear()
        self._agreeing.clear()

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._broken = self._broken or why
            self._fail_pending()
            for u in self._unrecorded:
                if not u.done:
                    u.finish(self._broken)


def flat_sum(group: dist.ProcessGroup) -> Callable[[torch.Tensor], dist.Work]:
    """``sum_flags`` of :class:`VerdictChain`: one all-reduce over ``group``."""
    return functools.partial(_all_reduce, group=group)


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    work = dist.all_reduce(tensor, group=group, async_op=True)
    assert work is not None
    return work
