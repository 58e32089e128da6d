"""torch's comm hooks on deft's buckets: the same parameters as torch DDP with the same hook.

Two gloo ranks, epsilon 0, one link: the whole loop is trained under deft with
``ddp.register_comm_hook(state, hook)`` and under ``torch.nn.parallel.DistributedDataParallel`` with
the same hook; parameters must agree to 1e-5 relative. fp16/bf16 compression casts element by
element, so deft's buckets need not be DDP's. PowerSGD keeps per-bucket state and draws its random
start per bucket, so both runs use one bucket holding every parameter (deft: a schedule file; DDP:
the model fits its first 1 MB bucket) and the same seed. A hook that returns something else than a
Future, or whose future fails, stops training with an error naming the bucket and the link, with no
update applied.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from deft.schedule import CommTask, Schedule, StagePlan, Update
from tests._dist import run_ranks, train_steps, values

STEPS = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 4))


def batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(97 * t + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


def one_bucket_schedule(path: str) -> None:
    n = sum(p.numel() for p in make_model().parameters())
    Schedule(cycle=1, links=("primary",), bucket_numel=(n,), bucket_nbytes=(4 * n,),
             stages=(StagePlan(0, "forward"), StagePlan(0, "backward", (CommTask(0, 0, "primary"),))),
             updates=(Update((0,), 0),)).save(path)


def bf16_reference_hook(state, bucket):  # type: ignore[no-untyped-def]  # torch DDP rejects other annotations
    """torch's bf16 hook under another name: torch DDP refuses ``bf16_compress_hook`` by name without
    CUDA and NCCL, but the maths (cast to bf16 / world, all-reduce, cast back) runs anywhere."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, state, bucket)


def make_hook(name: str, reference: bool = False) -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, bf16_reference_hook if reference else default_hooks.bf16_compress_hook
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                        use_error_feedback=True, warm_start=True, random_seed=7)
    return state, powerSGD_hook.powerSGD_hook if name == "powersgd" else powerSGD_hook.batched_powerSGD_hook


def train(model: nn.Module, wrapped: nn.Module, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for t in range(STEPS):
        x, y = batch(rank, t)
        nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()


def parity_worker(rank: int, world: int, name: str, schedule_path: str) -> dict[str, Any]:
    import deft

    ours = make_model()
    cfg: dict[str, Any] = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "timeout_s": 30}
    if name in ("powersgd", "batched_powersgd"):
        cfg["schedule_path"] = schedule_path
    ddp = deft.DistributedDataParallel(ours, config=cfg)
    ddp.register_comm_hook(*make_hook(name))
    train(ours, ddp, rank)
    ddp.flush()

    ref = make_model()
    tddp = nn.parallel.DistributedDataParallel(ref)
    tddp.register_comm_hook(*make_hook(name, reference=True))
    train(ref, tddp, rank)
    worst = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    moved = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), make_model().parameters(), strict=True))
    return {"worst": worst, "moved": moved, "params": [p.sum().item() for p in ours.parameters()]}


@pytest.mark.slow
# torch 2.13's batched_powerSGD_hook fails by itself (its _orthogonalize asserts a 3-D batch, the
# batched hook passes a 2-D matrix), under torch DDP as under deft: not comparable here.
@pytest.mark.parametrize("name", ["fp16", "bf16", "powersgd"])
def test_torch_hooks_match_torch_ddp(name: str, tmp_path: Path) -> None:
    path = str(tmp_path / "one_bucket.json")
    one_bucket_schedule(path)
    a, b = values(run_ranks(parity_worker, 2, (name, path), timeout=120))
    assert a["worst"] < 1e-5 and b["worst"] < 1e-5, (a["worst"], b["worst"])
    assert a["moved"] > 1e-3  # training really moved the parameters
    assert a["params"] == b["params"]


def _returns_tensor(state: Any, bucket: Any) -> Any:
    return bucket.buffer()


def _fails(state: Any, bucket: Any) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_exception(RuntimeError("codec exploded"))
    return fut


