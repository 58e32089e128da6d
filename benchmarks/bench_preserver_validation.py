"""Do the preserver's decisions match measured accuracy? Three workloads, several epsilons, preserver off.

    .venv/bin/python benchmarks/bench_preserver_validation.py [--only cnn,lm,mlp] [--epsilons 0,0.01,0.05,0.5]

One process, one thread, on the shared 2-core CPU (other engineers' jobs run beside it). For each workload:

1. **Two ranks emulated in one process.** Every iteration draws a global batch and splits it in two
   halves ("ranks"); each half's gradient is computed separately (batch-norm statistics per half, as
   two DDP ranks without SyncBN), and their mean is the all-reduced gradient.
2. **Statistics the way the runtime gathers them** (:mod:`deft.runtime.grad_stats`): during
   ``warmup_iters + profile_iters`` synchronous iterations, the per-half ``local_stats`` and the
   mean gradient feed :class:`~deft.preserver.noise.NoiseEstimator` and
   :class:`~deft.preserver.noise.DirectionPair`; the mean gradient and the parameters it was computed
   at feed the secant curvature, debiased by ``2 tr(Σ) / B``; the optimizer's rule comes from
   :func:`deft.runtime.grad_stats.stability_inputs`; the walk's metric and ``lr`` are the runtime's
   :func:`deft.preserver.noise.walk_geometry` (SGD: ``lr / (1 - momentum)``, Euclidean; Adam: its
   ``lr``, with both halves' gradients scaled by ``sqrt(P)`` from the optimizer's state before each
   step, as :meth:`deft.runtime.grad_stats.GradStats.refresh` does; the raw ``tr Σ`` for the secant's
   noise correction beside it). The gradient bookkeeping itself is this file's (the runtime's needs
   a process group); the maths it calls is the runtime's.
3. **The decision is the runtime's**: :func:`deft.runtime.planning.make_schedule` (the real planner and
   :func:`deft.preserver.feedback.preserve`) on a profile of the workload (see :func:`measure_profile`)
   at 250 Mbit/s on each of two links.
4. **Every schedule any try produced is trained** from the same warm-up point with its update timing
   emulated: iteration ``t`` at cycle position ``p`` computes its gradient at the current parameters;
   after it, the updates :func:`deft.preserver.stability.applied_updates` lists for ``p`` are applied
   (each the mean of the gradients it merges, ``lags`` iterations old) through the real optimizer;
   evaluations see every pending gradient applied (``flush``, on a copy). With ``merge_lr_scaling``
   set (the rows "merge lr ..."), each merged update's step runs inside the runtime's
   :func:`deft.runtime.optimizer_hooks.merged_lr` (lr x k or x sqrt k). No re-checks (the decision
   at planning time is the one judged). torch DDP is the no-delay schedule (same parameters as
   epsilon 0). The final metric is taken at the workload's iteration count; a schedule that has not
   reached the target there runs on, up to ``extend`` x that count, only to time it.
5. **Time to target** = iterations to the target x the simulator's predicted iteration time
   (:func:`deft.solver.simulate.simulate_schedule`; torch DDP: ``simulate_baseline("ddp")``) on that
   profile: a prediction, not a measured wall time.

6. **Twice where the Lanczos probe ran**: every preserver setting decides once on the statistics a user
   without a loss closure gets (the free, noise-debiased secant curvature) and once on those after
   ``ddp.calibrate(closure)`` (the same walk statistics, the probe's top eigenvalue as the curvature,
   as :func:`deft.runtime.grad_stats.stability_inputs` takes it); the rows "..., calibrated" and the
   second count in the header. Results of seed ``N`` > 0 go to ``results/preserver_validation_seedN.md``.

7. **The data-order spread** (``--data-orders``, default 2): torch DDP is trained again from the same
   warm-up point on other orders of the same data. How far its final metric moves is the resolution of
   one run: a schedule whose outcome lies within that distance of the bar landed on its side by the
   data order as much as by the schedule. Such cases are marked "(within the spread)", and the header
   gives a second count without them.

A decision *matches* when an accepted schedule ends within 1 accuracy point (accuracy workloads) or
2% of final validation loss (the LM) of torch DDP, or a rejected one ends further away. The cases are
each setting's chosen schedule and every schedule a try rejected on accuracy grounds ("unstable",
"walk ratio", "slower to target"; a schedule accepted by a try but not run, because a faster one was
preferred, is not a case, nor is one dropped as predicted no faster per iteration than the no-delay
plan: that is a statement about speed, not accuracy; those are listed, and counted apart in the header).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's deft
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from deft.config import DeftConfig
from deft.preserver.curvature import RAW_SCREEN, SecantCurvature, adam_preconditioner, top_eigenvalue
from deft.preserver.feedback import NO_FASTER, WalkStats, preserve, progress_kept, schedule_ratio
from deft.preserver.noise import DirectionPair, LocalStats, NoiseEstimator, local_stats, walk_geometry
from deft.preserver.stability import Plan, applied_updates, check_stability
from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.runtime.grad_stats import stability_inputs
from deft.runtime.optimizer_hooks import merged_lr
from deft.runtime.planning import make_schedule
from deft.schedule import Schedule
from deft.solver.lagfree import lagfree_plan
from deft.solver.plan import accumulate_plan, no_delay_plan
from deft.solver.plan import plan as deft_plan
from deft.solver.simulate import simulate_baseline

ROOT = Path(__file__).resolve().parent.parent
def fragment_name(seed: int) -> str:
    """seed 0: ``preserver_validation``; another seed: ``preserver_validation_seed<N>`` (results and plots)."""
    return "preserver_validation" + ("" if seed == 0 else f"_seed{seed}")


READING = "## What it says (written by hand"

LINK_BPS = 250e6  # bits per second on each of two links
LINK_ALPHA_S = 1e-3
LINKS = ("link0", "link1")
WORLD = 2


# -- workloads ------------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    title: str
    make_model: Callable[[], nn.Module]
    make_opt: Callable[[nn.Module], torch.optim.Optimizer]
    merge_lr: str  # the merge_lr_scaling of the extra row ("linear" for SGD, "sqrt" for Adam)
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]  # one global batch
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], tuple[float, float]]  # (metric, loss); metric: accuracy or val loss
    iters: int
    eval_every: int
    global_batch: int
    metric: str  # "accuracy" (higher is better) or "loss" (lower is better)
    describe: str = ""
    extend: float = 1.5  # schedules short of the target at ``iters`` run on to extend x iters (time to target)


def _accuracy_eval(x: torch.Tensor, y: torch.Tensor) -> Callable[[nn.Module], tuple[float, float]]:
    def ev(model: nn.Module) -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(x[i:i + 256]) for i in range(0, len(y), 256)])
        model.train()
        return float((logits.argmax(1) == y).float().mean()), float(F.cross_entropy(logits, y))
    return ev


def cnn_workload(seed: int, iters: int) -> Workload:
    from models import DigitsCNN
    from train_cnn import load_digits_split

    x_tr, y_tr, x_te, y_te = load_digits_split(seed)
    gb = 64

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(y_tr), (gb,), generator=gen)
        return x_tr[idx], y_tr[idx]

    return Workload("cnn", "digits CNN (examples/models.py DigitsCNN, 4.4M parameters)", DigitsCNN,
                    lambda m: torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9), "linear", batch,
                    lambda m, x, y: F.cross_entropy(m(x), y), _accuracy_eval(x_te, y_te), iters, 11, gb, "accuracy",
                    "scikit-learn digits at 32x32, SGD lr 0.02 momentum 0.9 (examples/train_cnn.py's), global batch 64",
                    extend=1.5)


class DigitsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp_workload(seed: int, iters: int) -> Workload:
    from sklearn.datasets import (
        load_breast_cancer,  # noqa: F401  (shipped with scikit-learn; digits used)
        load_digits,
    )
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    tr, te = train_test_split(list(range(len(y))), test_size=0.2, random_state=seed, stratify=d.target)
    x_tr, y_tr, x_te, y_te = x[tr], y[tr], x[te], y[te]
    gb = 32

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(y_tr), (gb,), generator=gen)
        return x_tr[idx], y_tr[idx]

    return Workload("mlp", "MLP on scikit-learn digits (8x8 pixels, 64-256-256-10)", DigitsMLP,
                    lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True), "linear", batch,
                    lambda m, x, y: F.cross_entropy(m(x), y), _accuracy_eval(x_te, y_te), iters, 10, gb, "accuracy",
                    "SGD lr 0.05, Nesterov momentum 0.9, global batch 32", extend=4.0)


class CharLM(nn.Module):
    """A small causal transformer over bytes."""

    def __init__(self, ctx: int, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), diagonal=1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for blk in self.blocks:
            h = blk(h, src_mask=self.mask[:x.shape[1], :x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def stdlib_text(limit: int = 600_000) -> bytes:
    """Python's own standard-library sources (every machine with Python has them), in sorted order:
    the text examples/train_lm.py trains its GPT-2 on."""
    from train_lm import load_text

    return load_text(limit)


def lm_workload(seed: int, iters: int) -> Workload:
    data = torch.tensor(list(stdlib_text()), dtype=torch.int64)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    ctx, gb = 64, 32
    vgen = torch.Generator().manual_seed(seed + 1)
    vstarts = torch.randint(0, len(val) - ctx - 1, (64,), generator=vgen)
    vx = torch.stack([val[s:s + ctx] for s in vstarts])
    vy = torch.stack([val[s + 1:s + ctx + 1] for s in vstarts])

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(train) - ctx - 1, (gb,), generator=gen)
        return (torch.stack([train[s:s + ctx] for s in starts]),
                torch.stack([train[s + 1:s + ctx + 1] for s in starts]))

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1))

    def ev(m: nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            v = float(loss_fn(m, vx, vy))
        return v, v

    return Workload("lm", f"character-level transformer LM on Python's stdlib sources ({len(data) // 1000} kB)",
                    lambda: CharLM(ctx), lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.99),
                                                                     weight_decay=0.01),
                    "sqrt", batch, loss_fn, ev, iters, 25, gb, "loss",
                    "2 pre-norm layers, d 64, 4 heads, context 64 bytes, AdamW lr 3e-3 betas (0.9, 0.99) "
                    "weight decay 0.01, global batch 32 sequences; metric: validation loss (64 held-out windows)")


# -- profile --------------------------------------------------------------------------------------
def measure_profile(w: Workload, seed: int, reps: int = 5) -> Profile:
    """Buckets: one per module owning parameters, output side first (the backward's ready order).

    Timed at the per-rank batch (half the global batch), minimum over ``reps`` (robust to the other
    jobs on the shared cores): the whole forward and the whole forward + backward. Per bucket, both
    are split in proportion to the forward time of its module (forward hooks; parameterless modules
    are counted with the last parameter-owning module before them). Communication: a 2-rank ring
    all-reduce of the bucket's bytes on each link, ``alpha + nbytes * 8 / 250 Mbit/s``.
    """
    torch.manual_seed(seed)
    model = w.make_model()
    owners = [(n, m) for n, m in model.named_modules()
              if any(p.requires_grad for p in m.parameters(recurse=False))]
    owner_names = {n for n, _ in owners}
    timed = [(n, m) for n, m in model.named_modules() if n in owner_names or not list(m.children())]
    times: dict[str, list[float]] = {n: [] for n, _ in timed}
    start: dict[str, float] = {}
    hooks = []
    for n, m in timed:
        hooks.append(m.register_forward_pre_hook(lambda mod, a, n=n: start.__setitem__(n, time.perf_counter())))
        hooks.append(m.register_forward_hook(lambda mod, a, o, n=n: times[n].append(time.perf_counter() - start[n])))
    gen = torch.Generator().manual_seed(seed)
    fwd_s, step_s = [], []
    for _ in range(reps):
        x, y = w.batch(gen)
        t0 = time.perf_counter()
        loss = w.loss_fn(model, x[:len(x) // WORLD], y[:len(y) // WORLD])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        fwd_s.append(t1 - t0)
        step_s.append(t2 - t0)
    for h in hooks:
        h.remove()
    share: dict[str, float] = {n: 0.0 for n, _ in owners}
    current = owners[0][0]
    for n, _ in timed:
        if n in owner_names:
            current = n
        share[current] += min(times[n]) if times[n] else 0.0
    total = sum(share.values()) or 1.0
    fwd_total, bwd_total = min(fwd_s), max(min(step_s) - min(fwd_s), 0.0)
    beta = 8.0 / LINK_BPS
    buckets, btimes = [], []
    for i, (n, m) in enumerate(reversed(owners)):
        params = [f"{n}.{pn}" for pn, p in m.named_parameters(recurse=False) if p.requires_grad]
        numel = sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad)
        buckets.append(Bucket(i, tuple(params), numel, 4 * numel))
        comm = LINK_ALPHA_S + beta * 4 * numel
        f = share[n] / total
        btimes.append(BucketTimes(fwd_total * f, bwd_total * f, {lk: comm for lk in LINKS}))
    links = tuple(Link(lk, "gloo", None, LINK_ALPHA_S, beta) for lk in LINKS)
    return Profile(tuple(buckets), tuple(btimes), links, WORLD, "timing", model=w.name)


# -- training with emulated update timing ----------------------------------------------------------
def grads_of(w: Workload, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list[list[torch.Tensor]], float]:
    """Per-"rank" gradients of the two halves and the mean loss."""
    per, losses = [], []
    h = len(x) // WORLD
    for r in range(WORLD):
        model.zero_grad(set_to_none=True)
        loss = w.loss_fn(model, x[r * h:(r + 1) * h], y[r * h:(r + 1) * h])
        loss.backward()
        losses.append(float(loss.detach()))
        per.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return per, statistics.fmean(losses)


def apply(model: nn.Module, opt: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    opt.step()
    opt.zero_grad(set_to_none=True)


def mean_of(gs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(t).mean(0) for t in zip(*gs, strict=True)]


@dataclass
class WarmState:
    model: dict[str, Any]
    opt: dict[str, Any]
    gen: torch.Tensor
    stats: WalkStats | None
    reason: str
    curvature: float | None
    secant_raw: float | None
    t: int
    lanczos: dict[str, Any] | None = None  # what ddp.calibrate would measure here (value, spec, hvps, seconds)
    calibrated: WalkStats | None = None  # the statistics after ddp.calibrate: the Lanczos curvature, not the secant


def _sq(ts: list[torch.Tensor]) -> float:
    return sum(float(torch.dot(t.reshape(-1).double(), t.reshape(-1).double())) for t in ts)


def warm_up(w: Workload, seed: int, n: int, probe: bool = True) -> WarmState:
    """``n`` synchronous iterations gathering the runtime's statistics; the state to branch from."""
    torch.manual_seed(seed)
    model = w.make_model()
    opt = w.make_opt(model)
    gen = torch.Generator().manual_seed(seed)
    noise, raw, dirs, secant = NoiseEstimator(), NoiseEstimator(), DirectionPair(), SecantCurvature()
    params = list(model.parameters())
    metric = "euclidean"
    loss = math.nan
    for _ in range(n):
        x, y = w.batch(gen)
        per, loss = grads_of(w, model, x, y)
        g = mean_of(per)
        secant.observe(params, g)
        geo = walk_geometry(opt, params)  # the runtime's GradStats.refresh: the metric before this step
        if geo.metric != metric:  # Adam's first step done: restart in its metric, as GradStats does
            noise, raw, dirs, metric = NoiseEstimator(), NoiseEstimator(), DirectionPair(), geo.metric
        half = len(x) // WORLD
        if geo.roots is not None:
            raw.update([LocalStats(_sq(gr), None, None, half) for gr in per], _sq(g))
            per_w = [[t * r for t, r in zip(gr, geo.roots, strict=True)] for gr in per]
            g_w = [t * r for t, r in zip(g, geo.roots, strict=True)]
        else:
            per_w, g_w = per, g
        pair = dirs.get()
        locs = [local_stats([t.reshape(-1) for t in gr], pair, half) for gr in per_w]
        noise.update(locs, _sq(g_w), dirs.dot() if pair is not None else None)
        dirs.observe([t.reshape(-1) for t in g_w])
        apply(model, opt, g)
    est = noise.estimate
    geo = walk_geometry(opt, with_roots=False)
    assert geo.lr is not None and geo.metric == metric
    cfg = DeftConfig()
    stats = WalkStats.from_estimate(max(loss, cfg.s_star), est, geo.lr, w.global_batch, cfg.s_star, metric=metric)
    lam = None
    reason = "no noise estimate"
    if stats is not None and est is not None:
        trace = (raw.estimate if metric != "euclidean" else est).trace
        sec, raw = secant.screen(2.0 * trace / w.global_batch)  # as deft.runtime.grad_stats.walk_stats
        lam, spec, how = stability_inputs(opt, sec, None)
        reason = f"{how} ({RAW_SCREEN})" if raw else how
        if lam is not None:
            stats = dataclasses.replace(stats, curvature=lam, optimizer=spec)
    warm = WarmState(copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), gen.get_state(), stats,
                     reason, lam, secant.value, n)
    if probe:
        # ddp.calibrate's probe: Lanczos (tol 0.05, ncv 4) on the next global batch's loss (the mean of the
        # two halves, batch-norm statistics per half), preconditioned by Adam's D as calibrate does.
        x, y = w.batch(torch.Generator().manual_seed(seed + 99))
        h = len(x) // WORLD
        pre = adam_preconditioner(opt) if type(opt).__name__ in ("Adam", "AdamW") else None
        est = top_eigenvalue(lambda: sum(w.loss_fn(model, x[r * h:(r + 1) * h], y[r * h:(r + 1) * h])
                                         for r in range(WORLD)) / WORLD,
                             list(model.parameters()), tol=0.05, ncv=4, maxiter=300, preconditioner=pre)
        lam_lz, spec_lz, _ = stability_inputs(opt, None, est.value, preconditioned=pre is not None)
        warm.lanczos = {"value": lam_lz, "spec": spec_lz, "hvps": est.hvps, "seconds": est.seconds}
        if warm.stats is not None and lam_lz is not None:  # what grad_stats.walk_stats gives after calibrate
            warm.calibrated = dataclasses.replace(warm.stats, curvature=lam_lz, optimizer=spec_lz)
    return warm


