"""Train a 4.4M-parameter CNN on scikit-learn's digits, data-parallel on CPU, with the scheme of your choice.

    torchrun --nproc-per-node 2 examples/train_cnn.py --ddp torch
    torchrun --nproc-per-node 2 examples/train_cnn.py --ddp deft [--epsilon 0.01] [--config deft.toml]
                                                             [--compression fp16|int8|powersgd]
    torchrun --nproc-per-node 2 examples/train_cnn.py --ddp deft --local-steps 4 [--local-outer average|diloco]
                                                             [--local-period fixed|adacomm]
    torchrun --nproc-per-node 2 examples/train_cnn.py --ddp fp16|powersgd|accum2|localsgd|diloco
    torchrun --nproc-per-node 2 examples/train_cnn.py --ddp torchft-diloco [--diloco-h 8]
    torchrun --nproc-per-node 2 examples/train_cnn.py --ddp torchft-localsgd [--localsgd-period 4]
    python examples/train_cnn.py --compute-only          # one process, one rank's work, no communication

Schemes (``--ddp``), all with the same model, data, optimizer (SGD, ``--lr``, ``--momentum``) and
learning rate:

* ``torch``: ``torch.nn.parallel.DistributedDataParallel`` (``--bucket-cap-mb`` sets its ``bucket_cap_mb``,
  default torch's 25; it applies to the fp16, accum2 and localsgd schemes' DDP too). With
  ``GLOO_SOCKET_IFNAME=nic0,nic1`` gloo opens one device per NIC and round-robins whole collectives
  over them (DDP's buckets, several in flight with a small ``bucket_cap_mb``): torch's own use of two NICs.
* ``fp16``: torch DDP + ``default_hooks.fp16_compress_hook`` (gradients all-reduced in float16).
* ``powersgd``: torch DDP + ``powerSGD_hook.powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=
  --powersgd-rank (4), use_error_feedback=True, warm_start=True, start_powerSGD_iter=...)``. The start
  iteration defaults to 10 % of the run's iterations (at least 2), torch's recommended starting point
  ("start with 10% of total training steps"; 2 is the least torch allows with error feedback). DDP
  keeps all gradients in one bucket here: with several, the hook's chained all-reduces can reach the
  ranks in different orders (a crash on gloo; see ``wrap``).
* ``accum2``: torch DDP + ``no_sync()`` over ``--accumulate`` (2) iterations: the first iteration's
  backward accumulates locally, the second all-reduces the sum; the optimizer steps every 2nd
  iteration on the mean gradient (loss divided by 2) with the **same learning rate**, so one update
  covers 2 x batch per rank. ``updates / iteration`` = 0.5.
* ``localsgd``: torch's post-local SGD: ``PostLocalSGDState(start_localSGD_iter=W,
  post_local_gradient_allreduce=False)`` + ``post_localSGD_hook`` (gradients all-reduced globally for
  the first W iterations, then not at all) and ``PostLocalSGDOptimizer(SGD, PeriodicModelAverager(
  period=--localsgd-period (4), warmup_steps=W))`` (parameters averaged over all ranks every 4th step).
  W defaults to 10 % of the run's iterations (at least 1). ``post_local_gradient_allreduce=False`` is
  what torch's default (an all-reduce inside each machine) does with one rank per machine, as on the
  testbed. Every iteration applies a local update; the test accuracy is rank 0's model.
* ``diloco``: DiLoCo (Douillard et al. 2023; ``examples/diloco.py``): no DDP wrapper; every rank takes
  ``--diloco-h`` (8) local steps of the same SGD, then the pseudo-gradients (snapshot - local
  parameters) are averaged in one flat all-reduce (buckets of ``--bucket-cap-mb`` if given) and an
  outer SGD with Nesterov momentum (``--diloco-outer-lr`` 0.7, ``--diloco-outer-momentum`` 0.9, the
  paper's) steps the snapshot, which every rank loads; BatchNorm statistics are rank 0's from each
  outer step on. No warm-up phase (the paper's runs start from a pretrained model; this one does not).
  Every iteration applies a local update; the test accuracy is rank 0's model (its local parameters
  between outer steps, like localsgd).
* ``torchft-diloco``, ``torchft-localsgd``: torchft's own ``torchft.local_sgd.DiLoCo`` (``--diloco-h``
  inner steps, the outer Nesterov SGD of ``--diloco-outer-lr`` and ``--diloco-outer-momentum``) and
  ``LocalSGD`` (parameters averaged every ``--localsgd-period`` steps, no warm-up phase) under a
  ``torchft.Manager``, every rank its own replica group, the lighthouse in-process on rank 0
  (``examples/torchft_peers.py``). Every iteration applies a local update; the test accuracy is rank
  0's model, as for localsgd and diloco.
* ``deft``: ``deft.DistributedDataParallel`` (plus the optional ``ddp.observe_loss(loss)`` that feeds
  deft's preserver); ``--epsilon``, ``--no-preserver`` and ``--config`` set its config.
  ``--compression fp16|int8|powersgd`` sets deft's ``compression`` knob: torch's ``fp16_compress_hook``,
  deft's 8-bit codec (``deft.runtime.int8_hook``), or
  ``powerSGD_hook`` with the powersgd scheme's settings (``--powersgd-rank`` (4), error feedback, warm
  start, ``--powersgd-start`` defaulting to 10 % of the iterations, and the powersgd scheme's one-bucket
  ``bucket_cap_mb``), on deft's scheduled buckets; deft profiles and plans on the compressed sizes and
  the codec's compute. ``--compression none`` keeps every bucket exact; without ``--compression``
  deft's default (``"auto"``) sends buckets in fp16 where its plan says the links are the bound.
  ``--local-steps H`` runs deft's local-steps mode instead (config ``local_steps``; docs/DESIGN.md,
  "Local steps"): every rank steps on its own gradient and every H steps the ranks average the parameters
  (``--local-outer average``, post-local SGD; warm-up ``--local-warmup``, default the localsgd scheme's
  10 %) or DiLoCo's pseudo-gradient through the outer Nesterov SGD (``--local-outer diloco``, with
  ``--diloco-outer-lr`` and ``--diloco-outer-momentum``; warm-up default 0, as the diloco scheme); the
  averaging is spread over the config's links and overlaps ``--local-overlap-iters`` (1) local steps
  (``--no-local-overlap``: applied at once, post-local SGD / DiLoCo exactly). ``--local-period adacomm``
  (config ``local_period``) makes H the largest period: deft chooses the period from the first period's
  measured compute and averaging time and shortens it as the loss this loop reports falls (AdaComm).
* ``--compute-only``: no wrapper, no process group: one process doing one rank's work (the shard a
  rank of a ``--shards`` (2)-rank job trains on, same batch, same iterations per epoch). Run one per
  host at the same time and it is the floor any scheme can reach.

Without torchrun (no ``RANK`` in the environment) a ``--ddp`` run forms a job of one process.

Data: the 1,797 8x8 digits that ship with scikit-learn, upsampled to 32x32 (bilinear), standardized
with the training split's mean and std; the train/test split (80/20, stratified) is fixed by
``--seed``. Each rank trains on its shard (``DistributedSampler``); ``--batch-size`` is per rank.

Times: ``time_s`` is the time since the wrapper was constructed (its set-up, warm-up, profiling and
planning included), evaluation excluded; ``train_s`` is the sum of iteration times. Each evaluation
prints the test accuracy, ``time_s`` and the steady iteration time (the mean over the iterations since
the last evaluation, those before ``--skip-iters`` left out). ``--json FILE`` (rank 0) writes every
iteration and every evaluation (the (time, accuracy) points) and a summary. "Updates" counts optimizer
steps that changed the parameters: ``len(ddp.update_log)`` for deft, the steps taken otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import DigitsCNN, num_parameters

from deft.errors import DeftError

SCHEMES = ("torch", "fp16", "powersgd", "accum2", "localsgd", "diloco", "torchft-diloco", "torchft-localsgd", "deft")


def load_digits_split(seed: int, size: int = 32, test_fraction: float = 0.2
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): float32 images ``N x 1 x size x size``, int64 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        list(range(len(y))), test_size=test_fraction, random_state=seed, stratify=digits.target)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x_train, x_test = x[idx_train], x[idx_test]
    mean, std = x_train.mean(), x_train.std()
    return (x_train - mean) / std, y[idx_train], (x_test - mean) / std, y[idx_test]


def add_scheme_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the data-parallel schemes (:func:`wrap` reads them), shared with train_lm.py."""
    ap.add_argument("--ddp", choices=SCHEMES, default=None,
                    help="data-parallel scheme (default torch); see the module docstring")
    ap.add_argument("--compute-only", action="store_true",
                    help="one process, one rank's work, no wrapper and no communication (the floor)")
    ap.add_argument("--shards", type=int, default=2, help="--compute-only: train on the shard of a job this large")
    ap.add_argument("--epsilon", type=float, default=None, help="deft's accuracy/speed knob (overrides config)")
    ap.add_argument("--no-preserver", action="store_true", help="deft: plan without the preserver's check")
    ap.add_argument("--config", default=os.environ.get("DEFT_CONFIG"),
                    help="deft TOML config (default: $DEFT_CONFIG, else deft's defaults)")
    # The codecs that have a torch DDP peer scheme here (--ddp fp16 / powersgd), so every deft run has its
    # side-by-side comparison, and deft's own int8; bf16 works in deft (config compression = "bf16") but has
    # no peer here.
    ap.add_argument("--compression", choices=("none", "fp16", "int8", "powersgd"), default=None,
                    help="deft: compress every bucket with torch's hook (config knob compression)")
    ap.add_argument("--powersgd-rank", type=int, default=4, help="powersgd: matrix_approximation_rank")
    ap.add_argument("--powersgd-start", type=int, default=None,
                    help="powersgd: start_powerSGD_iter (default 10%% of the iterations, at least 2)")
    ap.add_argument("--accumulate", type=int, default=2, help="accum2: iterations per optimizer step")
    ap.add_argument("--localsgd-period", type=int, default=4, help="localsgd: steps between model averages")
    ap.add_argument("--localsgd-warmup", type=int, default=None,
                    help="localsgd: iterations of global gradient all-reduce first (default 10%%, at least 1)")
    ap.add_argument("--diloco-h", type=int, default=8,
                    help="diloco: inner steps per outer step (H). The paper's 500 is for ~88k-step runs; a "
                         "2-4 epoch digits run has 44-88 iterations, and H = 8 still leaves 5-11 outer steps "
                         "for the outer momentum to act on while communicating as rarely as localsgd's "
                         "longest period (8), so the two differ only in the outer optimizer")
    ap.add_argument("--diloco-outer-lr", type=float, default=0.7, help="diloco: outer SGD's learning rate (paper 0.7)")
    ap.add_argument("--diloco-outer-momentum", type=float, default=0.9,
                    help="diloco: outer SGD's Nesterov momentum (paper 0.9; 0: plain SGD)")
    ap.add_argument("--local-steps", type=int, default=None,
                    help="deft: local-steps mode, the ranks average every H steps (config local_steps)")
    ap.add_argument("--local-outer", choices=("average", "diloco"), default="average",
                    help="deft --local-steps: average the parameters (post-local SGD) or DiLoCo's outer step")
    ap.add_argument("--local-warmup", type=int, default=None,
                    help="deft --local-steps: iterations of gradient all-reduce first (default: average 10%%, "
                         "at least 1, as localsgd; diloco 0, as the diloco scheme)")
    ap.add_argument("--local-overlap-iters", type=int, default=1,
                    help="deft --local-steps: local steps an averaging overlaps before it is applied")
    ap.add_argument("--local-period", choices=("fixed", "adacomm"), default="fixed",
                    help="deft --local-steps: average every H steps (fixed), or H is the largest period, chosen "
                         "from measurements and shortened as the loss falls (adacomm; config local_period)")
    ap.add_argument("--no-local-overlap", action="store_true",
                    help="deft --local-steps: wait for each averaging at once (post-local SGD / DiLoCo exactly)")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="torch DDP schemes (torch, fp16, accum2, localsgd): DDP's bucket_cap_mb (default torch's "
                         "25); diloco: bucket size of the pseudo-gradient all-reduce (default one flat all-reduce)")


