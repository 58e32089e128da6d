"""deft against what a user would pick instead: every scheme of examples/train_cnn.py on the testbed.

    sudo .venv/bin/python benchmarks/bench_peers.py [--rates 250,1000] [--epochs 4] [--repeats 1]
                                                    [--schemes compute,torch,deft] [--save-runs DIR]

Builds one testbed per rate (DESIGN.md section 6: 2 hosts x 2 links, every NIC ``tc tbf``-shaped to
the rate; all of them up at once, in separate namespaces) and trains ``examples/train_cnn.py``
(4.4M-parameter CNN on scikit-learn digits, batch 32 per rank, SGD lr 0.02 momentum 0.9, seed 0,
one rank per host) for ``--epochs`` epochs with every scheme:

* ``compute``: each host trains alone (``--compute-only``: one rank's shard, no communication) at
  the same time as the other host: computation under the same CPU load, the floor;
* ``torch``: torch DDP on nic0; ``fp16``: + ``fp16_compress_hook``; ``powersgd``: + ``powerSGD_hook``
  (rank 4, error feedback, warm start, PowerSGD from 10 % of the iterations on);
* ``accum2``: torch DDP + ``no_sync`` over 2 iterations (a step every 2nd iteration, same learning rate);
* ``localsgd``: torch's post-local SGD (global gradient all-reduce for the first 10 % of the
  iterations, then local steps and a model average every 4th step);
* ``deft-eps0``: deft with epsilon = 0 on nic0 only (reordering and re-bucketing, nothing delayed);
* ``deft``: deft with its default config (epsilon 0.01, preserver on) on both links;
* ``deft-fp16``, ``deft-powersgd``: the same with deft's ``compression`` knob (``--compression``):
  torch's fp16 hook, or PowerSGD with the powersgd row's settings (rank 4, error feedback, warm
  start, from 10 % of the iterations on), on deft's scheduled buckets.

The runs are interleaved: for each repeat the scheme order is rotated by one, and each scheme runs
at every rate before the next scheme starts, so a slow spell of the shared machine hits all alike.
The test accuracy is measured every ``--eval-every`` iterations. Reported per rate: steady iteration
time (mean over the iterations after ``--skip-iters``: cheap and costly iterations of accum2,
localsgd and merged updates average out), time to 93 % and 95 % test accuracy counted from the
wrapper's construction (set-up, warm-up, deft's profiling and planning included; evaluation excluded),
final and best accuracy, updates per iteration and the ratios to torch DDP. With ``--repeats`` > 1
each figure is the median over the repeats. One accuracy-vs-time plot per rate
(``benchmarks/peers_<rate>.png``); the tables go to ``benchmarks/results/peers.md`` (between the
``peers`` markers; text outside them is kept), with the machine's load average at the start of each
run. The testbeds are removed at the end, also on an error, Ctrl-C or SIGTERM.

``--live`` lets rank 0 of each run write to the terminal (its progress bar) and prints only the tables;
``--timeline FILE`` draws the schedule the first deft run really ran (simulated on the profile it
measured) under torch DDP's simulation on the same profile. ``scripts/demo.sh`` is
``--rates 250 --epochs 1 --schemes torch,deft --live --no-write --timeline out/deft_timeline.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_links import (
    PORT,
    ROOT,
    command_line,
    handle_signals,
    machine,
    recorded_command,
    run_ranks,
    runs_dir,
    update_section,
)

from deft.testbed import Testbed, TestbedError

EXAMPLE = ROOT / "examples" / "train_cnn.py"
RESULTS = ROOT / "benchmarks" / "results" / "peers.md"
HEADER = "# deft and its peers on the two-link testbed\n"
TARGETS = (0.93, 0.95)


@dataclass(frozen=True)
class Scheme:
    """One way to train: its label, its train_cnn.py arguments, the links its deft config lists."""

    label: str
    argv: tuple[str, ...]
    links: int = 1
    alone: bool = False  # one single-process job per host instead of one 2-rank job


SCHEMES: dict[str, Scheme] = {
    "compute": Scheme("computation only (floor)", ("--compute-only",), alone=True),
    "torch": Scheme("torch DDP", ("--ddp", "torch")),
    "fp16": Scheme("torch DDP + fp16 hook", ("--ddp", "fp16")),
    "powersgd": Scheme("torch DDP + PowerSGD (rank 4)", ("--ddp", "powersgd")),
    "accum2": Scheme("torch DDP + no_sync x2", ("--ddp", "accum2")),
    "localsgd": Scheme("torch post-local SGD (period 4)", ("--ddp", "localsgd")),
    "deft-eps0": Scheme("deft, epsilon 0, one link", ("--ddp", "deft", "--epsilon", "0")),
    "deft": Scheme("deft default, two links", ("--ddp", "deft"), links=2),
    "deft-fp16": Scheme("deft default + fp16 hook, two links", ("--ddp", "deft", "--compression", "fp16"), links=2),
    "deft-powersgd": Scheme("deft default + PowerSGD (rank 4), two links",
                            ("--ddp", "deft", "--compression", "powersgd"), links=2),
}


def run_order(names: list[str], rates: list[float], repeats: int) -> list[tuple[int, str, float]]:
    """(repeat, scheme, rate) in execution order: schemes rotated by one per repeat, all rates per scheme."""
    order = []
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            order += [(r, name, rate) for rate in rates]
    return order


def run_one(tb: Testbed, name: str, rep: int, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    sch = SCHEMES[name]
    stem = f"{name}.{tb.rate_mbit:g}.r{rep}"
    out = out_dir / f"{stem}.json"
    config = tb.write_config(out_dir / f"{stem}.toml", links=sch.links)
    json_arg = str(out_dir / f"{stem}.host{{host}}.json") if sch.alone else str(out)
    argv = [sys.executable, str(EXAMPLE), *sch.argv, "--epochs", str(args.epochs), "--eval-every",
            str(args.eval_every), "--skip-iters", str(args.skip_iters), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr), "--seed", str(args.seed), "--json", json_arg]
    print(f"[bench_peers] {tb.rate_mbit:g} Mbit/s, repeat {rep}: {name} ({sch.label})", flush=True)
    t0, load = time.perf_counter(), os.getloadavg()[0]
    if args.live:
        run_live(tb, argv, timeout_s=args.timeout, label=name, config=config, alone=sch.alone)
    else:
        run_ranks(tb, [*argv, "--no-progress"], timeout_s=args.timeout, label=f"{name}@{tb.rate_mbit:g}",
                  config=config, alone=sch.alone)
    doc = json.loads((out_dir / f"{stem}.host0.json" if sch.alone else out).read_text(encoding="utf-8"))
    doc["summary"].update(wall_s=time.perf_counter() - t0, rate_mbit=tb.rate_mbit, repeat=rep, name=name, load=load)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return doc


def run_live(tb: Testbed, argv: list[str], timeout_s: float, label: str, config: Path, alone: bool) -> None:
    """Like ``run_ranks``, but rank 0 writes straight to this terminal (its progress bar redraws in
    place); the other ranks' output goes to a log that is shown only if the run fails."""
    procs = []
    with tempfile.TemporaryFile("w+") as log:
        for h in range(tb.hosts):
            env = {**tb.env_for(h, rank=h, world=tb.hosts, port=PORT, config=config), "TORCH_CPP_LOG_LEVEL": "ERROR"}
            if alone:
                env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR=tb.addr(h, 0))
            host_argv = [a.replace("{host}", str(h)) for a in argv]
            out = {} if h == 0 else {"stdout": log, "stderr": subprocess.STDOUT}
            procs.append(tb.popen(h, host_argv, env, **out))
        deadline = time.monotonic() + timeout_s
        for h, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                log.seek(0)
                tail = "".join(log.readlines()[-15:])
                why = "timed out" if rc is None else f"exited with {rc}"
                raise RuntimeError(f"{label}: host {h} {why}\n--- other hosts' last output ---\n{tail}")


