"""Per-bucket compute times of several ranks reduced to one set: the ranks' *pace*.

In synchronous data parallelism every rank waits for the slowest one at each step, so the compute a
profile charges per iteration is the slowest rank's, not any one bucket's slowest rank. With
``x[r][b]`` rank ``r``'s compute (forward plus backward) of bucket ``b`` in one iteration, the pace
of that iteration is ``max_r sum_b x[r][b]``. The per-bucket maximum over ranks would charge
``sum_b max_r x[r][b]``, and

    sum_b max_r x[r][b]  >=  max_r sum_b x[r][b]

(for the rank ``r*`` with the largest sum, ``max_r x[r][b] >= x[r*][b]`` in every bucket), with
equality only when one rank is the slowest in every bucket. When ranks stall in different buckets (more
ranks than cores, each descheduled somewhere else) the per-bucket maxima add up every rank's stall
and the profile charges more compute than any rank spends.

:func:`paced_compute` therefore takes the total from the slowest rank of each iteration (its median
over iterations) and shares it among the buckets in proportion to their medians over ranks, which
keep a typical rank's proportions. The runtime's warm-up timer (:mod:`deft.runtime.warmup_timer`)
reduces its profile iterations with it. The trace parsers (:mod:`deft.profiler.kineto`,
:mod:`deft.profiler.nsys`) reduce in the same order through :func:`paced_ranks`, on the iterations
(step numbers) that every rank's trace holds; where the ranks share none (traces of different
steps) they fall back to each rank's per-bucket medians over its own steps taken as its one
iteration (:func:`paced_medians`), and one rank's medians are taken unchanged. The two orders differ:
``median_i max_r`` of the per-iteration totals is not ``max_r`` of the per-rank totals of medians
when the ranks are slow in different iterations. Communication is not reduced here: a synchronous
all-reduce completes when the slowest rank arrives, so its time stays the maximum over ranks.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple


def paced_compute(fwd: Sequence[Sequence[Sequence[float]]],
                  bwd: Sequence[Sequence[Sequence[float]]]) -> tuple[list[float], list[float]]:
    """Per-bucket forward and backward seconds at the ranks' pace.

    ``fwd[r][i][b]`` is rank ``r``'s forward time of bucket ``b`` in profile iteration ``i`` (``bwd``
    likewise). The total is the pace ``T = median_i max_r sum_b (fwd[r][i][b] + bwd[r][i][b])``: in each
    iteration the slowest rank's compute, robust to one slow iteration. The buckets share it as their
    medians over ranks of their medians over iterations, ``f_b`` and ``g_b``: forward ``f_b T / S`` and
    backward ``g_b T / S`` with ``S = sum_b (f_b + g_b)``. So the times sum to ``T`` and keep the
    typical rank's proportions; where ``S`` is 0 they are the medians unscaled (all zero).

    With one rank and one iteration ``T = S`` and the times are returned unchanged.

    Note: taking the maximum over ranks bucket by bucket would charge more than any rank spends:
    ``sum_b max_r x_rb >= max_r sum_b x_rb``. With more ranks than cores every rank is descheduled
    somewhere in the iteration, each in another bucket, and the per-bucket maxima add up every rank's
    stall.
    """
    if not fwd or len(fwd) != len(bwd):
        raise ValueError(f"internal: compute times of {len(fwd)} ranks' forward and {len(bwd)} ranks' backward")
    iters = min(len(r) for r in (*fwd, *bwd))
    if iters == 0:
        raise ValueError("internal: a rank timed no profile iteration")
    n = len(fwd[0][0])
    pace = statistics.median(max(sum(f[i]) + sum(g[i]) for f, g in zip(fwd, bwd, strict=True))
                             for i in range(iters))
    f_b = [statistics.median(statistics.median(r[i][b] for i in range(iters)) for r in fwd) for b in range(n)]
    g_b = [statistics.median(statistics.median(r[i][b] for i in range(iters)) for r in bwd) for b in range(n)]
    total = sum(f_b) + sum(g_b)
    scale = pace / total if total > 0 else 1.0
    return [x * scale for x in f_b], [x * scale for x in g_b]


def paced_medians(fwd: Sequence[Sequence[float]], bwd: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """:func:`paced_compute` of per-rank medians: ``fwd[r][b]`` is rank ``r``'s median forward time of
    bucket ``b`` over its steps (``bwd`` likewise), taken as the rank's one iteration.

    The total is ``T = max_r sum_b (fwd[r][b] + bwd[r][b])``, the slowest rank's sum of its medians;
    bucket ``b`` gets ``f_b T / S`` and ``g_b T / S`` with ``f_b = median_r fwd[r][b]``,
    ``g_b = median_r bwd[r][b]`` and ``S = sum_b (f_b + g_b)``. With one rank the medians are returned
    unchanged.
    """
    return paced_compute([[list(row)] for row in fwd], [[list(row)] for row in bwd])


class Paced(NamedTuple):
    """Per-bucket forward and backward seconds at the ranks' pace (:func:`paced_ranks`), and how they
    were reduced."""

    forward_s: list[float]
    backward_s: list[float]
    iterations: list[int]  # the iterations every rank holds, reduced per iteration; [] where medians were
    ranks: int

    def describe(self, unit: str) -> str:
        """The order of the reduction in words (a profile's ``meta["reduction"]``), ``unit`` naming an
        iteration ("step", "iteration")."""
        if self.iterations:
            return (f"compute at the ranks' pace per {unit} (deft.profiler.pace.paced_compute): in each of the "
                    f"{len(self.iterations)} {unit}s every rank holds the slowest rank's total, the median over "
                    f"those {unit}s, shared by the buckets' medians over ranks")
        if self.ranks == 0:
            return "no compute times: forward and backward 0"
        if self.ranks == 1:
            return f"compute: the one rank's median over {unit}s (deft.profiler.pace)"
        return (f"compute at the ranks' pace of their medians (deft.profiler.pace.paced_medians): the ranks hold "
                f"no {unit} in common, so each rank's medians over its own {unit}s first, then the slowest "
                f"rank's total of them, shared by the buckets' medians over ranks")


def paced_ranks(fwd: Sequence[Mapping[int, Sequence[float]]], bwd: Sequence[Mapping[int, Sequence[float]]],
                fwd_medians: Sequence[Sequence[float]], bwd_medians: Sequence[Sequence[float]]) -> Paced:
    """Several ranks' traces reduced to the ranks' pace, in the warm-up timer's order where it can be.

    ``fwd[r][i][b]`` is rank ``r``'s forward time of bucket ``b`` in the iteration numbered ``i`` (its
    step number; ``bwd`` likewise); ``fwd_medians[r][b]`` is the rank's median over its own iterations
    (``bwd_medians`` likewise). With ``I`` the iterations every rank holds (in both ``fwd`` and ``bwd``):

    * several ranks and ``I`` not empty: :func:`paced_compute` of the iterations in ``I``, so the total
      is ``T = median_{i in I} max_r sum_b (fwd[r][i][b] + bwd[r][i][b])``;
    * several ranks and ``I`` empty (traces of different steps): :func:`paced_medians` of the medians,
      ``T = max_r sum_b (fwd_medians[r][b] + bwd_medians[r][b])``;
    * one rank: its medians unchanged.

    :attr:`Paced.iterations` is ``sorted(I)`` where it was used, else empty.
    """
    if len(fwd) != len(bwd) or len(fwd_medians) != len(fwd):
        raise ValueError(f"internal: iterations of {len(fwd)} and {len(bwd)} ranks, medians of {len(fwd_medians)}")
    common = sorted(set.intersection(*(set(f) & set(g) for f, g in zip(fwd, bwd, strict=True)))) if fwd else []
    if len(fwd) > 1 and common:
        f, g = paced_compute([[list(r[i]) for i in common] for r in fwd], [[list(r[i]) for i in common] for r in bwd])
        return Paced(f, g, common, len(fwd))
    f, g = paced_medians(fwd_medians, bwd_medians)
    return Paced(f, g, [], len(fwd))
