"""The compatibility suite's harness: torch DDP and deft side by side under the loops users write.

Each rank builds the same model twice from one seed, trains it with torch's
``nn.parallel.DistributedDataParallel`` and with ``deft.DistributedDataParallel`` through the same
loop (:class:`Recipe`) on the same data, and reports what a user would compare: the parameters after
``ddp.flush()``, every iteration's loss, whatever the loop logged (gradient norms, GradScaler's scale,
evaluation outputs), and deft's updates.

How deft gets a schedule that defers buckets (``mode``):

* ``"forced"``: a schedule file, three buckets on two links, every bucket sent in the backward and
  buckets 0 and 1 (the output side) *deferred*: still in flight after the step, applied just before
  their first use in the next forward. Nothing is planned or adapted.
* ``"given"``: a communication-heavy profile is given, deft plans at once (``plan_lag_iters = 0``),
  the lag-free planner defers buckets, adaptation runs; the link-failover guard is off.
* ``"measured"``: deft profiles itself and plans in the background (``plan_lag_iters = 2``),
  adaptation runs with a short window (it may switch schedules; a switch flushes).
* ``"merged"`` (epsilon > 0 only): a schedule file merging two iterations per update, buckets sent in
  the second's backward: steps where no update is due.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

LINKS = [{"name": "primary"}, {"name": "second"}]


@dataclass
class Logged:
    """What a loop recorded in one run."""

    losses: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)  # norms, scales, evaluation outputs
    saved: list[float] = field(default_factory=list)  # what checkpoints taken in the loop held
    deferred: list[bool] = field(default_factory=list)  # deft: an update still finishing after the step


@dataclass(frozen=True)
class Recipe:
    """One training loop: ``step(ctx, t, x, y)`` runs iteration ``t`` on a ``Loop``."""

    model: Callable[[], nn.Module]
    step: Callable[[Loop, int, torch.Tensor, torch.Tensor], None]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9)
    steps: int = 24
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None
    scaler: bool = False
    restart_at: int | None = None  # checkpoint and resume in a fresh wrapper before this iteration
    restart_from: str = "wrapper"  # how the checkpoint is taken: the wrapper's state_dict, the module's, "dcp",
    # or "pickle" (torch.save of the wrapper itself)
    ranks_agree: bool = True  # False: a parameter neither wrapper averages (each rank trains its own)


@dataclass
class Loop:
    """What a recipe's step works with."""

    model: nn.Module
    wrapped: nn.Module
    opt: torch.optim.Optimizer
    rank: int
    log: Logged
    scaler: torch.amp.GradScaler | None = None
    is_deft: bool = False
    kept: dict[str, Any] = field(default_factory=dict)  # what a loop keeps between iterations (an EMA, a snapshot)


