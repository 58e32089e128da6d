"""Runtime edge cases, checked in closed form on two ranks.

* several updates due at one step (groups {0} and {1} of a cycle of 3 both applied after position 1);
* a parameter used only by some ranks in some iterations, and by none in others (its update is then
  skipped, as torch DDP's ``find_unused_parameters`` does: ``grad = None``, momentum untouched);
* ``flush()`` in the middle of a cycle, then training on (the cycle restarts at the next iteration);
* a second optimizer stepping parameters of the module after the one given to deft: each applies its
  own parameters' averaged gradients, in closed form;
* a schedule file made for another model fails at construction, naming the file;
* buffers (int64 and float) follow rank 0 at each training forward, not at ``no_grad`` evaluations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from deft.schedule import CommTask, Schedule, StagePlan, Update
from tests._closed_form import sgd_replay
from tests._dist import run_ranks, values

SHAPES = {"a": (4,), "b": (3,), "s": (2,)}
LR, MOMENTUM = 0.25, 0.5
ITERS = 9
FLUSH_AFTER = 4  # position 0 of the second cycle: group {4} is pending and is applied by flush()


def two_due_schedule() -> Schedule:
    """Cycle 3, groups {0}, {1}, {2}; {0} and {1} are both applied after position 1."""
    P = "primary"
    bwd = (CommTask(0, 0, P), CommTask(1, 0, P))
    stages = tuple(s for p in range(3) for s in (StagePlan(p, "forward"), StagePlan(p, "backward", bwd)))
    return Schedule(cycle=3, links=(P,), bucket_numel=(5, 4), bucket_nbytes=(20, 16), stages=stages,
                    updates=(Update((0,), 1), Update((1,), 1), Update((2,), 2)))


def uses_s(rank: int, t: int) -> bool:
    return rank == 0 and t % 3 == 1


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            setattr(self, name, nn.Parameter(torch.zeros(shape)))

    def forward(self, c: dict[str, torch.Tensor], use_s: bool) -> torch.Tensor:
        loss = (self.a * c["a"]).sum() + (self.b * c["b"]).sum()
        return loss + (self.s * c["s"]).sum() if use_s else loss


def coefficients(rank: int, t: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(104729 * t + 13 * rank)
    return {n: torch.randint(-3, 4, shape, generator=g).float() for n, shape in SHAPES.items()}


def closed_form(log: list[list[object]], world: int) -> dict[str, torch.Tensor]:
    """Replay with ``s`` used only where :func:`uses_s` says (tests/_closed_form.py)."""
    return sgd_replay(log, world, SHAPES, coefficients, LR, MOMENTUM,
                      used=lambda n, r, t: n != "s" or uses_s(r, t))


def edges_worker(rank: int, world: int, schedule_path: str) -> dict[str, object]:
    import deft

    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ddp = deft.DistributedDataParallel(model, config={
        "epsilon": 0.1, "warmup_iters": 1, "schedule_path": schedule_path, "timeout_s": 30})
    for t in range(ITERS):
        ddp(coefficients(rank, t), uses_s(rank, t)).backward()
        opt.step()
        opt.zero_grad()
        if t == FLUSH_AFTER:
            ddp.flush()
    ddp.flush()
    log = [[t, list(its)] for t, its in ddp.update_log]
    expect = closed_form(log, world)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), expect[n], rtol=0, atol=1e-6)
    return {"log": log, "params": {n: p.tolist() for n, p in model.named_parameters()}}


@pytest.mark.slow
def test_two_updates_at_one_step_partial_use_and_flush_mid_cycle(tmp_path: Path) -> None:
    path = tmp_path / "schedule.json"
    two_due_schedule().save(path)
    out = values(run_ranks(edges_worker, 2, (str(path),), timeout=120))
    assert out[0] == out[1]
    # warm-up t=0; schedule from t0=1: {1},{2} after t=2, {3} after t=3; flush applies {4} after t=4 and
    # restarts the cycle at t0=5: {5},{6} after t=6, {7} after t=7, the final flush applies {8}.
    assert [tuple(its) for _, its in out[0]["log"]] == [(t,) for t in range(ITERS)]
    assert [t for t, _ in out[0]["log"]] == [0, 2, 2, 3, 4, 6, 6, 7, 8]


def two_optimizers_worker(rank: int, world: int) -> dict[str, object]:
    import deft

    model = Linear()
    opt_ab = torch.optim.SGD([model.a, model.b], lr=LR, momentum=MOMENTUM)
    opt_s = torch.optim.SGD([model.s], lr=LR, momentum=MOMENTUM)
    ddp = deft.DistributedDataParallel(model, optimizer=opt_ab, config={"warmup_iters": 1, "timeout_s": 30})
    for t in range(ITERS):
        ddp(coefficients(rank, t), uses_s(rank, t)).backward()
        opt_ab.step()
        opt_s.step()
        opt_ab.zero_grad()
        opt_s.zero_grad()
    ddp.flush()
    return {"log": [[t, list(its)] for t, its in ddp.update_log],
            "params": {n: p.detach().tolist() for n, p in model.named_parameters()}}


@pytest.mark.slow
def test_a_second_optimizer_applies_its_own_parameters_updates() -> None:
    """The old failure: the second optimizer's parameters never saw a gradient (deft cleared ``p.grad``
    after the given optimizer's step); now each optimizer applies its own, once per iteration."""
    out = values(run_ranks(two_optimizers_worker, 2, timeout=60))
    assert out[0]["log"] == [[t, [t]] for t in range(ITERS)]
    expected = closed_form(out[0]["log"], 2)
    for v in out:
        for n, p in v["params"].items():
            torch.testing.assert_close(torch.tensor(p, dtype=torch.float64), expected[n], rtol=1e-6, atol=1e-6)


