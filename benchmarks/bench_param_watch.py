"""What the watch over the parameters costs the loop between ``optimizer.step()`` and the next forward.

deft arms a ``TorchFunctionMode`` (:class:`deft.runtime.param_watch.ParamWatch`) from the user's step to
the next forward while updates are left finishing in it. Every torch function the loop calls there
pays a Python call. The window's usual work is the next batch: here a ``DataLoader`` without workers
over the digits set with a per-sample normalisation (the heaviest such window in the project's
examples), timed bare, with the watch armed over a model's parameters, and with a do-nothing function
mode (the floor of any mode), side by side in one process, alternating, ``--repeats`` times each:

    .venv/bin/python benchmarks/bench_param_watch.py [--batch 64] [--repeats 30] [--results F]

The ratio to the bare window is the figure; a window of the loop without the next batch (``zero_grad``,
a scheduler step) is timed the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.overrides import TorchFunctionMode

from deft.runtime.param_watch import ParamWatch

HERE = Path(__file__).resolve().parent


class _Noop(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class _Digits(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    def __init__(self) -> None:
        d = load_digits()
        self.x = torch.tensor(d.images, dtype=torch.float32)
        self.y = d.target.tolist()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = self.x[i].unsqueeze(0) / 16.0
        return (img - 0.5) / 0.5, self.y[i]


def _timed(fn: Callable[[], None], mode: Callable[[], object] | None) -> float:
    t0 = time.perf_counter()
    if mode is None:
        fn()
    else:
        with mode():  # type: ignore[attr-defined]
            fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--results", type=Path, default=HERE / "results" / "param_watch.md")
    ap.add_argument("--iteration-ms", type=float, default=156.0,
                    help="an iteration to set the watch's extra against (default: the digits CNN's "
                         "computation-only iteration, results/peers.md, 250 Mbit/s table)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 36, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    loader = torch.utils.data.DataLoader(_Digits(), batch_size=args.batch, shuffle=True)
    batches = iter(loader)

    def next_batch() -> None:
        nonlocal batches
        try:
            next(batches)
        except StopIteration:
            batches = iter(loader)
            next(batches)

    def bookkeeping() -> None:
        opt.zero_grad()
        sched.step()

    watch = ParamWatch(lambda what: None)

    class _Armed:
        def __enter__(self) -> None:
            watch.arm([(str(i), p) for i, p in enumerate(model.parameters())])

        def __exit__(self, *exc: object) -> None:
            watch.disarm()

    windows = {"the next batch": next_batch, "zero_grad and a scheduler step": bookkeeping}
    modes: dict[str, Callable[[], object] | None] = {"bare": None, "watched": _Armed, "do-nothing mode": _Noop}
    rows = []
    for wname, fn in windows.items():
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(3):
            fn()
        for _ in range(args.repeats):
            for m, mode in modes.items():
                times[m].append(_timed(fn, mode))
        med = {m: statistics.median(v) for m, v in times.items()}
        rows.append((wname, med))
    lines = ["## The watch over the parameters between the step and the forward (`benchmarks/bench_param_watch.py`)",
             "", f"`.venv/bin/python benchmarks/bench_param_watch.py --batch {args.batch} --repeats {args.repeats}`"
             " (one process on the 2-core machine, the three timed alternately; medians).", "",
             "| window | bare | watched | do-nothing mode | watched / bare | extra per iteration of "
             f"{args.iteration_ms:g} ms |", "| --- | --- | --- | --- | --- | --- |"]
    for wname, med in rows:
        lines.append(f"| {wname} | {med['bare'] * 1e3:.3f} ms | {med['watched'] * 1e3:.3f} ms | "
                     f"{med['do-nothing mode'] * 1e3:.3f} ms | {med['watched'] / med['bare']:.2f}x | "
                     f"{(med['watched'] - med['bare']) * 1e5 / args.iteration_ms:.2f} % |")
    lines += ["", "The watch is armed only while a lag-free plan has left updates finishing (the window "
              "between the user's step and the next forward); a loop with no deferred update pays nothing. "
              "Most of its price is the floor of any function mode (the do-nothing column): a Python call per "
              "torch function. Where deft loses: this window runs up to twice as slow as without deft; the "
              f"iteration it sits in, by the last column's share of a {args.iteration_ms:g} ms iteration "
              "(the digits CNN's computation-only iteration, `results/peers.md`)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        args.results.write_text(text)


if __name__ == "__main__":
    main()
