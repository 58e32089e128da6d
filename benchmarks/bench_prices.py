"""Plans' prices against their measurements, from deft runs that bench_peers.py saved.

Issue 44's bar: every plan's predicted iteration within 15 % of what it measured. This script trains
nothing; it reads the records ``bench_peers.py --schemes deft --save-runs DIR`` keeps and lists, for each
run, the world it ran in, the links' contention and drag its profile measured (``deft.profile.Link``),
every plan it ran with its prediction and the adaptation window that measured it
(:func:`bench_peers.plan_prices`), and the run's steady iteration. Runs of two code versions on the same
machine, labelled, stand side by side:

    .venv/bin/python benchmarks/bench_prices.py --runs 'before=DIR1,DIR2' --runs 'after=DIR3,DIR4' \\
        --results benchmarks/results/prices.md --note '...'
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_peers as peers  # noqa: E402  (a sibling script, not a package)
from bench_seeds import write_fragment  # noqa: E402

#: The hand-written part of a results file, kept when the table is written again.
READING = "### Reading the prices (written by hand)"

TOLERANCE = peers.PREDICTION_TOLERANCE


def load(run_dir: Path) -> list[dict[str, Any]]:
    """The deft records of one ``--save-runs`` directory (one per run; a host's own copy left out)."""
    docs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(run_dir.glob("*.r*.json"))
            if ".host" not in p.name]
    deft = [d for d in docs if d["summary"].get("ddp") == "deft"]
    if not deft:
        raise SystemExit(f"bench_prices.py: {run_dir}: no deft run recorded there (expected bench_peers.py "
                         "--save-runs records of scheme deft)")
    return deft


def workload(doc: dict[str, Any]) -> str:
    return "GPT-2" if "final_val_loss" in doc["summary"] else "CNN"


def first_window(doc: dict[str, Any]) -> str:
    """Where the first adaptation window's time went against the profile (``forward_vs_profile``,
    ``backward_vs_profile``, ``links_vs_profile`` of its record): "forward x F; backward x G; link x L, ...",
    each link's on the rank whose sends waited longest for the others beside it where recorded
    (``links_slowest_vs_profile``: "link x L (slowest rank x M)"),
    and where the adaptation calibrated the profile to that window (``compute_factor``, ``comm_factor``),
    what the simulator needed to reproduce it: "...; simulated as measured at compute x C, links x K" (links
    timed as priced but needed slower: the window lost time between their sends); "-" where the run did
    not record them."""
    records = ((doc["summary"].get("schedule") or {}).get("plan_info") or {}).get("adapt") or []
    first = records[0] if records and isinstance(records[0], dict) else {}
    parts = []
    if isinstance(first.get("forward_vs_profile"), (int, float)):
        parts.append(f"forward x {first['forward_vs_profile']:.2f}")
    if isinstance(first.get("backward_vs_profile"), (int, float)):
        parts.append(f"backward x {first['backward_vs_profile']:.2f}")
    links, slowest = first.get("links_vs_profile"), first.get("links_slowest_vs_profile")
    if isinstance(links, dict) and links:
        worst = slowest if isinstance(slowest, dict) else {}
        parts.append(", ".join(f"{k} x {v:.2f}" + (f" (slowest rank x {worst[k]:.2f})" if k in worst else "")
                               for k, v in links.items()))
    if isinstance(first.get("compute_factor"), (int, float)) and isinstance(first.get("comm_factor"), (int, float)):
        parts.append(f"simulated as measured at compute x {first['compute_factor']:.2f}, "
                     f"links x {first['comm_factor']:.2f}")
    return "; ".join(parts) or "-"


def warmup_priced(doc: dict[str, Any]) -> str:
    """Where the run went back to the warm-up's synchronous schedule (its last switch, to the warm-up's
    layout): that schedule, as saved, simulated on the saved profile (then the measured one priced as
    that schedule sends, uncorrected), against the time it was measured at (the decision's
    ``synchronous_s``): "simulated / measured". "-" for any other run: its saved profile is a corrected
    one, or in a plan's buckets."""
    from deft.errors import DeftError
    from deft.profile import Profile
    from deft.schedule import Schedule
    from deft.solver.simulate import simulate_schedule

    sched = doc["summary"].get("schedule") or {}
    info = sched.get("plan_info") or {}
    switches = info.get("switches") or []
    back = [r for r in info.get("adapt") or [] if isinstance(r, dict) and isinstance(r.get("synchronous_s"), float)
            and "synchronous schedule" in str(r.get("decision", ""))]
    if not switches or switches[-1].get("layout") != "warm-up" or not back or not sched.get("profile"):
        return "-"
    try:
        simulated = simulate_schedule(Profile.from_dict(sched["profile"], "the run's saved profile"),
                                      Schedule.from_dict(sched["schedule"], "the run's saved schedule")).iteration_s
    except DeftError:
        return "-"
    measured = back[-1]["synchronous_s"]
    return f"{simulated * 1e3:.0f} / {measured * 1e3:.0f} ({measured / simulated:.2f}x)"


