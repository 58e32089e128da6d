"""Train a GPT-2 or a Llama (HuggingFace transformers) on the Python standard library's source text,
data-parallel on CPU, with the scheme of your choice.

    torchrun --nproc-per-node 2 examples/train_lm.py --ddp torch
    torchrun --nproc-per-node 2 examples/train_lm.py --ddp deft [--epsilon 0.01] [--compression fp16]
    torchrun --nproc-per-node 2 examples/train_lm.py --ddp fp16|powersgd|accum2|localsgd
    torchrun --nproc-per-node 2 examples/train_lm.py --ddp torch|deft --trainer accelerate
    python examples/train_lm.py --compute-only

The schemes (``--ddp``) are ``examples/train_cnn.py``'s, with the same flags (its ``wrap``); only the
model, the data and the optimizer differ:

* **Model**: ``transformers.GPT2LMHeadModel`` from a ``GPT2Config`` (random initialisation, nothing
  downloaded): byte-level (vocabulary 256), ``--n-embd`` 320, ``--n-layer`` 8, ``--n-head`` 8,
  context ``--seq`` 64; about 10M parameters, the input embedding tied to the output layer. ``--arch
  llama``: ``transformers.LlamaForCausalLM`` of the same sizes (MLP width 4 x ``--n-embd``, 13M
  parameters, tied), whose rotary embedding keeps its frequencies in buffers that every forward reads
  first (torch DDP broadcasts them before each forward; deft waits for them there).
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

``--trainer accelerate`` trains the same model on the same windows with the same optimizer, schedule
and clipping through HuggingFace Accelerate instead of this script's loop, in the shape of Accelerate's
``no_trainer`` examples: ``accelerator.prepare(model, optimizer, loader, scheduler)``, then
``accelerator.accumulate``, ``accelerator.backward``, ``accelerator.clip_grad_norm_`` on the steps that
sync, ``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``. ``--ddp torch`` uses
``accelerate.Accelerator`` (which wraps the model in torch DDP); ``--ddp deft`` uses
``deft.integrations.accelerate.Accelerator(deft_config=...)`` (the deft scheme's config, as ``--ddp deft``
without the trainer). The loader is a map-style dataset of this loop's windows (:class:`LoopWindows`),
so each rank trains on the windows it would draw here; the scheduler is built for
``iters x processes`` steps, as the ``no_trainer`` examples do (Accelerate's prepared scheduler steps
once per process). ``--bf16`` becomes ``mixed_precision="bf16"``. The loop does not call deft's optional
``observe_loss``, as a user of Accelerate would not.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cnn import (
    Wrapped,
    add_scheme_args,
    check_scheme_args,
    deft_config,
    init_distributed,
    schedule_info,
    steady_mean,
    wrap,
)

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


class LoopWindows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The script loop's windows as a map-style dataset, for a loader that a trainer shards.

    Item ``j`` is window ``j mod B`` of batch ``b = j // B`` (``B`` the per-rank batch), and batch ``b``
    is what rank ``b mod world`` draws at iteration ``b // world`` in this script's loop. A sequential
    loader of batch ``B`` sharded the way Accelerate shards it (rank ``r`` takes batches ``r, r + world,
    ...``) so gives every rank, at every iteration, the windows of the script's loop.
    """

    def __init__(self, data: torch.Tensor, args: argparse.Namespace, world: int) -> None:
        self.data, self.args, self.world = data, args, world

    def __len__(self) -> int:
        return self.args.iters * self.world * self.args.batch_size

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, pos = divmod(j, self.args.batch_size)
        it, rank = divmod(b, self.world)
        x, y = windows(self.data, self.args.batch_size, self.args.seq, loop_generator(self.args.seed, rank, it))
        return x[pos], y[pos]


