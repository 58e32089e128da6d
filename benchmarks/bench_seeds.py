"""Do two training schemes of examples/train_cnn.py differ in final accuracy? Paired over seeds, on loopback.

    .venv/bin/python benchmarks/bench_seeds.py [--schemes powersgd,deft-powersgd] [--seeds 0-7] [--epochs 4]
                                               [--eval-every 11] [--save-runs DIR] [--no-write]
    .venv/bin/python benchmarks/bench_seeds.py --from-runs DIR [--schemes ...] [--seeds ...]

For every seed ``S`` of ``--seeds`` and every scheme of ``--schemes`` (seed-major, schemes in the given
order, so a slow spell of the shared machine hits all schemes of a seed alike) it runs one 2-rank job

    <venv>/torchrun --nproc-per-node 2 --master-port <free port> examples/train_cnn.py <scheme args>
        --epochs 4 --eval-every 11 --seed S --json DIR/<scheme>_<S>.json --no-progress

with the scheme arguments of benchmarks/bench_peers.py's ``SCHEMES`` (``torch``: ``--ddp torch``;
``fp16``, ``powersgd``: ``--ddp fp16|powersgd``; ``deft``: ``--ddp deft``; ``deft-fp16``,
``deft-powersgd``: ``--ddp deft --compression fp16|powersgd``) and this checkout on ``PYTHONPATH``.
The seed fixes the train/test split, the initial model, the sampler's shuffling and the dropout
masks, so two schemes at the same seed start from the same point on the same data: the comparison
is paired.

**Loopback, not the testbed.** The ranks talk gloo over 127.0.0.1; there is no link shaping, so the
iteration times here say nothing about deft and are not reported. The accuracy does not depend on the
link speed as long as the plan does not delay updates: every bucket is all-reduced the same way
whatever the link (PowerSGD and fp16 compress the same numbers), and the link only decides when a
sum arrives, not what it is. A deft plan that delays updates (K other than [1]) or re-partitions the
buckets is chosen on the measured profile, hence on the link; the report lists the K and the buckets
each deft run planned, so a reader can check that this held.

Per run, from train_cnn.py's ``--json`` records (``evals``: one entry per test evaluation with
``iter``, ``test_acc``, ``test_loss``): the final test accuracy (last evaluation), the best, the mean
of the last three evaluations (less sensitive to the 4-10 point swings between evaluations) and the
final test loss. Per scheme: mean and sample standard deviation (n - 1) over the seeds. For each
scheme after the first, the paired differences ``d_S = scheme_S - first_S`` with

* the paired t-test (``scipy.stats.ttest_rel``): ``t = mean(d) / (sd(d) / sqrt(n))``, n - 1 degrees
  of freedom, two-sided, and its 95 % confidence interval of the mean difference;
* the Wilcoxon signed-rank test (``scipy.stats.wilcoxon``, its defaults: zero differences dropped,
  two-sided, exact null distribution for up to 13 seeds with ties or zeros);

and the seeds each scheme wins on final accuracy. Differences are rounded to 1e-12 before testing:
accuracies are multiples of 1/360, so equal gaps must rank as ties, not as float noise. Also listed:
the first iteration at which the two schemes' training losses (rank 0's) differ, per seed.

The report goes to ``benchmarks/results/seeds.md`` (unless ``--no-write``); a hand-written reading
at the end of that file (from the line starting with ``## What it says (written by hand``) is kept.
``--from-runs DIR`` trains nothing and rebuilds the report from ``DIR/<scheme>_<seed>.json`` (the
command recorded in ``DIR/command.txt`` if there is one, else this one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_links import machine, recorded_command, runs_dir
from bench_peers import SCHEMES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_cnn.py"
RESULTS = ROOT / "benchmarks" / "results" / "seeds.md"
READING = "## What it says (written by hand"

# The schemes this benchmark runs (each a 2-rank job of train_cnn.py on loopback: one link, whatever
# bench_peers' testbed labels say), with bench_peers' argv.
LABELS: dict[str, str] = {
    "torch": "torch DDP",
    "fp16": "torch DDP + fp16 hook",
    "powersgd": "torch DDP + PowerSGD (rank 4)",
    "deft": "deft default",
    "deft-fp16": "deft default + fp16 hook",
    "deft-powersgd": "deft default + PowerSGD (rank 4)",
}
# (attribute of SeedRun, column title, what it is)
METRICS: tuple[tuple[str, str, str], ...] = (
    ("final_acc", "final", "final test accuracy"),
    ("best_acc", "best", "best test accuracy"),
    ("last3_acc", "last 3", "mean test accuracy of the last three evaluations"),
    ("final_loss", "loss", "final test loss"),
)
TIE_DECIMALS = 12


class SeedRunError(ValueError):
    """A run file is missing, unreadable or lacks a field the report needs."""


@dataclass(frozen=True)
class SeedRun:
    """One training run: a scheme at a seed, reduced to what the report compares.

    Invariant: ``best_acc >= final_acc`` and ``best_acc >= last3_acc`` (all from the same ``evals``).
    """

    scheme: str
    seed: int
    final_acc: float  # test accuracy at the last evaluation
    best_acc: float  # the highest test accuracy of any evaluation
    last3_acc: float  # mean test accuracy of the last three evaluations
    final_loss: float  # test loss at the last evaluation
    iters: int  # the last evaluation's iteration (the run's length)
    losses: tuple[float, ...]  # rank 0's training loss per iteration ('iters' records; empty if absent)
    plan: str | None  # deft's plan (K, buckets) from the summary; None for other schemes
    params: int | None


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation (n - 1; 0 for one value) of one metric over the seeds."""

    mean: float
    sd: float


