"""Per-link all-reduce cost: a microbenchmark over a size sweep and a least-squares alpha-beta fit.

The solver needs the all-reduce time of any bucket on any link (DESIGN.md section 3). We measure
``T(nbytes)`` on the real process group of each link and fit the linear model

    T(b) = alpha + beta * b        (alpha: per-collective latency, 1/beta: effective bandwidth)

at the current world size ``N``, so the fitted model already contains whatever the collective costs at
``N``: the ring's ``2(N-1)/N`` on the bytes, its ``2(N-1)`` steps of start-up, and the wait of each step
for its ranks where they share cores (benchmarks/results/allreduce_n.md). deft's runtime profiles the
links at the run's own world size, so its plans rest on this fit; rescaling a fit to another ``N`` is the
simulator's what-if (``deft.solver.simulate.ring_factors``).

Measurement (:func:`measure`): for every size, ``warmup`` untimed all-reduces, then ``iters`` timed
ones (or ``iters`` rounds over all sizes with ``interleave=True``), each started right after a
barrier so no rank's clock includes waiting for a late peer. Each rank takes the median of its
iterations (robust against scheduler hiccups; ``statistic="min"`` takes the fastest instead, the cost
without interference), and the sample is the maximum over ranks: a collective is finished for the
job only when it is finished on the slowest rank.

Fit (:func:`fit`): weighted least squares with weights ``w_i = T_i^-p``. The default ``p = 1`` treats
a time's variance as proportional to the time (timing noise accumulates over a collective's
duration), so the sub-millisecond samples of small buckets pin ``alpha`` instead of being drowned by
the absolute errors of the large ones, while a curve that is not quite straight (a memory-bound
loopback, cache effects) is still followed where most of the time is spent. ``p = 2`` minimizes
squared relative errors (small sizes dominate), ``p = 0`` is ordinary least squares. ``alpha`` is
clamped at 0 (a negative latency is an artifact of noise; the fit is redone through the origin and
the clamp is recorded in ``notes``).

``python -m deft.profiler.links`` runs the benchmark under torchrun (or any env:// launcher) on every
link of a deft config, alone and all links at once, and writes the samples and fits as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deft._json import JsonDict
from deft.errors import ContractError, DeftError
from deft.netif import new_group_on_nic
from deft.profile import Link, fit_alpha_beta

if TYPE_CHECKING:  # pragma: no cover - torch is imported where a benchmark runs
    import threading

    import torch
    import torch.distributed as dist

DEFAULT_SIZES = tuple(2**k for k in range(12, 25, 2))  # 4 KiB .. 16 MiB, x4 steps


@dataclass(frozen=True)
class Sample:
    """All-reduce of ``nbytes``: ``seconds`` = max over ranks of each rank's median (or min) over ``iters``."""

    nbytes: int
    seconds: float
    iters: int
    spread_s: float = 0.0  # max over ranks of (p90 - p10) of the per-iteration times


