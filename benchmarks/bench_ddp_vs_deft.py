"""Iteration time of torch DDP and deft on the two-link testbed: same model, same links, one run.

    sudo .venv/bin/python benchmarks/bench_ddp_vs_deft.py [--rate-mbit 250] [--iters 40] [--only torch,compute]

Builds the testbed of docs/DESIGN.md section 6 (2 hosts x 2 links, tbf-shaped at ``--rate-mbit``) and runs
``examples/train_cnn.py`` (4.4M-parameter CNN, digits, batch 32 per rank) with one rank per host:

* ``compute``: each host trains alone (world size 1) at the same time: computation under the same
  CPU load, no communication: the floor any scheme can reach;
* ``torch``: torch DDP (gloo on nic0);
* ``deft-eps0``: deft with epsilon = 0 (no delayed update: reordering and the second link only);
* ``deft``: deft with its default epsilon (0.01), both links;
* ``deft-1link``: deft with the default epsilon on nic0 only.

The steady-state iteration time is the median over iterations after ``--skip-iters`` (deft's warm-up
and planning happen in the first iterations). Speedup = torch DDP's time / the scheme's time.
Results go to ``benchmarks/results/testbed.md`` (section "ddp_vs_deft").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_links import RESULTS, ROOT, command_line, handle_signals, machine, run_ranks, update_section

from deft.testbed import Testbed

EXAMPLE = ROOT / "examples" / "train_cnn.py"

# name -> (description, example arguments, links in the deft config, single-rank jobs)
SCHEMES: dict[str, tuple[str, list[str], int, bool]] = {
    "compute": ("computation only (1 rank per host, no communication)", ["--ddp", "torch"], 1, True),
    "torch": ("torch DDP (nic0)", ["--ddp", "torch"], 1, False),
    "deft-eps0": ("deft, epsilon = 0, two links", ["--ddp", "deft", "--epsilon", "0"], 2, False),
    "deft": ("deft, default epsilon (0.01), two links", ["--ddp", "deft"], 2, False),
    "deft-1link": ("deft, default epsilon (0.01), nic0 only", ["--ddp", "deft"], 1, False),
}


def deft_runtime_ready() -> str | None:
    """None if ``deft.DistributedDataParallel`` imports, else why not."""
    try:
        import deft.runtime.ddp  # noqa: F401
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def run_scheme(tb: Testbed, name: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    desc, scheme_args, n_links, alone = SCHEMES[name]
    out = out_dir / f"{name}.json"
    config = tb.write_config(out_dir / f"{name}.toml", links=n_links)
    # single-rank jobs are each their own rank 0: each writes its own file, host 0's is reported
    json_arg = str(out_dir / f"{name}.host{{host}}.json") if alone else str(out)
    argv = [sys.executable, str(EXAMPLE), *scheme_args, "--max-iters", str(args.iters), "--epochs", "100",
            "--eval-every", str(10**9), "--skip-iters", str(args.skip_iters), "--batch-size", str(args.batch_size),
            "--no-progress", "--json", json_arg]
    print(f"[bench_ddp_vs_deft] {name}: {desc}", flush=True)
    t0 = time.perf_counter()
    run_ranks(tb, argv, timeout_s=args.timeout, label=name, config=config, alone=alone)
    doc = json.loads((out_dir / f"{name}.host0.json" if alone else out).read_text())
    doc["summary"]["wall_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return doc


def run_all(args: argparse.Namespace, names: list[str], skipped: dict[str, str], out_dir: Path
            ) -> dict[str, dict[str, Any]]:
    """Run every scheme on one testbed; a failing one is recorded in ``skipped``, the others still run."""
    docs: dict[str, dict[str, Any]] = {}
    with Testbed(hosts=2, links=2, rate_mbit=args.rate_mbit) as tb:
        print(f"[bench_ddp_vs_deft] testbed {tb.base} up: 2 hosts x 2 links at {args.rate_mbit:g} Mbit/s", flush=True)
        for name in names:
            try:
                docs[name] = run_scheme(tb, name, args, out_dir)
            except RuntimeError as e:
                print(f"[bench_ddp_vs_deft] {name} FAILED: {e}", flush=True)
                skipped[name] = f"failed: {str(e).splitlines()[0]}"
                continue
            s = docs[name]["summary"]
            print(f"[bench_ddp_vs_deft] {name}: {s['iter_s_median'] * 1e3:.0f} ms/iteration (median), "
                  f"updates/iter {s['updates_per_iter']:.3f}, {s['wall_s']:.0f} s", flush=True)
    return docs


def load_runs(run_dir: Path, names: list[str], skipped: dict[str, str]) -> tuple[dict[str, dict[str, Any]], str]:
    """The records a ``--save-runs`` run left in ``run_dir`` and the command that made them."""
    docs = {}
    for name in names:
        path = run_dir / f"{name}.json"
        if path.exists():
            docs[name] = json.loads(path.read_text(encoding="utf-8"))
        else:
            skipped.setdefault(name, f"no records in {run_dir}")
    cmd = run_dir / "command.txt"
    return docs, (cmd.read_text(encoding="utf-8").strip() if cmd.exists() else command_line())


def collect_runs(args: argparse.Namespace, names: list[str], skipped: dict[str, str], run_all: Callable[..., Any]
                 ) -> tuple[dict[str, dict[str, Any]], str]:
    """Run every named configuration (keeping records in ``--save-runs``), or reload ``--from-runs``."""
    if args.from_runs:
        return load_runs(Path(args.from_runs), names, skipped)
    command = command_line()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.save_runs or tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "command.txt").write_text(command + "\n", encoding="utf-8")
        return run_all(args, names, skipped, out_dir), command


def report(args: argparse.Namespace, docs: dict[str, dict[str, Any]], skipped: dict[str, str], command: str) -> str:
    base = docs.get("torch", {}).get("summary", {}).get("iter_s_median")
    lines = [f"## torch DDP vs deft on the two-link testbed at {args.rate_mbit:g} Mbit/s "
             "(`benchmarks/bench_ddp_vs_deft.py`)", "",
             f"Command: `{command}`  ",
             f"Machine: {machine()}. Model: examples/models.py DigitsCNN "
             f"({next(iter(docs.values()))['summary']['params']:,} parameters) on scikit-learn digits, "
             f"batch {args.batch_size} per rank, 2 ranks (one per host), {args.iters} iterations per scheme, "
             f"median over iterations {args.skip_iters + 1}..{args.iters}; all schemes in one run.", "",
             "| scheme | iteration (ms, median) | mean (ms) | speedup vs torch DDP | updates / iteration | "
             "links used (calls) | loss, last 10 iterations | test accuracy at the end |",
             "|---|---|---|---|---|---|---|---|"]
    for name, doc in docs.items():
        s = doc["summary"]
        stats = s.get("schedule", {}).get("link_stats", {})
        used = ", ".join(f"{k} ({v.get('calls', 0)})" for k, v in stats.items()) or "-"
        speed = f"{base / s['iter_s_median']:.2f}x" if base and name != "torch" else ("1.00x" if base else "-")
        if name == "compute":
            speed = f"(floor: {base / s['iter_s_median']:.2f}x)" if base else "-"
            used = "none"
        last = [r["loss"] for r in doc["iters"][-10:]]
        lines.append(f"| {SCHEMES[name][0]} | {s['iter_s_median'] * 1e3:.0f} | {s['iter_s_mean'] * 1e3:.0f} | "
                     f"{speed} | {s['updates_per_iter']:.3f} | {used} | {sum(last) / len(last):.3f} | "
                     f"{s['final_test_acc']:.3f} |")
    for name, why in skipped.items():
        lines.append(f"| {SCHEMES[name][0]} | not run: {why} | | | | | | |")
    plans = {n: d["summary"].get("schedule", {}) for n, d in docs.items() if d["summary"].get("schedule")}
    if plans:
        lines += ["", "deft's plans:", ""]
        for n, p in plans.items():
            pred = p.get("predicted_iteration_s")
            lines.append(f"- {n}: cycle {p.get('cycle')}, K = {p.get('K')}, {p.get('buckets')} buckets, "
                         f"links {p.get('links')}, predicted iteration "
                         f"{'-' if pred is None else f'{pred * 1e3:.0f} ms'}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-mbit", type=float, default=250.0)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--skip-iters", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--only", default=",".join(SCHEMES), help=f"comma-separated subset of {','.join(SCHEMES)}")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per scheme")
    ap.add_argument("--save-runs", default=None, help="keep each run's JSON records in this directory")
    ap.add_argument("--from-runs", default=None,
                    help="no training: rebuild the report from the JSON records a --save-runs run left here")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        ap.error(f"unknown scheme {unknown[0]!r}; choose from {', '.join(SCHEMES)}")
    handle_signals()
    skipped: dict[str, str] = {}
    why = None if args.from_runs else deft_runtime_ready()
    if why is not None:
        for n in [n for n in names if n.startswith("deft")]:
            skipped[n] = f"deft runtime does not import ({why})"
            names.remove(n)
    docs, command = collect_runs(args, names, skipped, run_all)
    if not docs:
        print("[bench_ddp_vs_deft] nothing ran", flush=True)
        return 1
    text = report(args, docs, skipped, command)
    print(text)
    if not args.no_write:
        update_section("ddp_vs_deft", text)
        print(f"[bench_ddp_vs_deft] wrote {RESULTS.relative_to(ROOT)}")
    return 0 if not any(v.startswith("failed") for v in skipped.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