def _flushed_copy(w: Workload, model: nn.Module, opt: torch.optim.Optimizer,
                  hist: dict[int, list[torch.Tensor]], merge_lr: str = "none") -> nn.Module:
    """The model as evaluation after ``ddp.flush()`` sees it: every pending gradient applied (on a copy)."""
    if not hist:
        return model
    m2 = copy.deepcopy(model)
    o2 = w.make_opt(m2)
    o2.load_state_dict(opt.state_dict())
    with merged_lr(o2, len(hist), merge_lr):  # ddp.flush steps a cut-short merge like a merge of that many
        apply(m2, o2, mean_of(list(hist.values())))
    return m2


def train_plan(w: Workload, seed: int, warm: WarmState, plan: Plan, target: float | None = None,
               extend: float = 1.0, merge_lr: str = "none", data_seed: int | None = None) -> dict[str, Any]:
    """From the warm-up state, run ``plan``'s update timing to ``w.iters`` (the final metric is taken
    there), then on, up to ``extend x w.iters``, only until ``target`` is reached (time to target).
    ``data_seed``: draw the batches after the warm-up in another order (the data-order spread)."""
    torch.manual_seed(seed + 7 if data_seed is None else data_seed + 7)
    model = w.make_model()
    model.load_state_dict(warm.model)
    opt = w.make_opt(model)
    opt.load_state_dict(copy.deepcopy(warm.opt))  # torch keeps the given state tensors: SGD would mutate them
    gen = torch.Generator()
    if data_seed is None:
        gen.set_state(warm.gen)
    else:
        gen.manual_seed(data_seed)
    hist: dict[int, list[torch.Tensor]] = {}
    evals, losses = [], []
    n = len(plan)
    diverged = False
    final = {"iteration": w.iters, "metric": math.nan, "loss": math.nan}
    last = w.iters if target is None else int(extend * w.iters)
    t0 = time.perf_counter()
    for t in range(warm.t, last):
        x, y = w.batch(gen)
        per, loss = grads_of(w, model, x, y)
        losses.append(loss)
        if not math.isfinite(loss):
            diverged = True
            break
        hist[t] = mean_of(per)
        for u in plan[(t - warm.t) % n]:
            its = [t - lag for lag in u.lags if t - lag >= warm.t]  # earlier ones were applied in warm-up
            if its:
                with merged_lr(opt, len(its), merge_lr):  # the runtime's step of a merged update
                    apply(model, opt, mean_of([hist[i] for i in its]))
                for i in its:
                    hist.pop(i, None)
        if (t + 1) % w.eval_every == 0 or t + 1 == w.iters:
            metric, vloss = w.evaluate(_flushed_copy(w, model, opt, hist, merge_lr))
            evals.append({"iteration": t + 1, "metric": metric, "loss": vloss})
            if t + 1 == w.iters:
                final = evals[-1]
            reached = target is not None and ((metric >= target) if w.metric == "accuracy" else (metric <= target))
            if t + 1 >= w.iters and (target is None or reached):
                break
    return {"evals": evals, "train_loss": losses, "final_metric": final["metric"], "final_loss": final["loss"],
            "seconds": time.perf_counter() - t0, "diverged": diverged}


