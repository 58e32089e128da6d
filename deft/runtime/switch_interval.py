"""Python's GIL switch interval, shortened while deft has threads that need the GIL promptly.

The training thread gives the GIL up for every torch operation and takes it back after; between
operations it runs Python (the model's modules, deft's hooks). Another thread that wants the GIL then
waits up to the switch interval (Python's default 5 ms) before the holder is asked to let go. Two kinds
of deft's threads wait so:

* rank 0's background planner (:mod:`deft.runtime.background`): each take-back of the training thread
  waits on it, and the iteration beside the planner is slowed;
* gloo's worker threads, which run a send's completion callbacks (torch's PowerSGD hook chains its
  collectives so, a user's hook may): the callback holds its gloo thread, and with it the link, until it
  has the GIL (benchmarks/results/gloo_callbacks.md; deft's own completions are learnt off those
  threads, :mod:`deft.runtime.completions`): held only where ``switch_interval_ms`` asks for it.

:data:`SWITCH` holds the interval at the shortest one asked for while any holder is active, never
longer than the caller's own, and gives the caller's value back once the last holder has left.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator


class SwitchInterval:
    """Holders of a shortened switch interval (module docstring). Thread-safe; holders may overlap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, float] = {}
        self._next = 0
        self._saved = 0.0

    def hold(self, seconds: float) -> int:
        """Ask for at most ``seconds`` until :meth:`release` of the returned token."""
        with self._lock:
            if not self._held:
                self._saved = sys.getswitchinterval()
            token, self._next = self._next, self._next + 1
            self._held[token] = seconds
            sys.setswitchinterval(min(self._saved, *self._held.values()))
            return token

    @contextlib.contextmanager
    def holding(self, seconds: float) -> Iterator[None]:
        """:meth:`hold` for the ``with`` block."""
        token = self.hold(seconds)
        try:
            yield
        finally:
            self.release(token)

    def release(self, token: int) -> None:
        """End the hold ``token`` (a token released already: nothing)."""
        with self._lock:
            if self._held.pop(token, None) is None:
                return
            sys.setswitchinterval(min(self._saved, *self._held.values()) if self._held else self._saved)


SWITCH = SwitchInterval()
