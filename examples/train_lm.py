"""Train a GPT-2 language model (HuggingFace transformers) on the Python standard library's source text,
data-parallel on CPU, with the scheme of your choice.

    torchrun --nproc-per-node 2 examples/train_lm.py --ddp torch
    torchrun --nproc-per-node 2 examples/train_lm.py --ddp deft [--epsilon 0.01] [--compression fp16]
    torchrun --nproc-per-node 2 examples/train_lm.py --ddp fp16|powersgd|accum2|localsgd
    python examples/train_lm.py --compute-only

The schemes (``--ddp``) are ``examples/train_cnn.py``'s, with the same flags (its ``wrap``); only the
model, the data and the optimizer differ:

* **Model**: ``transformers.GPT2LMHeadModel`` from a ``GPT2Config`` (random initialisation, nothing
  downloaded): byte-level (vocabulary 256), ``--n-embd`` 320, ``--n-layer`` 8, ``--n-head`` 8,
  context ``--seq`` 64; about 10M parameters, the input embedding tied to the output layer.
* **Data**: the ``.py`` files at the top of this Python's standard library (``sysconfig``'s
  ``stdlib`` path), sorted by name and concatenated up to ``--data-bytes`` (2 MB), as bytes. The
  first 90 % train, the last 10 % validate (a fixed split). Each rank draws ``--batch-size`` windows
  of ``--seq + 1`` bytes per iteration from the training text, from a generator seeded by
  (``--seed``, rank, iteration).
* **Optimizer**: AdamW (``--lr`` 1e-3, betas 0.9/0.95, weight decay 0.1 on matrices only), a linear
  warm-up over 10 % of the iterations then cosine decay to 0 (``transformers``'
  ``get_cosine_schedule_with_warmup``), ``clip_grad_norm_(1.0)`` before every step; ``--bf16``
  runs the forward under ``torch.autocast("cpu", torch.bfloat16)`` (it helps on a CPU with bf16
  support: benchmarks/results/peers_lm.md; off by default, as the benchmark's table ran).
* **Validation**: the mean cross-entropy over ``--val-windows`` (32) fixed windows of the validation
  text every ``--eval-every`` iterations (and at the end), and its perplexity.

``--json FILE`` (rank 0) writes every iteration, every evaluation and a summary in train_cnn.py's layout
(``val_loss`` where train_cnn.py has ``test_loss``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cnn import add_scheme_args, check_scheme_args, init_distributed, schedule_info, steady_mean, wrap

from deft.errors import DeftError

VOCAB = 256  # bytes


def load_text(limit: int) -> bytes:
    """The standard library's top-level ``.py`` files, sorted by name, concatenated up to ``limit`` bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for f in sorted(root.glob("*.py")):
        out += f.read_bytes()
        if len(out) >= limit:
            break
    if len(out) < 10_000:
        raise SystemExit(f"train_lm.py: found only {len(out)} bytes of Python source under {root}")
    return bytes(out[:limit])