#: The decisions that calibrate and settle without correcting the running profile, as the records of
#: runs from before ``profile_corrected`` was recorded word them (``deft.runtime.adapt``).
UNCORRECTED_SETTLES = ("no calibration reproduces", "faster than profiled: settled",
                       "while the window timed them at")


def corrected_by(record: dict[str, Any]) -> bool:
    """Whether an adaptation record's calibration became the running profile: its ``profile_corrected``
    where recorded; in older records, a calibration (``compute_factor``, ``comm_factor``) whose decision
    is not one of :data:`UNCORRECTED_SETTLES`."""
    if "profile_corrected" in record:
        return record["profile_corrected"] is True
    calibrated = isinstance(record.get("compute_factor"), float) and isinstance(record.get("comm_factor"), float)
    return calibrated and not any(w in str(record.get("decision", "")) for w in UNCORRECTED_SETTLES)


def first_plan(doc: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]] | None:
    """The run's first plan as it was priced: ``(schedule, profile, record)``, the profile the plan was made
    on cut into the plan's pieces and the first adaptation window's record. Only where the saved schedule
    is the first plan (the first record's) and the saved profile is the first plan's, uncorrected or
    corrected once by that record's factors (undone here); None for any other run."""
    from deft.config import DeftConfig
    from deft.errors import DeftError
    from deft.profile import Profile
    from deft.schedule import Schedule
    from deft.solver.partition import profile_for_schedule

    sched = doc["summary"].get("schedule") or {}
    saved_config = doc["summary"].get("config")
    records = [r for r in (sched.get("plan_info") or {}).get("adapt") or [] if isinstance(r, dict)]
    if not records or not sched.get("schedule") or not sched.get("profile"):
        return None
    first = records[0]
    try:
        schedule = Schedule.from_dict(sched["schedule"], "the run's saved schedule")
        profile = Profile.from_dict(sched["profile"], "the run's saved profile")
        if schedule.digest() != first.get("schedule"):
            return None
        if any(corrected_by(r) for r in records[1:]):
            return None  # corrected since: the first plan's profile is not recoverable
        if corrected_by(first):
            if len(records) > 1:
                return None  # a later window may have gone back to another corrected profile
            profile = profile.scaled(1 / first["compute_factor"], 1 / first["comm_factor"])
        config = DeftConfig.load(saved_config) if isinstance(saved_config, str) and Path(saved_config).is_file() \
            else DeftConfig()
        return schedule, profile_for_schedule(profile, schedule, config), first  # the plan's pieces
    except DeftError:
        return None


def lag_priced(doc: dict[str, Any]) -> str:
    """The run's first plan (:func:`first_plan`) priced with the last rank's lag, simulated on the profile
    the plan was made on against the first window's measurement: "simulated / measured (error)". Where the
    run's deft priced it (the profile's links carry ``lag_s``, ``DeftConfig.rank_wait``), that price, and
    the same plan simulated without it ("; without it N"); where it did not, each link's ``lag_s`` set to
    its sends' mean lag (``meta["rank_lag_s"]``) as deft would. "-" for a run whose first plan is not
    recoverable or that recorded no lag."""
    from deft.errors import DeftError
    from deft.solver.simulate import simulate_schedule

    lags = (((doc["summary"].get("schedule") or {}).get("profile") or {}).get("meta") or {}).get("rank_lag_s")
    found = first_plan(doc) if lags else None
    if found is None:
        return "-"
    schedule, profile, first = found
    if set(lags) != set(schedule.links):
        return "-"
    priced = any(lk.lag_s > 0 for lk in profile.links)

    def lagging(lag: Any) -> Any:
        return replace(profile, links=tuple(replace(lk, lag_s=lag(lk)) for lk in profile.links))

    try:
        simulated = simulate_schedule(profile if priced else lagging(
            lambda lk: lags[lk.name]["mean"] if lk.name in lags else 0.0), schedule).iteration_s
        without = simulate_schedule(lagging(lambda lk: 0.0), schedule).iteration_s if priced else None
    except DeftError:
        return "-"
    measured = float(first["measured_s"])
    out = f"{simulated * 1e3:.0f} / {measured * 1e3:.0f} ({simulated / measured - 1:+.1%})"
    return out if without is None else f"{out}; without it {without * 1e3:.0f}"


