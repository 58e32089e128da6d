"""Per-call cost of the preserver's live statistics on one 4,390,144-element gradient (the digits CNN's
large bucket): ``local_stats`` with both directions, ``DirectionPair.dot``, ``SecantCurvature.observe``.

They run on every warm-up and profile iteration (under PowerSGD also on each plain iteration before
``start_powerSGD_iter``). Run against any checkout to compare (one thread, median of 7 calls)::

    PYTHONPATH=<checkout> .venv/bin/python benchmarks/bench_stats_cost.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import deft
from deft.preserver.curvature import SecantCurvature
from deft.preserver.noise import DirectionPair, local_stats

N = 4_390_144


def median_ms(f: Callable[[], object], repeats: int = 7) -> float:
    f()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    g, u1, u2, x = (torch.randn(N, generator=gen) for _ in range(4))
    secant = SecantCurvature()

    def observe() -> None:
        x.add_(1e-3)
        g.add_(1e-3)
        secant.observe([x], [g])

    pair = DirectionPair()
    pair.observe([u1])
    pair.observe([u2])
    print(f"{deft.__file__}: local_stats {median_ms(lambda: local_stats([g], ([u1], [u2]), 32)):.1f} ms, "
          f"DirectionPair.dot {median_ms(pair.dot):.1f} ms, SecantCurvature.observe {median_ms(observe):.1f} ms")


if __name__ == "__main__":
    main()