def plan_key(plan: Plan, merge_lr: str = "none") -> str:
    """One trained run per update timing, and per lr scaling when the plan merges."""
    key = json.dumps([[list(u.lags) for u in due] for due in plan])
    merges = any(len(u.lags) > 1 for due in plan for u in due)
    return key + (f" lr:{merge_lr}" if merges and merge_lr != "none" else "")


def describe(s: Schedule, merge_lr: str = "none") -> str:
    stale = max((u.apply_after - u.last for u in s.updates), default=0)
    kind = "no delay" if all(k == 1 for k in s.batch_sequence) and stale == 0 else \
        ("lag-free merge" if stale == 0 else f"stale by {stale}")
    scaled = merge_lr != "none" and any(k > 1 for k in s.batch_sequence)
    lr = f", lr x {'k' if merge_lr == 'linear' else 'sqrt k'}" if scaled else ""
    return f"K={list(s.batch_sequence)} ({kind}{lr})"


# -- one workload ---------------------------------------------------------------------------------
def run_workload(w: Workload, args: argparse.Namespace, epsilons: list[float]) -> dict[str, Any]:
    say = lambda m: print(f"[validation:{w.name}] {m}", flush=True)  # noqa: E731
    prof = measure_profile(w, args.seed)
    cfg0 = DeftConfig()
    warm_n = cfg0.warmup_iters + cfg0.profile_iters
    warm = warm_up(w, args.seed, warm_n, probe=not args.no_probe)
    say(f"warm-up {warm_n} iterations: stats {warm.stats}, curvature {warm.reason}")
    links = [{"name": lk} for lk in LINKS]
    # (label, config, statistics): each preserver setting twice where the Lanczos probe ran, once as a user
    # without a loss closure gets it (the free secant curvature) and once after ddp.calibrate(closure)
    configs: list[tuple[str, DeftConfig, WalkStats | None]] = [
        (f"epsilon {e:g}" + (" (default)" if e == cfg0.epsilon else ""),
         DeftConfig.resolve({"epsilon": e, "links": links}), warm.stats) for e in epsilons]
    configs.append(("preserver off",
                    DeftConfig.resolve({"epsilon": cfg0.epsilon, "preserver": False, "links": links}), warm.stats))
    configs.append((f"epsilon {cfg0.epsilon:g}, merge lr {w.merge_lr}",
                    DeftConfig.resolve({"epsilon": cfg0.epsilon, "merge_lr_scaling": w.merge_lr, "links": links}),
                    warm.stats))
    if warm.calibrated is not None:
        configs += [(f"{label}, calibrated", cfg, warm.calibrated)
                    for label, cfg, _ in list(configs) if cfg.preserver and cfg.epsilon > 0]
    decisions = []
    # The no-delay schedule epsilon 0 runs, and the preserver's yardstick: the lag-free plan (its forward
    # stage makes it faster than no_delay_plan, with the same updates, hence the same training run).
    nd = (lagfree_plan if configs[0][1].forward_updates else no_delay_plan)(prof, configs[0][1])
    ddp_key = plan_key(applied_updates(nd))
    candidates: dict[str, tuple[Schedule, str]] = {ddp_key: (nd, "none")}
    tried_schedules: list[tuple[Schedule, str]] = []

    def recording(fn: Callable[..., Schedule], merge_lr: str) -> Callable[..., Schedule]:
        def wrapped(*a: Any, **kw: Any) -> Schedule:
            sched = fn(*a, **kw)
            tried_schedules.append((sched, merge_lr))
            return sched
        return wrapped

    for label, cfg, stats in configs:
        if cfg.preserver and cfg.epsilon > 0:  # make_schedule's call, with planners that record each try
            base = lagfree_plan if cfg.forward_updates else no_delay_plan
            ml = cfg.merge_lr_scaling
            res = preserve(prof, cfg, stats, planner=recording(deft_plan, ml),
                           no_delay_planner=recording(base, ml), accumulate_planner=recording(accumulate_plan, ml))
            sched, tries = res.schedule, list(res.tries)
        else:
            sched, tries = make_schedule(cfg, prof, stats, None).schedule, []
        decisions.append({"label": label, "epsilon": cfg.epsilon, "preserver": cfg.preserver, "schedule": sched,
                          "tries": tries, "merge_lr": cfg.merge_lr_scaling,
                          "calibrated": stats is not None and stats is warm.calibrated})
        candidates.setdefault(plan_key(applied_updates(sched), cfg.merge_lr_scaling), (sched, cfg.merge_lr_scaling))
    for sched, ml in tried_schedules:
        candidates.setdefault(plan_key(applied_updates(sched), ml), (sched, ml))
    if len(candidates) > args.max_schedules:
        say(f"{len(candidates)} distinct schedules; training the first {args.max_schedules} (chosen ones first)")
    runs: dict[str, dict[str, Any]] = {}
    target = None
    for key, (s, ml) in list(candidates.items())[:args.max_schedules]:  # torch DDP's (no delay) first: the target
        r = train_plan(w, args.seed, warm, applied_updates(s), target, w.extend, ml)
        if target is None:
            target = target_of(w, r)
        r["schedule"] = s
        r["describe"] = describe(s, ml)
        r["iteration_s"] = s.predicted_iteration_s  # deft.solver.simulate on the partitioned profile
        r["ratio"] = None if warm.stats is None else schedule_ratio(s, warm.stats, ml)
        chk = None if warm.stats is None else warm.stats.stability(s)
        r["stability"] = chk
        runs[key] = r
        say(f"{r['describe']}: final {w.metric} {r['final_metric']:.4f} (loss {r['final_loss']:.4f}), "
            f"{r['seconds']:.0f} s, predicted {r['iteration_s'] * 1e3:.1f} ms/iteration")
    ddp_run = runs[ddp_key]
    ddp_iter_s = simulate_baseline(prof, "ddp").iteration_s
    # torch DDP again from the same warm-up point, on other orders of the same data: how far the final
    # metric moves when nothing but the batches' order changes (the bar must be read against this)
    orders = []
    for i in range(args.data_orders):
        r = train_plan(w, args.seed, warm, applied_updates(nd), data_seed=1000 * (args.seed + 1) + i)
        orders.append(r["final_metric"])
        say(f"torch DDP on data order {i + 1}: final {w.metric} {r['final_metric']:.4f}")
    return {"workload": w, "profile": prof, "warm": warm, "decisions": decisions, "runs": runs, "ddp_key": ddp_key,
            "ddp": ddp_run, "ddp_iteration_s": ddp_iter_s, "orders": orders}


