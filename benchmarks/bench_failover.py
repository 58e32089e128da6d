"""What guarding the second link costs, and what losing it costs, on the testbed.

    sudo .venv/bin/python benchmarks/bench_failover.py [--rate 250] [--iters 40] [--down-at 25]

Two hosts x two links at ``--rate`` Mbit/s, one rank per host, a 2.2 M-parameter MLP (8.8 MB of float32
gradient, a 16-sample batch: the links are the bound), deft at epsilon 0 (the lag-free plan):

* the cost of a guarded send's copies (:mod:`deft.runtime.failover`): one clone of a 4 MiB bucket and its
  copy back, and of the agreement: one all-reduce of a flag per link over a gloo group on ``nic0``;
* the median iteration of the planned iterations (from ``iters / 2`` on) with ``link_failover`` on and
  off, and torch DDP's on ``nic0`` beside them;
* a run whose ranks take ``nic1`` down in their own host at the start of iteration ``--down-at``
  (``ip link set nic1 down``, as ``Testbed.set_link``): each iteration's time from there on, what the
  record says (``plan_info["link_failures"]``) and the time lost against the iterations before it.

Results go to ``benchmarks/results/failover.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_links import command_line, handle_signals, machine, run_ranks  # noqa: E402

from deft.testbed import Testbed  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "failover.md"


def _median_of(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _train(wrapped: Any, model: Any, rank: int, iters: int, down_at: int | None = None) -> list[float]:
    """Each iteration's wall time (forward start to the next), in seconds."""
    import torch
    from torch import nn

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    times = []
    for t in range(iters):
        if t == down_at:
            subprocess.run(["ip", "link", "set", "nic1", "down"], check=True)
        start = time.perf_counter()
        g = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 10, generator=g)
        nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def worker(iters: int, down_at: int, out: str) -> None:
    """One rank: the measurements of the module docstring; rank 0 writes them to ``out`` as JSON."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import deft
    from deft.netif import new_group_on_nic

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bucket = torch.randn(2**20)
    flags = torch.zeros(2, dtype=torch.int32)
    control = new_group_on_nic("gloo", "nic0", 60.0, None)
    res: dict[str, Any] = {
        "copy_4mib_s": _median_of(lambda: bucket.copy_(bucket.clone()), 20),
        "agree_s": _median_of(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=control), 50)}

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 1024), nn.Tanh(), nn.Linear(1024, 10))

    ref = model()
    res["torch_ddp"] = _train(nn.parallel.DistributedDataParallel(ref), ref, rank, iters)
    links = [{"name": "primary", "ifname": "nic0"}, {"name": "second", "backend": "gloo", "ifname": "nic1"}]
    base = {"epsilon": 0.0, "links": links, "timeout_s": 60.0, "link_deadline_s": 3.0}
    for name, cfg, down in (("guarded", {"link_failover": True}, None), ("unguarded", {"link_failover": False}, None),
                            ("nic1_down", {"link_failover": True}, down_at)):
        ours = model()
        ddp = deft.DistributedDataParallel(ours, config={**base, **cfg})
        res[name] = _train(ddp, ours, rank, iters, down)
        ddp.flush()
        if down is not None:
            res["record"] = ddp.plan_info.get("link_failures", [])
            res["worst_vs_torch_ddp"] = max(((a - b).abs().max() / b.abs().max()).item()
                                            for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    if rank == 0:
        Path(out).write_text(json.dumps(res), encoding="utf-8")
    sys.stdout.flush()
    os._exit(0)  # a collective stuck on the lost link's group would hold the exit until its timeout


def report(rate: float, iters: int, down_at: int, doc: dict[str, Any]) -> str:
    steady = {k: statistics.median(doc[k][iters // 2:down_at if k == "nic1_down" else iters])
              for k in ("torch_ddp", "guarded", "unguarded", "nic1_down")}
    after = doc["nic1_down"][down_at:]
    lost = sum(after) - len(after) * steady["nic1_down"]
    tail = statistics.median(doc["nic1_down"][-5:])
    lines = ["## A lost link (`benchmarks/bench_failover.py`)", "", f"Command: `{command_line()}`  ",
             f"Machine: {machine()}; 2 hosts x 2 links at {rate:g} Mbit/s, one rank per host; a 2.2 M-parameter "
             "MLP (8.8 MB of gradient), 16 samples a rank, deft at epsilon 0 with `link_deadline_s = 3`.", "",
             "| what | figure |", "|---|---|",
             f"| a guarded send's copies: clone + copy back of 4 MiB | {doc['copy_4mib_s'] * 1e3:.2f} ms |",
             f"| one agreement: a 2-flag all-reduce over nic0 | {doc['agree_s'] * 1e3:.2f} ms |",
             f"| median planned iteration, torch DDP on nic0 | {steady['torch_ddp'] * 1e3:.0f} ms |",
             f"| median planned iteration, deft, `link_failover = false` | {steady['unguarded'] * 1e3:.0f} ms |",
             f"| median planned iteration, deft, `link_failover = true` | {steady['guarded'] * 1e3:.0f} ms |",
             f"| nic1 down at iteration {down_at}: time lost over the iterations after it | {lost:.2f} s |",
             f"| median of the last 5 iterations, on the primary alone | {tail * 1e3:.0f} ms |",
             f"| parameters against torch DDP (largest relative difference) | {doc['worst_vs_torch_ddp']:.1e} |", "",
             "Iterations from the loss on (ms): " + ", ".join(f"{x * 1e3:.0f}" for x in after[:8]), "",
             "Rank 0's record: `" + json.dumps([{k: r.get(k) for k in ("link", "iteration", "resent_buckets", "lost_s",
                                                                        "replan")} for r in doc["record"]]) + "`"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=250.0, help="link rate in Mbit/s")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--down-at", type=int, default=25)
    ap.add_argument("--no-write", action="store_true", help=f"print the report, do not write {RESULT.name}")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.iters, args.down_at, args.out)
        return 0
    handle_signals()
    with tempfile.TemporaryDirectory() as tmp, Testbed(hosts=2, links=2, rate_mbit=args.rate) as tb:
        out = Path(tmp) / "failover.json"
        run_ranks(tb, [sys.executable, str(Path(__file__).resolve()), "--worker", "--iters", str(args.iters),
                       "--down-at", str(args.down_at), "--out", str(out)], timeout_s=900, label="failover")
        doc = json.loads(out.read_text())
    text = report(args.rate, args.iters, args.down_at, doc)
    print(text)
    if not args.no_write:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text("# A lost link\n\n" + text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
