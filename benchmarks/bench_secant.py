"""How far can the free secant curvature be trusted after a few warm-up iterations? (issue 12)

    .venv/bin/python benchmarks/bench_secant.py [--only mlp,cnn] [--seeds 0,1,2] [--iters 4,8,16]

One process, one thread, no network. The workloads, warm-up and two emulated ranks are those of
``benchmarks/bench_preserver_validation.py`` (two half-batch gradients per iteration; their mean is
the all-reduced gradient; the real optimizer steps on it). After ``n`` synchronous iterations it
compares, at the same point, estimates of the top Hessian eigenvalue ``lam`` that the stability check
needs:

* **raw secant**: median over the ``n - 1`` consecutive pairs of ``|Δg| / |Δx|`` (averaged gradients,
  parameter moves; :class:`deft.preserver.curvature.SecantCurvature`);
* **debiased** (what the runtime uses): the same with the mini-batch noise ``2 tr(Σ) / B`` removed
  from ``|Δg|²`` (``tr Σ`` from the two halves, :class:`deft.preserver.noise.NoiseEstimator`);
* **cross**: an estimator that needs no noise estimate: the two ranks' own differences
  ``Δg_a, Δg_b`` carry independent noise, so with ``N`` ranks
  ``(N |Δg_mean|² - mean_r |Δg_r|²) / (N - 1)`` is unbiased for the noise-free ``|H Δx|²`` of the
  pair; shown as the median of the pairs' ratios and pooled (``sqrt(Σ s² / Σ |Δx|²)``);
* **Lanczos**: what ``ddp.calibrate`` measures (``tol 0.05, ncv 4``) on the next global batch.

For a quadratic loss every noise-free secant is at most ``lam``; above it, the estimate is noise.
Writes ``benchmarks/results/secant.md``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_preserver_validation as pv  # the workloads and the two-rank emulation

from deft.preserver.curvature import SecantCurvature, top_eigenvalue
from deft.preserver.noise import LocalStats, NoiseEstimator

RESULTS = pv.ROOT / "benchmarks" / "results" / "secant.md"
MAKERS = {"mlp": pv.mlp_workload, "cnn": pv.cnn_workload}


def _dist2(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float(((x - y).double() ** 2).sum()) for x, y in zip(a, b, strict=True))


def measure(name: str, seed: int, n: int) -> dict[str, float]:
    """The estimates after ``n`` synchronous iterations from seed ``seed``'s initial model."""
    w = MAKERS[name](seed, 100)
    torch.manual_seed(seed)
    model = w.make_model()
    opt = w.make_opt(model)
    gen = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    sec, noise = SecantCurvature(), NoiseEstimator()
    prev = None
    cross: list[float] = []
    pairs: list[tuple[float, float]] = []
    for _ in range(n):
        x, y = w.batch(gen)
        per, _ = pv.grads_of(w, model, x, y)
        g = pv.mean_of(per)
        sec.observe(params, g)
        noise.update([LocalStats(pv._sq(gr), None, None, len(x) // pv.WORLD) for gr in per], pv._sq(g))
        now = ([p.detach().clone() for p in params], [[t.clone() for t in gr] for gr in per], [t.clone() for t in g])
        if prev is not None:
            dx = _dist2(now[0], prev[0])
            dg_mean = _dist2(now[2], prev[2])
            dg_local = [_dist2(now[1][r], prev[1][r]) for r in range(pv.WORLD)]
            s2 = (pv.WORLD * dg_mean - sum(dg_local) / pv.WORLD) / (pv.WORLD - 1)
            cross.append(math.sqrt(max(0.0, s2) / dx))
            pairs.append((s2, dx))
        prev = now
        pv.apply(model, opt, g)
    noise_sq = 2.0 * noise.estimate.trace / w.global_batch
    x, y = w.batch(torch.Generator().manual_seed(seed + 99))  # the validation's probe batch
    h = len(x) // pv.WORLD
    est = top_eigenvalue(lambda: sum(w.loss_fn(model, x[r * h:(r + 1) * h], y[r * h:(r + 1) * h])
                                     for r in range(pv.WORLD)) / pv.WORLD,
                         params, tol=0.05, ncv=4, maxiter=300)
    return {"raw": sec.value, "debiased": sec.debiased(noise_sq), "screen": sec.screen(noise_sq)[0],
            "cross_median": statistics.median(cross),
            "cross_pooled": math.sqrt(max(0.0, sum(s for s, _ in pairs)) / sum(d for _, d in pairs)),
            "lanczos": est.value}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="mlp")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--iters", default="4,8,16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = ["| workload | seed | iterations | raw secant | debiased (runtime) | screen (runtime) | cross, median | "
            "cross, pooled | Lanczos | screen / Lanczos |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.only.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            for n in (int(v) for v in args.iters.split(",")):
                m = measure(name, seed, n)
                print(name, seed, n, {k: round(v, 3) for k, v in m.items()}, flush=True)
                rows.append(f"| {name} | {seed} | {n} | {m['raw']:.3g} | {m['debiased']:.3g} | {m['screen']:.3g} | "
                            f"{m['cross_median']:.3g} | {m['cross_pooled']:.3g} | {m['lanczos']:.3g} | "
                            f"{m['screen'] / m['lanczos']:.1f} |")
    command = ".venv/bin/python benchmarks/bench_secant.py " + " ".join(sys.argv[1:])
    text = "\n".join(["# The free secant curvature against Lanczos after a few iterations (issue 12)", "",
                      f"Measured {time.strftime('%Y-%m-%d')}, one process, one thread, "
                      f"{time.perf_counter() - t0:.0f} s. Command (repository root):", "", "```",
                      command.strip(), "```", "", "How: see the module docstring of benchmarks/bench_secant.py. "
                      "The deft runtime's default is 1 + 3 = 4 synchronous iterations before planning.", "",
                      *rows, ""])
    old = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else ""
    reading = "## What it says"
    if reading in old:
        text += "\n" + old[old.index(reading):]
    RESULTS.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