@dataclass(frozen=True)
class Paired:
    """Paired comparison of one metric: ``d_S = second_S - first_S`` over the common seeds.

    ``t = mean(d) / (sd(d) / sqrt(n))`` (``scipy.stats.ttest_rel``), ``p_t`` its two-sided p-value with
    n - 1 degrees of freedom, ``ci`` the 95 % confidence interval of the mean difference
    ``mean(d) -+ t_{0.975, n-1} sd(d) / sqrt(n)``; ``p_wilcoxon`` the two-sided signed-rank p-value
    (zeros dropped). All are None where undefined (fewer than 2 seeds, or every difference zero).
    """

    metric: str
    n: int
    mean_diff: float
    sd_diff: float
    t: float | None
    p_t: float | None
    ci: tuple[float, float] | None
    p_wilcoxon: float | None


@dataclass(frozen=True)
class Wins:
    """Seeds on which the second scheme's final accuracy is above, below or equal to the first's."""

    second: tuple[int, ...]
    first: tuple[int, ...]
    tied: tuple[int, ...]


# -- running --------------------------------------------------------------------------------------
def parse_seeds(text: str) -> list[int]:
    """``"0-7"``, ``"0,2,5"`` or ``"0-3,6"`` -> the seeds in order, each once."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"--seeds: expected numbers or ranges like 0-7, comma-separated; got {part!r} in {text!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"--seeds: range {part!r} runs backwards")
        seeds += [s for s in range(lo, hi + 1) if s not in seeds]
    return seeds


def parse_schemes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in LABELS]
    if unknown:
        raise ValueError(f"--schemes: unknown scheme {unknown[0]!r}; choose from {', '.join(LABELS)}")
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"--schemes: expected distinct scheme names, got {text!r}")
    return names


def run_path(run_dir: Path, scheme: str, seed: int) -> Path:
    return run_dir / f"{scheme}_{seed}.json"


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it); torchrun's rendezvous binds it next."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_argv(scheme: str, seed: int, epochs: int, eval_every: int, out: Path, port: int) -> list[str]:
    torchrun = Path(sys.executable).parent / "torchrun"
    return [str(torchrun), "--nproc-per-node", "2", "--master-port", str(port), str(EXAMPLE),
            *SCHEMES[scheme].argv, "--epochs", str(epochs), "--eval-every", str(eval_every), "--seed", str(seed),
            "--json", str(out), "--no-progress"]


def train(schemes: Sequence[str], seeds: Sequence[int], epochs: int, eval_every: int, run_dir: Path,
          timeout_s: float) -> None:
    """Every (seed, scheme) as one torchrun job, seed-major; each job's output goes to ``<scheme>_<S>.log``."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        raise SystemExit(f"bench_seeds.py: no torchrun next to {sys.executable} (expected {torchrun})")
    # the ranks import deft from this checkout, not from wherever the interpreter's deft is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    for seed in seeds:
        for scheme in schemes:
            argv = torchrun_argv(scheme, seed, epochs, eval_every, run_path(run_dir, scheme, seed), free_port())
            log = run_dir / f"{scheme}_{seed}.log"
            print(f"[bench_seeds] seed {seed}: {scheme} ({LABELS[scheme]})", flush=True)
            with log.open("w", encoding="utf-8") as f:
                try:
                    rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                        timeout=timeout_s, check=False).returncode
                except subprocess.TimeoutExpired:
                    rc = None
            if rc != 0:
                tail = "".join(log.read_text(encoding="utf-8").splitlines(keepends=True)[-15:])
                why = f"timed out after {timeout_s:g} s" if rc is None else f"exited with {rc}"
                raise SystemExit(f"bench_seeds.py: {scheme} at seed {seed} {why}: {shlex.join(argv)}\n{tail}")
            run = load_run(run_path(run_dir, scheme, seed), scheme, seed)
            print(f"[bench_seeds] seed {seed}: {scheme} final accuracy {run.final_acc:.4f}", flush=True)


