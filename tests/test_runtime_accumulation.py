"""Gradient accumulation without ``no_sync()``, against torch DDP (2 gloo ranks on CPU).

Many loops accumulate by calling ``loss.backward()`` on several micro-batches and ``optimizer.step()``
once, never entering ``no_sync()``: torch DDP all-reduces every backward and the averaged gradients add
up in ``p.grad``, so the step applies their sum. deft must give the same parameters at epsilon 0 (its
own lag-free plan, and a forced plan whose updates finish in the next forward), and at the default
epsilon apply every micro-batch's gradient exactly once. The check is shown to discriminate: dropping
all but the last micro-batch of each step lands far from torch DDP.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values

STEPS = 8


def make_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(wrapped: nn.Module, opt: torch.optim.Optimizer, rank: int, accum: int, drop_early: bool = False,
          steps: int = STEPS, observe: Any = None) -> None:
    """``accum`` micro-batches per step, each ``backward()`` through the wrapper, no ``no_sync()``.
    ``drop_early``: ``zero_grad()`` before the last micro-batch (all but the last one dropped)."""
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        for micro in range(accum):
            if drop_early and micro == accum - 1:
                opt.zero_grad()
            x, y = _batch(rank, step, micro)
            loss = loss_fn(wrapped(x), y) / accum
            loss.backward()
            if observe is not None:
                observe(loss.item())
        opt.step()
        opt.zero_grad()


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _worst(a: nn.Module, b: nn.Module) -> float:
    return max(((p - q).abs().max() / q.abs().max()).item()
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def exact_worker(rank: int, world: int, accum: int) -> dict[str, Any]:
    import deft

    ours = make_model()
    opt = _opt(ours)
    ddp = deft.DistributedDataParallel(ours, config={"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2,
                                                     "timeout_s": 30})
    train(ddp, opt, rank, accum)
    ddp.flush()
    ref = make_model()
    train(nn.parallel.DistributedDataParallel(ref), _opt(ref), rank, accum)
    dropped = make_model()
    train(nn.parallel.DistributedDataParallel(dropped), _opt(dropped), rank, accum, drop_early=True)
    return {"worst": _worst(ours, ref), "dropped": _worst(dropped, ref),
            "log": [[t, list(its)] for t, its in ddp.update_log], "skipped": ddp.plan_info.get("skipped_steps")}


@pytest.mark.slow
@pytest.mark.parametrize("accum", [2, 3])
def test_accumulation_without_no_sync_matches_torch_ddp(accum: int) -> None:
    for v in values(run_ranks(exact_worker, 2, (accum,), timeout=120)):
        assert v["worst"] < 1e-5, v
        assert v["dropped"] > 1e-3, v  # losing the early micro-batches would be seen
        assert v["skipped"] is None, v
        # every micro-batch (deft's iteration) applied once, by the step that ends its group
        assert v["log"] == [[s * accum + accum - 1, [s * accum + m]] for s in range(STEPS) for m in range(accum)]


def deferred_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    from tests.test_runtime_parity import Net, deferring_run

    ours, opt, ddp = deferring_run(path, rank)
    loss_fn = nn.CrossEntropyLoss()

    def loop(wrapped: nn.Module, o: torch.optim.Optimizer) -> None:
        for step in range(STEPS):
            for micro in range(2):
                g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
                (loss_fn(wrapped(x), y) / 2).backward()
            o.step()
            o.zero_grad()

    loop(ddp, opt)
    ddp.flush()
    torch.manual_seed(0)
    ref = Net()
    loop(nn.parallel.DistributedDataParallel(ref), torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9))
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                for a, b in zip(ours.state_dict().values(), ref.state_dict().values(), strict=True)
                if a.is_floating_point())
    return {"worst": worst, "applied": sorted(t for _, its in ddp.update_log for t in its)}


@pytest.mark.slow
def test_accumulation_with_updates_finishing_in_the_forward(tmp_path: Any) -> None:
    """A forced plan defers buckets into the next forward: the next micro-batch's forward is where
    they would be applied; accumulating, they are carried into the step instead."""
    for v in values(run_ranks(deferred_worker, 2, (str(tmp_path / "s.json"),), timeout=120)):
        assert v["worst"] < 1e-5, v
        assert v["applied"] == list(range(2 * STEPS)), v


def default_worker(rank: int, world: int) -> dict[str, Any]:
    import deft

    ours = make_model()
    opt = _opt(ours)
    ddp = deft.DistributedDataParallel(ours, config={"timeout_s": 60, "solver_time_limit_s": 0.1})
    losses: list[float] = []
    train(ddp, opt, rank, 2, steps=20, observe=lambda x: (losses.append(x), ddp.observe_loss(x)))
    ddp.flush()
    return {"applied": sorted(t for _, its in ddp.update_log for t in its),
            "params": [p.detach().flatten().tolist()[:50] for p in ours.parameters()], "losses": losses}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_accumulation_at_the_default_epsilon_applies_each_gradient_once() -> None:
    out = values(run_ranks(default_worker, 2, timeout=480))
    for v in out:
        assert v["applied"] == list(range(40)), v["applied"]
        assert all(x == x and abs(x) < 1e6 for p in v["params"] for x in p)
        assert sum(v["losses"][-10:]) < sum(v["losses"][:10]), v["losses"]
    assert out[0]["params"] == out[1]["params"]


def merged_worker(rank: int, world: int, path: str, accum: int) -> dict[str, Any]:
    import deft
    from deft.schedule import CommTask, Schedule, StagePlan, Update

    path = f"{path}.{rank}"  # each rank its own file: no race on the write
    ours = make_model()
    numel = sum(p.numel() for p in ours.parameters())
    half = numel // 2
    Schedule(cycle=2, links=("primary",), bucket_numel=(half, numel - half),
             bucket_nbytes=(4 * half, 4 * (numel - half)),
             stages=(StagePlan(0, "forward"), StagePlan(0, "backward"), StagePlan(1, "forward"),
                     StagePlan(1, "backward", (CommTask(0, 0, "primary"), CommTask(1, 0, "primary")))),
             updates=(Update((0, 1), 1),)).save(path)
    opt = _opt(ours)
    ddp = deft.DistributedDataParallel(ours, config={"epsilon": 0.5, "warmup_iters": 1, "profile_iters": 2,
                                                     "schedule_path": path, "timeout_s": 30})
    train(ddp, opt, rank, accum)
    ddp.flush()
    return {"applied": sorted(t for _, its in ddp.update_log for t in its),
            "params": [p.detach().flatten().tolist()[:20] for p in ours.parameters()],
            "skipped": ddp.plan_info.get("skipped_steps"),
            "merged": sum(len(its) == 2 for _, its in ddp.update_log)}


@pytest.mark.slow
@pytest.mark.parametrize("accum", [2, 3])
def test_accumulation_under_a_merged_schedule_applies_each_gradient_once(accum: int, tmp_path: Any) -> None:
    """A schedule merging iterations two by two (no update due at every other micro-batch, cycles not
    aligned with the steps when ``accum`` is 3): every micro-batch's gradient applied exactly once."""
    out = values(run_ranks(merged_worker, 2, (str(tmp_path / "s.json"), accum), timeout=120))
    for v in out:
        assert v["applied"] == list(range(accum * STEPS)), v["applied"]
        assert v["skipped"] is None, v
        assert v["merged"] >= 5, v  # the forced schedule ran
        assert all(abs(x) < 1e6 for p in v["params"] for x in p)
    assert out[0]["params"] == out[1]["params"]