def gap(w: Workload, metric: float, ddp: dict[str, Any]) -> float:
    """How much worse than torch DDP, in the bar's unit: accuracy points lost, or % of validation loss added."""
    if not math.isfinite(metric):
        return math.inf
    if w.metric == "accuracy":
        return 100 * (ddp["final_metric"] - metric)
    return 100 * (metric - ddp["final_metric"]) / ddp["final_metric"]


#: The bar, in :func:`gap`'s unit: 1 accuracy point, or 2 % of final validation loss.
BAR = {"accuracy": 1.0, "loss": 2.0}


def loses(w: Workload, run: dict[str, Any], ddp: dict[str, Any]) -> bool:
    """Measured outcome: more than 1 accuracy point, or 2% of final loss, worse than torch DDP."""
    if not math.isfinite(run["final_metric"]):
        return True
    if w.metric == "accuracy":
        return run["final_metric"] < ddp["final_metric"] - 0.01
    return run["final_metric"] > ddp["final_metric"] * 1.02


def target_of(w: Workload, ddp: dict[str, Any]) -> float:
    """Accuracy: torch DDP's final minus 2 points; LM: torch DDP's final validation loss x 1.03."""
    return ddp["final_metric"] - 0.02 if w.metric == "accuracy" else ddp["final_metric"] * 1.03


