"""Simulated comparison of deft with the baselines on the reference profiles; prints markdown.

    .venv/bin/python benchmarks/bench_simulate.py [--out FILE]

Tables: (1) VGG-19 as a user runs it: the planner's first plan (preserver off) and the default
pipeline (preserver on) for stated walk statistics; (2) every scheme on every profile in
examples/profiles (iteration time, deft's speed-up over the scheme, bubbles, updates per iteration;
"deft" there is the planner's first plan); (3) the ablations the paper runs (one link instead of two;
``epsilon = 0``, i.e. no delayed update); (4) VGG-19 scaled to 8..1024 workers with the ring
all-reduce model; (5) how long planning and simulating take.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from deft.config import DeftConfig
from deft.errors import ContractError, DeftError
from deft.preserver.feedback import WalkStats
from deft.profile import BucketTimes, Profile
from deft.solver.cli import describe_stats, simulate_pipeline
from deft.solver.compare import SCHEMES, simulate
from deft.solver.simulate import SimResult

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "examples" / "profiles"
ORDER = ("ddp", "wfbp", "mgwfbp", "bytescheduler", "usbyte", "deft")
# Walk statistics for the default pipeline: a run before it has measured them (None), then a gradient
# from strong to weak against the loss (lr * mu = 0.05, 0.015, 0.005 at loss 2).
PIPELINE_STATS: tuple[WalkStats | None, ...] = (
    None,
    WalkStats(loss=2.0, mu=1.0, sigma=20.0, lr=0.05, batch=512),
    WalkStats(loss=2.0, mu=0.3, sigma=20.0, lr=0.05, batch=512),
    WalkStats(loss=2.0, mu=0.1, sigma=20.0, lr=0.05, batch=512),
)


def single_link(profile: Profile) -> Profile:
    """The profile restricted to its primary link (the paper's "DeFT without multi-link")."""
    name = profile.links[0].name
    times = tuple(BucketTimes(t.forward_s, t.backward_s, {name: t.comm_s[name]} if name in t.comm_s else {})
                  for t in profile.times)
    return replace(profile, links=profile.links[:1], times=times)


def compare(profile: Profile, config: DeftConfig, workers: int | None = None) -> dict[str, SimResult | str]:
    """Every scheme; a scheme that cannot run on this profile gives the reason instead of a result."""
    out: dict[str, SimResult | str] = {}
    for s in ORDER:
        try:
            out[s] = simulate(profile, s, config, workers=workers)
        except DeftError as e:
            out[s] = f"n/a: {e.problem if isinstance(e, ContractError) else e}"
    return out


def _ms(r: SimResult | str) -> str:
    return f"{r.iteration_s * 1e3:.1f}" if isinstance(r, SimResult) else "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the markdown to this file")
    args = ap.parse_args(argv)
    cfg = DeftConfig()
    lines: list[str] = []
    emit = lines.append

    vgg = Profile.load(PROFILES / "vgg19.json")
    ddp = simulate(vgg, "ddp", cfg)
    emit("### VGG-19 as a user runs it (simulated, 16 workers, default config: epsilon 0.01)\n")
    emit("| deft as run | walk statistics | schedule | iteration ms | speed-up over DDP | updates/iter |")
    emit("|---|---|---|---:|---:|---:|")
    first = simulate(vgg, "deft", cfg)
    sched = first.meta["schedule"]
    emit(f"| preserver off (`preserver = false`): the planner's first plan | not used | cycle {sched.cycle}, "
         f"K = {list(sched.batch_sequence)} ({sched.meta['mode']}) | {first.iteration_s * 1e3:.1f} | "
         f"{(first.speedup_over(ddp) - 1) * 100:+.0f}% | {first.updates_per_iteration:.2f} |")
    for stats in PIPELINE_STATS:
        r, chosen = simulate_pipeline(vgg, cfg, stats)
        s = chosen.schedule
        emit(f"| default (preserver on) | {describe_stats(stats).split(' (')[0]} | cycle {s.cycle}, "
             f"K = {list(s.batch_sequence)} ({s.meta['mode']}) | {r.iteration_s * 1e3:.1f} | "
             f"{(r.speedup_over(ddp) - 1) * 100:+.0f}% | {r.updates_per_iteration:.2f} |")
    emit(f"\nDDP: {ddp.iteration_s * 1e3:.1f} ms.\n")

    emit("### Every scheme on the reference profiles (simulated, 16 workers, epsilon 0.01)\n")
    emit("| model | scheme | iteration ms | deft speed-up over it | bubbles | updates/iter | link utilisation |")
    emit("|---|---|---:|---:|---:|---:|---|")
    timings: dict[str, float] = {}
    for path in sorted(PROFILES.glob("*.json")):
        p = Profile.load(path)
        res = {}
        for s in ORDER:
            t0 = time.perf_counter()
            res[s] = simulate(p, s, cfg)
            timings[f"{p.model} {s}"] = time.perf_counter() - t0
        deft = res["deft"]
        for s in ORDER:
            r = res[s]
            util = ", ".join(f"{k} {v:.0%}" for k, v in r.link_utilization.items() if v > 0)
            label = "deft (first plan, preserver off)" if s == "deft" else s
            emit(f"| {p.model} ({p.source}) | {label} | {r.iteration_s * 1e3:.1f} | "
                 f"{(deft.speedup_over(r) - 1) * 100:+.0f}% | {r.bubble_ratio:.0%} | {r.updates_per_iteration:.2f} | "
                 f"{util} |")
        sched = deft.meta["schedule"]
        emit(f"| {p.model} | *compute bound* | {deft.compute_bound_s * 1e3:.1f} | deft cycle {sched.cycle}, "
             f"K = {list(sched.batch_sequence)}, {sched.n_buckets} buckets | | | |")

    emit("\n### Ablations (VGG-19, 16 workers)\n")
    emit("| variant | iteration ms | vs compute bound | updates/iter | K |")
    emit("|---|---:|---:|---:|---|")
    for label, prof, c in (("deft, nccl + gloo, epsilon 0.01", vgg, cfg),
                           ("deft, nccl only (no heterogeneous link)", single_link(vgg), cfg),
                           ("deft, epsilon 0 (no delayed update, two links)", vgg, DeftConfig(epsilon=0.0)),
                           ("deft, epsilon 0, nccl only", single_link(vgg), DeftConfig(epsilon=0.0))):
        r = simulate(prof, "deft", c)
        emit(f"| {label} | {r.iteration_s * 1e3:.1f} | {r.iteration_s / r.compute_bound_s:.2f}x | "
             f"{r.updates_per_iteration:.2f} | {list(r.meta['schedule'].batch_sequence)} |")

    emit("\n### VGG-19 scaled with the ring all-reduce model (iteration ms; deft's updates/iteration)\n")
    emit("| workers | " + " | ".join(ORDER) + " | deft updates/iter |")
    emit("|---:|" + "---:|" * (len(ORDER) + 1))
    notes = []
    for n in (8, 16, 32, 64, 128, 1024):
        res = compare(vgg, cfg, n)
        d = res["deft"]
        upd = f"{d.updates_per_iteration:.2f}" if isinstance(d, SimResult) else "n/a"
        emit(f"| {n} | " + " | ".join(_ms(res[s]) for s in ORDER) + f" | {upd} |")
        notes += [f"- {n} workers, {s}: {r}" for s, r in res.items() if isinstance(r, str)]
    lines.extend(["", *notes] if notes else [])

    emit("\n### Cost of planning + simulating one scheme (wall seconds, this machine)\n")
    emit("| model | " + " | ".join(ORDER) + " |")
    emit("|---|" + "---:|" * len(ORDER))
    for model in sorted({k.split()[0] for k in timings}):
        emit(f"| {model} | " + " | ".join(f"{timings[f'{model} {s}']:.3f}" for s in ORDER) + " |")

    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    assert set(ORDER) == set(SCHEMES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
