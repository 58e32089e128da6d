"""The profile iterations' window: it slides on while their compute has not settled.

The profile prices the compute of its ``profile_iters`` iterations. Where the ranks outnumber the cores
(several ranks per host on a small machine, or every rank of a testbed on one), a process's first
iterations still speed up and the time-slicing of the cores moves each iteration's compute by a tenth or
more; a profile of three such iterations prices the first plan anywhere within that spread, and so does the
plan's choice. So after the last profile iteration the ranks read the slowest rank's compute of each
profile iteration (``c(t) = max_r c_r(t)``, :class:`deft.runtime.compute_drift.ComputeClock`) and the
window is *settled* (:func:`settled`) when a majority of its iterations lie within::

    |c(t) - m| <= max(tolerance * m, SETTLE_FLOOR_S),     m = median_t c(t)

``tolerance``: ``DeftConfig.adapt_tolerance``, the error a plan's first window accepts. One slow
iteration moves neither the median nor the verdict; two of three apart from their median do. Unsettled,
the window slides by one iteration (the oldest becomes warm-up: :meth:`deft.runtime.calendar.Calendar.slid`,
its timings dropped from the profile) at most ``DeftConfig.profile_settle_iters`` times, and the profile
is made from the last ``profile_iters`` iterations, the settled ones where they settled.

Note: what a slide costs. A profile iteration runs the warm-up's synchronous schedule, torch DDP's pace:
each slide costs the difference between that and the plan's iteration, once. Where the compute is steady
(one rank a core, or a GPU) the window settles at once and costs nothing; the floor keeps a model whose
compute is a few milliseconds (where a spread of milliseconds prices nothing) from sliding on the
machine's jitter. The figures behind the rule: benchmarks/results/prices_window.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

#: Deviations from the window's median below this many seconds count as within it (module docstring):
#: the time-slice granularity of a shared machine, below anything a plan's price turns on.
SETTLE_FLOOR_S = 0.01


def settled(rows: Sequence[float], tolerance: float, floor_s: float = SETTLE_FLOOR_S) -> bool:
    """Whether the profile window's compute has settled (module docstring): ``rows`` the slowest rank's
    compute of each of its iterations (0.0: timed on no rank, left out). A window with nothing timed is
    settled (nothing to wait for)."""
    timed = [s for s in rows if s > 0]
    if not timed:
        return True
    m = statistics.median(timed)
    within = sum(1 for s in timed if abs(s - m) <= max(tolerance * m, floor_s))
    return 2 * within > len(timed)