def iters_to(w: Workload, run: dict[str, Any], target: float) -> int | None:
    for e in run["evals"]:
        if (e["metric"] >= target) if w.metric == "accuracy" else (e["metric"] <= target):
            return int(e["iteration"])
    return None


# -- report ---------------------------------------------------------------------------------------
def report_workload(res: dict[str, Any], plot_dir: Path, name: str
                    ) -> tuple[list[str], list[tuple[bool, bool, bool]], dict[str, Any]]:
    w: Workload = res["workload"]
    runs, ddp = res["runs"], res["ddp"]
    target = target_of(w, ddp)
    unit = "accuracy" if w.metric == "accuracy" else "val. loss"
    lines = [f"### {w.title}", "", w.describe + f"; {w.iters} iterations (up to {int(w.extend * w.iters)} to "
             "reach the target).", ""]
    warm: WarmState = res["warm"]
    st = warm.stats
    lines.append(f"Statistics after {warm.t} synchronous iterations: " + (
        "none" if st is None else
        f"loss {st.loss:.3f}, mu {st.mu:.4g}, sigma {st.sigma:.4g} ({st.metric} metric), walk lr {st.lr:.4g}, "
        f"batch {st.batch:g}; "
        f"curvature {warm.reason}" + (f" {warm.curvature:.4g}" if warm.curvature is not None else "")
        + (f" (raw secant {warm.secant_raw:.4g})" if warm.secant_raw is not None else "")))
    if warm.lanczos is not None:
        lz = warm.lanczos
        lines.append(f"What `ddp.calibrate` would measure at that point (Lanczos, tol 0.05, ncv 4"
                     f"{', Adam-preconditioned' if lz['spec'] is not None and lz['spec'].kind == 'adam' else ''}): "
                     f"{lz['value']:.4g} in {lz['hvps']} Hessian-vector products, {lz['seconds']:.1f} s here. "
                     "The column 'with Lanczos' gives each schedule's verdict at that curvature.")
    prof: Profile = res["profile"]
    comp = sum(t.forward_s + t.backward_s for t in prof.times)
    comm = sum(t.comm_s[LINKS[0]] for t in prof.times)
    lines += ["", f"Profile: {prof.n} buckets, compute {comp * 1e3:.1f} ms per iteration (this CPU, per-rank batch), "
              f"all-reduce {comm * 1e3:.1f} ms per iteration on one 250 Mbit/s link; torch DDP predicted "
              f"{res['ddp_iteration_s'] * 1e3:.1f} ms per iteration. Target: {unit} "
              f"{'>=' if w.metric == 'accuracy' else '<='} {target:.4f} "
              f"({'torch DDP final - 2 points' if w.metric == 'accuracy' else 'torch DDP final x 1.03'}).", ""]
    spread = max((abs(gap(w, m, ddp)) for m in res["orders"]), default=0.0)
    bar = BAR[w.metric]
    unit_s = "points" if w.metric == "accuracy" else "% of loss"
    if res["orders"]:
        n_o = len(res["orders"])
        finals = ", ".join(f"{m:.4f}" for m in res["orders"])
        moves = ", ".join(f"{-gap(w, m, ddp):+.1f}" for m in res["orders"])
        lines += [f"Data-order spread: torch DDP trained again from the same warm-up point on {n_o} other "
                  f"order{'s' if n_o > 1 else ''} of the data ended at {finals} ({moves} {unit_s} from the run "
                  f"above): an outcome within {spread:.1f} {unit_s} of the bar ({bar:g} {unit_s} worse) is on the "
                  "side the data order put it, and is marked '(within the spread)' below.", ""]

    def resolvable(r: dict[str, Any]) -> bool:
        return abs(gap(w, r["final_metric"], ddp) - bar) > spread

    lines += ["| setting | chosen schedule | ms/iteration (predicted) | predicted ratio | progress kept | "
              "radius (edge) | with Lanczos | final " + unit + " | vs torch DDP | iterations to target | "
              "predicted time to target | decision vs measured |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ddp_time = None
    it = iters_to(w, ddp, target)
    if it is not None:
        ddp_time = it * res["ddp_iteration_s"]
    lines.append(f"| torch DDP (emulated) | K=[1] | {res['ddp_iteration_s'] * 1e3:.1f} | 1 | 1 | | | "
                 f"{ddp['final_metric']:.4f} | | {it} | {'-' if ddp_time is None else f'{ddp_time:.1f} s'} | |")
    # (accepted, decision matched, after ddp.calibrate, outcome farther from the bar than the data-order spread)
    cases: list[tuple[bool, bool, bool, bool]] = []
    summary: dict[str, Any] = {"times": {}}
    for dec in res["decisions"]:
        key = plan_key(applied_updates(dec["schedule"]), dec["merge_lr"])
        r = runs.get(key)
        if r is None:
            lines.append(f"| {dec['label']} | {describe(dec['schedule'])} | | | not trained | | | | |")
            continue
        lost = loses(w, r, ddp)
        it = iters_to(w, r, target)
        # the decision's own schedule's prediction: a run is shared by every schedule with its updates
        iter_s = dec["schedule"].predicted_iteration_s
        t_s = None if it is None else it * iter_s
        summary["times"][dec["label"]] = (t_s, iter_s)
        chk = r["stability"] if not dec["calibrated"] else warm.calibrated.stability(r["schedule"])
        rad = "" if chk is None else f"{chk.radius:.3f} ({chk.edge:.3g})"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.4f}"
        diff = (r["final_metric"] - ddp["final_metric"]) * (100 if w.metric == "accuracy" else 1)
        diff_s = f"{diff:+.1f} pt" if w.metric == "accuracy" else f"{100 * diff / ddp['final_metric']:+.1f}%"
        verdict = ""
        if dec["preserver"] and dec["epsilon"] > 0:
            ok = not lost
            cases.append((True, ok, dec["calibrated"], resolvable(r)))
            verdict = "accepted, " + ("kept accuracy: match" if ok else "LOST: mismatch") + \
                ("" if resolvable(r) else " (within the spread)")
        elif dec["epsilon"] == 0:
            verdict = "epsilon 0 (no delay by rule)"
        else:
            verdict = "untested" + (" (lost)" if lost else "")
        lz = lanczos_verdict(warm, r["schedule"])
        pk = progress_retained(warm.stats, r["schedule"], dec["merge_lr"])
        pk_s = "" if pk is None else f"{pk:.3f}"
        lines.append(f"| {dec['label']} | {r['describe']} | {iter_s * 1e3:.1f} | {ratio} | {pk_s} | {rad} | "
                     f"{lz} | "
                     f"{r['final_metric']:.4f} | {diff_s} | {'-' if it is None else it} | "
                     f"{'-' if t_s is None else f'{t_s:.1f} s'} | {verdict} |")
        summary.setdefault("rows", []).append({"label": dec["label"], "epsilon": dec["epsilon"],
                                               "merge_lr": dec["merge_lr"],
                                               "preserver": dec["preserver"], "lost": lost, "time": t_s,
                                               "calibrated": dec["calibrated"],
                                               "iteration_s": iter_s, "describe": r["describe"],
                                               "diff": diff_s})
    # rejected tries: would they have lost?
    rej_rows = []
    seen = set()
    for dec in res["decisions"]:
        if not dec["preserver"] or dec["epsilon"] == 0:
            continue
        chosen = plan_key(applied_updates(dec["schedule"]), dec["merge_lr"])
        for tr in dec["tries"]:
            if tr.accepted or tr.kind == "no_delay":
                continue
            key = plan_key(tr.plan, dec["merge_lr"])
            if key == chosen or key not in runs or (dec["label"], key) in seen:
                continue
            seen.add((dec["label"], key))
            r = runs[key]
            lost = loses(w, r, ddp)
            why = tr.rejected_on  # every rejected try of preserve() says why (feedback.REJECTIONS)
            assert why is not None, tr
            if why == NO_FASTER:  # not an accuracy decision: counted apart
                summary.setdefault("no_faster", []).append((not lost, dec["calibrated"]))
            else:
                cases.append((False, lost, dec["calibrated"], resolvable(r)))
            pk = progress_retained(warm.stats, r["schedule"], dec["merge_lr"])
            measured = (("lost" if lost else "kept accuracy") + " (not an accuracy decision)" if why == NO_FASTER
                        else "lost: match" if lost else "kept accuracy: MISMATCH")
            if not resolvable(r) and why != NO_FASTER:
                measured += " (within the spread)"
            it_r = iters_to(w, r, target)
            tr_s = tr.schedule.predicted_iteration_s if tr.schedule is not None else r["iteration_s"]
            t_r = "-" if it_r is None else f"{it_r * tr_s:.1f} s"
            rej_rows.append(f"| {dec['label']} | {r['describe']} | {tr_s * 1e3:.1f} | {tr.ratio:.4f} | "
                            f"{'' if pk is None else f'{pk:.3f}'} | {why} | "
                            f"{lanczos_verdict(warm, r['schedule'])} | {r['final_metric']:.4f} | {t_r} | "
                            f"{measured} |")
    if rej_rows:
        lines += ["", "Schedules the preserver rejected, trained anyway:", "",
                  "| setting | rejected schedule | ms/iteration (predicted) | ratio | progress kept | rejected on | "
                  "with Lanczos | final " + unit + " | predicted time to target | measured |",
                  "|---|---|---|---|---|---|---|---|---|---|", *rej_rows]
    plot_path = plot_dir / f"{name}_{w.name}.png"
    plot(res, target, plot_path)
    lines += ["", f"![{w.name}]({plot_path.name})", ""]  # relative to benchmarks/RESULTS.md, like the others
    summary["ddp_time"] = ddp_time
    return lines, cases, summary


