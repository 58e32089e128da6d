"""The run's calendar: at which iterations warm-up ends, the profile is measured, the plan is made, and
the preserver's statistics are gathered.

A frozen value: :func:`place` computes it at construction (and again when a comm hook is registered),
:meth:`Calendar.restart` when a checkpoint taken before planning is loaded. Nothing else moves it.

Iterations ``0 <= t < warm_end`` warm up (torch DDP's schedule; the comm hook's plain iterations
first), ``warm_end <= t < plan_at`` are the profile iterations when deft measures its own profile,
and the plan is made after the step of iteration ``plan_at - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: After planning, statistics run only in this many iterations before each preserver re-check. In them
#: every update is applied whole at the step (the statistics need the whole averaged gradient), so a
#: lag-free plan loses its forward overlap there; 8 keeps twice the samples the first plan is made from
#: at a small share of a long run (benchmarks/RESULTS.md, "Figures behind the runtime's constants").
STATS_WINDOW = 8


@dataclass(frozen=True)
class Calendar:
    """When the run's phases begin (module docstring); ``stats_window`` is ``[first, end)`` of the
    iterations whose gradients feed the preserver's statistics before planning."""

    warm_end: int
    plan_at: int
    stats_window: tuple[int, int]

    def profiling(self, t: int) -> bool:
        """Is iteration ``t`` a profile iteration (when deft measures its profile)?"""
        return self.warm_end <= t < self.plan_at

    def stats_before_plan(self, t: int) -> bool:
        """Do iteration ``t``'s gradients feed the statistics the first plan is made from?"""
        return self.stats_window[0] <= t < self.stats_window[1]

    def restart(self, t: int, profile_iters: int, measuring: bool) -> Calendar:
        """A checkpoint taken before planning finished, loaded at iteration ``t``: the timings of a
        half-done profile are not in it, so profile (and gather statistics) again from ``t``."""
        plan_at = t + (profile_iters if measuring else 0)
        return Calendar(warm_end=t, plan_at=plan_at, stats_window=(0, plan_at))


def place(plain_iters: int, warmup_iters: int, profile_iters: int, measuring: bool) -> Calendar:
    """Warm-up ends ``warmup_iters`` (at least 1) iterations after the comm hook begins to compress.

    ``plain_iters``: the iterations a comm hook sends uncompressed (PowerSGD's ``start_powerSGD_iter``;
    0 without a hook). A profile of those would plan the steady state on uncompressed times, and a
    hook's first compressed iterations are slow (PowerSGD allocates its error feedback there), so the
    warm-up counts from the first compressed one. A given profile or schedule is taken as it is:
    nothing is measured, so no profile iterations.

    The statistics before planning are the last ``n`` iterations before the hook compresses (exact
    all-reduced gradients: the walk's inputs), or the first ``n`` when it compresses sooner; without a
    hook, every iteration before planning. ``n`` is the warm-up plus profile length. The figures behind
    these choices: benchmarks/RESULTS.md, "Figures behind the runtime's constants".
    """
    warm_end = plain_iters + max(1, warmup_iters)
    plan_at = warm_end + (profile_iters if measuring else 0)
    n = plan_at - plain_iters
    return Calendar(warm_end=warm_end, plan_at=plan_at, stats_window=(max(0, plain_iters - n), max(plain_iters, n)))


def stats_after_plan(t: int, recheck_every: int) -> bool:
    """After planning, statistics run in the :data:`STATS_WINDOW` iterations before each re-check (the
    estimator's moving average forgets older steps anyway)."""
    return recheck_every <= STATS_WINDOW or (t % recheck_every) >= recheck_every - STATS_WINDOW
