"""The first plans by layout: their links against the profile, and what a drag priced on them would give.

    .venv/bin/python benchmarks/report_drag.py DIR [DIR ...] [--drags 0.1,0.2,0.3] [--no-write]

Reads every run saved by ``bench_peers.py --save-runs DIR`` under the directories given (recursively, one
record per run: copies under a ``by/`` folder and hosts' records skipped) whose first plan and the profile
it was made on are recoverable (:func:`bench_prices.first_plan`), and prints, per layout and model, how
the first adaptation window timed the links against the profile's price of the same sends
(``links_vs_profile``, the mean over the links) and how many first plans are within 15 % of that window
as the simulator prices them on the saved profile, then with every gloo link's drag
(:class:`deft.profile.Link`: a send slowed to ``1 / (1 + d)`` of its speed while the compute runs beside
it) set to each of ``--drags``. The plans are the ones the runs made: a planner that knew the drag might
have made others, so this says whether the drag explains the error of the plans that ran, not what a
drag-aware plan would measure. Writes its section of ``benchmarks/results/prices_drag.md`` unless
``--no-write``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bench_links import command_line, report_section, saved_runs  # noqa: E402
from bench_prices import first_plan  # noqa: E402

RESULTS = HERE / "results" / "prices_drag.md"
WITHIN = 0.15
DRAGS = (0.1, 0.2, 0.3)


@dataclass(frozen=True)
class FirstPlan:
    """One run's first plan: its layout, the links' time in its first window over their price, and its
    error against that window (``simulated / measured - 1``) as priced on its saved profile and with
    each drag tried."""

    run: str
    model: str
    layout: str
    links: float | None
    errors: tuple[float, ...]  # as priced (the saved profile's own drag, 0 unless fitted), then one per drag
    at_window: float | None = None  # the error with each link priced as its first window timed it


def first_plans(dirs: Sequence[Path], drags: Sequence[float]) -> list[FirstPlan]:
    from deft.errors import DeftError
    from deft.runtime.link_timing import scale_links
    from deft.solver.simulate import simulate_schedule

    out = []
    for d in dirs:
        for path, doc in saved_runs([d]):
            summary = doc["summary"]
            found = first_plan(doc)
            if found is None:
                continue
            schedule, profile, first = found
            measured = first.get("measured_s")
            if not isinstance(measured, (int, float)) or measured <= 0:
                continue
            timed = first.get("links_vs_profile")
            timed = timed if isinstance(timed, dict) and timed else None
            errors = []
            try:
                errors.append(simulate_schedule(profile, schedule).iteration_s / measured - 1)
                for drag in drags:
                    p = replace(profile, links=tuple(replace(lk, drag=drag) if lk.backend == "gloo" else lk
                                                     for lk in profile.links))
                    errors.append(simulate_schedule(p, schedule).iteration_s / measured - 1)
                at_window = None if timed is None else \
                    simulate_schedule(scale_links(profile, timed), schedule).iteration_s / measured - 1
            except DeftError:
                continue
            links = statistics.mean(timed.values()) if timed else None
            model = "GPT-2" if summary.get("final_val_loss") is not None else "CNN"  # lm runs record a loss
            layout = f"{summary.get('hosts') or 2} x {summary.get('ranks_per_host') or 1}"
            out.append(FirstPlan(str(path.relative_to(d.parent)), model, layout, links, tuple(errors), at_window))
    return out


def report(plans: Sequence[FirstPlan], drags: Sequence[float], command: str) -> str:
    rows = []
    for model, layout in sorted({(p.model, p.layout) for p in plans}):
        part = [p for p in plans if (p.model, p.layout) == (model, layout)]
        timed = [p.links for p in part if p.links is not None]
        links = (f"{statistics.mean(timed):.2f} ({min(timed):.2f}-{max(timed):.2f})" if timed else "-")
        within = " | ".join(f"{sum(abs(p.errors[k]) <= WITHIN for p in part)}"
                            for k in range(len(drags) + 1))
        mean = f"{statistics.mean(p.errors[0] for p in part):+.1%}"
        windowed = [p.at_window for p in part if p.at_window is not None]
        at_window = f"{sum(abs(e) <= WITHIN for e in windowed)} of {len(windowed)}" if windowed else "-"
        rows.append(f"| {model} | {layout} | {len(part)} | {links} | {mean} | {within} | {at_window} |")
    heads = " | ".join(f"within 15 %, drag {d:g}" for d in drags)
    return "\n".join([
        "## The first plans' links against the profile, and a drag priced on them offline "
        "(`benchmarks/report_drag.py`)",
        "",
        f"Command: `{command}`  ",
        "Every saved run of the directories whose first plan and its profile are recoverable (the records of "
        "`bench_peers.py --save-runs`, of every scheme and code version saved there; copies under `by/` "
        "skipped). Links: the first window's busy time per link over the profile's price of the same sends "
        "(`links_vs_profile`), the mean over the links, mean (range) over the runs. Error: the first plan "
        "simulated on its saved profile / its first window - 1; then the same plan with every gloo link's "
        "drag set (sends at `1 / (1 + d)` of their speed beside the compute); last, with each link priced "
        "as the first window timed it (its times x its `links_vs_profile`: what the plan would have been "
        "priced at had the profile known it). Every run on the 2-core "
        "testbed machine, the cores shared by every rank's compute and every link's gloo threads.",
        "",
        f"| model | layout (hosts x ranks) | runs | links / price | mean error | within 15 % | {heads} | "
        "within 15 %, links at their window's price |",
        "|---|---|---|---|---|---|" + "---|" * len(drags) + "---|",
        *rows,
        "",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--drags", default=",".join(f"{d:g}" for d in DRAGS))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    try:
        drags = tuple(float(x) for x in args.drags.split(","))
    except ValueError:
        ap.error(f"--drags: expected numbers separated by commas, got {args.drags!r}")
    if any(d < 0 for d in drags):
        ap.error(f"--drags: expected drags >= 0, got {args.drags!r}")
    plans = first_plans(args.dirs, drags)
    if not plans:
        print("report_drag: no run with a recoverable first plan in " + ", ".join(map(str, args.dirs)),
              file=sys.stderr)
        return 1
    return report_section(report(plans, drags, command_line().replace("sudo ", "", 1)), "drag_offline", RESULTS,
                          not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
