"""Start N gloo ranks on 127.0.0.1 for multi-process tests (reusable by every test module).

``run_ranks(fn, world=2, args=..., timeout=...)`` starts ``world`` fresh processes (spawn), each with
the default process group initialized (gloo, a free port on loopback, ``init_timeout_s``; with
``init_group=False`` only the ``env://`` variables are set, for a script that joins by itself), runs
``fn(rank, world, *args)`` and returns a :class:`RankResult` per rank: the exit code, the value ``fn``
returned (anything ``json`` can encode; tensors should be converted with ``.tolist()``) or the error
text. ``fn`` must be a top-level function of an importable module (it is pickled by name). Ranks are
forked from a forkserver that preloads torch and deft, so a fresh pair of ranks costs a fork, not a
torch import.

Processes that outlive ``timeout`` are killed (by pid, only the ones started here) and reported with
``timed_out=True``, so a hanging collective fails the test instead of the whole suite; first each is
asked (SIGUSR1, :mod:`faulthandler`) for the Python stack of every thread, which goes into the error.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class RankResult:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None and not self.timed_out


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux's ``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range.

    Why below it: a port the kernel picks for ``bind(0)`` comes from the range it also hands to outgoing
    connections, and between this call and rank 0's store listening on it, another test's gloo pairs
    (the other xdist worker's ranks) could be given it (``EADDRINUSE``). A random port below the range
    is never handed out so; a bind checks it is free now."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10_000, max(10_001, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every try taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, outdir: str, args: tuple[Any, ...],
           init_timeout_s: float, threads: int, init_group: bool) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # what the rank runs: a library (Accelerate) may set its own otherwise
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    out = Path(outdir) / f"rank{rank}.json"
    # where a hang shows itself: the harness sends SIGUSR1 before it kills a rank that outlived its time
    stacks = open(Path(outdir) / f"rank{rank}.stacks", "w")  # noqa: SIM115 (open until os._exit)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=init_timeout_s))
            # every rank has joined before any runs fn: a rank that ends at once (an error expected at
            # construction) must not take rank 0's store away from a peer still connecting its group
            dist.barrier()
        value = fn(rank, world, *args)
        out.write_text(json.dumps({"value": value}))
        code = 0
    except BaseException as e:  # report, then exit non-zero like a crashed training script
        out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip destroy_process_group/atexit: a dead peer would make teardown hang or abort.
    os._exit(code)


_CTX: Any = None


def _context() -> Any:
    """A forkserver that has imported torch and deft once: ranks fork from it in milliseconds.

    Forking the test process itself is unsafe (its OpenMP/intra-op threads may exist); the forkserver
    is a clean single-threaded process started once per pytest run.
    """
    global _CTX
    if _CTX is None:
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        # torch._dynamo: the first optimizer imports it lazily, which costs seconds per rank otherwise;
        # scikit-learn: the examples' digits (tests._scripts.run_script), a second a rank otherwise. A module
        # that cannot be imported is skipped by the forkserver.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "deft",
                                    "deft.runtime.ddp", "deft.solver.plan", "deft.preserver.feedback", "tests._dist",
                                    "tests._scripts", "sklearn.datasets", "sklearn.model_selection"])
        _CTX = ctx
    return _CTX


def run_ranks(fn: Callable[..., Any], world: int = 2, args: tuple[Any, ...] = (), timeout: float = 120.0,
              init_timeout_s: float = 60.0, threads: int = 1, init_group: bool = True) -> list[RankResult]:
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="deft-ranks-") as outdir:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, outdir, args, init_timeout_s, threads,
                                                      init_group))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p.is_alive() for p in procs]
        for p, h in zip(procs, hung, strict=True):
            if h and p.pid is not None:
                # faulthandler writes every thread's stack; a rank may have exited since is_alive()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGUSR1)
        if any(hung):
            time.sleep(1.0)
        results = []
        for r, p in enumerate(procs):
            timed_out = hung[r]
            if timed_out:
                p.kill()
                p.join(5)
            res = RankResult(rank=r, exitcode=p.exitcode, timed_out=timed_out)
            stacks = Path(outdir) / f"rank{r}.stacks"
            if timed_out and stacks.exists() and stacks.stat().st_size > 0:
                res.error = "hung; its threads' stacks:\n" + stacks.read_text()
            f = Path(outdir) / f"rank{r}.json"
            if f.exists():
                doc = json.loads(f.read_text())
                res.value = doc.get("value")
                if "error" in doc:
                    res.error = doc["error"] + "\n" + doc.get("traceback", "") + (res.error or "")
            results.append(res)
        return results


def values(results: list[RankResult]) -> list[Any]:
    """The returned values, failing with every rank's error text if a rank did not succeed."""
    bad = [r for r in results if not r.ok]
    if bad:
        msg = "\n".join(f"rank {r.rank}: exit {r.exitcode}{' (timed out)' if r.timed_out else ''}: {r.error}"
                        for r in bad)
        raise AssertionError(f"ranks failed:\n{msg}")
    return [r.value for r in results]


