"""What splitting one all-reduce into ``k`` pieces costs on each testbed link, against the start-up probe.

    python benchmarks/bench_split_cost.py [--rate-mbit 250] [--sizes 1000000,4000000] [--pieces 1,2,4,8,16]

On the testbed (2 hosts x 2 links, root), for each link: the runtime's start-up probe
(:func:`deft.runtime.warmup_timer.probe_alpha`: one-element all-reduces on the idle link, median),
then for each size ``B`` and piece count ``k`` the time from launching ``k`` all-reduces of ``B / k``
bytes back to back (as the runtime launches the pieces of one split gradient) until all completed,
after a barrier; median of ``--reps`` (the first two dropped), max over ranks. The cost of a split
per extra piece is ``(T(k) - T(1)) / (k - 1)``: what the planner's model charges as ``alpha`` per
piece (:mod:`deft.solver.partition`). Prints a table; record it by hand in ``results/replay.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_links import ROOT, run_ranks

from deft.testbed import Testbed


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from deft.netif import new_group_on_nic
    from deft.runtime.links import CommLink
    from deft.runtime.warmup_timer import probe_alpha

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    second = new_group_on_nic("gloo", spec["second_ifname"])
    rows: dict[str, list[float]] = {}
    for name, group in (("primary", None), ("second", second)):
        row = [probe_alpha({name: CommLink(name, "gloo", None, group)}, cuda=False)[name]]
        for total in spec["sizes"]:
            buf = torch.ones(total // 4)
            for k in spec["pieces"]:
                pieces = list(buf.chunk(k))
                times = []
                for _ in range(spec["reps"]):
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    for w in [dist.all_reduce(p, group=group, async_op=True) for p in pieces]:
                        w.wait()
                    times.append(time.perf_counter() - t0)
                row.append(statistics.median(times[2:]))
        rows[name] = row
    t = torch.tensor(list(rows.values()), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(dict(zip(rows, t.tolist(), strict=True))), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-mbit", type=float, default=250.0)
    ap.add_argument("--sizes", default="1000000,4000000", help="bytes per all-reduce before splitting")
    ap.add_argument("--pieces", default="1,2,4,8,16", help="piece counts; must include 1")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    pieces = [int(x) for x in args.pieces.split(",") if x]
    if 1 not in pieces or min(pieces) < 1 or min(sizes, default=0) < 4 * max(pieces) or args.reps < 3:
        ap.error("--pieces must include 1, every size must hold at least one float per piece, --reps >= 3")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    with Testbed(hosts=2, links=2, rate_mbit=args.rate_mbit) as tb:
        spec = json.dumps({"sizes": sizes, "pieces": pieces, "reps": args.reps, "second_ifname": tb.ifname(1)})
        logs = run_ranks(tb, [sys.executable, str(Path(__file__).resolve()), "--worker", spec], timeout_s=600,
                         label="split")
    res = next(json.loads(line[len("RESULT "):]) for line in logs[0].splitlines() if line.startswith("RESULT "))
    print(f"| link | start-up probe (ms) | size (MB) | {' | '.join(f'k = {k}' for k in pieces)} | "
          "extra per piece (ms) |")
    print("|---|---|---|" + "---|" * len(pieces) + "---|")
    for name, row in res.items():
        probe, rest = row[0], row[1:]
        for i, total in enumerate(sizes):
            ts = rest[i * len(pieces):(i + 1) * len(pieces)]
            t1 = ts[pieces.index(1)]
            extra = [(t - t1) / (k - 1) for k, t in zip(pieces, ts, strict=True) if k > 1]
            print(f"| {name} | {probe * 1e3:.3f} | {total / 1e6:g} | {' | '.join(f'{t * 1e3:.1f}' for t in ts)} | "
                  f"{', '.join(f'{e * 1e3:+.2f}' for e in extra)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
