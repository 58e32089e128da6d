"""Rank workers for tests/test_integration_accelerate.py: Accelerate's no_trainer causal-LM loop.

The loop is the shape of Accelerate's ``run_clm_no_trainer.py``: a tiny GPT-2 from ``transformers``,
AdamW, a linear warm-up scheduler prepared by the accelerator, a prepared data loader,
``gradient_accumulation_steps=2`` with ``with accelerator.accumulate(model):``, ``accelerator.backward``,
and ``accelerator.clip_grad_norm_`` at a max norm that engages. The same loop runs under plain
``accelerate.Accelerator`` (torch DDP) and under deft's, in the same ranks, from the same weights.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

STEPS = 8          # optimizer steps per run (16 micro-batches per rank)
ACCUM = 2
BATCH = 2          # sequences per micro-batch and rank
SEQ = 16
MAX_NORM = 0.5     # engages: the tiny GPT-2's gradient norms are above it
BASE = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "bucket_cap_mb": 0.001}


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _loader(world: int) -> torch.utils.data.DataLoader[Any]:
    """Learnable sequences (a per-sequence offset counting up, modulo the vocabulary): the loss falls."""
    g = torch.Generator().manual_seed(1)
    n = STEPS * ACCUM * BATCH * world
    start = torch.randint(0, 128, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + step * torch.arange(SEQ)) % 128
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH, shuffle=False)


def _reset() -> None:
    """A fresh Accelerate state for the next Accelerator of this process (its mixed precision may differ)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _schedule(path: str, model: torch.nn.Module) -> str:
    """tests/test_runtime_parity.py's ``early`` deferring schedule for this model: three buckets sent in
    the backward, buckets 0 and 1 waited for and applied module by module in the next forward."""
    from deft.schedule import CommTask, Schedule, StagePlan, Update

    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    numel = (total // 3, total // 3, total - 2 * (total // 3))
    P, S = "primary", "second"
    stages = (StagePlan(0, "forward"),
              StagePlan(0, "backward", (CommTask(0, 0, P), CommTask(1, 0, S), CommTask(2, 0, S))))
    Schedule(cycle=1, links=(P, S), bucket_numel=numel, bucket_nbytes=tuple(4 * n for n in numel), stages=stages,
             updates=(Update((0,), 0, finish_in_forward=True, deferred=(0, 1)),)).save(path)
    return path


def lm_run(rank: int, world: int, *, deft: dict[str, Any] | None, mixed_precision: str = "no",
           scaler: bool = False, inf_at: int | None = None, save_at: int | None = None,
           resume: str | None = None, tmp: str = "", clip: bool = True,
           join: bool = False, dynamo: str = "no", muon: bool = False, save_mid: bool = False) -> dict[str, Any]:
    """One training run; ``deft``: deft's config (None: plain Accelerate, torch DDP).

    ``scaler``: Accelerate's fp16 path with a GradScaler (fp16 autocast, scaled backward, unscale in
    ``clip_grad_norm_``, ``scaler.step``), installed by hand because Accelerate turns fp16 off on the
    CPU; ``inf_at``: rank 0's loss is made infinite at that micro-batch. ``save_at``: stop after that
    many optimizer steps with ``save_state`` into ``tmp``; ``resume``: ``load_state`` from there and
    run the rest. ``clip``: clip at :data:`MAX_NORM`; ``join``: enter ``join_uneven_inputs`` first,
    with even and uneven batches (the error text of the latter is returned); ``dynamo``: Accelerate's
    ``dynamo_backend`` (it compiles the prepared wrapper, torch DDP's or deft's); ``muon``: torch's Muon
    on the blocks' matrices and AdamW on the rest, both prepared with a scheduler each and stepped one
    after the other (two optimizers); ``save_mid``: the save comes after the first micro-batch of step
    ``save_at`` (between its micro-batches), into the folder a save at the step before wrote. Returns the parameters,
    the losses, the clipped norms, deft's update log and whether an update was left finishing in the
    next forward after each step.
    """
    import accelerate
    from transformers import get_linear_schedule_with_warmup

    from deft.integrations.accelerate import Accelerator

    began = time.perf_counter()
    _reset()
    if dynamo != "no" and deft is None:  # torch DDP's compiled afresh; deft's run after it in this process
        torch._dynamo.reset()  # gets that code for GPT-2's classes, which deft's wrapper must drop itself
    if deft is None:
        acc = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=ACCUM,
                                     dynamo_backend=dynamo)
    else:
        acc = Accelerator(cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=ACCUM,
                          dynamo_backend=dynamo, deft_config=deft)
    if scaler:
        acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    model = _gpt2()
    if muon:
        embedded = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
        matrices = [p for p in model.parameters() if p.dim() == 2 and id(p) not in embedded]
        rest = [p for p in model.parameters() if p.dim() != 2 or id(p) in embedded]
        opts = [torch.optim.Muon(matrices, lr=3e-3, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01)]
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)]
    scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=2, num_training_steps=STEPS) for o in opts]
    model, *prepared = acc.prepare(model, *opts, _loader(world), *scheds)
    opts, loader, scheds = prepared[:len(opts)], prepared[len(opts)], prepared[len(opts) + 1:]
    first, refused = 0, None
    if join:
        with acc.join_uneven_inputs([model]):  # even batches: nothing to join
            pass
        try:
            with acc.join_uneven_inputs([model], even_batches=False):
                pass
        except Exception as e:  # what deft says, checked by the test
            refused = f"{type(e).__name__}: {e}"
    if resume is not None:
        acc.load_state(resume)
        first = (int(save_at or 0) - 1) * ACCUM + 1 if save_mid else int(save_at or 0) * ACCUM
        loader = acc.skip_first_batches(loader, first)
    losses, norms, finishing, skipped, steps = [], [], [], 0, (first // ACCUM)
    for i, (ids,) in enumerate(loader, start=first):
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            losses.append(loss.item())
            if inf_at == i and rank == 0:
                loss = loss * float("inf")
            acc.backward(loss)
            if acc.sync_gradients and clip:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
            for opt, sched in zip(opts, scheds, strict=True):
                opt.step()
                sched.step()
            for opt in opts:
                opt.zero_grad()
            if acc.sync_gradients:
                skipped += int(acc.optimizer_step_was_skipped)
                if deft is not None:
                    finishing.append(any(u.finishing for u in model.pending_updates))
        if acc.sync_gradients:
            steps += 1
            if save_at is not None and resume is None and steps == save_at - int(save_mid):
                acc.save_state(os.path.join(tmp, "ckpt"))
                if not save_mid:
                    break
        elif save_mid and resume is None and save_at is not None and steps == save_at - 1:
            acc.save_state(os.path.join(tmp, "ckpt"))  # between the micro-batches of step save_at
            break
    out: dict[str, Any] = {"seconds": time.perf_counter() - began, "losses": losses, "norms": norms,
                           "skipped": skipped, "steps": steps,
                           "finishing": finishing, "join": refused}
    if deft is not None and save_mid and resume is None:  # stopped between micro-batches: nothing to flush
        acc.deft_wrappers[0].close()
    elif deft is not None:
        ddp = acc.deft_wrappers[0]
        ddp.flush()
        out["update_log"] = [[int(t), [int(i) for i in its]] for t, its in ddp.update_log]
        out["iterations"] = ddp.iteration
        out["finish_in_forward"] = ddp.plan_info.get("finish_in_forward")
        out["plan"] = str(ddp.plan_info.get("source"))
        out["unwrapped_is_model"] = acc.unwrap_model(model) is ddp.module
        ddp.close()
    inner = acc.unwrap_model(model)
    out["params"] = [p.detach().flatten().tolist() for p in inner.parameters()]
    out["scale"] = float(acc.scaler.get_scale()) if acc.scaler is not None else None
    return out


def cases(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Every case of the test file in one pair of ranks: torch DDP and deft, same weights and data."""
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    # fp32: uninterrupted, and a save_state / load_state half-way (a fresh accelerator, model and wrapper)
    res["fp32_torch"] = lm_run(rank, world, deft=None)
    res["fp32_deft"] = lm_run(rank, world, deft=BASE, join=True)
    half = os.path.join(tmp, "half")
    res["fp32_deft_first"] = lm_run(rank, world, deft=BASE, save_at=STEPS // 2, tmp=half)
    res["fp32_deft_resumed"] = lm_run(rank, world, deft=BASE, save_at=STEPS // 2,
                                      resume=os.path.join(half, "ckpt"))
    res["bf16_torch"] = lm_run(rank, world, deft=None, mixed_precision="bf16")
    res["bf16_deft"] = lm_run(rank, world, deft=BASE, mixed_precision="bf16")
    res["fp16_torch"] = lm_run(rank, world, deft=None, mixed_precision="fp16", scaler=True, inf_at=5)
    res["fp16_deft"] = lm_run(rank, world, deft=BASE, mixed_precision="fp16", scaler=True, inf_at=5)
    path = _schedule(str(Path(tmp) / f"deferring.{rank}.json"), _gpt2())
    deferring = BASE | {"schedule_path": path, "links": [{"name": "primary"}, {"name": "second"}]}
    # a global clip couples the parameters (deft then applies the update whole at the step): unclipped
    # here, so that updates really finish in the next forward
    res["noclip_torch"] = lm_run(rank, world, deft=None, clip=False)
    res["deferring_deft"] = lm_run(rank, world, deft=deferring, clip=False)
    res["deferring_clipped_deft"] = lm_run(rank, world, deft=deferring)
    # dynamo_backend: Accelerate compiles the prepared wrapper (deft's hooks run between its graphs)
    res["compiled_torch"] = lm_run(rank, world, deft=None, clip=False, dynamo="aot_eager")
    res["compiled_deferring_deft"] = lm_run(rank, world, deft=deferring, clip=False, dynamo="aot_eager")
    # two optimizers (torch's Muon and AdamW), on deft's default plan and on the deferring schedule
    res["muon_torch"] = lm_run(rank, world, deft=None, muon=True)
    res["muon_deft"] = lm_run(rank, world, deft=BASE, muon=True)
    res["muon_noclip_torch"] = lm_run(rank, world, deft=None, clip=False, muon=True)
    res["muon_deferring_deft"] = lm_run(rank, world, deft=deferring, clip=False, muon=True)
    # save_state between the micro-batches of a step (a checkpoint every so many batches), and resumed
    mid = {"torch": None, "deft": deferring}
    for kind, cfg in mid.items():
        where = os.path.join(tmp, f"mid_{kind}")
        lm_run(rank, world, deft=cfg, clip=False, save_at=STEPS // 2, save_mid=True, tmp=where)
        torch.distributed.barrier()  # every rank's files written
        res[f"mid_{kind}_saved"] = sorted(os.listdir(os.path.join(where, "ckpt")))
        res[f"mid_{kind}_resumed"] = lm_run(rank, world, deft=cfg, clip=False, save_at=STEPS // 2, save_mid=True,
                                            resume=os.path.join(where, "ckpt"))
    res["default_deft"] = lm_run(rank, world, deft={"warmup_iters": 1, "profile_iters": 2, "bucket_cap_mb": 0.001})
    return res
