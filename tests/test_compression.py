"""Compression in the profile, the simulator and the CLI.

Expected numbers are derived by hand in the comments: the hook's wire sizes from torch's PowerSGD
rule (``(n + m) r`` elements for an ``n x m`` matrix when ``(n + m) r * 2 < n m``), and the simulated
timelines from the event order the simulator's docstring states.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from deft.cli import main
from deft.config import DeftConfig
from deft.errors import ContractError
from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.runtime.codecs.hooks import CommHook, plain_iterations
from deft.runtime.codecs.powersgd_memory import forget_buckets
from deft.runtime.codecs.wire import wire_nbytes
from deft.schedule import CommTask, Schedule, StagePlan, Update
from deft.solver.partition import partition
from deft.solver.simulate import simulate_baseline, simulate_schedule
from tests._dist import run_ranks, train_steps, values

# The MLP of the 2-rank test: Linear(64, 256), Linear(256, 256), Linear(256, 10), weights and biases.
MLP_SHAPES = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]


def powersgd(rank: int, start: int = 2) -> CommHook:
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=start, use_error_feedback=True, warm_start=True)
    return CommHook(state, powerSGD_hook.powerSGD_hook, "powersgd")


# -- wire sizes ---------------------------------------------------------------------------------------
def test_fp16_and_bf16_send_two_bytes_per_element() -> None:
    # 256*64 + 256 + 256*256 + 256 + 10*256 + 10 = 16384 + 256 + 65536 + 256 + 2560 + 10 = 85002 elements
    assert wire_nbytes(CommHook(None, default_hooks.fp16_compress_hook, "fp16"), MLP_SHAPES, 4) == 2 * 85002
    assert wire_nbytes(CommHook(None, default_hooks.bf16_compress_hook, "bf16"), MLP_SHAPES, 4) == 2 * 85002


def test_powersgd_wire_size_by_hand() -> None:
    # rank 4: 256x64 -> (256+64)*4 = 1280 (1280*2 < 16384: compressed); bias 256 as 256x1 -> r = 1,
    # (256+1)*1*2 = 514 > 256: sent whole; 256x256 -> 512*4 = 2048; 10x256 -> r = 4, 266*4 = 1064
    # (2128 < 2560); bias 10 whole. 1280 + 256 + 2048 + 256 + 1064 + 10 = 4914 elements of 4 bytes.
    assert wire_nbytes(powersgd(4), MLP_SHAPES, 4) == 4914 * 4
    # rank 32: 256x64 -> 320*32 = 10240, 10240*2 = 20480 > 16384: whole (16384); 256x256 -> 512*32 = 16384,
    # 32768 < 65536: compressed; 10x256 -> r = min(10, 256, 32) = 10, 2660*2 > 2560: whole.
    assert wire_nbytes(powersgd(32), MLP_SHAPES, 4) == (16384 + 256 + 16384 + 256 + 2560 + 10) * 4


def test_batched_powersgd_pads_to_a_square() -> None:
    hook = CommHook(powersgd(2).state, powerSGD_hook.batched_powerSGD_hook, "batched")
    # 85002 elements -> side ceil(sqrt(85002)) = 292 (291^2 = 84681 < 85002 <= 85264); P and Q 292x2 each
    assert wire_nbytes(hook, MLP_SHAPES, 4) == 2 * 292 * 2 * 4


def counted_worker(rank: int, world: int, name: str) -> list[int]:
    """Bytes of every all-reduce torch's hook really issues for one bucket of MLP_SHAPES (one rank)."""
    import torch.distributed as dist

    from deft.runtime.codecs.hooks import HookBucket

    sizes: list[int] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]  # this spawned process only
    flat = torch.randn(85002)
    grads, at = [], 0
    for sh in MLP_SHAPES:
        grads.append(flat[at:at + math.prod(sh)].view(sh))
        at += math.prod(sh)
    bucket = HookBucket(0, flat, grads, [torch.nn.Parameter(g.clone()) for g in grads], is_last=True)
    if name == "fp16":
        default_hooks.fp16_compress_hook(None, bucket).wait()
    else:
        hook = powersgd(4)
        hook.state.iter = hook.state.start_powerSGD_iter  # the compressed path
        powerSGD_hook.powerSGD_hook(hook.state, bucket).wait()
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp16", "powersgd"])
def test_wire_size_is_what_torchs_hook_all_reduces(name: str) -> None:
    """A second method: count the bytes of the all-reduces torch's own hook issues (one rank)."""
    [sizes] = values(run_ranks(counted_worker, 1, (name,), timeout=60))
    hook = CommHook(None, default_hooks.fp16_compress_hook, "fp16") if name == "fp16" else powersgd(4)
    assert sum(sizes) == wire_nbytes(hook, MLP_SHAPES, 4)
    if name == "powersgd":  # uncompressed tensors (the biases), then P, then Q
        assert sizes == [(256 + 256 + 10) * 4, (256 + 256 + 10) * 4 * 4, (64 + 256 + 256) * 4 * 4]


