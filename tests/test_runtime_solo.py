"""World size 1: deft runs solo, bit for bit torch DDP on one rank, with no machinery of its own.

This process is the only rank of a gloo group (a file store, no port). deft and torch DDP train the
same model from the same seed; the parameters and buffers must be equal exactly (one rank's average is
its own gradient), with plain steps, accumulation with and without ``no_sync()``,
``optimizer.step(closure)`` and a GradScaler that skips a step. No gradient hook runs: a user's
post-accumulate hook registered after the wrapper still sees the gradient (deft's capture, with
``solo = false``, takes it). The update log,
``plan_info``, the checkpoint round trip and the refusals are the public API's; the refusal of a
one-rank record by a two-rank job starts two ranks (``slow``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import deft
from deft.config import DeftConfig
from deft.errors import ContractError, DeftError
from tests._dist import run_ranks, values

STEPS = 4


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """This process as the only rank of a gloo default group."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batch(t: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * t + micro)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _loss(wrapped: nn.Module, t: int, micro: int = 0) -> torch.Tensor:
    x, y = _batch(t, micro)
    return nn.functional.cross_entropy(wrapped(x), y)


def _plain(wrapped: nn.Module, opt: torch.optim.Optimizer) -> None:
    for t in range(STEPS):
        _loss(wrapped, t).backward()
        opt.step()
        opt.zero_grad()


def _no_sync(wrapped: nn.Module, opt: torch.optim.Optimizer) -> None:
    for t in range(STEPS):
        with wrapped.no_sync():  # type: ignore[operator]
            for micro in (1, 2):
                _loss(wrapped, t, micro).backward()
        _loss(wrapped, t).backward()
        opt.step()
        opt.zero_grad()


def _accumulate(wrapped: nn.Module, opt: torch.optim.Optimizer) -> None:
    for t in range(STEPS):  # micro-batches without no_sync(): every backward adds to p.grad
        for micro in (0, 1):
            _loss(wrapped, t, micro).backward()
        opt.step()
        opt.zero_grad()


def _closure(wrapped: nn.Module, opt: torch.optim.Optimizer) -> None:
    for t in range(STEPS):
        def closure(t: int = t) -> torch.Tensor:
            opt.zero_grad()
            loss = _loss(wrapped, t)
            loss.backward()
            return loss
        opt.step(closure)


def _scaler(wrapped: nn.Module, opt: torch.optim.Optimizer) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for t in range(STEPS):
        loss = _loss(wrapped, t) * (float("inf") if t == 1 else 1.0)  # step 1 overflows: skipped
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _amp_clip(wrapped: nn.Module, opt: torch.optim.Optimizer) -> None:
    """torch's documented AMP loop with clipping (autocast, scale, unscale_, clip_grad_norm_, step,
    update) and the grad norm a loop logs: the clip at 0.05 binds, so a norm taken on other gradients
    than torch DDP's would change the parameters compared."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    params = list(wrapped.parameters())
    for t in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(wrapped, t)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(params, max_norm=0.05)
        assert bool(torch.isfinite(norm))  # the grad norm a training loop logs
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


LOOPS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], None]] = {
    "plain": _plain, "no_sync": _no_sync, "accumulate": _accumulate, "closure": _closure, "grad_scaler": _scaler,
    "amp_clip": _amp_clip}


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def _train(loop: str, wrap: Callable[[nn.Module], nn.Module]) -> tuple[list[torch.Tensor], nn.Module]:
    model = _model()
    wrapped = wrap(model)
    LOOPS[loop](wrapped, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return _state(model), wrapped


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("loop", list(LOOPS))
def test_world_one_equals_torch_ddp_exactly(loop: str) -> None:
    want, _ = _train(loop, nn.parallel.DistributedDataParallel)
    got, ddp = _train(loop, deft.DistributedDataParallel)
    ddp.flush()  # nothing pending: the parameters stay as they are
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    steps = STEPS - 1 if loop == "grad_scaler" else STEPS  # GradScaler skipped one optimizer.step()
    assert ddp.update_log == [(t, (t,)) for t in range(steps)]
    assert ddp.iteration == steps and ddp.pending_updates == []
    assert ddp.link_stats["primary"]["calls"] == 0  # nothing sent
    ddp.close()


def _grads_seen_by_a_user_hook(config: dict[str, Any]) -> tuple[list[bool], dict[str, Any]]:
    """Whether a user's post-accumulate-grad hook, registered after the wrapper, finds ``p.grad`` set."""
    model = _model()
    ddp = deft.DistributedDataParallel(model, config=config)
    seen: list[bool] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(ddp, 0).backward()
    opt.step()
    info = dict(ddp.plan_info)
    ddp.close()
    return seen, info


@pytest.mark.usefixtures("one_rank")
def test_no_gradient_hook_and_nothing_planned() -> None:
    seen, info = _grads_seen_by_a_user_hook({})
    assert seen == [True] * len(list(_model().parameters()))
    assert info["mode"] == "solo" and "world size 1" in str(info["reason"])
    # the opt-out runs deft's machinery on one rank: its capture takes the gradient first
    seen, info = _grads_seen_by_a_user_hook({"solo": False, "epsilon": 0.0, "warmup_iters": 1, "profile_iters": 1})
    assert seen == [False] * len(seen) and seen
    assert "mode" not in info