def sends_against_plan(doc: dict[str, Any]) -> str:
    """Where the first window's sends ended against the first plan simulated (:func:`first_plan`): each
    bucket's median end after its iteration's forward began (``sends_timed`` of the first record, rank
    0's) less the same send's end in a steady simulated iteration, "median +M (A to B), N sends" in ms
    (positive: later than simulated); "-" where not recorded, the first plan is not recoverable, or its
    cycle is longer than one iteration (which iteration of the cycle a send fell in is not recorded)."""
    import bisect

    from deft.errors import DeftError
    from deft.solver.simulate import simulate_schedule

    found = first_plan(doc)
    if found is None:
        return "-"
    schedule, profile, first = found
    timed = first.get("sends_timed")
    if not isinstance(timed, dict) or not timed or schedule.cycle != 1:
        return "-"
    try:
        result = simulate_schedule(profile, schedule)
    except DeftError:
        return "-"
    starts = result.iteration_starts
    i = bisect.bisect_left(starts, result.window[0])
    ends = {(e.row, e.bucket): e.end_s - starts[i] for e in result.events
            if e.kind == "comm" and e.stage_iteration == i}
    late = sorted(float(times[2]) - ends[(link, int(b))] * 1e3 for link, per in timed.items()
                  for b, times in per.items() if (link, int(b)) in ends)
    if not late:
        return "-"
    return (f"{statistics.median(late):+.0f} ({late[0]:+.0f} to {late[-1]:+.0f}), "
            f"{len(late)} send{'s' if len(late) > 1 else ''}")


def drift_priced(doc: dict[str, Any]) -> str:
    """The compute's drift deft read between its profile and lag iterations (``plan_info.compute_drift``):
    the factor, and where it was applied the first plan's price before and after it; "-" where none was
    read (no background plan, too few lag iterations, or a run before it was recorded)."""
    found = (((doc["summary"].get("schedule") or {}).get("plan_info") or {}).get("compute_drift")) or {}
    if not isinstance(found.get("factor"), (int, float)):
        return "-"
    if not found.get("applied"):
        return f"x {found['factor']:.2f} (within the tolerance)"
    before = found.get("predicted_before_s")
    priced = f": first plan {before * 1e3:.0f} ms before it" if isinstance(before, (int, float)) else ""
    return f"x {found['factor']:.2f} (applied{priced})"


def ranks_forward(doc: dict[str, Any], where: Path) -> str:
    """The fastest and the slowest rank's forward in the profile iterations (``meta.rank_compute_s``), each
    the median over the iterations (ms); "-" where the profile did not record it. A record whose ranks
    timed different numbers of iterations is named (``where``), not read."""
    meta = (((doc["summary"].get("schedule") or {}).get("profile") or {}).get("meta") or {})
    forward = (meta.get("rank_compute_s") or {}).get("forward") or []
    if not forward or not forward[0]:
        return "-"
    if len({len(rank) for rank in forward}) != 1:
        raise SystemExit(f"bench_prices.py: {where}: profile.meta.rank_compute_s.forward: expected every rank's "
                         f"forwards over the same profile iterations, got {[len(rank) for rank in forward]} per rank")
    per_iteration = list(zip(*forward, strict=True))
    fastest = statistics.median(min(it) for it in per_iteration)
    slowest = statistics.median(max(it) for it in per_iteration)
    return f"{fastest * 1e3:.0f} / {slowest * 1e3:.0f}"


def row(label: str, run_dir: Path, doc: dict[str, Any]) -> str:
    s = doc["summary"]
    layout = peers.Layout.of(s)
    links = ((s.get("schedule") or {}).get("profile") or {}).get("links") or []
    rho = sorted({float(lk.get("contention", 0.0)) for lk in links})
    drag = sorted({float(lk.get("drag", 0.0)) for lk in links})
    lags = (((s.get("schedule") or {}).get("profile") or {}).get("meta") or {}).get("rank_lag_s") or {}
    lag_s = ", ".join(f"{v['mean'] * 1e3:.0f}" for v in lags.values()) or "-"
    prices = peers.plan_prices(doc)
    plans = "; ".join(f"{p.predicted_s * 1e3:.0f} / {p.measured_s * 1e3:.0f} ({p.error:+.1%})" for p in prices)
    first = f"{prices[0].error:+.1%}" if prices else "-"
    worst = max((abs(p.error) for p in prices), default=float("nan"))
    held = "yes" if worst <= TOLERANCE else "no"
    return (f"| {label} | {workload(doc)} | {s['rate_mbit']:g} | {layout.words()} | "
            f"{', '.join(f'{r:.2f}' for r in rho) or '-'} | {', '.join(f'{d:.2f}' for d in drag) or '-'} | "
            f"{plans or '-'} | {first} | {first_window(doc)} | "
            f"{warmup_priced(doc)} | {lag_s} | {lag_priced(doc)} | {sends_against_plan(doc)} | {drift_priced(doc)} | "
            f"{ranks_forward(doc, run_dir)} | {held} | "
            f"{s['iter_s_mean'] * 1e3:.0f} | `{run_dir.name}` |")


