"""A decision computed on a thread of rank 0 while training goes on (``config.plan_lag_iters``).

:class:`Background` runs ``fn()`` on a daemon thread at a lower CPU priority (``config.planner_nice``,
Linux) and hands its JSON document back; an exception comes back as ``{"error": ...}``, so a failed
background decision travels to the other ranks like a failed synchronous one. Used for the first plan
(:meth:`deft.runtime.planning.Planning.start`) and the adaptation's decisions
(:meth:`deft.runtime.ddp.DistributedDataParallel._maybe_adapt`); when and how the ranks collect the
result is theirs (the module docstring of :mod:`deft.runtime.planning`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("deft.runtime")


class Background:
    """``fn()`` on a daemon thread; :meth:`result` waits for it. An exception in ``fn`` is returned as
    ``{"error": "..."}`` (the decisions are JSON documents that carry their own errors), so a failed
    background decision travels to the other ranks like a failed synchronous one."""

    def __init__(self, fn: Callable[[], dict[str, Any]], name: str, nice: int = 0) -> None:
        self._fn = fn
        self._nice = nice
        self._doc: dict[str, Any] | None = None
        self.seconds = 0.0  # how long fn ran
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
            self._doc = self._fn()
        except BaseException as e:  # carried to every rank, never lost in a thread
            log.exception("deft: background job %s failed", self._thread.name)
            self._doc = {"error": f"{type(e).__name__}: {e}"}
        finally:
            self.seconds = time.perf_counter() - t0

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> tuple[dict[str, Any], float]:
        """The document and the seconds the caller waited for it (0 when it was ready)."""
        t0 = time.perf_counter()
        self._thread.join()
        assert self._doc is not None
        return self._doc, time.perf_counter() - t0