def progress_retained(stats: WalkStats | None, s: Schedule, merge_lr: str = "none") -> float | None:
    """:func:`deft.preserver.feedback.progress_kept` (the preserver's "slower to target" rule), or None
    without statistics."""
    return None if stats is None else progress_kept(s, stats, merge_lr)


def lanczos_verdict(warm: WarmState, s: Schedule) -> str:
    if warm.lanczos is None or warm.lanczos["spec"] is None:
        return ""
    chk = check_stability(s, warm.lanczos["value"], warm.lanczos["spec"])
    return ("stable" if chk.stable else "unstable") + f" ({chk.radius:.3f})"


def targets(summaries: dict[str, dict[str, Any]], default_eps: float) -> list[str]:
    """The issue's targets, per workload, stated plainly."""
    out = ["## The issue's targets", ""]
    for (name, sm), calibrated in itertools.product(summaries.items(), (False, True)):
        # epsilon 0 and preserver off need no statistics: they belong to both lists
        rows = [r for r in sm.get("rows", [])
                if r["calibrated"] == calibrated or not r["preserver"] or r["epsilon"] == 0]
        if calibrated and not any(r["calibrated"] for r in rows):
            continue
        dflt = [r for r in rows if r["preserver"] and r["epsilon"] == default_eps and r["merge_lr"] == "none"]
        eps0 = next((r for r in rows if r["epsilon"] == 0), None)
        faster = [r for r in rows if r["preserver"] and r["epsilon"] > 0 and not r["describe"].endswith("(no delay)")
                  and r["time"] is not None and eps0 is not None and eps0["time"] is not None
                  and r["time"] < eps0["time"]]
        eps_rows = sorted((r for r in rows if r["preserver"] and r["merge_lr"] == "none"), key=lambda r: r["epsilon"])
        mono = all(b["iteration_s"] <= a["iteration_s"] * (1 + 1e-9) for a, b in itertools.pairwise(eps_rows))
        lost = any(r["lost"] for r in dflt)
        out.append(f"- **{name}**{' (after ddp.calibrate)' if calibrated else ''}: default epsilon "
                   f"{'loses more than 1 point / 2%: MISSED' if lost else 'within 1 point / 2% of torch DDP: met'} "
                   f"({', '.join(r['diff'] for r in dflt)}); "
                   f"a delayed or merged schedule reaching the target faster than epsilon 0: "
                   f"{'met (' + ', '.join(r['label'] for r in faster) + ')' if faster else 'not here'}; "
                   "larger epsilon never slower (predicted ms/iteration, preserver on): "
                   f"{'met' if mono else 'MISSED'}.")
    return out


