"""The testbed's own CPU cost: what a shaped link's all-reduce takes from the model's compute.

    sudo .venv/bin/python benchmarks/bench_testbed_cpu.py [--rate 250] [--mib 16] [--reps 5]

On this machine the two ranks, their gloo threads and the kernel's network stack share 2 cores, so
every CPU second a link spends is taken from the model exactly when communication overlaps compute.
This measures that cost for two tbf settings of the same testbed (2 hosts x 2 links at ``--rate``):

* ``1 ms burst``: the testbed as it was (tbf burst = 1 ms of traffic, 31 KB at 250 Mbit/s). A TCP
  packet handed to the veth is up to 64 KiB (GSO); tbf splits every packet longer than its burst into
  1500-byte frames in software, and each frame then crosses the veth and the peer's stack alone;
* ``GSO burst``: the testbed now (:func:`deft.testbed.tbf_params`: at least two of the device's
  largest GSO packets), where those packets pass whole.

Per setting, one rank per host (``torch.set_num_threads(1)``, as examples/train_cnn.py):

* an all-reduce of ``--mib`` MiB on nic0 alone and ``--mib``/2 MiB on each link at once: wall time,
  and the CPU time (user, system) of rank 0's process per all-reduce (gloo threads included);
* a fixed amount of compute (matrix products, about 0.2 s) alone, and while the both-links
  all-reduce runs in the background: the slowdown is the CPU the links took from it.

The figures are rank 0's (an all-reduce ends on both ranks together, so its wall time is the
same on both). Results go to ``benchmarks/results/testbed.md`` (section "testbed_cpu").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_links import command_line, handle_signals, machine, run_ranks, update_section  # noqa: E402

from deft.testbed import Testbed, tbf_params  # noqa: E402


def _cpu() -> tuple[float, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def worker(mib: float, reps: int, out: str) -> None:
    """One rank: the measurements above; rank 0 writes them to ``out`` as JSON."""
    import torch
    import torch.distributed as dist

    from deft.netif import new_group_on_nic

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    second = new_group_on_nic("gloo", "nic1", 120.0, None)
    whole = torch.randn(int(mib * 2**20 / 4))
    halves = [torch.randn(whole.numel() // 2), torch.randn(whole.numel() // 2)]
    a, b = torch.randn(384, 384), torch.randn(384, 384)

    def compute() -> float:
        t = time.perf_counter()
        for _ in range(60):
            a.mm(b)
        return time.perf_counter() - t

    def timed(fn: Any) -> dict[str, float]:
        fn()  # warm: connections, allocations
        dist.barrier()
        walls, users, syss = [], [], []
        for _ in range(reps):
            u0, s0 = _cpu()
            t0 = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t0)
            u1, s1 = _cpu()
            users.append(u1 - u0)
            syss.append(s1 - s0)
            dist.barrier()
        return {"wall_s": min(walls), "user_s": sum(users) / reps, "sys_s": sum(syss) / reps}

    def one_link() -> None:
        dist.all_reduce(whole)

    def both_links() -> None:
        w = [dist.all_reduce(halves[0], async_op=True), dist.all_reduce(halves[1], group=second, async_op=True)]
        for x in w:
            x.wait()

    res = {"one_link": timed(one_link), "both_links": timed(both_links)}
    alone = [compute() for _ in range(reps + 1)][1:]
    beside = []
    for _ in range(reps):
        dist.barrier()
        w = [dist.all_reduce(halves[0], async_op=True), dist.all_reduce(halves[1], group=second, async_op=True)]
        beside.append(compute())
        for x in w:
            x.wait()
    res["compute_alone_s"] = min(alone)
    res["compute_beside_comm_s"] = sorted(beside)[len(beside) // 2]
    if rank == 0:
        Path(out).write_text(json.dumps(res), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


def measure(rate: float, burst: int | None, mib: float, reps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, Testbed(hosts=2, links=2, rate_mbit=rate, burst_bytes=burst) as tb:
        out = Path(tmp) / "cpu.json"
        qdisc = tb.run(0, ["tc", "qdisc", "show", "dev", "nic0"]).strip()
        print(f"[bench_testbed_cpu] {qdisc}", flush=True)
        run_ranks(tb, [sys.executable, str(Path(__file__).resolve()), "--worker", "--mib", str(mib),
                       "--reps", str(reps), "--out", str(out)], timeout_s=600, label=f"burst {burst or 'gso'}")
        doc = json.loads(out.read_text())
        doc["qdisc"] = qdisc
        return doc


def report(rate: float, mib: float, rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["## The testbed's CPU cost per all-reduce (`benchmarks/bench_testbed_cpu.py`)", "",
             f"Command: `{command_line()}`  ", f"Machine: {machine()}; 2 hosts x 2 links at {rate:g} Mbit/s, one "
             "rank per host, one compute thread each; rank 0's process CPU (gloo threads and the system "
             "calls they make included), mean per all-reduce; wall: best of the repetitions.", "",
             "| tbf setting | all-reduce | wall (ms) | CPU user (ms) | CPU system (ms) | CPU per MiB (ms) |",
             "|---|---|---|---|---|---|"]
    for name, doc in rows:
        for key, what in (("one_link", f"{mib:g} MiB on nic0"), ("both_links", f"{mib / 2:g} MiB on each link")):
            m = doc[key]
            cpu = m["user_s"] + m["sys_s"]
            lines.append(f"| {name} | {what} | {m['wall_s'] * 1e3:.0f} | {m['user_s'] * 1e3:.0f} | "
                         f"{m['sys_s'] * 1e3:.0f} | {cpu * 1e3 / mib:.1f} |")
    lines += ["", "A fixed amount of compute (60 products of 384 x 384 matrices) alone and while the both-links "
              "all-reduce runs in the background (median):", "",
              "| tbf setting | compute alone (ms) | beside the all-reduce (ms) | slowdown |", "|---|---|---|---|"]
    for name, doc in rows:
        a, b = doc["compute_alone_s"], doc["compute_beside_comm_s"]
        lines.append(f"| {name} | {a * 1e3:.0f} | {b * 1e3:.0f} | {b / a:.2f}x |")
    lines += ["", "qdiscs: " + "; ".join(f"{name}: `{doc['qdisc']}`" for name, doc in rows)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=250.0, help="link rate in Mbit/s")
    ap.add_argument("--mib", type=float, default=16.0, help="all-reduce size in MiB (about the digits CNN's 18 MB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print the report, do not touch results/testbed.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.mib, args.reps, args.out)
        return 0
    handle_signals()
    old_burst = max(16 * 1024, int(args.rate * 1e6 / 8 * 1e-3))  # the testbed's tbf burst before tbf_params
    new_burst = tbf_params(args.rate)[0]
    rows = [(f"1 ms burst ({old_burst} B)", measure(args.rate, old_burst, args.mib, args.reps)),
            (f"GSO burst ({new_burst} B, now)", measure(args.rate, None, args.mib, args.reps))]
    text = report(args.rate, args.mib, rows)
    print(text)
    if not args.no_write:
        update_section("testbed_cpu", text)
        print("[bench_testbed_cpu] wrote benchmarks/results/testbed.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
