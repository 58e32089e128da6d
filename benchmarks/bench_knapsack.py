"""Benchmark of deft.solver.knapsack on DeFT-like 0/1 two-knapsack instances.

Run: ``.venv/bin/python benchmarks/bench_knapsack.py [--instances 20] [--ref-work 0.5]``

Instances follow the paper's Problem 2: items are buckets with value == weight == their
all-reduce time on the primary link; knapsack 0's capacity is a stage's compute time (forward
or backward), knapsack 1's is that divided by mu = 1.65 (the slower second link). Bucket sizes
are log-uniform between 0.25M and 6.5M fp32 elements (DeFT's partition size caps them at 6.5M),
all-reduce times follow a ring model at 16 workers over 10 Gbit/s with 50 us latency per step,
and the stage's compute covers 20-40 % (forward) or 40-60 % (backward) of the total
communication, so the two knapsacks (1 + 1/mu = 1.61 times that) cannot take every bucket.

Reported per size: wall time of ``solve(method="exact")`` with its defaults (0.5 units of CP-SAT
deterministic work, relative gap 1e-3: what the planner passes with the default config), how often
it proves optimality, its certified gap, and the greedy's gap to the best known optimum: a
reference solve with ``relative_gap=0`` (the proven optimum when it proves one, else its certified
bound, so the greedy's gap is then an over-estimate).

Second table: the paper's greedy order (the smaller knapsack in primary-link units first) against
filling the primary link first, on the planner's model of Problem 2 (every link the same capacity in
time, each item ``mu`` times longer on the second link), 2000 random instances of 3-12 items.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass

from deft.solver import knapsack

MU = 1.65
WORKERS = 16
BANDWIDTH_B_PER_S = 10e9 / 8
ALPHA_S = 50e-6


@dataclass
class Instance:
    comm: list[float]
    capacities: list[float]
    stage: str


def deft_like(n: int, rng: random.Random) -> Instance:
    """One stage's knapsack problem (see the module docstring)."""
    numel = [math.exp(rng.uniform(math.log(0.25e6), math.log(6.5e6))) for _ in range(n)]
    steps = 2 * (WORKERS - 1)
    comm = [steps * ALPHA_S + steps / WORKERS * 4 * x / BANDWIDTH_B_PER_S for x in numel]
    stage = rng.choice(["forward", "backward"])
    share = rng.uniform(0.2, 0.4) if stage == "forward" else rng.uniform(0.4, 0.6)
    cap = share * math.fsum(comm)
    return Instance(comm, [cap, cap / MU], stage)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)]