def check_scheme_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Range checks of :func:`add_scheme_args`' flags; sets ``args.ddp`` (``compute`` for --compute-only)."""
    for flag, value, low in (("--shards", args.shards, 1), ("--powersgd-rank", args.powersgd_rank, 1),
                             ("--powersgd-start", args.powersgd_start, 2), ("--accumulate", args.accumulate, 1),
                             ("--localsgd-period", args.localsgd_period, 2),
                             ("--localsgd-warmup", args.localsgd_warmup, 0), ("--diloco-h", args.diloco_h, 1),
                             ("--local-steps", args.local_steps, 1), ("--local-warmup", args.local_warmup, 0),
                             ("--local-overlap-iters", args.local_overlap_iters, 1)):
        if value is not None and value < low:
            ap.error(f"{flag}: expected an integer >= {low}, got {value}")
    if not args.diloco_outer_lr > 0:
        ap.error(f"--diloco-outer-lr: expected > 0, got {args.diloco_outer_lr}")
    if not 0 <= args.diloco_outer_momentum < 1:
        ap.error(f"--diloco-outer-momentum: expected 0 <= momentum < 1, got {args.diloco_outer_momentum}")
    if args.bucket_cap_mb is not None and not args.bucket_cap_mb > 0:
        ap.error(f"--bucket-cap-mb: expected > 0, got {args.bucket_cap_mb}")
    if args.config is not None and not Path(args.config).is_file():
        ap.error(f"--config: no such file {args.config} (from --config or $DEFT_CONFIG)")
    if args.compute_only and args.ddp is not None:
        ap.error(f"--compute-only runs no data-parallel scheme; drop --ddp {args.ddp}")
    args.ddp = "compute" if args.compute_only else (args.ddp or "torch")
    if args.compression is not None and args.ddp != "deft":
        ap.error(f"--compression is deft's knob; --ddp {args.ddp} has its own (use --ddp fp16|powersgd for torch DDP)")
    if args.local_steps is None and (args.local_warmup is not None or args.no_local_overlap
                                     or args.local_outer != "average" or args.local_overlap_iters != 1
                                     or args.local_period != "fixed"):
        ap.error("--local-outer, --local-warmup, --local-overlap-iters, --local-period and --no-local-overlap "
                 "need --local-steps")
    if args.local_steps is not None and args.ddp != "deft":
        ap.error(f"--local-steps is deft's local-steps mode; --ddp {args.ddp} has its own (localsgd, diloco)")
    if args.local_steps is not None and args.compression is not None:
        ap.error("--compression does not apply to --local-steps (parameters are averaged exactly)")
    if args.local_steps is not None and not args.no_local_overlap and args.local_overlap_iters > args.local_steps:
        ap.error(f"--local-overlap-iters: expected at most --local-steps ({args.local_steps}), "
                 f"got {args.local_overlap_iters}")
    if args.bucket_cap_mb is not None and args.ddp in ("deft", "powersgd", "compute", "torchft-diloco",
                                                       "torchft-localsgd"):
        why = {"deft": "deft buckets by its own plan", "powersgd": "powersgd keeps one bucket (see wrap())",
               "compute": "--compute-only communicates nothing"}.get(args.ddp, "torchft buckets as torchft does")
        ap.error(f"--bucket-cap-mb does not apply to --ddp {args.ddp}: {why}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_scheme_args(ap)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=None, help="stop after this many iterations in total")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                    help="cosine: the learning rate decays to 0 over the run (torch's CosineAnnealingLR, "
                         "stepped after every optimizer step)")
    ap.add_argument("--width", type=int, default=64, help="CNN width (64: 4.4M parameters)")
    ap.add_argument("--hidden", type=int, default=832, help="first fc width")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate every N iterations (0: each epoch)")
    ap.add_argument("--skip-iters", type=int, default=10,
                    help="iterations left out of the steady-state iteration time (warm-up, planning)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write per-iteration and per-evaluation records (rank 0)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar (one line per evaluation instead)")
    args = ap.parse_args(argv)
    for flag, value, low in (("--epochs", args.epochs, 1), ("--batch-size", args.batch_size, 1),
                             ("--max-iters", args.max_iters, 1), ("--width", args.width, 1),
                             ("--hidden", args.hidden, 1), ("--eval-every", args.eval_every, 0),
                             ("--skip-iters", args.skip_iters, 0)):
        if value is not None and value < low:
            ap.error(f"{flag}: expected an integer >= {low}, got {value}")
    if not args.lr > 0:
        ap.error(f"--lr: expected > 0, got {args.lr}")
    check_scheme_args(ap, args)
    return args


def init_distributed() -> tuple[int, int]:
    """Join the job torchrun (or any env:// launcher) describes; a lone process forms a job of one."""
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"),
                          RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def default_start(total_iters: int, least: int) -> int:
    """10 % of the run's iterations, at least ``least``: torch's suggested start of PowerSGD/local SGD."""
    return max(least, round(0.1 * total_iters))


@dataclasses.dataclass
class Wrapped:
    """What a scheme hands the training loop: the model to call, the optimizer, how it steps.

    ``accumulate``: iterations per optimizer step (``no_sync`` on all but the last of each group);
    ``updates``: how many updates have been applied after ``steps`` optimizer steps.
    """

    ddp: nn.Module
    optimizer: Any
    info: dict[str, Any]
    accumulate: int = 1
    updates: Callable[[int], int] = lambda steps: steps
    report: Callable[[], dict[str, Any]] = dict  # at the end of training: what to add to ``info``
    close: Callable[[], None] = lambda: None    # after the last barrier: stop what the scheme started


def lr_schedule(name: str, optimizer: Any, steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The learning-rate schedule over the run's ``steps`` optimizer steps (None: constant). Only for
    schemes whose optimizer is a torch optimizer (not DiLoCo's outer/inner pair)."""
    if name == "constant":
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise SystemExit(f"train_cnn.py: error: --lr-schedule {name} needs a torch optimizer; this scheme steps "
                         f"with {type(optimizer).__name__}")
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))


def one_bucket_mb(model: nn.Module) -> float:
    """A ``bucket_cap_mb`` that puts the whole model in one DDP bucket (torch 2.13 caps the first bucket
    at the given cap too)."""
    return max(25.0, 2 * sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20)


def deft_config(args: argparse.Namespace, total_iters: int) -> Any:
    """The ``deft.DeftConfig`` of the deft scheme: ``--config`` (or deft's defaults) with the flags applied."""
    import deft

    cfg = deft.DeftConfig.resolve(args.config)
    if args.epsilon is not None:
        cfg = dataclasses.replace(cfg, epsilon=args.epsilon)
    if args.no_preserver:
        cfg = dataclasses.replace(cfg, preserver=False)
    if args.compression is not None:  # the same PowerSGD settings as the torch scheme
        cfg = dataclasses.replace(cfg, compression=args.compression, powersgd_rank=args.powersgd_rank,
                                  powersgd_start_iter=args.powersgd_start or default_start(total_iters, 2))
    if args.local_steps is not None:
        warm = args.local_warmup if args.local_warmup is not None else \
            (default_start(total_iters, 1) if args.local_outer == "average" else 0)
        cfg = dataclasses.replace(cfg, local_steps=args.local_steps, local_outer=args.local_outer,
                                  local_warmup_iters=warm, local_outer_lr=args.diloco_outer_lr,
                                  local_outer_momentum=args.diloco_outer_momentum,
                                  local_overlap=not args.no_local_overlap,
                                  local_overlap_iters=args.local_overlap_iters, local_period=args.local_period)
    return cfg


def wrap(model: nn.Module, args: argparse.Namespace, total_iters: int, optimizer: Any = None) -> Wrapped:
    """The lines that differ between the schemes: the wrapper, its hook, its optimizer (``optimizer``, by
    default SGD with ``--lr`` and ``--momentum``; post-local SGD wraps it; an object stepping several
    torch optimizers is not given to deft, which finds them as they step)."""
    sgd = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=args.lr,
                                                                   momentum=args.momentum)
    bound = sgd if isinstance(sgd, torch.optim.Optimizer) else None
    if args.ddp == "compute":
        return Wrapped(model, sgd, {"shards": args.shards})
    if args.ddp == "deft":
        import deft

        cfg = deft_config(args, total_iters)
        if args.local_steps is not None:
            ddp = deft.DistributedDataParallel(model, optimizer=bound, config=cfg)
            info = {"epsilon": cfg.epsilon, "links": [dataclasses.asdict(lk) for lk in cfg.links],
                    "local_steps": cfg.local_steps, "local_outer": cfg.local_outer,
                    "local_warmup_iters": cfg.local_warmup_iters,
                    "local_overlap": cfg.local_overlap, "local_overlap_iters": cfg.local_overlap_iters,
                    "local_period": cfg.local_period}
            if cfg.local_outer == "diloco":
                info.update(local_outer_lr=cfg.local_outer_lr, local_outer_momentum=cfg.local_outer_momentum)
            return Wrapped(ddp, sgd, info)  # a local step every iteration
        # PowerSGD: the torch powersgd scheme's one bucket (see below), through the same torch DDP argument
        cap = one_bucket_mb(model) if cfg.compression == "powersgd" else None
        ddp = deft.DistributedDataParallel(model, optimizer=bound, config=cfg, bucket_cap_mb=cap)
        info = {"epsilon": cfg.epsilon, "preserver": cfg.preserver,
                "links": [dataclasses.asdict(lk) for lk in cfg.links], "compression": cfg.compression}
        if cfg.compression == "powersgd":
            info.update(matrix_approximation_rank=cfg.powersgd_rank, start_powerSGD_iter=cfg.powersgd_start_iter,
                        use_error_feedback=True, warm_start=True, bucket_cap_mb=cap)
        return Wrapped(ddp, sgd, info, updates=lambda _steps: len(ddp.update_log))
    if args.ddp.startswith("torchft-"):
        import torchft_peers

        period = args.diloco_h if args.ddp == "torchft-diloco" else args.localsgd_period
        peer = torchft_peers.start(args.ddp, model, sgd, period, args.diloco_outer_lr, args.diloco_outer_momentum)

        return Wrapped(model, sgd, peer.info, report=lambda: {"syncs": peer.syncs()}, close=peer.close)
    if args.ddp == "diloco":
        from diloco import DiLoCo

        opt = DiLoCo(model, sgd, h=args.diloco_h, outer_lr=args.diloco_outer_lr,
                     outer_momentum=args.diloco_outer_momentum, bucket_cap_mb=args.bucket_cap_mb)
        return Wrapped(model, opt, {"H": args.diloco_h, "outer_lr": args.diloco_outer_lr,
                                    "outer_momentum": args.diloco_outer_momentum, "outer_nesterov": True,
                                    "bucket_cap_mb": args.bucket_cap_mb})
    if args.ddp == "powersgd":
        # One DDP bucket. With several, torch's PowerSGD hook launches a bucket's second and third
        # all-reduce (P, then Q) from the completion callback of the one before, while the autograd
        # thread launches the next bucket's first all-reduce: the ranks can issue collectives in
        # different orders, which gloo reports as "Received data size doesn't match expected size"
        # (seen twice in two 88-iteration runs on the testbed with DDP's default buckets).
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=one_bucket_mb(model))
    elif args.bucket_cap_mb is not None:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    else:
        ddp = nn.parallel.DistributedDataParallel(model)
    if args.ddp == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return Wrapped(ddp, sgd, {"hook": "fp16_compress_hook"})
    if args.ddp == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        start = args.powersgd_start or default_start(total_iters, 2)
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                       use_error_feedback=True, warm_start=True, start_powerSGD_iter=start)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        return Wrapped(ddp, sgd, {"hook": "powerSGD_hook", "matrix_approximation_rank": args.powersgd_rank,
                                  "start_powerSGD_iter": start, "use_error_feedback": True, "warm_start": True,
                                  "buckets": "one (see wrap())"})
    if args.ddp == "accum2":
        return Wrapped(ddp, sgd, {"accumulate": args.accumulate, "lr": args.lr}, accumulate=args.accumulate)
    if args.ddp == "localsgd":
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
        from torch.distributed.algorithms.model_averaging import averagers
        from torch.distributed.optim import PostLocalSGDOptimizer

        warmup = args.localsgd_warmup if args.localsgd_warmup is not None else default_start(total_iters, 1)
        state = post_local.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup,
                                             post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, post_local.post_localSGD_hook)
        opt = PostLocalSGDOptimizer(optim=sgd, averager=averagers.PeriodicModelAverager(
            period=args.localsgd_period, warmup_steps=warmup))
        return Wrapped(ddp, opt, {"hook": "post_localSGD_hook", "period": args.localsgd_period,
                                  "warmup_steps": warmup})
    return Wrapped(ddp, sgd, {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb})


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on (x, y), with the model in eval mode, restored to train after."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for i in range(0, len(y), batch):
        logits = model(x[i:i + batch])
        loss_sum += float(F.cross_entropy(logits, y[i:i + batch], reduction="sum"))
        correct += int((logits.argmax(1) == y[i:i + batch]).sum())
    model.train()
    return correct / len(y), loss_sum / len(y)