def amp_accumulate(model: nn.Module, wrapped: nn.Module, rank: int, inf_at: tuple[int, int],
                   set_to_none: bool = True) -> float:
    """torch's AMP loop accumulating two micro-batches without ``no_sync()``; rank 0's loss infinite at
    micro-batch ``inf_at = (step, micro)``: GradScaler skips that whole step, ``zero_grad()`` drops it
    (``set_to_none=False``: leaves zeros in ``p.grad``)."""
    opt = _opt(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    for step in range(STEPS):
        for micro in range(2):
            x, y = _batch(rank, step, micro)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(wrapped(x), y) / 2
            if (step, micro) == inf_at and rank == 0:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=set_to_none)
    return float(scaler.get_scale())


def amp_worker(rank: int, world: int, micro: int, set_to_none: bool) -> dict[str, Any]:
    import deft

    ours = make_model()
    ddp = deft.DistributedDataParallel(ours, config={"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2,
                                                     "timeout_s": 30})
    scale = amp_accumulate(ours, ddp, rank, (3, micro), set_to_none)
    ddp.flush()
    ref = make_model()
    ref_scale = amp_accumulate(ref, nn.parallel.DistributedDataParallel(ref), rank, (3, micro), set_to_none)
    return {"worst": _worst(ours, ref), "scale": scale, "ref_scale": ref_scale,
            "applied": sorted(t for _, its in ddp.update_log for t in its), "skipped": ddp.plan_info["skipped_steps"]}