def run(sizes: list[int], n_inst: int, ref_work: float, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    # count how many default solves need CP-SAT (the rest end after the greedy + local search)
    cp_sat_calls = [0]
    real_cp_sat = knapsack._cp_sat

    def counting(*a: object) -> object:
        cp_sat_calls[0] += 1
        return real_cp_sat(*a)

    # the first CP-SAT call pays for importing OR-Tools (~0.4 s); keep it out of the numbers
    warm = deft_like(16, random.Random(-1))
    knapsack.solve(warm.comm, [[x, x] for x in warm.comm], warm.capacities, relative_gap=0.0)
    rows = []
    for n in sizes:
        t_exact, t_greedy, t_ref, gaps_exact, greedy_gap, fits = [], [], [], [], [], []
        ref_proven = proven = used_cp_sat = 0
        for _ in range(n_inst):
            inst = deft_like(n, rng)
            w = [[x, x] for x in inst.comm]
            knapsack._cp_sat = counting
            ex = knapsack.solve(inst.comm, w, inst.capacities)
            knapsack._cp_sat = real_cp_sat
            used_cp_sat += cp_sat_calls[0] > 0
            cp_sat_calls[0] = 0
            gr = knapsack.solve(inst.comm, w, inst.capacities, method="greedy")
            ref = knapsack.solve(inst.comm, w, inst.capacities, relative_gap=0.0, work_limit=ref_work)
            best = max(ref.value, ex.value)
            upper = best if ref.optimal else min(ref.bound, ex.bound)
            ref_proven += ref.optimal
            t_ref.append(ref.solve_s)
            proven += ex.optimal
            t_exact.append(ex.solve_s)
            t_greedy.append(gr.solve_s)
            gaps_exact.append(ex.gap)
            greedy_gap.append((upper - gr.value) / upper)
            fits.append(ex.value / math.fsum(inst.comm))
        rows.append({
            "n": n,
            "median_ms": 1e3 * statistics.median(t_exact),
            "p90_ms": 1e3 * pct(t_exact, 0.9),
            "max_ms": 1e3 * max(t_exact),
            "greedy_median_ms": 1e3 * statistics.median(t_greedy),
            "proven": proven / n_inst,
            "cp_sat": used_cp_sat / n_inst,
            "exact_gap_mean": statistics.fmean(gaps_exact),
            "exact_gap_max": max(gaps_exact),
            "greedy_gap_mean": statistics.fmean(greedy_gap),
            "greedy_gap_max": max(greedy_gap),
            "ref_proven": ref_proven / n_inst,
            "ref_median_ms": 1e3 * statistics.median(t_ref),
            "packed_share": statistics.fmean(fits),
        })
    return rows


def _primary_first(v: list[float], w: list[list[float]], c: list[float]) -> float:
    """The greedy with knapsacks in index order (the primary link first): the value it packs."""
    packed = [False] * len(v)
    total = 0.0
    for j in range(len(c)):
        room = c[j]
        for i in sorted(range(len(v)), key=lambda i: (-v[i], i)):
            if not packed[i] and w[i][j] <= room:
                packed[i], room, total = True, room - w[i][j], total + v[i]
    return total


def greedy_orders(seed: int, n_inst: int = 2000) -> str:
    """The paper's greedy order against primary-first on the planner's per-link-weight model."""
    rng = random.Random(seed)
    paper_better = primary_better = 0
    rel: list[float] = []
    for _ in range(n_inst):
        n = rng.randint(3, 12)
        v = [rng.uniform(0.5, 20.0) for _ in range(n)]
        w = [[x, MU * x] for x in v]
        cap = rng.uniform(0.2, 0.6) * math.fsum(v)
        paper = knapsack.solve(v, w, [cap, cap], method="greedy").value
        first = _primary_first(v, w, [cap, cap])
        paper_better += paper > first * (1 + 1e-12)
        primary_better += first > paper * (1 + 1e-12)
        rel.append((paper - first) / max(paper, first, 1e-30))
    return (
        f"\n| greedy order ({n_inst} instances, weights [x, {MU} x], equal capacities) | paper packs more "
        f"| primary-first packs more | equal | mean (paper - primary-first) / best |\n|---|---|---|---|---|\n"
        f"| paper (smaller knapsack in primary units first) vs primary link first | {paper_better} "
        f"| {primary_better} | {n_inst - paper_better - primary_better} | {100 * statistics.fmean(rel):+.3f} % |\n"
    )


def markdown(rows: list[dict[str, object]], args: argparse.Namespace, wall: float) -> str:
    head = (
        "| items x knapsacks | exact median | exact p90 | exact max | exact needed CP-SAT | exact proven optimal "
        "| exact certified gap mean / max | greedy median | greedy gap mean / max | reference proven optimal "
        "| reference median | packed share |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['n']} x 2 | {r['median_ms']:.1f} ms | {r['p90_ms']:.1f} ms | {r['max_ms']:.1f} ms "
        f"| {100 * r['cp_sat']:.0f} % | {100 * r['proven']:.0f} % "
        f"| {100 * r['exact_gap_mean']:.3f} % / {100 * r['exact_gap_max']:.3f} % "
        f"| {r['greedy_median_ms']:.2f} ms | {100 * r['greedy_gap_mean']:.3f} % / {100 * r['greedy_gap_max']:.3f} % "
        f"| {100 * r['ref_proven']:.0f} % | {r['ref_median_ms']:.0f} ms | {100 * r['packed_share']:.0f} % |\n"
        for r in rows
    )
    cmd = " ".join(["benchmarks/bench_knapsack.py", *sys.argv[1:]])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"Command: `.venv/bin/python {cmd}` ({args.instances} instances per size, seed {args.seed}, "
        f"reference work limit {args.ref_work}, {knapsack._NUM_WORKERS} CP-SAT worker(s), "
        f"Python {platform.python_version()}, {os.cpu_count()} cores, load average {load:.1f} at the end, "
        f"total {wall:.0f} s)\n\n" + head + body
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--instances", type=int, default=20)
    p.add_argument("--ref-work", type=float, default=0.5,
                   help="CP-SAT deterministic work units for the gap-0 reference solve")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="override CP-SAT's worker count (tuning)")
    args = p.parse_args()
    if args.workers is not None:
        knapsack._NUM_WORKERS = args.workers
    t0 = time.perf_counter()
    rows = run(args.sizes, args.instances, args.ref_work, args.seed)
    print(markdown(rows, args, time.perf_counter() - t0))
    print(greedy_orders(args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
