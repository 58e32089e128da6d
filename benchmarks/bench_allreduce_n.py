"""What gloo's all-reduce costs at N = 2, 4, 8 ranks on loopback, against the ring model; and the
planner's time at N = 8 against the plan-lag limit. Prints markdown (``--out`` writes it too).

    .venv/bin/python benchmarks/bench_allreduce_n.py [--worlds 2,4,8] [--iters 10] [--statistic min]
        [--cores C] [--out FILE]
    .venv/bin/python benchmarks/bench_allreduce_n.py --planner [--workers 8] [--out FILE]
    sudo .venv/bin/python benchmarks/bench_allreduce_n.py --testbed 2x2 [--rate 50] [--iters 10] [--out FILE]

All-reduce: for each world size, ``world`` gloo ranks on 127.0.0.1 time a float32 all-reduce per size
(:func:`deft.profiler.links.measure`: median over ``--iters`` after a warm-up, the slowest rank's), and
the samples are fitted ``T = alpha + beta b`` (:func:`deft.profiler.links.fit`, as ``deft-profile``
fits a link). The ring model (:func:`deft.solver.simulate.scale_workers`) rescales the ``N = 2`` fit to
``N``: start-up ``x (N - 1)``, transfer ``x 2 (N - 1) / N``, and with ``--cores`` (default: this
machine's) the start-up also ``x c(N) / c(2)``, ``c(k) = max(1, k / cores)²`` (ranks waiting to be
scheduled); the table gives both predictions beside the measurement at every size. On a machine with
fewer cores than ranks the ranks' reductions and copies share the cores, so the transfer term there
measures the CPU as much as loopback's bandwidth.

``--planner``: every reference profile of ``examples/profiles`` rescaled to ``--workers`` ranks by the
ring model, planned as a run plans it (``deft.runtime.planning.make_schedule`` at the default
``epsilon`` without walk statistics: the no-delay and lag-free plans and their local search), timed
(median of ``--repeats``, wall and CPU time: on a shared machine the wall time counts the other
processes' share of the core) against the plan-lag limit, ``plan_lag_iters`` iterations of the plan's own
predicted iteration: rank 0 plans in the background for at most that many iterations before every rank
waits for it (docs/DESIGN.md, "Rank 0 plans in the background").

``--testbed HxM`` (root: network namespaces): ``H`` hosts of ``M`` ranks on :class:`deft.testbed.Testbed`
(one link at ``--rate`` Mbit/s), each rank started with torchrun's variables; deft's primary link
all-reduces 4 MB flat (gloo's ring over all ranks) and hierarchically (:mod:`deft.runtime.hierarchy`),
alternating, ``--iters`` times each: the time per all-reduce (median over the iterations of the slowest
rank's, from a barrier to a barrier) and the bytes each host's ``nic0`` sent per all-reduce, as multiples
of the size.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
SIZES = (4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, iters: int, statistic: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from deft.profiler.links import measure

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    samples = measure(None, SIZES, iters=iters, warmup=3, statistic=statistic)
    if rank == 0:
        Path(out).write_text(json.dumps([[s.nbytes, s.seconds] for s in samples]))
    dist.destroy_process_group()


def measure_world(world: int, iters: int, statistic: str) -> list[tuple[int, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "samples.json")
        mp.spawn(_rank, args=(world, _free_port(), iters, statistic, out), nprocs=world)
        return [(int(b), float(t)) for b, t in json.loads(Path(out).read_text())]


def allreduce_table(worlds: list[int], iters: int, statistic: str, cores: int) -> str:
    from deft.profiler.links import Sample, fit
    from deft.solver.simulate import ring_factors

    measured = {n: measure_world(n, iters, statistic) for n in worlds}
    fits = {n: fit([Sample(nbytes=b, seconds=t, iters=iters, spread_s=0.0) for b, t in measured[n]])
            for n in worlds}
    base = min(worlds)
    a0, b0 = fits[base].alpha_s, fits[base].beta_s_per_byte
    ring = {n: ring_factors(base, n) for n in worlds}
    crowded = {n: ring_factors(base, n, cores) for n in worlds}
    lines = [f"Fits (`T = alpha + beta b`, float32 all-reduce, gloo on loopback, {os.cpu_count()} cores, "
             f"{statistic} of {iters} per size), and the N = {base} fit rescaled by the ring model "
             f"(`ring_factors`), plain and with the ranks sharing {cores} cores:", "",
             "| N | alpha (us) | beta (ns/B) | r2 | ring: alpha (us) | beta (ns/B) | "
             f"ring on {cores} cores: alpha (us) |",
             "|---|---|---|---|---|---|---|"]
    for n in worlds:
        f = fits[n]
        lines.append(f"| {n} | {f.alpha_s * 1e6:.0f} | {f.beta_s_per_byte * 1e9:.3f} | {f.r2:.3f} | "
                     f"{a0 * ring[n][0] * 1e6:.0f} | {b0 * ring[n][1] * 1e9:.3f} | {a0 * crowded[n][0] * 1e6:.0f} |")
    lines += ["", f"Measured against the predictions from the N = {base} fit (ms): measured / ring / ring on "
              f"{cores} cores", "",
              "| bytes | " + " | ".join(f"N = {n}" for n in worlds) + " |",
              "|---|" + "---|" * len(worlds)]
    for i, size in enumerate(SIZES):
        cells = []
        for n in worlds:
            b, t = measured[n][i]
            plain = a0 * ring[n][0] + b0 * ring[n][1] * b
            crowd = a0 * crowded[n][0] + b0 * crowded[n][1] * b
            cells.append(f"{t * 1e3:.2f} / {plain * 1e3:.2f} / {crowd * 1e3:.2f}")
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


TESTBED_BYTES = 4 << 20


def _testbed_rank(out: str, iters: int) -> None:
    """One rank of ``--testbed``, inside its host's namespace (the environment names rank, layout and NIC)."""
    import torch
    import torch.distributed as dist

    from deft.config import DeftConfig
    from deft.runtime.links import make_links

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    links = {mode: make_links(DeftConfig(hierarchical=mode == "hierarchical"), False, None)["primary"]
             for mode in ("flat", "hierarchical")}
    buf = torch.ones(TESTBED_BYTES // 4)
    times: dict[str, list[float]] = {m: [] for m in links}
    sent: dict[str, int] = dict.fromkeys(links, 0)
    nic = Path("/sys/class/net/nic0/statistics/tx_bytes")
    for i in range(iters + 1):  # the first: connections made, off the count
        for mode, link in links.items():
            dist.barrier()
            b0, t0 = int(nic.read_text()), time.perf_counter()
            link.all_reduce(buf).wait()
            dist.barrier()
            if i:
                times[mode].append(time.perf_counter() - t0)
                sent[mode] += int(nic.read_text()) - b0
    slowest = {m: torch.tensor(t, dtype=torch.float64) for m, t in times.items()}
    for t in slowest.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(os.environ["LOCAL_RANK"]) == 0:
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {m: {"s": statistics.median(slowest[m].tolist()), "sent": sent[m] / iters / TESTBED_BYTES}
             for m in links}))
    dist.barrier()
    dist.destroy_process_group()