def loop_generator(seed: int, rank: int, it: int) -> torch.Generator:
    """The generator of rank ``rank``'s windows at iteration ``it``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + it)


def make_model(args: argparse.Namespace) -> nn.Module:
    if args.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        # The rotary embedding's inverse frequencies are buffers, read at the forward's start.
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=args.n_embd, num_hidden_layers=args.n_layer,
                                            num_attention_heads=args.n_head, intermediate_size=4 * args.n_embd,
                                            max_position_embeddings=args.seq, tie_word_embeddings=True,
                                            bos_token_id=0, eos_token_id=0))
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=args.seq, n_embd=args.n_embd, n_layer=args.n_layer,
                     n_head=args.n_head, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def make_optimizer(model: nn.Module, lr: float, kind: str = "adamw") -> Any:
    """``adamw``: AdamW with weight decay on matrices only (biases, LayerNorms and nothing else decay-free).
    ``muon``: :class:`MuonAdamW`."""
    if kind == "muon":
        return MuonAdamW(model, lr)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


class MuonAdamW:
    """torch's Muon on the blocks' matrices and AdamW on the rest (the embeddings, tied to the output
    layer, the biases and the LayerNorms): two optimizers stepped one after the other, the way Muon is
    run (it takes 2-D parameters only). Muon's rate is matched to AdamW's RMS (``match_rms_adamw``), so
    both take ``lr``; decay 0.1 on the matrices, as with ``adamw``."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        trained = [p for p in model.parameters() if p.requires_grad]
        matrices = [p for p in trained if p.dim() == 2 and id(p) not in embedded]
        rest = [p for p in trained if p.dim() != 2 or id(p) in embedded]
        self.optimizers: tuple[torch.optim.Optimizer, ...] = (
            torch.optim.Muon(matrices, lr=lr, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=0.0))

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)


def members(opt: Any) -> tuple[torch.optim.Optimizer, ...]:
    """The torch optimizers behind ``opt`` (itself, or a :class:`MuonAdamW`'s two)."""
    return opt.optimizers if isinstance(opt, MuonAdamW) else (opt,)


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
    ap.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                    help="gpt2: GPT2LMHeadModel; llama: LlamaForCausalLM (rotary position buffers) of the same sizes")
    ap.add_argument("--n-embd", type=int, default=320)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                    help="adamw, or torch's Muon on the blocks' matrices with AdamW on the rest (two optimizers)")
    ap.add_argument("--bf16", action="store_true", help="forward under torch.autocast('cpu', torch.bfloat16)")
    ap.add_argument("--data-bytes", type=int, default=2_000_000)
    ap.add_argument("--val-windows", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--skip-iters", type=int, default=10,
                    help="iterations left out of the steady-state iteration time (warm-up, planning)")
    ap.add_argument("--trainer", choices=("none", "accelerate"), default="none",
                    help="accelerate: train through HuggingFace Accelerate's loop (--ddp torch or deft)")
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
    if args.optimizer != "adamw" and args.trainer != "none":
        ap.error(f"--optimizer {args.optimizer}: this script's own loop only (--trainer none)")
    args.momentum = 0.0  # read by train_cnn.wrap only when it builds its own SGD (never here)
    check_scheme_args(ap, args)
    if args.trainer == "accelerate" and args.ddp not in ("torch", "deft"):
        ap.error(f"--trainer accelerate runs --ddp torch or --ddp deft, got --ddp {args.ddp}")
    if args.trainer == "accelerate" and args.bucket_cap_mb is not None:
        ap.error("--bucket-cap-mb does not apply to --trainer accelerate (Accelerate builds torch DDP itself)")
    return args


@dataclass
class Loop:
    """How one training run steps: ``step(it, x, y)`` runs iteration ``it`` on its windows and returns (the
    loss, whether the optimizer stepped); ``batches`` yields each iteration's windows; ``model`` is the
    bare model (validated, saved)."""

    w: Wrapped
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    step: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, bool]]
    model: nn.Module