@pytest.mark.slow
@pytest.mark.parametrize("micro", [0, 1])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulation_with_grad_scaler_skipping_a_step(micro: int, set_to_none: bool) -> None:
    """An inf in either micro-batch of step 3: the whole step is skipped, both micro-batches dropped,
    whether ``zero_grad()`` sets ``p.grad`` to None or to zeros."""
    for v in values(run_ranks(amp_worker, 2, (micro, set_to_none), timeout=120)):
        assert v["worst"] < 1e-5, v
        assert v["scale"] == v["ref_scale"] == 2.0 ** 11, v  # x2 after steps 0-2, halved at 3, x2 after 4-6
        assert v["applied"] == [t for t in range(2 * STEPS) if t not in (6, 7)], v
        assert v["skipped"] == [7], v


def between_micro_batches_worker(rank: int, world: int) -> dict[str, Any]:
    """torch DDP and deft through one loop: the wrapper's ``state_dict()`` (and deft's ``flush()``)
    between the two micro-batches of step 2, the first under ``no_sync()``; then, deft alone, a step
    after micro-batches all under ``no_sync()`` with a checkpoint between them."""
    import deft

    loss_fn = nn.CrossEntropyLoss()
    out: dict[str, Any] = {}
    for kind in ("torch", "deft"):
        model = make_model()
        opt = _opt(model)
        ddp: Any = (nn.parallel.DistributedDataParallel(model) if kind == "torch" else deft.DistributedDataParallel(
            model, config={"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2}))
        train(ddp, opt, rank, 1, steps=2)
        with ddp.no_sync():
            x, y = _batch(rank, 2, 0)
            loss_fn(ddp(x), y).backward()
        saved = {k: v.clone() for k, v in ddp.state_dict().items() if k.startswith("module.")}
        if kind == "deft":
            ddp.flush()
        x, y = _batch(rank, 2, 1)
        loss_fn(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        train(ddp, opt, rank, 1, steps=2)
        out[kind] = ([p.detach().clone() for p in model.parameters()], saved)
        if kind == "deft":
            ddp.flush()
            out["applied"] = sorted(t for _, its in ddp.update_log for t in its)
            with ddp.no_sync():
                loss_fn(ddp(x), y).backward()
            ddp.state_dict()
            try:
                opt.step()
                out["alone"] = "no error"
            except deft.DeftError as e:
                out["alone"] = str(e)
    (ours, ours_saved), (ref, ref_saved) = out["deft"], out["torch"]
    worst = max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(ours, ref, strict=True))
    return {"worst": worst, "saved": sorted(ours_saved) == sorted(ref_saved) and all(
        torch.equal(ours_saved[k], ref_saved[k]) for k in ref_saved), "applied": out["applied"], "alone": out["alone"]}


@pytest.mark.slow
def test_flush_and_save_between_micro_batches_hold_torch_ddps_state() -> None:
    for v in values(run_ranks(between_micro_batches_worker, 2, timeout=120)):
        assert v["saved"], "the state_dict between micro-batches differs from torch DDP's"
        assert v["worst"] < 1e-5, v
        assert v["applied"] == [0, 1, 2, 3, 4]
        # the checkpoint between them does not make a step on each rank's own gradient pass
        assert "follows only backwards whose forward ran under no_sync()" in v["alone"], v["alone"]
