"""What deft's warm-up, profiling and planning cost against torch DDP on the two-link testbed.

    sudo .venv/bin/python benchmarks/bench_profiling_cost.py [--rate-mbit 250] [--iters 16] [--repeats 2]

Builds the testbed of DESIGN.md section 6 (2 hosts x 2 links, tbf-shaped at ``--rate-mbit``) and runs
``examples/train_cnn.py`` with torch DDP (nic0) and with deft (default config: epsilon 0.01, both
links), alternately, ``--repeats`` times each. deft's default config has ``W = warmup_iters`` warm-up
iterations and ``P = profile_iters`` profile iterations (``DeftConfig``'s defaults, read at import: ``WARMUP``
and ``PLAN_AT = W + P`` below; 1 + 3 since 2026-11-23, 3 + 5 before); planning runs inside the step of
iteration ``PLAN_AT``. Iteration times are ``train_cnn.py``'s (forward + backward + ``optimizer.step()``,
rank 0).

Reported, per repeat:

* ``T``: torch DDP's median iteration over iterations ``PLAN_AT + 1 .. --iters`` (the reference);
* each deft profile iteration (``W + 1 .. PLAN_AT``; ``PLAN_AT`` also holds the planning) in units of
  ``T`` (target: <= 1.3 for the profile iterations before ``PLAN_AT``; ``PLAN_AT`` is reported apart
  with its planning);
* the extra cost of the whole warm-up + profiling + planning phase: sum over iterations 1..``PLAN_AT``
  of deft minus the same sum for torch DDP, in units of ``T`` (target: <= 2);
* the profile deft measured (``DEFT_PROFILE_OUT``): each link's fitted alpha and beta (for comparison,
  ``benchmarks/bench_links.py`` measured 34 ns/B on each link alone at 250 Mbit/s), and the plan's
  predicted iteration time against deft's measured steady-state median.

Results go to ``benchmarks/results/profiling_cost.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ddp_vs_deft import run_scheme
from bench_links import ROOT, command_line, handle_signals, machine

from deft.config import DeftConfig
from deft.testbed import Testbed

RESULTS = ROOT / "benchmarks" / "results" / "profiling_cost.md"
_DEFAULTS = DeftConfig()
WARMUP = max(1, _DEFAULTS.warmup_iters)
PLAN_AT = WARMUP + _DEFAULTS.profile_iters  # iterations 1..PLAN_AT (1-based) precede the planned schedule


def measure(args: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    """``--repeats`` pairs (torch DDP, deft) on one testbed; each deft run also leaves its profile."""
    runs = []
    with Testbed(hosts=2, links=2, rate_mbit=args.rate_mbit) as tb:
        print(f"[bench_profiling_cost] testbed {tb.base} up: 2 hosts x 2 links at {args.rate_mbit:g} Mbit/s",
              flush=True)
        ns = argparse.Namespace(iters=args.iters, skip_iters=PLAN_AT, batch_size=args.batch_size,
                                timeout=args.timeout)
        for r in range(args.repeats):
            torch_doc = run_scheme(tb, "torch", ns, out_dir)
            profile_path = out_dir / f"profile{r}.json"
            os.environ["DEFT_PROFILE_OUT"] = str(profile_path)
            try:
                deft_doc = run_scheme(tb, "deft", ns, out_dir)
            finally:
                os.environ.pop("DEFT_PROFILE_OUT", None)
            runs.append({"torch": torch_doc, "deft": deft_doc,
                         "profile": json.loads(profile_path.read_text(encoding="utf-8"))})
    return runs


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of one (torch DDP, deft) pair; iteration numbers are 1-based."""
    t_iters = [r["iter_s"] for r in run["torch"]["iters"]]
    d_iters = [r["iter_s"] for r in run["deft"]["iters"]]
    ref = statistics.median(t_iters[PLAN_AT:])
    profile_x = [d / ref for d in d_iters[WARMUP:PLAN_AT]]
    extra = (sum(d_iters[:PLAN_AT]) - sum(t_iters[:PLAN_AT])) / ref
    prof = run["profile"]
    links = {lk["name"]: (lk["alpha_s"], lk["beta_s_per_byte"]) for lk in prof["links"]}
    sched = run["deft"]["summary"].get("schedule", {})
    return {"ref": ref, "torch_first": t_iters[:PLAN_AT], "deft_first": d_iters[:PLAN_AT], "profile_x": profile_x,
            "extra": extra, "links": links, "predicted": sched.get("predicted_iteration_s"),
            "deft_steady": statistics.median(d_iters[PLAN_AT:]), "K": sched.get("K")}


