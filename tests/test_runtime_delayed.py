"""Delayed updates for real: a hand-made multi-iteration schedule on two links, checked in closed form.

The schedule (cycle 4) merges iterations {0,1} and {2,3} of each cycle, sends buckets in forward
stages (origin 1), in backward stages of later iterations (origin 1) and as soon as they are ready
(origin 0), on two links, and applies the second group's update in the *next* cycle
(``apply_after = 4``). Buckets cut through parameters and through dtypes (fp32 and bf16).

The loss ``sum_j (w_j * c_j).sum()`` has gradient ``c_j`` whatever the parameters, with ``c`` a known
integer tensor per (rank, iteration). So the averaged gradient of every update is known exactly from
``update_log`` and the final parameters have a closed form: SGD with momentum 0.5 replayed over the
logged updates. The test also checks that every iteration is applied exactly once, that a step that is
not due leaves parameters and optimizer state untouched, that a ``no_grad`` forward changes nothing,
that both links carried traffic, and that every rank ends identical; at 2 ranks and at 8 (loopback).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from deft.schedule import CommTask, Schedule, StagePlan, Update
from tests._closed_form import sgd_replay
from tests._dist import run_ranks, values

SHAPES = {"w1": ((5, 4), torch.float32), "w2": ((6,), torch.bfloat16), "w3": ((10,), torch.float32)}
LR, MOMENTUM = 0.125, 0.5
ITERS = 10  # 1 warm-up iteration + 2.25 cycles: the run ends inside a group, which flush() applies cut short


def delayed_schedule(bucket_numel: tuple[int, ...] = (10, 14, 12)) -> Schedule:
    """Cycle 4, groups {0,1} (applied after position 2) and {2,3} (after position 0 of the next cycle).

    Three buckets of ``bucket_numel`` elements (reused by the checkpoint and fault tests).
    """
    P, S = "primary", "second"
    stages = (
        StagePlan(0, "forward", (CommTask(2, 1, S),)),                       # previous cycle's group {2,3}
        StagePlan(0, "backward", (CommTask(0, 1, P),)),
        StagePlan(1, "forward", ()),
        StagePlan(1, "backward", (CommTask(1, 0, P), CommTask(0, 0, S))),    # group {0,1} as ready
        StagePlan(2, "forward", (CommTask(2, 1, P),)),
        StagePlan(2, "backward", ()),
        StagePlan(3, "forward", ()),
        StagePlan(3, "backward", (CommTask(1, 0, S),)),
    )
    return Schedule(cycle=4, links=(P, S), bucket_numel=bucket_numel, bucket_nbytes=tuple(4 * n for n in bucket_numel),
                    stages=stages, updates=(Update((0, 1), 2), Update((2, 3), 4)))


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, (shape, dtype) in SHAPES.items():
            setattr(self, name, nn.Parameter(torch.zeros(shape, dtype=dtype)))

    def forward(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(((getattr(self, n) * c[n]).sum().float() for n in SHAPES), torch.zeros(()))


def coefficients(rank: int, t: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * t + 31 * rank)
    return {n: torch.randint(-3, 4, shape, generator=g).to(dtype) for n, (shape, dtype) in SHAPES.items()}


def closed_form(update_log: list[list[object]], world: int,
                coeffs: Callable[[int, int], dict[str, torch.Tensor]] = coefficients) -> dict[str, torch.Tensor]:
    """SGD with momentum replayed over the logged updates (tests/_closed_form.py)."""
    return sgd_replay(update_log, world, {n: shape for n, (shape, _) in SHAPES.items()}, coeffs, LR, MOMENTUM)


def delayed_worker(rank: int, world: int, schedule_path: str) -> dict[str, object]:
    import deft

    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ddp = deft.DistributedDataParallel(model, config={
        "epsilon": 0.1, "warmup_iters": 1, "schedule_path": schedule_path, "timeout_s": 30,
        "links": [{"name": "primary"}, {"name": "second"}]})
    not_due: list[int] = []  # the steps checked below; the test pins them to the schedule
    for t in range(ITERS):
        loss = ddp(coefficients(rank, t))
        loss.backward()
        if t == 5:  # evaluation in the middle of a cycle: no communication, nothing counted
            stats, it = ddp.link_stats, ddp.iteration
            with torch.no_grad():
                ddp(coefficients(rank, 99))
            assert ddp.link_stats == stats and ddp.iteration == it
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
        n_log = len(ddp.update_log)
        opt.step()
        opt.zero_grad()
        if len(ddp.update_log) == n_log:  # not due: nothing moved, optimizer state untouched
            not_due.append(t)
            for n, p in model.named_parameters():
                assert torch.equal(p, before[n]), f"{n} changed at a step that was not due (t={t})"
            assert {id(p) for p in opt.state} == set(state)
            for p, s in opt.state.items():
                for k, v in s.items():
                    assert torch.equal(v, state[id(p)][k]), f"optimizer state {k} changed at t={t}"
    pending = [list(u.iterations) for u in ddp.pending_updates]
    ddp.flush()
    log = [[t, list(its)] for t, its in ddp.update_log]
    expect = closed_form(log, world)
    for n, p in model.named_parameters():
        tol = 1e-6 if p.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(p.detach().double(), expect[n], rtol=0, atol=tol)
    return {"log": log, "pending_before_flush": pending, "links": ddp.link_stats,
            "not_due": not_due, "params": {n: p.double().tolist() for n, p in model.named_parameters()}}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 8])
def test_delayed_updates_closed_form(tmp_path: Path, world: int) -> None:
    path = tmp_path / "schedule.json"
    delayed_schedule().save(path)
    out = values(run_ranks(delayed_worker, world, (str(path),), timeout=180))
    log = out[0]["log"]
    assert all(v["log"] == log and v["params"] == out[0]["params"] for v in out)
    # Every iteration applied exactly once, in the schedule's groups: warm-up 0 alone, then t0 = 1.
    merged = [tuple(its) for _, its in log]
    assert merged == [(0,), (1, 2), (3, 4), (5, 6), (7, 8), (9,)]
    applied_at = [t for t, _ in log]
    # group {1,2} after position 2 (t=3); {3,4} after position 0 of the next cycle (t=5); ...
    assert applied_at == [0, 3, 5, 7, 9, 9]  # the last one by flush() after iteration 9
    assert out[0]["pending_before_flush"] == [[9]]
    # not due: every step but 0 (warm-up), 3, 5, 7, 9 (applied_at above), so the unchanged-state checks ran 5 times
    assert all(v["not_due"] == [1, 2, 4, 6, 8] for v in out)
    for v in out:
        assert v["links"]["primary"]["calls"] > 0 and v["links"]["second"]["calls"] > 0
        assert v["links"]["second"]["bytes"] > 0


#: After the step of these iterations an evaluation forward with gradients enabled and no backward begins
#: the next iteration, then the loop checkpoints the wrapper or flushes, as torch DDP allows there. The next
#: iterations are at positions 1 (its group holds an iteration already), 2 (its forward stage has sent a
#: bucket of the group before it) and 2 again, before flush().
EVAL_THEN = {1: "state_dict", 2: "state_dict", 6: "flush"}
#: These iterations run as two micro-batches of half the loss (the first under no_sync()), with a
#: checkpoint or flush() between them: at position 3, the merged update holding iteration 3 queued, and
#: at position 1 after the flush restarted the cycle at iteration 7, the update holding iteration 7 queued.
MICRO_THEN = {4: "state_dict", 8: "flush"}
#: The checkpoints resumed from: after an evaluation, and between micro-batches.
RESUMED = (2, 4)


def _withdrawn_run(rank: int, schedule_path: str, start: int,
                   saved: bytes | None) -> tuple[Linear, Any, torch.optim.Optimizer, dict[int, bytes]]:
    """The run from iteration ``start`` (from the checkpoint ``saved``): its model, its wrapper and
    optimizer, and the checkpoints it took at :data:`RESUMED`."""
    import io

    import deft

    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ddp = deft.DistributedDataParallel(model, config={
        "epsilon": 0.1, "warmup_iters": 1, "schedule_path": schedule_path, "timeout_s": 30,
        "links": [{"name": "primary"}, {"name": "second"}]})
    if saved is not None:
        sd = torch.load(io.BytesIO(saved), weights_only=True)
        ddp.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
    checkpoints: dict[int, bytes] = {}

    def between(t: int, what: str) -> None:
        if what == "flush":
            ddp.flush()
            return
        buf = io.BytesIO()
        torch.save({"model": ddp.state_dict(), "opt": opt.state_dict()}, buf)
        if t in RESUMED:
            checkpoints[t] = buf.getvalue()

    for t in range(start, ITERS):
        if t in MICRO_THEN:
            with ddp.no_sync():
                (0.5 * ddp(coefficients(rank, t))).backward()
            between(t, MICRO_THEN[t])
            (0.5 * ddp(coefficients(rank, t))).backward()
        else:
            ddp(coefficients(rank, t)).backward()
        opt.step()
        opt.zero_grad()
        if t in EVAL_THEN:
            ddp.eval()
            ddp(coefficients(rank, 99))
            ddp.train()
            between(t, EVAL_THEN[t])
    ddp.flush()
    return model, ddp, opt, checkpoints


def withdrawn_worker(rank: int, world: int, schedule_path: str) -> dict[str, object]:
    model, ddp, opt, checkpoints = _withdrawn_run(rank, schedule_path, 0, None)
    log = [[t, list(its)] for t, its in ddp.update_log]
    expect = closed_form(log, world)
    for n, p in model.named_parameters():
        tol = 1e-6 if p.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(p.detach().double(), expect[n], rtol=0, atol=tol)
    out: dict[str, object] = {"log": log, "params": {n: p.double().tolist() for n, p in model.named_parameters()}}
    for t in RESUMED:  # the loop resumes at the checkpoint's iteration: after step t, or at t's first micro-batch
        first = t + 1 if t in EVAL_THEN else t
        resumed, rddp, _, _ = _withdrawn_run(rank, schedule_path, first, checkpoints[t])
        out[f"resumed_{t}"] = {"log": [[t, list(its)] for t, its in rddp.update_log],
                               "params": {n: p.double().tolist() for n, p in resumed.named_parameters()}}
    # after a backward and before its step (the flush restarted the cycle at ITERS): at position 0 deft
    # holds nothing of an earlier iteration and the state_dict is the module's, without deft's record; at
    # position 1 its group holds the iteration before, which that checkpoint would lose: refused
    import deft

    said: list[object] = []
    for t in (ITERS, ITERS + 1):
        ddp(coefficients(rank, t)).backward()
        try:
            said.append(sorted(k for k in ddp.state_dict() if not k.startswith("module.")))
        except deft.DeftError as e:
            said.append(str(e))
        try:  # deft's record alone (what a trainer's checkpoint takes): refused, the gradients left in place
            ddp.get_deft_state()
            said.append("record taken")
        except deft.DeftError as e:
            said.append(str(e))
        opt.step()
        opt.zero_grad()
    ddp.flush()
    out["before_the_step"] = said
    out["applied_after"] = sorted(i for _, its in ddp.update_log for i in its if i >= ITERS)
    return out


@pytest.mark.slow
def test_a_checkpoint_in_an_iteration_no_gradient_reached_applies_each_iteration_once(tmp_path: Path) -> None:
    """After a forward without backward, and between micro-batches with a merged update queued: the
    checkpoint and flush() are allowed, as under torch DDP, and nothing is lost or applied twice."""
    path = tmp_path / "schedule.json"
    delayed_schedule().save(path)
    out = values(run_ranks(withdrawn_worker, 2, (str(path),), timeout=180))
    log = out[0]["log"]
    assert all(v["log"] == log and v["params"] == out[0]["params"] for v in out)
    merged = [t for _, its in log for t in its]
    assert sorted(merged) == list(range(ITERS))  # every iteration applied once, none of the evaluations
    assert (6, [5, 6]) in [(t, its) for t, its in log]  # flush() after iteration 6 applied the group queued there
    assert (7, [7]) in [(t, its) for t, its in log]  # flush() between 8's micro-batches: 7's group cut short
    for v in out:  # each checkpoint resumes to the same run
        for t in RESUMED:
            assert v[f"resumed_{t}"] == {"log": v["log"], "params": v["params"]}, t
        no_record, no_record_alone, refused, _ = v["before_the_step"]
        assert no_record == []
        assert "cannot be taken after the backward of iteration 10 and before its optimizer step" in no_record_alone
        assert v["applied_after"] == [ITERS, ITERS + 1]  # the steps after them applied both iterations
        assert f"while deft still holds the gradients of iterations [[{ITERS}, {ITERS + 1}]]" in refused, refused