def run_all(args: argparse.Namespace, names: list[str], rates: list[float], out_dir: Path,
            failed: dict[tuple[str, float], str]) -> list[dict[str, Any]]:
    """Every (repeat, scheme, rate) on testbeds that are all up for the whole run; failures recorded."""
    docs = []
    with contextlib.ExitStack() as stack:
        beds = {}
        for rate in rates:
            beds[rate] = stack.enter_context(Testbed(hosts=2, links=2, rate_mbit=rate))
            print(f"[bench_peers] testbed {beds[rate].base} up: 2 hosts x 2 links at {rate:g} Mbit/s", flush=True)
        for rep, name, rate in run_order(names, rates, args.repeats):
            try:
                doc = run_one(beds[rate], name, rep, args, out_dir)
            except RuntimeError as e:
                print(f"[bench_peers] {name} at {rate:g} Mbit/s FAILED: {e}", flush=True)
                failed[(name, rate)] = str(e).splitlines()[0]
                continue
            s = doc["summary"]
            print(f"[bench_peers] {name} at {rate:g} Mbit/s: {s['iter_s_mean'] * 1e3:.0f} ms/iteration, "
                  f"final accuracy {s['final_test_acc']:.3f}, {s['wall_s']:.0f} s", flush=True)
            docs.append(doc)
    return docs


