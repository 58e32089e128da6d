"""The compute's drift by its sign: each first plan's error with and without the drift it was priced on.

    .venv/bin/python benchmarks/report_drift.py DIR [DIR ...] [--no-write]

Reads every run saved by ``bench_peers.py --save-runs DIR`` under the directories given (recursively,
one record per run: copies under a ``by/`` folder are skipped) whose first plan was priced on the
compute's drift (``plan_info.compute_drift.applied``) and measured by the adaptation's first window, and
prints, per run, the drift ``g`` and the first plan's error against that window as priced (with ``g``)
and as it would have been without it (``predicted_before_s``); then, per sign of ``g - 1``, how many
first plans each way are within 15 % of their window. Writes its section of
``benchmarks/results/prices_drift.md`` unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_links import command_line, report_section, saved_runs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "prices_drift.md"
WITHIN = 0.15


@dataclass(frozen=True)
class FirstPlan:
    """One run's first plan: the drift it was priced on, its error against its first window with the
    drift and without it (``predicted / measured - 1``)."""

    run: str
    model: str
    rate_mbit: float
    world: int
    g: float
    with_g: float
    without_g: float


def first_plans(dirs: list[Path]) -> list[FirstPlan]:
    out = []
    for d in dirs:
        for path, doc in saved_runs([d]):
            summary = doc["summary"]
            sched = summary.get("schedule")
            info = sched.get("plan_info") if isinstance(sched, dict) else None
            drift = (info or {}).get("compute_drift")
            windows = (info or {}).get("adapt") or []
            if not drift or not drift.get("applied") or "predicted_before_s" not in drift or not windows:
                continue
            first = windows[0]
            measured = first.get("measured_s")
            if not measured:
                continue
            model = "GPT-2" if summary.get("final_val_loss") is not None else "CNN"  # lm runs record a loss
            out.append(FirstPlan(str(path.relative_to(d.parent)), model, float(summary["rate_mbit"]),
                                 int(summary.get("world_size") or 0), float(drift["factor"]),
                                 first["predicted_s"] / measured - 1, drift["predicted_before_s"] / measured - 1))
    return out


def report(plans: list[FirstPlan], command: str) -> str:
    rows = [f"| {p.model} | {p.rate_mbit:g} | {p.world} | {p.g:.2f} | {p.with_g:+.1%} | {p.without_g:+.1%} | "
            f"`{p.run}` |" for p in sorted(plans, key=lambda p: (p.g > 1, p.model, p.g))]
    summary = []
    for name, sel in (("sped up (g < 1)", [p for p in plans if p.g < 1]),
                      ("slowed (g > 1)", [p for p in plans if p.g > 1])):
        for model in sorted({p.model for p in sel}):
            part = [p for p in sel if p.model == model]
            summary.append(
                f"| {name} | {model} | {len(part)} | {sum(abs(p.with_g) <= WITHIN for p in part)} | "
                f"{sum(abs(p.without_g) <= WITHIN for p in part)} | "
                f"{statistics.median(abs(p.with_g) for p in part):.1%} | "
                f"{statistics.median(abs(p.without_g) for p in part):.1%} |")
    return "\n".join([
        "## A slowdown is the planner's: the first plans priced with and without the drift "
        "(`benchmarks/report_drift.py`)",
        "",
        f"Command: `{command}`  ",
        "Every saved run of the directories whose first plan was priced on the compute's drift and measured "
        "by the adaptation's first window (the records of `bench_peers.py --save-runs`; copies under `by/` "
        "skipped); error: the first plan's price / its first window - 1, with the drift (as run) and without "
        "it (`compute_drift.predicted_before_s`). Every run on the 2-core testbed machine, the cores shared by "
        "every rank's compute, every link's gloo threads and rank 0's planner.",
        "",
        "| drift | model | runs | within 15 % with it | within 15 % without it | median error with it | "
        "median error without it |",
        "|---|---|---|---|---|---|---|",
        *summary,
        "",
        "| model | Mbit/s | ranks | g | error with it | error without it | run |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    plans = first_plans(args.dirs)
    if not plans:
        print("report_drift: no run priced on the compute's drift in " + ", ".join(map(str, args.dirs)),
              file=sys.stderr)
        return 1
    return report_section(report(plans, command_line().replace("sudo ", "", 1)), "drift_sign", RESULTS,
                          not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
