"""GradScaler and autocast in an unchanged loop, against torch DDP + GradScaler.

Two gloo ranks on CPU, ``torch.autocast("cpu", torch.bfloat16)`` and ``torch.amp.GradScaler("cpu")``,
the user's loop unchanged: ``scaler.scale(loss).backward(); scaler.unscale_(opt);
clip_grad_norm_(...); scaler.step(opt); scaler.update()``. At iteration 5 rank 0's loss is made
infinite: the scaler must skip that step on every rank (the all-reduced gradient is inf), halve the
scale, and training goes on. deft (epsilon 0, its own plan after warm-up) must end with torch DDP's
parameters to 1e-5 and the same scale; its update log must lack exactly the skipped iteration.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import amp_steps, run_ranks, values

STEPS, INF_AT = 14, 5


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def train(model: nn.Module, wrapped: nn.Module, rank: int) -> float:
    return amp_steps(model, wrapped, rank, STEPS, INF_AT, batch=8, features=12, classes=3)[0]


def amp_worker(rank: int, world: int) -> dict[str, Any]:
    import deft

    ours = make_model()
    ddp = deft.DistributedDataParallel(ours, config={"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2,
                                                     "timeout_s": 30})
    scale = train(ours, ddp, rank)
    ddp.flush()
    ref = make_model()
    ref_scale = train(ref, nn.parallel.DistributedDataParallel(ref), rank)
    worst = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    return {"worst": worst, "scale": scale, "ref_scale": ref_scale, "log": [list(i) for _, i in ddp.update_log],
            "skipped": ddp.plan_info.get("skipped_steps"), "finish": ddp.plan_info.get("finish_in_forward")}


@pytest.mark.slow
def test_grad_scaler_and_autocast_match_torch_ddp() -> None:
    a, b = values(run_ranks(amp_worker, 2, timeout=120))
    for v in (a, b):
        assert v["worst"] < 1e-5, v["worst"]
        # 1024 grows x2 after every 4 good steps and halves at the inf: 2048 after step 3, 1024 at step 5,
        # 2048 after step 9, 4096 after step 13
        assert v["scale"] == v["ref_scale"] == 4096.0
        assert v["log"] == [[t] for t in range(STEPS) if t != INF_AT]  # the inf step was skipped, only it
        assert v["skipped"] == [INF_AT]
