"""deft's host tax at world size 1 on the CPU: torch DDP against deft, one gloo rank, nothing to schedule.

    python benchmarks/bench_host_tax.py [--models digits_cnn,resnet101] [--repeats 3] [--iters 5] [--note TEXT]

At world size 1 no gradient crosses a link, so whatever deft does per iteration beyond the module's own
forward, backward and step is pure cost. This process is the only rank of a gloo group (a file store);
for each model it builds three wrappers of the same initial model, each with its own SGD (lr 0.01,
momentum 0.9) and the same synthetic batch:

* ``torch``: ``torch.nn.parallel.DistributedDataParallel``;
* ``deft``: ``deft.DistributedDataParallel`` with its default config (solo at world size 1);
* ``deft-machinery``: deft with ``solo = false``: gradient capture, warm-up timer, profile, plan, planner
  thread and executor running on one rank (what deft cost there before it went solo).

Iterations are interleaved, one of each wrapper in turn (the order rotated every round), so a load
change on the shared machine hits every wrapper alike. An iteration is timed from its forward to the end
of ``optimizer.zero_grad()``. The first ``--skip`` iterations of each wrapper are left out (deft's
warm-up, profile and plan with ``solo = false``); then ``--repeats`` blocks of ``--iters`` iterations.
Reported per wrapper: the median of all timed iterations and the spread of the blocks' medians;
the ratio is paired: torch DDP's iteration / the wrapper's iteration of the same round, its median over
the rounds (above 1: faster than torch DDP), as the machine's load moves between rounds.

Models: the digits CNN of ``examples/models.py`` (4.4M parameters, batch 32 x 1 x 32 x 32) and ResNet-101
(torchvision's layout, bottleneck blocks 3-4-23-3, 44.5M parameters in 314 tensors, written out here:
torchvision is not installed) at a CPU-sized batch of 8 x 3 x 64 x 64. Writes
``benchmarks/results/host_tax.md`` (``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "host_tax.md"
WRAPPERS = ("torch", "deft", "deft-machinery")


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck (v1.5: the stride on the 3x3 convolution)."""

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.down = None if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + (x if self.down is None else self.down(x)))


def resnet101(num_classes: int = 1000) -> nn.Module:
    """torchvision's ``resnet101()`` layout, without torchvision."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    c_in = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 23, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(c_in, width, stride if b == 0 else 1))
            c_in = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes)]
    return nn.Sequential(*layers)


def digits_cnn() -> nn.Module:
    """The digits CNN of ``examples/models.py``."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    from models import DigitsCNN

    return DigitsCNN()


# name -> (model factory, input shape, classes)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "digits_cnn": (digits_cnn, (32, 1, 32, 32), 10),
    "resnet101": (resnet101, (8, 3, 64, 64), 1000),
}


def wrap(kind: str, model: nn.Module, opt: torch.optim.Optimizer) -> nn.Module:
    import deft

    if kind == "torch":
        return nn.parallel.DistributedDataParallel(model)
    return deft.DistributedDataParallel(model, optimizer=opt, config={"solo": kind == "deft"})


