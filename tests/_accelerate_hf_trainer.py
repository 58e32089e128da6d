"""Rank workers for tests/test_integration_transformers.py: the HuggingFace ``Trainer`` on a tiny GPT-2.

``gradient_accumulation_steps=2``, ``max_grad_norm`` that engages, AdamW with a linear warm-up schedule,
a loss and gradient norm logged every step; the same run under ``transformers.Trainer`` (torch DDP
through Accelerate) and deft's, in the same ranks, from the same weights and data.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tests._accelerate_lm import BASE, SEQ, _gpt2, _reset

STEPS = 8
MAX_NORM = 0.5


def _dataset(world: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = STEPS * 2 * 2 * world
    start = torch.randint(0, 128, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + step * torch.arange(SEQ)) % 128
    return [{"input_ids": row, "labels": row} for row in ids]


def _stop_at(step: int) -> Any:
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):  # type: ignore[misc]
        """An interrupted run: training stops after optimizer step ``step`` (after its checkpoint)."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step >= step:
                control.should_training_stop = True

    return StopAt()


def trainer_run(rank: int, world: int, *, deft: dict[str, Any] | None, out: str, stop_at: int | None = None,
                resume: str | None = None) -> dict[str, Any]:
    """One ``Trainer`` run into ``out`` (checkpoints every 4 steps); ``deft``: deft's config (None:
    ``transformers.Trainer``); ``stop_at``: stop after that step; ``resume``: the checkpoint to resume
    from. The parameters and the logged losses and gradient norms."""
    import transformers

    from deft.integrations.transformers import Trainer

    _reset()
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=MAX_NORM,
        learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=2, max_steps=STEPS,
        logging_steps=1, save_steps=4, report_to=[], use_cpu=True, ddp_backend="gloo",
        dataloader_num_workers=0, disable_tqdm=True, seed=0)
    kwargs: dict[str, Any] = {"model": _gpt2(), "args": args, "train_dataset": _dataset(world)}
    if stop_at is not None:
        kwargs["callbacks"] = [_stop_at(stop_at)]
    trainer = transformers.Trainer(**kwargs) if deft is None else Trainer(**kwargs, deft_config=deft)
    trainer.remove_callback(transformers.PrinterCallback)  # the logs are read from trainer.state
    trainer.train(resume_from_checkpoint=resume)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    res: dict[str, Any] = {
        "losses": [float(e["loss"]) for e in logs], "grad_norms": [float(e["grad_norm"]) for e in logs],
        "steps": int(trainer.state.global_step),
        "params": [p.detach().flatten().tolist() for p in trainer.model.parameters()],
        "wrapper": type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__,
    }
    if deft is not None:
        ddp = trainer.model_wrapped
        res["update_log"] = [[int(t), [int(i) for i in its]] for t, its in ddp.update_log]
        res["iterations"] = ddp.iteration
        res["plan_info"] = {k: str(v) for k, v in ddp.plan_info.items()}
        ddp.close()
    return res


def cases(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    res["torch"] = trainer_run(rank, world, deft=None, out=os.path.join(tmp, "torch"))
    res["deft"] = trainer_run(rank, world, deft=BASE, out=os.path.join(tmp, "deft"))
    half = os.path.join(tmp, "half")
    res["deft_first"] = trainer_run(rank, world, deft=BASE, out=half, stop_at=STEPS // 2)
    res["deft_resumed"] = trainer_run(rank, world, deft=BASE, out=half,
                                      resume=os.path.join(half, f"checkpoint-{STEPS // 2}"))
    res["default"] = trainer_run(rank, world, deft={"warmup_iters": 1, "profile_iters": 2, "bucket_cap_mb": 0.001},
                                 out=os.path.join(tmp, "default"))
    return res
