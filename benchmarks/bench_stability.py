"""Does linear stability explain what stale updates did to the digits CNN? (deft.preserver.stability)

    .venv/bin/python benchmarks/bench_stability.py [--steps 20] [--probe-batch 64] [--tol 1e-3]

Single process, no deft runtime, no network. The model, data, optimizer and mini-batches are those
of the update-timing check in ``benchmarks/bench_preserver.py`` (examples/models.py ``DigitsCNN``,
scikit-learn digits, SGD lr 0.02 momentum 0.9, global batch 2 x 32 drawn by a seeded generator):

1. the top Hessian eigenvalue ``lam`` of the training loss (train mode: batch-norm batch statistics,
   one dropout mask per probe) on a fixed probe batch, at initialisation and after ``--steps`` steps of
   every-iteration SGD, by Lanczos (``scipy.sparse.linalg.eigsh``) and power iteration, with the time
   and the number of Hessian-vector products each took;
2. the secant estimate ``|g_t - g_{t-1}| / |x_t - x_{t-1}|`` (mini-batch gradients) over those steps;
3. ``lam`` after ``--steps`` steps of the "one iteration late" run, to see what the instability did;
4. for the schedules the measurements concern (no delay, K = [2] lag-free, one iteration late, and
   K = [1, 2, 1] one iteration late as the testbed's epsilon 0.05 ran): the stability edge, the
   per-iteration radius at the measured ``lam`` and the preserver's verdict (margin 0.5).

Writes ``benchmarks/results/stability.md``. Probes do not disturb training: batch-norm running
statistics and the RNG are restored after each.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.sparse.linalg import eigsh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's deft
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from models import DigitsCNN, num_parameters
from train_cnn import evaluate, load_digits_split

from deft.errors import ContractError
from deft.preserver.curvature import CurvatureEstimate, SecantCurvature, hessian_operator, top_eigenvalue
from deft.preserver.stability import (
    DEFAULT_MARGIN,
    OptimizerSpec,
    check_stability,
)
from deft.schedule import synchronous_schedule, update_pattern_schedule

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "stability.md"


SCHEDULES = {
    "no delay (torch DDP)": synchronous_schedule((1,), (4,), ("l0",)),
    "K = [2], lag-free": update_pattern_schedule(2, [((0, 1), 1)]),
    "K = [1, 1], one iteration late": update_pattern_schedule(2, [((0,), 1), ((1,), 2)]),
    "K = [1, 2, 1], one iteration late": update_pattern_schedule(4, [((0,), 1), ((1, 2), 3), ((3,), 4)]),
}
#: What the update-timing check measured for three of them (benchmarks/results/testbed.md).
MEASURED = {
    "no delay (torch DDP)": "0.950 (loss 0.146)",
    "K = [2], lag-free": "0.956 (loss 0.237)",
    "K = [1, 1], one iteration late": "0.256 (loss 2.244)",
    "K = [1, 2, 1], one iteration late": "0.753 on the testbed (epsilon 0.05 run, 4 epochs)",
}


def probe(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, method: str, tol: float, maxiter: int = 300,
          ncv: int | None = None) -> CurvatureEstimate | str:
    """Top Hessian eigenvalue of the training loss on (x, y), or why it failed; BN running stats and the RNG
    untouched. ``method="smallest"``: the most negative eigenvalue (Lanczos, ``which="SA"``)."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    t0 = time.perf_counter()
    try:
        with torch.random.fork_rng():
            torch.manual_seed(12345)
            if method == "smallest":
                op = hessian_operator(F.cross_entropy(model(x), y), list(model.parameters()))
                vals, _ = eigsh(op, k=1, which="SA", tol=tol,
                                v0=np.random.default_rng(0).standard_normal(op.shape[0]))
                return CurvatureEstimate(value=float(vals[0]), method="lanczos, smallest", hvps=op.matvecs,
                                         residual=math.nan, seconds=time.perf_counter() - t0)
            return top_eigenvalue(lambda: F.cross_entropy(model(x), y), list(model.parameters()), method=method,
                                  tol=tol, maxiter=maxiter, ncv=ncv)
    except ContractError as e:
        return f"{e.problem} ({time.perf_counter() - t0:.0f} s)"
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, x_train: torch.Tensor, y_train: torch.Tensor,
          steps: int, batch: int, seed: int, late: bool) -> tuple[list[float], SecantCurvature]:
    """``steps`` iterations of the timing check's "sync" (or "late") mode; the secant on mini-batch gradients."""
    gen = torch.Generator().manual_seed(seed)
    secant = SecantCurvature(window=steps)
    pending: list[list[torch.Tensor]] = []
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(y_train), (batch,), generator=gen)
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        losses.append(float(loss.detach()))
        grads = [p.grad.clone() for p in model.parameters()]
        secant.observe(list(model.parameters()), grads)
        opt.zero_grad()
        pending.append(grads)
        if late and len(pending) < 2:
            continue
        for p, g in zip(model.parameters(), pending.pop(0), strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad()
    return losses, secant


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank; the global batch is 2x this")
    ap.add_argument("--probe-batch", type=int, default=64, help="samples in the fixed probe batch")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--tol", type=float, default=1e-3, help="relative tolerance of the eigenvalue")
    ap.add_argument("--power-maxiter", type=int, default=40, help="products per power-iteration run")
    ap.add_argument("--cheap-batch", type=int, default=16, help="probe samples of the cheap Lanczos setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    probe_idx = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(args.seed + 99))
    px, py = x_train[probe_idx[:args.probe_batch]], y_train[probe_idx[:args.probe_batch]]
    batch = 2 * args.batch_size

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(args.seed)
        m = DigitsCNN()
        return m, torch.optim.SGD(m.parameters(), lr=args.lr, momentum=args.momentum)

    log: list[str] = []

    def say(msg: str) -> None:
        print(f"[bench_stability] {msg}", flush=True)
        log.append(msg)

    model, opt = fresh()
    spec = OptimizerSpec.from_torch(opt)
    est: dict[str, CurvatureEstimate | str] = {}

    def run_probe(label: str, m: torch.nn.Module, method: str, batch_size: int | None = None, tol: float | None = None,
                  **kw: int) -> None:
        n = batch_size or args.probe_batch
        est[label] = probe(m, px[:n], py[:n], method, tol or args.tol, **kw)
        e = est[label]
        say(f"{label}: {e if isinstance(e, str) else e.to_dict()}")

    run_probe("init, Lanczos (ncv 20)", model, "lanczos")
    run_probe("init, Lanczos (ncv 8)", model, "lanczos", ncv=8)
    cheap = "init, Lanczos (ncv 4, tol 0.05)"
    run_probe(cheap, model, "lanczos", tol=0.05, ncv=4)
    small = f"init, Lanczos (ncv 4, tol 0.05, {args.cheap_batch} of the probe samples)"
    run_probe(small, model, "lanczos", batch_size=args.cheap_batch, tol=0.05, ncv=4)
    run_probe(f"init, power (at most {args.power_maxiter} products per run)", model, "power",
              maxiter=args.power_maxiter)
    run_probe("init, most negative eigenvalue (Lanczos)", model, "smallest")
    t0 = time.perf_counter()
    losses, secant = train(model, opt, x_train, y_train, args.steps, batch, args.seed, late=False)
    train_s = time.perf_counter() - t0
    say(f"{args.steps} every-iteration steps in {train_s:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    after = f"after {args.steps} steps, Lanczos (ncv 20)"
    run_probe(after, model, "lanczos")
    acc_sync, _ = evaluate(model, x_test, y_test)

    late_model, late_opt = fresh()
    late_losses, _ = train(late_model, late_opt, x_train, y_train, args.steps, batch, args.seed, late=True)
    late_label = f"after {args.steps} one-iteration-late steps, Lanczos (ncv 20)"
    run_probe(late_label, late_model, "lanczos")
    acc_late, _ = evaluate(late_model, x_test, y_test)

    first, second, late_est = est["init, Lanczos (ncv 20)"], est[after], est[late_label]
    if isinstance(first, str) or isinstance(second, str) or isinstance(late_est, str):
        raise SystemExit(f"bench_stability: Lanczos failed: {first} / {second} / {late_est}")
    lam0, lam20 = first.value, second.value
    late_edge = check_stability(SCHEDULES["K = [1, 1], one iteration late"], lam0, spec).edge
    lanczos = [e for k, e in est.items() if not isinstance(e, str) and "ncv 20" in k]
    secs = [e.seconds for e in lanczos]
    per_product = sum(e.seconds for e in lanczos) / sum(e.hvps for e in lanczos)
    cheap_est, small_est = est[cheap], est[small]
    if isinstance(cheap_est, str) or isinstance(small_est, str):
        raise SystemExit(f"bench_stability: cheap Lanczos failed: {cheap_est} / {small_est}")
    rows = []
    for name, sched in SCHEDULES.items():
        c0, c20 = check_stability(sched, lam0, spec), check_stability(sched, lam20, spec)
        verdict = ("accept (DDP's edge)" if c20.as_stable_as_ddp else "accept") if c20.stable else "reject"
        rows.append(f"| {name} | {c20.edge:.1f} | {lam0 / c20.edge:.2f} / {lam20 / c20.edge:.2f} | {c0.radius:.4f} | "
                    f"{c20.radius:.4f} | {verdict} | {MEASURED[name]} |")

    est_rows = [f"| {k} | {e} | | | |" if isinstance(e, str) else
                f"| {k} | {e.value:.3f} | {e.hvps} | {e.seconds:.1f} | {e.residual:.1e} |" for k, e in est.items()]
    sec = secant.value
    if sec is None:
        raise SystemExit("bench_stability: no secant ratio (did the parameters move?)")
    text = "\n".join([
        "# Stability of stale updates: measured curvature and the radius it implies",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on the shared 2-core CPU box ({platform.machine()}, torch "
        f"{torch.__version__}), one process, one thread (`torch.set_num_threads(1)`). Other engineers' jobs ran "
        "on the same two cores at the same time, so the times are indicative, not precise.",
        "",
        "Command (from the repository root):",
        "",
        "```",
        f".venv/bin/python benchmarks/bench_stability.py --steps {args.steps} --probe-batch {args.probe_batch} "
        f"--tol {args.tol}",
        "```",
        "",
        f"Model: examples/models.py DigitsCNN ({num_parameters(model):,} parameters), scikit-learn digits; SGD "
        f"lr {args.lr} momentum {args.momentum}, global batch {batch} (the update-timing check of "
        "benchmarks/bench_preserver.py, same seed, same mini-batches). Curvature: top eigenvalue of the "
        f"Hessian of the training loss (train mode) on a fixed probe batch of {args.probe_batch} samples, "
        f"relative tolerance {args.tol}.",
        "",
        "## The top Hessian eigenvalue and what one estimate costs",
        "",
        "| when, method | top eigenvalue | Hessian-vector products | seconds | residual |",
        "|---|---|---|---|---|",
        *est_rows,
        "",
        f"Secant estimate over the {args.steps} every-iteration steps (median of "
        f"`|g_t - g_(t-1)| / |x_t - x_(t-1)|`, mini-batch gradients of different batches): "
        f"{'n/a' if sec is None else f'{sec:.1f}'} (range {min(secant.ratios):.1f} .. {max(secant.ratios):.1f}).",
        f"Training: every-iteration loss {losses[0]:.3f} -> {losses[-1]:.3f}, test accuracy {acc_sync:.3f} "
        f"after {args.steps} steps; one iteration late {late_losses[0]:.3f} -> {late_losses[-1]:.3f}, "
        f"test accuracy {acc_late:.3f}. One training step takes {train_s / args.steps:.2f} s here.",
        "",
        f"## Radius per iteration along the sharpest direction (`OptimizerSpec.from_torch`: SGD lr {args.lr}, "
        f"momentum {args.momentum})",
        "",
        f"Edge: the curvature at which the radius reaches 1. Verdict: `check_stability` at the curvature after "
        f"{args.steps} steps, margin {DEFAULT_MARGIN}: accept iff curvature <= margin x edge, or the schedule "
        "has torch DDP's own edge (lag-free schedules).",
        "",
        f"| schedule | edge | lam / edge (init / after {args.steps}) | radius at init (lam {lam0:.1f}) "
        f"| radius after {args.steps} steps (lam {lam20:.1f}) | verdict | measured test accuracy |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "## What it says",
        "",
        f"- The radius agrees with the measured outcome in all four cases: the lag-free schedules have radius < 1 "
        "and trained as torch DDP does; the stale ones have radius > 1 per iteration and lost (0.256 in the "
        "update-timing check, 0.753 against 0.961 on the testbed). The margin does not matter on this workload: "
        f"one iteration late the edge is {late_edge:.0f} (`(1 - momentum) / lr`) and the curvature is already "
        f"{lam0 / late_edge:.0f}x that at initialisation, {lam20 / late_edge:.0f}x after {args.steps} steps.",
        f"- The stale run's own sharpness rose to {late_est.value:.0f} and its loss from {late_losses[0]:.2f} to "
        f"{late_losses[-1]:.2f} within {args.steps} steps: the instability shows at once, no self-stabilisation "
        "in that window.",
        f"- Progressive sharpening: {lam0:.0f} -> {lam20:.0f} in {args.steps} steps (x{lam20 / lam0:.1f}), towards "
        f"torch DDP's edge of {2 * (1 + args.momentum) / args.lr:.0f}. A stale schedule accepted on a warm-up probe "
        "with margin 0.5 can become unstable later; the re-check must re-probe.",
        f"- Cost, and where deft loses: one Lanczos estimate at tol {args.tol} took {min(secs):.0f}-{max(secs):.0f} s "
        f"on one core ({lanczos[0].hvps} Hessian-vector products of ~{per_product:.1f} s, each "
        f"~{per_product / (train_s / args.steps):.0f}x a training step of {train_s / args.steps:.2f} s): "
        f"~{min(secs) / (train_s / args.steps):.0f}-{max(secs) / (train_s / args.steps):.0f} training steps' worth, "
        "about as long as a whole 4-epoch run of this example (88 iterations) computes. The decisions here have "
        f"margins of 10-20x, so a loose solver is enough: ncv 4 and tol 0.05 gave {cheap_est.value:.1f} in "
        f"{cheap_est.hvps} products ({cheap_est.seconds:.0f} s). Fewer samples are not a saving: on "
        f"{args.cheap_batch} samples the top eigenvalue is {small_est.value:.0f} ({small_est.value / lam0:.1f}x the "
        f"{args.probe_batch}-sample value; a small batch's Hessian is sharper than the global batch's), so the probe "
        "should use the global batch the update averages.",
        "- Power iteration fails here: the most negative eigenvalue is larger in magnitude than the top one, so "
        "the first run converges slowly to it and the shifted second run converges more slowly still. Lanczos "
        "(`which=\"LA\"`) is the method to use.",
        f"- The secant estimate (free, no closure) gave {sec:.0f} against {lam0:.0f}-{lam20:.0f}: {lam0 / sec:.1f}-"
        f"{lam20 / sec:.1f}x low here (the steps do not follow the sharpest direction), yet still far above the "
        "one-iteration-late edge; usable as a screen when the margin is this wide, not as a measurement.",
        "",
    ])
    print(text)
    if not args.no_write:
        RESULTS.write_text(text, encoding="utf-8")
        print(f"[bench_stability] wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
