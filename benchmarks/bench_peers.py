"""deft against what a user would pick instead: every scheme of examples/train_cnn.py on the testbed.

    sudo .venv/bin/python benchmarks/bench_peers.py [--rates 50,250,1000] [--epochs 4] [--seeds 0,1,2]
                                                    [--repeats 1] [--schemes compute,torch,deft]
                                                    [--save-runs DIR] [--from-runs DIR[,DIR...]]
                                                    [--results benchmarks/results/FRAGMENT.md]
    sudo .venv/bin/python benchmarks/bench_peers.py --workload lm --trainer accelerate [--rates 250]
    sudo .venv/bin/python benchmarks/bench_peers.py --hosts 4 | --hosts 2 --ranks-per-host 2 [--launcher torchrun]

Builds one testbed per rate (DESIGN.md section 6: ``--hosts`` (2) hosts x 2 links, every NIC ``tc
tbf``-shaped to the rate; with more than two hosts each link is a bridge; all of them up at once, in
separate namespaces) and trains ``examples/train_cnn.py`` (4.4M-parameter CNN on scikit-learn digits,
batch 32 per rank, SGD lr 0.02 momentum 0.9, ``--ranks-per-host`` (1) ranks per host; ``--lr-schedule
cosine`` decays the learning rate to 0 over the run, so that the final accuracy is not taken mid-swing)
for ``--epochs`` epochs with every scheme and every seed of ``--seeds`` (default: ``--seed``, 0):

* ``compute``: each rank trains alone (``--compute-only``: one rank's shard, no communication) at
  the same time as the others: computation under the same CPU load, the floor;
* ``torch``: torch DDP on nic0; ``fp16``: + ``fp16_compress_hook``; ``powersgd``: + ``powerSGD_hook``
  (rank 4, error feedback, warm start, PowerSGD from 10 % of the iterations on);
* ``torch-2nic``: torch DDP on both NICs the way torch offers it: the ranks get
  ``GLOO_SOCKET_IFNAME=nic0,nic1``, so gloo opens one device per NIC and round-robins whole
  collectives over them; with ``bucket_cap_mb`` 4 DDP has several buckets' all-reduces in flight;
* ``accum2``: torch DDP + ``no_sync`` over 2 iterations (a step every 2nd iteration, same learning rate);
* ``localsgd2``, ``localsgd4``, ``localsgd8``: torch's post-local SGD (global gradient all-reduce for
  the first 10 % of the iterations, then local steps and a model average every 2nd, 4th, 8th step;
  ``localsgd``, the older name of ``localsgd4``, is still accepted and read from older records);
* ``diloco``: DiLoCo (Douillard et al. 2023, ``examples/diloco.py``): H = 8 local steps of the same SGD,
  then the averaged pseudo-gradient (one flat all-reduce) steps the global model with an outer SGD,
  Nesterov momentum 0.9, lr 0.7 (the paper's), written out on the default process group;
* ``torchft-diloco8``, ``torchft-localsgd4``, ``torchft-localsgd8``: torchft's own ``DiLoCo`` (the
  diloco row's H and outer optimizer) and ``LocalSGD`` (parameters averaged every 4th or 8th step, no
  warm-up phase), each host one replica group of one rank under a ``torchft.Manager``, the lighthouse
  in-process on host 0, torchft's gloo process group on nic0 (``examples/torchft_peers.py``);
* ``deft-eps0``: deft with epsilon = 0 on nic0 only (reordering and re-bucketing, nothing delayed);
* ``deft``: deft with its default config (epsilon 0.01, preserver on) on both links;
* ``deft-fp16``, ``deft-powersgd``: the same with deft's ``compression`` knob (``--compression``):
  torch's fp16 hook, or PowerSGD with the powersgd row's settings (rank 4, error feedback, warm
  start, from 10 % of the iterations on), on deft's scheduled buckets;
* ``deft-queued``, ``deft-fp16-queued``: ``deft``, ``deft-fp16`` with ``link_queue = true`` (one send in
  flight per gloo link);
* ``deft-local4``, ``deft-local8``, ``deft-diloco8``: deft's local-steps mode (``--local-steps``),
  post-local SGD or DiLoCo at a fixed period; ``deft-adacomm``, ``deft-diloco-ada``: the same with
  ``--local-period adacomm`` and ``--local-steps 16`` as the largest period: deft chooses the period
  from measurements and shortens it as the loss falls (AdaComm).

Through a trainer (``--workload lm``): ``torch+accelerate`` and ``deft+accelerate`` train
``examples/train_lm.py --trainer accelerate``, Accelerate's ``no_trainer`` loop with
``accelerate.Accelerator`` (torch DDP) or ``deft.integrations.accelerate.Accelerator`` (deft's default
config, both links). ``--trainer accelerate`` runs torch, deft and both of these (unless ``--schemes``
says otherwise) and adds, per rate, deft's ratio to torch DDP under the trainer beside its ratio in
train_lm.py's own loop, from the same interleaved run.

Ranks: rank ``h * M + l`` runs on host ``h`` (M ranks per host), started with the environment torchrun's
``--nnodes H --nproc-per-node M`` gives its ranks (``--launcher env``, the default: no agent process per
host taking CPU from the ranks, every rank a process this script stops by id, and the one-rank-per-host
runs exactly those of the earlier reports), or by torchrun itself in each host's namespace (``--launcher
torchrun``). Ranks of one host reach each other at the host's own addresses, which the kernel routes
over the namespace's loopback: only traffic between hosts crosses the shaped NICs. The ``compute``
floor runs every rank alone, on the shard a rank of the whole world trains on. Every table and plot
names the world size (hosts x ranks per host); ``--from-runs`` over runs of several layouts writes a
table per layout.

The runs are interleaved: for each repeat and seed the scheme order is rotated by one, and each scheme
runs at every rate before the next scheme starts, so a slow spell of the shared machine hits all alike.
The test accuracy is measured every ``--eval-every`` iterations. Reported per rate: steady iteration
time (mean over the iterations after ``--skip-iters``: cheap and costly iterations of accum2,
localsgd and merged updates average out), time to 93 % and 95 % test accuracy counted from the
wrapper's construction (set-up, warm-up, deft's profiling and planning included; evaluation excluded),
final and best accuracy, updates per iteration and the ratios to torch DDP. With several runs (seeds x
repeats) each figure is the median over them (times to a target with their range; the final accuracy also
as a mean, and per seed). Under each table: which scheme is first on each figure and, for every deft row,
each figure on which another scheme beats it ("Where deft loses"). One accuracy-vs-time plot per rate
(``benchmarks/peers_<rate>.png``); the tables go to ``benchmarks/results/peers.md`` (between the
``peers`` markers; text outside them is kept; ``--results FILE`` writes another fragment instead, and the
plots are then named after it), with the machine's load average at the start of each
run. The testbeds are removed at the end, also on an error, Ctrl-C or SIGTERM. Three seeds for every
scheme at 50 Mbit/s take hours; ``--save-runs`` one pass of every scheme at seed 0 and another of the
rows that decide the winner at seeds 1,2, then ``--from-runs DIR0,DIR12`` writes one report of both.

``--live`` lets rank 0 of each run write to the terminal (its progress bar) and prints only the tables;
``--timeline FILE`` draws the schedule the first deft run really ran (simulated on the profile it
measured) under torch DDP's simulation on the same profile. ``scripts/demo.sh`` is
``--rates 250 --epochs 1 --schemes torch,deft --live --no-write --timeline out/deft_timeline.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_links import (
    PORT,
    ROOT,
    command_line,
    handle_signals,
    machine,
    recorded_command,
    runs_dir,
    update_section,
)

from deft.testbed import Testbed, TestbedError, own_cores, stop_process_group

HEADER = "# deft and its peers on the two-link testbed\n"


@dataclass(frozen=True)
class Workload:
    """What is trained and how it is judged: the example script, its quality metric (an accuracy, higher
    is better; or a validation loss, lower is better), the targets the times are taken to."""

    name: str
    example: Path
    results: Path
    metric: str             # the evaluations' key
    final_key: str          # the summary's keys
    best_key: str
    higher_is_better: bool
    label: str              # the metric in words
    fixed_targets: tuple[float, ...] = ()  # () : set from torch DDP's curve (targets())

    def argv(self, args: argparse.Namespace, seed: int) -> list[str]:
        length = (["--epochs", str(args.epochs), "--lr-schedule", args.lr_schedule] if self.name == "cnn"
                  else ["--iters", str(args.iters), *(["--arch", args.lm_arch] if args.lm_arch != "gpt2" else []),
                        *(["--optimizer", args.lm_optimizer] if args.lm_optimizer != "adamw" else [])])
        return [*length, "--eval-every", str(args.eval_every), "--skip-iters", str(args.skip_iters),
                "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(seed)]

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target

    def targets(self, docs: list[dict[str, Any]]) -> tuple[float, ...]:
        """The fixed targets, or the value torch DDP's run reaches at 80 % of its iterations (the
        median over its repeats; over every run shown when torch DDP did not run: the first run's own
        value would be a target that run reaches exactly and the others by their codecs' rounding)."""
        if self.fixed_targets:
            return self.fixed_targets
        ref = [d for d in docs if d["summary"]["name"] == "torch"] or docs
        at = []
        for d in ref:
            evals = d["evals"]
            last = max(e["iter"] for e in evals)
            at.append(min(evals, key=lambda e: abs(e["iter"] - 0.8 * last))[self.metric])
        return (statistics.median(at),) if at else ()

    def fmt(self, v: float) -> str:
        return f"{v:.0%}" if self.higher_is_better else f"{v:.3f}"


