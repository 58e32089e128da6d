"""What the compute takes from the links where they share the processor: a link's *drag*.

Where a link's collectives run on the cores the model computes on (gloo on CPU tensors), a send is
slower while the model computes beside it. The model (:class:`deft.profile.Link`): a send's work
progresses at ``1 / (1 + d)`` of its speed while the rank's compute stream is busy and at full speed
otherwise, ``d`` the drag. A busy group (buckets a link carried together, :mod:`deft.runtime.warmup_timer`)
of ``T`` seconds, ``o`` of them beside the compute, holds ``T - o + o / (1 + d)`` seconds of work, so

    T = alpha m + beta B + k o,        k = d / (1 + d)                             (1)

``m`` collectives of ``B`` bytes, ``alpha`` the link's probed start-up, ``beta`` its transfer time per
byte with the cores free. :func:`fit_drag` fits one ``k`` shared by the links (they share the same
cores) and a ``beta`` per link by least squares over every link's groups, ``alpha`` fixed:

    minimize  sum_i (T_i - alpha_l(i) m_i - beta_l(i) B_i - k o_i)^2

Invariants: ``0 <= k <= MAX_DRAG / (1 + MAX_DRAG)``; where the fit cannot tell ``k`` from ``beta``
(every group as much beside the compute as the others, :data:`MIN_SHARE_SPREAD`) or finds no drag
(``k <= 0``), ``d = 0`` and every ``beta`` is the one-parameter fit with ``alpha`` fixed, as without
drag. The fit returns the drag alone: each link's ``beta`` is :func:`group_beta` with ``alpha`` and the
(clamped) ``k`` fixed, the least squares in ``beta`` that ``k`` leaves. A group's time with the cores
free is ``T - k o`` (:meth:`DragFit.free_seconds`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

MB = 1e6  # bytes per MB in the fit's scaled byte column
#: The largest drag a profile carries (a send at a fifth of its speed beside the compute).
MAX_DRAG = 4.0
#: The least spread of the groups' shares of time beside the compute (``o / T``, largest minus
#: smallest) that separates ``k`` from ``beta``: below it every group is alike and ``k`` is not fitted.
MIN_SHARE_SPREAD = 0.2


@dataclass(frozen=True)
class DragGroup:
    """One busy group of one link: ``count`` collectives of ``nbytes`` bytes took ``seconds``, ``beside``
    of them beside the rank's compute."""

    count: int
    nbytes: int
    seconds: float
    beside: float


@dataclass(frozen=True)
class DragFit:
    """The fitted drag ``d`` (``k = d / (1 + d)``) and why it is 0 where it is (``reason``; empty when
    fitted). Each link's ``beta`` with the cores free is :func:`group_beta` with ``k``."""

    drag: float
    reason: str = ""

    @property
    def k(self) -> float:
        return self.drag / (1.0 + self.drag)

    def free_seconds(self, group: DragGroup) -> float:
        """The group's time with the cores free, ``T - k o`` (never below 0)."""
        return max(0.0, group.seconds - self.k * group.beside)


def group_beta(groups: Sequence[DragGroup], alpha: float, k: float = 0.0) -> float:
    """``beta >= 0`` of (1) with ``alpha`` and ``k`` fixed: ``max(0, sum B_i r_i / sum B_i^2)``, ``r_i =
    T_i - alpha m_i - k o_i`` (the derivative of the squares in ``beta`` vanishes there; the objective
    is a parabola, so clamping at 0 gives the constrained minimum); ``1e-12`` where no row has bytes or
    nothing is left to fit and ``alpha`` is 0 (a link must have a model)."""
    b = np.asarray([g.nbytes for g in groups], dtype=float) / MB
    rest = np.asarray([g.seconds - alpha * g.count - k * g.beside for g in groups], dtype=float)
    den = float(b @ b)
    beta = max(0.0, float(b @ rest) / den) / MB if den > 0 else 0.0
    return beta if beta > 0 or alpha > 0 else 1e-12


def fit_drag(groups: Mapping[str, Sequence[DragGroup]], alphas: Mapping[str, float]) -> DragFit:
    """Fit (1) over every link's groups (module docstring). ``groups[l]``: link ``l``'s busy groups (a
    link without any is left out of the fit); ``alphas[l]``: its start-up."""
    links = [lk for lk in groups if groups[lk]]
    rows = [(lk, g) for lk in links for g in groups[lk]]

    if not rows:
        return DragFit(0.0, "no busy group")
    shares = [g.beside / g.seconds for _, g in rows if g.seconds > 0]
    if not shares or max(shares) - min(shares) < MIN_SHARE_SPREAD:
        return DragFit(0.0, f"the groups' shares beside the compute spread by less than {MIN_SHARE_SPREAD}")
    col = {lk: i for i, lk in enumerate(links)}
    a = np.zeros((len(rows), len(links) + 1))
    y = np.zeros(len(rows))
    for i, (lk, g) in enumerate(rows):
        a[i, col[lk]] = g.nbytes / MB
        a[i, -1] = g.beside
        y[i] = g.seconds - alphas[lk] * g.count
    solution, _, rank, _ = np.linalg.lstsq(a, y, rcond=None)
    if rank < a.shape[1]:
        return DragFit(0.0, "the groups do not determine the drag apart from the links' transfer times")
    k = float(solution[-1])
    if k <= 0:
        return DragFit(0.0, "no drag: the groups beside the compute were no slower")
    k = min(k, MAX_DRAG / (1.0 + MAX_DRAG))
    return DragFit(k / (1.0 - k))