def schedule_info(ddp: nn.Module) -> dict[str, Any]:
    """What a deft wrapper reports about its running plan and its links (empty for the other schemes)."""
    if not hasattr(ddp, "update_log"):
        return {}
    info: dict[str, Any] = {}
    plan = getattr(ddp, "plan_info", None)
    local = isinstance(plan, dict) and "local_steps" in plan  # local-steps mode runs no schedule
    try:
        if not local:
            sched = ddp.schedule
            info.update(cycle=sched.cycle, K=[u.k for u in sched.updates], links=list(sched.links),
                        buckets=len(sched.bucket_numel), predicted_iteration_s=sched.predicted_iteration_s,
                        predicted_bubble_ratio=sched.predicted_bubble_ratio)
            info["meta"] = {k: v for k, v in sched.meta.items() if isinstance(v, (int, float, str, bool))}
            info["schedule"] = sched.to_dict()  # the schedule that ran, for deft.solver.simulate_schedule
            profile = getattr(ddp, "profile", None)
            if profile is not None:
                info["profile"] = profile.to_dict()  # the profile it was planned on
    except Exception as e:  # the summary must not fail the run; say what was missing instead
        info["error"] = f"{type(e).__name__}: {e}"
    if isinstance(plan, dict):
        info["plan_info"] = json.loads(json.dumps(plan, default=str))
    stats = getattr(ddp, "link_stats", None)
    if isinstance(stats, dict):
        info["link_stats"] = stats
    return info


