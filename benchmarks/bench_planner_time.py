"""How long the lag-free planner takes, and on how many pieces; prints markdown.

    .venv/bin/python benchmarks/bench_planner_time.py [--search-window WARMUP,ITERATIONS] [--repeats N]
    .venv/bin/python benchmarks/bench_planner_time.py --preserver [--repeats N]
    .venv/bin/python benchmarks/bench_planner_time.py --stop-check
    .venv/bin/python benchmarks/bench_planner_time.py --reference-preserver
    .venv/bin/python benchmarks/bench_planner_time.py --window
    .venv/bin/python benchmarks/bench_planner_time.py --search-budget

For every reference profile in ``examples/profiles`` and every profile in
``benchmarks/profiles/compat_mlp_loopback`` (the compat suite's MLP, 30 KB of gradient in 9 buckets,
profiled by deft on loopback in ten runs of ``tests/compat/test_loops.py``'s "measured" mode, saved with
``DEFT_PROFILE_OUT``): the buckets of the no-delay plan's partition (the forward-set candidates the
lag-free plan simulates), the wall time of :func:`deft.solver.lagfree.lagfree_plan` (median of
``--repeats``, on one core of a 2-core machine), its predicted iteration and the plan's mode.

``--preserver``: instead, the whole plan of a run with the preserver (``make_schedule`` at the
default ``epsilon`` 0.01) on ``benchmarks/profiles/testbed_runs``: 30 profiles deft measured on the
two-link testbed (digits CNN at 50, 250 and 1000 Mbit/s) with the walk statistics of the same runs,
taken from ``bench_peers.py --save-runs`` output (each file says which run); its time, its prediction
and how many plans the preserver tried.

``--stop-check``: whether a preserver try after the first one that delays and merges nothing and is no
faster than the no-delay plan was ever accepted (the loop stops at that try; run on a tree without the
stop, with ``PYTHONPATH``, to see what the stop gives up): the testbed runs' profiles
with their statistics and the reference profiles with ``bench_simulate.PIPELINE_STATS``, each at
epsilon 0.01, 0.05 and 0.5.

``--reference-preserver``: the whole plan (``make_schedule``) of each reference profile with each of
``bench_simulate.PIPELINE_STATS``' walk statistics at epsilon 0.01 and 0.05: its time, K and tries.

``--window``: rank 0's first decision on the profiles in ``benchmarks/profiles/lm_runs`` (the GPT-2's
profiles from ``bench_peers.py --save-runs``, coded as that run's plan coded them, with its walk
statistics) and on the reference profiles with ``bench_simulate.PIPELINE_STATS``, made in the iteration
(the config's CP-SAT budget) and in the background with ``plan_lag_iters`` iterations of window
(``ExactBudget.for_window``): its time, the CP-SAT work its tries spent, K and the predicted iteration.

``--search-budget``: the lag-free plan (epsilon 0) with the whole search and within the search budget of
a background decision (``SearchBudget.for_window``) at ``plan_lag_iters`` 2 and the default 6, on every
profile above, the testbed runs', the GPT-2 runs' and ``benchmarks/profiles/adapt_runs`` (the profile
tests/test_faults_netns.py's run planned its first plan on, saved by its worker: a 0.6 M-parameter MLP
on two 100 Mbit/s links), the last also with its second link 5x slower (what that run re-plans on):
its time, the work it spent (in simulations of the no-delay plan's partition) and its predicted
iteration against the whole search's.

``--search-window`` sets the local search's simulation length (``SEARCH_WARMUP``,
``SEARCH_ITERATIONS``) for the comparison of windows at the same code; run with ``PYTHONPATH`` on
another tree to time another commit's planner on the same profiles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import deft
import deft.solver.lagfree as lagfree
from deft.config import DeftConfig
from deft.preserver.feedback import WalkStats
from deft.preserver.stability import OptimizerSpec
from deft.profile import Profile
from deft.runtime.planning import make_schedule
from deft.solver import knapsack
from deft.solver.partition import profile_for_schedule
from deft.solver.plan import ExactBudget, no_delay_plan

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "examples" / "profiles", ROOT / "benchmarks" / "profiles" / "compat_mlp_loopback")
TESTBED_RUNS = ROOT / "benchmarks" / "profiles" / "testbed_runs"
LM_RUNS = ROOT / "benchmarks" / "profiles" / "lm_runs"
ADAPT_RUNS = ROOT / "benchmarks" / "profiles" / "adapt_runs"


def walk_stats(doc: dict[str, Any]) -> WalkStats:
    """A run's ``plan_info["stats"]`` (``WalkStats.to_dict``) as the planner got them. Read here, not by
    a library function, so that this script also times older trees (``PYTHONPATH``) that lack one."""
    opt = doc.get("optimizer")
    return WalkStats(loss=doc["loss"], mu=doc["mu"], sigma=doc["sigma"], lr=doc["lr"], batch=doc["batch"],
                     s_star=doc.get("s_star", 0.0), curvature=doc.get("curvature"),
                     optimizer=OptimizerSpec(**opt) if opt else None, metric=doc.get("metric", "euclidean"))


def stop_check() -> None:
    from bench_simulate import PIPELINE_STATS  # benchmarks/ is this script's directory

    from deft.preserver.feedback import NO_FASTER, preserve
    from deft.solver.lagfree import lagfree_plan
    from deft.solver.plan import plan

    cases = [(path.stem, Profile.from_dict(doc["profile"], str(path)), walk_stats(doc["stats"]))
             for path in sorted(TESTBED_RUNS.glob("*.json")) for doc in [json.loads(path.read_text())]]
    cases += [(f"{path.stem} (mu {st.mu:g})", Profile.load(path), st)
              for path in sorted(SOURCES[0].glob("*.json")) for st in PIPELINE_STATS if st is not None]
    print("| profile | epsilon | DeFT tries | first that delays nothing, no faster | a later one accepted | chosen K |")
    print("|---|---|---|---|---|---|")
    runs = later = skipped = 0
    for name, prof, stats in cases:
        for eps in (0.01, 0.05, 0.5):
            res = preserve(prof, DeftConfig(epsilon=eps), stats, planner=plan, no_delay_planner=lagfree_plan)
            tried = [t for t in res.tries if t.kind == "deft"]
            # feedback._delays_nothing, written out: this check runs on trees from before it existed
            first = next((i for i, t in enumerate(tried) if t.rejected_on == NO_FASTER and t.schedule is not None
                          and all(k == 1 for k in t.schedule.batch_sequence)
                          and all(u.apply_after == u.last and u.apply_after < t.schedule.cycle
                                  for u in t.schedule.updates)), None)
            accepted = first is not None and any(t.accepted for t in tried[first + 1:])
            runs, later = runs + 1, later + accepted
            skipped += 0 if first is None else len(tried) - first - 1
            print(f"| {name} | {eps:g} | {len(tried)} | {'-' if first is None else first + 1} | "
                  f"{'**yes**' if accepted else 'no'} | {list(res.schedule.batch_sequence)} |", flush=True)
    print(f"\n{runs} preserver runs; a try after the stop accepted in {later}; tries after the stop: {skipped}")


def reference_preserver_table() -> None:
    from bench_simulate import PIPELINE_STATS  # benchmarks/ is this script's directory

    print("| profile | walk mu | epsilon | plan time (s) | K | predicted iteration (ms) | plans tried |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(SOURCES[0].glob("*.json")):
        prof = Profile.load(path)
        for stats in (st for st in PIPELINE_STATS if st is not None):
            for eps in (0.01, 0.05):
                t0 = time.perf_counter()
                d = make_schedule(DeftConfig(epsilon=eps), prof, stats, None)
                print(f"| {path.stem} | {stats.mu:g} | {eps:g} | {time.perf_counter() - t0:.2f} | "
                      f"{list(d.schedule.batch_sequence)} | {d.schedule.predicted_iteration_s * 1e3:.3f} | "
                      f"{d.info.get('tries')} |", flush=True)


def preserver_table(repeats: int) -> None:
    cfg = DeftConfig(epsilon=0.01)
    print("| run | buckets | plan time (s) | predicted iteration (ms) | plans tried | source |")
    print("|---|---|---|---|---|---|")
    total = 0.0
    for path in sorted(TESTBED_RUNS.glob("*.json")):
        doc = json.loads(path.read_text())
        prof, stats = Profile.from_dict(doc["profile"], str(path)), walk_stats(doc["stats"])
        times, decision = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            decision = make_schedule(cfg, prof, stats, None)
            times.append(time.perf_counter() - t0)
        assert decision is not None
        total += statistics.median(times)
        print(f"| {path.stem} | {prof.n} | {statistics.median(times):.2f} | "
              f"{decision.schedule.predicted_iteration_s * 1e3:.3f} | {decision.info.get('tries')} | "
              f"{decision.info.get('source')} |", flush=True)
    print(f"\nTotal plan time: {total:.2f} s")


def window_table(repeats: int) -> None:
    from bench_simulate import PIPELINE_STATS  # benchmarks/ is this script's directory

    cases = [(path.stem, Profile.from_dict(doc["profile"], str(path)), walk_stats(doc["stats"]))
             for path in sorted(LM_RUNS.glob("*.json")) for doc in [json.loads(path.read_text())]]
    cases += [(f"{path.stem} (mu {st.mu:g})", Profile.load(path), st)
              for path in sorted(SOURCES[0].glob("*.json")) for st in PIPELINE_STATS if st is not None]
    cfg = DeftConfig()
    print("| profile | decision | CP-SAT budget (units) | plan time (s) | CP-SAT work spent (units) | K | "
          "predicted iteration (ms) | plans tried |")
    print("|---|---|---|---|---|---|---|---|")
    for name, prof, stats in cases:
        window_s = cfg.plan_lag_iters * no_delay_plan(prof, cfg).predicted_iteration_s
        for lag, what in ((0, "in the iteration"), (cfg.plan_lag_iters, f"background, {window_s:.1f} s window")):
            units = (ExactBudget.for_window(cfg, window_s) if lag else ExactBudget.for_config(cfg)).units
            times, decision = [], None
            for _ in range(repeats):
                t0 = time.perf_counter()
                decision = make_schedule(cfg, prof, stats, None, lag_iters=lag)
                times.append(time.perf_counter() - t0)
            assert decision is not None and decision.preserved is not None
            work = sum(t.schedule.meta.get("solver_work", 0.0) for t in decision.preserved.tries
                       if t.kind == "deft" and t.schedule is not None)
            print(f"| {name} | {what} | {units:.2f} | {statistics.median(times):.2f} | {work:.2f} | "
                  f"{list(decision.schedule.batch_sequence)} | {decision.schedule.predicted_iteration_s * 1e3:.1f} | "
                  f"{decision.info.get('tries')} |", flush=True)


def search_budget_table() -> None:
    from deft.runtime.link_timing import scale_links
    from deft.solver.lagfree import SIM_ITERATIONS, SearchBudget, lagfree_plan

    cases = [(f"{folder.name}/{path.stem}", Profile.load(path)) for folder in (*SOURCES, ADAPT_RUNS)
             for path in sorted(folder.glob("*.json"))]
    cases += [(f"{folder.name}/{path.stem}", Profile.from_dict(json.loads(path.read_text())["profile"], str(path)))
              for folder in (TESTBED_RUNS, LM_RUNS) for path in sorted(folder.glob("*.json"))]
    cases += [(f"{name}, second link x5", scale_links(prof, {"second": 5.0}))
              for name, prof in list(cases) if name.startswith(ADAPT_RUNS.name)]
    cfg = DeftConfig(epsilon=0.0)
    print("| profile | pieces | whole search: time (s), predicted (ms) | lag 2: window (s), time (s), "
          "simulations, predicted / whole | lag 6: window (s), time (s), simulations, predicted / whole |")
    print("|---|---|---|---|---|")
    totals = [0.0, 0.0, 0.0]
    worst = 1.0
    for name, prof in cases:
        nd = no_delay_plan(prof, cfg)
        pieces = profile_for_schedule(prof, nd, cfg).n
        cells = []
        whole_s = 0.0
        for i, lag in enumerate((0, 2, 6)):
            window_s = lag * nd.predicted_iteration_s
            budget = SearchBudget.for_window(window_s) if lag else None
            t0 = time.perf_counter()
            sched = lagfree_plan(prof, cfg, budget=budget)
            took = time.perf_counter() - t0
            totals[i] += took
            if budget is None:
                whole_s = sched.predicted_iteration_s
                cells.append(f"{took:.2f}, {whole_s * 1e3:.2f}")
            else:
                ratio = sched.predicted_iteration_s / whole_s
                worst = max(worst, ratio)
                sims = budget.spent / (SIM_ITERATIONS * pieces)  # in simulations of the no-delay partition
                cells.append(f"{window_s:.2f}, {took:.2f}, {sims:.0f}, {ratio:.4f}")
        print(f"| {name} | {pieces} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nTotal time: whole search {totals[0]:.1f} s, lag 2 {totals[1]:.1f} s, lag 6 {totals[2]:.1f} s; "
          f"worst predicted iteration against the whole search's: {worst:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--search-window", default=None, metavar="WARMUP,ITERATIONS",
                    help="the local search's simulation length (default: the code's own)")
    ap.add_argument("--repeats", type=int, default=1, help="plans per profile; the median time is printed")
    ap.add_argument("--preserver", action="store_true",
                    help="time the whole plan with the preserver on the testbed runs' profiles instead")
    ap.add_argument("--reference-preserver", action="store_true",
                    help="time the whole plan of the reference profiles with bench_simulate's walk statistics")
    ap.add_argument("--stop-check", action="store_true",
                    help="whether a preserver try after the stop's condition was ever accepted")
    ap.add_argument("--window", action="store_true",
                    help="the GPT-2 runs' first decision in the iteration and in the background's window")
    ap.add_argument("--search-budget", action="store_true",
                    help="the lag-free plan with the whole search and within a background decision's budget")
    args = ap.parse_args()
    if args.search_budget:
        print(f"deft from {Path(deft.__file__).parent}\n")
        search_budget_table()
        return
    if args.window:
        knapsack.load_cp_sat()
        print(f"deft from {Path(deft.__file__).parent}; {args.repeats} plan(s) per row\n")
        window_table(args.repeats)
        return
    if args.reference_preserver:
        knapsack.load_cp_sat()
        print(f"deft from {Path(deft.__file__).parent}\n")
        reference_preserver_table()
        return
    if args.stop_check:
        knapsack.load_cp_sat()
        print(f"deft from {Path(deft.__file__).parent}\n")
        stop_check()
        return
    if args.search_window is not None:
        warmup, iterations = (int(x) for x in args.search_window.split(","))
        lagfree.SEARCH_WARMUP, lagfree.SEARCH_ITERATIONS = warmup, iterations
    if args.preserver:
        knapsack.load_cp_sat()  # its import (0.3-0.4 s) is not planning
        print(f"deft from {Path(deft.__file__).parent}; make_schedule at epsilon 0.01; {args.repeats} plan(s) "
              "per profile\n")
        preserver_table(args.repeats)
        return
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