WORKLOADS = {
    "cnn": Workload("cnn", ROOT / "examples" / "train_cnn.py", ROOT / "benchmarks" / "results" / "peers.md",
                    "test_acc", "final_test_acc", "best_test_acc", True, "test accuracy", (0.93, 0.95)),
    "lm": Workload("lm", ROOT / "examples" / "train_lm.py", ROOT / "benchmarks" / "results" / "peers_lm.md",
                   "val_loss", "final_val_loss", "best_val_loss", False, "validation loss"),
}


@dataclass(frozen=True)
class Scheme:
    """One way to train: its label, its train_cnn.py arguments, the links its deft config lists."""

    label: str
    argv: tuple[str, ...]
    links: int = 1
    alone: bool = False  # one single-process job per host instead of one 2-rank job
    # the ranks' gloo binds to both NICs (GLOO_SOCKET_IFNAME=nic0,nic1): one gloo device per NIC, whole
    # collectives round-robined over them (torch's own way to use two NICs)
    both_nics: bool = False
    # the ranks import deft from the source tree named by $DEFT_BEFORE_TREE (a git worktree of an earlier
    # commit): the same scheme before a change, interleaved with the runs after it
    before: bool = False
    # the training loop of a trainer library (train_lm.py --trainer): lm workload only
    trainer: str | None = None
    # deft config settings of this scheme (over --deft-config's)
    config: tuple[tuple[str, Any], ...] = ()

    def env(self, tb: Testbed) -> dict[str, str]:
        """What this scheme's ranks get on top of :meth:`Testbed.env_for` (which binds gloo to nic0)."""
        env = {}
        if self.both_nics:
            env["GLOO_SOCKET_IFNAME"] = ",".join(tb.ifname(k) for k in range(tb.links))
        if self.before:
            tree = os.environ.get(BEFORE_TREE, "")
            if not (Path(tree) / "deft" / "__init__.py").is_file():
                raise SystemExit(f"bench_peers: the deft-before scheme needs ${BEFORE_TREE} to name a source tree "
                                 f"with deft/ in it (git worktree add DIR COMMIT), got {tree!r}")
            env["PYTHONPATH"] = tree
        return env


#: cnn: the learning-rate schedules of train_cnn.py's --lr-schedule, as the report words them.
LR_SCHEDULES = {"constant": "", "cosine": " decayed to 0 over the run (cosine)"}

#: The environment variable naming the earlier source tree of the ``deft-before`` scheme.
BEFORE_TREE = "DEFT_BEFORE_TREE"


def adacomm_scheme(h_max: int, outer: str) -> Scheme:
    """deft's local steps with the period chosen by deft (config local_period "adacomm"): H_0 <= h_max from
    the measured compute and averaging time, then AdaComm's rule shortens it as the loss falls."""
    what = "post-local" if outer == "average" else "DiLoCo Nesterov 0.7/0.9"
    return Scheme(f"deft local steps (AdaComm period, H <= {h_max}, {what}), two links",
                  ("--ddp", "deft", "--local-steps", str(h_max), "--local-period", "adacomm", "--local-outer", outer),
                  links=2)


SCHEMES: dict[str, Scheme] = {
    "compute": Scheme("computation only (floor)", ("--compute-only",), alone=True),
    "torch": Scheme("torch DDP", ("--ddp", "torch")),
    "fp16": Scheme("torch DDP + fp16 hook", ("--ddp", "fp16")),
    "powersgd": Scheme("torch DDP + PowerSGD (rank 4)", ("--ddp", "powersgd")),
    "accum2": Scheme("torch DDP + no_sync x2", ("--ddp", "accum2")),
    "torch-2nic": Scheme("torch DDP on both NICs (gloo round-robin, bucket_cap_mb 4)",
                         ("--ddp", "torch", "--bucket-cap-mb", "4"), both_nics=True),
    "localsgd2": Scheme("torch post-local SGD (period 2)", ("--ddp", "localsgd", "--localsgd-period", "2")),
    "localsgd4": Scheme("torch post-local SGD (period 4)", ("--ddp", "localsgd", "--localsgd-period", "4")),
    "localsgd8": Scheme("torch post-local SGD (period 8)", ("--ddp", "localsgd", "--localsgd-period", "8")),
    "diloco": Scheme("DiLoCo (H 8, outer Nesterov lr 0.7 momentum 0.9)",
                     ("--ddp", "diloco", "--diloco-h", "8", "--diloco-outer-lr", "0.7",
                      "--diloco-outer-momentum", "0.9")),
    "torchft-diloco8": Scheme("torchft DiLoCo (H 8, outer Nesterov lr 0.7 momentum 0.9)",
                              ("--ddp", "torchft-diloco", "--diloco-h", "8", "--diloco-outer-lr", "0.7",
                               "--diloco-outer-momentum", "0.9")),
    "torchft-localsgd4": Scheme("torchft LocalSGD (period 4)", ("--ddp", "torchft-localsgd", "--localsgd-period", "4")),
    "torchft-localsgd8": Scheme("torchft LocalSGD (period 8)", ("--ddp", "torchft-localsgd", "--localsgd-period", "8")),
    # the lm workload through Accelerate's loop (train_lm.py --trainer accelerate)
    "torch+accelerate": Scheme("torch DDP through Accelerate", ("--ddp", "torch", "--trainer", "accelerate"),
                               trainer="accelerate"),
    "deft+accelerate": Scheme("deft default through Accelerate, two links",
                              ("--ddp", "deft", "--trainer", "accelerate"), links=2, trainer="accelerate"),
    "deft-eps0": Scheme("deft, epsilon 0, one link", ("--ddp", "deft", "--epsilon", "0")),
    "deft": Scheme("deft default, two links", ("--ddp", "deft"), links=2),
    # deft's default before it chose codecs itself (compression = "none": every bucket exact)
    "deft-exact": Scheme("deft default, every bucket exact, two links", ("--ddp", "deft", "--compression", "none"),
                         links=2),
    # deft's local-steps mode (config local_steps: every rank steps, the averaging overlapped over both links)
    "deft-local4": Scheme("deft local steps (H 4, post-local), two links", ("--ddp", "deft", "--local-steps", "4"),
                          links=2),
    "deft-local8": Scheme("deft local steps (H 8, post-local), two links", ("--ddp", "deft", "--local-steps", "8"),
                          links=2),
    "deft-diloco8": Scheme("deft local steps (H 8, DiLoCo Nesterov 0.7/0.9), two links",
                           ("--ddp", "deft", "--local-steps", "8", "--local-outer", "diloco"), links=2),
    # the same with the period chosen by deft (adacomm_scheme): deft-adacomm, deft-diloco-ada (H_max 16),
    # deft-adacomm8, deft-diloco-ada8
    **{f"deft-{name}{'' if h_max == 16 else h_max}": adacomm_scheme(h_max, outer)
       for h_max in (16, 8) for name, outer in (("adacomm", "average"), ("diloco-ada", "diloco"))},
    # the link-failover guard off: a lost second link then ends the run (what the guard costs)
    "deft-unguarded": Scheme("deft default, two links, link failover off", ("--ddp", "deft"), links=2,
                             config=(("link_failover", False),)),
    "deft-before": Scheme("deft default before this change ($DEFT_BEFORE_TREE), two links", ("--ddp", "deft"),
                          links=2, before=True),
    "deft-fp16": Scheme("deft default + fp16 hook, two links", ("--ddp", "deft", "--compression", "fp16"), links=2),
    # the default and deft + fp16 with one send in flight per gloo link (link_queue, opt-in)
    "deft-queued": Scheme("deft default, two links, link queue", ("--ddp", "deft"), links=2,
                          config=(("link_queue", True),)),
    "deft-fp16-queued": Scheme("deft default + fp16 hook, two links, link queue", ("--ddp", "deft", "--compression",
                               "fp16"), links=2, config=(("link_queue", True), ("compression", "fp16"))),
    "deft-int8": Scheme("deft default + deft's int8 hook, two links", ("--ddp", "deft", "--compression", "int8"),
                        links=2),
    "deft-powersgd": Scheme("deft default + PowerSGD (rank 4), two links",
                            ("--ddp", "deft", "--compression", "powersgd"), links=2),
}