def bad_hook_worker(rank: int, world: int, kind: str) -> dict[str, Any]:
    import deft

    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = deft.DistributedDataParallel(model, config={"warmup_iters": 1, "timeout_s": 20})
    ddp.register_comm_hook(None, _returns_tensor if kind == "tensor" else _fails)
    error = None
    try:
        x, y = batch(rank, 0)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    except deft.DeftError as e:
        error = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return {"error": error, "unchanged": unchanged}


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "says"), [("tensor", "returned Tensor"), ("fails", "codec exploded")])
def test_bad_hooks_fail_clearly_and_apply_nothing(kind: str, says: str) -> None:
    for v in values(run_ranks(bad_hook_worker, 2, (kind,), timeout=60)):
        assert v["error"] is not None and says in v["error"], v["error"]
        assert "bucket 0" in v["error"] and "'primary'" in v["error"]
        assert v["unchanged"]


def _fails_alone_on_rank_1(state: Any, bucket: Any) -> Any:
    """An averaging hook that raises on rank 1 when its group has one rank (deft's codec timing)."""
    if dist.get_rank() == 1 and state.size() == 1:
        raise ValueError("needs a peer")
    buf = bucket.buffer().div_(state.size())
    return dist.all_reduce(buf, group=state, async_op=True).get_future().then(lambda f: f.value()[0])


def codec_timing_failure_worker(rank: int, world: int) -> str | None:
    import deft

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = deft.DistributedDataParallel(model, config={"warmup_iters": 1, "profile_iters": 2, "timeout_s": 20})
    ddp.register_comm_hook(None, _fails_alone_on_rank_1)
    try:
        for t in range(4):
            x, y = batch(rank, t)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    except deft.DeftError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_hook_failing_in_codec_timing_names_hook_rank_and_bucket_on_every_rank() -> None:
    a, b = values(run_ranks(codec_timing_failure_worker, 2, (), timeout=60))
    head = "comm hook '_fails_alone_on_rank_1' failed while deft timed its codec on a one-rank group"
    assert a is not None and a.startswith(head) and "on a rank other than 0" in a, a
    assert b is not None and b.startswith(head + " on rank 1: RuntimeError: bucket ") and "needs a peer" in b, b


def late_hook_worker(rank: int, world: int) -> str | None:
    import deft

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = deft.DistributedDataParallel(model, config={"warmup_iters": 1, "profile_iters": 3, "timeout_s": 20})
    for t in range(2):  # iteration 0 warms up, iteration 1 is the first profiled one (no hook)
        x, y = batch(rank, t)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    try:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    except deft.DeftError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_hook_registered_after_profiling_began_is_refused() -> None:
    for said in values(run_ranks(late_hook_worker, 2, (), timeout=60)):
        assert said is not None and "profiling began at iteration 1" in said, said


