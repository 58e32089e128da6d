"""The compute's drift between the profile and the plan: each rank's compute in the profile iterations
against the iterations that ran while rank 0 planned in the background.

The profile prices the compute of its own few iterations. A machine still speeding up when they run (or
slowing down: another job, a throttled processor) leaves the first plan priced for a compute it no longer
has. The iterations that run while rank 0 plans (``DeftConfig.plan_lag_iters``) run the same synchronous
schedule on the same buckets, and run anyway, so they tell at no cost whether the profile's compute still
holds when the plan starts. :class:`ComputeClock` times, on each rank, iteration ``t``'s compute
``c_r(t)``: from its forward's start to the end of its (last) autograd pass, deft's launch calls and hooks
inside it on both sides alike. The drift (:func:`drift`) is::

    g = median_{t in lag} max_r c_r(t) / median_{t in profile} max_r c_r(t)

each iteration at the slowest rank (the pace, as the profile reduces its compute: :mod:`deft.profiler.pace`),
then the median over the iterations (one slow iteration moves neither). Where the compute sped up
(``g < 1``) by more than ``DeftConfig.adapt_tolerance`` and beyond the profile iterations' own spread
(the lag iterations' median faster than the fastest profile iteration) the first plan is priced on the
profile with every compute time ``x g``
(:meth:`deft.profile.Profile.scaled`): the plan is not made again (the adaptation's first window decides
that, against this price); otherwise the adaptation's first window takes the drift as it takes any error
of that size. Why the spread: with more ranks than cores the profile iterations' compute varies by a
tenth or more from one iteration to the next, and a ratio of two medians of two or three iterations each
moves as much by chance (benchmarks/results/prices_drift.md). Fewer than :data:`MIN_LAG_SAMPLES` timed
lag iterations: no drift is read.

A plan done after a single lag iteration (a pause between iterations, an evaluation, gave the planner
its time) would go unpriced: where that one iteration is faster than the profile's median by more than
the tolerance, the plan is held one iteration more for the second reading (:func:`wants_another`), and
the two decide by the rule above (the spread included), so one fast iteration alone neither prices the
plan nor is lost. Where it is not faster, the plan is installed at once: a second lag iteration would
cost what the plan saves, and a slowdown is not applied.

Note: what else is in ``g``. The lag iterations send with the codec the preserver accepted so far, where
the profile iterations sent exact (or the profile's codec) and rotated their buckets over the links: on
a CPU machine whose cores the gloo threads share, part of ``g`` is the sends' lighter load on the
compute, which the plan's iterations share (they send coded too). And rank 0's planner thread runs beside
every lag iteration (the plan is collected at the first boundary after it ends, :mod:`deft.runtime.background`),
at ``DeftConfig.planner_nice``, which the plan's iterations do not: where it takes a core the compute
needs, part of ``g`` is the planner's. The planner only slows the lag iterations, so a speed-up is the
machine's (or the sends'), while a slowdown may be the planner's alone: a slowdown is recorded, not
applied, and the adaptation's first window measures the plan without the planner (the measurements:
benchmarks/results/prices_drift.md, "A slowdown is the planner's").
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from deft._json import JsonDict

#: The fewest timed lag iterations a drift is read from: a plan is often collected after two
#: (benchmarks/results/prices_drift.md, the lag samples of each run's record); the median of two is
#: their mean, one slow iteration half in it, and the tolerance and the spread rule carry the rest.
MIN_LAG_SAMPLES = 2


@dataclass
class ComputeClock:
    """This rank's compute per iteration before the first plan is installed (module docstring)."""

    seconds: dict[int, float] = field(default_factory=dict)
    _start: tuple[int, float] | None = None  # (iteration, its forward's start)

    def forward(self, t: int, now: float) -> None:
        """Iteration ``t``'s first forward begins at ``now``."""
        self._start = (t, now)

    def backward_ends(self, now: float) -> None:
        """An autograd pass of the running iteration ended at ``now``: its compute so far."""
        if self._start is not None:
            t, began = self._start
            self.seconds[t] = now - began

    def row(self, iterations: Sequence[int]) -> list[float]:
        """The compute of each of ``iterations`` (0.0 where none was timed), for the max over ranks."""
        return [self.seconds.get(t, 0.0) for t in iterations]


@dataclass(frozen=True)
class Drift:
    """The profile iterations' and the lag iterations' compute (each the median of the slowest rank's),
    their ratio ``factor`` (``g``), and whether the first plan is priced with it (a speed-up beyond the
    tolerance and the profile iterations' spread: module docstring)."""

    profile_s: float
    lag_s: float
    factor: float
    applied: bool
    samples: int
    rows: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())  # the slowest rank's, per iteration

    def to_dict(self) -> JsonDict:
        return {"profile_s": round(self.profile_s, 4), "lag_s": round(self.lag_s, 4),
                "factor": round(self.factor, 4), "applied": self.applied, "lag_samples": self.samples,
                "profile_iterations_s": [round(s, 4) for s in self.rows[0]],
                "lag_iterations_s": [round(s, 4) for s in self.rows[1]]}


def drift(profile_rows: Sequence[float], lag_rows: Sequence[float], tolerance: float,
          min_samples: int = MIN_LAG_SAMPLES) -> Drift | None:
    """``g`` of the module docstring from the slowest rank's compute of each profile and lag iteration
    (``max_r c_r(t)``; iterations timed on no rank, 0.0, left out). None: fewer than ``min_samples``
    lag iterations, or no profile iteration, were timed."""
    prof = [s for s in profile_rows if s > 0]
    lag = [s for s in lag_rows if s > 0]
    if not prof or len(lag) < min_samples:
        return None
    p, q = statistics.median(prof), statistics.median(lag)
    g = q / p
    # a speed-up only (module docstring, Note): the planner beside the lag iterations can only slow them
    return Drift(p, q, g, g < 1.0 - tolerance and q < min(prof), len(lag), (tuple(prof), tuple(lag)))


def wants_another(profile_rows: Sequence[float], lag_rows: Sequence[float], tolerance: float,
                  min_samples: int = MIN_LAG_SAMPLES) -> bool:
    """Whether a plan ready before ``min_samples`` lag iterations were timed is held for one more
    (module docstring): at least one was timed, fewer than ``min_samples``, and their median is faster
    than the profile's by more than ``tolerance``. Arguments as :func:`drift`'s."""
    timed = sum(1 for s in lag_rows if s > 0)
    if not 0 < timed < min_samples:
        return False
    early = drift(profile_rows, lag_rows, tolerance, min_samples=timed)
    return early is not None and early.factor < 1.0 - tolerance
