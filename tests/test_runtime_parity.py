"""epsilon = 0: deft.DistributedDataParallel gives torch DDP's parameters (2 gloo ranks on CPU).

The whole torch DDP training loop is reused with only the wrapper line changed: deft finds the
optimizer by itself (global step hooks), measures a warm-up profile, plans with ``no_delay_plan`` and
runs it. The same process then trains an identical model under real
``torch.nn.parallel.DistributedDataParallel`` on the same data; parameters and buffers (BatchNorm
statistics, broadcast from rank 0 as torch DDP does) must agree to 1e-5 relative after 20 steps, for
SGD with momentum and for Adam.

Further cases cover what torch DDP's ``find_unused_parameters=True`` covers: a branch that is used
in some iterations only, a frozen parameter, and a model whose gradient ready order differs from the
registration order (the last registered layer runs first); and gradient accumulation over two
micro-batches with ``no_sync()`` and gradient clipping.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from deft.schedule import CommTask, Schedule, StagePlan, Update
from tests._dist import run_ranks, values
from tests.compat._harness import close

STEPS = 20
CLIP = 0.5


class Net(nn.Module):
    """Registration order differs from ready order: ``head`` is registered first but runs last."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.conv = nn.Conv1d(2, 4, 3, padding=1)
        self.body = nn.Linear(32, 16)
        self.norm = nn.BatchNorm1d(16)  # buffers: broadcast from rank 0 at every forward, as torch DDP does
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        self.branch = nn.Linear(16, 16) if branch else None

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.relu(self.conv(x.view(-1, 2, 8))).flatten(1)
        h = torch.tanh(self.norm(self.body(h)))
        if self.branch is not None and use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _train(model: nn.Module, wrapped: nn.Module, opt: torch.optim.Optimizer, rank: int, branch: bool,
           accum: bool, finishing: list[bool] | None = None) -> None:
    """``STEPS`` iterations with a learning-rate schedule stepped after every optimizer step;
    ``finishing`` (deft only) records whether an update was left finishing in the next forward."""
    loss_fn = nn.CrossEntropyLoss()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        use = branch and step % 3 == 1
        if accum:  # two micro-batches, the first under no_sync(), as with torch DDP
            with wrapped.no_sync():  # type: ignore[operator]
                (0.5 * loss_fn(wrapped(x[:4], use_branch=use), y[:4])).backward()
            x, y = x[4:], y[4:]
        loss = loss_fn(wrapped(x, use_branch=use), y) * (0.5 if accum else 1.0)
        loss.backward()
        if accum and isinstance(wrapped, nn.parallel.DistributedDataParallel):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # deft: clip_grad_norm_on_update
        opt.step()
        sched.step()
        if finishing is not None:
            finishing.append(any(u.finishing for u in wrapped.pending_updates))  # type: ignore[union-attr]
        opt.zero_grad()


def _make_opt(kind: str, params: object) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]
    return torch.optim.Adam(params, lr=0.01)  # type: ignore[arg-type]