#: The table's heading unless ``--title`` names what this set of runs compares.
TITLE = "Plans' prices against their measurements"


def report(groups: list[tuple[str, list[Path]]], note: str, command: str, title: str = TITLE) -> str:
    lines = [f"## {title} (`benchmarks/bench_prices.py`)", "",
             f"Command: `{command}`  ",
             f"Runs: {note}  ",
             "Each run: deft's default (`bench_peers.py --schemes deft --save-runs DIR`); the machine's 2 cores "
             "shared by every rank's computation and every link's gloo threads. Contention: the slowdown per "
             "busy link the profile measured (absent: 0); drag: the links' sends slowed by the compute beside "
             "them, as the profile fitted it (absent: 0). Plans: each plan's prediction / the adaptation "
             "window that measured it (ms; the last one's against the run's steady iteration where no "
             f"window measured it). First window against the profile: its forward, backward and each link's busy time "
             "over the profile's prices of them (1: as priced; `-`: not recorded), and where the adaptation "
             "calibrated the profile to it, the compute and links factors with which the simulator reproduces "
             "it (links needed slower than timed: time lost between their sends). Warm-up schedule: where the "
             "run went back to the warm-up's synchronous schedule, that schedule simulated on the run's saved "
             "(uncorrected) profile / as it was measured (`-`: the run did not go back to it). Last rank's lag: per "
             "link, the mean over the profile iterations' sends of how long after the paced rank (the one with "
             "the most compute) the last rank launched each (`meta.rank_lag_s`, ms; `-`: not recorded). With "
             "the lag: the first plan simulated with each link's sends starting no earlier than that lag after "
             "their hand-over (as deft prices it, `deft.profile.Link.lag_s`) / its first window; where the "
             "run's deft priced it (`DeftConfig.rank_wait`), also the same plan without it; `-`: no lag "
             "recorded, or the first plan's profile not recoverable from the run. Sends against the plan: "
             "where the first window's sends ended (rank 0's, each bucket's median, after its iteration's "
             "forward began) less where the first plan simulated ends them, median (range) in ms; `-`: not "
             "recorded, the plan not recoverable or its cycle longer than one iteration. Compute drift: the lag "
             "iterations' compute over the "
             "profile iterations' (`plan_info.compute_drift`, the slowest rank's, medians; applied beyond "
             "`adapt_tolerance`: the first plan priced on the profile's compute times it, its price before "
             "given); `-`: none read. Ranks' forward: the fastest and the slowest rank's forward in each profile "
             "iteration, medians over the iterations (`meta.rank_compute_s`, ms; `-`: not recorded). Within "
             f"{TOLERANCE:.0%}: every plan of the run.", "",
             "| code | model | Mbit/s | layout | contention | drag | plans: predicted / measured (ms) | first plan | "
             f"first window against the profile | warm-up schedule: simulated / measured (ms) | "
             "last rank's lag (ms) | first plan with the lag: simulated / measured (ms) | "
             "first window's sends against the plan: ended after it (ms) | compute drift | "
             "ranks' forward: fastest / slowest (ms) | "
             "within "
             f"{TOLERANCE:.0%} | steady iteration (ms) | runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, dirs in groups:
        for d in dirs:
            lines += [row(label, d, doc) for doc in load(d)]
    return "\n".join(lines) + "\n"


def parse_groups(specs: list[str]) -> list[tuple[str, list[Path]]]:
    out = []
    for spec in specs:
        label, sep, dirs = spec.partition("=")
        if not sep or not label or not dirs:
            raise SystemExit(f"bench_prices.py: --runs {spec!r}: expected LABEL=DIR[,DIR...]")
        paths = [Path(p) for p in dirs.split(",") if p]
        missing = [str(p) for p in paths if not p.is_dir()]
        if missing:
            raise SystemExit(f"bench_prices.py: --runs {label}: no such directory {', '.join(missing)}")
        out.append((label, paths))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", action="append", required=True, help="LABEL=DIR[,DIR...]: deft runs of one code version")
    ap.add_argument("--results", help="write the table here (default: print it)")
    ap.add_argument("--note", default="", help="which code and how quiet the machine was")
    ap.add_argument("--title", default=TITLE, help="the table's heading (what these runs compare)")
    args = ap.parse_args(argv)
    command = "benchmarks/bench_prices.py " + " ".join(f"--runs {shlex.quote(r)}" for r in args.runs) + (
        f" --title {shlex.quote(args.title)}" if args.title != TITLE else "")
    text = report(parse_groups(args.runs), args.note, command, args.title)
    if args.results:
        write_fragment(text, Path(args.results), READING)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
