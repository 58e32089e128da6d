"""One send in flight per gloo link (``link_queue = true``): the link's collectives run one after another,
in launch order.

The plan prices a link as a queue (:mod:`deft.solver.simulate`): a send starts when the one before it
on the link has ended, and the one the next forward needs first is launched first, so it ends first.
A gloo process group runs two collectives at once (``ProcessGroupGloo``'s two worker threads; the
option that sets them is not reachable through ``dist.new_group``): two sends in flight share the NIC,
and the first ends about when the second would have, late for its deadline, while the two together
take as long as one after the other.

:class:`LinkQueue` restores the queue the plan priced: each send is launched from the completion
callback of the one before it (at once where the link is idle), and its handle is a :class:`QueuedWork`,
a ``dist.Work`` over a future of its own, so that the runtime waits on it as on any all-reduce's. A
send is a plain all-reduce (``CommLink.all_reduce``) or a 16-bit codec's hook on the link's group (the
executor's coded buckets: their collective starts inside the hook's call, which then waits its turn).
int8's hook cannot wait in the queue (its count of calls numbers its draws and tags, which must follow
the launch order on every rank) nor run beside it (its collectives would enter the group in another
order on another rank), so the config refuses the queue with a compression that may choose it. A
hierarchical link (several ranks per host, :mod:`deft.runtime.hierarchy`) has no queue.

Invariants:

* Every rank launches a link's sends in the same order (the schedule's), so the collectives match.
* A send that fails fails every send queued behind it, without launching them: a gloo group whose
  transport failed may abort the process when given another collective, and a link with a failed send
  is lost (:mod:`deft.runtime.failover`) and carries nothing more. Each failure is judged where its
  send is waited for, on every rank alike (a peer whose own sends completed finds them late).
* The callback runs on the gloo thread that completed the previous send; launching a collective there
  only enqueues it (as :mod:`deft.runtime.hierarchy` issues its steps).

Note [why torch DDP does not need it]
Torch DDP launches its buckets the same way and gets the same sharing, but waits for all of them at
the step: only the sum of the sends matters to it, and the sum does not change. deft waits for each
bucket where its deadline is (the step, or the forward of its module), so which one ends first does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deft.runtime.control import FUTURE_TYPES, future_done_event


class QueuedWork(dist.Work):
    """The handle of a send queued on its link: a ``dist.Work`` over the future that its collective's
    completion (or its launch's failure) sets (``wait(timeout)``, ``is_completed``, ``get_future``)."""

    def __init__(self, future: torch.futures.Future[object]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and not self._future.done() \
                and not future_done_event(self._future).wait(timeout.total_seconds()):
            raise TimeoutError(f"queued all-reduce not done after {timeout.total_seconds():g} s")
        self._future.wait()  # raises the collective's error
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future[object]:
        return self._future


class LinkQueue:
    """A link's launch queue (module docstring): :meth:`submit` launches a collective once every one
    submitted before it has completed. Thread-safe."""

    def __init__(self) -> None:
        self._tail: torch.futures.Future[object] | None = None
        self._lock = threading.Lock()

    def submit(self, launch: Callable[[], dist.Work | torch.futures.Future[Any]], device: torch.device) -> QueuedWork:
        """Queue ``launch`` (which starts one send on this link and returns its Work, or a comm hook's
        Future, whose value the handle's future takes) behind the sends submitted before it; ``device``:
        the tensors' (a future holding CUDA tensors names it)."""
        outer: torch.futures.Future[object] = torch.futures.Future(
            devices=[device] if device.type == "cuda" else None)

        def run(before: torch.futures.Future[object] | None = None) -> None:
            failed = _failure(before)
            if failed is not None:  # the link's transport has failed: nothing more is put on it
                outer.set_exception(RuntimeError(f"not launched: an earlier all-reduce on this link failed ({failed})"))
                return
            try:
                started = launch()
                inner = started if isinstance(started, FUTURE_TYPES) else started.get_future()
            except Exception as e:
                outer.set_exception(e)
                return

            def done(f: torch.futures.Future[object]) -> None:
                try:
                    outer.set_result(f.value())
                except Exception as e:
                    outer.set_exception(e)
            inner.add_done_callback(done)

        with self._lock:  # the order of the tails is the order of the launches
            tail, self._tail = self._tail, outer
        if tail is None:
            run()
        else:
            tail.add_done_callback(run)  # at once (inline) where the previous send has completed
        return QueuedWork(outer)


def _failure(fut: torch.futures.Future[object] | None) -> str | None:
    """The error of a completed future that failed (None: no future, or a success)."""
    if fut is None:
        return None
    try:
        fut.value()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None