#: older names, still accepted by --schemes and read from older --save-runs records
ALIASES = {"localsgd": "localsgd4"}


def canonical(name: str) -> str:
    return ALIASES.get(name, name)


def run_order(names: list[str], rates: list[float], repeats: int, seeds: list[int] | None = None
              ) -> list[tuple[int, int, str, float]]:
    """(repeat, seed, scheme, rate) in execution order: for each repeat and seed the schemes rotated by one
    more, all rates per scheme (so a slow spell of the machine hits every scheme alike)."""
    order = []
    for r in range(repeats):
        for j, seed in enumerate(seeds or [0]):
            k = (r * len(seeds or [0]) + j) % len(names)
            for name in names[k:] + names[:k]:
                order += [(r, seed, name, rate) for rate in rates]
    return order


#: The launchers of ``--launcher``: ``env`` starts every rank itself with the environment torchrun would give it
#: (rank ``h * M + l`` on host ``h``); ``torchrun`` runs torchrun's multi-node launch in every host's namespace.
LAUNCHERS = ("env", "torchrun")
#: gloo's complaint on every rank of the testbed's namespaces (no name for the peer's address): not an error
NOISE = "hostname of the client socket cannot be retrieved"
#: The most ranks one run may start: each is a process training on this machine's few cores.
MAX_WORLD = 16
MAX_RANKS_PER_HOST = 8


@dataclass(frozen=True)
class Layout:
    """Where a run's ranks are: ``hosts`` testbed hosts, ``per_host`` ranks on each."""

    hosts: int = 2
    per_host: int = 1

    @property
    def world(self) -> int:
        return self.hosts * self.per_host

    def words(self) -> str:
        """``4 ranks (2 hosts x 2 ranks per host)``: the world size in every heading."""
        per = f"{self.per_host} rank{'s' if self.per_host > 1 else ''} per host"
        return f"{self.world} ranks ({self.hosts} hosts x {per})"

    def suffix(self) -> str:
        """What a plot's file name adds: nothing for the 2 x 1 layout (the older names), else ``_2x2``."""
        return "" if self == Layout() else f"_{self.hosts}x{self.per_host}"

    @classmethod
    def of(cls, summary: dict[str, Any]) -> Layout:
        """A run's layout from its record (records from before ``--hosts``: 2 hosts x 1 rank)."""
        return cls(int(summary.get("hosts", 2)), int(summary.get("ranks_per_host", 1)))


def check_layout(hosts: int, per_host: int) -> str | None:
    """Why ``--hosts``/``--ranks-per-host`` cannot run, or None."""
    if hosts < 2:
        return f"--hosts: expected an integer >= 2 (the testbed joins hosts by shaped links), got {hosts}"
    if not 1 <= per_host <= MAX_RANKS_PER_HOST:
        return f"--ranks-per-host: expected an integer in [1, {MAX_RANKS_PER_HOST}], got {per_host}"
    if hosts * per_host > MAX_WORLD:
        return (f"--hosts {hosts} x --ranks-per-host {per_host} = {hosts * per_host} ranks: at most {MAX_WORLD} "
                "(every rank is a process training on this machine)")
    return None


def pin_hosts(choice: str, hosts: int, cores: int) -> bool:
    """Whether each host's processes run on its own share of the ``cores`` (``--pin-hosts``: ``on``,
    ``--no-pin-hosts``: ``off``, neither: ``auto``).

    ``auto`` pins where every host gets a core of its own (:func:`deft.testbed.own_cores`), as every real
    cluster's hosts have: unpinned, the ranks of all hosts take turns at all cores unevenly, which no
    cluster does (benchmarks/results/prices_pinned.md). With more hosts than cores pinning cannot give
    each its own, so ``auto`` leaves them unpinned."""
    if choice not in ("on", "off", "auto"):
        raise ValueError(f"pin_hosts: expected 'on', 'off' or 'auto', got {choice!r}")
    return choice == "on" or (choice == "auto" and own_cores(hosts, cores))


@dataclass(frozen=True)
class Proc:
    """One process a run starts: on ``host``, running rank ``rank`` (a torchrun: its host's first rank)."""

    host: int
    rank: int
    argv: list[str]
    env: dict[str, str]


def processes(tb: Testbed, per_host: int, argv: list[str], env: dict[str, str], config: Path, alone: bool,
              launcher: str = "env") -> list[Proc]:
    """The processes of one run of ``argv`` (``[python, script, ...]``) on every host, with ``env`` (the
    scheme's variables) on top of :meth:`Testbed.env_for`'s. ``alone``: every rank its own one-process job
    (same CPU load, no communication); ``{host}`` in an argument becomes the rank's index, so jobs that
    each think they are rank 0 write distinct files."""
    world, procs = tb.hosts * per_host, []
    for h in range(tb.hosts):
        if launcher == "torchrun" and not alone:
            base = tb.env_for(h, rank=h * per_host, world=world, port=PORT, config=config)
            links = {k: base[k] for k in ("GLOO_SOCKET_IFNAME", "DEFT_CONFIG", "OMP_NUM_THREADS")}
            procs.append(Proc(h, h * per_host, [*tb.torchrun_argv(h, per_host, PORT), *argv[1:]], {**links, **env}))
            continue
        for local in range(per_host):
            rank = h * per_host + local
            e = tb.env_for(h, rank=rank, world=world, port=PORT, config=config, local_rank=local,
                           local_world=per_host)
            if alone:
                e.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=tb.addr(h, 0),
                         MASTER_PORT=str(PORT + local))
            procs.append(Proc(h, rank, [a.replace("{host}", str(rank)) for a in argv], {**e, **env}))
    return procs


def run_procs(tb: Testbed, procs: list[Proc], timeout_s: float, label: str, live: bool = False,
              pin: bool = False) -> None:
    """Start every process, stream rank 0's output (``live``: straight to this terminal, its progress bar
    redrawing in place) and every other line naming an error; raise on a failure or the timeout, with the
    last lines of every process. ``pin``: each host's processes on that host's cores only
    (:func:`deft.testbed.host_cpus`)."""
    logs: list[list[str]] = [[] for _ in procs]
    started, threads = [], []
    for i, pr in enumerate(procs):
        out: dict[str, Any] = ({} if live and pr.rank == 0 else
                               {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "bufsize": 1})
        p = tb.popen(pr.host, pr.argv, pr.env, pin=pin, **out)
        started.append(p)
        if p.stdout is None:
            continue

        def pump(i: int = i, proc: Any = p, rank: int = pr.rank) -> None:
            for line in proc.stdout:
                logs[i].append(line)
                if not live and (rank == 0 or ("error" in line.lower() and NOISE not in line)):
                    print(f"  [{label} r{rank}] {line.rstrip()}", flush=True)

        threads.append(threading.Thread(target=pump, daemon=True))
        threads[-1].start()
    deadline, failed = time.monotonic() + timeout_s, None
    for pr, p in zip(procs, started, strict=True):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failed = f"rank {pr.rank} (host {pr.host}) did not finish within {timeout_s:.0f} s"
            break
        if rc != 0:
            failed = f"rank {pr.rank} (host {pr.host}) exited with {rc}"
            break
    if failed:
        for p in started:
            stop_process_group(p, grace_s=10.0)
    for t in threads:
        t.join(timeout=5)
    if failed:
        tail = "".join(f"[rank {pr.rank}] " + "".join(lg[-15:]) for pr, lg in zip(procs, logs, strict=True))
        raise RuntimeError(f"{label}: {failed}\n--- last output ---\n{tail}")


def run_config(tb: Testbed, sch: Scheme, path: Path, args: argparse.Namespace) -> Path:
    """The deft config of one run at ``path``: the testbed's links the scheme uses, and ``--deft-config``."""
    return tb.write_config(path, links=sch.links, **{**args.deft_config, **dict(sch.config)})