def in_place_worker(rank: int, world: int) -> dict[str, Any]:
    """torch's hooks that deft hands its own buffer (codecs.hooks.IN_PLACE_HOOKS): where each leaves its result."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from deft.runtime.codecs.hooks import CAST_HOOKS, IN_PLACE_HOOKS, CommHook, HookBucket, hook_result
    from deft.runtime.codecs.int8 import Int8State, int8_compress_hook

    model = make_model()
    params = list(model.parameters())
    out: dict[str, Any] = {}
    for hook in IN_PLACE_HOOKS:
        state: Any = None if hook is not powerSGD_hook.powerSGD_hook else powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=7)
        if state is not None:
            state.iter = 2  # on the compressed path
        if hook is int8_compress_hook:
            state = Int8State()
        n = sum(p.numel() for p in params)
        buffer = torch.full((n,), float(rank + 1))
        grads, offset = [], 0
        for p in params:
            grads.append(buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        ch = CommHook(state, hook, hook.__name__)
        result = hook_result(ch.launch(dist.group.WORLD, HookBucket(0, buffer, grads, params, is_last=True)).wait())
        if hook in CAST_HOOKS:  # the copy back is the executor's, where it takes the result
            out[hook.__name__] = {"in_place": ch.in_place, "buffer_untouched": buffer.eq(rank + 1).all().item(),
                                  "numel": result.numel() == n, "mean": result.float().mean().item()}
            continue
        out[hook.__name__] = {"in_place": ch.in_place, "same": result.data_ptr() == buffer.data_ptr(),
                              "numel": buffer.numel() == n, "mean": buffer.mean().item()}
    return out


@pytest.mark.slow
def test_in_place_hooks_leave_the_average_in_deft_buffer() -> None:
    # Every rank's bucket holds rank + 1: the average over 2 ranks is 1.5 everywhere. fp16 and bf16 hold
    # 1.5 exactly; int8 sends every element as its block's largest (127 levels of it, no rounding left);
    # PowerSGD's rank-1 approximation of a constant matrix is that constant (it has rank 1),
    # and the 1-D biases go uncompressed, so its mean is 1.5 up to float rounding.
    for v in values(run_ranks(in_place_worker, 2, (), timeout=60)):
        assert set(v) == {"fp16_compress_hook", "bf16_compress_hook", "int8_compress_hook", "powerSGD_hook"}
        for name, r in v.items():
            assert r["in_place"] and r["numel"], (name, r)
            assert r["mean"] == pytest.approx(1.5, rel=1e-5), (name, r)
        for name in ("int8_compress_hook", "powerSGD_hook"):  # the result in deft's buffer itself
            assert v[name]["same"], (name, v[name])
        for name in ("fp16_compress_hook", "bf16_compress_hook"):  # cast_send: copied back where it is taken
            assert v[name]["buffer_untouched"], (name, v[name])


def cast_bits_worker(rank: int, world: int) -> dict[str, Any]:
    """torch's 16-bit hooks and cast_send on the same random bucket: the buffers they leave, as integers."""
    from deft.runtime.codecs.hooks import CAST_HOOKS, HookBucket, cast_send, hook_result

    out: dict[str, Any] = {}
    for hook, dtype in CAST_HOOKS.items():
        g = torch.Generator().manual_seed(rank)
        buffer = torch.randn(4099, generator=g) * 10 ** torch.randint(-6, 4, (4099,), generator=g)
        theirs = buffer.clone()
        hook(None, HookBucket(0, theirs, [theirs], [theirs], is_last=True)).wait()  # decompresses in place
        ours = buffer.clone()
        ours.copy_(hook_result(cast_send(dtype, dist.group.WORLD, HookBucket(0, buffer, [buffer], [buffer],
                                                                             is_last=True)).wait()))
        out[hook.__name__] = {"theirs": theirs.view(torch.int32).tolist(), "ours": ours.view(torch.int32).tolist(),
                              "moved": not torch.equal(theirs, buffer)}
    return out


@pytest.mark.slow
def test_cast_send_leaves_the_bits_of_torchs_16_bit_hooks() -> None:
    for v in values(run_ranks(cast_bits_worker, 2, (), timeout=60)):
        for name, r in v.items():
            assert r["moved"], name  # the hook averaged the ranks' different buckets
            assert r["ours"] == r["theirs"], name