def finish_in_forward_schedule(path: str, branch: bool, early: bool = False) -> None:
    """Cycle 1 on two links: buckets 1 and 2 (the input side) in backward, bucket 0 (the output side,
    needed last by the next forward) in the next forward, the update applied module by module.

    ``early``: every bucket is sent in the backward, bucket 0 first on the primary link (ahead of the
    used map there); buckets 0 and 1 are deferred (``Update.deferred``): waited for and applied module
    by module in the next forward. Nothing is sent in a forward stage, so an update is left finishing
    after the step only if the runtime honours ``deferred``."""
    total = sum(p.numel() for p in Net(branch).parameters() if p.requires_grad)
    numel = (total // 3, total // 3, total - 2 * (total // 3))
    P, S = "primary", "second"
    if early:
        stages = (StagePlan(0, "forward"),
                  StagePlan(0, "backward", (CommTask(0, 0, P), CommTask(1, 0, S), CommTask(2, 0, S))))
    else:
        stages = (StagePlan(0, "forward", (CommTask(0, 1, S),)),
                  StagePlan(0, "backward", (CommTask(1, 0, P), CommTask(2, 0, S))))
    Schedule(cycle=1, links=(P, S), bucket_numel=numel, bucket_nbytes=tuple(4 * n for n in numel),
             stages=stages,
             updates=(Update((0,), 0, finish_in_forward=True, deferred=(0, 1) if early else ()),)).save(path)


def deferring_run(path: str, rank: int) -> tuple[Net, torch.optim.Optimizer, nn.Module]:
    """A fresh ``Net`` (seed 0), its SGD with momentum and deft at epsilon 0 running the ``early``
    :func:`finish_in_forward_schedule` (updates finishing in the next forward) from this rank's own
    copy of the schedule file."""
    import deft

    path = f"{path}.{rank}"  # each rank its own file: no race on the write
    finish_in_forward_schedule(path, branch=False, early=True)
    torch.manual_seed(0)
    ours = Net()
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    ddp = deft.DistributedDataParallel(ours, config={"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2,
                                                     "bucket_cap_mb": 0.001, "schedule_path": path,
                                                     "links": [{"name": "primary"}, {"name": "second"}]})
    return ours, opt, ddp


def parity_worker(rank: int, world: int, kind: str, branch: bool, accum: bool,
                  schedule_path: str | None = None) -> dict[str, object]:
    import deft

    torch.manual_seed(0)
    ours = Net(branch)
    if rank == 1:  # deft must broadcast rank 0's initial parameters, as torch DDP does
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(1.0)
    opt = _make_opt(kind, ours.parameters())
    cfg: dict[str, object] = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "bucket_cap_mb": 0.001}
    if schedule_path is not None:
        cfg |= {"schedule_path": schedule_path, "links": [{"name": "primary"}, {"name": "second"}]}
    ddp = deft.DistributedDataParallel(ours, config=cfg)
    if accum:
        ddp.clip_grad_norm_on_update(CLIP)
    finishing: list[bool] = []
    _train(ours, ddp, opt, rank, branch, accum, finishing=finishing)

    torch.manual_seed(0)
    ref = Net(branch)
    ref_opt = _make_opt(kind, ref.parameters())
    tddp = nn.parallel.DistributedDataParallel(ref, find_unused_parameters=branch)
    _train(ref, tddp, ref_opt, rank, branch, accum)

    worst = 0.0
    for (n, a), b in zip(ours.state_dict().items(), ref.state_dict().values(), strict=True):
        if not a.is_floating_point():
            assert torch.equal(a, b), n
            continue
        rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        worst = max(worst, rel)
        assert rel < 1e-5, f"{n}: relative difference {rel}"
    return {"worst": worst, "schedule_cycle": ddp.schedule.cycle, "n_updates": len(ddp.update_log),
            "plan": str(ddp.plan_info.get("source")), "last_norm": ddp.last_grad_norm, "finishing": finishing,
            "finish_in_forward": ddp.plan_info.get("finish_in_forward"),
            "params": [p.sum().item() for p in ours.parameters()]}


@pytest.mark.slow
# the cheapest end-to-end run (two ranks, SGD, against torch DDP): the fast lane's one multi-process test
@pytest.mark.parametrize(("kind", "branch", "accum"), [pytest.param("sgd", False, False, marks=pytest.mark.e2e_fast),
                                                       ("adam", True, False), ("sgd", True, True)])