def time_to(evals: list[dict[str, Any]], target: float) -> float | None:
    """Seconds (``time_s``: set-up and warm-up included, evaluation excluded) to the first evaluation
    at or above ``target`` test accuracy; None if never reached."""
    return next((e["time_s"] for e in evals if e["test_acc"] >= target), None)


@dataclass(frozen=True)
class Row:
    """One scheme at one rate, the median over its repeats (times to a target: over those that reach it)."""

    name: str
    runs: int
    iter_s: float
    iter_spread: tuple[float, float]
    to_target: dict[float, tuple[float | None, int]]  # target -> (median seconds, runs that reached it)
    final_acc: float
    best_acc: float
    updates_per_iter: float
    time_s: float
    plan: str
    load: float | None  # the machine's 1-minute load average when the (first) run started


def summarize(name: str, docs: list[dict[str, Any]]) -> Row:
    iters = [d["summary"]["iter_s_mean"] for d in docs]
    to: dict[float, tuple[float | None, int]] = {}
    for t in TARGETS:
        hit = [x for x in (time_to(d["evals"], t) for d in docs) if x is not None]
        to[t] = (statistics.median(hit) if hit else None, len(hit))
    sched = docs[0]["summary"].get("schedule") or {}
    plan = ""
    if sched:
        pred = sched.get("predicted_iteration_s")
        plan = (f"K = {sched.get('K')}, links {sched.get('links')}, "
                f"predicted {'-' if pred is None else f'{pred * 1e3:.0f} ms'}")
    return Row(name=name, runs=len(docs), iter_s=statistics.median(iters), iter_spread=(min(iters), max(iters)),
               to_target=to, final_acc=statistics.median(d["summary"]["final_test_acc"] for d in docs),
               best_acc=statistics.median(d["summary"]["best_test_acc"] for d in docs),
               updates_per_iter=statistics.median(d["summary"]["updates_per_iter"] for d in docs),
               time_s=statistics.median(d["summary"]["time_s"] for d in docs), plan=plan,
               load=docs[0]["summary"].get("load"))


def _sec(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f}"


def _ratio(base: float | None, v: float | None) -> str:
    return "-" if base is None or v is None or v <= 0 else f"{base / v:.2f}x"