def warmup_layout_worker(rank: int, world: int, compression: str, cap_mb: float | None = None) -> list[int]:
    """The profile's buckets (the warm-up layout) of a 1.6 MB MLP under ``compression`` (``cap_mb``: torch
    DDP's ``bucket_cap_mb`` argument)."""
    import deft

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 600), nn.ReLU(), nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 10))
    ddp = deft.DistributedDataParallel(model, config={
        "compression": compression, "powersgd_start_iter": 2, "warmup_iters": 1, "profile_iters": 2,
        "timeout_s": 30, "epsilon": 0.0}, bucket_cap_mb=cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_steps(ddp, opt, rank, iters=6, batch=8)
    ddp.flush()
    assert ddp.profile is not None
    return [b.numel for b in ddp.profile.buckets]


@pytest.mark.slow
def test_chained_hooks_warm_up_and_profile_on_torch_sized_buckets() -> None:
    # Ready order: layer 3 (6000 + 10), layer 2 (360000 + 600), layer 1 (38400 + 600) elements, float32.
    # torch DDP's first bucket holds up to 1 MB: 6010 + 600 (bias 2) = 6610; weight 2 (1.44 MB) opens the
    # next. fp16 (not chained): 1 MB buckets from there: [360000] alone (it exceeds the cap), then
    # 600 + 38400 = 39000. PowerSGD (chained): bucket_cap_mb = 25 MB: 360000 + 600 + 38400 = 399000.
    fp16 = values(run_ranks(warmup_layout_worker, 2, ("fp16",), timeout=120))
    psgd = values(run_ranks(warmup_layout_worker, 2, ("powersgd",), timeout=120))
    assert fp16[0] == fp16[1] == [6610, 360000, 39000]
    assert psgd[0] == psgd[1] == [6610, 399000]
    # bucket_cap_mb given to the constructor caps the first bucket too (torch 2.13): one bucket of all
    # 6010 + 600 + 360000 + 600 + 38400 = 405610 elements, as torch DDP(bucket_cap_mb=25) has.
    given = values(run_ranks(warmup_layout_worker, 2, ("powersgd", 25.0), timeout=120))
    assert given[0] == given[1] == [405610]


def _rng_around_codec_timing(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from deft.config import DeftConfig
    from deft.runtime.codecs.hooks import HookBucket, from_config
    from deft.runtime.codecs.timing import time_hook

    hook = from_config(DeftConfig(compression="powersgd", powersgd_rank=2))
    assert hook is not None
    param = torch.zeros(64, 32)
    buffer = torch.randn(64 * 32, generator=torch.Generator().manual_seed(1))
    bucket = HookBucket(0, buffer, [buffer.view(64, 32)], [param], is_last=True)
    torch.manual_seed(7)
    without = torch.rand(6).tolist()
    torch.manual_seed(7)
    seconds = time_hook(hook, dist.group.WORLD, [bucket])
    after = torch.rand(6).tolist()
    st = hook.state
    return {"without": without, "after": after, "timed": seconds is not None and len(seconds) == 1,
            "iter": st.iter, "memories": len(st.p_memory_dict) + len(st.q_memory_dict) + len(st.error_dict)}


@pytest.mark.slow
def test_codec_timing_leaves_the_global_rng_and_the_hook_state_alone() -> None:
    """PowerSGD reseeds torch's generator to draw its first Q; the codec timing runs on a scratch state
    and must not move the training's random stream (dropout, shuffling) nor the registered state."""
    (res,) = run_ranks(_rng_around_codec_timing, world=1, timeout=120)
    assert res.ok, res.error
    v = res.value
    assert v["timed"]
    assert v["after"] == v["without"]
    assert v["iter"] == 0 and v["memories"] == 0


def _codec_timing_of_buckets_alike(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from deft.runtime.codecs.hooks import CommHook, HookBucket
    from deft.runtime.codecs.timing import time_hook

    calls: list[int] = []

    def counting(state: object, bucket: Any) -> Any:
        calls.append(bucket.index())
        return default_hooks.fp16_compress_hook(state, bucket)  # type: ignore[arg-type]

    def bucket(index: int, shapes: list[tuple[int, ...]], is_last: bool = False) -> HookBucket:
        numel = sum(math.prod(s) for s in shapes)
        buf = torch.randn(numel, generator=torch.Generator().manual_seed(index))
        grads, at = [], 0
        for s in shapes:
            grads.append(buf[at:at + math.prod(s)].view(s))
            at += math.prod(s)
        return HookBucket(index, buf, grads, [torch.zeros(s) for s in shapes], is_last=is_last)

    # Buckets 0, 1 and 3 are alike (a repeated block); 2 holds the same elements in other shapes, 4 is last.
    block = [(64, 32), (32,)]
    buckets = [bucket(0, block), bucket(1, block), bucket(2, [(32, 64), (32,)]), bucket(3, block),
               bucket(4, block, is_last=True)]
    seconds = time_hook(CommHook(None, counting, "counting"), dist.group.WORLD, buckets, repeats=3)
    return {"calls": calls, "seconds": seconds}


@pytest.mark.slow
def test_codec_timing_runs_the_hook_once_per_class_of_buckets_alike() -> None:
    """A codec's compute depends on the gradients' shapes, not their values: buckets alike share one
    timing (1 untimed + 3 timed runs of the first of them) and buckets that differ are timed apart."""
    (res,) = run_ranks(_codec_timing_of_buckets_alike, world=1, timeout=120)
    assert res.ok, res.error
    calls, seconds = res.value["calls"], res.value["seconds"]
    assert calls == [0] * 4 + [2] * 4 + [4] * 4
    assert len(seconds) == 5 and seconds[0] == seconds[1] == seconds[3] > 0
    assert seconds[2] > 0 and seconds[4] > 0