def test_epsilon_zero_matches_torch_ddp(kind: str, branch: bool, accum: bool) -> None:
    out = values(run_ranks(parity_worker, 2, (kind, branch, accum), timeout=120))
    for v in out:
        assert v["worst"] < 1e-5
        # the lag-free plan, or DDP's synchronous schedule if the planner cannot plan this tiny profile
        assert v["schedule_cycle"] == 1 and ("lagfree_plan" in v["plan"] or "synchronous" in v["plan"])
        assert v["n_updates"] == STEPS  # one update per iteration, every iteration
    assert out[0]["params"] == out[1]["params"]  # identical on both ranks
    # a norm is recorded exactly when clipping is on, and then clipping really changed the update
    assert (out[0]["last_norm"] is not None) == accum
    assert out[0]["last_norm"] is None or out[0]["last_norm"] > CLIP


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_epsilon_zero_matches_torch_ddp_at_four_and_eight_ranks(world: int) -> None:
    """The same loop on loopback at 4 and 8 ranks: deft's own profile, plan and runtime give torch DDP's
    parameters, every iteration applied once, on every rank."""
    out = values(run_ranks(parity_worker, world, ("sgd", False, False), timeout=180))
    for v in out:
        assert v["worst"] < 1e-5
        assert v["schedule_cycle"] == 1 and v["n_updates"] == STEPS
    assert all(v["params"] == out[0]["params"] for v in out)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "branch", "accum", "early"),
                         [("sgd", False, False, False), ("adam", True, False, False), ("sgd", True, True, False),
                          ("sgd", False, False, True), ("adam", True, False, True)])
def test_update_finishing_in_the_forward_matches_torch_ddp(kind: str, branch: bool, accum: bool, early: bool,
                                                           tmp_path: Path) -> None:
    """Lag-free forward stage (Update.finish_in_forward): the output-side bucket's all-reduce runs into
    the next forward and its parameters are updated just before their module's forward; parameters,
    BatchNorm buffers and Adam moments evolve as under torch DDP (with a learning-rate scheduler that
    steps between the update's two parts). With a global gradient clip the update cannot be split:
    deft applies it whole at the step and says so."""
    path = str(tmp_path / "finish_in_forward.json")
    finish_in_forward_schedule(path, branch, early)
    out = values(run_ranks(parity_worker, 2, (kind, branch, accum, path), timeout=120))
    for v in out:
        assert v["worst"] < 1e-5
        assert v["n_updates"] == STEPS
        # with the clip the split is refused with a reason naming it; without, planned after 1 warm-up
        # iteration (a schedule file needs no profile) and finishing in the forward from then on
        refused = v["finish_in_forward"]
        assert (refused is not None) == accum
        assert refused is None or (str(refused).startswith("off") and "clip" in str(refused))
        assert v["finishing"] == ([False] * STEPS if accum else [False] + [True] * (STEPS - 1))
    assert out[0]["params"] == out[1]["params"]


def after_step_flush_worker(rank: int, world: int, path: str) -> dict[str, object]:
    """The ``early`` deferring schedule: after each step the gradient norms are read, ``flush()`` applies
    the updates still finishing, and the norms are read again; torch DDP's run gives the reference."""
    ours, opt, ddp = deferring_run(path, rank)
    torch.manual_seed(0)
    ref = Net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    tddp = nn.parallel.DistributedDataParallel(ref)

    def norms(m: nn.Module) -> list[float]:
        return [float(p.grad.norm()) for p in m.parameters() if p.grad is not None]

    before, after, torch_norms = [], [], []
    for step in range(6):
        x, y = _batch(rank, step)
        for wrapped, o in ((ddp, opt), (tddp, ref_opt)):
            o.zero_grad()
            nn.functional.cross_entropy(wrapped(x), y).backward()
            o.step()
        before.append(norms(ours))
        ddp.flush()  # type: ignore[operator]
        after.append(norms(ours))
        torch_norms.append(norms(ref))
    return {"before": before, "after": after, "torch": torch_norms,
            "trainable": sum(p.requires_grad for p in ref.parameters())}


@pytest.mark.slow
def test_gradients_read_after_the_step_are_torch_ddps_before_and_after_a_flush(tmp_path: Path) -> None:
    """``flush()`` between the step and a read (it steps the finishing updates itself) gives the loop's
    ``p.grad`` back as the step left it."""
    path = str(tmp_path / "early.json")
    for v in values(run_ranks(after_step_flush_worker, 2, (path,), timeout=120)):
        assert all(len(n) == v["trainable"] for n in v["torch"])  # every trainable parameter has a gradient
        for ours_before, ours_after, theirs in zip(v["before"], v["after"], v["torch"], strict=True):
            assert close(ours_before, theirs) and close(ours_after, theirs), (ours_before, ours_after, theirs)