@dataclass(frozen=True)
class LinkFit:
    """``T(b) = alpha_s + beta_s_per_byte * b`` and how well it describes the samples.

    ``r2`` is the ordinary coefficient of determination of the times (share of their variance the
    line explains; dominated by the large sizes), ``rmse_s`` the root-mean-square error in seconds,
    ``rel_rmse`` the root-mean-square *relative* error (what the fit with ``weight_power=2`` minimizes; it shows
    how well the small sizes are described), ``n`` the number of samples.
    """

    alpha_s: float
    beta_s_per_byte: float
    r2: float
    rmse_s: float
    n: int
    rel_rmse: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def predict(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes

    @property
    def bandwidth_mbit(self) -> float:
        """Effective all-reduce bandwidth 8/beta in Mbit/s (payload bytes, not wire bytes)."""
        return 8.0 / self.beta_s_per_byte / 1e6 if self.beta_s_per_byte > 0 else math.inf

    def to_dict(self) -> JsonDict:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


def fit(samples: Sequence[Sample], source: str = "<samples>", weight_power: float = 1.0) -> LinkFit:
    """Weighted least-squares fit of ``T = alpha + beta * nbytes`` (weights ``T^-weight_power``) with
    ``alpha, beta >= 0``: :func:`deft.profile.fit_alpha_beta`, plus the checks of the samples.

    Raises :class:`ContractError` naming the sample when a time is not positive and finite, or when
    fewer than two distinct sizes make the line undetermined.
    """
    if len(samples) < 2:
        raise ContractError(source, "samples", f"expected at least 2 samples, got {len(samples)}")
    if not 0.0 <= weight_power <= 2.0:
        raise ContractError(source, "weight_power", f"expected a number in [0, 2], got {weight_power}")
    for i, s in enumerate(samples):
        if not (math.isfinite(s.seconds) and s.seconds > 0):
            raise ContractError(source, f"samples[{i}].seconds", f"expected a positive finite time, got {s.seconds}")
        if s.nbytes < 0:
            raise ContractError(source, f"samples[{i}].nbytes", f"expected >= 0, got {s.nbytes}")
    if len({s.nbytes for s in samples}) < 2:
        raise ContractError(source, "samples", "expected at least 2 distinct sizes to fit a line")
    t = [s.seconds for s in samples]
    f = fit_alpha_beta([s.nbytes for s in samples], t, [ti**-weight_power for ti in t], source)
    notes = []  # the non-negativity rule of deft.profile.fit_alpha_beta, when it decided
    if f.free_beta < 0:
        notes.append(f"beta fitted negative ({f.free_beta:.3g} s/B); clamped to 0 (alpha {f.alpha:.3g} s)")
    if f.free_alpha < 0:
        notes.append(f"alpha fitted negative ({f.free_alpha:.3g} s); clamped to 0 (beta {f.beta:.3g} s/B)")
    alpha, beta, r2, rmse, rel_rmse = f.alpha, f.beta, f.r2, f.rmse, f.rel_rmse
    return LinkFit(alpha_s=alpha, beta_s_per_byte=beta, r2=r2, rmse_s=rmse, n=len(samples), rel_rmse=rel_rmse,
                   notes=tuple(notes))


def to_link(link_fit: LinkFit, name: str, backend: str, ifname: str | None = None) -> Link:
    """The profile's :class:`~deft.profile.Link` carrying this fit."""
    return Link(name=name, backend=backend, ifname=ifname, alpha_s=link_fit.alpha_s,
                beta_s_per_byte=link_fit.beta_s_per_byte)


# -- measurement (needs torch.distributed) ---------------------------------------------------------
def _p(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reduce_max(values: list[float], group: dist.ProcessGroup | None, device: torch.device) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(x) for x in t.cpu()]


def _check_sweep(sizes_bytes: Sequence[int], iters: int, warmup: int) -> None:
    if not sizes_bytes:
        raise ContractError("<measure>", "sizes_bytes", "expected at least one size")
    for i, s in enumerate(sizes_bytes):
        if int(s) < 1:
            raise ContractError("<measure>", f"sizes_bytes[{i}]", f"expected >= 1 byte, got {s}")
    if iters < 1 or warmup < 0:
        raise ContractError("<measure>", "iters", f"expected iters >= 1 and warmup >= 0, got {iters}, {warmup}")


STATISTICS = ("median", "min")


def measure(group: dist.ProcessGroup | None, sizes_bytes: Sequence[int], iters: int = 10, warmup: int = 2,
            dtype: torch.dtype | None = None, device: torch.device | None = None, statistic: str = "median",
            interleave: bool = False) -> list[Sample]:
    """All-reduce microbenchmark of one process group (``None``: the default group), one sample per size.

    Every rank of ``group`` must call it with the same arguments. Sizes are rounded down to whole
    elements of ``dtype`` (default float32); ``device`` defaults to CUDA for NCCL groups, else CPU.
    ``statistic`` reduces each rank's iterations: ``median`` (typical cost, the default) or ``min``
    (the cost without interference, for machines shared with other work). ``interleave`` measures
    in rounds over all sizes instead of size after size (see the comment in the code for the trade).
    """
    if statistic not in STATISTICS:
        raise ContractError("<measure>", "statistic", f"expected one of {', '.join(STATISTICS)}, got {statistic!r}")
    reduce_iters = statistics.median if statistic == "median" else min
    import torch
    import torch.distributed as dist

    _check_sweep(sizes_bytes, iters, warmup)
    dtype = dtype or torch.float32
    if device is None:
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    elem = torch.empty((), dtype=dtype).element_size()
    numels = [max(1, int(size) // elem) for size in sizes_bytes]
    bufs = [torch.ones(n, dtype=dtype, device=device) for n in numels]
    times: list[list[float]] = [[] for _ in bufs]

    def timed(i: int) -> None:
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(bufs[i], group=group)
        _sync(device)
        times[i].append(time.perf_counter() - t0)

    if interleave:
        # rounds over all sizes: a slow spell of a shared machine hits every size alike instead of
        # bending the curve where it fell. Not the default: on a shaped link a small all-reduce timed
        # right after a large one comes out several times slower than in a run of its own size (link
        # and TCP state carried over), which inflates alpha
        for buf in bufs:
            for _ in range(warmup):
                dist.all_reduce(buf, group=group)
        for _ in range(iters):
            for i in range(len(bufs)):
                timed(i)
    else:
        for i, buf in enumerate(bufs):
            for _ in range(warmup):
                dist.all_reduce(buf, group=group)
            for _ in range(iters):
                timed(i)
    medians = [reduce_iters(ts) for ts in times]
    spreads = [_p(ts, 0.9) - _p(ts, 0.1) for ts in times]
    actual = [n * elem for n in numels]
    medians = _reduce_max(medians, group, device)
    spreads = _reduce_max(spreads, group, device)
    return [Sample(nbytes=b, seconds=m, iters=iters, spread_s=s)
            for b, m, s in zip(actual, medians, spreads, strict=True)]


def measure_concurrent(groups: Sequence[dist.ProcessGroup], sizes_bytes: Sequence[int], iters: int = 10,
                       warmup: int = 2, dtype: torch.dtype | None = None) -> tuple[list[list[Sample]], list[Sample]]:
    """All-reduce the same size on every group at once (CPU tensors), as deft does on two links.

    Returns, per group, the time from the common launch until that group's collective completed
    (recorded by a completion callback, so a fast link is not charged for waiting on a slow one),
    and the time until all completed. Median per rank, max over ranks (reduced on ``groups[0]``).
    """
    import threading

    import torch
    import torch.distributed as dist

    _check_sweep(sizes_bytes, iters, warmup)
    dtype = dtype or torch.float32
    elem = torch.empty((), dtype=dtype).element_size()
    per_group: list[list[Sample]] = [[] for _ in groups]
    together: list[Sample] = []
    for size in sizes_bytes:
        numel = max(1, int(size) // elem)
        bufs = [torch.ones(numel, dtype=dtype) for _ in groups]
        for _ in range(warmup):
            for w in [dist.all_reduce(b, group=g, async_op=True) for b, g in zip(bufs, groups, strict=True)]:
                w.wait()
        times: list[list[float]] = [[] for _ in groups]
        total: list[float] = []
        for _ in range(iters):
            for g in groups:
                dist.barrier(group=g)
            done = [0.0] * len(groups)
            lock = threading.Lock()
            t0 = time.perf_counter()
            works = [dist.all_reduce(b, group=g, async_op=True) for b, g in zip(bufs, groups, strict=True)]
            for i, w in enumerate(works):
                w.get_future().add_done_callback(functools.partial(_mark_done, done, lock, i))
            for w in works:
                w.wait()
            t_end = time.perf_counter()
            with lock:
                for i in range(len(groups)):
                    # a callback attached after completion runs inline; either way done[i] <= t_end
                    times[i].append((done[i] or t_end) - t0)
            total.append(t_end - t0)
        meds = _reduce_max([statistics.median(ts) for ts in times] + [statistics.median(total)], groups[0],
                           torch.device("cpu"))
        for i in range(len(groups)):
            per_group[i].append(Sample(nbytes=numel * elem, seconds=meds[i], iters=iters))
        together.append(Sample(nbytes=numel * elem, seconds=meds[-1], iters=iters))
    return per_group, together


def _mark_done(done: list[float], lock: threading.Lock, i: int, _fut: object) -> None:
    with lock:
        done[i] = time.perf_counter()


def new_link_group(backend: str, ifname: str | None) -> dist.ProcessGroup:
    """A process group over all ranks bound to NIC ``ifname`` (:func:`deft.netif.new_group_on_nic`)."""
    return new_group_on_nic(backend, ifname)


def main(argv: list[str] | None = None) -> int:
    """Benchmark every link of a deft config, alone and all at once; rank 0 writes JSON (``--out``)."""
    try:
        return _main(argv)
    except DeftError as e:  # bad flags or config: one line naming them, not a traceback
        print(f"python -m deft.profiler.links: error: {e}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    import torch
    import torch.distributed as dist

    from deft.config import DeftConfig

    ap = argparse.ArgumentParser(prog="python -m deft.profiler.links", description=(main.__doc__ or "").splitlines()[0])
    ap.add_argument("--config", default=os.environ.get("DEFT_CONFIG"), help="deft TOML config naming the links")
    ap.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES), help="comma-separated bytes")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stat", choices=STATISTICS, default="median", help="per-rank reduction of the iterations")
    ap.add_argument("--interleave", action="store_true", help="measure in rounds over all sizes")
    ap.add_argument("--concurrent-sizes", default="4194304", help="sizes for the all-links-at-once run ('' to skip)")
    ap.add_argument("--out", default=None, help="JSON output (rank 0)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x]
        conc_sizes = [int(x) for x in args.concurrent_sizes.split(",") if x]
    except ValueError:
        raise DeftError(f"--sizes/--concurrent-sizes: expected comma-separated integers, got {args.sizes!r}") from None
    _check_sweep(sizes, args.iters, args.warmup)
    if conc_sizes:
        _check_sweep(conc_sizes, args.iters, args.warmup)
    cfg = DeftConfig.resolve(args.config)
    if "RANK" not in os.environ:
        raise DeftError("no RANK in the environment: launch every rank under torchrun (or another env:// "
                        "launcher), e.g. `torchrun --nproc-per-node 2 -m deft.profiler.links`")
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank()
    links: JsonDict = {}
    result: JsonDict = {"world_size": dist.get_world_size(), "config": args.config, "links": links}
    groups = []
    for lk in cfg.links:
        backend = lk.backend if lk.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        groups.append(new_link_group(backend, lk.ifname))
        samples = measure(groups[-1], sizes, iters=args.iters, warmup=args.warmup, statistic=args.stat,
                          interleave=args.interleave)
        f = fit(samples, source=f"link {lk.name}")
        links[lk.name] = {"backend": backend, "ifname": lk.ifname, "fit": f.to_dict(),
                                    "samples": [asdict(s) for s in samples]}
        if rank == 0:
            print(f"[links] {lk.name} ({backend}, {lk.ifname or 'default NIC'}): alpha={f.alpha_s * 1e6:.1f} us "
                  f"beta={f.beta_s_per_byte * 1e9:.3f} ns/B ({f.bandwidth_mbit:.0f} Mbit/s) r2={f.r2:.4f} "
                  f"relative rmse={f.rel_rmse:.1%}",
                  flush=True)
    if len(groups) > 1 and conc_sizes:
        per, tog = measure_concurrent(groups, conc_sizes, iters=args.iters, warmup=args.warmup)
        result["concurrent"] = {
            "per_link": {lk.name: [asdict(s) for s in per[i]] for i, lk in enumerate(cfg.links)},
            "all": [asdict(s) for s in tog],
        }
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