def wrong_schedule_worker(rank: int, world: int, schedule_path: str) -> str:
    import deft
    from deft.errors import ContractError

    try:
        deft.DistributedDataParallel(Linear(), config={"warmup_iters": 1, "timeout_s": 30,
                                                       "schedule_path": schedule_path})
    except ContractError as e:
        return str(e)
    return "no error at construction"


@pytest.mark.slow
def test_schedule_file_for_another_model_fails_at_construction(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    Schedule(cycle=1, links=("primary",), bucket_numel=(5, 5), bucket_nbytes=(20, 20),
             stages=(StagePlan(0, "forward"), StagePlan(0, "backward", (CommTask(0, 0, "primary"),
                                                                         CommTask(1, 0, "primary")))),
             updates=(Update((0,), 0),)).save(path)
    for msg in values(run_ranks(wrong_schedule_worker, 2, (str(path),), timeout=60)):
        assert str(path) in msg and "10" in msg and "9" in msg and "another model" in msg


class Counting(nn.Module):
    """A parameter and two buffers (int64 and float) that every training forward moves by rank + 1."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(9))  # the 9 elements of two_due_schedule()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("level", torch.zeros(2))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        self.count += step
        self.level += float(step)
        return (self.w * x).sum()


def buffers_worker(rank: int, world: int, schedule_path: str) -> list[list[float]]:
    import deft

    model = Counting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = deft.DistributedDataParallel(model, config={"warmup_iters": 1, "timeout_s": 30, "epsilon": 0.1,
                                                      "schedule_path": schedule_path})
    seen = []
    for _ in range(4):
        ddp(torch.ones(9), rank + 1).backward()
        seen.append([float(model.count), *model.level.tolist()])
        with torch.no_grad():  # evaluation: no broadcast, the local buffers move
            ddp(torch.ones(9), 10)
        opt.step()
        opt.zero_grad()
    return seen


@pytest.mark.slow
def test_buffers_follow_rank0_at_each_iteration(tmp_path: Path) -> None:
    path = tmp_path / "schedule.json"
    two_due_schedule().save(path)
    r0, r1 = values(run_ranks(buffers_worker, 2, (str(path),), timeout=60))
    # Before each training forward every rank takes rank 0's buffers (rank 0: +1 per training forward and
    # +10 per evaluation); rank 1 then adds its own 2.
    for t in range(4):
        base = 11 * t
        assert r0[t] == [base + 1] * 3 and r1[t] == [base + 2] * 3