def report(args: argparse.Namespace, runs: list[dict[str, Any]], command: str) -> str:
    lines = [f"## Profiling cost: deft's warm-up, profiling and planning vs torch DDP at {args.rate_mbit:g} "
             "Mbit/s (`benchmarks/bench_profiling_cost.py`)", "",
             f"Command: `{command}`  ",
             f"Machine: {machine()}; shared with other jobs (tests of other engineers ran on the same 2 cores), "
             "and on these 2 cores the gloo threads of both links and the model's compute share the CPU. "
             f"Model: examples/train_cnn.py DigitsCNN, batch {args.batch_size} per rank, 2 ranks (one per host), "
             f"{args.iters} iterations per run; torch DDP and deft (default config, two links) alternate, "
             f"{args.repeats} runs each. deft: {WARMUP} warm-up + {PLAN_AT - WARMUP} profile iterations, "
             f"planning inside the step of iteration {PLAN_AT}. T = torch DDP's median iteration over "
             f"iterations {PLAN_AT + 1}..{args.iters} of the same pair.", "",
             f"| run | T (ms) | deft iterations 1..{PLAN_AT} (ms) | torch DDP iterations 1..{PLAN_AT} (ms) | "
             f"deft iterations {WARMUP + 1}..{PLAN_AT} / T | extra cost of iterations 1..{PLAN_AT} (in T) | "
             "profile: alpha (us), beta (ns/B) per link | plan: predicted / measured iteration (ms), K |",
             "|---|---|---|---|---|---|---|---|"]
    for i, run in enumerate(runs):
        s = summarize(run)
        fits = "; ".join(f"{k} {a * 1e6:.0f}, {b * 1e9:.1f}" for k, (a, b) in s["links"].items())
        pred = "-" if s["predicted"] is None else f"{s['predicted'] * 1e3:.0f}"
        lines.append(f"| {i + 1} | {s['ref'] * 1e3:.0f} | {' '.join(f'{x * 1e3:.0f}' for x in s['deft_first'])} | "
                     f"{' '.join(f'{x * 1e3:.0f}' for x in s['torch_first'])} | "
                     f"{' '.join(f'{x:.2f}' for x in s['profile_x'])} | {s['extra']:.2f} | {fits} | "
                     f"{pred} / {s['deft_steady'] * 1e3:.0f}, {s['K']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-mbit", type=float, default=250.0)
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--label", default="", help="a heading suffix (e.g. 'before' / 'after')")
    ap.add_argument("--save-runs", default=None, help="keep the runs' JSON records in this directory")
    ap.add_argument("--no-write", action="store_true", help="print the report, do not touch the results file")
    args = ap.parse_args()
    if args.iters <= PLAN_AT:
        ap.error(f"--iters: expected more than {PLAN_AT} (the reference is torch DDP after iteration {PLAN_AT})")
    handle_signals()
    # the ranks import this checkout's deft (an editable install elsewhere must not win)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    command = command_line()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.save_runs or tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        runs = measure(args, out_dir)
    text = report(args, runs, command)
    if args.label:
        text = text.replace("\n", f" ({args.label})\n", 1)
    print(text)
    if not args.no_write:
        old = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else ""
        RESULTS.write_text((old.rstrip() + "\n\n" if old else "") + text + "\n", encoding="utf-8")
        print(f"[bench_profiling_cost] appended to {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