def test_unknown_hook_has_no_wire_size() -> None:
    def my_hook(state: Any, bucket: Any) -> Any:
        raise AssertionError("not called")

    assert wire_nbytes(CommHook(None, my_hook, "my_hook"), MLP_SHAPES, 4) is None


def test_powersgd_plain_iterations_and_forgetting() -> None:
    hook = powersgd(4, start=7)
    assert plain_iterations(hook) == 7
    hook.state.iter = 5
    assert plain_iterations(hook) == 2
    assert plain_iterations(CommHook(None, default_hooks.fp16_compress_hook, "fp16")) == 0
    hook.state.error_dict[0] = torch.zeros(3)
    hook.state.p_memory_dict[0] = torch.zeros(3)
    forget_buckets(hook)
    assert hook.state.error_dict == {} and hook.state.p_memory_dict == {}


# -- the contract -------------------------------------------------------------------------------------
def compressed_profile(codec: str = "fp16") -> Profile:
    """Two buckets on one link (alpha 0, 1 s per MB); times in seconds, easy to add by hand."""
    buckets = (Bucket(0, ("a",), 1000, 4000, wire_nbytes=2000), Bucket(1, ("b",), 500, 2000, wire_nbytes=1000))
    times = (BucketTimes(1.0, 2.0, {"primary": 3.0}, codec_s=0.5),
             BucketTimes(1.0, 1.0, {"primary": 1.0}, codec_s=0.25))
    return Profile(buckets, times, (Link("primary", "gloo", None, 0.0, 1e-6),), 2, "synthetic", codec=codec)


def test_json_round_trip_keeps_compression(tmp_path: Path) -> None:
    prof = compressed_profile()
    path = tmp_path / "p.json"
    prof.save(path)
    doc = json.loads(path.read_text())
    assert doc["schema"] == 2 and doc["codec"] == "fp16"
    assert [b["wire_nbytes"] for b in doc["buckets"]] == [2000, 1000]
    back = Profile.load(path)
    assert back == prof
    assert [b.wire for b in back.buckets] == [2000, 1000] and back.codec_time(1) == 0.25


def test_uncompressed_profile_stays_schema_1(tmp_path: Path) -> None:
    prof = Profile((Bucket(0, ("a",), 10, 40),), (BucketTimes(1.0, 1.0, {"primary": 1.0}),),
                   (Link("primary", "gloo"),), 2, "synthetic")
    doc = prof.to_dict()
    assert doc["schema"] == 1 and "codec" not in doc and "wire_nbytes" not in doc["buckets"][0]
    assert prof.buckets[0].wire == 40


@pytest.mark.parametrize(("edit", "field", "says"), [
    (lambda d: d["buckets"][0].__setitem__("wire_nbytes", -5), "buckets[0].wire_nbytes", ">= 0"),
    (lambda d: d["buckets"][1].pop("wire_nbytes"), "buckets[1].wire_nbytes", "missing"),
    (lambda d: d["buckets"][0].__setitem__("codec_s", "fast"), "buckets[0].codec_s", "finite number"),
    (lambda d: d.__setitem__("codec", ""), "codec", "non-empty"),
    (lambda d: d.__setitem__("schema", 1), "codec", "schema 2"),
    (lambda d: d.__setitem__("schema", 3), "schema", "file has 3"),
])
def test_bad_compression_fields_name_file_and_field(tmp_path: Path, edit: Any, field: str, says: str) -> None:
    doc = compressed_profile().to_dict()
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ContractError) as err:
        Profile.load(path)
    assert str(path) in str(err.value) and field in str(err.value) and says in str(err.value)


def test_compression_fields_without_codec_are_refused() -> None:
    with pytest.raises(ContractError, match=r"buckets\[0\]\.wire_nbytes.*codec"):
        Profile((Bucket(0, ("a",), 10, 40, wire_nbytes=20),), (BucketTimes(1.0, 1.0, {"primary": 1.0}),),
                (Link("primary", "gloo"),), 2, "synthetic")
    doc = compressed_profile().to_dict()
    doc["schema"], doc["codec"] = 1, None
    del doc["codec"]
    with pytest.raises(ContractError, match=r"buckets\[0\]\.wire_nbytes"):
        Profile.from_dict(doc, "x.json")