def split(text: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def windows(data: torch.Tensor, n: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random windows: inputs and next-byte targets, ``n x seq`` each."""
    starts = torch.randint(0, len(data) - seq - 1, (n,), generator=g)
    x = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return x[:, :-1], x[:, 1:]


def make_model(args: argparse.Namespace) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=args.seq, n_embd=args.n_embd, n_layer=args.n_layer,
                     n_head=args.n_head, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (biases, LayerNorms and nothing else decay-free)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


@torch.no_grad()
def validate(model: nn.Module, val: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean cross-entropy on the fixed validation windows (the bare module, in eval mode)."""
    model.eval()
    x, y = windows(val, args.val_windows, args.seq, torch.Generator().manual_seed(12345))
    loss = float(lm_loss(model, x, y, args.bf16))
    model.train()
    return loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_scheme_args(ap)
    ap.add_argument("--iters", type=int, default=200, help="training iterations")
    ap.add_argument("--batch-size", type=int, default=4, help="windows per rank per iteration")
    ap.add_argument("--seq", type=int, default=64, help="context length (bytes)")
    ap.add_argument("--n-embd", type=int, default=320)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bf16", action="store_true", help="forward under torch.autocast('cpu', torch.bfloat16)")
    ap.add_argument("--data-bytes", type=int, default=2_000_000)
    ap.add_argument("--val-windows", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--skip-iters", type=int, default=10,
                    help="iterations left out of the steady-state iteration time (warm-up, planning)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write per-iteration and per-evaluation records (rank 0)")
    ap.add_argument("--save-model", default=None,
                    help="rank 0 saves the trained model's state_dict here (torch.save; after flush for deft)")
    args = ap.parse_args(argv)
    for flag, value, low in (("--iters", args.iters, 1), ("--batch-size", args.batch_size, 1),
                             ("--seq", args.seq, 2), ("--n-embd", args.n_embd, 8), ("--n-layer", args.n_layer, 1),
                             ("--n-head", args.n_head, 1), ("--data-bytes", args.data_bytes, 10_000),
                             ("--val-windows", args.val_windows, 1), ("--eval-every", args.eval_every, 1),
                             ("--skip-iters", args.skip_iters, 0)):
        if value < low:
            ap.error(f"{flag}: expected an integer >= {low}, got {value}")
    if args.n_embd % args.n_head:
        ap.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if not args.lr > 0:
        ap.error(f"--lr: expected > 0, got {args.lr}")
    args.momentum = 0.0  # read by train_cnn.wrap only when it builds its own SGD (never here)
    check_scheme_args(ap, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    compute = args.ddp == "compute"
    rank, world = (0, 1) if compute else init_distributed()
    train, val = split(load_text(args.data_bytes))
    torch.manual_seed(args.seed)
    model = make_model(args)
    opt = make_optimizer(model, args.lr)
    start = time.perf_counter()
    try:
        w = wrap(model, args, args.iters, optimizer=opt)
    except DeftError as e:
        raise SystemExit(f"train_lm.py: error: {e}") from None
    from transformers import get_cosine_schedule_with_warmup

    sched = get_cosine_schedule_with_warmup(opt, max(1, args.iters // 10), args.iters)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"[train_lm] ddp={args.ddp} world={world} params={n_params:,} train={len(train):,} bytes "
              f"val={len(val):,} bytes batch={args.batch_size}x{args.seq}/rank iters={args.iters}", flush=True)
    iters: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    train_s = eval_s = 0.0
    steps = 0

    def run_eval(it: int) -> None:
        nonlocal eval_s
        t_eval = time.perf_counter()
        flush = getattr(w.ddp, "flush", None)
        if callable(flush):
            flush()
        loss = validate(model, val, args)
        if not compute:
            dist.barrier()
        now = time.perf_counter()
        evals.append({"iter": it, "time_s": t_eval - start - eval_s, "train_s": train_s, "val_loss": loss,
                      "perplexity": math.exp(min(loss, 50.0)), "updates": w.updates(steps)})
        eval_s += now - t_eval
        if rank == 0:
            print(f"[train_lm] iter {it}: val loss {loss:.4f} (perplexity {evals[-1]['perplexity']:.2f}) "
                  f"time {evals[-1]['time_s']:.1f}s", flush=True)

    for it in range(args.iters):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + it)
        x, y = windows(train, args.batch_size, args.seq, g)
        t0 = time.perf_counter()
        sync = (it + 1) % w.accumulate == 0 or it + 1 == args.iters
        with w.ddp.no_sync() if not sync else contextlib.nullcontext():
            loss = lm_loss(w.ddp, x, y, args.bf16)
            (loss / w.accumulate if w.accumulate > 1 else loss).backward()
        if args.ddp == "deft":
            w.ddp.observe_loss(loss)
        if sync:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            w.optimizer.step()
            w.optimizer.zero_grad()
            steps += 1
        sched.step()
        dt = time.perf_counter() - t0
        train_s += dt
        iters.append({"iter": it + 1, "time_s": time.perf_counter() - start - eval_s, "train_s": train_s,
                      "iter_s": dt, "loss": float(loss.detach()), "updates": w.updates(steps)})
        if (it + 1) % args.eval_every == 0 or it + 1 == args.iters:
            run_eval(it + 1)

    w.info.update(w.report())
    summary = {"ddp": args.ddp, "world_size": world, "params": n_params, "iters": args.iters,
               "updates": w.updates(steps), "updates_per_iter": w.updates(steps) / args.iters,
               "iter_s_mean": steady_mean(iters, args.skip_iters),
               "iter_s_median": statistics.median(r["iter_s"] for r in iters[args.skip_iters:] or iters),
               "time_s": evals[-1]["time_s"], "final_val_loss": evals[-1]["val_loss"],
               "best_val_loss": min(e["val_loss"] for e in evals), "scheme": w.info,
               "schedule": schedule_info(w.ddp), "seed": args.seed}
    if rank == 0:
        print(f"[train_lm] done: {args.iters} iters, val loss {summary['final_val_loss']:.4f}, "
              f"time {summary['time_s']:.1f}s, iteration {summary['iter_s_mean'] * 1e3:.0f} ms mean, "
              f"updates/iter {summary['updates_per_iter']:.3f}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"summary": summary, "evals": evals, "iters": iters}, indent=1)
                                       + "\n", encoding="utf-8")
        if args.save_model:  # the last evaluation flushed deft's queued updates: these are the trained weights
            torch.save(model.state_dict(), args.save_model)
    if not compute:
        dist.barrier()
        w.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