def plot(res: dict[str, Any], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w: Workload = res["workload"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, r in res["runs"].items():
        xs = [e["iteration"] * r["iteration_s"] for e in r["evals"]]
        ax.plot(xs, [e["metric"] for e in r["evals"]], marker="o", ms=3,
                label=r["describe"] + (" = torch DDP's parameters, at epsilon 0's iteration time"
                                       if key == res["ddp_key"] else ""),
                lw=2 if key == res["ddp_key"] else 1)
    ax.axhline(target, color="grey", ls=":", lw=1, label="target")
    ax.set_xlabel("predicted training time, s (simulator, 2 x 250 Mbit/s)")
    ax.set_ylabel("test accuracy" if w.metric == "accuracy" else "validation loss")
    ax.set_title(w.title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def decision_counts(all_cases: list[tuple[str, bool, bool, bool, bool]]) -> str:
    """'matched of all' for the free secant's decisions and, where the probe ran, ddp.calibrate's; then the
    same among the cases whose outcome lies farther from the bar than torch DDP's data-order spread."""
    out = []
    for calibrated, how in ((False, "free secant curvature (no loss closure)"), (True, "after `ddp.calibrate`")):
        cs = [c for c in all_cases if c[3] == calibrated]
        if cs:
            matched = sum(1 for c in cs if c[2])
            clear = [c for c in cs if c[4]]
            m_clear = sum(1 for c in clear if c[2])
            out.append(f"{how}: {matched} of {len(cs)} ({100 * matched / len(cs):.0f}%); outside the data-order "
                       f"spread {m_clear} of {len(clear)}" + (f" ({100 * m_clear / len(clear):.0f}%)" if clear else ""))
    return "; ".join(out)


def no_faster_counts(summaries: dict[str, dict[str, Any]]) -> str:
    """The tries dropped as no faster than the no-delay plan (not cases), and how many kept accuracy."""
    out = []
    for calibrated, how in ((False, "free secant"), (True, "after calibrate")):
        nf = [kept for sm in summaries.values() for kept, cal in sm.get("no_faster", []) if cal == calibrated]
        if nf:
            out.append(f"{how}: {len(nf)} ({sum(nf)} of them kept accuracy)")
    return ("Tries dropped as predicted no faster than the no-delay plan, not counted: " + "; ".join(out) + "."
            if out else "")


def write_report(results: Path, command: str, seconds: float, all_cases: list[tuple[str, bool, bool, bool, bool]],
                 summaries: dict[str, dict[str, Any]], body: list[str]) -> str:
    """The markdown fragment (rewritten after every workload, so a late failure keeps the earlier ones)."""
    head = ["# Preserver validation: decisions against measured accuracy (issue 12)", "",
            f"Measured {time.strftime('%Y-%m-%d')} on the shared 2-core CPU box, one process, one thread "
            f"(other engineers' jobs ran beside it: training seconds are not reported, only predicted time). "
            f"Total {seconds:.0f} s.", "", "Command (repository root):", "", "```",
            f".venv/bin/{command.replace('python ', 'python ', 1)}", "```", "",
            "How (see the module docstring of benchmarks/bench_preserver_validation.py): two ranks emulated in one "
            "process (two half-batch gradients, their mean is the all-reduced gradient); the preserver's statistics "
            "gathered as the runtime gathers them during warm-up + profile iterations (noise from the two halves, "
            "noise-debiased secant curvature, the optimizer's rule from the real optimizer); the decision is "
            "`deft.runtime.planning.make_schedule` (real planner + preserver) on a profile of the workload at "
            "250 Mbit/s x 2 links; every schedule any try produced is then trained from the same warm-up point with "
            "its update timing emulated (no re-checks), evaluated as after `ddp.flush()`. Final metric: at the "
            "workload's iteration count (as an epoch budget); a schedule short of the target there runs on (up to "
            "the extension given per workload) only to time it. Time to target = iterations to target x the "
            "simulator's predicted iteration time for that schedule (the planner's prediction; torch DDP: "
            "`simulate_baseline('ddp')`): a prediction, not a measured wall time.", "",
            f"**Decisions matching the measured outcome: {decision_counts(all_cases)}** "
            "(accepted: kept within 1 point / 2% of torch DDP; rejected: would have lost more). "
            + no_faster_counts(summaries), ""]
    text = "\n".join(head + targets(summaries, DeftConfig().epsilon) + [""] + body) + "\n"
    # A hand-written reading of the tables, if the fragment has one, is kept (it starts at READING).
    old = results.read_text(encoding="utf-8") if results.exists() else ""
    if READING in old:
        text += "\n" + old[old.index(READING):]
    results.write_text(text, encoding="utf-8")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="cnn,lm,mlp")
    ap.add_argument("--epsilons", default="0,0.01,0.05,0.5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cnn-iters", type=int, default=88)
    ap.add_argument("--lm-iters", type=int, default=300)
    ap.add_argument("--mlp-iters", type=int, default=300)
    ap.add_argument("--max-schedules", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--data-orders", type=int, default=2,
                    help="torch DDP trained again on this many other data orders (the spread the bar is read against)")
    ap.add_argument("--no-probe", action="store_true", help="skip the Lanczos probe (ddp.calibrate's) at planning")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks",
                    help="the plots go here and the fragment into its results/ (a scratch run: elsewhere)")
    args = ap.parse_args()
    (args.out_dir / "results").mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    epsilons = [float(e) for e in args.epsilons.split(",")]
    makers = {"cnn": lambda: cnn_workload(args.seed, args.cnn_iters),
              "lm": lambda: lm_workload(args.seed, args.lm_iters),
              "mlp": lambda: mlp_workload(args.seed, args.mlp_iters)}
    names = args.only.split(",")
    command = ("python benchmarks/bench_preserver_validation.py " + " ".join(sys.argv[1:])).strip()
    body, all_cases, summaries = [], [], {}
    t0 = time.perf_counter()
    text = ""
    for name in names:
        res = run_workload(makers[name](), args, epsilons)
        lines, cases, summary = report_workload(res, args.out_dir, fragment_name(args.seed))
        body += lines
        all_cases += [(name, *c) for c in cases]
        summaries[name] = summary
        results = args.out_dir / "results" / f"{fragment_name(args.seed)}.md"
        text = write_report(results, command, time.perf_counter() - t0, all_cases, summaries, body)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"cases": all_cases}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