def train_steps(ddp: Any, opt: Any, rank: int, iters: int, batch: int, features: int = 64,
                classes: int = 10) -> list[float]:
    """``iters`` plain training iterations of a classifier wrapped in ``ddp``: each rank draws its own
    batches (``batch`` x ``features`` normal inputs, labels in ``range(classes)``) from a generator
    seeded with its rank; cross-entropy, backward, ``opt.step()``, ``opt.zero_grad()``. The losses."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(iters):
        x, y = torch.randn(batch, features, generator=g), torch.randint(0, classes, (batch,), generator=g)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def amp_steps(model: Any, wrapped: Any, rank: int, steps: int, inf_at: int, batch: int, features: int,
              classes: int) -> tuple[float, list[float]]:
    """torch's documented AMP loop: ``autocast`` (CPU, bfloat16), ``GradScaler`` (scale 1024, growth every
    4 good steps), ``scaler.scale(loss).backward()``, ``unscale_``, ``clip_grad_norm_`` (1.0, its norm
    kept), ``scaler.step``, ``scaler.update``; SGD lr 0.05 momentum 0.9; rank 0's loss is made infinite
    at iteration ``inf_at``. Each rank's batches come from a generator seeded per iteration and rank.
    The final scale and the clipped norms."""
    import torch
    from torch import nn

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=4)
    norms = []
    for t in range(steps):
        g = torch.Generator().manual_seed(31 * t + rank)
        x, y = torch.randn(batch, features, generator=g), torch.randint(0, classes, (batch,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(wrapped(x), y)
        if t == inf_at and rank == 0:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return float(scaler.get_scale()), norms


def slow_first_planner(rank: int, seconds: float) -> None:
    """In a spawned worker: rank 0's planner (``deft.runtime.planning.make_schedule``) sleeps ``seconds``
    before planning, so that the iterations run while it plans in the background are known ones."""
    if rank != 0:
        return
    import deft.runtime.planning as planning

    slow = planning.make_schedule

    def slowed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return slow(*args, **kwargs)

    planning.make_schedule = slowed  # type: ignore[assignment]  # this spawned process only


#: How long :func:`next_send_ends_while_python_holds_the_gil` holds the GIL: a 256 KB send on loopback
#: takes milliseconds.
HOLD_S = 3.0


def next_send_ends_while_python_holds_the_gil(group: Any) -> bool:
    """Launch a 256 KB all-reduce on ``group`` and run pure Python, holding the GIL (a switch interval
    longer than the loop: nothing takes it away), until it completes or :data:`HOLD_S` passes: did it
    complete meanwhile? On a serial link (one gloo thread) it does not where something before it makes
    gloo's thread wait for the GIL. Its future's ``done()`` keeps the GIL (``Work.is_completed`` lets it
    go); the send is waited for before returning."""
    import torch
    import torch.distributed as dist

    work = dist.all_reduce(torch.ones(1 << 16), group=group, async_op=True)
    assert work is not None
    fut = work.get_future()
    before = sys.getswitchinterval()
    sys.setswitchinterval(HOLD_S * 4)
    try:
        t0 = time.perf_counter()
        while not fut.done() and time.perf_counter() - t0 < HOLD_S:
            pass
        during = fut.done()
    finally:
        sys.setswitchinterval(before)
    fut.wait()
    return during