def steady_mean(iters: list[dict[str, Any]], skip: int) -> float:
    """Mean iteration time after the first ``skip`` iterations (all of them if that leaves none).

    The mean, not the median: accum2, localsgd and deft's merged updates alternate cheap and costly
    iterations, and only the mean over whole periods is their cost per iteration.
    """
    rest = [r["iter_s"] for r in iters if r["iter"] > skip] or [r["iter_s"] for r in iters]
    return statistics.fmean(rest)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.ddp == "compute":
        rank, world, replicas = 0, 1, args.shards
    else:
        rank, world = init_distributed()
        replicas = world
    barrier = dist.barrier if args.ddp != "compute" else (lambda: None)
    torch.manual_seed(args.seed)  # same initial model everywhere (the wrappers broadcast rank 0's anyway)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    model = DigitsCNN(width=args.width, hidden=args.hidden)

    data = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    per_epoch = len(loader)
    if per_epoch == 0:
        raise SystemExit(f"--batch-size {args.batch_size} is larger than a rank's shard ({len(sampler)} samples)")
    total = per_epoch * args.epochs if args.max_iters is None else min(args.max_iters, per_epoch * args.epochs)
    eval_every = args.eval_every or per_epoch

    from tqdm import tqdm

    start = time.perf_counter()  # time_s counts from here: the wrapper's set-up is part of the run
    try:
        w = wrap(model, args, total)
    except DeftError as e:  # a bad config or --epsilon: one line naming the field, not a traceback
        raise SystemExit(f"train_cnn.py: error: {e}") from None
    ddp, optimizer = w.ddp, w.optimizer
    schedule = lr_schedule(args.lr_schedule, optimizer, -(-total // w.accumulate))  # a short last group steps too
    torch.manual_seed(args.seed * 1000 + rank + 1)  # dropout differs per rank, as in any DDP job
    if rank == 0:
        print(f"[train_cnn] ddp={args.ddp} world={world} params={num_parameters(model):,} "
              f"train={len(y_train)} test={len(y_test)} batch={args.batch_size}/rank iters/epoch={per_epoch} "
              f"total iters={total} {json.dumps(w.info) if w.info else ''}", flush=True)

    bar = tqdm(total=total, disable=rank != 0 or args.no_progress, unit="it", dynamic_ncols=True,
               desc=args.ddp)
    iters: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    train_s = eval_s = 0.0
    it = steps = 0

    def run_eval(epoch: int) -> None:
        nonlocal eval_s
        t_eval = time.perf_counter()
        flush = getattr(ddp, "flush", None)
        # Apply queued gradients so the test sees every iteration trained so far; not in the local-steps
        # mode, whose flush would apply the averaging in flight early: its test sees rank 0's local
        # parameters, as the localsgd and diloco schemes' do.
        if callable(flush) and "local_steps" not in w.info:
            flush()
        acc, test_loss = evaluate(model, x_test, y_test)
        barrier()  # ranks resume training together, so evaluation time stays out of iteration times
        now = time.perf_counter()
        evals.append({"iter": it, "epoch": epoch, "time_s": t_eval - start - eval_s, "train_s": train_s,
                      "wall_s": now - start, "test_acc": acc, "test_loss": test_loss,
                      "updates": w.updates(steps)})
        eval_s += now - t_eval

    since_eval = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        losses = []
        for x, y in loader:
            group_start = (it // w.accumulate) * w.accumulate
            group_len = min(w.accumulate, total - group_start)
            sync = it + 1 == group_start + group_len  # the last iteration of its group steps
            t0 = time.perf_counter()
            no_sync = ddp.no_sync() if not sync else contextlib.nullcontext()
            with no_sync:
                loss = F.cross_entropy(ddp(x), y)
                (loss / group_len if group_len > 1 else loss).backward()
            if args.ddp == "deft":
                ddp.observe_loss(loss)
            if sync:
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if schedule is not None:
                    schedule.step()
            dt = time.perf_counter() - t0
            train_s += dt
            it += 1
            since_eval += 1
            losses.append(float(loss.detach()))
            iters.append({"iter": it, "epoch": epoch, "time_s": time.perf_counter() - start - eval_s,
                          "train_s": train_s, "iter_s": dt, "loss": losses[-1], "updates": w.updates(steps)})
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.3f}", ms_per_it=f"{dt * 1e3:.0f}")
            if it % eval_every == 0 or it == total:
                run_eval(epoch)
                if rank == 0:
                    e = evals[-1]
                    recent = iters[-since_eval:]
                    msg = (f"[train_cnn] epoch {epoch} iter {it}: loss {statistics.fmean(losses):.4f} "
                           f"test acc {e['test_acc']:.4f} time {e['time_s']:.1f}s "
                           f"iter {steady_mean(recent, args.skip_iters) * 1e3:.0f} ms "
                           f"updates {e['updates']}")
                    bar.write(msg) if not bar.disable else print(msg, flush=True)
                since_eval = 0
            if it >= total:
                break
        if it >= total:
            break
    bar.close()
    if args.ddp == "diloco":
        w.info["outer_steps"] = optimizer.outer_steps
    w.info.update(w.report())

    steady = [r["iter_s"] for r in iters[args.skip_iters:]] or [r["iter_s"] for r in iters]
    updates = w.updates(steps)
    summary = {
        "ddp": args.ddp, "world_size": world, "params": num_parameters(model), "batch_size": args.batch_size,
        "lr": args.lr, "lr_schedule": args.lr_schedule, "epochs": args.epochs, "iters": it, "updates": updates,
        "updates_per_iter": updates / max(it, 1),
        "iter_s_mean": steady_mean(iters, args.skip_iters), "iter_s_median": statistics.median(steady),
        "skip_iters": args.skip_iters, "train_s": train_s, "time_s": evals[-1]["time_s"],
        "final_test_acc": evals[-1]["test_acc"], "best_test_acc": max(e["test_acc"] for e in evals),
        "final_test_loss": evals[-1]["test_loss"], "scheme": w.info, **(w.info if args.ddp == "deft" else {}),
        "schedule": schedule_info(ddp), "config": args.config, "seed": args.seed,
    }
    if rank == 0:
        print(f"[train_cnn] done: {it} iters, test acc {summary['final_test_acc']:.4f} "
              f"(best {summary['best_test_acc']:.4f}), time {summary['time_s']:.1f}s, "
              f"iteration {summary['iter_s_mean'] * 1e3:.0f} ms mean / {summary['iter_s_median'] * 1e3:.0f} ms "
              f"median (after {min(args.skip_iters, it)} skipped), updates/iter {summary['updates_per_iter']:.3f}",
              flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"summary": summary, "evals": evals, "iters": iters}, indent=1)
                                       + "\n", encoding="utf-8")
    if args.ddp != "compute":
        dist.barrier()
        w.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
