"""The training loop's own time per iteration: the profile's ``step_s``.

An iteration's time is its forward, its backward, the sends the compute waits for, and what the loop does
outside all three: the optimizer's step, gradient clipping, the learning-rate schedule, the next batch. The
warm-up timer prices the forward and the backward; without the rest a plan is priced short by the step of
an optimizer that touches every parameter (Adam's four reads and three writes of each) on every iteration.

:class:`StepClock` times, on each rank, what runs between deft's hooks from the end of an iteration's
backward to the next forward: from the end of deft's backward-end callback (the due updates exposed) to
its step pre hook, from the pre hook's end to its post hook (the optimizer's own step), and from the post
hook's end to the next training forward. deft's own work inside its hooks (exposing updates, the
preserver's statistics, the profile's bookkeeping, planning) is left out: the plan prices its own
runtime's work elsewhere or not at all, and the profile iterations carry bookkeeping the plan's do not.
What runs between the forward's end and the backward's start (the loss) is not counted: it is small where
the model's output is (a cross-entropy over it).

The profile's ``step_s`` (:meth:`deft.runtime.warmup_timer.WarmupTimer.profile`) is the median over the
profile iterations timed whole (all but the last, whose step ends in the planning) of the slowest rank's
seconds, as the compute is reduced (:mod:`deft.profiler.pace`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class StepClock:
    """This rank's seconds of the loop's own work per iteration (module docstring)."""

    seconds: dict[int, float] = field(default_factory=dict)
    _running: tuple[int, float] | None = None  # (iteration, when the loop's own work resumed)

    def resume(self, t: int, now: float) -> None:
        """A deft hook of iteration ``t`` returns to the loop at ``now``."""
        self._running = (t, now)

    def pause(self, now: float) -> None:
        """A deft hook (or a training forward) begins at ``now``: the loop's work since it resumed counts."""
        if self._running is not None:
            t, since = self._running
            self.seconds[t] = self.seconds.get(t, 0.0) + max(0.0, now - since)
            self._running = None

    def row(self, iterations: Sequence[int]) -> list[float | None]:
        """The seconds of each of ``iterations`` (None where none was timed), for the reduction over ranks."""
        return [self.seconds.get(t) for t in iterations]
