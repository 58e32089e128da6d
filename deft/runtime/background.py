"""A decision computed on a thread of rank 0 while training goes on (``config.plan_lag_iters``).

:class:`Background` runs ``fn()`` on a daemon thread at a lower CPU priority (``config.planner_nice``,
Linux), with Python's GIL switch interval shortened meanwhile (:data:`SWITCH_INTERVAL_S`), and hands
its JSON document back; an exception comes back as ``{"error": ...}``, so a failed
background decision travels to the other ranks like a failed synchronous one. Used for the first plan
(:meth:`deft.runtime.planning.Planning.start`) and the adaptation's decisions
(:meth:`deft.runtime.adapt.Adaptation.after_step`). :class:`JobSlot` holds the one decision in flight,
whichever it is, and says (collectively) when every rank collects it: at the first iteration boundary
where rank 0's thread is done, ``plan_lag_iters`` iterations after it began at the latest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from deft.runtime.switch_interval import SWITCH

if TYPE_CHECKING:
    from deft.runtime.control import ControlPlane

log = logging.getLogger("deft.runtime")

#: Python's GIL switch interval while a background job runs (seconds): each take-back of the GIL by the
#: training thread waits on the job's thread up to the interval, so at Python's default the iteration
#: that runs beside rank 0's planner is slowed; a short interval keeps it at the others' pace
#: (benchmarks/results/slow_links.md; :mod:`deft.runtime.switch_interval`).
SWITCH_INTERVAL_S = 0.0005


class Background:
    """``fn()`` on a daemon thread; :meth:`result` waits for it. An exception in ``fn`` is returned as
    ``{"error": "..."}`` (the decisions are JSON documents that carry their own errors), so a failed
    background decision travels to the other ranks like a failed synchronous one."""

    def __init__(self, fn: Callable[[], Mapping[str, object]], name: str, nice: int = 0) -> None:
        self._fn = fn
        self._nice = nice
        self._doc: Mapping[str, object] | None = None
        self.seconds = 0.0  # how long fn ran
        self._waited = 0.0  # how long callers have waited for it (wait, result)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        # Everything under the try: a thread that died without a document would leave rank 0 failing
        # an assert and the other ranks waiting for the broadcast until their timeout, with no reason.
        try:
            if self._nice and sys.platform.startswith("linux"):
                # Linux schedules threads as tasks: a thread id given to setpriority changes only this
                # thread (and the solver threads it starts). Elsewhere a thread id is no process id.
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            with SWITCH.holding(SWITCH_INTERVAL_S):
                self._doc = self._fn()
        except BaseException as e:  # carried to every rank, never lost in a thread
            log.exception("deft: background job %s failed", self._thread.name)
            self._doc = {"error": f"{type(e).__name__}: {e}"}
        finally:
            self.seconds = time.perf_counter() - t0

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the thread; True when it is done."""
        t0 = time.perf_counter()
        self._thread.join(seconds)
        self._waited += time.perf_counter() - t0
        return self.done()

    def result(self) -> tuple[Mapping[str, object], float]:
        """The document and the seconds callers waited for it, here and in :meth:`wait` (0 when it was
        ready)."""
        t0 = time.perf_counter()
        self._thread.join()
        assert self._doc is not None
        self._waited += time.perf_counter() - t0
        return self._doc, self._waited


#: What a background decision is for: the first plan, an adaptation's re-plan, or the plan without a lost link.
JobKind = Literal["plan", "adapt", "replan"]


@dataclass
class JobSlot:
    """The one background decision in flight (every rank holds the slot; only rank 0 holds a job).

    A decision is *held* from the iteration it began until the iteration boundary at which every rank
    collects it (:meth:`ready`, then :meth:`take`). The first plan and the adaptation never overlap (one
    runs before the plan is installed, the other after), and a lost link's re-plan drops either and
    stops the adaptation, so one slot serves all three."""

    control: ControlPlane
    kind: JobKind | None = None
    job: Background | None = None  # rank 0's thread (None elsewhere, and where rank 0 decided nothing)
    due: int = 0                   # collected at this iteration boundary at the latest

    def hold(self, kind: JobKind, job: Background | None, due: int) -> None:
        if self.kind is not None:
            raise RuntimeError(f"internal: a {kind} decision began while a {self.kind} decision was in flight")
        self.kind, self.job, self.due = kind, job, due

    def holds(self, kind: JobKind) -> bool:
        return self.kind == kind

    def ready(self, t: int) -> bool:
        """Collective while a decision is held: collect it at the boundary before iteration ``t``? Before
        ``due``, when rank 0's thread is done (rank 0's word, broadcast, so every rank answers alike).
        At ``due``, yes, once rank 0's thread is done: every rank waits for it together, in rounds of
        at most a quarter of ``timeout_s`` each, so a decision that takes longer than ``timeout_s`` is
        not mistaken for a dead rank, while a dead rank still fails the round within ``timeout_s``."""
        if t < self.due:
            return self._word(0.0)
        while not self._word(self.control.timeout_s / 4):
            log.info("deft: every rank waits for rank 0's background %s decision", self.kind)
        return True

    def _word(self, wait_s: float) -> bool:
        """Collective: is rank 0's thread done (after waiting up to ``wait_s`` for it)?"""
        done = 0
        if self.control.rank == 0:
            if wait_s > 0:  # at the limit: a rank 0 without a job has nothing to wait for
                done = int(self.job is None or self.job.wait(wait_s))
            else:
                done = int(self.job is not None and self.job.done())
        return bool(self.control.broadcast_ints([done], "background planning state")[0])

    def take(self) -> Background | None:
        """Empty the slot; rank 0 gets its job (to wait for with :meth:`Background.result`)."""
        job, self.kind, self.job = self.job, None, None
        return job

    def discard(self) -> None:
        """Forget the decision in flight (a checkpoint was loaded): its thread is waited for (it reads
        the old run's state) and its result dropped."""
        job = self.take()
        if job is not None:
            job.result()