def measure(name: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Every wrapper's iteration times on model ``name``, interleaved (module docstring)."""
    factory, shape, classes = MODELS[name]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g)
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for kind in WRAPPERS:
        torch.manual_seed(0)
        model = factory()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        runs[kind] = (wrap(kind, model, opt), opt)
    times: dict[str, list[float]] = {k: [] for k in WRAPPERS}
    for it in range(args.skip + args.repeats * args.iters):
        shift = it % len(WRAPPERS)
        for kind in WRAPPERS[shift:] + WRAPPERS[:shift]:
            wrapped, opt = runs[kind]
            start = time.perf_counter()
            nn.functional.cross_entropy(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad()
            times[kind].append(time.perf_counter() - start)
        if it == args.skip - 1:
            print(f"[host_tax] {name}: warm-up done", flush=True)
    for kind in WRAPPERS[1:]:
        runs[kind][0].close()  # type: ignore[operator]
    return {k: v[args.skip:] for k, v in times.items()}


def summary(times: list[float], iters: int) -> tuple[float, float, float]:
    """(median, lowest block median, highest block median) of ``times``, one value per iteration."""
    blocks = [statistics.median(times[i:i + iters]) for i in range(0, len(times), iters)]
    return statistics.median(times), min(blocks), max(blocks)


def paired(times: dict[str, list[float]], kind: str) -> list[float]:
    """torch DDP's time / ``kind``'s, round by round: the two ran back to back, under the same load."""
    return [t / k for t, k in zip(times["torch"], times[kind], strict=True)]


def report(results: dict[str, dict[str, list[float]]], args: argparse.Namespace, command: str,
           load: tuple[float, float]) -> str:
    lines = ["## Host tax at world size 1 (CPU, gloo)", "", f"    {command}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{torch.get_num_threads()} intra-op thread(s); {args.note or 'shared with other jobs'} (load average "
             f"{load[0]:.1f} at the start, {load[1]:.1f} at the end). One gloo rank; each wrapper's own model and "
             f"SGD, the same batch; iterations interleaved, order rotated; {args.skip} left out, then "
             f"{args.repeats} blocks of {args.iters}. Times: median iteration in ms [lowest-highest block median]. "
             "Ratio: the median over the rounds of torch DDP's iteration / the wrapper's iteration of the same "
             "round [lowest-highest block median]; above 1, faster than torch DDP. `deft` is the default (solo at "
             "world size 1); `solo = false` runs deft's machinery (gradient capture, profile, plan, executor) on "
             "one rank. ResNet-101 is torchvision's layout written out in the benchmark (torchvision is not "
             "installed here).", "",
             "| model | batch | torch DDP | deft | deft, solo = false | torch DDP / deft | "
             "torch DDP / deft (solo = false) |", "|---|---|---|---|---|---|---|"]
    losses, machinery = [], []
    for name, times in results.items():
        cells = [f"{1e3 * m:.1f} [{1e3 * lo:.1f}-{1e3 * hi:.1f}]"
                 for m, lo, hi in (summary(times[k], args.iters) for k in WRAPPERS)]
        ratios = {k: summary(paired(times, k), args.iters) for k in WRAPPERS[1:]}
        cells += [f"{m:.3f} [{lo:.3f}-{hi:.3f}]" for m, lo, hi in ratios.values()]
        shape = "x".join(str(d) for d in MODELS[name][1])
        lines.append(f"| {name} | {shape} | {' | '.join(cells)} |")
        if ratios["deft"][0] < 1:
            losses.append(f"{name} ({ratios['deft'][0]:.3f})")
        machinery.append(f"{ratios['deft-machinery'][0]:.3f} on {name}")
    lines.append("")
    lines.append(f"Where deft loses: {'on ' + ', '.join(losses) if losses else 'nowhere in this run'} with its "
                 f"default at world size 1. Its machinery on one rank (`solo = false`): torch DDP / deft = "
                 f"{', '.join(machinery)}. torch DDP runs its reducer even on one rank (every gradient copied "
                 "into its bucket, a gloo all-reduce, the division by the world size, copied back); deft's default "
                 "runs none of it, so on a model with many gradient bytes it can be faster than torch DDP.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    ap.add_argument("--skip", type=int, default=10, help="iterations of each wrapper left out first")
    ap.add_argument("--repeats", type=int, default=3, help="blocks of timed iterations")
    ap.add_argument("--iters", type=int, default=5, help="iterations per block")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--note", default="", help="a line on how the runs were made (goes into the report)")
    ap.add_argument("--no-write", action="store_true", help=f"print the report only; do not write {RESULTS.name}")
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    for flag, v in (("--skip", args.skip), ("--repeats", args.repeats), ("--iters", args.iters),
                    ("--threads", args.threads)):
        if v < 1:
            ap.error(f"{flag}: expected an integer >= 1, got {v}")
    torch.set_num_threads(args.threads)
    command = ".venv/bin/python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_host_tax.py", *sys.argv[1:]])
    start_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(tmp) / "store"), 1), rank=0, world_size=1)
        try:
            results: dict[str, Any] = {n: measure(n, args) for n in names}
        finally:
            dist.destroy_process_group()
    text = report(results, args, command, (start_load, os.getloadavg()[0]))
    print(text)
    if not args.no_write:
        RESULTS.write_text(text, encoding="utf-8")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