def run_one(tb: Testbed, name: str, rep: int, seed: int, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    sch, wl, layout = SCHEMES[name], WORKLOADS[args.workload], Layout(tb.hosts, args.ranks_per_host)
    stem = f"{name}.{tb.rate_mbit:g}.s{seed}.r{rep}"
    out = out_dir / f"{stem}.json"
    config = run_config(tb, sch, out_dir / f"{stem}.toml", args)
    json_arg = str(out_dir / f"{stem}.host{{host}}.json") if sch.alone else str(out)
    # the floor: each rank alone on the shard a rank of this world trains on
    shards = ["--shards", str(layout.world)] if sch.alone and wl.name == "cnn" else []
    quiet = ["--no-progress"] if wl.name == "cnn" and not args.live else []
    argv = [sys.executable, str(wl.example), *sch.argv, *wl.argv(args, seed), *shards, "--json", json_arg, *quiet]
    print(f"[bench_peers] {tb.rate_mbit:g} Mbit/s, {layout.words()}, seed {seed}, repeat {rep}: {name} "
          f"({sch.label})", flush=True)
    t0, load = time.perf_counter(), os.getloadavg()[0]
    procs = processes(tb, args.ranks_per_host, argv, sch.env(tb), config, sch.alone, args.launcher)
    run_procs(tb, procs, timeout_s=args.timeout, label=f"{name}@{tb.rate_mbit:g}", live=args.live,
              pin=args.pin_hosts)
    doc = json.loads((out_dir / f"{stem}.host0.json" if sch.alone else out).read_text(encoding="utf-8"))
    doc["summary"].update(wall_s=time.perf_counter() - t0, rate_mbit=tb.rate_mbit, repeat=rep, name=name, load=load,
                          seed=seed, env=sch.env(tb), hosts=layout.hosts, ranks_per_host=layout.per_host,
                          launcher=args.launcher, pinned=args.pin_hosts)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return doc


def run_all(args: argparse.Namespace, names: list[str], rates: list[float], out_dir: Path,
            failed: dict[tuple[str, float], str]) -> list[dict[str, Any]]:
    """Every (repeat, scheme, rate) on testbeds that are all up for the whole run; failures recorded."""
    docs = []
    with contextlib.ExitStack() as stack:
        beds = {}
        for rate in rates:
            beds[rate] = stack.enter_context(Testbed(hosts=args.hosts, links=2, rate_mbit=rate))
            print(f"[bench_peers] testbed {beds[rate].base} up: {args.hosts} hosts x 2 links at {rate:g} Mbit/s, "
                  f"{args.ranks_per_host} rank(s) per host", flush=True)
        order = run_order(names, rates, args.repeats, args.seeds)
        if args.warm_run and order:
            warm_up(beds, order[0], args, out_dir)
        for rep, seed, name, rate in order:
            try:
                doc = run_one(beds[rate], name, rep, seed, args, out_dir)
            except RuntimeError as e:
                print(f"[bench_peers] {name} at {rate:g} Mbit/s, seed {seed} FAILED: {e}", flush=True)
                failed[(name, rate)] = f"seed {seed}: {str(e).splitlines()[0]}"
                continue
            s, wl = doc["summary"], WORKLOADS[args.workload]
            print(f"[bench_peers] {name} at {rate:g} Mbit/s, seed {seed}: {s['iter_s_mean'] * 1e3:.0f} ms/iteration, "
                  f"final {wl.label} {s[wl.final_key]:.3f}, {s['wall_s']:.0f} s", flush=True)
            docs.append(doc)
    return docs


def warm_up(beds: dict[float, Testbed], first: tuple[int, int, str, float], args: argparse.Namespace,
            out_dir: Path) -> None:
    """One epoch (lm: one evaluation period) of the pass's first run, discarded: the first run of a pass had
    its first iteration 1-2 s slower than any other (forward and backward 1.3-1.7 s against 0.4 s, at 50 and
    at 250 Mbit/s, benchmarks/results/slow_links.md), and the rotation always starts with the first scheme."""
    rep, seed, name, rate = first
    scratch = out_dir / "warm-up"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        short = {"epochs": 1, "iters": min(args.iters, args.eval_every)}  # cnn: one epoch; lm: one evaluation's
        run_one(beds[rate], name, rep, seed, argparse.Namespace(**{**vars(args), **short}), scratch)
    except RuntimeError as e:  # the measured runs report their own failures
        print(f"[bench_peers] warm-up run failed (ignored): {str(e).splitlines()[0]}", flush=True)


def time_to(evals: list[dict[str, Any]], target: float, wl: Workload) -> float | None:
    """Seconds (``time_s``: set-up and warm-up included, evaluation excluded) to the first evaluation
    that reaches ``target`` (an accuracy at or above it, a loss at or below it); None if never."""
    return next((e["time_s"] for e in evals if wl.reached(e[wl.metric], target)), None)


@dataclass(frozen=True)
class Row:
    """One scheme at one rate over its runs (seeds x repeats): medians (times to a target: over the runs that
    reach it, with their range), the final metric's median and mean, and each seed's final value."""

    name: str
    runs: int
    iter_s: float
    iter_spread: tuple[float, float]
    # target -> (median seconds, runs that reached it, (fastest, slowest) of those)
    to_target: dict[float, tuple[float | None, int, tuple[float, float] | None]]
    final_acc: float
    final_mean: float
    final_by_seed: dict[int, float]  # seed -> final value (median over that seed's repeats)
    best_acc: float
    updates_per_iter: float
    time_s: float
    plan: str
    load: float | None  # the machine's 1-minute load average when the (first) run started


def summarize(name: str, docs: list[dict[str, Any]], wl: Workload, targets: tuple[float, ...]) -> Row:
    iters = [d["summary"]["iter_s_mean"] for d in docs]
    to: dict[float, tuple[float | None, int, tuple[float, float] | None]] = {}
    for t in targets:
        hit = [x for x in (time_to(d["evals"], t, wl) for d in docs) if x is not None]
        to[t] = (statistics.median(hit), len(hit), (min(hit), max(hit))) if hit else (None, 0, None)
    finals = [d["summary"][wl.final_key] for d in docs]
    by_seed: dict[int, list[float]] = {}
    for d in docs:
        by_seed.setdefault(int(d["summary"].get("seed", 0)), []).append(d["summary"][wl.final_key])
    sched = docs[0]["summary"].get("schedule") or {}
    plan = ""
    if sched:
        prices = "; ".join(f"{p.predicted_s * 1e3:.0f} / {p.measured_s * 1e3:.0f}" for p in plan_prices(docs[0]))
        plan = f"K = {sched.get('K')}, links {sched.get('links')}, plans predicted / measured (ms): {prices or '-'}"
    return Row(name=name, runs=len(docs), iter_s=statistics.median(iters), iter_spread=(min(iters), max(iters)),
               to_target=to, final_acc=statistics.median(finals), final_mean=statistics.fmean(finals),
               final_by_seed={k: statistics.median(v) for k, v in sorted(by_seed.items())},
               best_acc=statistics.median(d["summary"][wl.best_key] for d in docs),
               updates_per_iter=statistics.median(d["summary"]["updates_per_iter"] for d in docs),
               time_s=statistics.median(d["summary"]["time_s"] for d in docs), plan=plan,
               load=docs[0]["summary"].get("load"))


def _sec(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f}"


def _secs(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f} s"


def _ratio(base: float | None, v: float | None) -> str:
    return "-" if base is None or v is None or v <= 0 else f"{base / v:.2f}x"


def table(rate: float, rows: list[Row], wl: Workload, targets: tuple[float, ...], layout: Layout = Layout()
          ) -> list[str]:
    base = next((r for r in rows if r.name == "torch"), None)
    to_cols = "".join(f" time to {wl.fmt(t)} (s) | vs torch DDP |" for t in targets)
    lines = [f"### {rate:g} Mbit/s, {layout.words()}", "",
             f"| scheme | runs | iteration (ms) | vs torch DDP |{to_cols} final {wl.label}: median (mean) | "
             "final per seed | best | updates / iteration | time at the end (s) | load |",
             "|---|---|---|---|" + "---|---|" * len(targets) + "---|---|---|---|---|---|"]
    for r in rows:
        spread = f" ({r.iter_spread[0] * 1e3:.0f}-{r.iter_spread[1] * 1e3:.0f})" if r.runs > 1 else ""
        cells = [f"{SCHEMES[r.name].label}", str(r.runs), f"{r.iter_s * 1e3:.0f}{spread}",
                 _ratio(base.iter_s if base else None, r.iter_s)]
        for t in targets:
            sec, n, rng = r.to_target[t]
            note = f" ({rng[0]:.1f}-{rng[1]:.1f})" if rng is not None and n > 1 else ""
            note += f" ({n}/{r.runs} runs)" if 0 < n < r.runs else ""
            cells += [_sec(sec) + note, _ratio(base.to_target[t][0] if base else None, sec)]
        mean = f" ({r.final_mean:.3f})" if r.runs > 1 else ""
        cells += [f"{r.final_acc:.3f}{mean}", ", ".join(f"s{k} {v:.3f}" for k, v in r.final_by_seed.items()),
                  f"{r.best_acc:.3f}", f"{r.updates_per_iter:.3f}", f"{r.time_s:.1f}",
                  "-" if r.load is None else f"{r.load:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *verdict(rows, wl, targets)]
    plans = [f"- {SCHEMES[r.name].label}: {r.plan}" for r in rows if r.plan]
    if plans:
        lines += ["", "deft's plans (first run):", "", *plans]
    return lines


def _reach(r: Row, t: float) -> tuple[float, float]:
    """Sort key to a target: the larger share of runs that reached it first, then the shorter median time."""
    sec, n, _ = r.to_target[t]
    return (-n / r.runs, sec if sec is not None else float("inf"))


def _reached(r: Row, t: float) -> str:
    sec, n, _ = r.to_target[t]
    return "never" if sec is None else f"{sec:.1f} s" + (f", {n}/{r.runs} runs" if n < r.runs else "")


def verdict(rows: list[Row], wl: Workload, targets: tuple[float, ...]) -> list[str]:
    """Who is first at this rate, and every figure on which a deft row is behind another scheme, in words.
    The computation-only floor is no scheme one could train with, so it takes part in neither. To a target,
    a scheme that got there in more of its runs is ahead; among equal shares the shorter median time."""
    peers = [r for r in rows if r.name != "compute"]
    if not peers:
        return []
    sign = 1 if wl.higher_is_better else -1
    first = [f"iteration: {SCHEMES[min(peers, key=lambda r: r.iter_s).name].label}"]
    for t in targets:
        reached = [r for r in peers if r.to_target[t][0] is not None]
        if reached:
            w = min(reached, key=lambda r: _reach(r, t))
            n = f", {w.to_target[t][1]}/{w.runs} runs" if w.to_target[t][1] < w.runs else ""
            first.append(f"time to {wl.fmt(t)}: {SCHEMES[w.name].label} ({w.to_target[t][0]:.1f} s{n})")
        else:
            first.append(f"time to {wl.fmt(t)}: no scheme reached it")
    w = max(peers, key=lambda r: sign * r.final_acc)
    first.append(f"final {wl.label} (median): {SCHEMES[w.name].label} ({w.final_acc:.3f})")
    lines = ["First at this rate (computation-only floor excluded): " + "; ".join(first) + ".", ""]
    defts = [r for r in peers if r.name.startswith("deft")]
    if defts:
        lines += ["Where deft loses at this rate:", ""]
    for d in defts:
        behind = []
        faster = sorted((r for r in peers if r.iter_s < d.iter_s and r is not d), key=lambda r: r.iter_s)
        if faster:
            behind.append(f"per iteration ({d.iter_s * 1e3:.0f} ms) slower than "
                          + ", ".join(f"{SCHEMES[r.name].label} ({r.iter_s * 1e3:.0f})" for r in faster))
        for t in targets:
            ahead = sorted((r for r in peers if r is not d and r.to_target[t][0] is not None
                            and _reach(r, t) < _reach(d, t)), key=lambda r: _reach(r, t))
            if ahead:
                behind.append(f"time to {wl.fmt(t)} ({_reached(d, t)}) behind "
                              + ", ".join(f"{SCHEMES[r.name].label} ({_reached(r, t)})" for r in ahead))
        better = sorted((r for r in peers if r is not d and sign * r.final_acc > sign * d.final_acc),
                        key=lambda r: -sign * r.final_acc)
        if better:
            behind.append(f"final {wl.label} ({d.final_acc:.3f}, median of {d.runs}) below "
                          + ", ".join(f"{SCHEMES[r.name].label} ({r.final_acc:.3f}, {r.runs})" for r in better))
        lines.append(f"- {SCHEMES[d.name].label}: " + ("; ".join(behind) if behind else "behind no other scheme")
                     + ".")
    return lines


#: How far a plan's predicted iteration may sit from its measured one (issue 44's bar).
PREDICTION_TOLERANCE = 0.15


@dataclass(frozen=True)
class PlanPrice:
    """One plan deft ran: its prediction when it was installed, and what it measured: the adaptation's
    window on it (``on == "window"``), or the run's steady iteration for a plan no window measured."""

    predicted_s: float
    measured_s: float
    on: str

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def plan_prices(doc: dict[str, Any]) -> tuple[PlanPrice, ...]:
    """Every plan of one deft run with its prediction and measurement, in order (from the adaptation's
    records, ``plan_info["adapt"]``). Going back to a plan measured before is no new prediction (the
    schedule then carries its measured time as its prediction), so it adds nothing; a plan installed by
    the last record is priced against the run's steady iteration. Without records: the schedule the run
    ended on against the steady iteration."""
    sched = doc["summary"].get("schedule") or {}
    steady = doc["summary"]["iter_s_mean"]
    records = [r for r in (sched.get("plan_info") or {}).get("adapt") or []
               if isinstance(r, dict) and isinstance(r.get("predicted_s"), (int, float))
               and isinstance(r.get("measured_s"), (int, float))]
    if not records:
        pred = sched.get("predicted_iteration_s")
        return (PlanPrice(pred, steady, "run"),) if isinstance(pred, (int, float)) and pred > 0 else ()
    prices = [PlanPrice(r["predicted_s"], r["measured_s"], "window") for r in records]
    last = records[-1]
    if last.get("new_schedule") and isinstance(last.get("new_predicted_s"), (int, float)) \
            and str(last.get("decision", "")).startswith("try"):
        prices.append(PlanPrice(last["new_predicted_s"], steady, "run"))
    return tuple(prices)


@dataclass(frozen=True)
class LayoutRows:
    """torch DDP's and deft's default rows at one layout and rate, with the targets they were judged on and
    the prices of the plans deft's first run ran (:func:`plan_prices`)."""

    layout: Layout
    torch: Row
    deft: Row
    targets: tuple[float, ...]
    plans: tuple[PlanPrice, ...]


def layout_rows(layout: Layout, at: list[dict[str, Any]], wl: Workload) -> LayoutRows | None:
    """The :class:`LayoutRows` of the runs ``at`` one layout and rate; None without both schemes."""
    torch_docs = [d for d in at if d["summary"]["name"] == "torch"]
    deft_docs = [d for d in at if d["summary"]["name"] == "deft"]
    if not torch_docs or not deft_docs:
        return None
    targets = wl.targets(at)
    return LayoutRows(layout, summarize("torch", torch_docs, wl, targets), summarize("deft", deft_docs, wl, targets),
                      targets, plan_prices(deft_docs[0]))


def scale_table(rate: float, rows: list[LayoutRows], wl: Workload) -> list[str]:
    """deft's default against torch DDP at every layout of one rate, and in words where its ratio at more
    ranks falls under its ratio at two hosts of one rank, where it is not first to a target, and where its
    plan's prediction is more than :data:`PREDICTION_TOLERANCE` off the measured iteration, and where its
    final metric is worse than torch DDP's at the three decimals the table shows."""
    lines = [f"### deft's default against torch DDP by layout, {rate:g} Mbit/s", "",
             "| layout | torch DDP iteration (ms) | deft iteration (ms) | vs torch DDP | "
             "deft's plans: predicted / measured (ms) | prediction vs measured | "
             "to the target: torch DDP / deft (s) | vs torch DDP | "
             f"final {wl.label}: torch DDP / deft |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = next((r for r in rows if r.layout == Layout()), None)
    notes = []
    for r in rows:
        ratio = r.torch.iter_s / r.deft.iter_s
        prices = "; ".join(f"{p.predicted_s * 1e3:.0f} / {p.measured_s * 1e3:.0f}" for p in r.plans) or "-"
        errors = "; ".join(f"{p.error:+.1%}" for p in r.plans) or "-"
        to_cells = [f"{wl.fmt(t)}: {_sec(r.torch.to_target[t][0])} / {_sec(r.deft.to_target[t][0])}"
                    for t in r.targets]
        to_ratios = [_ratio(r.torch.to_target[t][0], r.deft.to_target[t][0]) for t in r.targets]
        lines.append(f"| {r.layout.words()} | {r.torch.iter_s * 1e3:.0f} | {r.deft.iter_s * 1e3:.0f} | {ratio:.2f}x | "
                     f"{prices} | {errors} | {'; '.join(to_cells)} | {'; '.join(to_ratios)} | "
                     f"{r.torch.final_acc:.3f} / {r.deft.final_acc:.3f} |")
        where = r.layout.words()
        for i, p in enumerate(r.plans, 1):
            if abs(p.error) > PREDICTION_TOLERANCE:
                on = "its adaptation window" if p.on == "window" else "the run's steady iteration"
                notes.append(f"- {where}: plan {i}'s prediction is {p.error:+.1%} off {on} "
                             f"({p.predicted_s * 1e3:.0f} against {p.measured_s * 1e3:.0f} ms).")
        for t in r.targets:
            sec_t, sec_d = r.torch.to_target[t][0], r.deft.to_target[t][0]
            if sec_d is None or (sec_t is not None and sec_t <= sec_d):
                notes.append(f"- {where}: deft is not first to {wl.fmt(t)} ({_secs(sec_d)} against torch DDP's "
                             f"{_secs(sec_t)}).")
        if not wl.reached(round(r.deft.final_acc, 3), round(r.torch.final_acc, 3)):  # as the table shows them
            notes.append(f"- {where}: deft's final {wl.label} {r.deft.final_acc:.3f} is worse than torch DDP's "
                         f"{r.torch.final_acc:.3f} (best {r.deft.best_acc:.3f} against {r.torch.best_acc:.3f}).")
        if base is None or r is base:
            continue
        base_ratio = base.torch.iter_s / base.deft.iter_s
        if ratio < base_ratio:
            notes.append(f"- {where}: deft's iteration ratio {ratio:.2f}x is under its {base_ratio:.2f}x at "
                         f"{base.layout.words()}.")
        for t, bt in zip(r.targets, base.targets, strict=False):
            now = _ratio(r.torch.to_target[t][0], r.deft.to_target[t][0])
            then = _ratio(base.torch.to_target[bt][0], base.deft.to_target[bt][0])
            if "-" not in (now, then) and float(now[:-1]) < float(then[:-1]):
                notes.append(f"- {where}: to {wl.fmt(t)} deft's ratio {now} is under its {then} (to "
                             f"{wl.fmt(bt)}) at {base.layout.words()}.")
    lines += ["", "Where deft falls short at this rate:" if notes else
              "deft's ratio holds at every layout, it is first to every target, its final metric is torch DDP's "
              f"or better and every prediction is within {PREDICTION_TOLERANCE:.0%}.", ""]
    return lines + notes


def plot(rate: float, docs: list[dict[str, Any]], names: list[str], path: Path, wl: Workload,
         targets: tuple[float, ...], layout: Layout = Layout()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colors = plt.get_cmap("tab20")
    for i, name in enumerate(names):
        runs = [d for d in docs if d["summary"]["name"] == name]
        for j, d in enumerate(runs):
            ev = d["evals"]
            ax.plot([e["time_s"] for e in ev], [e[wl.metric] for e in ev], marker="o", ms=3,
                    color=colors(i % 20), alpha=1.0 if j == 0 else 0.35, lw=1.6 if name.startswith("deft") else 1.1,
                    ls="-" if not name.startswith("deft") else "-.", label=SCHEMES[name].label if j == 0 else None)
    for t in targets:
        ax.axhline(t, color="grey", ls=":", lw=1)
    model = "DigitsCNN (4.4M parameters)" if wl.name == "cnn" else "GPT-2 (byte level)"
    seeds = sorted({int(d["summary"].get("seed", 0)) for d in docs})
    ax.set(xlabel="time since the wrapper's construction, evaluation excluded (s)", ylabel=wl.label,
           title=f"{model}, {layout.words()}, two-link testbed at {rate:g} Mbit/s"
                 + (f" (seeds {', '.join(map(str, seeds))}: faint lines)" if len(seeds) > 1 else ""))
    if wl.name == "cnn":
        ax.set_ylim(0.5, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def deft_timeline(doc: dict[str, Any], path: Path, rate: float) -> str:
    """Draw the schedule a deft run really ran (simulated on the profile it measured) under torch DDP's
    simulation on the same profile; returns one line comparing measured and predicted iteration time."""
    from deft.config import DeftConfig
    from deft.errors import DeftError
    from deft.profile import Profile
    from deft.schedule import Schedule
    from deft.solver.codecs import exact_profile
    from deft.solver.compare import simulate
    from deft.solver.partition import profile_for_schedule
    from deft.solver.simulate import simulate_schedule
    from deft.solver.timeline import draw_timeline

    info = doc["summary"].get("schedule") or {}
    if "schedule" not in info or "profile" not in info:
        return f"no timeline: the deft run recorded no schedule/profile ({info.get('error', 'not a deft run')})"
    sched = Schedule.from_dict(info["schedule"], "schedule deft ran")
    prof = Profile.from_dict(info["profile"], "profile deft measured")
    cfg = DeftConfig.from_dict({"epsilon": doc["summary"].get("epsilon", 0.01)})
    try:
        planned = profile_for_schedule(prof, sched, cfg)
    except DeftError as e:  # adaptation went back to a schedule planned on another partition of the buckets
        return (f"no timeline: the schedule deft ended on ({sched.n_buckets} buckets) does not fit the profile "
                f"it recorded last ({prof.n} buckets): {e}")
    ran = simulate_schedule(planned, sched, scheme="deft")
    ddp = simulate(exact_profile(prof), "ddp", cfg)  # torch DDP sends every bucket exact
    path.parent.mkdir(parents=True, exist_ok=True)
    draw_timeline({"torch DDP": ddp, "deft (the schedule it ran)": ran}, path,
                  title=f"deft's measured profile at {rate:g} Mbit/s: torch DDP vs the schedule deft ran "
                        f"(K = {list(sched.batch_sequence)})")
    measured = doc["summary"]["iter_s_mean"]
    return (f"timeline: {path} (deft measured {measured * 1e3:.0f} ms/iteration; its plan predicted "
            f"{ran.iteration_s * 1e3:.0f} ms, torch DDP {ddp.iteration_s * 1e3:.0f} ms on the same profile)")


def run_lr_schedule(docs: list[dict[str, Any]]) -> str:
    """The learning-rate schedule the runs trained with, from their records (``"constant"`` for records
    from before ``--lr-schedule``), so a report rebuilt with ``--from-runs`` names it whatever the flags.
    Runs of different schedules are not compared in one report."""
    found = sorted({d["summary"].get("lr_schedule", "constant") for d in docs})
    if len(found) > 1:
        raise SystemExit(f"bench_peers.py: error: the runs mix learning-rate schedules ({', '.join(found)}); "
                         "report them separately")
    return found[0] if found else "constant"


#: (the scheme in the script's own loop, the same scheme through the trainer) for the trainer table
TRAINER_PAIRS = {"accelerate": (("torch", "torch+accelerate"), ("deft", "deft+accelerate"))}


def trainer_table(rows: list[Row], wl: Workload, targets: tuple[float, ...]) -> list[str]:
    """deft's ratio to torch DDP in train_lm.py's own loop beside the same ratio through each trainer whose
    four rows ran: iteration time and time to each target; the last column, the trainer's ratio over the
    own loop's (1.00: the trainer changes nothing in deft's standing)."""
    by = {r.name: r for r in rows}
    lines: list[str] = []
    for trainer, ((t_own, t_tr), (d_own, d_tr)) in TRAINER_PAIRS.items():
        if not all(n in by for n in (t_own, t_tr, d_own, d_tr)):
            continue
        to = [f"time to {wl.fmt(t)}" for t in targets]
        lines += ["", f"deft's ratio to torch DDP in train_lm.py's own loop and through {trainer} "
                  "(torch DDP's figure / deft's, > 1: deft faster; the last column: the ratio through the "
                  "trainer / the ratio in the own loop):", "",
                  "| figure | own loop: torch DDP | own loop: deft | own loop: ratio | "
                  f"{trainer}: torch DDP | {trainer}: deft | {trainer}: ratio | {trainer} / own |",
                  "|---|---|---|---|---|---|---|---|"]
        figures = [("iteration (ms)", lambda r: r.iter_s * 1e3)] + [
            (label, lambda r, t=t: r.to_target[t][0]) for label, t in zip(to, targets, strict=True)]
        for label, get in figures:
            a, b, c, d = (get(by[n]) for n in (t_own, d_own, t_tr, d_tr))
            own = None if a is None or b is None or b <= 0 else a / b
            tr = None if c is None or d is None or d <= 0 else c / d
            cells = [label, *("never" if v is None else f"{v:.1f}" if "time" in label else f"{v:.0f}"
                              for v in (a, b)), "-" if own is None else f"{own:.2f}x",
                     *("never" if v is None else f"{v:.1f}" if "time" in label else f"{v:.0f}" for v in (c, d)),
                     "-" if tr is None else f"{tr:.2f}x", "-" if own is None or tr is None else f"{tr / own:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def default_schemes(workload: str, trainer: str | None) -> list[str]:
    """The schemes a run without ``--schemes`` trains: with a trainer, the four rows of its table (each
    wrapper in the own loop, then through the trainer); else every scheme the workload can run."""
    if trainer is not None:
        return [n for pair in zip(*TRAINER_PAIRS[trainer], strict=True) for n in pair]
    return [n for n, sch in SCHEMES.items() if workload == "lm" or sch.trainer is None]


def pinning(docs: list[dict[str, Any]]) -> str:
    """How the runs' hosts used the cores, for the report's machine line: each host's ranks on its own
    (``--pin-hosts``), every host on every core, or a mix (a run's ``pinned``; absent: not pinned)."""
    pinned = {bool(d["summary"].get("pinned")) for d in docs}
    if pinned == {True}:
        return "; each host's ranks on its own share of the cores (`--pin-hosts`)"
    if pinned == {True, False}:
        return "; some runs with each host's ranks on its own cores (`--pin-hosts`), the others on every core"
    return "; every host's ranks on every core (not pinned)"


def report(args: argparse.Namespace, docs: list[dict[str, Any]], names: list[str], rates: list[float],
           failed: dict[tuple[str, float], str], command: str, plots: dict[tuple[Layout, float], Path]) -> str:
    first, wl = docs[0]["summary"], WORKLOADS[args.workload]
    target = ("torch DDP reaches at 80 % of its run" if any(d["summary"]["name"] == "torch" for d in docs)
              else "each run shown reaches at 80 % of it, the median (torch DDP did not run)")
    layouts = run_layouts(docs)
    ranks = layouts[0].words() if len(layouts) == 1 else "the ranks each table's heading names"
    seeds = ", ".join(str(k) for k in sorted({int(d["summary"].get("seed", 0)) for d in docs}))
    runs = (f"seeds {seeds} (the runs column says how many each scheme had; each seed fixes the data split, "
            f"the initial model and the data order), {args.repeats} repeat(s) each, schemes interleaved")
    if wl.name == "cnn":
        model = (f"Model: examples/models.py DigitsCNN ({first['params']:,} parameters) on scikit-learn digits "
                 f"(1437 train / 360 test), batch {args.batch_size} per rank, {ranks}, SGD lr "
                 f"{args.lr} momentum 0.9{LR_SCHEDULES[run_lr_schedule(docs)]}, {args.epochs} epochs; "
                 f"test accuracy every {args.eval_every} iterations; {runs}.  ")
    else:
        arch = "LlamaForCausalLM" if first.get("arch") == "llama" else "GPT2LMHeadModel"
        optimizer = ("torch's Muon (the blocks' matrices, rate matched to AdamW's RMS) and AdamW (the rest), "
                     "two optimizers," if first.get("optimizer") == "muon" else "AdamW")
        model = (f"Model: examples/train_lm.py, a HuggingFace {arch} ({first['params']:,} parameters, "
                 "byte level, tied embeddings) on the Python standard library's source (2 MB, 90/10 split), "
                 f"batch {args.batch_size} x 64 bytes per rank, {ranks}, {optimizer} lr {args.lr} "
                 f"with warm-up then cosine decay, clip 1.0, {args.iters} iterations; "
                 f"validation loss every {args.eval_every} iterations; target: the validation loss {target}; "
                 f"{runs}.  ")
    lines = [f"## Peers: {wl.label} and time of every scheme (`benchmarks/bench_peers.py`)", "",
             f"Command: `{command}`  ",
             f"Machine: {machine()}; {args.note}. On this 2-core machine the gloo threads of every link and "
             f"the model's computation share the CPU{pinning(docs)}.  ", model,
             "Load: the machine's 1-minute load average when the run started (2 cores; '-': not recorded).  ",
             f"Iteration: mean over iterations {args.skip_iters + 1}..end. Time to an accuracy: seconds from the "
             "wrapper's construction (set-up, warm-up, deft's profiling and planning included), evaluation "
             "excluded. With several runs (seeds x repeats) each figure is the median over the runs (a time to "
             "a target over the runs that reach it, fastest-slowest in brackets, and how many did if not all; "
             "the final value also as a mean), and the final value of each seed is listed. Ratios: torch DDP's "
             "figure / the scheme's (> 1: faster than torch DDP).", ""]
    for layout in layouts:
        for rate in rates:
            at = runs_at(docs, layout, rate)
            targets = wl.targets(at)
            rows = [summarize(n, [d for d in at if d["summary"]["name"] == n], wl, targets) for n in names
                    if any(d["summary"]["name"] == n for d in at)]
            if not rows:
                continue
            lines += table(rate, rows, wl, targets, layout)
            lines += trainer_table(rows, wl, targets)
            lost = [f"- {SCHEMES[n].label}: {why}" for (n, r), why in failed.items() if r == rate]
            if lost:
                lines += ["", "Not measured:", "", *lost]
            if (layout, rate) in plots:
                lines += ["", f"![accuracy vs time at {rate:g} Mbit/s, {layout.words()}]"
                          f"({plots[layout, rate].name})"]
            lines.append("")
    for rate in rates:
        scale = [r for r in (layout_rows(lay, runs_at(docs, lay, rate), wl) for lay in layouts) if r is not None]
        if len(scale) > 1:
            lines += [*scale_table(rate, scale, wl), ""]
    return "\n".join(lines)


def run_layouts(docs: list[dict[str, Any]]) -> list[Layout]:
    """The layouts the runs trained on, fewest ranks first."""
    return sorted({Layout.of(d["summary"]) for d in docs}, key=lambda lay: (lay.world, lay.hosts))


def runs_at(docs: list[dict[str, Any]], layout: Layout, rate: float) -> list[dict[str, Any]]:
    return [d for d in docs if d["summary"]["rate_mbit"] == rate and Layout.of(d["summary"]) == layout]


def parse_deft_config(items: list[str]) -> dict[str, Any]:
    """``--deft-config KEY=VALUE`` items as config settings: each key a scalar field of
    :class:`deft.DeftConfig`, each value a TOML scalar (``0``, ``0.5``, ``true``, ``"greedy"``; a bare word is
    taken as a string), the whole checked as deft checks a config file. ``ValueError`` names the bad item."""
    import tomllib

    from deft.config import DeftConfig
    from deft.errors import DeftError

    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--deft-config: {item!r}: expected KEY=VALUE (e.g. plan_lag_iters=0)")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        if key not in DeftConfig.__dataclass_fields__ or key == "links" or isinstance(value, (dict, list)):
            raise ValueError(f"--deft-config: {item!r}: {key!r} is not a scalar setting of deft's config")
        out[key] = value
    try:
        DeftConfig.from_dict(out)
    except DeftError as e:  # deft's own check of the settings: its message names the field
        raise ValueError(f"--deft-config: {e}") from e
    return out


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str], list[float]]:
    """The command line, checked: (args, the schemes to run, the rates); a bad value exits with a message
    naming the flag (argparse's exit status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="250,1000", help="comma-separated link rates in Mbit/s")
    ap.add_argument("--hosts", type=int, default=2, help="testbed hosts (network namespaces), each with two links")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help=f"ranks on each host (at most {MAX_RANKS_PER_HOST}, {MAX_WORLD} in all); traffic between "
                         "ranks of one host stays inside it (loopback), off the shaped NICs")
    ap.add_argument("--pin-hosts", dest="pin_hosts", action="store_const", const="on", default="auto",
                    help="each host's processes on that host's share of the machine's cores only (taskset), "
                         "as on real hosts; with more hosts than cores, hosts share a core in turn. Default: "
                         "pinned where every host gets a core of its own (--hosts at most the cores)")
    ap.add_argument("--no-pin-hosts", dest="pin_hosts", action="store_const", const="off",
                    help="every host's processes on every core")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="env",
                    help="env: start every rank with the environment torchrun would set (rank h * M + l on host h); "
                         "torchrun: torchrun --nnodes H --nproc-per-node M --node-rank h in each host")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="cnn",
                    help="cnn: examples/train_cnn.py (accuracy); lm: examples/train_lm.py (validation loss)")
    ap.add_argument("--epochs", type=int, default=4, help="cnn: epochs")
    ap.add_argument("--iters", type=int, default=200, help="lm: iterations")
    ap.add_argument("--lm-arch", choices=("gpt2", "llama"), default="gpt2",
                    help="lm: the model (train_lm.py --arch): GPT-2, or a Llama of the same sizes")
    ap.add_argument("--lm-optimizer", choices=("adamw", "muon"), default="adamw",
                    help="lm: the optimizer (train_lm.py --optimizer): AdamW, or torch's Muon on the blocks' "
                         "matrices with AdamW on the rest")
    ap.add_argument("--schemes", default=None,
                    help=f"comma-separated subset of {','.join(SCHEMES)} (localsgd: localsgd4, its older name; "
                         "default: every scheme the workload runs, or with --trainer the four of the trainer table)")
    ap.add_argument("--trainer", choices=sorted(TRAINER_PAIRS), default=None,
                    help="lm: run torch and deft in train_lm.py's own loop and through this trainer's loop, and "
                         "report deft's ratio to torch DDP in each")
    ap.add_argument("--results", default=None,
                    help="the fragment to write (default benchmarks/results/peers.md, lm: peers_lm.md); the "
                         "plots are named after it")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (scheme, rate, seed)")
    ap.add_argument("--no-warm-run", dest="warm_run", action="store_false",
                    help="skip the discarded one-epoch run of the first scheme that starts each pass")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="iterations between evaluations (cnn 11, lm 20)")
    ap.add_argument("--skip-iters", type=int, default=12, help="iterations left out of the steady iteration time")
    ap.add_argument("--batch-size", type=int, default=None, help="per rank (cnn 32 images, lm 4 windows)")
    ap.add_argument("--lr", type=float, default=None, help="cnn: SGD's (0.02); lm: AdamW's (1e-3)")
    ap.add_argument("--lr-schedule", choices=sorted(LR_SCHEDULES), default="constant",
                    help="cnn: the learning rate constant, or decayed to 0 over the run (cosine)")
    ap.add_argument("--seeds", default=None,
                    help="comma-separated seeds, each a separate run of every scheme at every rate (default: --seed)")
    ap.add_argument("--seed", type=int, default=0, help="the one seed when --seeds is not given")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--note", default="machine shared with other jobs during this run",
                    help="how quiet the machine was (goes into the report)")
    ap.add_argument("--save-runs", default=None, help="keep every run's JSON records in this directory")
    ap.add_argument("--from-runs", default=None,
                    help="no training: rebuild report and plots from --save-runs dirs (comma-separated: "
                         "e.g. one pass of every scheme at seed 0 and one of the deciding rows at seeds 1,2)")
    ap.add_argument("--deft-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a deft config setting (a deft.DeftConfig field, a TOML value) for every run, e.g. "
                         "plan_lag_iters=0; repeatable")
    ap.add_argument("--no-write", action="store_true", help="print the report; write neither peers.md nor plots")
    ap.add_argument("--live", action="store_true", help="rank 0 of each run prints to this terminal (progress bar)")
    ap.add_argument("--timeline", default=None,
                    help="draw the schedule of the first deft run (simulated on its profile) into this PNG")
    args = ap.parse_args(argv)
    try:
        args.deft_config = parse_deft_config(args.deft_config)
    except ValueError as e:
        ap.error(str(e))
    cnn = args.workload == "cnn"
    for key, (for_cnn, for_lm) in {"eval_every": (11, 20), "batch_size": (32, 4), "lr": (0.02, 1e-3)}.items():
        if getattr(args, key) is None:
            setattr(args, key, for_cnn if cnn else for_lm)
    if args.trainer is not None and args.workload != "lm":
        ap.error(f"--trainer {args.trainer}: the trainers run the lm workload (add --workload lm)")
    if args.schemes is None:
        args.schemes = ",".join(default_schemes(args.workload, args.trainer))
    names = list(dict.fromkeys(canonical(n) for n in args.schemes.split(",") if n))
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        ap.error(f"--schemes: unknown scheme {unknown[0]!r}; choose from {', '.join(SCHEMES)}")
    through = [n for n in names if SCHEMES[n].trainer is not None]
    if cnn and through:
        ap.error(f"--schemes: {through[0]} trains through a trainer, which only the lm workload runs")
    try:
        args.seeds = ([int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds is not None
                      else [args.seed])
    except ValueError:
        ap.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        ap.error(f"--seeds: expected distinct integers >= 0, got {','.join(map(str, args.seeds)) or 'none'}")
    try:
        rates = [float(r) for r in args.rates.split(",") if r]
    except ValueError:
        ap.error(f"--rates: expected comma-separated numbers (Mbit/s), got {args.rates!r}")
    if not rates or any(r <= 0 for r in rates):
        ap.error(f"--rates: expected positive rates, got {args.rates!r}")
    for flag, v in (("--epochs", args.epochs), ("--iters", args.iters), ("--repeats", args.repeats),
                    ("--eval-every", args.eval_every)):
        if v < 1:
            ap.error(f"{flag}: expected an integer >= 1, got {v}")
    bad_layout = check_layout(args.hosts, args.ranks_per_host)
    if bad_layout:
        ap.error(bad_layout)
    args.pin_hosts = pin_hosts(args.pin_hosts, args.hosts, len(os.sched_getaffinity(0)))
    return args, names, rates


#: The flags that shape the runs themselves, which a report from saved runs describes as they ran.
RUN_SHAPE = ("epochs", "iters", "lm_arch", "lm_optimizer", "eval_every", "skip_iters", "batch_size", "lr",
             "lr_schedule")


def adopt_run_shape(args: argparse.Namespace, recorded: list[str]) -> None:
    """A report from saved runs (``--from-runs``) takes each :data:`RUN_SHAPE` flag left at its default
    from the commands that made the runs (``recorded``), where they agree: the report describes the runs
    as they ran (``--iters 120``), not as this command's defaults would have."""
    defaults = parse_args(["--workload", args.workload])[0]
    made = []
    for cmd in recorded:
        words = shlex.split(cmd)
        tail = next((words[i + 1:] for i, w in enumerate(words) if w.endswith("bench_peers.py")), None)
        if tail is not None:
            with contextlib.suppress(SystemExit):  # a scheme since renamed or removed: that command says nothing
                made.append(parse_args(tail)[0])
    for key in RUN_SHAPE:
        values = {repr(getattr(m, key)) for m in made}
        if getattr(args, key) == getattr(defaults, key) and len(values) == 1:
            setattr(args, key, getattr(made[0], key))


def main() -> int:
    args, names, rates = parse_args()
    handle_signals()
    # the ranks import deft from this checkout, not from wherever the interpreter's deft is installed
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    failed: dict[tuple[str, float], str] = {}
    if args.from_runs:
        run_dirs = [Path(p) for p in args.from_runs.split(",") if p]
        docs = [json.loads(p.read_text(encoding="utf-8")) for run_dir in run_dirs
                for p in sorted(run_dir.glob("*.r*.json")) if ".host" not in p.name]
        for d in docs:  # records of older runs: "localsgd" is localsgd4
            d["summary"]["name"] = canonical(d["summary"]["name"])
        docs = [d for d in docs if d["summary"]["name"] in names and d["summary"]["rate_mbit"] in rates]
        recorded = [recorded_command(run_dir, command_line()) for run_dir in run_dirs]
        command = "; ".join(recorded)
        adopt_run_shape(args, recorded)
    else:
        command = command_line()
        with tempfile.TemporaryDirectory() as tmp:
            out_dir = runs_dir(Path(args.save_runs or tmp), command)
            try:
                docs = run_all(args, names, rates, out_dir, failed)
            except TestbedError as e:  # not root, no iproute2, no namespaces: one line, not a traceback
                print(f"bench_peers.py: error: {e}", file=sys.stderr)
                return 2
    if not docs:
        print("[bench_peers] nothing ran", flush=True)
        return 1
    plots: dict[tuple[Layout, float], Path] = {}
    wl = WORKLOADS[args.workload]
    results = Path(args.results).resolve() if args.results else wl.results
    plot_stem = results.stem if args.results else f"peers{'' if wl.name == 'cnn' else '_lm'}"
    if not args.no_write:
        for layout in run_layouts(docs):
            for rate in rates:
                at = runs_at(docs, layout, rate)
                if at:
                    path = plots[layout, rate] = ROOT / "benchmarks" / f"{plot_stem}{layout.suffix()}_{rate:g}.png"
                    plot(rate, at, names, path, wl, wl.targets(at), layout)
    text = report(args, docs, names, rates, failed, command, plots)
    print(text[text.index("### "):] if args.live else text)  # live: the tables, under the runs on screen
    if args.timeline:
        # the plain deft row first: on a compressed profile "torch DDP" would be simulated with the codec
        deft_runs = sorted((d for d in docs if d["summary"]["ddp"] == "deft"),
                           key=lambda d: d["summary"].get("compression", "none") != "none")
        first = deft_runs[0] if deft_runs else None
        print(deft_timeline(first, Path(args.timeline), first["summary"]["rate_mbit"]) if first
              else "no timeline: no deft run in this benchmark")
    if not args.no_write:
        if not results.exists():
            results.write_text(HEADER if wl.name == "cnn" else "# deft and its peers on a GPT-2\n",
                               encoding="utf-8")
        update_section("peers", text, results)
        print(f"[bench_peers] wrote {results} and {', '.join(p.name for p in plots.values())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