def own_loop(model: nn.Module, opt: torch.optim.Optimizer, train: torch.Tensor, args: argparse.Namespace,
             rank: int) -> Loop:
    """This script's loop: ``wrap``'s scheme, ``no_sync`` on accumulated iterations, clipping, the schedule."""
    from transformers import get_cosine_schedule_with_warmup

    w = wrap(model, args, args.iters, optimizer=opt)
    scheds = [get_cosine_schedule_with_warmup(o, max(1, args.iters // 10), args.iters) for o in members(opt)]

    def step(it: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, bool]:
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
        for sched in scheds:
            sched.step()
        return loss, sync

    batches = (windows(train, args.batch_size, args.seq, loop_generator(args.seed, rank, it))
               for it in range(args.iters))
    return Loop(w, batches, step, model)


def make_accelerator(args: argparse.Namespace) -> Any:
    """Accelerate's ``Accelerator`` (torch DDP), or deft's (``deft_config=`` the deft scheme's config)."""
    kwargs: dict[str, Any] = {"cpu": True, "mixed_precision": "bf16" if args.bf16 else "no"}
    if args.ddp == "deft":
        from deft.integrations import accelerate as deft_accelerate

        if not hasattr(deft_accelerate, "Accelerator"):
            raise SystemExit("train_lm.py: error: --trainer accelerate --ddp deft needs "
                             "deft.integrations.accelerate.Accelerator, which this deft does not have")
        return deft_accelerate.Accelerator(deft_config=deft_config(args, args.iters), **kwargs)
    from accelerate import Accelerator

    return Accelerator(**kwargs)


def accelerate_loop(accelerator: Any, model: nn.Module, opt: torch.optim.Optimizer, train: torch.Tensor,
                    args: argparse.Namespace) -> Loop:
    """Accelerate's ``no_trainer`` loop: everything through ``prepare``; the schedule built for
    ``iters x processes`` steps, because a prepared scheduler steps once per process."""
    from torch.utils.data import DataLoader
    from transformers import get_cosine_schedule_with_warmup

    rng = torch.get_rng_state()
    n = accelerator.num_processes
    loader = DataLoader(LoopWindows(train, args, n), batch_size=args.batch_size, shuffle=False)
    sched = get_cosine_schedule_with_warmup(opt, max(1, args.iters // 10) * n, args.iters * n)
    ddp, popt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    def step(it: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, bool]:
        with accelerator.accumulate(ddp):
            loss = lm_loss(ddp, x, y, False)  # --bf16: the accelerator's mixed precision
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(ddp.parameters(), 1.0)
            popt.step()
            sched.step()
            popt.zero_grad()
        return loss, bool(accelerator.sync_gradients)

    info = {"trainer": "accelerate", "accelerator": f"{type(accelerator).__module__}.{type(accelerator).__name__}",
            "wrapper": f"{type(ddp).__module__}.{type(ddp).__name__}"}
    if args.ddp == "deft":
        info["epsilon"] = deft_config(args, args.iters).epsilon
    deft_wrapper = hasattr(ddp, "update_log")
    w = Wrapped(ddp, popt, info, updates=(lambda _steps: len(ddp.update_log)) if deft_wrapper else (lambda s: s))

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        it = iter(loader)
        first = next(it)
        # starting the loader drew from the global generator; dropout then continues where the own loop's does
        torch.set_rng_state(rng)
        yield first
        yield from it

    return Loop(w, batches(), step, accelerator.unwrap_model(ddp))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    compute = args.ddp == "compute"
    accelerator = make_accelerator(args) if args.trainer == "accelerate" else None  # it joins the job itself
    if accelerator is not None:
        rank, world = accelerator.process_index, accelerator.num_processes
    else:
        rank, world = (0, 1) if compute else init_distributed()
    distributed = dist.is_available() and dist.is_initialized()
    train, val = split(load_text(args.data_bytes))
    torch.manual_seed(args.seed)
    model = make_model(args)
    opt = make_optimizer(model, args.lr, args.optimizer)
    start = time.perf_counter()
    try:
        loop = (own_loop(model, opt, train, args, rank) if accelerator is None
                else accelerate_loop(accelerator, model, opt, train, args))
    except DeftError as e:
        raise SystemExit(f"train_lm.py: error: {e}") from None
    w = loop.w
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"[train_lm] ddp={args.ddp} trainer={args.trainer} world={world} params={n_params:,} "
              f"train={len(train):,} bytes val={len(val):,} bytes batch={args.batch_size}x{args.seq}/rank "
              f"iters={args.iters}", flush=True)
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
        loss = validate(loop.model, val, args)
        if distributed:
            dist.barrier()
        now = time.perf_counter()
        evals.append({"iter": it, "time_s": t_eval - start - eval_s, "train_s": train_s, "val_loss": loss,
                      "perplexity": math.exp(min(loss, 50.0)), "updates": w.updates(steps)})
        eval_s += now - t_eval
        if rank == 0:
            print(f"[train_lm] iter {it}: val loss {loss:.4f} (perplexity {evals[-1]['perplexity']:.2f}) "
                  f"time {evals[-1]['time_s']:.1f}s", flush=True)

    for it in range(args.iters):
        x, y = next(loop.batches)
        t0 = time.perf_counter()
        loss, stepped = loop.step(it, x, y)
        steps += stepped
        dt = time.perf_counter() - t0
        train_s += dt
        iters.append({"iter": it + 1, "time_s": time.perf_counter() - start - eval_s, "train_s": train_s,
                      "iter_s": dt, "loss": float(loss.detach()), "updates": w.updates(steps)})
        if (it + 1) % args.eval_every == 0 or it + 1 == args.iters:
            run_eval(it + 1)

    w.info.update(w.report())
    summary = {"ddp": args.ddp, "trainer": args.trainer, "arch": args.arch, "optimizer": args.optimizer,
               "world_size": world, "params": n_params,
               "iters": args.iters, "updates": w.updates(steps), "updates_per_iter": w.updates(steps) / args.iters,
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
            torch.save(loop.model.state_dict(), args.save_model)
    if distributed:
        dist.barrier()
        w.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