def table(rate: float, rows: list[Row], repeats: int) -> list[str]:
    base = next((r for r in rows if r.name == "torch"), None)
    lines = [f"### {rate:g} Mbit/s", "",
             "| scheme | iteration (ms) | vs torch DDP | time to 93% (s) | vs torch DDP | time to 95% (s) | "
             "vs torch DDP | final accuracy | best | updates / iteration | time at the end (s) | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spread = f" ({r.iter_spread[0] * 1e3:.0f}-{r.iter_spread[1] * 1e3:.0f})" if r.runs > 1 else ""
        cells = [f"{SCHEMES[r.name].label}", f"{r.iter_s * 1e3:.0f}{spread}",
                 _ratio(base.iter_s if base else None, r.iter_s)]
        for t in TARGETS:
            sec, n = r.to_target[t]
            note = f" ({n}/{r.runs} runs)" if repeats > 1 and n < r.runs else ""
            cells += [_sec(sec) + note, _ratio(base.to_target[t][0] if base else None, sec)]
        cells += [f"{r.final_acc:.3f}", f"{r.best_acc:.3f}", f"{r.updates_per_iter:.3f}", f"{r.time_s:.1f}",
                  "-" if r.load is None else f"{r.load:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    plans = [f"- {SCHEMES[r.name].label}: {r.plan}" for r in rows if r.plan]
    if plans:
        lines += ["", "deft's plans (first repeat):", "", *plans]
    return lines


def plot(rate: float, docs: list[dict[str, Any]], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colors = plt.get_cmap("tab10")
    for i, name in enumerate(names):
        runs = [d for d in docs if d["summary"]["name"] == name]
        for j, d in enumerate(runs):
            ev = d["evals"]
            ax.plot([e["time_s"] for e in ev], [e["test_acc"] for e in ev], marker="o", ms=3,
                    color=colors(i % 10), alpha=1.0 if j == 0 else 0.35, lw=1.6 if name.startswith("deft") else 1.1,
                    ls="-" if not name.startswith("deft") else "-.", label=SCHEMES[name].label if j == 0 else None)
    for t in TARGETS:
        ax.axhline(t, color="grey", ls=":", lw=1)
    ax.set(xlabel="time since the wrapper's construction, evaluation excluded (s)", ylabel="test accuracy",
           ylim=(0.5, 1.0), title=f"DigitsCNN (4.4M parameters), 2 ranks, two-link testbed at {rate:g} Mbit/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def deft_timeline(doc: dict[str, Any], path: Path, rate: float) -> str:
    """Draw the schedule a deft run really ran (simulated on the profile it measured) under torch DDP's
    simulation on the same profile; returns one line comparing measured and predicted iteration time."""
    from deft.config import DeftConfig
    from deft.errors import DeftError
    from deft.profile import Profile
    from deft.schedule import Schedule
    from deft.solver.compare import simulate
    from deft.solver.partition import profile_for_schedule
    from deft.solver.simulate import simulate_schedule
    from deft.solver.timeline import draw_timeline

    info = doc["summary"].get("schedule") or {}
    if "schedule" not in info or "profile" not in info:
        return f"no timeline: the deft run recorded no schedule/profile ({info.get('error', 'not a deft run')})"
    sched = Schedule.from_dict(info["schedule"], "schedule deft ran")
    prof = Profile.from_dict(info["profile"], "profile deft measured")
    cfg = DeftConfig.from_dict({"epsilon": doc["summary"].get("epsilon", 0.01)})
    try:
        planned = profile_for_schedule(prof, sched, cfg)
    except DeftError as e:  # adaptation went back to a schedule planned on another partition of the buckets
        return (f"no timeline: the schedule deft ended on ({sched.n_buckets} buckets) does not fit the profile "
                f"it recorded last ({prof.n} buckets): {e}")
    ran = simulate_schedule(planned, sched, scheme="deft")
    ddp = simulate(prof, "ddp", cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    draw_timeline({"torch DDP": ddp, "deft (the schedule it ran)": ran}, path,
                  title=f"deft's measured profile at {rate:g} Mbit/s: torch DDP vs the schedule deft ran "
                        f"(K = {list(sched.batch_sequence)})")
    measured = doc["summary"]["iter_s_mean"]
    return (f"timeline: {path} (deft measured {measured * 1e3:.0f} ms/iteration; its plan predicted "
            f"{ran.iteration_s * 1e3:.0f} ms, torch DDP {ddp.iteration_s * 1e3:.0f} ms on the same profile)")


def report(args: argparse.Namespace, docs: list[dict[str, Any]], names: list[str], rates: list[float],
           failed: dict[tuple[str, float], str], command: str, plots: dict[float, Path]) -> str:
    first = docs[0]["summary"]
    lines = ["## Peers: accuracy and time of every scheme (`benchmarks/bench_peers.py`)", "",
             f"Command: `{command}`  ",
             f"Machine: {machine()}; {args.note}. On this 2-core machine the gloo threads of every link and "
             "the model's computation share the CPU.  ",
             f"Model: examples/models.py DigitsCNN ({first['params']:,} parameters) on scikit-learn digits "
             f"(1437 train / 360 test), batch {args.batch_size} per rank, 2 ranks (one per host), SGD lr {args.lr} "
             f"momentum 0.9, {args.epochs} epochs, seed {args.seed}; test accuracy every {args.eval_every} "
             f"iterations; {args.repeats} repeat(s), schemes interleaved.  ",
             "Load: the machine's 1-minute load average when the run started (2 cores; '-': not recorded).  ",
             f"Iteration: mean over iterations {args.skip_iters + 1}..end. Time to an accuracy: seconds from the "
             "wrapper's construction (set-up, warm-up, deft's profiling and planning included), evaluation "
             "excluded. Ratios: torch DDP's figure / the scheme's (> 1: faster than torch DDP).", ""]
    for rate in rates:
        at = [d for d in docs if d["summary"]["rate_mbit"] == rate]
        rows = [summarize(n, [d for d in at if d["summary"]["name"] == n]) for n in names
                if any(d["summary"]["name"] == n for d in at)]
        lines += table(rate, rows, args.repeats)
        lost = [f"- {SCHEMES[n].label}: {why}" for (n, r), why in failed.items() if r == rate]
        if lost:
            lines += ["", "Not measured:", "", *lost]
        if rate in plots:
            lines += ["", f"![accuracy vs time at {rate:g} Mbit/s]({plots[rate].name})"]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="250,1000", help="comma-separated link rates in Mbit/s")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated subset of {','.join(SCHEMES)}")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=11, help="iterations between test evaluations")
    ap.add_argument("--skip-iters", type=int, default=12, help="iterations left out of the steady iteration time")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--note", default="machine shared with other jobs during this run",
                    help="how quiet the machine was (goes into the report)")
    ap.add_argument("--save-runs", default=None, help="keep every run's JSON records in this directory")
    ap.add_argument("--from-runs", default=None, help="no training: rebuild report and plots from a --save-runs dir")
    ap.add_argument("--no-write", action="store_true", help="print the report; write neither peers.md nor plots")
    ap.add_argument("--live", action="store_true", help="rank 0 of each run prints to this terminal (progress bar)")
    ap.add_argument("--timeline", default=None,
                    help="draw the schedule of the first deft run (simulated on its profile) into this PNG")
    args = ap.parse_args()
    names = [n for n in args.schemes.split(",") if n]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        ap.error(f"--schemes: unknown scheme {unknown[0]!r}; choose from {', '.join(SCHEMES)}")
    try:
        rates = [float(r) for r in args.rates.split(",") if r]
    except ValueError:
        ap.error(f"--rates: expected comma-separated numbers (Mbit/s), got {args.rates!r}")
    if not rates or any(r <= 0 for r in rates):
        ap.error(f"--rates: expected positive rates, got {args.rates!r}")
    for flag, v in (("--epochs", args.epochs), ("--repeats", args.repeats), ("--eval-every", args.eval_every)):
        if v < 1:
            ap.error(f"{flag}: expected an integer >= 1, got {v}")
    handle_signals()
    # the ranks import deft from this checkout, not from wherever the interpreter's deft is installed
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    failed: dict[tuple[str, float], str] = {}
    if args.from_runs:
        run_dir = Path(args.from_runs)
        docs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(run_dir.glob("*.r*.json"))
                if ".host" not in p.name]
        docs = [d for d in docs if d["summary"]["name"] in names and d["summary"]["rate_mbit"] in rates]
        command = recorded_command(run_dir, command_line())
    else:
        command = command_line()
        with tempfile.TemporaryDirectory() as tmp:
            out_dir = runs_dir(Path(args.save_runs or tmp), command)
            try:
                docs = run_all(args, names, rates, out_dir, failed)
            except TestbedError as e:  # not root, no iproute2, no namespaces: one line, not a traceback
                print(f"bench_peers.py: error: {e}", file=sys.stderr)
                return 2
    if not docs:
        print("[bench_peers] nothing ran", flush=True)
        return 1
    plots: dict[float, Path] = {}
    if not args.no_write:
        for rate in rates:
            at = [d for d in docs if d["summary"]["rate_mbit"] == rate]
            if at:
                plots[rate] = ROOT / "benchmarks" / f"peers_{rate:g}.png"
                plot(rate, at, names, plots[rate])
    text = report(args, docs, names, rates, failed, command, plots)
    print(text[text.index("### "):] if args.live else text)  # live: the tables, under the runs on screen
    if args.timeline:
        # the plain deft row first: on a compressed profile "torch DDP" would be simulated with the codec
        deft_runs = sorted((d for d in docs if d["summary"]["ddp"] == "deft"),
                           key=lambda d: d["summary"].get("compression", "none") != "none")
        first = deft_runs[0] if deft_runs else None
        print(deft_timeline(first, Path(args.timeline), first["summary"]["rate_mbit"]) if first
              else "no timeline: no deft run in this benchmark")
    if not args.no_write:
        if not RESULTS.exists():
            RESULTS.write_text(HEADER, encoding="utf-8")
        update_section("peers", text, RESULTS)
        print(f"[bench_peers] wrote {RESULTS.relative_to(ROOT)} and {', '.join(p.name for p in plots.values())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
