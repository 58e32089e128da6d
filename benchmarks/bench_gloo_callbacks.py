"""What a Python callback on gloo's worker thread costs a link while the training thread runs Python.

    sudo .venv/bin/python benchmarks/bench_gloo_callbacks.py [--rate-mbit 250] [--sends 40] [--reps 5]
        [--switch-ms 5,1,0.5]

Two hosts of the testbed, one link. Each rank launches ``--sends`` all-reduces of 100,000 fp16
elements (200 KB) at once on the link's group and keeps its main thread busy in pure Python (holding
the GIL, as a model's Python between torch's kernels does) until all have completed: the time from the
launches to the last completion (and, for a waiter, its last stamp), per rep. Six cells: the group
with gloo's own two worker threads or one (``deft.runtime.link_queue.serial_gloo_group``), and each send
without a callback, with a ``then`` callback that copies its result back (as torch's
``fp16_compress_hook`` decompresses; deft's ``cast_send`` does not), or stamped by a *waiter*, a Python
thread of its own waiting on the sends in launch order (``deft.runtime.completions``, as deft stamps
its sends). The callback runs on the gloo thread that completed the send, which first waits for the
GIL, up to Python's switch interval (each of ``--switch-ms``; deft holds ``switch_interval_ms`` while
it runs). Results go to their section of ``benchmarks/results/gloo_callbacks.md`` unless
``--no-write``. Both ranks' gloo threads and their busy main threads share the machine's cores: the
table says how many.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_links import command_line, handle_signals, machine, run_ranks, update_section  # noqa: E402
from deft.testbed import Testbed  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gloo_callbacks.md"
SENDS = ("no callback", "callback", "waiter")
CELLS = [(serial, send) for serial in (False, True) for send in SENDS]


def waiter(futures: queue.SimpleQueue[torch.futures.Future[object] | None], stamps: list[float]) -> None:
    """Stamp each future's completion in launch order from a Python thread of its own (``wait`` lets the
    GIL go): what a send's completion time costs without a callback on gloo's thread."""
    while (fut := futures.get()) is not None:
        fut.wait()
        stamps.append(time.perf_counter())


def worker(sends: int, reps: int, switch_ms: list[float]) -> None:
    """One rank: every cell at every interval, ``reps`` times; prints one JSON line of milliseconds per cell."""
    import torch.distributed as dist

    from deft.runtime.link_queue import serial_gloo_group

    dist.init_process_group("gloo")
    out: dict[str, list[float]] = {}
    groups = {serial: serial_gloo_group(None, 120.0, None) if serial else dist.new_group(backend="gloo")
              for serial in (False, True)}
    for (serial, send), ms in ((cell, ms) for ms in switch_ms for cell in CELLS):
        sys.setswitchinterval(ms / 1000)
        group, times = groups[serial], []
        for _ in range(reps + 1):  # the first rep warms the group's connections up: dropped
            buffers = [torch.randn(100_000) for _ in range(sends)]
            dist.barrier(group=group)
            t0 = time.perf_counter()
            futures, stamps = [], []
            pending: queue.SimpleQueue[torch.futures.Future[object] | None] = queue.SimpleQueue()
            stamper = threading.Thread(target=waiter, args=(pending, stamps), daemon=True)
            stamper.start()
            for b in buffers:
                fut = dist.all_reduce(b.to(torch.float16).div_(2), group=group, async_op=True).get_future()
                if send == "callback":
                    fut = fut.then(lambda f, b=b: b.copy_(f.value()[0]))
                elif send == "waiter":
                    pending.put(fut)
                futures.append(fut)
            pending.put(None)
            while not all(f.done() for f in futures) or (send == "waiter" and len(stamps) < sends):
                x = 0
                for i in range(20_000):  # pure Python: the GIL held between checks
                    x += i
            times.append(1000 * (time.perf_counter() - t0))
            stamper.join()
        out[f"{ms:g} ms, {'serial' if serial else 'two threads'}, {send}"] = times[1:]
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # torch 2.13's gloo may abort at teardown


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), [float(x) for x in sys.argv[4].split(",")])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-mbit", type=float, default=250.0)
    ap.add_argument("--sends", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--switch-ms", default="5,1,0.5",
                    help="comma-separated GIL switch intervals in ms (sys.setswitchinterval; Python's own is 5)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    handle_signals()
    with Testbed(hosts=2, links=1, rate_mbit=args.rate_mbit, prefix="gcb") as tb:
        logs = run_ranks(tb, [sys.executable, str(Path(__file__).resolve()), "--worker", str(args.sends),
                              str(args.reps), str(args.switch_ms)], timeout_s=600, label="callbacks")
    result = json.loads(next(line for line in logs[0].splitlines() if line.startswith("RESULT "))[7:])
    wire_ms = args.sends * 100_000 * 2 * 8 / (args.rate_mbit * 1e3)  # one rank's bytes at the link's rate
    rows = [f"| {cell} | {statistics.median(t):.0f} | {min(t):.0f}-{max(t):.0f} | "
            f"{statistics.median(t) / wire_ms:.2f} |" for cell, t in result.items()]
    text = "\n".join([
        "## A callback on gloo's thread against the training thread's GIL (`benchmarks/bench_gloo_callbacks.py`)",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}. Testbed: 2 hosts, one link at {args.rate_mbit:g} Mbit/s; the cores shared by "
        f"both ranks' gloo threads and their busy main threads. {args.sends} fp16 all-reduces of 200 KB "
        f"launched at once, {args.reps} reps (rank 0's times; a warm-up rep dropped) at each GIL switch "
        f"interval; the bytes alone take {wire_ms:.0f} ms at the link's rate (ring of 2: each rank sends its "
        "buffer once).",
        "",
        "| switch interval, group, send | median (ms) | range | / the bytes' time |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    print(text)
    if not args.no_write:  # the section only: a reading written by hand after it stays
        update_section("gloo_callbacks", text, RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
