"""Local-steps mode (``config.local_steps``; deft.runtime.local_steps): post-local SGD and DiLoCo.

Without overlap it is torch's post-local SGD (``post_localSGD_hook`` + ``PeriodicModelAverager``) and
examples/diloco.py's DiLoCo; with overlap every averaging is applied once, on every rank, keeping the
local progress since its snapshot (the hand formula, replayed here apart from the code under test);
a checkpoint taken while an averaging is in flight resumes bit for bit.
"""

from __future__ import annotations

import io
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from deft.config import DeftConfig, LinkConfig
from deft.errors import ContractError
from tests._dist import run_ranks, values

LR, MOMENTUM = 0.1, 0.9
TWO_LINKS = (LinkConfig("a"), LinkConfig("b"))
CAP_MB = 200 / 2**20  # 200-byte caps: the MLP's 212 floats in 6 buckets (a multiple of 2 links), 3 per link


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + it)  # each rank its own data, by iteration
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _train(model: Any, opt: Any, rank: int, start: int, stop: int) -> None:
    for it in range(start, stop):
        x, y = _batch(rank, it)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- workers (top-level: pickled by name) --------------------------------------------------------------
def postlocal_worker(rank: int, world: int, h: int, w: int, iters: int) -> dict[str, Any]:
    """deft without overlap against torch DDP + post_localSGD_hook + PeriodicModelAverager."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
    from torch.distributed.algorithms.model_averaging import averagers
    from torch.distributed.optim import PostLocalSGDOptimizer

    import deft

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=DeftConfig(
        local_steps=h, local_warmup_iters=w, local_overlap=False))
    _train(ddp, opt, rank, 0, iters)

    tmodel = _model()
    tddp = nn.parallel.DistributedDataParallel(tmodel)
    state = post_local.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=w,
                                         post_local_gradient_allreduce=False)
    tddp.register_comm_hook(state, post_local.post_localSGD_hook)
    # deft averages after every H local steps (the first after step W + H - 1): torch's averager with
    # warmup_steps = W + H - 1 (its default W averages once more, right after the first local step)
    topt = PostLocalSGDOptimizer(optim=torch.optim.SGD(tmodel.parameters(), lr=LR, momentum=MOMENTUM),
                                 averager=averagers.PeriodicModelAverager(period=h, warmup_steps=w + h - 1))
    _train(tddp, topt, rank, 0, iters)
    return {"diff": float((_flat(model) - _flat(tmodel)).abs().max()),
            "moved": float((_flat(model) - _flat(_model())).abs().max()),
            "info": dict(ddp.plan_info["local_steps"])}


def diloco_worker(rank: int, world: int, h: int, w: int, iters: int) -> dict[str, Any]:
    """deft's DiLoCo without overlap against a reference: the warm-up's gradient mean by hand, then
    examples/diloco.py's DiLoCo (its snapshot taken at the end of the warm-up)."""
    import deft

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from diloco import DiLoCo

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=DeftConfig(
        local_steps=h, local_warmup_iters=w, local_overlap=False, local_outer="diloco"))
    _train(ddp, opt, rank, 0, iters)

    ref = _model()
    inner = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    for it in range(w):
        x, y = _batch(rank, it)
        nn.functional.cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            assert p.grad is not None
            p.grad.div_(world)
            dist.all_reduce(p.grad)
        inner.step()
        inner.zero_grad()
    outer = DiLoCo(ref, inner, h=h, outer_lr=0.7, outer_momentum=0.9)
    _train(ref, outer, rank, w, iters)
    return {"diff": float((_flat(model) - _flat(ref)).abs().max()), "outer_steps": outer.outer_steps,
            "info": dict(ddp.plan_info["local_steps"])}


def no_progress_worker(rank: int, world: int) -> dict[str, Any]:
    """Inner lr 0 and a different model per rank (no init sync): overlap on, applied later, ends where
    overlap off ends."""
    import deft

    out = {}
    for overlap in (False, True):
        model = _model(seed=10 + rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=MOMENTUM)
        ddp = deft.DistributedDataParallel(model, optimizer=opt, init_sync=False, config=DeftConfig(
            local_steps=3, local_overlap=overlap, local_overlap_iters=2, links=TWO_LINKS, bucket_cap_mb=CAP_MB))
        _train(ddp, opt, rank, 0, 8)  # averagings after steps 2 and 5: applied after 4 and 7 with overlap
        ddp.flush()
        out[str(overlap)] = _flat(model).tolist()
    return out


