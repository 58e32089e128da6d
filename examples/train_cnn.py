"""Train a 4.4M-parameter CNN on scikit-learn's digits with torch DDP or deft, data-parallel on CPU.

    torchrun --nproc-per-node 2 examples/train_cnn.py --ddp torch
    torchrun --nproc-per-node 2 examples/train_cnn.py --ddp deft [--epsilon 0.01] [--config deft.toml]

The training loop is a plain torch DDP loop; ``--ddp deft`` changes only the line that wraps the
model (plus the optional ``ddp.observe_loss(loss)`` that feeds deft's preserver). Without torchrun
(no ``RANK`` in the environment) it runs as a single process.

Data: the 1,797 8x8 digits that ship with scikit-learn, upsampled to 32x32 (bilinear), standardized
with the training split's mean and std; the train/test split (80/20, stratified) is fixed by
``--seed``. Each rank trains on its shard (``DistributedSampler``); ``--batch-size`` is per rank.

``--json FILE`` (rank 0) writes every iteration (train time, iteration time, loss, updates applied so
far) and every evaluation (test accuracy and loss) for the benchmark scripts. Train time excludes
evaluation. "Updates" counts optimizer steps that really changed the parameters: every iteration
for torch DDP, ``len(ddp.update_log)`` for deft.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ddp", choices=("torch", "deft"), default="torch", help="which data-parallel wrapper")
    ap.add_argument("--epsilon", type=float, default=None, help="deft's accuracy/speed knob (overrides config)")
    ap.add_argument("--no-preserver", action="store_true", help="deft: plan without the preserver's check")
    ap.add_argument("--config", default=os.environ.get("DEFT_CONFIG"),
                    help="deft TOML config (default: $DEFT_CONFIG, else deft's defaults)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=None, help="stop after this many iterations in total")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--width", type=int, default=64, help="CNN width (64: 4.4M parameters)")
    ap.add_argument("--hidden", type=int, default=832, help="first fc width")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate every N iterations (0: each epoch)")
    ap.add_argument("--skip-iters", type=int, default=10,
                    help="iterations left out of the steady-state iteration time (warm-up, planning)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write per-iteration and per-evaluation records (rank 0)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar (one line per epoch instead)")
    args = ap.parse_args(argv)
    for flag, value, low in (("--epochs", args.epochs, 1), ("--batch-size", args.batch_size, 1),
                             ("--max-iters", args.max_iters, 1), ("--width", args.width, 1),
                             ("--hidden", args.hidden, 1), ("--eval-every", args.eval_every, 0),
                             ("--skip-iters", args.skip_iters, 0)):
        if value is not None and value < low:
            ap.error(f"{flag}: expected an integer >= {low}, got {value}")
    if not args.lr > 0:
        ap.error(f"--lr: expected > 0, got {args.lr}")
    if args.config is not None and not Path(args.config).is_file():
        ap.error(f"--config: no such file {args.config} (from --config or $DEFT_CONFIG)")
    return args


def init_distributed() -> tuple[int, int]:
    """Join the job torchrun (or any env:// launcher) describes; a lone process forms a job of one."""
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"),
                          RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def wrap(model: nn.Module, args: argparse.Namespace) -> tuple[nn.Module, dict[str, Any]]:
    """The one line that differs between torch DDP and deft (plus reading deft's config)."""
    if args.ddp == "torch":
        return nn.parallel.DistributedDataParallel(model), {}
    import deft

    cfg = deft.DeftConfig.resolve(args.config)
    if args.epsilon is not None:
        cfg = dataclasses.replace(cfg, epsilon=args.epsilon)
    if args.no_preserver:
        cfg = dataclasses.replace(cfg, preserver=False)
    info = {"epsilon": cfg.epsilon, "preserver": cfg.preserver,
            "links": [dataclasses.asdict(lk) for lk in cfg.links]}
    return deft.DistributedDataParallel(model, config=cfg), info


def updates_applied(ddp: nn.Module, iters_done: int) -> int:
    log = getattr(ddp, "update_log", None)
    return len(log) if log is not None else iters_done


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
    """What a deft wrapper reports about its running plan and its links (empty for torch DDP)."""
    if not hasattr(ddp, "update_log"):
        return {}
    info: dict[str, Any] = {}
    try:
        sched = ddp.schedule
        info.update(cycle=sched.cycle, K=[u.k for u in sched.updates], links=list(sched.links),
                    buckets=len(sched.bucket_numel), predicted_iteration_s=sched.predicted_iteration_s,
                    predicted_bubble_ratio=sched.predicted_bubble_ratio)
        info["meta"] = {k: v for k, v in sched.meta.items() if isinstance(v, (int, float, str, bool))}
    except Exception as e:  # the summary must not fail the run; say what was missing instead
        info["error"] = f"{type(e).__name__}: {e}"
    stats = getattr(ddp, "link_stats", None)
    if isinstance(stats, dict):
        info["link_stats"] = stats
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed()
    torch.manual_seed(args.seed)  # same initial model everywhere (both wrappers broadcast rank 0's anyway)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    model = DigitsCNN(width=args.width, hidden=args.hidden)
    try:
        ddp, deft_info = wrap(model, args)
    except DeftError as e:  # a bad config or --epsilon: one line naming the field, not a traceback
        raise SystemExit(f"train_cnn.py: error: {e}") from None
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    torch.manual_seed(args.seed * 1000 + rank + 1)  # dropout differs per rank, as in any DDP job

    sampler = DistributedSampler(TensorDataset(x_train, y_train), num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, sampler=sampler,
                        drop_last=True)
    per_epoch = len(loader)
    total = per_epoch * args.epochs if args.max_iters is None else min(args.max_iters, per_epoch * args.epochs)
    if per_epoch == 0:
        raise SystemExit(f"--batch-size {args.batch_size} is larger than a rank's shard ({len(sampler)} samples)")
    eval_every = args.eval_every or per_epoch
    if rank == 0:
        print(f"[train_cnn] ddp={args.ddp} world={world} params={num_parameters(model):,} "
              f"train={len(y_train)} test={len(y_test)} batch={args.batch_size}/rank iters/epoch={per_epoch} "
              f"total iters={total} {json.dumps(deft_info) if deft_info else ''}", flush=True)

    from tqdm import tqdm

    bar = tqdm(total=total, disable=rank != 0 or args.no_progress, unit="it", dynamic_ncols=True)
    iters: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    train_s = 0.0
    it = 0
    start = time.perf_counter()

    def run_eval(epoch: int) -> None:
        flush = getattr(ddp, "flush", None)
        if callable(flush):
            flush()  # apply queued gradients so the test sees every iteration trained so far
        acc, test_loss = evaluate(model, x_test, y_test)
        evals.append({"iter": it, "epoch": epoch, "train_s": train_s, "wall_s": time.perf_counter() - start,
                      "test_acc": acc, "test_loss": test_loss, "updates": updates_applied(ddp, it)})
        dist.barrier()  # ranks resume training together, so evaluation time stays out of iteration times

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        losses = []
        for x, y in loader:
            t0 = time.perf_counter()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            if args.ddp == "deft":
                ddp.observe_loss(loss)
            optimizer.step()
            optimizer.zero_grad()
            dt = time.perf_counter() - t0
            train_s += dt
            it += 1
            losses.append(float(loss.detach()))
            iters.append({"iter": it, "epoch": epoch, "train_s": train_s, "iter_s": dt, "loss": losses[-1],
                          "updates": updates_applied(ddp, it)})
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.3f}", ms_per_it=f"{dt * 1e3:.0f}")
            if it % eval_every == 0 or it == total:
                run_eval(epoch)
                if rank == 0:
                    e = evals[-1]
                    msg = (f"[train_cnn] epoch {epoch} iter {it}: loss {statistics.fmean(losses):.4f} "
                           f"test acc {e['test_acc']:.4f} train time {train_s:.1f}s "
                           f"iter {statistics.median(r['iter_s'] for r in iters[-len(losses):]) * 1e3:.0f} ms "
                           f"updates {e['updates']}")
                    bar.write(msg) if not bar.disable else print(msg, flush=True)
            if it >= total:
                break
        if it >= total:
            break
    bar.close()

    steady = [r["iter_s"] for r in iters[args.skip_iters:]] or [r["iter_s"] for r in iters]
    summary = {
        "ddp": args.ddp, "world_size": world, "params": num_parameters(model), "batch_size": args.batch_size,
        "lr": args.lr, "epochs": args.epochs, "iters": it, "updates": updates_applied(ddp, it),
        "updates_per_iter": updates_applied(ddp, it) / max(it, 1),
        "iter_s_mean": statistics.fmean(steady), "iter_s_median": statistics.median(steady),
        "skip_iters": args.skip_iters, "train_s": train_s, "final_test_acc": evals[-1]["test_acc"],
        "final_test_loss": evals[-1]["test_loss"], **deft_info, "schedule": schedule_info(ddp),
        "config": args.config, "seed": args.seed,
    }
    if rank == 0:
        print(f"[train_cnn] done: {it} iters, test acc {summary['final_test_acc']:.4f}, "
              f"iteration {summary['iter_s_median'] * 1e3:.0f} ms median / {summary['iter_s_mean'] * 1e3:.0f} ms mean "
              f"(after {min(args.skip_iters, it)} skipped), updates/iter {summary['updates_per_iter']:.3f}",
              flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"summary": summary, "evals": evals, "iters": iters}, indent=1)
                                       + "\n", encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
