"""How long the lag-free planner takes, and on how many pieces; prints markdown.

    .venv/bin/python benchmarks/bench_planner_time.py [--search-window WARMUP,ITERATIONS] [--repeats N]

For every reference profile in ``examples/profiles`` and every profile in
``benchmarks/profiles/compat_mlp_loopback`` (the compat suite's MLP, 30 KB of gradient in 9 buckets,
profiled by deft on loopback in ten runs of ``tests/compat/test_loops.py``'s "measured" mode, saved with
``DEFT_PROFILE_OUT``): the buckets of the no-delay plan's partition (the forward-set candidates the
lag-free plan simulates), the wall time of :func:`deft.solver.lagfree.lagfree_plan` (median of
``--repeats``, on one core of a 2-core machine), its predicted iteration and the plan's mode.

``--search-window`` sets the local search's simulation length (``SEARCH_WARMUP``,
``SEARCH_ITERATIONS``) for the comparison of windows at the same code; run with ``PYTHONPATH`` on
another tree to time another commit's planner on the same profiles.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import deft
import deft.solver.lagfree as lagfree
from deft.config import DeftConfig
from deft.profile import Profile
from deft.solver.partition import profile_for_schedule
from deft.solver.plan import no_delay_plan

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "examples" / "profiles", ROOT / "benchmarks" / "profiles" / "compat_mlp_loopback")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--search-window", default=None, metavar="WARMUP,ITERATIONS",
                    help="the local search's simulation length (default: the code's own)")
    ap.add_argument("--repeats", type=int, default=1, help="plans per profile; the median time is printed")
    args = ap.parse_args()
    if args.search_window is not None:
        warmup, iterations = (int(x) for x in args.search_window.split(","))
        lagfree.SEARCH_WARMUP, lagfree.SEARCH_ITERATIONS = warmup, iterations
    cfg = DeftConfig(epsilon=0.0)
    print(f"deft from {Path(deft.__file__).parent}; search window {lagfree.SEARCH_WARMUP} warm-up + "
          f"{lagfree.SEARCH_ITERATIONS} iterations; {args.repeats} plan(s) per profile\n")
    print("| profile | buckets | pieces (no-delay partition) | plan time (s) | predicted iteration (ms) | mode |")
    print("|---|---|---|---|---|---|")
    total = 0.0
    for folder in SOURCES:
        for path in sorted(folder.glob("*.json")):
            prof = Profile.load(path)
            pieces = profile_for_schedule(prof, no_delay_plan(prof, cfg), cfg).n
            times, sched = [], None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                sched = lagfree.lagfree_plan(prof, cfg)
                times.append(time.perf_counter() - t0)
            assert sched is not None
            total += statistics.median(times)
            print(f"| {folder.name}/{path.stem} | {prof.n} | {pieces} | {statistics.median(times):.2f} | "
                  f"{sched.predicted_iteration_s * 1e3:.3f} | {sched.meta.get('mode')} |", flush=True)
    print(f"\nTotal plan time: {total:.2f} s")


if __name__ == "__main__":
    main()