def _hand_reference(rank: int, world: int, outer: str, h: int, w: int, d: int, iters: int) -> torch.Tensor:
    """The overlap's formula written out: theta <- new + (theta - theta_s), applied d steps after the
    snapshot theta_s; new = mean(theta_s) or the outer Nesterov step on mean(anchor - theta_s)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params = list(model.parameters())
    anchor = _flat(model).clone()
    buf: torch.Tensor | None = None
    pending: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (apply after step, theta_s, new)

    def load(v: torch.Tensor) -> None:
        off = 0
        for p in params:
            p.data.copy_(v[off:off + p.numel()].view_as(p))
            off += p.numel()

    for s in range(iters):
        x, y = _batch(rank, s)
        nn.functional.cross_entropy(model(x), y).backward()
        if s < w:
            for p in params:
                assert p.grad is not None
                p.grad.div_(world)
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        if pending is not None and pending[0] == s:
            load(pending[2] + (_flat(model) - pending[1]))
            pending = None
        if s + 1 == w:
            anchor = _flat(model).clone()
        if s >= w and (s - w + 1) % h == 0:
            snap = _flat(model).clone()
            if outer == "average":
                new = snap / world
                dist.all_reduce(new)
            else:
                delta = (anchor - snap) / world
                dist.all_reduce(delta)
                buf = delta.clone() if buf is None else 0.9 * buf + delta
                anchor = anchor - 0.7 * (delta + 0.9 * buf)
                new = anchor
            pending = (s + d, snap, new)
    if pending is not None:  # flush
        load(pending[2] + (_flat(model) - pending[1]))
    return _flat(model)


def overlap_worker(rank: int, world: int, outer: str) -> dict[str, Any]:
    """Overlap on, two links, H 4, warm-up 2, applied 2 steps after each snapshot; the last step is an
    averaging point and flush() applies it."""
    import deft

    h, w, d, iters = 4, 2, 2, 14  # averaging points after steps 5, 9, 13; applied after 7, 11, flush
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=DeftConfig(
        local_steps=h, local_warmup_iters=w, local_outer=outer, local_overlap_iters=d, links=TWO_LINKS,
        bucket_cap_mb=CAP_MB))
    _train(ddp, opt, rank, 0, iters)
    before_flush = dict(ddp.plan_info["local_steps"])
    ddp.flush()
    ref = _hand_reference(rank, world, outer, h, w, d, iters)
    return {"params": _flat(model).tolist(), "diff": float((_flat(model) - ref).abs().max()),
            "before_flush": before_flush, "after_flush": dict(ddp.plan_info["local_steps"]),
            "link_stats": ddp.link_stats}


def checkpoint_worker(rank: int, world: int, outer: str) -> dict[str, Any]:
    """Saved after step 6 (the averaging launched after step 5 is in flight until after step 7), loaded
    into a fresh model, optimizer and wrapper: the same bits as the run that never stopped."""
    import deft

    h, w, d, iters, cut = 4, 2, 2, 14, 7

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model = _model(seed)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        ddp = deft.DistributedDataParallel(model, optimizer=opt, config=DeftConfig(
            local_steps=h, local_warmup_iters=w, local_outer=outer, local_overlap_iters=d, links=TWO_LINKS,
            bucket_cap_mb=CAP_MB))
        return model, opt, ddp

    model, opt, ddp = build(0)
    _train(ddp, opt, rank, 0, iters)
    whole = _flat(model)

    model, opt, ddp = build(0)
    _train(ddp, opt, rank, 0, cut)
    in_flight = ddp.plan_info["local_steps"]["in_flight"]
    blob = io.BytesIO()
    torch.save({"model": ddp.state_dict(), "opt": opt.state_dict()}, blob)
    _train(ddp, opt, rank, cut, iters)  # saving did not disturb the run
    saved_run = _flat(model)

    blob.seek(0)
    doc = torch.load(blob, weights_only=True)
    model, opt, ddp = build(seed=5)  # another initial model: everything must come from the checkpoint
    ddp.load_state_dict(doc["model"])
    opt.load_state_dict(doc["opt"])
    resumed_at = ddp.iteration
    _train(ddp, opt, rank, cut, iters)
    return {"equal": bool(torch.equal(whole, _flat(model))), "saved_run_equal": bool(torch.equal(whole, saved_run)),
            "in_flight": in_flight, "resumed_at": resumed_at, "applied": ddp.plan_info["local_steps"]["applied"]}


# -- local_period "adacomm" ------------------------------------------------------------------------------
ADA_W, ADA_HMAX = 2, 8  # the first averaging point is after step W + H_max - 1 = 9
ADA_FIRST = ADA_W + ADA_HMAX - 1


def _fed_loss(rank: int, it: int) -> float:
    """The loss each rank reports at iteration ``it``: falling, different per rank (so the mean matters)."""
    return (4.0 + rank) * 0.85 ** it


def _train_observed(ddp: Any, opt: Any, rank: int, start: int, stop: int, report: bool = True) -> None:
    """Training that reports :func:`_fed_loss`; rank 1 is late at the first averaging point, so that the
    averaging's measured time (the maximum over the ranks) dwarfs a step's: H_0 is then very likely H_max.
    The tests hold for any H_0."""
    for it in range(start, stop):
        x, y = _batch(rank, it)
        nn.functional.cross_entropy(ddp(x), y).backward()
        if report:
            ddp.observe_loss(_fed_loss(rank, it))
        if rank == 1 and it == ADA_FIRST:
            time.sleep(0.3)
        opt.step()
        opt.zero_grad()


def _ada_config(outer: str, overlap_iters: int) -> DeftConfig:
    """``overlap_iters`` 0: no overlap."""
    return DeftConfig(local_steps=ADA_HMAX, local_period="adacomm", local_warmup_iters=ADA_W, local_outer=outer,
                      local_overlap=overlap_iters > 0, local_overlap_iters=max(1, overlap_iters), links=TWO_LINKS,
                      bucket_cap_mb=CAP_MB)


def adacomm_worker(rank: int, world: int, outer: str, overlap_iters: int, report: bool = True) -> dict[str, Any]:
    """30 steps, then on to the next averaging point (so no local step follows the last snapshot) and
    flush(): the ranks must be equal. ``report``: the loop calls ``ddp.observe_loss``."""
    import deft

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=_ada_config(outer, overlap_iters))
    _train_observed(ddp, opt, rank, 0, 30, report)
    stop = int(ddp.plan_info["local_steps"]["next_point"]) + 1
    _train_observed(ddp, opt, rank, 30, stop, report)
    ddp.flush()
    return {"params": _flat(model).tolist(), "info": dict(ddp.plan_info["local_steps"]), "stop": stop}


def adacomm_checkpoint_worker(rank: int, world: int) -> dict[str, Any]:
    """Saved after step 10 (H_0 chosen after step 9; that averaging in flight until after step 11; a loss
    reported since), loaded into a fresh wrapper: the same bits as the run that saved and went on (a second
    whole run measures its own H_0: timing, not the checkpoint, decides it)."""
    import deft

    iters, cut = 40, ADA_FIRST + 2

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model = _model(seed)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        return model, opt, deft.DistributedDataParallel(model, optimizer=opt, config=_ada_config("average", 2))

    model, opt, ddp = build(0)
    _train_observed(ddp, opt, rank, 0, cut)
    at_save = dict(ddp.plan_info["local_steps"])
    blob = io.BytesIO()
    torch.save({"model": ddp.state_dict(), "opt": opt.state_dict()}, blob)
    _train_observed(ddp, opt, rank, cut, iters)
    saved_run, saved_info = _flat(model), dict(ddp.plan_info["local_steps"])

    blob.seek(0)
    doc = torch.load(blob, weights_only=True)
    model, opt, ddp = build(seed=5)
    ddp.load_state_dict(doc["model"])
    opt.load_state_dict(doc["opt"])
    _train_observed(ddp, opt, rank, cut, iters)
    resumed_info = dict(ddp.plan_info["local_steps"])
    return {"equal": bool(torch.equal(saved_run, _flat(model))), "at_save": at_save, "saved": saved_info,
            "resumed": resumed_info}


def _expected_losses(points: list[int]) -> list[float]:
    """F at each averaging point: the mean over the 2 ranks of each rank's mean fed loss since the last
    point (for the first, since the end of the warm-up)."""
    out, last = [], ADA_W - 1
    for p in points:
        out.append(sum(sum(_fed_loss(r, it) for it in range(last + 1, p + 1)) / (p - last) for r in (0, 1)) / 2)
        last = p
    return out


def _decisions(info: dict[str, Any]) -> dict[str, Any]:
    """plan_info["local_steps"] less what each rank observes on its own (buckets not yet arrived when applied)."""
    return {k: v for k, v in info.items() if k != "waited_buckets"}


def _check_adacomm_history(info: dict[str, Any], h_min: int) -> list[int]:
    """The recorded periods follow AdaComm's rule from the recorded F values, and the points follow the
    periods; returns the points."""
    ada = info["adacomm"]
    h0, f0, hist = ada["H0"], ada["F0"], ada["history"]
    assert h_min <= h0 <= ADA_HMAX and ada["h_min"] == h_min
    points = [c["step"] for c in hist]
    assert points[0] == ADA_FIRST
    assert f0 == hist[0]["loss"]
    for c, nxt in zip(hist, [*points[1:], info["next_point"]], strict=True):
        assert c["H"] == min(h0, max(h_min, math.ceil(math.sqrt(c["loss"] / f0) * h0)))
        assert c["ratio"] == pytest.approx(c["loss"] / f0)
        assert nxt == c["step"] + c["H"]  # the next point is one period later
    assert [c["loss"] for c in hist] == pytest.approx(_expected_losses(points), rel=1e-12)
    m = ada["measured"]
    assert m["compute_s"] > 0 and m["allreduce_s"] > 0 and m["overlap_steps"] == info["overlap_iters"]
    return points


# -- tests -----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("h", [2, 4])
def test_average_without_overlap_is_torch_post_local_sgd(h: int) -> None:
    res = values(run_ranks(postlocal_worker, 2, args=(h, 2, 12)))
    for r in res:
        assert r["diff"] <= 1e-6
        assert r["moved"] > 1e-3  # the run trained: the comparison is not between two initial models
        assert r["info"]["averagings"] == (12 - 2) // h
        assert r["info"]["applied"] == r["info"]["averagings"]


@pytest.mark.slow
@pytest.mark.parametrize("w", [0, 2])
def test_diloco_without_overlap_is_the_reference(w: int) -> None:
    res = values(run_ranks(diloco_worker, 2, args=(3, w, w + 9)))
    for r in res:
        assert r["outer_steps"] == 3
        assert r["diff"] <= 1e-6
        assert r["info"]["averagings"] == 3


@pytest.mark.slow
def test_overlap_without_local_progress_ends_where_blocking_ends() -> None:
    r0, r1 = values(run_ranks(no_progress_worker, 2))
    for r in (r0, r1):
        assert max(abs(a - b) for a, b in zip(r["True"], r["False"], strict=True)) <= 1e-6
    assert r0["True"] == r1["True"]  # averaged: the ranks' different models became one
    assert r0["True"] != _flat(_model(seed=10)).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("outer", ["average", "diloco"])
def test_overlap_applies_each_averaging_once_keeping_local_progress(outer: str) -> None:
    r0, r1 = values(run_ranks(overlap_worker, 2, args=(outer,)))
    for r in (r0, r1):
        assert r["diff"] <= 1e-6
        assert r["before_flush"]["averagings"] == 3
        assert r["before_flush"]["applied"] == 2
        assert r["before_flush"]["in_flight"] == {"index": 2, "launched_after": 13, "apply_after": 15}
        assert r["after_flush"]["applied"] == 3
        assert r["after_flush"]["in_flight"] is None
        assert r["after_flush"]["buckets_per_link"] == {"a": 3, "b": 3}
        assert r["link_stats"]["a"]["calls"] == 3 * 3 + 2  # 3 averagings x 3 buckets + 2 warm-up gradients
        assert r["link_stats"]["b"]["calls"] == 3 * 3
        assert r["link_stats"]["a"]["bytes"] - 2 * 212 * 4 == r["link_stats"]["b"]["bytes"] + 3 * 4 * 4
    assert r0["params"] == r1["params"]  # the last averaging applied with no local progress since


@pytest.mark.slow
@pytest.mark.parametrize("outer", ["average", "diloco"])
def test_checkpoint_mid_period_resumes_bit_for_bit(outer: str) -> None:
    for r in values(run_ranks(checkpoint_worker, 2, args=(outer,))):
        assert r["in_flight"] == {"index": 0, "launched_after": 5, "apply_after": 7}
        assert r["resumed_at"] == 7
        assert r["saved_run_equal"]
        assert r["equal"]
        assert r["applied"] == 2  # after steps 7 and 11; the one launched after step 13 is in flight


@pytest.mark.parametrize(("kw", "field"), [
    ({"local_steps": 4, "epsilon": 0.0}, "local_steps"),
    ({"local_steps": -1}, "local_steps"),
    ({"local_warmup_iters": -2}, "local_warmup_iters"),
    ({"local_steps": 4, "local_outer": "lookahead"}, "local_outer"),
    ({"local_steps": 4, "local_outer_lr": 0.0}, "local_outer_lr"),
    ({"local_steps": 4, "local_outer_momentum": 1.0}, "local_outer_momentum"),
    ({"local_steps": 4, "local_overlap_iters": 0}, "local_overlap_iters"),
    ({"local_steps": 4, "local_overlap_iters": 5}, "local_overlap_iters"),
    ({"local_steps": 4, "compression": "fp16"}, "compression"),
    ({"local_steps": 4, "local_period": "adaptive"}, "local_period"),
    ({"local_period": "adacomm"}, "local_period"),
    ({"local_steps": 2, "local_period": "adacomm", "local_overlap_iters": 3}, "local_overlap_iters"),
])
def test_bad_local_config_names_the_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError, match=field):
        DeftConfig(**kw)
    with pytest.raises(ContractError, match=field):
        DeftConfig.from_dict(dict(kw), "deft.toml")


def test_epsilon_zero_refusal_says_why() -> None:
    with pytest.raises(ContractError, match="epsilon = 0 promises torch DDP's exact maths"):
        DeftConfig(local_steps=2, epsilon=0.0)


def test_local_config_defaults_and_toml_types() -> None:
    assert DeftConfig().local_steps == 0  # off: the normal deft path
    cfg = DeftConfig.from_dict({"local_steps": 4, "local_outer": "diloco", "local_overlap": False,
                                "local_outer_lr": 1.0})
    assert (cfg.local_steps, cfg.local_outer, cfg.local_overlap, cfg.local_outer_lr) == (4, "diloco", False, 1.0)
    with pytest.raises(ContractError, match="local_overlap"):
        DeftConfig.from_dict({"local_steps": 4, "local_overlap": 1})
    assert DeftConfig().local_period == "fixed"
    assert DeftConfig.from_dict({"local_steps": 16, "local_period": "adacomm"}).local_period == "adacomm"


@pytest.mark.slow
@pytest.mark.parametrize(("outer", "overlap_iters"), [("average", 2), ("diloco", 0)])
def test_adacomm_ranks_agree_on_every_period_and_follow_the_rule(outer: str, overlap_iters: int) -> None:
    r0, r1 = values(run_ranks(adacomm_worker, 2, args=(outer, overlap_iters)))
    info = r0["info"]
    assert _decisions(r0["info"]) == _decisions(r1["info"])  # every point, period and measurement agreed
    assert info["period"] == "adacomm" and info["H_max"] == ADA_HMAX and info["H"] == info["adacomm"]["H"]
    points = _check_adacomm_history(info, max(1, overlap_iters))
    assert points[-1] == r0["stop"] - 1  # the last step was an averaging point
    assert info["averagings"] == len(points)
    assert info["applied"] == info["averagings"] and info["in_flight"] is None
    assert r0["params"] == r1["params"]
    periods = [c["H"] for c in info["adacomm"]["history"]]
    # rank 1's 0.3 s at the first point is the averaging's measured time, against steps of milliseconds:
    # (a - D c) / H <= 0.1 c needs H in the hundreds, so H_0 is H_max; the fed loss falls to ~1/10 by
    # step 30, so sqrt(F_l / F_0) H_0 <= 0.32 x 8 < H_0: the period must drop
    assert info["adacomm"]["H0"] == ADA_HMAX
    assert min(periods) < ADA_HMAX
    assert periods == sorted(periods, reverse=True)  # a falling loss never lengthens the period


@pytest.mark.slow
def test_adacomm_without_losses_keeps_h0_and_says_why() -> None:
    r0, r1 = values(run_ranks(adacomm_worker, 2, args=("average", 1, False)))
    assert _decisions(r0["info"]) == _decisions(r1["info"])
    ada = r0["info"]["adacomm"]
    assert ada["F0"] is None and "no loss reported" in ada["note"]
    assert {c["H"] for c in ada["history"]} == {ada["H0"]}
    assert r0["info"]["applied"] == r0["info"]["averagings"] == len(ada["history"])
    assert r0["params"] == r1["params"]


@pytest.mark.slow
def test_adacomm_checkpoint_mid_period_resumes_bit_for_bit() -> None:
    for r in values(run_ranks(adacomm_checkpoint_worker, 2)):
        at_save = r["at_save"]
        assert at_save["in_flight"] == {"index": 0, "launched_after": ADA_FIRST, "apply_after": ADA_FIRST + 2}
        assert at_save["adacomm"]["H0"] is not None
        assert _decisions(r["resumed"]) == _decisions(r["saved"])  # every later decision, H_0 from the checkpoint
        assert r["equal"]
        assert r["saved"]["applied"] >= 2


def modes_worker(rank: int, world: int) -> dict[str, Any]:
    """A local-steps wrapper beside a scheduled one: what the mode refuses, what its views say, and that
    neither loads the other's checkpoint."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import deft
    from deft.errors import DeftError

    out: dict[str, Any] = {}
    local_model, sched_model = _model(), _model()
    local = deft.DistributedDataParallel(local_model, optimizer=torch.optim.SGD(local_model.parameters(), lr=LR),
                                         config=DeftConfig(local_steps=2, local_overlap=False))
    scheduled = deft.DistributedDataParallel(sched_model, optimizer=torch.optim.SGD(sched_model.parameters(), lr=LR))
    for name, call in (("hook", lambda: local.register_comm_hook(None, default_hooks.fp16_compress_hook)),
                       ("schedule", lambda: local.schedule),
                       ("local_into_scheduled", lambda: scheduled.load_state_dict(local.state_dict())),
                       ("scheduled_into_local", lambda: local.load_state_dict(scheduled.state_dict()))):
        try:
            call()
            out[name] = None
        except (DeftError, ContractError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    x, y = _batch(rank, 0)
    out["calibrate"] = local.calibrate(lambda: nn.functional.cross_entropy(local.module(x), y))
    out["views"] = [str(local.phase), local.pending_updates, local.update_log, local.profile, local.comm_hook,
                    local.last_grad_norm, local.iteration]
    local.load_state_dict(local.state_dict())  # its own record loads
    return out


@pytest.mark.slow
def test_local_steps_mode_refusals_views_and_foreign_checkpoints() -> None:
    for r in values(run_ranks(modes_worker, 2)):
        assert "no bucket to hook" in r["hook"] and r["hook"].startswith("DeftError: register_comm_hook")
        assert r["schedule"].startswith("DeftError: schedule: local-steps mode")
        assert "deft_state.mode" in r["local_into_scheduled"]
        assert "saved in local-steps mode and this wrapper runs outside it" in r["local_into_scheduled"]
        assert "saved outside local-steps mode and this wrapper runs in it" in r["scheduled_into_local"]
        assert r["calibrate"] is None
        assert r["views"] == ["idle", [], [], None, None, None, 0]


def test_local_state_of_another_version_or_damaged_is_refused() -> None:
    from deft.runtime.local_steps import LocalSteps

    cfg = _ada_config("average", 2)
    local = LocalSteps(cfg, list(_model().parameters()), {}, rank=0, world=1)
    good = local.state_dict()
    with pytest.raises(ContractError, match=r"local_steps\.version: expected version 2, got 1"):
        local.load_state_dict({**good, "version": 1})
    with pytest.raises(ContractError, match=r"local_steps\.local_period"):
        local.load_state_dict({**good, "local_period": "fixed"})
    with pytest.raises(ContractError, match=r"local_steps\.period: a damaged"):
        local.load_state_dict({**good, "period": {**good["period"], "next_point": None}})
    with pytest.raises(ContractError, match=r"local_steps\.period: period H = 1"):
        local.load_state_dict({**good, "period": {**good["period"], "H": 1}})  # below the overlap's D = 2
    local.load_state_dict(good)
    assert local.next_point == ADA_FIRST and local.adacomm is not None and local.adacomm.h0 is None
