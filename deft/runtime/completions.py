"""The completions of a link's gloo collectives, learnt off gloo's worker threads.

deft acts on its gloo collectives' completions: it stamps their times (the profile's busy periods,
:mod:`deft.runtime.warmup_timer`; the running schedule's link clock, :mod:`deft.runtime.link_timing`),
the guard's verdicts learn that a guarded send ended (:mod:`deft.runtime.verdicts`), and a hierarchical
all-reduce issues its next step (:mod:`deft.runtime.hierarchy`). A callback on a collective's future
(``then``, ``add_done_callback``) runs on the gloo worker thread that completed it, and a Python callback
first takes the GIL: while the training thread holds it (the model's Python between its kernels) that
worker, and every collective of its group queued behind it, waits up to the interpreter's switch
interval per callback (``benchmarks/results/gloo_callbacks.md``). :class:`Completions` instead keeps one
Python thread per link (or group) that waits on its futures in launch order (``Future.wait`` lets the GIL
go while it waits) and acts as each wait returns: the gloo threads run no Python.

Invariants:

* A stamp is never before its collective completed. It is late by the time its thread waits for the
  GIL (as a callback's stamp is), and, where a collective completes before one launched earlier on the
  same link (gloo runs two of a group's at once), it is stamped with that earlier one's. A link's busy
  periods (the union of its ``[launch, completion]`` intervals) are the same either way: a collective
  that completes first was launched while the earlier one was in flight.
* A failed collective (``wait`` raises) stamps nothing; one that never completes (a lost link) holds its
  link's later ones, whose collectives share its fate.
* :meth:`Completions.watch` returns an event set once the future is stamped or found failed, and runs
  its ``then`` on the link's thread after that. :func:`wait_stamped` waits for the events of the futures
  that have completed.
* A link's thread ends after :data:`IDLE_S` with nothing to wait for; the next future starts another.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import torch

log = logging.getLogger("deft.runtime")

#: Seconds a link's thread waits for another future before it ends.
IDLE_S = 1.0

_Entry = tuple["torch._C.Future[object]", "list[float] | None", threading.Event, "Callable[[], None] | None"]


class Completions:
    """One waiting thread per link, started on demand (module docstring)."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[_Entry]] = {}
        self._running: set[str] = set()  # links whose thread is alive

    def watch(self, link: str, fut: torch._C.Future[object], stamps: list[float] | None = None,
              then: Callable[[], None] | None = None) -> threading.Event:
        """Once ``fut`` completes, after every future watched on ``link`` before it: append its completion
        time to ``stamps`` (nothing if it failed), set the returned event, then call ``then()`` on the
        link's thread (an exception it raises is logged, and the link's next future is waited on)."""
        done = threading.Event()
        with self._lock:
            q = self._queues.setdefault(link, queue.SimpleQueue())
            q.put((fut, stamps, done, then))
            if link not in self._running:
                self._running.add(link)
                threading.Thread(target=self._run, args=(link, q), name=f"deft-completions-{link}",
                                 daemon=True).start()
        return done

    def _run(self, link: str, q: queue.SimpleQueue[_Entry]) -> None:
        while True:
            try:
                fut, stamps, done, then = q.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:  # a future put after the timeout finds this thread gone or still here
                    if q.empty():
                        self._running.discard(link)
                        return
                continue
            try:
                fut.wait()
            except Exception:  # a failed collective: reported where its result is taken
                pass
            else:
                if stamps is not None:
                    stamps.append(time.perf_counter())  # list.append is atomic: the owner reads it anywhere
            finally:
                done.set()
            if then is not None:
                try:
                    then()
                except Exception:  # logged: the link's later futures must not die with it
                    log.exception("deft: an action on a completed collective of link %r failed", link)


def wait_stamped(sends: Iterable[tuple[str, Sequence[torch._C.Future[object]], Sequence[threading.Event]]]) -> None:
    """Wait until every completed future of ``sends`` (``(link, futures, their events)`` in launch order)
    is stamped. A link's futures after one not complete are not waited for: that one holds their stamps
    (a lost link's send may never complete)."""
    stuck: set[str] = set()
    for link, futures, stamped in sends:
        for fut, done in zip(futures, stamped, strict=True):
            if link in stuck or not fut.done():
                stuck.add(link)
            else:
                done.wait()