def test_unmeasured_link_uses_wire_bytes() -> None:
    prof = compressed_profile()
    two = Profile(prof.buckets, prof.times, (*prof.links, Link("second", "gloo", None, 0.5, 1e-3)), 2, "synthetic",
                  codec="fp16")
    assert two.comm_time(0, "second") == pytest.approx(0.5 + 1e-3 * 2000)  # wire 2000 B, not nbytes 4000


def test_partition_keeps_wire_and_codec_totals() -> None:
    prof = compressed_profile()
    parted = partition(prof, DeftConfig(partition_numel=250), capacity_s=100.0)
    assert parted.n == 6  # 1000 -> 4 pieces of 250, 500 -> 2
    assert sum(b.wire for b in parted.buckets) == 3000
    assert sum(t.codec_s for t in parted.times) == pytest.approx(0.75)
    assert parted.buckets[0].wire == 500 and parted.times[0].codec_s == pytest.approx(0.125)
    assert parted.codec == "fp16"


def test_partition_never_splits_a_tensor_under_powersgd() -> None:
    # The same profile and caps that split it into 6 pieces under fp16: under PowerSGD a piece of a
    # matrix would go uncompressed, so the 2 buckets stay whole (and too big for the cap of 250).
    prof = compressed_profile()
    psgd = Profile(prof.buckets, prof.times, prof.links, prof.world_size, prof.source, codec="powersgd (rank 4)")
    parted = partition(psgd, DeftConfig(partition_numel=250), capacity_s=100.0)
    assert [b.numel for b in parted.buckets] == [b.numel for b in prof.buckets]


# -- the simulator ------------------------------------------------------------------------------------
def test_wfbp_timeline_with_codec_by_hand() -> None:
    # One iteration from its forward start s: fwd b1 [s, s+1], fwd b0 [s+1, s+2], bwd b0 [s+2, s+4],
    # codec b0 [s+4, s+4.5], bwd b1 [s+4.5, s+5.5], codec b1 [s+5.5, s+5.75]; comm b0 [s+4.5, s+7.5],
    # comm b1 waits for the link: [s+7.5, s+8.5]; the step waits for both: next forward at s+8.5.
    res = simulate_baseline(compressed_profile(), "wfbp")
    assert res.iteration_s == pytest.approx(8.5)
    # without the codec: comm b0 [s+4, s+7], comm b1 [s+7, s+8]
    plain = compressed_profile()
    plain = Profile(tuple(Bucket(b.id, b.params, b.numel, b.nbytes) for b in plain.buckets),
                    tuple(BucketTimes(t.forward_s, t.backward_s, t.comm_s) for t in plain.times), plain.links, 2,
                    "synthetic")
    assert simulate_baseline(plain, "wfbp").iteration_s == pytest.approx(8.0)
    codecs = [e for e in res.events if e.kind == "codec" and e.iteration == 10]
    assert sorted((e.bucket, round(e.end_s - e.start_s, 9)) for e in codecs) == [(0, 0.5), (1, 0.25)]
    fwd = next(e for e in res.events if e.kind == "forward" and e.iteration == 10 and e.bucket == 1).start_s
    comm0 = next(e for e in res.events if e.row == "primary" and e.iteration == 10 and e.bucket == 0)
    assert comm0.start_s - fwd == pytest.approx(4.5)


def test_delayed_schedule_pays_codec_on_the_compute_stream() -> None:
    # Every iteration its own update: bucket 0 sent in backward (origin 0), bucket 1 in the next forward
    # (origin 1), applied at the next step.
    # Per iteration on the compute stream: codec b1 0.25 (before the forward), fwd 1 + 1, bwd b0 2,
    # codec b0 0.5, bwd b1 1 = 5.75; the link carries 3 + 1 = 4 < 5.75 and nothing waits for it in the
    # steady state (b1 of t-1 goes at s+0.25 or when b0 of t-1 ends at s+2; b0 of t ends by s+7.75, before
    # the step after t+1): 5.75 per iteration, 0.75 more than without compression's compute.
    prof = compressed_profile()
    fwd, bwd = (CommTask(1, 1, "primary"),), (CommTask(0, 0, "primary"),)
    sched = Schedule(cycle=2, links=("primary",), bucket_numel=(1000, 500), bucket_nbytes=(4000, 2000),
                     stages=(StagePlan(0, "forward", fwd), StagePlan(0, "backward", bwd),
                             StagePlan(1, "forward", fwd), StagePlan(1, "backward", bwd)),
                     updates=(Update((0,), 1), Update((1,), 2)))
    res = simulate_schedule(prof, sched)
    assert res.iteration_s == pytest.approx(5.75)
    assert res.bubble_ratio == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(("codec", "expected"), [("powersgd (rank 4)", 8.5), ("fp16", 7.5)])