def testbed_table(layout: str, rate: float, iters: int) -> str:
    import subprocess

    from deft.testbed import Testbed

    hosts, per_host = (int(v) for v in layout.split("x"))
    world = hosts * per_host
    with tempfile.TemporaryDirectory() as tmp, Testbed(hosts=hosts, links=1, rate_mbit=rate) as tb:
        os.chmod(tmp, 0o755)
        port, procs = _free_port(), []
        for r in range(world):
            env = tb.env_for(r // per_host, rank=r, world=world, port=port, local_rank=r % per_host,
                             local_world=per_host)
            env["PYTHONPATH"] = str(ROOT)
            procs.append(tb.popen(r // per_host, [sys.executable, str(Path(__file__).resolve()), "--testbed-rank", tmp,
                                                  "--iters", str(iters)], env=env, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate(timeout=600)
            if p.returncode:
                raise RuntimeError(f"a rank failed: {err[-2000:]}")
        reports = [json.loads(Path(tmp, f"rank{h * per_host}.json").read_text()) for h in range(hosts)]
    ideal = TESTBED_BYTES * 8 / (rate * 1e6)
    lines = [f"All-reduce of {TESTBED_BYTES >> 20} MB (float32) on deft's primary link, testbed {hosts} hosts x "
             f"{per_host} ranks, one link at {rate:g} Mbit/s, {iters} of each, alternating (S / rate = "
             f"{ideal * 1e3:.0f} ms):", "",
             "| all-reduce | time per all-reduce (ms, median, slowest rank) | each host's nic0 sent (x S) |",
             "|---|---|---|"]
    for mode in ("flat", "hierarchical"):
        sent = " / ".join(f"{r[mode]['sent']:.3f}" for r in reports)
        lines.append(f"| {mode} | {reports[0][mode]['s'] * 1e3:.0f} | {sent} |")
    return "\n".join(lines)


def planner_table(workers: int, repeats: int) -> str:
    from deft.config import DeftConfig
    from deft.profile import Profile
    from deft.runtime.planning import make_schedule
    from deft.solver.simulate import scale_workers

    cfg = DeftConfig()
    lines = [f"Planner at N = {workers} (reference profiles rescaled by the ring model; median of {repeats}; "
             f"limit: plan_lag_iters = {cfg.plan_lag_iters} predicted iterations):", "",
             "| profile | measured N | buckets | plan, wall (s) | plan, CPU (s) | predicted iteration (s) | "
             "limit (s) | wall within | CPU within |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in sorted((ROOT / "examples" / "profiles").glob("*.json")):
        profile = scale_workers(Profile.load(str(path)), workers)
        times, cpu, sched = [], [], None
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            sched = make_schedule(cfg, profile, None, None).schedule
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        assert sched is not None
        it = sched.predicted_iteration_s
        took, used = statistics.median(times), statistics.median(cpu)
        limit = cfg.plan_lag_iters * it
        lines.append(f"| {path.stem} | {Profile.load(str(path)).world_size} | {profile.n} | {took:.3f} | {used:.3f} | "
                     f"{it:.4f} | {limit:.3f} | {'yes' if took <= limit else 'NO'} | "
                     f"{'yes' if used <= limit else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--statistic", choices=("median", "min"), default="median")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="the crowded model's cores")
    ap.add_argument("--planner", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--testbed", default=None, metavar="HxM", help="H hosts of M ranks on the testbed (root)")
    ap.add_argument("--rate", type=float, default=50.0, help="--testbed: the link's Mbit/s")
    ap.add_argument("--testbed-rank", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.testbed_rank:
        _testbed_rank(args.testbed_rank, args.iters)
        return 0
    if args.testbed:
        text = testbed_table(args.testbed, args.rate, args.iters)
    elif args.planner:
        text = planner_table(args.workers, args.repeats)
    else:
        text = allreduce_table([int(w) for w in args.worlds.split(",")], args.iters, args.statistic, args.cores)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
