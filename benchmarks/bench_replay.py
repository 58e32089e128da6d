"""Replay: the paper's profiles as sleeping models on the testbed, measured against the simulator.

    sudo .venv/bin/python benchmarks/bench_replay.py [--profiles vgg19,resnet101,gpt2] [--rate-mbit 250]
                                                     [--scale 1.0] [--iters 40] [--schemes ddp,deft-eps0]
                                                     [--hosts N] [--results FILE]
    .venv/bin/python benchmarks/bench_replay.py --from-runs DIR[,DIR...] [--profiles ...] [--results FILE]
    .venv/bin/python benchmarks/bench_replay.py --from-runs DIR --profiles NAME --comms SCHEME:ITERATION

What it measures: the scheduler and the runtime, apart from this machine's CPU. For each reference
profile of ``examples/profiles`` it builds a synthetic model with one parameter tensor per bucket;
bucket ``i``'s forward and backward are an autograd function that sleeps the bucket's forward time
and, in backward, its backward time, and returns a gradient of the parameter's shape. ``time.sleep``
releases the CPU (and the GIL) as a GPU kernel would, so the gloo threads run undisturbed. The model
runs on the testbed (``--hosts`` hosts, one rank each, x 2 links) with torch DDP and with deft, and the
measured iteration time is compared with :mod:`deft.solver.simulate` on the same profile.

Each bucket is one module owning one parameter, so deft's per-module forward pre-hooks (an update
finishing in the forward) wait for one bucket each, as the simulator assumes. Each run also records
the wall time of every iteration's forward, backward and step (``phases``) and the forward's sleeps
(``fwd_compute``), and a deft run every collective its links launched (``comms``: link, bytes, launch
and completion ``perf_counter`` times); the measurement job also times every bucket on both links at once
(``concurrent_s``: how much the two links' gloo threads slow each other).

Rescaling (the paper's coverage rate is kept):

* times: every forward, backward and all-reduce time of the profile is multiplied by ``--scale``
  (1.0: the paper's milliseconds; an iteration is then a few hundred ms);
* sizes: the profile was measured on 16 A100s at 40 Gbit/s, the testbed is ``--hosts`` ranks at
  ``--rate-mbit``. Bucket ``i`` gets ``nbytes_i = scale * T_i(primary) / beta`` bytes, ``beta`` the
  2-rank ring all-reduce cost per byte at the link rate (8 / rate, plus ``--overhead`` for TCP/IP
  headers, 7 % measured in ``results/testbed.md``), so at two hosts its all-reduce takes about the scaled
  paper time and compute/communication keep the paper's ratio. The same model at every ``--hosts``: with
  N hosts gloo's ring puts ``2 (N - 1) / N`` of each bucket on every NIC (and ``2 (N - 1)`` start-ups on
  its path), so the all-reduces grow with N as a real job's do when it adds hosts, while the sleeping
  compute per rank stays: what deft gains at N apart from this machine's 2 cores;
* ranks per host: ``--ranks-per-host M`` starts M ranks on every host (rank ``h * M + l`` on host h, as
  torchrun's ``--nproc-per-node M``); their traffic inside a host stays off the shaped NICs. The profile
  measured before the runs is the default group's flat ring, what torch DDP runs; deft's links go
  hierarchical there (``hierarchical = "auto"``), so only the schemes that time themselves (``-self``)
  are priced on what they run;
* second link: ``--second-link profile`` (default) shapes nic1 to ``rate / mu``, ``mu`` the profile's
  second/primary communication ratio (1.65 for the reference profiles: the paper's gloo vs NCCL), by
  replacing the tbf qdisc of nic1 in both hosts; ``same`` leaves it at the rate;
* the profile given to deft and to the simulator is the one measured here: the scaled compute times
  and every bucket's all-reduce time measured on each link alone (``deft.profiler.links.measure``,
  median of ``--comm-iters``, max over ranks) before the runs. Each link's model (what a piece of a
  split bucket pays) has the per-message start-up ``alpha`` the runtime's warm-up timer measures
  (:func:`deft.runtime.warmup_timer.probe_alpha`: one-element all-reduces, median, max over ranks)
  and ``beta`` fitted with it fixed (:func:`~deft.runtime.warmup_timer.fit_group_beta`); the
  ``-fit`` scheme gets the same comm times with the two-parameter fit instead
  (:func:`deft.profile.fit_alpha_beta`, what the replay used before, which can find ``alpha = 0``),
  for a before/after within one run.

Schemes: ``compute`` the model alone on each host at once (no communication: checks the emulation itself
against the profile's forward + backward); ``ddp`` torch DDP with one bucket per parameter
(``bucket_cap_mb`` = 1 byte, so its all-reduces are the profile's buckets; simulated as ``wfbp``: the
same messages, the optimizer step waiting for all of them, which is torch DDP); ``deft-eps0`` deft with
epsilon = 0 (no delayed update) on both links; ``deft-eps0-fit`` the same with the fitted-alpha profile;
``deft-eps0-self`` the same given no profile: deft times itself in its profile iterations (the warm-up
timer: what a user gets), plans on that, and its schedule is simulated on the profile deft measured
(``ddp.profile``); ``deft-eps0-fine`` the lag-free plan on the finest partition alone (half the
no-delay plan's capacity: many pieces, each paying the start-up), planned here and given to deft as its
schedule file; ``deft-eps0-unguarded`` ``deft-eps0`` with ``link_failover = false`` (the second link's
results used without the ranks' verdict on them: what the guard costs); ``deft`` deft's default config
(epsilon 0.01, preserver on) on both links; ``deft-self`` the same timing itself (no profile given);
``deft-plan`` deft with the preserver off (the planner's DeFT schedule, delayed updates as planned).
A deft run's links are guarded as the run guards them (every link but the primary, unless
``link_failover`` is off), so its simulation prices the verdicts it waited for.
Every other deft run is given the measured profile (``profile=``), so it plans on exactly what the
simulator sees; the schedule it ran (``ddp.schedule``) is simulated with
:func:`deft.solver.simulate.simulate_schedule` on the profile that schedule refers to.

Iteration time, measured and simulated alike: the time between forward starts, averaged over whole
cycles after ``--skip-iters`` iterations (rank 0). Also recorded over the same window: the wall time the
emulated compute really took (sleep wake-up delays show there) and the CPU time of rank 0's process
(training and gloo threads), and the machine's load average when each run started. Targets (issue 9):
measured within 10 % of simulated for torch DDP and deft, deft's measured speedup over DDP at least 90 %
of the simulated one. Results go to ``benchmarks/results/replay.md`` (between the ``replay`` markers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_links import ROOT, command_line, handle_signals, machine, run_ranks, update_section

from deft.config import DeftConfig
from deft.errors import ContractError
from deft.profile import Bucket, BucketTimes, Link, Profile, fit_alpha_beta
from deft.runtime.failover import guarded, guarded_links, guarding
from deft.runtime.warmup_timer import fit_group_beta
from deft.schedule import Schedule
from deft.solver.compare import simulate
from deft.solver.lagfree import lagfree_plan
from deft.solver.partition import profile_for_schedule
from deft.solver.simulate import simulate_schedule
from deft.testbed import Testbed

PROFILES = ROOT / "examples" / "profiles"
RESULTS = ROOT / "benchmarks" / "results" / "replay.md"
HEADER = "# Replay: the paper's profiles on the testbed, measured against the simulator\n"
LINKS = ("primary", "second")


@dataclass(frozen=True)
class Scheme:
    label: str
    settings: dict[str, Any]  # deft config settings; None for torch DDP
    deft: bool = True
    profile: str = "probe"  # deft's profile: probe (measured alpha), fit (fitted alpha), self (deft times itself)
    scales: tuple[float, ...] | None = None  # a lag-free plan on only these partitions, given as deft's schedule


SCHEMES: dict[str, Scheme] = {
    "compute": Scheme("computation only (each host alone, no communication)", {}, deft=False),
    "ddp": Scheme("torch DDP (one bucket per profile bucket)", {}, deft=False),
    # Adaptation off: the replay measures the schedule planned on the given profile against its
    # simulation; a switch to a schedule planned on a corrected profile would measure something else.
    "deft-eps0": Scheme("deft, epsilon 0, two links", {"epsilon": 0.0, "adapt": False}),
    "deft-eps0-unguarded": Scheme("deft, epsilon 0, two links, link failover off",
                                  {"epsilon": 0.0, "adapt": False, "link_failover": False}),
    "deft-eps0-fit": Scheme("deft, epsilon 0, two links, fitted alpha (before)", {"epsilon": 0.0, "adapt": False},
                            profile="fit"),
    "deft-eps0-self": Scheme("deft, epsilon 0, two links, its own warm-up profile", {"epsilon": 0.0, "adapt": False},
                             profile="self"),
    "deft-eps0-fine": Scheme("deft, epsilon 0, two links, lag-free plan on the finest partition (x0.5)",
                             {"epsilon": 0.0, "adapt": False}, scales=(0.5,)),
    "deft": Scheme("deft default (epsilon 0.01, preserver), two links", {"adapt": False}),
    "deft-self": Scheme("deft default, its own warm-up profile", {"adapt": False}, profile="self"),
    "deft-plan": Scheme("deft, preserver off (the planner's schedule), two links",
                        {"preserver": False, "adapt": False}),
}


# --------------------------------------------------------------------------------------------------
# The rescaled profile
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """What the replay model is built to be: per bucket compute (s) and size (bytes), the second
    link's slow-down ``mu``; the comm times are measured on the testbed before the runs."""

    name: str
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    nbytes: tuple[int, ...]
    paper_comm_s: tuple[float, ...]  # the reference's primary all-reduce times, scaled
    mu: float
    reference_cr: float