def test_hooked_sends_on_two_links(codec: str, expected: float) -> None:
    # Bucket 0 on primary, bucket 1 on second, both in backward, applied at the step. Compute as in the
    # wfbp test; comm b0 [s+4.5, s+7.5]; comm b1 ready at s+5.75. PowerSGD's launches are chained: b1
    # is sent only after b0, [s+7.5, s+8.5]. fp16's are not (one collective each, no shared state):
    # b1 runs on its own link, [s+5.75, s+6.75], and the iteration ends with b0 at s+7.5.
    prof = compressed_profile()
    second = Link("second", "gloo", None, 0.0, 1e-6)
    times = tuple(BucketTimes(t.forward_s, t.backward_s, {**t.comm_s, "second": t.comm_s["primary"]}, t.codec_s)
                  for t in prof.times)
    two = Profile(prof.buckets, times, (*prof.links, second), 2, "synthetic", codec=codec)
    sched = Schedule(cycle=1, links=("primary", "second"), bucket_numel=(1000, 500), bucket_nbytes=(4000, 2000),
                     stages=(StagePlan(0, "forward"),
                             StagePlan(0, "backward", (CommTask(0, 0, "primary"), CommTask(1, 0, "second")))),
                     updates=(Update((0,), 0),))
    assert simulate_schedule(two, sched).iteration_s == pytest.approx(expected)