# -- reading runs ---------------------------------------------------------------------------------
def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SeedRunError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _plan(summary: dict[str, Any]) -> str | None:
    sched = summary.get("schedule") or {}
    if "K" not in sched:
        return None
    numel = (sched.get("schedule") or {}).get("bucket_numel")
    return f"K = {sched['K']}" + (f", buckets {numel}" if numel else "")


def load_run(path: Path, scheme: str, seed: int) -> SeedRun:
    """Read one train_cnn.py ``--json`` file; every field the report uses is checked."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SeedRunError(f"{path}: no such run file (expected <scheme>_<seed>.json for {scheme} at seed {seed})")\
            from None
    except json.JSONDecodeError as e:
        raise SeedRunError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SeedRunError(f"{path}: expected a JSON object with 'summary', 'evals', 'iters', got {type(doc).__name__}")
    summary = doc.get("summary", {})
    if not isinstance(summary, dict):
        raise SeedRunError(f"{path}: 'summary': expected an object, got {type(summary).__name__}")
    if "seed" in summary and summary["seed"] != seed:
        raise SeedRunError(f"{path}: 'summary.seed' is {summary['seed']!r} but the file name says seed {seed}")
    evals = doc.get("evals")
    if not isinstance(evals, list) or len(evals) < 3:
        got = f"{len(evals)} evaluation(s)" if isinstance(evals, list) else repr(type(evals).__name__)
        raise SeedRunError(f"{path}: 'evals': expected a list of at least 3 test evaluations (the report averages "
                           f"the last three), got {got}; raise --epochs or lower --eval-every")
    acc, loss, at = [], [], []
    for i, e in enumerate(evals):
        if not isinstance(e, dict):
            raise SeedRunError(f"{path}: 'evals[{i}]': expected an object, got {type(e).__name__}")
        for key in ("iter", "test_acc", "test_loss"):
            if key not in e:
                raise SeedRunError(f"{path}: 'evals[{i}]' has no '{key}' (expected 'iter', 'test_acc', 'test_loss')")
        at.append(_number(e["iter"], f"{path}: 'evals[{i}].iter'"))
        acc.append(_number(e["test_acc"], f"{path}: 'evals[{i}].test_acc'"))
        loss.append(_number(e["test_loss"], f"{path}: 'evals[{i}].test_loss'"))
        if not 0.0 <= acc[-1] <= 1.0:
            raise SeedRunError(f"{path}: 'evals[{i}].test_acc': expected an accuracy in [0, 1], got {acc[-1]!r}")
    iters = doc.get("iters", [])
    if not isinstance(iters, list):
        raise SeedRunError(f"{path}: 'iters': expected a list of per-iteration records, got {type(iters).__name__}")
    losses = tuple(_number(r.get("loss") if isinstance(r, dict) else r, f"{path}: 'iters[{i}].loss'")
                   for i, r in enumerate(iters))
    params = summary.get("params")
    return SeedRun(scheme=scheme, seed=seed, final_acc=acc[-1], best_acc=max(acc),
                   last3_acc=statistics.fmean(acc[-3:]), final_loss=loss[-1], iters=int(at[-1]), losses=losses,
                   plan=_plan(summary), params=params if isinstance(params, int) else None)


def load_runs(run_dir: Path, schemes: Sequence[str], seeds: Sequence[int]) -> dict[str, list[SeedRun]]:
    """scheme -> its runs in seed order; every ``<scheme>_<seed>.json`` must exist and have the same length."""
    missing = [run_path(run_dir, n, s).name for n in schemes for s in seeds if not run_path(run_dir, n, s).exists()]
    if missing:
        raise SeedRunError(f"{run_dir}: missing run files {', '.join(missing)} (pass the --seeds/--schemes it holds)")
    runs = {n: [load_run(run_path(run_dir, n, s), n, s) for s in seeds] for n in schemes}
    lengths = {(r.scheme, r.seed): r.iters for rs in runs.values() for r in rs}
    if len(set(lengths.values())) > 1:
        raise SeedRunError(f"{run_dir}: the runs differ in length (last evaluation's iteration): {lengths}")
    return runs


# -- statistics -----------------------------------------------------------------------------------
def spread(values: Sequence[float]) -> Spread:
    return Spread(mean=statistics.fmean(values), sd=statistics.stdev(values) if len(values) > 1 else 0.0)


def paired(first: Sequence[SeedRun], second: Sequence[SeedRun], metric: str) -> Paired:
    """The paired comparison of ``metric`` (a SeedRun attribute), ``second - first``, seed by seed."""
    if [r.seed for r in first] != [r.seed for r in second]:
        raise ValueError(f"paired: the runs are not on the same seeds: {[r.seed for r in first]} and "
                         f"{[r.seed for r in second]}")
    a = np.array([getattr(r, metric) for r in first])
    b = np.array([getattr(r, metric) for r in second])
    d = np.round(b - a, TIE_DECIMALS)
    n = len(d)
    sd = float(np.std(d, ddof=1)) if n > 1 else 0.0
    t = p_t = p_w = ci = None
    if n > 1 and np.any(d != 0):
        res = stats.ttest_rel(b, a)
        t, p_t = float(res.statistic), float(res.pvalue)
        low, high = res.confidence_interval(0.95)
        ci = (float(low), float(high))
        p_w = float(stats.wilcoxon(d).pvalue)  # on the rounded differences: equal gaps rank as ties
    return Paired(metric=metric, n=n, mean_diff=float(np.mean(d)), sd_diff=sd, t=t, p_t=p_t, ci=ci, p_wilcoxon=p_w)


def wins(first: Sequence[SeedRun], second: Sequence[SeedRun]) -> Wins:
    """Which seeds each scheme wins on final accuracy (equal to 1e-12: tied)."""
    d = {f.seed: round(s.final_acc - f.final_acc, TIE_DECIMALS) for f, s in zip(first, second, strict=True)}
    return Wins(second=tuple(s for s, v in d.items() if v > 0), first=tuple(s for s, v in d.items() if v < 0),
                tied=tuple(s for s, v in d.items() if v == 0))


def split_iteration(first: SeedRun, second: SeedRun) -> int | None:
    """The first iteration (1-based) whose rank-0 training loss differs; None if equal throughout or not recorded."""
    pairs = zip(first.losses, second.losses, strict=False)  # load_runs checks the runs have the same length
    return next((i + 1 for i, (x, y) in enumerate(pairs) if x != y), None)


# -- report ---------------------------------------------------------------------------------------
def _f(v: float | None, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _p(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _seeds(seeds: Sequence[int]) -> str:
    return ", ".join(map(str, seeds)) if seeds else "none"


def render(runs: dict[str, list[SeedRun]], command: str, how: str = "") -> str:
    """The markdown report: per seed, per scheme (mean +- sd), paired differences against the first scheme."""
    schemes = list(runs)
    first = runs[schemes[0]]
    seeds = [r.seed for r in first]
    n = len(seeds)
    params = next((r.params for rs in runs.values() for r in rs if r.params), None)
    over = "paired over" if len(schemes) > 1 else "over"
    lines = [f"# Seeds: final accuracy of {' vs '.join(f'`{s}`' for s in schemes)}, {over} {n} seed(s) "
             "(`benchmarks/bench_seeds.py`)", "",
             "Command (repository root):", "", "```", command, "```", "",
             f"Machine: {machine()}; CPU only. Each run is one `torchrun --nproc-per-node 2` job of "
             "examples/train_cnn.py on loopback gloo (127.0.0.1), 1 thread per rank (torchrun's "
             "OMP_NUM_THREADS=1); the 2 ranks share the 2 cores with each other and with whatever else ran. No "
             "link shaping: times are not reported. The accuracy does not depend on the link speed while no "
             "plan delays updates or re-partitions the buckets on its timings (deft's plans are listed below).  ",
             f"Model: examples/models.py DigitsCNN ({'?' if params is None else f'{params:,}'} parameters) on "
             f"scikit-learn digits (360 test images: one image = 0.28 points), {first[0].iters} iterations, "
             "train_cnn.py's defaults otherwise (batch 32 per rank, SGD lr 0.02 momentum 0.9). The seed fixes "
             "the split, the initial model, the shuffling and the dropout: runs at one seed are paired.  ",
             "Per run: final = test accuracy at the last evaluation; best = highest of any evaluation; last 3 = "
             "mean of the last three evaluations; loss = final test loss."]
    if how:
        lines += ["", how]
    lines += ["", "## Per seed", "",
              "| seed | " + " | ".join(f"{s} {title}" for s in schemes for _, title, _ in METRICS) + " |",
              "|---|" + "---|" * (len(schemes) * len(METRICS))]
    for i, seed in enumerate(seeds):
        cells = [_f(getattr(runs[s][i], attr)) for s in schemes for attr, _, _ in METRICS]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    lines += ["", f"## Per scheme: mean ± standard deviation over {n} seed(s) (sample sd, n - 1)", "",
              "| scheme | " + " | ".join(desc for _, _, desc in METRICS) + " |",
              "|---|" + "---|" * len(METRICS)]
    for s in schemes:
        cells = []
        for attr, _, _ in METRICS:
            sp = spread([getattr(r, attr) for r in runs[s]])
            cells.append(f"{sp.mean:.4f} ± {sp.sd:.4f}")
        lines.append(f"| `{s}`: {LABELS[s]} | " + " | ".join(cells) + " |")
    for s in schemes[1:]:
        second = runs[s]
        lines += ["", f"## Paired: `{s}` minus `{schemes[0]}`, seed by seed", "",
                  "| metric | mean difference | 95% interval (t) | sd of the differences | t (ttest_rel) | p, t-test "
                  "| p, Wilcoxon |",
                  "|---|---|---|---|---|---|---|"]
        for attr, _, desc in METRICS:
            pr = paired(first, second, attr)
            ci = "-" if pr.ci is None else f"{pr.ci[0]:+.4f} .. {pr.ci[1]:+.4f}"
            lines.append(f"| {desc} | {pr.mean_diff:+.4f} | {ci} | {pr.sd_diff:.4f} | {_f(pr.t, 3)} | "
                         f"{_p(pr.p_t)} | {_p(pr.p_wilcoxon)} |")
        w = wins(first, second)
        lines += ["", f"Wins on final accuracy: `{s}` on {len(w.second)} seed(s) ({_seeds(w.second)}), "
                      f"`{schemes[0]}` on {len(w.first)} ({_seeds(w.first)}), equal on {len(w.tied)} "
                      f"({_seeds(w.tied)}).  "]
        splits = {f.seed: split_iteration(f, x) for f, x in zip(first, second, strict=True)}
        if len(set(splits.values())) == 1:
            at = next(iter(splits.values()))
            lines.append("First iteration whose training loss (rank 0) differs: "
                         + ("none (equal throughout, or not recorded)" if at is None else f"{at} on every seed")
                         + ".  ")
        else:
            lines.append("First iteration whose training loss (rank 0) differs, per seed: "
                         + ", ".join(f"{k}: {'-' if v is None else v}" for k, v in splits.items()) + ".  ")
    for s in schemes:
        plans = [r.plan for r in runs[s] if r.plan is not None]
        if plans:
            kinds = {p: sum(q == p for q in plans) for p in plans}
            lines.append(f"`{s}` planned: " + "; ".join(f"{p} ({c} of {n} seeds)" for p, c in kinds.items())
                         + ".  ")
    lines[-1] = lines[-1].rstrip()
    return "\n".join(lines) + "\n"


def write_fragment(text: str, path: Path = RESULTS, reading: str = READING) -> str:
    """Write the report to ``path``, keeping a hand-written reading (from the line starting with ``reading``
    on) if it has one; the other benchmarks' results files use it too, each with its own heading."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if reading in old:
        text += "\n" + old[old.index(reading):]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return text


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join([".venv/bin/python", str(shown), *sys.argv[1:]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="powersgd,deft-powersgd",
                    help=f"comma-separated, from {','.join(LABELS)}; differences are against the first")
    ap.add_argument("--seeds", default="0-7", help="seeds: 0-7, 0,2,5 or 0-3,6")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=11, help="iterations between test evaluations")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--save-runs", default=None, help="keep every run's JSON and log in this directory")
    ap.add_argument("--from-runs", default=None, help="no training: rebuild the report from DIR/<scheme>_<seed>.json")
    ap.add_argument("--note", default="", help="a line on how the runs were made (goes into the report)")
    ap.add_argument("--no-write", action="store_true", help=f"print the report only; do not write {RESULTS.name}")
    args = ap.parse_args()
    try:
        schemes, seeds = parse_schemes(args.schemes), parse_seeds(args.seeds)
    except ValueError as e:
        ap.error(str(e))
    for flag, v in (("--epochs", args.epochs), ("--eval-every", args.eval_every)):
        if v < 1:
            ap.error(f"{flag}: expected an integer >= 1, got {v}")
    how = args.note
    try:
        if args.from_runs:
            run_dir = Path(args.from_runs)
            command = recorded_command(run_dir, command_line())
            made = max((run_path(run_dir, n, s).stat().st_mtime for n in schemes for s in seeds
                        if run_path(run_dir, n, s).exists()), default=None)
            when = "" if made is None else f" (newest run file {datetime.date.fromtimestamp(made).isoformat()})"
            how = " ".join(filter(None, [how, f"Report rebuilt from the saved run files with `--from-runs`{when}."]))
            runs = load_runs(run_dir, schemes, seeds)
        else:
            command = command_line()
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = runs_dir(Path(args.save_runs or tmp), command)
                train(schemes, seeds, args.epochs, args.eval_every, run_dir, args.timeout)
                runs = load_runs(run_dir, schemes, seeds)
    except SeedRunError as e:
        print(f"bench_seeds.py: error: {e}", file=sys.stderr)
        return 2
    text = render(runs, command, how)
    print(text)
    if not args.no_write:
        write_fragment(text)
        print(f"[bench_seeds] wrote {RESULTS} (then: .venv/bin/python benchmarks/assemble_results.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
