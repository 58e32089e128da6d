"""The preserver's knob on real training: accuracy against wall time for torch DDP and deft's epsilons.

    sudo .venv/bin/python benchmarks/bench_preserver.py [--epochs 4] [--target 0.93] [--only torch,eps0.01]

On the two-link testbed (docs/DESIGN.md section 6: 2 hosts x 2 links, 250 Mbit/s), one rank per host,
``examples/train_cnn.py`` (4.4M-parameter CNN on scikit-learn digits, same seed and data for all) is
trained for ``--epochs`` epochs by: torch DDP; deft with epsilon = 0, 0.01, 0.05, 0.2; deft with the
preserver disabled (default epsilon, nothing checks the schedule). The test accuracy is measured every
``--eval-every`` iterations (after ``ddp.flush()``), against training time (evaluation excluded).

Writes ``benchmarks/preserver_accuracy.png`` (accuracy and training loss against time, like Fig. 10 of
the paper) and a table (final accuracy, time to ``--target`` accuracy, updates per iteration, iteration
time) into ``benchmarks/results/testbed.md`` (section "preserver").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ddp_vs_deft import EXAMPLE, collect_runs, deft_runtime_ready
from bench_links import RESULTS, ROOT, handle_signals, machine, run_ranks, update_section

from deft.testbed import Testbed

PLOT = ROOT / "benchmarks" / "preserver_accuracy.png"

# name -> (label, example arguments)
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "torch": ("torch DDP", ["--ddp", "torch"]),
    "eps0": ("deft, epsilon = 0", ["--ddp", "deft", "--epsilon", "0"]),
    "eps0.01": ("deft, epsilon = 0.01 (default)", ["--ddp", "deft", "--epsilon", "0.01"]),
    "eps0.05": ("deft, epsilon = 0.05", ["--ddp", "deft", "--epsilon", "0.05"]),
    "eps0.2": ("deft, epsilon = 0.2", ["--ddp", "deft", "--epsilon", "0.2"]),
    "nopreserver": ("deft, preserver disabled", ["--ddp", "deft", "--no-preserver"]),
}


def run_config(tb: Testbed, name: str, args: argparse.Namespace, out_dir: Path, config: Path) -> dict[str, Any]:
    label, cfg_args = CONFIGS[name]
    out = out_dir / f"{name}.json"
    argv = [sys.executable, str(EXAMPLE), *cfg_args, "--epochs", str(args.epochs), "--eval-every",
            str(args.eval_every), "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(args.seed),
            "--no-progress", "--json", str(out)]
    print(f"[bench_preserver] {name}: {label}", flush=True)
    t0 = time.perf_counter()
    run_ranks(tb, argv, timeout_s=args.timeout, label=name, config=config)
    doc = json.loads(out.read_text())
    doc["summary"]["wall_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return doc


def time_to(evals: list[dict[str, Any]], target: float) -> float | None:
    """Training seconds until the first evaluation at or above ``target`` accuracy (None: never)."""
    return next((e["train_s"] for e in evals if e["test_acc"] >= target), None)


def plot(docs: dict[str, dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, doc in docs.items():
        evals, iters = doc["evals"], doc["iters"]
        ax_acc.plot([e["train_s"] for e in evals], [e["test_acc"] for e in evals], marker="o", ms=3,
                    label=CONFIGS[name][0])
        # training loss smoothed over a window, against time
        w = 8
        xs = [iters[i]["train_s"] for i in range(w - 1, len(iters))]
        ys = [statistics.fmean(r["loss"] for r in iters[i - w + 1:i + 1]) for i in range(w - 1, len(iters))]
        ax_loss.plot(xs, ys, label=CONFIGS[name][0])
    ax_acc.axhline(target, color="grey", ls=":", lw=1)
    lowest = min(e["test_acc"] for d in docs.values() for e in d["evals"])
    ax_acc.set(xlabel="training time (s)", ylabel="test accuracy", title="test accuracy vs time",
               ylim=(max(0.0, min(0.8, lowest) - 0.05), 1.0))
    ax_loss.set(xlabel="training time (s)", ylabel="training loss (8-iteration mean)", title="loss vs time",
                yscale="log")
    ax_acc.legend(fontsize=8)
    ax_acc.grid(alpha=0.3)
    ax_loss.grid(alpha=0.3)
    fig.suptitle("DigitsCNN (4.4M params), 2 ranks on the two-link testbed at 250 Mbit/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_timing_check(args: argparse.Namespace, iters: int) -> str:
    """Without deft or a network: does *when* a gradient is applied change training this much?

    One process, one core, the same model, data and optimizer as the runs above, global batch
    2 x batch-size drawn with a fixed generator, three ways of applying the same gradients:
    every iteration at once (torch DDP); each one iteration late, i.e. computed on parameters one
    update old (a K = [1, 1] schedule whose update is applied after the next iteration, as deft's
    delayed update does); merged in pairs computed on the same parameters (K = [2], batch 2B).
    Returns a markdown table: mean training loss of the last 10 iterations and test accuracy.
    """
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples"))
    from models import DigitsCNN
    from train_cnn import evaluate, load_digits_split

    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    rows = []
    for mode, label in (("sync", "every iteration (torch DDP)"), ("late", "one iteration late (K = [1, 1], delayed)"),
                        ("pairs", "pairs merged (K = [2])")):
        torch.manual_seed(args.seed)
        model = DigitsCNN()
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        gen = torch.Generator().manual_seed(args.seed)
        pending: list[list[torch.Tensor]] = []
        losses = []
        t0 = time.perf_counter()
        for it in range(iters):
            idx = torch.randint(0, len(y_train), (2 * args.batch_size,), generator=gen)
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            losses.append(float(loss.detach()))
            pending.append([p.grad.clone() for p in model.parameters()])
            opt.zero_grad()
            due = {"sync": 1, "late": 2, "pairs": 2}[mode]
            if len(pending) < due or (mode == "pairs" and it % 2 == 0):
                continue
            if mode == "late":  # apply the oldest gradient: it was computed one update ago
                grads = pending.pop(0)
            else:
                grads = [torch.stack(g).mean(0) for g in zip(*pending, strict=True)]
                pending.clear()
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            opt.step()
            opt.zero_grad()
        acc, _ = evaluate(model, x_test, y_test)
        rows.append(f"| {label} | {statistics.fmean(losses[-10:]):.3f} | {acc:.4f} |")
        print(f"[bench_preserver] update timing check, {label}: loss {statistics.fmean(losses[-10:]):.3f}, "
              f"test accuracy {acc:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return "\n".join([
        f"Update-timing check (`--timing-check`, one process, no deft, no network): the same "
        f"{iters} mini-batches of {2 * args.batch_size}, SGD lr {args.lr} momentum 0.9, gradients applied three ways.",
        "", f"| gradients applied | training loss, iterations {iters - 9}..{iters} | test accuracy |",
        "|---|---|---|", *rows])


def run_all(args: argparse.Namespace, names: list[str], skipped: dict[str, str], out_dir: Path
            ) -> dict[str, dict[str, Any]]:
    """Train every configuration on one testbed; a failing one is recorded in ``skipped``."""
    docs: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    with Testbed(hosts=2, links=2, rate_mbit=args.rate_mbit) as tb:
        config = tb.write_config(out_dir / "deft.toml")
        print(f"[bench_preserver] testbed {tb.base} up; {len(names)} configurations", flush=True)
        for i, name in enumerate(names):
            try:
                docs[name] = run_config(tb, name, args, out_dir, config)
            except RuntimeError as e:
                print(f"[bench_preserver] {name} FAILED: {e}", flush=True)
                skipped[name] = f"failed: {str(e).splitlines()[0]}"
                continue
            s = docs[name]["summary"]
            print(f"[bench_preserver] {i + 1}/{len(names)} {name}: acc {s['final_test_acc']:.4f}, "
                  f"{s['train_s']:.0f} s training, {s['iter_s_median'] * 1e3:.0f} ms/iteration, updates/iter "
                  f"{s['updates_per_iter']:.3f} (elapsed {time.perf_counter() - t_start:.0f} s)", flush=True)
    return docs


def report(args: argparse.Namespace, docs: dict[str, dict[str, Any]], skipped: dict[str, str], command: str) -> str:
    lines = ["## Preserver: accuracy vs time for epsilon (`benchmarks/bench_preserver.py`)", "",
             f"Command: `{command}`  ",
             f"Machine: {machine()}. Testbed 2 hosts x 2 links at {args.rate_mbit:g} Mbit/s; DigitsCNN on "
             f"scikit-learn digits (1437 train / 360 test), batch {args.batch_size} per rank, SGD lr {args.lr} "
             f"momentum 0.9, {args.epochs} epochs, seed {args.seed}; test accuracy every {args.eval_every} "
             "iterations after `ddp.flush()`; times are training time (evaluation excluded).", "",
             f"![accuracy vs time]({PLOT.relative_to(ROOT / 'benchmarks')})", "",
             f"| configuration | final test accuracy | best | time to {args.target:.0%} (s) | training time (s) | "
             "iteration (ms, median) | updates / iteration | K (plan) |", "|---|---|---|---|---|---|---|---|"]
    for name, doc in docs.items():
        s = doc["summary"]
        ttt = time_to(doc["evals"], args.target)
        k = s.get("schedule", {}).get("K")
        best = max(e["test_acc"] for e in doc["evals"])
        lines.append(f"| {CONFIGS[name][0]} | {s['final_test_acc']:.4f} | {best:.4f} | "
                     f"{'never' if ttt is None else f'{ttt:.1f}'} | "
                     f"{s['train_s']:.1f} | {s['iter_s_median'] * 1e3:.0f} | {s['updates_per_iter']:.3f} | "
                     f"{'-' if k is None else k} |")
    for name, why in skipped.items():
        lines.append(f"| {CONFIGS[name][0]} | not run: {why} | | | | | | |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-mbit", type=float, default=250.0)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=11, help="iterations between evaluations (22 per epoch)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.93, help="accuracy for the time-to-accuracy column")
    ap.add_argument("--only", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    ap.add_argument("--save-runs", default=None, help="keep each run's JSON records in this directory")
    ap.add_argument("--from-runs", default=None,
                    help="no training: rebuild the report from the JSON records a --save-runs run left here")
    ap.add_argument("--timing-check", type=int, default=0, metavar="ITERS",
                    help="also train ITERS iterations in one process with updates applied at once, one "
                         "iteration late and merged in pairs (no deft): separates the algorithm from the runtime")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    handle_signals()
    skipped: dict[str, str] = {}
    why = None if args.from_runs else deft_runtime_ready()
    if why is not None:
        for n in [n for n in names if n != "torch"]:
            skipped[n] = f"deft runtime does not import ({why})"
            names.remove(n)
    docs, command = collect_runs(args, names, skipped, run_all)
    if not docs:
        print("[bench_preserver] nothing ran", flush=True)
        return 1
    plot(docs, args.target, PLOT)
    text = report(args, docs, skipped, command)
    if args.timing_check:
        text += "\n\n" + update_timing_check(args, args.timing_check)
    print(text)
    if not args.no_write:
        update_section("preserver", text)
        print(f"[bench_preserver] wrote {RESULTS.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")
    return 0 if not any(v.startswith("failed") for v in skipped.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