@pytest.mark.usefixtures("one_rank")
def test_public_api_in_solo_mode() -> None:
    model = _model()
    ddp = deft.DistributedDataParallel(model)
    ref = _model()
    tddp = nn.parallel.DistributedDataParallel(ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    ddp.clip_grad_norm_on_update(0.05)
    for t in range(2):
        loss = _loss(ddp, t)
        loss.backward()
        ddp.observe_loss(loss)
        _loss(tddp, t).backward()
        norm = float(nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05))
        for o in opts:
            o.step()
            o.zero_grad()
        assert ddp.last_grad_norm == norm
    for w, g in zip(_state(ref), _state(model), strict=True):
        assert torch.equal(w, g)
    assert ddp.calibrate(lambda: _loss(ddp.module, 0)) is None
    info = ddp.plan_info
    assert json.loads(json.dumps(info)) == dict(info)
    with pytest.raises(TypeError, match="read-only"):
        info["mode"] = "x"  # type: ignore[index]
    with pytest.raises(DeftError, match="world size 1"):
        _ = ddp.schedule
    with pytest.raises(DeftError, match="solo = false"):
        ddp.register_comm_hook(None, lambda state, bucket: None)
    assert ddp.comm_hook is None and ddp.profile is None
    ddp.close()


@pytest.mark.usefixtures("one_rank")
def test_settings_that_only_shape_communication_are_ignored_and_said() -> None:
    for config, said in (({"compression": "fp16"}, "compression = 'fp16'"), ({"local_steps": 2}, "local_steps = 2")):
        ddp = deft.DistributedDataParallel(_model(), config=config)
        assert ddp.plan_info["mode"] == "solo" and said in " ".join(ddp.plan_info["ignored"])  # type: ignore[arg-type]
        ddp.close()
    # DiLoCo's outer step changes the maths even on one rank: its mode runs
    ddp = deft.DistributedDataParallel(_model(), config={"local_steps": 2, "local_outer": "diloco"})
    assert "local_steps" in ddp.plan_info and "mode" not in ddp.plan_info
    ddp.close()


def test_the_opt_out_is_a_checked_setting() -> None:
    assert DeftConfig().solo is True
    assert DeftConfig.from_dict({"solo": False}).solo is False
    with pytest.raises(ContractError, match="solo"):
        DeftConfig.from_dict({"solo": "no"})


def _run_to(ddp: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for t in steps:
        _loss(ddp, t).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("config", [{}, {"local_steps": 2}], ids=["default", "local_steps"])
def test_checkpoint_round_trip(config: dict[str, Any], tmp_path: Path) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
        m = _model()
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return m, o, deft.DistributedDataParallel(m, optimizer=o, config=config)

    full, full_opt, full_ddp = build()
    _run_to(full_ddp, full_opt, range(STEPS))
    _, first_opt, first_ddp = build()
    _run_to(first_ddp, first_opt, range(2))
    torch.save({"ddp": first_ddp.state_dict(), "opt": first_opt.state_dict()}, tmp_path / "ckpt.pt")
    second, second_opt, second_ddp = build()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    second_ddp.load_state_dict(saved["ddp"])
    second_opt.load_state_dict(saved["opt"])
    assert second_ddp.iteration == 2
    _run_to(second_ddp, second_opt, range(2, STEPS))
    for w, g in zip(_state(full), _state(second), strict=True):
        assert torch.equal(w, g)
    assert second_ddp.update_log == full_ddp.update_log == [(t, (t,)) for t in range(STEPS)]
    for d in (full_ddp, first_ddp, second_ddp):
        d.close()


@pytest.mark.usefixtures("one_rank")
def test_a_record_of_the_full_machinery_is_refused_naming_the_opt_out() -> None:
    machinery = deft.DistributedDataParallel(_model(), config={"solo": False})
    state = machinery.state_dict()
    machinery.close()
    solo = deft.DistributedDataParallel(_model())
    with pytest.raises(ContractError, match="solo = false"):
        solo.load_state_dict(state)
    solo.close()


@pytest.mark.usefixtures("one_rank")
def test_a_solo_record_is_refused_by_the_full_machinery_naming_solo() -> None:
    solo = deft.DistributedDataParallel(_model())
    state = solo.state_dict()
    solo.close()
    machinery = deft.DistributedDataParallel(_model(), config={"solo": False})
    with pytest.raises(ContractError, match="saved by deft's solo mode"):
        machinery.load_state_dict(state)
    machinery.close()


def two_rank_load_worker(rank: int, world: int, path: str) -> str:
    model = _model()
    ddp = deft.DistributedDataParallel(model, config={"epsilon": 0.0})
    try:
        ddp.load_state_dict(torch.load(path, weights_only=True))
    except ContractError as e:
        return str(e)
    finally:
        ddp.close()
    return "loaded"


@pytest.mark.slow
def test_a_one_rank_record_is_refused_by_two_ranks(one_rank: None, tmp_path: Path) -> None:
    ddp = deft.DistributedDataParallel(_model(), config={"epsilon": 0.0})
    _run_to(ddp, torch.optim.SGD(ddp.module.parameters(), lr=0.1), range(2))
    torch.save(ddp.state_dict(), tmp_path / "one.pt")
    ddp.close()
    for msg in values(run_ranks(two_rank_load_worker, 2, (str(tmp_path / "one.pt"),), timeout=120)):
        assert "saved by a job of 1 ranks and this one has 2" in msg, msg