class MLP(nn.Module):
    """A small MLP (several buckets); ``functional``: the head's parameters are used by the parent's
    forward through ``F.linear`` without calling the head module; ``checkpointed``: the body's
    activations are recomputed in the backward (``torch.utils.checkpoint``, non-reentrant, torch's
    recommended form; the body's modules run their forward, and deft's hooks, a second time)."""

    def __init__(self, functional: bool = False, norm: bool = False, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed  # the body recomputed in the backward (activation checkpointing)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.norm = nn.BatchNorm1d(64) if norm else None
        self.mid = nn.Linear(64, 32)
        self.head = nn.Linear(32, 4)
        self.functional = functional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            h = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        else:
            h = self.body(x)
        if self.norm is not None:
            h = self.norm(h)
        h = torch.tanh(self.mid(h))
        if self.functional:
            return nn.functional.linear(h, self.head.weight, self.head.bias)
        return self.head(h)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * t + rank)
    x = torch.randn(16, 16, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()


def trained(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters torch DDP and deft reduce: those that require a gradient when the module is
    wrapped, less torch DDP's ignore list."""
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in ignored]


def deferring_schedule(path: str, model: nn.Module, merged: bool = False) -> None:
    """The ``forced`` (or ``merged``) schedule of the module docstring for ``model``."""
    from deft.schedule import CommTask, Schedule, StagePlan, Update

    total = sum(p.numel() for _, p in trained(model))
    numel = (total // 3, total // 3, total - 2 * (total // 3))
    sends = (CommTask(0, 0, "primary"), CommTask(1, 0, "second"), CommTask(2, 0, "second"))
    if merged:
        stages = (StagePlan(0, "forward"), StagePlan(0, "backward"), StagePlan(1, "forward"),
                  StagePlan(1, "backward", sends))
        schedule = Schedule(cycle=2, links=("primary", "second"), bucket_numel=numel,
                            bucket_nbytes=tuple(4 * n for n in numel), stages=stages, updates=(Update((0, 1), 1),))
    else:
        stages = (StagePlan(0, "forward"), StagePlan(0, "backward", sends))
        schedule = Schedule(cycle=1, links=("primary", "second"), bucket_numel=numel,
                            bucket_nbytes=tuple(4 * n for n in numel), stages=stages,
                            updates=(Update((0,), 0, finish_in_forward=True, deferred=(0, 1)),))
    schedule.save(path)


def heavy_profile(model: nn.Module) -> Any:
    """One bucket per parameter in reverse registration order, communication 6x the compute on two
    links: the lag-free planner sends the output side in the next forward."""
    from deft.profile import Bucket, BucketTimes, Link, Profile

    named = trained(model)[::-1]
    buckets = tuple(Bucket(id=i, params=(n,), numel=p.numel(), nbytes=4 * p.numel()) for i, (n, p) in enumerate(named))
    times = tuple(BucketTimes(forward_s=1e-3, backward_s=1e-3, comm_s={"primary": 6e-3, "second": 6e-3})
                  for _ in named)
    links = tuple(Link(name=n, backend="gloo", alpha_s=2e-3, beta_s_per_byte=1e-9) for n in ("primary", "second"))
    return Profile(buckets=buckets, times=times, links=links, world_size=2, source="timing")


def deft_wrapper(model: nn.Module, mode: str, epsilon: float | None, workdir: str, rank: int,
                 extra: dict[str, object] | None = None) -> nn.Module:
    import deft

    # solver_time_limit_s: these tests check what a plan does, not how good it is; the default 1 s per
    # CP-SAT solve over the 4 KB buckets made single tests take 4-73 s between runs (a 2-core CI)
    cfg: dict[str, object] = {"warmup_iters": 1, "profile_iters": 2, "timeout_s": 60, "links": LINKS,
                              "bucket_cap_mb": 0.004, "solver_time_limit_s": 0.2, **(extra or {})}
    if epsilon is not None:
        cfg["epsilon"] = epsilon
    profile = None
    if mode in ("forced", "merged"):
        path = os.path.join(workdir, f"{mode}.json")
        if rank == 0:
            deferring_schedule(path, model, merged=mode == "merged")
        import torch.distributed as dist

        dist.barrier()
        cfg["schedule_path"] = path
    elif mode == "given":
        profile = heavy_profile(model)
        # the guard off: what this mode checks is a plan that defers sends past the step, and the second
        # link's verdict, priced in the plan (deft.runtime.failover.guarded_links), makes the planner keep
        # this profile's sends at the step; "forced" runs a deferring schedule with the guard on
        cfg |= {"plan_lag_iters": 0, "adapt_window": 4, "link_failover": False}
    elif mode == "measured":
        cfg |= {"plan_lag_iters": 2, "adapt_window": 4}
    else:
        raise ValueError(mode)
    return deft.DistributedDataParallel(model, config=cfg, profile=profile)


def _train(recipe: Recipe, loop: Loop, start: int, stop: int, observe: bool = False) -> None:
    make = recipe.batch or batch
    for t in range(start, stop):
        x, y = make(loop.rank, t)
        recipe.step(loop, t, x, y)
        if observe and loop.is_deft:  # README's loop: the loss feeds the preserver
            loop.wrapped.observe_loss(loop.log.losses[-1])  # type: ignore[operator]
        if loop.is_deft:  # an update left finishing after this step (deferred buckets in flight)
            loop.log.deferred.append(any(u.finishing for u in loop.wrapped.pending_updates))  # type: ignore[union-attr]


def run(recipe: Recipe, rank: int, mode: str, epsilon: float | None, workdir: str,
        observe: bool = False, extra: dict[str, object] | None = None) -> dict[str, Any]:
    """Train torch DDP and deft through ``recipe`` (``observe``: deft's loop also calls
    ``ddp.observe_loss``, as README's does); what the caller compares."""
    out: dict[str, Any] = {}
    for kind in ("torch", "deft"):
        model = recipe.model()
        if kind == "torch":
            wrapped: nn.Module = nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
        else:
            wrapped = deft_wrapper(model, mode, epsilon, workdir, rank, extra)
        opt = recipe.optimizer(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=5) if recipe.scaler else None
        loop = Loop(model, wrapped, opt, rank, Logged(), scaler, kind == "deft")
        stop = recipe.steps if recipe.restart_at is None else recipe.restart_at
        _train(recipe, loop, 0, stop, observe)
        if recipe.restart_at is not None:
            loop = _resume(recipe, loop, kind, mode, epsilon, workdir, rank)
            _train(recipe, loop, recipe.restart_at, recipe.steps, observe)
        if kind == "deft":
            loop.wrapped.flush()  # type: ignore[operator]
            out["updates"] = [list(its) for _, its in loop.wrapped.update_log]  # type: ignore[union-attr]
            out["plan"] = str(loop.wrapped.plan_info.get("source"))  # type: ignore[union-attr]
            out["background"] = loop.wrapped.plan_info.get("background")  # type: ignore[union-attr]
            out["stats_reason"] = str(loop.wrapped.plan_info.get("stats_reason"))  # type: ignore[union-attr]
            out["deferred"] = sum(loop.log.deferred)
            out["nonfinite_steps"] = loop.wrapped.plan_info.get("nonfinite_steps", [])  # type: ignore[union-attr]
            out["used_before_forward"] = loop.wrapped.plan_info.get("used_before_forward")  # type: ignore[union-attr]
        out[kind] = {"losses": loop.log.losses, "values": loop.log.values, "saved": loop.log.saved,
                     "params": [p.detach().flatten().tolist() for p in loop.model.parameters()],
                     "scale": None if loop.scaler is None else float(loop.scaler.get_scale())}
    return out


def _resume(recipe: Recipe, loop: Loop, kind: str, mode: str, epsilon: float | None, workdir: str,
            rank: int) -> Loop:
    """A checkpoint the way users take one (the wrapper's state_dict, or the bare module's as many
    scripts do, with the optimizer's and the scaler's), saved to a file and loaded into a fresh model,
    wrapper and optimizer."""
    if recipe.restart_from == "dcp":
        return _resume_dcp(recipe, loop, kind, mode, epsilon, workdir, rank)
    if recipe.restart_from == "pickle":
        return _resume_pickled(recipe, loop, kind, workdir, rank)
    path = os.path.join(workdir, f"{kind}-rank{rank}.pt")
    whose = loop.wrapped if recipe.restart_from == "wrapper" else loop.model
    torch.save({"model": whose.state_dict(), "opt": loop.opt.state_dict(),
                "scaler": None if loop.scaler is None else loop.scaler.state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    model = recipe.model()
    if recipe.restart_from == "module":
        model.load_state_dict(saved["model"])
    if kind == "torch":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        wrapped = deft_wrapper(model, mode, epsilon, workdir, rank)
    if recipe.restart_from == "wrapper":
        wrapped.load_state_dict(saved["model"])
    opt = recipe.optimizer(model)
    opt.load_state_dict(saved["opt"])
    scaler = loop.scaler
    if scaler is not None:
        scaler = torch.amp.GradScaler("cpu")
        scaler.load_state_dict(saved["scaler"])
    return Loop(model, wrapped, opt, rank, loop.log, scaler, loop.is_deft)


def _resume_pickled(recipe: Recipe, loop: Loop, kind: str, workdir: str, rank: int) -> Loop:
    """``torch.save`` of the wrapper itself (the whole model, as some scripts save it) and of the
    optimizer's state; ``torch.load`` gives a wrapper again, and a fresh optimizer over its module."""
    path = os.path.join(workdir, f"{kind}-whole-rank{rank}.pt")
    torch.save({"wrapped": loop.wrapped, "opt": loop.opt.state_dict()}, path)
    saved = torch.load(path, weights_only=False)
    wrapped: nn.Module = saved["wrapped"]
    model = wrapped.module
    assert isinstance(model, nn.Module)
    opt = recipe.optimizer(model)
    opt.load_state_dict(saved["opt"])
    return Loop(model, wrapped, opt, rank, loop.log, loop.scaler, loop.is_deft)


def _resume_dcp(recipe: Recipe, loop: Loop, kind: str, mode: str, epsilon: float | None, workdir: str,
                rank: int) -> Loop:
    """torch.distributed.checkpoint as torch's recipe takes one of a DDP model: ``get_state_dict`` of the
    wrapper and optimizer into ``dcp.save`` on every rank; a fresh model, wrapper and optimizer whose
    ``get_state_dict`` ``dcp.load`` fills, then ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = os.path.join(workdir, f"{kind}-dcp")
    model_sd, optim_sd = get_state_dict(loop.wrapped, loop.opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    model = recipe.model()
    wrapped: nn.Module = (nn.parallel.DistributedDataParallel(model) if kind == "torch"
                          else deft_wrapper(model, mode, epsilon, workdir, rank))
    opt = recipe.optimizer(model)
    model_sd, optim_sd = get_state_dict(wrapped, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(wrapped, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return Loop(model, wrapped, opt, rank, loop.log, loop.scaler, loop.is_deft)


def worst_relative(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest difference between two parameter lists, relative to the reference's largest entry."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        scale = max(max(abs(v) for v in y), 1e-12)
        worst = max(worst, max(abs(u - v) for u, v in zip(x, y, strict=True)) / scale)
    return worst


def close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    """Element-wise equal to ``rel`` (relative to the larger magnitude; non-finite values equal only
    to themselves)."""
    if len(a) != len(b):
        return False
    for u, v in zip(a, b, strict=True):
        if not (math.isfinite(u) and math.isfinite(v)):
            if not (u == v or (math.isnan(u) and math.isnan(v))):
                return False
        elif abs(u - v) > rel * max(abs(u), abs(v), 1e-6):
            return False
    return True
