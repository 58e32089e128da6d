"""``DEFT_TRACE_ITERS``: a torch.profiler window of the running plan instead of the profile iterations.

Two ranks record iterations 5 and 6 (after a warm-up iteration and two profile iterations, with a
plan made at once from the profile): each rank's trace holds those two training iterations' per-bucket
ranges and no other; a malformed window is refused naming the variable and what it expects."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from deft.errors import DeftError
from deft.runtime.tracing import trace_window_from_env
from tests._dist import run_ranks, values


def test_the_window_defaults_to_the_profile_iterations_and_bad_values_are_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEFT_TRACE_ITERS", raising=False)
    assert trace_window_from_env(1, 3) == (1, 3)
    monkeypatch.setenv("DEFT_TRACE_ITERS", "14:4")
    assert trace_window_from_env(1, 3) == (14, 4)
    for bad in ("14", "a:b", "3:0", "-1:2"):
        monkeypatch.setenv("DEFT_TRACE_ITERS", bad)
        with pytest.raises(DeftError, match=r"DEFT_TRACE_ITERS=.*expected FIRST:COUNT"):
            trace_window_from_env(1, 3)


def _worker(rank: int, world: int, trace_dir: str) -> list[int]:
    os.environ["DEFT_TRACE_DIR"] = trace_dir
    os.environ["DEFT_TRACE_ITERS"] = "5:2"
    import deft
    from deft.profiler import kineto

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config={
        "warmup_iters": 1, "profile_iters": 2, "plan_lag_iters": 0, "epsilon": 0.0, "bucket_cap_mb": 0.05})
    gen = torch.Generator().manual_seed(rank)
    for _ in range(9):
        loss = nn.functional.cross_entropy(ddp(torch.randn(32, 64, generator=gen)), torch.randint(0, 8, (32,),
                                                                                                  generator=gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert ddp.plan_info["source"] != "warmup", ddp.plan_info
    rows = kineto.bucket_steps(kineto.read_trace(Path(trace_dir) / f"rank{rank}.json.gz"))
    return sorted({r.step for r in rows})


@pytest.mark.slow
def test_two_rank_traces_hold_exactly_the_asked_iterations(tmp_path: Path) -> None:
    steps: Any = values(run_ranks(_worker, 2, args=(str(tmp_path),), timeout=120))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json.gz", "rank1.json.gz"]
    assert steps == [[5, 6], [5, 6]]