# -- the CLI ------------------------------------------------------------------------------------------
def test_simulate_and_plan_show_the_compression(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "comp.json"
    compressed_profile().save(path)
    for cmd in (["simulate", str(path), "--schemes", "ddp"], ["plan", str(path), "--out", str(tmp_path / "s.json")]):
        assert main(cmd) == 0
        out = capsys.readouterr().out
        # 3000 B of 6000 B: 0.5x; codec 0.75 s = 750 ms per iteration
        assert "compression fp16" in out and "(0.500x)" in out and "codec compute 750.00 ms" in out
        rows = [line.split() for line in out.splitlines() if line.startswith("  ") and len(line.split()) == 4]
        assert ["0", "4000", "2000", "500.000"] in rows and ["1", "2000", "1000", "250.000"] in rows


# -- a real run: PowerSGD profiled on its compressed path ---------------------------------------------
def powersgd_worker(rank: int, world: int) -> dict[str, Any]:
    import deft

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = deft.DistributedDataParallel(model, config={
        "compression": "powersgd", "powersgd_rank": 4, "powersgd_start_iter": 5, "warmup_iters": 1,
        "profile_iters": 3, "timeout_s": 30, "epsilon": 0.0})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_steps(ddp, opt, rank, iters=16, batch=32)
    ddp.flush()
    p = ddp.profile
    assert p is not None
    return {"codec": p.codec, "wire": sum(b.wire for b in p.buckets), "nbytes": sum(b.nbytes for b in p.buckets),
            "codec_s": [t.codec_s for t in p.times], "t0": ddp.plan_info["t0"],
            "finite": all(math.isfinite(c) for t in p.times for c in t.comm_s.values())}


@pytest.mark.slow
def test_powersgd_is_profiled_compressed() -> None:
    a, b = values(run_ranks(powersgd_worker, 2, (), timeout=120))
    assert a["codec"] == "powersgd (rank 4)"
    assert a["nbytes"] == 85002 * 4 and a["wire"] == 4914 * 4  # test_powersgd_wire_size_by_hand
    # PowerSGD compresses from iteration 5 (0-based): plain iterations 0..4, one compressed warm-up
    # iteration (5; warmup_iters = 1 counts from there), 3 profile iterations (6, 7, 8), planned from
    # iteration 9 in the background: the plan runs from the first boundary where rank 0 is done, at
    # most plan_lag_iters (6, the default) later
    assert 9 < a["t0"] <= 9 + 6 and a["t0"] == b["t0"]
    assert all(c > 0 for c in a["codec_s"]) and a["finite"]
    assert a["codec_s"] == b["codec_s"]  # max over ranks: every rank plans on the same profile


# -- PowerSGD's memory across a layout change ---------------------------------------------------------
def _powersgd_round(state: Any, layout: Any, params: list[torch.Tensor],
                    grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One iteration of torch's powerSGD_hook over every bucket of ``layout`` (one rank); per-parameter results."""
    from deft.runtime.codecs.hooks import hook_bucket

    buffers = layout.new_buffers(torch.device("cpu"))
    for i, g in enumerate(grads):
        layout.param_view(buffers, i).copy_(g.reshape(-1))
    for b in range(layout.n_buckets):
        [view] = layout.bucket_views(buffers, b)
        bucket = hook_bucket(layout, params, b, view, is_last=b == layout.n_buckets - 1)
        powerSGD_hook.powerSGD_hook(state, bucket).wait()
    return [layout.param_view(buffers, i).clone() for i in range(len(params))]


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_powersgd_memory_follows_its_elements_to_a_new_layout(one_rank_group: Any) -> None:
    """After a re-layout, carried memory makes PowerSGD compress exactly as if the buckets had not changed.

    Second method: a reference state that stays on the first layout. Per-tensor PowerSGD's maths does not
    depend on bucket boundaries once the error residual and Q follow their elements, so iteration 2 on
    the new layout must give the reference's per-parameter results; dropping the memory must not."""
    from deft.runtime.buckets import FlatLayout
    from deft.runtime.codecs.powersgd_memory import carry_buckets

    torch.manual_seed(0)
    params = [torch.zeros(sh) for sh in MLP_SHAPES]
    names = [f"p{i}" for i in range(len(params))]
    sizes = [math.prod(sh) for sh in MLP_SHAPES]
    before = FlatLayout(range(6), names, params, [sizes[0] + sizes[1], sum(sizes[2:])])
    # Another order (output side first) and other cuts, one of them alone around the 256x256 weight.
    after = FlatLayout([4, 5, 2, 3, 0, 1], names, params,
                       [sizes[4] + sizes[5], sizes[2], sizes[3] + sizes[0] + sizes[1]])

    def state() -> Any:
        return powerSGD_hook.PowerSGDState(process_group=one_rank_group, matrix_approximation_rank=2,
                                           start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                           random_seed=0)

    reference, carried, dropped = state(), state(), state()
    for st in (reference, carried, dropped):
        st.iter = st.start_powerSGD_iter  # the compressed path from the first call
    first = [torch.randn(sh) for sh in MLP_SHAPES]
    second = [torch.randn(sh) for sh in MLP_SHAPES]
    for st in (reference, carried, dropped):
        _powersgd_round(st, before, params, first)
    carry_buckets(CommHook(carried, powerSGD_hook.powerSGD_hook, "powersgd"), before, after, params)
    forget_buckets(CommHook(dropped, powerSGD_hook.powerSGD_hook, "powersgd"))
    want = _powersgd_round(reference, before, params, second)
    got = _powersgd_round(carried, after, params, second)
    lost = _powersgd_round(dropped, after, params, second)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # Rank 2 of a 256x64 gradient keeps little of it: the residual fed back is large, so dropping it shows.
    assert max((a - b).abs().max().item() for a, b in zip(want, lost, strict=True)) > 1e-2
    # And the memory keeps following: a third iteration, still on the new layout, against the reference.
    third = [torch.randn(sh) for sh in MLP_SHAPES]
    for w, g in zip(_powersgd_round(reference, before, params, third), _powersgd_round(carried, after, params, third),
                    strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_batched_powersgd_memory_is_dropped_on_a_new_layout() -> None:
    from deft.runtime.buckets import FlatLayout
    from deft.runtime.codecs.powersgd_memory import carry_buckets

    params = [torch.zeros(sh) for sh in MLP_SHAPES]
    names = [f"p{i}" for i in range(len(params))]
    total = sum(math.prod(sh) for sh in MLP_SHAPES)
    one = FlatLayout(range(6), names, params, [total])
    hook = CommHook(powersgd(2).state, powerSGD_hook.batched_powerSGD_hook, "batched")
    hook.state.error_dict[0] = torch.ones(292 * 292)
    hook.state.q_memory_dict[0] = torch.ones(292 * 2)
    carry_buckets(hook, one, FlatLayout(range(6), names, params, [1000, total - 1000]), params)
    assert hook.state.error_dict == {} and hook.state.q_memory_dict == {}
