"""deft's 8-bit codec (``deft.runtime.codecs.int8``; public: ``deft.runtime.int8_hook``): unbiased,
within its error bound, the same on every rank.

Two gloo ranks call the hook directly on heavy-tailed gradients whose exact average the test computes
with a plain all-reduce; the block scales of the bound are recomputed here from the gathered
gradients (``max |g| / 127`` per 256 elements), not read from the hook.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from deft.config import DeftConfig
from deft.runtime.codecs.hooks import HookBucket, codec_hook, from_config
from deft.runtime.codecs.wire import int8_nbytes, wire_nbytes
from deft.runtime.int8_hook import Int8State, int8_compress_hook  # the public path (README)
from deft.schedule import CommTask, Schedule, StagePlan, Update
from tests._dist import amp_steps, next_send_ends_while_python_holds_the_gil, run_ranks, train_steps, values

N = 1000  # not a multiple of the 256-element block: the last block is padded
DRAWS = 300


def gradient(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(N, generator=g) * torch.rand(N, generator=g).pow(4) * 3  # heavy-tailed
    x[100:356] = 0.0 if rank == 0 else x[100:356]  # a block zero on one rank only
    x[600:700] = 0.0  # zero on every rank
    return x


def call(state: Int8State, x: torch.Tensor) -> torch.Tensor:
    buf = x.clone()
    return int8_compress_hook(state, HookBucket(0, buf, [buf], [buf], True)).wait().clone()


def properties_worker(rank: int, world: int) -> dict[str, Any]:
    g = gradient(rank)
    exact = g.clone()
    dist.all_reduce(exact)
    exact /= world
    everyone = [torch.empty(N) for _ in range(world)]
    dist.all_gather(everyone, g)
    # per element: the sum over ranks of its block's scale, and of its square (blocks of 256)
    scale_sum, scale_sq = torch.zeros(N), torch.zeros(N)
    for gr in everyone:
        for lo in range(0, N, 256):
            s = gr[lo:lo + 256].abs().max() / 127
            scale_sum[lo:lo + 256] += s
            scale_sq[lo:lo + 256] += s * s
    var_bound = scale_sq / (4 * world * world)  # per element, sum over ranks of s²/4, over R²
    state = Int8State(seed=3)
    errors = torch.stack([call(state, g) - exact for _ in range(DRAWS)])
    worst = float(((errors.abs().max(0).values - scale_sum / world) / exact.abs().clamp_min(1e-3)).max())
    mean_err = errors.mean(0)
    live = var_bound > 0
    z = float((mean_err[live].square() / (var_bound[live] / DRAWS)).sum()) / int(live.sum())
    last = call(state, g)
    agree = [torch.empty(N) for _ in range(world)]
    dist.all_gather(agree, last)
    # a checkpointed generator draws on as the uninterrupted one
    saved = state.state_dict()
    nxt = call(state, g)
    resumed = Int8State(seed=99)
    resumed.load_state_dict(saved)
    # an fp16 overflow on rank 0 only: its block is non-finite on every rank, the others finite
    bad = g.clone()
    if rank == 0:
        bad[300] = math.inf
    out_bad = call(Int8State(), bad)
    return {
        "wire": wire_nbytes(codec_hook("int8"), [(10, 100)], 4),  # the run's world: 2 ranks
        "worst_over_bound": worst,
        "z": z,
        "sq_err": float(errors.square().sum(1).mean()),
        "sq_bound": float(var_bound.sum()),
        "zero_blocks_exact": float(errors[:, 600:700].abs().max()),
        "agree": bool(torch.equal(agree[0], agree[1])),
        "resumed_equal": bool(torch.equal(call(resumed, g), nxt)),
        "nonfinite": [int((~torch.isfinite(out_bad[lo:lo + 256])).sum()) for lo in range(0, N, 256)],
    }


@pytest.mark.slow
def test_int8_hook_is_unbiased_within_its_bound_and_the_same_on_every_rank() -> None:
    a, b = values(run_ranks(properties_worker, 2, timeout=120))
    for r in (a, b):
        assert r["worst_over_bound"] <= 1e-6  # |e_i| <= (1/R) sum_r s_r per element, every draw
        assert r["z"] < 1.5  # mean error within its standard error: unbiased (rounding to nearest fails it)
        assert r["sq_err"] <= 1.1 * r["sq_bound"]  # E|e|² within the preserver's bound
        assert r["sq_err"] > 0.2 * r["sq_bound"]  # and the bound is not vacuous here
        assert r["zero_blocks_exact"] == 0.0
        assert r["agree"] and r["resumed_equal"]
        assert r["wire"] == 1040
        assert r["nonfinite"] == [0, 256, 0, 0]  # elements 256..511 (element 300's block): NaN on both ranks


def test_wire_bytes_are_the_all_reduce_that_costs_as_much_as_the_all_gather() -> None:
    # 1000 elements: 4 blocks of 256 (1024 bytes) and 4 float32 scales (16 bytes) per rank; a ring
    # all-gather over 2 ranks sends 1040 bytes per rank, as a ring all-reduce of 1040 bytes does; over 4
    # ranks 3 x 1040, as an all-reduce of 2080 bytes (2 x 3/4 x 2080); on gloo the scatter path sends
    # 2 x 3 chunks of one block (260 bytes), as an all-reduce of 1040 bytes does
    assert int8_nbytes(1000, 2) == 1040
    assert int8_nbytes(1000, 4, scatter_ok=False) == 2080
    assert int8_nbytes(1000, 4) == 1040
    config_hook = from_config(DeftConfig(compression="int8"))
    assert config_hook is not None and config_hook.name == "int8" and not config_hook.chained


def one_bucket_schedule(tmp_path: Path) -> str:
    """A schedule file sending the 64 x 40 weight (2560 elements) as one bucket, after the backward."""
    path = str(tmp_path / "one_bucket.json")
    Schedule(cycle=1, links=("primary",), bucket_numel=(2560,), bucket_nbytes=(4 * 2560,),
             stages=(StagePlan(0, "forward"), StagePlan(0, "backward", (CommTask(0, 0, "primary"),))),
             updates=(Update((0,), 0),)).save(path)
    return path


def parity_worker(rank: int, world: int, schedule_path: str) -> dict[str, Any]:
    """deft with ``compression = "int8"`` against torch DDP with ``int8_compress_hook`` (seed 0, as the
    knob's state). One weight, one bucket: torch DDP's first iteration buckets in the parameters' order
    and later ones in ready order, which differ for several tensors and would round other blocks."""
    import deft

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(64, 40, bias=False)

    def train(model: nn.Module, wrapped: nn.Module) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return train_steps(wrapped, opt, rank, 8, batch=16, features=64, classes=40)

    ours = make()
    ddp = deft.DistributedDataParallel(ours, config={"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2,
                                                     "timeout_s": 30, "compression": "int8",
                                                     "schedule_path": schedule_path})
    ours_losses = train(ours, ddp)
    ddp.flush()
    ref = make()
    tddp = nn.parallel.DistributedDataParallel(ref)
    tddp.register_comm_hook(Int8State(seed=0), int8_compress_hook)
    ref_losses = train(ref, tddp)
    return {"worst": float((ours.weight - ref.weight).abs().max() / ref.weight.abs().max()),
            "moved": float((ours.weight - make().weight).abs().max()), "losses": [ours_losses, ref_losses]}


@pytest.mark.slow
def test_compression_int8_equals_torch_ddp_with_the_int8_hook(tmp_path: Path) -> None:
    path = one_bucket_schedule(tmp_path)
    a, b = values(run_ranks(parity_worker, 2, (path,), timeout=120))
    for r in (a, b):
        assert r["worst"] < 1e-5 and r["moved"] > 1e-3
        assert r["losses"][0] == pytest.approx(r["losses"][1], rel=1e-5)


AMP_STEPS, INF_AT = 12, 5


def amp_parity_worker(rank: int, world: int, schedule_path: str) -> dict[str, Any]:
    """torch's documented AMP loop (autocast, GradScaler, ``unscale_``, gradient clipping, the grad norm
    read) with ``compression = "int8"`` against torch DDP + ``int8_compress_hook``; rank 0's loss is
    infinite at one step: the int8 average is NaN there on every rank, and both scalers skip it."""
    import deft

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(64, 40, bias=False)

    def train(model: nn.Module, wrapped: nn.Module) -> tuple[float, list[float]]:
        return amp_steps(model, wrapped, rank, AMP_STEPS, INF_AT, batch=16, features=64, classes=40)

    ours = make()
    ddp = deft.DistributedDataParallel(ours, config={"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2,
                                                     "timeout_s": 30, "compression": "int8",
                                                     "schedule_path": schedule_path})
    scale, norms = train(ours, ddp)
    ddp.flush()
    ref = make()
    tddp = nn.parallel.DistributedDataParallel(ref)
    tddp.register_comm_hook(Int8State(seed=0), int8_compress_hook)
    ref_scale, ref_norms = train(ref, tddp)
    return {"worst": float((ours.weight - ref.weight).abs().max() / ref.weight.abs().max()),
            "scale": scale, "ref_scale": ref_scale, "norms": norms, "ref_norms": ref_norms,
            "log": [list(i) for _, i in ddp.update_log]}


@pytest.mark.slow
def test_int8_under_torchs_amp_loop_equals_torch_ddp_and_skips_the_overflow(tmp_path: Path) -> None:
    path = one_bucket_schedule(tmp_path)
    for r in values(run_ranks(amp_parity_worker, 2, (path,), timeout=120)):
        assert r["worst"] < 1e-5, r["worst"]
        # 1024 doubles after 4 good steps (2048 after step 3), halves at the inf (1024), then 2048 after
        # step 9: the same in both
        assert r["scale"] == r["ref_scale"] == 2048.0
        assert not math.isfinite(r["norms"][INF_AT]) and not math.isfinite(r["ref_norms"][INF_AT])
        finite = [i for i in range(AMP_STEPS) if i != INF_AT]
        assert [r["norms"][i] for i in finite] == pytest.approx([r["ref_norms"][i] for i in finite], rel=1e-5)
        assert r["log"] == [[t] for t in range(AMP_STEPS) if t != INF_AT]  # the inf step skipped, only it


class _FailedWork:
    """What a collective on a lost link gives back: a wait that raises, a future that completes with the
    error."""

    def wait(self, timeout: object = None) -> bool:
        raise RuntimeError("injected: the link's all-gather failed")

    def get_future(self) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_exception(RuntimeError("injected: the link's all-gather failed"))
        return fut


def pieces_worker(rank: int, world: int) -> dict[str, Any]:
    from deft.runtime.codecs import int8

    n = 3 * int8.GATHER_PIECE // 2  # a payload of 1.5 pieces and its scales: two pieces
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
    state = Int8State(seed=9)
    real, sizes = dist.all_gather, []

    def counted(outs: list[torch.Tensor], inp: torch.Tensor, **kwargs: Any) -> Any:
        sizes.append(inp.numel())
        return real(outs, inp, **kwargs)

    dist.all_gather = counted  # type: ignore[assignment]
    try:
        got = call(state, x)
    finally:
        dist.all_gather = real
    # the maths, whole: every rank's payload of the first call's draws, all-gathered at once, decoded
    payload = int8.encode(x, state.generator(0, rank, torch.device("cpu")))
    everyone = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(everyone, payload)
    dist.all_gather = lambda *a, **k: _FailedWork()  # type: ignore[assignment]
    try:
        call(state, x)
        failed = ""
    except RuntimeError as e:
        failed = str(e)
    finally:
        dist.all_gather = real
    return {"sizes": sizes, "payload": payload.numel(), "equal": bool(torch.equal(got, int8.decode(everyone, n))),
            "failed": failed}


@pytest.mark.slow
def test_a_payload_gathered_in_pieces_decodes_as_gathered_whole_and_a_failed_piece_fails_the_bucket() -> None:
    for r in values(run_ranks(pieces_worker, 2, timeout=120)):
        # two all-gathers of half the payload each (1.5 pieces' worth: two equal pieces), decoded as one
        assert r["sizes"] == [r["payload"] // 2] * 2 and r["equal"], r
        # a piece whose all-gather failed (a lost link) fails the bucket's future, not decoded as sent
        assert "injected" in r["failed"], r


def held_link_worker(rank: int, world: int) -> dict[str, Any]:
    """The hook's gather on a serial link (one gloo thread), then the link's next send while the main
    thread runs pure Python, holding the GIL (a switch interval longer than the loop): the next send
    completes during the loop, the hook's decode waiting for the GIL off gloo's thread (a decode in a
    callback on the gather's future, or the gather's future taken at all, would hold the link's only
    thread: tests/test_completions.py keeps those broken variants)."""
    from deft.runtime.link_queue import serial_gloo_group

    link = serial_gloo_group(None, 60.0, None)
    state = Int8State(process_group=link)
    dist.barrier(group=link)
    buf = gradient(rank)
    fut = int8_compress_hook(state, HookBucket(0, buf, [buf], [buf], True))
    during = next_send_ends_while_python_holds_the_gil(link)
    average = fut.wait()
    dist.barrier()
    return {"during": during, "average": average.tolist()}


@pytest.mark.slow
def test_the_hooks_decode_does_not_hold_its_link_while_python_runs() -> None:
    results = values(run_ranks(held_link_worker, 2, timeout=60))
    assert all(r["during"] for r in results), results
    assert results[0]["average"] == results[1]["average"]