def target_of(ref: Profile, name: str, scale: float, rate_mbit: float, overhead: float) -> Target:
    """Scale every time by ``scale``; size bucket ``i`` so that its 2-rank all-reduce at the link rate
    takes ``scale * T_i`` (ring all-reduce of 2 ranks: each rank sends the buffer once, 8 bits per byte,
    ``overhead`` for headers); whole float32 elements, at least one."""
    primary = ref.links[0].name
    beta = 8.0 / (rate_mbit * 1e6) * (1.0 + overhead)
    comm = [scale * ref.comm_time(b.id, primary) for b in ref.buckets]
    nbytes = tuple(max(4, 4 * round(t / beta / 4)) for t in comm)
    second = ref.links[1].name if len(ref.links) > 1 else primary
    mu = ref.total_comm_s(second) / ref.total_comm_s(primary)
    return Target(name=name, forward_s=tuple(scale * t.forward_s for t in ref.times),
                  backward_s=tuple(scale * t.backward_s for t in ref.times), nbytes=nbytes,
                  paper_comm_s=tuple(comm), mu=mu, reference_cr=ref.coverage_rate)


def module_name(i: int) -> str:
    return f"bucket{i}"


def param_name(i: int) -> str:
    return f"{module_name(i)}.weight"


def measured_profile(t: Target, comm: dict[str, list[float]], ifnames: dict[str, str],
                     alpha: dict[str, float] | None = None, world_size: int = 2) -> Profile:
    """The profile deft and the simulator get: the target's compute, the measured all-reduce times;
    each link's ``alpha`` the probed one with ``beta`` fitted to it, or (``alpha=None``) both fitted."""
    links = []
    for name in LINKS:
        if alpha is not None:
            a = alpha[name]
            beta = fit_group_beta([1] * len(t.nbytes), list(t.nbytes), comm[name], a)
        else:
            fit = fit_alpha_beta([float(n) for n in t.nbytes], comm[name], source=f"measured all-reduces on {name}")
            a, beta = fit.alpha, fit.beta
        links.append(Link(name=name, backend="gloo", ifname=ifnames[name], alpha_s=a, beta_s_per_byte=beta))
    buckets = tuple(Bucket(id=i, params=(param_name(i),), numel=n // 4, nbytes=n) for i, n in enumerate(t.nbytes))
    times = tuple(BucketTimes(forward_s=f, backward_s=b, comm_s={lk: comm[lk][i] for lk in LINKS})
                  for i, (f, b) in enumerate(zip(t.forward_s, t.backward_s, strict=True)))
    return Profile(buckets=buckets, times=times, links=tuple(links), world_size=world_size, source="synthetic",
                   model=f"{t.name}-replay", meta={"replay_of": t.name, "mu": t.mu})


# --------------------------------------------------------------------------------------------------
# Worker (one per host, run inside the namespaces)
# --------------------------------------------------------------------------------------------------
def worker(spec_path: str) -> int:
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        doc = _measure(spec, dist) if spec["job"] == "measure" else _train(spec, torch, dist)
        if rank == 0:  # a compute-only job per host: each is its own rank 0
            out = Path(spec["out"].replace("{host}", os.environ.get("BENCH_SLOT", os.environ.get("GROUP_RANK", "0"))))
            out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _measure(spec: dict[str, Any], dist: Any) -> dict[str, Any]:
    import torch

    from deft.netif import new_group_on_nic
    from deft.profiler.links import measure, measure_concurrent
    from deft.runtime.links import CommLink
    from deft.runtime.warmup_timer import probe_alpha

    groups = {"primary": None, "second": new_group_on_nic("gloo", spec["ifnames"]["second"])}
    sizes = spec["nbytes"]
    # the runtime's own start-up probe (median per rank), then max over ranks as the runtime's control plane
    probed = probe_alpha({k: CommLink(k, "gloo", None, g) for k, g in groups.items()}, cuda=False,
                         rank=dist.get_rank(), timeout_s=120.0)
    alpha = torch.tensor([probed[k] for k in groups], dtype=torch.float64)
    dist.all_reduce(alpha, op=dist.ReduceOp.MAX)
    out = {}
    for name, group in groups.items():
        samples = measure(group, sizes, iters=spec["iters"], warmup=2)
        out[name] = [s.seconds for s in samples]
    # The same sizes on both links at once (as deft sends): each link's time from the common launch.
    both, _ = measure_concurrent(list(groups.values()), sizes, iters=spec["iters"], warmup=2)
    return {"comm_s": out, "alpha_s": dict(zip(groups, alpha.tolist(), strict=True)),
            "concurrent_s": {name: [s.seconds for s in samples] for name, samples in zip(groups, both, strict=True)}}


def _replay_model(torch: Any, forward_s: list[float], backward_s: list[float], numel: list[int],
                  spent: list[float]) -> Any:
    """One parameter per bucket; bucket ``n-1`` computes first in forward, bucket ``0`` first in backward.

    Parameters are registered from bucket ``n-1`` to ``0``, so the reverse registration order torch
    DDP assumes for its first iteration is the real ready order. ``spent[0]`` accumulates the wall
    time the emulated compute really took (the sleeps, their wake-up delays, the gradient allocation),
    ``spent[1]`` the forward's part of it.
    """
    from torch import nn

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, p: Any, fwd: float, bwd: float) -> Any:
            t0 = time.perf_counter()
            ctx.bwd = bwd
            ctx.shape = p.shape
            time.sleep(fwd)
            out = x.clone()
            spent[0] += time.perf_counter() - t0
            spent[1] += time.perf_counter() - t0
            return out

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            t0 = time.perf_counter()
            time.sleep(ctx.bwd)
            grad = torch.full(ctx.shape, 1e-3, dtype=g.dtype)
            spent[0] += time.perf_counter() - t0
            return g, grad, None, None

    class Layer(nn.Module):
        """Bucket ``i``: one module owning its one parameter, so that deft's per-module forward pre-hook
        (an update finishing in the forward) waits for this bucket alone, as the simulator assumes."""

        def __init__(self, i: int) -> None:
            super().__init__()
            self.i = i
            self.weight = nn.Parameter(torch.zeros(numel[i]))

        def forward(self, x: Any) -> Any:
            return Sleep.apply(x, self.weight, forward_s[self.i], backward_s[self.i])

    class Replay(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n = len(numel)
            for i in reversed(range(self.n)):
                self.add_module(module_name(i), Layer(i))

        def forward(self, x: Any) -> Any:
            for i in reversed(range(self.n)):
                x = getattr(self, module_name(i))(x)
            return x

    return Replay()


def _trace_comms(comms: list[list[Any]]) -> None:
    """Record every all-reduce deft's links launch: ``[link, bytes, launched, completed]`` (perf_counter
    seconds; completed when its future's callback runs on a gloo thread)."""
    from deft.runtime.links import CommLink

    launch = CommLink.all_reduce

    def traced(self: CommLink, tensor: Any) -> Any:
        row = [self.name, tensor.numel() * tensor.element_size(), time.perf_counter(), None]
        comms.append(row)
        work = launch(self, tensor)

        def done(_: Any) -> None:
            row[3] = time.perf_counter()
        work.get_future().add_done_callback(done)
        return work

    CommLink.all_reduce = traced  # type: ignore[method-assign]


def _train(spec: dict[str, Any], torch: Any, dist: Any) -> dict[str, Any]:
    spent = [0.0, 0.0]
    model = _replay_model(torch, spec["forward_s"], spec["backward_s"], [n // 4 for n in spec["nbytes"]], spent)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    is_deft = SCHEMES[spec["scheme"]].deft
    comms: list[list[Any]] = []  # deft: every collective's [link, bytes, launched, completed] (perf_counter)
    if is_deft:
        import deft

        _trace_comms(comms)
        ddp = deft.DistributedDataParallel(model, optimizer=opt, config=spec["config"], profile=spec["profile"])
        own = spec["profile"] is None
    elif spec["scheme"] == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1 / 2**20)
    else:
        ddp = model
    x = torch.ones(())
    starts, cpu, compute, fwd_compute = [], [], [], []
    phases: list[list[float]] = []  # wall seconds of each iteration's forward, backward, step
    for _ in range(spec["iters"]):
        starts.append(time.perf_counter())
        cpu.append(time.process_time())  # CPU seconds of the whole process: training thread and gloo threads
        compute.append(spent[0])
        fwd_compute.append(spent[1])
        t0 = time.perf_counter()
        loss = ddp(x)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if is_deft:
            ddp.observe_loss(loss)
        opt.step()
        opt.zero_grad()
        phases.append([t1 - t0, t2 - t1, time.perf_counter() - t2])
    starts.append(time.perf_counter())
    cpu.append(time.process_time())
    compute.append(spent[0])
    fwd_compute.append(spent[1])
    doc: dict[str, Any] = {"starts": starts, "cpu": cpu, "compute": compute, "fwd_compute": fwd_compute,
                           "phases": phases}
    if is_deft:
        doc.update(schedule=ddp.schedule.to_dict(), plan_info=json.loads(json.dumps(ddp.plan_info, default=str)),
                   link_stats=ddp.link_stats, updates=len(ddp.update_log), comms=comms)
        if own and ddp.profile is not None:  # deft timed itself: the profile it planned on
            doc["profile"] = ddp.profile.to_dict()
        ddp.flush()
    return doc


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------
def shape_second_link(tb: Testbed, rate_mbit: float) -> None:
    """Re-shape link 1 (nic1) of every host to ``rate_mbit`` with the testbed's own tbf parameters."""
    tb.reshape(1, rate_mbit)


def steady_s(starts: list[float], skip: int, cycle: int) -> tuple[float, int]:
    """Mean time between forward starts over whole cycles after ``skip`` iterations; (seconds, iterations)."""
    n = (len(starts) - 1 - skip) // cycle * cycle
    if n < 1:
        raise ValueError(f"no whole cycle of {cycle} iterations after skipping {skip} of {len(starts) - 1}")
    return (starts[skip + n] - starts[skip]) / n, n


def profile_path(name: str) -> Path:
    """A reference profile's name (``examples/profiles/<name>.json``), or the path of any profile file."""
    return Path(name) if name.endswith(".json") else PROFILES / f"{name}.json"


def run_profile(tb: Testbed, name: str, args: argparse.Namespace, names: list[str], out_dir: Path
                ) -> dict[str, Any]:
    ref = Profile.load(profile_path(name))
    name = Path(name).stem
    tgt = target_of(ref, name, args.scale, args.rate_mbit, args.overhead)
    second_rate = args.rate_mbit / tgt.mu if args.second_link == "profile" else args.rate_mbit
    shape_second_link(tb, second_rate)
    print(f"[bench_replay] {name}: {len(tgt.nbytes)} buckets, {sum(tgt.nbytes) / 1e6:.2f} MB, compute "
          f"{(sum(tgt.forward_s) + sum(tgt.backward_s)) * 1e3:.0f} ms; second link at {second_rate:.0f} Mbit/s",
          flush=True)
    ifnames = {lk: tb.ifname(i) for i, lk in enumerate(LINKS)}
    base = {"nbytes": list(tgt.nbytes), "forward_s": list(tgt.forward_s), "backward_s": list(tgt.backward_s),
            "ifnames": ifnames}
    spec = out_dir / f"{name}.measure.spec.json"
    spec.write_text(json.dumps({**base, "job": "measure", "iters": args.comm_iters,
                                "out": str(out_dir / f"{name}.measure.json")}), encoding="utf-8")
    run_ranks(tb, [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec)], timeout_s=args.timeout,
              label=f"{name}/measure", per_host=args.ranks_per_host)
    measured = json.loads((out_dir / f"{name}.measure.json").read_text(encoding="utf-8"))
    comm = measured["comm_s"]
    for lk, times in measured.get("concurrent_s", {}).items():
        alone = sum(comm[lk])
        print(f"[bench_replay] {name}: all buckets on {lk}: {alone * 1e3:.0f} ms alone, {sum(times) * 1e3:.0f} ms "
              f"with the other link busy ({sum(times) / alone:.2f}x)", flush=True)
    alpha = measured["alpha_s"]
    world = tb.hosts * args.ranks_per_host
    prof = measured_profile(tgt, comm, ifnames, alpha, world_size=world)
    fitted = measured_profile(tgt, comm, ifnames, world_size=world)
    print(f"[bench_replay] {name}: alpha probed " + ", ".join(f"{k} {alpha[k] * 1e3:.3f} ms" for k in LINKS)
          + "; fitted " + ", ".join(f"{lk.name} {lk.alpha_s * 1e3:.3f} ms" for lk in fitted.links), flush=True)
    paths = {"probe": out_dir / f"{name}.profile.json", "fit": out_dir / f"{name}.profile-fit.json"}
    prof.save(paths["probe"])
    fitted.save(paths["fit"])
    runs: dict[str, Any] = {}
    for scheme in names:
        sch = SCHEMES[scheme]
        settings = dict(sch.settings)
        if sch.scales is not None:  # a forced partition: planned here, run as deft's schedule file
            forced = out_dir / f"{name}.{scheme}.schedule.json"
            lagfree_plan(prof, DeftConfig.from_dict({"epsilon": 0.0}), scales=sch.scales).save(forced)
            settings["schedule_path"] = str(forced)
        config = tb.write_config(out_dir / f"{name}.{scheme}.toml", links=2, **settings)
        alone = scheme == "compute"
        out = out_dir / (f"{name}.{scheme}.host{{host}}.json" if alone else f"{name}.{scheme}.json")
        spec = out_dir / f"{name}.{scheme}.spec.json"
        spec.write_text(json.dumps({**base, "job": "train", "scheme": scheme, "iters": args.iters,
                                    "config": str(config), "out": str(out),
                                    "profile": str(paths[sch.profile]) if sch.profile in paths else None}),
                        encoding="utf-8")
        print(f"[bench_replay] {name}: {scheme} ({sch.label})", flush=True)
        load = os.getloadavg()[0]
        try:
            run_ranks(tb, [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec)],
                      timeout_s=args.timeout, label=f"{name}/{scheme}", config=config, alone=alone,
                      per_host=args.ranks_per_host)
        except RuntimeError as e:
            print(f"[bench_replay] {name}/{scheme} FAILED: {e}", flush=True)
            runs[scheme] = {"error": str(e).splitlines()[0]}
            continue
        runs[scheme] = {**json.loads(Path(str(out).replace("{host}", "0")).read_text(encoding="utf-8")), "load": load}
    return {"name": name, "hosts": tb.hosts, "ranks_per_host": args.ranks_per_host, "profile": prof.to_dict(),
            "profile_fit": fitted.to_dict(), "alpha_probed": alpha, "target": tgt.__dict__,
            "rate_mbit": args.rate_mbit, "second_rate_mbit": second_rate,
            "concurrent_s": measured.get("concurrent_s"), "runs": runs}


@dataclass(frozen=True)
class Row:
    scheme: str
    measured_s: float
    simulated_s: float
    iterations: int
    plan: str
    links: str
    cpu_s: float | None = None  # CPU seconds per iteration of rank 0's process (all its threads)
    compute_s: float | None = None  # wall seconds per iteration the emulated compute really took
    load: float | None = None  # the machine's 1-minute load average when the run started

    @property
    def error(self) -> float:
        return self.measured_s / self.simulated_s - 1.0


def per_iteration(run: dict[str, Any], key: str, skip: int, n: int) -> float | None:
    """A cumulative counter's growth per iteration over the iteration-time window (None: not recorded)."""
    c = run.get(key)
    return None if not c else (c[skip + n] - c[skip]) / n


def guards(profile: Profile, link_failover: bool) -> Callable[[str], bool]:
    """Which of ``profile``'s links a run guards, as the run decides it (:mod:`deft.runtime.failover`)."""
    names = [lk.name for lk in profile.links]
    on = guarding(link_failover, names)
    return lambda link: guarded(on, names[0], link)


def analyse(rec: dict[str, Any], args: argparse.Namespace) -> tuple[list[Row], dict[str, str]]:
    """Measured and simulated iteration time of every scheme that ran; failures by scheme."""
    prof = Profile.from_dict(rec["profile"], f"{rec['name']} replay profile")
    rows, failed = [], {}

    def window(run: dict[str, Any], n: int) -> tuple[float | None, float | None]:
        return per_iteration(run, "cpu", args.skip_iters, n), per_iteration(run, "compute", args.skip_iters, n)

    for scheme, run in rec["runs"].items():
        if "error" in run:
            failed[scheme] = run["error"]
            continue
        load = run.get("load")
        if scheme == "compute":
            measured, n = steady_s(run["starts"], args.skip_iters, 1)
            rows.append(Row(scheme, measured, prof.forward_s + prof.backward_s, n, "forward + backward of the "
                            "profile", "-", *window(run, n), load))
            continue
        if scheme == "ddp":
            sim = simulate(prof, "wfbp")
            measured, n = steady_s(run["starts"], args.skip_iters, 1)
            rows.append(Row(scheme, measured, sim.iteration_s, n, "one all-reduce per bucket", "primary",
                            *window(run, n), load))
            continue
        sched = Schedule.from_dict(run["schedule"], f"{rec['name']}/{scheme} schedule")
        cfg = DeftConfig.from_dict({"epsilon": SCHEMES[scheme].settings.get("epsilon", 0.01)})
        given = {"fit": rec.get("profile_fit"), "self": run.get("profile")}.get(SCHEMES[scheme].profile)
        base = prof if given is None else Profile.from_dict(given, f"{rec['name']}/{scheme} profile")
        if SCHEMES[scheme].profile != "self":  # deft's own profile says which links it guarded
            base = guarded_links(base, guards(base, SCHEMES[scheme].settings.get("link_failover", True)))
        planned = profile_for_schedule(base, sched, cfg)
        sim = simulate_schedule(planned, sched)
        measured, n = steady_s(run["starts"], args.skip_iters, sched.cycle)
        src = run.get("plan_info", {}).get("source", "?")
        alphas = "/".join(f"{lk.alpha_s * 1e3:.2f}" for lk in base.links)
        plan = (f"{src}: cycle {sched.cycle}, K = {list(sched.batch_sequence)}, {sched.n_buckets} buckets "
                f"(alpha {alphas} ms)")
        if SCHEMES[scheme].scales is not None and rec.get("profile_fit") is not None:
            with contextlib.suppress(ContractError):  # the fitted profile may partition to other sizes
                fit = profile_for_schedule(Profile.from_dict(rec["profile_fit"]), sched, cfg)
                plan += f"; the fitted-alpha profile predicts {simulate_schedule(fit, sched).iteration_s * 1e3:.0f} ms"
        used = ", ".join(f"{k} ({v['calls']})" for k, v in run.get("link_stats", {}).items())
        rows.append(Row(scheme, measured, sim.iteration_s, n, plan, used, *window(run, n), load))
    return rows, failed


def layout_of(rec: dict[str, Any]) -> tuple[int, int]:
    """A record's (hosts, ranks per host); records made before either was kept ran 2 x 1."""
    return int(rec.get("hosts", 2)), int(rec.get("ranks_per_host", 1))


def layout_name(layout: tuple[int, int]) -> str:
    hosts, per_host = layout
    return f"{hosts} hosts" if per_host == 1 else f"{hosts} hosts x {per_host} ranks"


def report(args: argparse.Namespace, recs: list[dict[str, Any]], command: str) -> str:
    layouts = sorted({layout_of(rec) for rec in recs})
    rates = sorted({float(rec.get("rate_mbit", args.rate_mbit)) for rec in recs})
    lines = ["## Replay: measured vs simulated iteration time (`benchmarks/bench_replay.py`)", "",
             f"Command: `{command}`  ",
             f"Machine: {machine()}; {args.note}. Compute is emulated by sleeps (the CPU is free for gloo); "
             "on this 2-core machine the gloo threads of both links (and, with more hosts, of every host) still "
             "share the CPU with each other and with whatever else runs.  ",
             f"Testbed: {' / '.join(map(layout_name, layouts))} (one rank per host unless said) x 2 links, nic0 at "
             f"{' / '.join(f'{r:g}' for r in rates)} Mbit/s; times scaled by {args.scale:g}; "
             f"{args.iters} iterations per run, steady state after {args.skip_iters} (whole cycles, time between "
             "forward starts, rank 0). Simulated: `deft.solver.simulate` on the measured profile "
             "(torch DDP as `wfbp`: one all-reduce per bucket, step after all; deft: `simulate_schedule` of the "
             "schedule deft ran). Speedup = DDP's iteration / deft's. Compute per iteration: wall time the emulated "
             "forward and backward really took (sleeps, their wake-up delays, gradient allocation; the profile "
             "says forward + backward). CPU per iteration: CPU time of rank 0's process "
             "(training thread and gloo threads) over the same window. Load: the machine's 1-minute load average "
             "when the run started (2 cores).", ""]
    verdicts = []
    speedups: list[Speedup] = []
    side: list[tuple[str, tuple[int, int], str, str, float, float, float | None]] = []
    for rec in recs:
        rows, failed = analyse(rec, args)
        t = rec["target"]
        prof = Profile.from_dict(rec["profile"])
        layout = layout_of(rec)
        label = f"{rec['label']}: " if rec.get("label") else ""
        where = f"{label}{rec['name']}@{layout_name(layout)}"
        lines += [f"### {label}{rec['name']}, {layout_name(layout)}", "",
                  f"{prof.n} buckets, {sum(t['nbytes']) / 1e6:.2f} MB; compute {prof.forward_s * 1e3:.0f} + "
                  f"{prof.backward_s * 1e3:.0f} ms (forward + backward); all-reduce of every bucket measured "
                  f"{prof.total_comm_s('primary') * 1e3:.0f} ms on primary (paper, scaled: "
                  f"{sum(t['paper_comm_s']) * 1e3:.0f} ms), {prof.total_comm_s('second') * 1e3:.0f} ms on second "
                  f"(shaped to {rec['second_rate_mbit']:.0f} Mbit/s, mu = {t['mu']:.2f}); coverage rate "
                  f"{prof.coverage_rate:.2f} (paper {t['reference_cr']:.2f}).", "",
                  "| scheme | measured (ms) | simulated (ms) | error | speedup measured | simulated | "
                  "measured / simulated speedup | gain kept | compute per iteration (ms) | CPU per iteration (ms) | "
                  "load | schedule | link calls |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        ddp = next((r for r in rows if r.scheme == "ddp"), None)
        for r in rows:
            if ddp is not None and SCHEMES[r.scheme].deft:
                sm, ss = ddp.measured_s / r.measured_s, ddp.simulated_s / r.simulated_s
                gain = f"{(sm - 1) / (ss - 1):.0%}" if ss > 1.0001 else "-"
                sp = [f"{sm:.2f}x", f"{ss:.2f}x", f"{sm / ss:.0%}", gain]
                verdicts.append(Verdict(where, r.scheme, abs(r.error) <= 0.10, sm / ss >= 0.9))
                speedups.append(Speedup(rec["name"], layout, r.scheme, r.measured_s, r.simulated_s,
                                        ddp.measured_s, ddp.simulated_s))
            else:
                sp = ["-"] * 4
                if r.scheme == "ddp":
                    verdicts.append(Verdict(where, r.scheme, abs(r.error) <= 0.10, None))
            if rec.get("label") and r.scheme != "compute":
                side.append((rec["name"], layout, r.scheme, rec["label"], r.measured_s, r.simulated_s,
                             None if ddp is None or r is ddp else ddp.measured_s / r.measured_s))
            cpu, comp, load = (("-" if v is None else f"{v * k:.{d}f}")
                               for v, k, d in ((r.cpu_s, 1e3, 0), (r.compute_s, 1e3, 0), (r.load, 1, 1)))
            lines.append(f"| {SCHEMES[r.scheme].label} | {r.measured_s * 1e3:.0f} | {r.simulated_s * 1e3:.0f} | "
                         f"{r.error:+.1%} | {' | '.join(sp)} | {comp} | {cpu} | {load} | {r.plan} | {r.links} |")
        for scheme, why in failed.items():
            lines.append(f"| {SCHEMES[scheme].label} | failed: {why} |" + " |" * 11)
        lines.append("")
    if len(layouts) > 1:
        lines += by_world_size(speedups)
    if side:
        lines += side_by_side(side)
    lines += targets_line(verdicts)
    return "\n".join(lines)


@dataclass(frozen=True)
class Speedup:
    """One deft run's iteration beside torch DDP's in the same record (seconds, measured and simulated)."""

    profile: str
    layout: tuple[int, int]  # hosts, ranks per host
    scheme: str
    measured_s: float
    simulated_s: float
    ddp_measured_s: float
    ddp_simulated_s: float


def comm_log(rec: dict[str, Any], scheme: str, iteration: int) -> list[str]:
    """The collectives a deft run's links launched in ``iteration`` (from its forward's start to the next
    one's, rank 0, the run's own ``comms`` record): when each was launched and ended, how long it took,
    and what the link's fitted model prices it at alone (``alpha + beta * bytes``)."""
    run = rec["runs"].get(scheme) or {}
    starts, comms = run.get("starts") or [], run.get("comms") or []
    if not comms or not 0 <= iteration < len(starts) - 1:
        raise ValueError(f"{rec['name']}/{scheme}: no collectives recorded for iteration {iteration}")
    t0, t1 = starts[iteration], starts[iteration + 1]
    links = {lk.name: lk for lk in Profile.from_dict(rec["profile"]).links}
    lines = [f"### Collectives of {rec['name']}/{scheme}, iteration {iteration} (rank 0)", "",
             "| link | bytes | launched (ms) | ended (ms) | took (ms) | priced alone (ms) |",
             "|---|---|---|---|---|---|"]
    for link, nbytes, launched, ended in sorted((c for c in comms if t0 <= c[2] < t1), key=lambda c: c[2]):
        lk = links[link]
        lines.append(f"| {link} | {nbytes} | {(launched - t0) * 1e3:.1f} | {(ended - t0) * 1e3:.1f} | "
                     f"{(ended - launched) * 1e3:.1f} | {(lk.alpha_s + lk.beta_s_per_byte * nbytes) * 1e3:.1f} |")
    return [*lines, ""]


def side_by_side(side: list[tuple[str, tuple[int, int], str, str, float, float, float | None]]) -> list[str]:
    """Each profile, layout and scheme measured under each label (``--labels``: the run directories'
    code), one row: measured / simulated (error) and the speedup over that run's torch DDP."""
    labels = list(dict.fromkeys(x[3] for x in side))
    cells: dict[tuple[str, tuple[int, int], str], dict[str, str]] = {}
    for name, layout, scheme, label, ms, sim, speedup in side:
        sp = "" if speedup is None else f", {speedup:.2f}x"
        cells.setdefault((name, layout, scheme), {})[label] = \
            f"{ms * 1e3:.0f} / {sim * 1e3:.0f} ({ms / sim - 1:+.1%}{sp})"
    lines = ["### Side by side", "",
             "Each cell: measured / simulated iteration (ms), the measurement's error against the simulation "
             "and, for deft, its speedup over the same directory's torch DDP run.", "",
             f"| profile | layout | scheme | {' | '.join(labels)} |", "|---|---|---|" + "---|" * len(labels)]
    for (name, layout, scheme), by in cells.items():
        lines.append(f"| {name} | {layout_name(layout)} | {SCHEMES[scheme].label} | "
                     + " | ".join(by.get(label, "-") for label in labels) + " |")
    return [*lines, ""]


def by_world_size(speedups: list[Speedup]) -> list[str]:
    """deft's speedup over torch DDP per profile and scheme in each layout, measured and simulated, and
    each against the two-host layout's (the issue's bar: at least as large with more hosts)."""
    lines = ["### deft's speedup over torch DDP by world size", "",
             "Each row: torch DDP's and deft's iterations (ms, measured / simulated), deft's speedup measured "
             "(simulated), and the measured speedup over the same profile and scheme's at 2 hosts x 1 rank.", "",
             "| profile | scheme | ranks | layout | torch DDP (ms) | deft (ms) | speedup measured (simulated) | "
             "against 2 hosts |", "|---|---|---|---|---|---|---|---|"]
    base = {(x.profile, x.scheme): x.ddp_measured_s / x.measured_s for x in speedups if x.layout == (2, 1)}
    for x in sorted(speedups, key=lambda x: (x.profile, x.scheme, x.layout[0] * x.layout[1], x.layout)):
        sm, ss = x.ddp_measured_s / x.measured_s, x.ddp_simulated_s / x.simulated_s
        two = base.get((x.profile, x.scheme))
        lines.append(f"| {x.profile} | {SCHEMES[x.scheme].label} | {x.layout[0] * x.layout[1]} | "
                     f"{layout_name(x.layout)} | {x.ddp_measured_s * 1e3:.0f} / {x.ddp_simulated_s * 1e3:.0f} | "
                     f"{x.measured_s * 1e3:.0f} / {x.simulated_s * 1e3:.0f} | {sm:.2f}x ({ss:.2f}x) | "
                     f"{'-' if two is None else f'{sm / two:.2f}'} |")
    return [*lines, ""]


@dataclass(frozen=True)
class Verdict:
    profile: str
    scheme: str
    within_10: bool
    speedup_90: bool | None  # None: not a deft run


def targets_line(verdicts: list[Verdict]) -> list[str]:
    """The issue's two targets, counted over the runs, naming the runs that miss them."""
    if not verdicts:
        return []

    def missed(vs: list[Verdict], ok: list[bool]) -> str:
        names = [f"{v.profile}/{v.scheme}" for v, good in zip(vs, ok, strict=True) if not good]
        return f" (missed: {', '.join(names)})" if names else ""

    deft_runs = [v for v in verdicts if v.speedup_90 is not None]
    within = [v.within_10 for v in verdicts]
    kept = [bool(v.speedup_90) for v in deft_runs]
    return [f"Targets: measured within 10 % of simulated in {sum(within)} of {len(within)} torch DDP and deft runs"
            f"{missed(verdicts, within)}; deft's measured speedup at least 90 % of the simulated one in "
            f"{sum(kept)} of {len(kept)} deft runs{missed(deft_runs, kept)}. 'Gain kept' is the stricter "
            "(measured speedup - 1) / (simulated speedup - 1).", ""]


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="vgg19,resnet101,gpt2",
                    help="names of examples/profiles/*.json, or paths of profile files (e.g. one deft measured)")
    ap.add_argument("--rate-mbit", type=float, default=250.0)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every profile time by this")
    ap.add_argument("--overhead", type=float, default=0.07, help="TCP/IP bytes on the wire per payload byte")
    ap.add_argument("--second-link", choices=("profile", "same"), default="profile",
                    help="profile: nic1 at rate / mu (the profile's slower second link); same: at the rate")
    ap.add_argument("--schemes", default="compute,ddp,deft-eps0,deft,deft-plan", help=f"subset of {','.join(SCHEMES)}")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--skip-iters", type=int, default=12)
    ap.add_argument("--comm-iters", type=int, default=5, help="all-reduces per bucket and link when measuring")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--note", default="machine shared with other jobs during this run")
    ap.add_argument("--save-runs", default=None, help="keep specs, profiles and records in this directory")
    ap.add_argument("--hosts", type=int, default=2, help="testbed hosts")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="ranks per host (torchrun's --nproc-per-node): their traffic inside a host stays off the "
                         "shaped NICs; profiles given to deft are measured with the default group's flat ring")
    ap.add_argument("--from-runs", default=None,
                    help="no runs: rebuild the report from --save-runs directories (comma-separated; several "
                         "host counts add a table of the speedup by world size)")
    ap.add_argument("--labels", default=None,
                    help="with --from-runs: a label per directory (the code it ran), and a side-by-side table")
    ap.add_argument("--comms", default=None, metavar="SCHEME:ITERATION",
                    help="with --from-runs: print the collectives that scheme's run launched in that iteration "
                         "and write nothing")
    ap.add_argument("--results", default=str(RESULTS), help="the markdown file whose replay section is written")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    names = [n for n in args.schemes.split(",") if n]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        ap.error(f"--schemes: unknown scheme {unknown[0]!r}; choose from {', '.join(SCHEMES)}")
    profiles = [p for p in args.profiles.split(",") if p]
    missing = [p for p in profiles if not profile_path(p).is_file()]
    if missing:
        ap.error(f"--profiles: no file {profile_path(missing[0])}")
    if not (args.rate_mbit > 0 and args.scale > 0 and args.overhead >= 0):
        ap.error("--rate-mbit and --scale must be > 0, --overhead >= 0")
    if args.hosts < 2 or args.ranks_per_host < 1:
        ap.error(f"--hosts: expected at least 2 hosts of at least 1 rank, got {args.hosts} x {args.ranks_per_host}")
    if args.iters <= args.skip_iters + 4:
        ap.error(f"--iters ({args.iters}) must exceed --skip-iters ({args.skip_iters}) by more than 4")
    handle_signals()
    # the ranks import deft from this checkout, not from wherever the interpreter's deft is installed
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if args.from_runs:
        recs, commands = [], []
        dirs = [Path(d) for d in args.from_runs.split(",") if d]
        labels = [x for x in args.labels.split(",") if x] if args.labels else []
        if labels and len(labels) != len(dirs):
            ap.error(f"--labels: expected one per --from-runs directory ({len(dirs)}), got {len(labels)}")
        for i, run_dir in enumerate(dirs):
            recs += [{**json.loads(f.read_text(encoding="utf-8")), **({"label": labels[i]} if labels else {})}
                     for p in profiles for f in [run_dir / f"{Path(p).stem}.record.json"] if f.is_file()]
            cmd = run_dir / "command.txt"
            commands.append(cmd.read_text(encoding="utf-8").strip() if cmd.exists() else f"(runs in {run_dir})")
        command = "; ".join(commands)
    else:
        command = command_line()
        recs = []
        with tempfile.TemporaryDirectory() as tmp, \
                Testbed(hosts=args.hosts, links=2, rate_mbit=args.rate_mbit) as tb:
            out_dir = Path(args.save_runs or tmp)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "command.txt").write_text(command + "\n", encoding="utf-8")
            print(f"[bench_replay] testbed {tb.base} up: {tb.hosts} hosts x {args.ranks_per_host} rank(s) x 2 links "
                  f"at {args.rate_mbit:g} Mbit/s", flush=True)
            for p in profiles:
                t0 = time.perf_counter()
                try:
                    rec = run_profile(tb, p, args, names, out_dir)
                except RuntimeError as e:
                    print(f"[bench_replay] {p}: FAILED: {e}", flush=True)
                    continue
                (out_dir / f"{Path(p).stem}.record.json").write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
                print(f"[bench_replay] {p}: done in {time.perf_counter() - t0:.0f} s", flush=True)
                recs.append(rec)
    if not recs:
        print("[bench_replay] nothing ran", flush=True)
        return 1
    if args.comms:
        scheme, _, it = args.comms.partition(":")
        for rec in recs:
            print("\n".join(comm_log(rec, scheme, int(it))))
        return 0
    text = report(args, recs, command)
    print(text)
    if not args.no_write:
        results = Path(args.results)
        if not results.exists():
            results.write_text(HEADER, encoding="utf-8")
        update_section("replay", text, results)
        print(f"[bench_replay] wrote {results}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
