"""The GPU path: CUDA tensors, NCCL on the primary link, gloo on CUDA tensors on the second, Nsight.

Tests marked ``cuda`` need a GPU and skip with the reason where none is present (multi-process ones
are also ``slow``); the decisions they rest on that need no GPU are tested here on CPU: NVTX ranges on
by default for a model on CUDA, and the verdict on torch's gloo + CUDA futures fix
(pytorch/pytorch#155714, fixed by pytorch/pytorch#170812). Two ranks on one GPU use gloo links (NCCL
refuses two ranks on one device).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from deft.config import LinkConfig
from deft.runtime.links import default_backend, gloo_cuda_fix, link_backend, queues
from deft.runtime.tracing import nvtx_wanted
from deft.schedule import CommTask, Schedule, StagePlan, Update
from tests._dist import run_ranks, values

NO_GPU = "no CUDA device: the GPU path (NCCL, gloo on CUDA tensors, nsys) cannot run here"
NCCL_LINK = [{"name": "primary", "backend": "nccl"}]
TWO_GLOO_LINKS = [{"name": "primary", "backend": "gloo"}, {"name": "second", "backend": "gloo"}]
STEPS = 12


# -- decisions testable without a GPU -----------------------------------------------------------------
@pytest.mark.parametrize(("device", "env", "on"), [
    ("cuda", {}, True), ("cuda:0", {}, True), (torch.device("cuda", 1), {}, True),
    ("cpu", {}, False), ("cuda", {"DEFT_NVTX": "0"}, False), ("cpu", {"DEFT_NVTX": "1"}, True),
    ("cuda", {"DEFT_NVTX": "off"}, False), ("cpu", {"DEFT_NVTX": "maybe"}, False),
])
def test_nvtx_ranges_on_by_default_on_cuda(device: str | torch.device, env: dict[str, str], on: bool) -> None:
    assert nvtx_wanted(device, env) is on


@pytest.mark.parametrize(("backend", "cuda", "expected"), [
    ("nccl", True, "nccl"), ("gloo", True, "gloo"), ("gloo", False, "gloo"), ("nccl", False, "gloo"),
    ("cpu:gloo,cuda:nccl", True, "nccl"), ("cpu:gloo,cuda:nccl", False, "gloo"), ("cuda:gloo", True, "gloo"),
    ("ucc", True, "nccl"), ("mpi", False, "gloo"),
])
def test_the_primary_link_follows_the_default_groups_backend(backend: str, cuda: bool, expected: str) -> None:
    """torch DDP all-reduces on the default group: ``init_process_group("gloo")`` with two ranks on one
    GPU (found on an H100: deft's primary link went NCCL and NCCL refused the shared device) keeps gloo."""
    primary = default_backend(cuda, backend)
    assert primary == expected
    assert link_backend(LinkConfig(name="primary"), 0, cuda, primary) == expected
    assert link_backend(LinkConfig(name="second"), 1, cuda, primary) == "gloo"
    assert link_backend(LinkConfig(name="primary", backend="gloo"), 0, cuda, primary) == "gloo"


@pytest.mark.parametrize(("backend", "cuda", "serial"), [
    ("gloo", False, True), ("gloo", True, False), ("nccl", True, False)])
def test_link_queue_serialises_gloo_links_of_cpu_tensors_only(backend: str, cuda: bool, serial: bool) -> None:
    # the others keep their backend's threads, with a warning from make_links (deft.runtime.links)
    assert queues(backend, cuda) is serial


@pytest.mark.parametrize(("version", "hip", "fixed"), [
    ("2.13.0", None, True), ("2.13.0+cu128", None, True), ("2.12.1", None, True), ("3.0.0", None, True),
    ("2.12.0a0+gitabc", None, None), ("2.11.0", None, None), ("2.10.1+cu126", None, False),
    ("2.8.0", None, False), ("2.10.0", "6.4", None), ("nightly", None, None),
])
def test_gloo_cuda_fix_verdict(version: str, hip: str | None, fixed: bool | None) -> None:
    verdict = gloo_cuda_fix(version, hip)
    assert verdict.fixed is fixed and verdict.torch_version == version and verdict.reason


def _pinned_torch() -> str:
    """The torch release scripts/setup.sh installs (``torch==X``)."""
    setup = (Path(__file__).resolve().parents[1] / "scripts" / "setup.sh").read_text()
    found = re.search(r"torch==([0-9][0-9.]*)", setup)
    assert found is not None, "scripts/setup.sh pins no torch==X"
    return found.group(1)


@pytest.mark.skipif(str(torch.__version__).split("+")[0] != _pinned_torch(),
                    reason=f"torch {torch.__version__} is not the pinned {_pinned_torch()} (a GPU machine's own "
                           "torch): its gloo + CUDA futures are checked at run time by "
                           "test_gloo_futures_on_cuda_tensors_are_not_corrupted")
def test_the_pinned_torch_carries_the_gloo_cuda_fix() -> None:
    verdict = gloo_cuda_fix()
    assert verdict.torch_version == str(torch.__version__) and verdict.fixed is True, verdict.reason


# -- helpers for the GPU workers ------------------------------------------------------------------------
def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def batch(rank: int, step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 64, generator=g).to(device), torch.randint(0, 10, (16,), generator=g).to(device)


def train(wrapped: nn.Module, opt: torch.optim.Optimizer, rank: int, device: str, steps: range) -> None:
    """Plain loop: one forward, backward and step per iteration."""
    train_groups(wrapped, opt, rank, device, [(s,) for s in steps])


def train_groups(wrapped: nn.Module, opt: torch.optim.Optimizer, rank: int, device: str,
                 groups: list[tuple[int, ...]]) -> None:
    """torch DDP's gradient accumulation over each group of iterations (``no_sync`` on all but the
    last, the loss divided by the group's size, one step): the reference for deft's merged updates."""
    for group in groups:
        for step in group:
            x, y = batch(rank, step, device)
            ctx = wrapped.no_sync() if step != group[-1] else contextlib.nullcontext()  # type: ignore[operator]
            with ctx:
                (nn.functional.cross_entropy(wrapped(x), y) / len(group)).backward()
        opt.step()
        opt.zero_grad()


def worst_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def merged_schedule(path: str, numel: tuple[int, ...]) -> None:
    """Cycle 2 on two links: iterations merge two by two; bucket 0 on the primary link, bucket 1 on the
    second, both sent in the second backward of each pair, the update applied after it."""
    P, S = "primary", "second"
    Schedule(cycle=2, links=(P, S), bucket_numel=numel, bucket_nbytes=tuple(4 * n for n in numel),
             stages=(StagePlan(0, "forward"), StagePlan(0, "backward"), StagePlan(1, "forward"),
                     StagePlan(1, "backward", (CommTask(0, 0, P), CommTask(1, 0, S)))),
             updates=(Update((0, 1), 1),)).save(path)


# -- workers (top level: pickled by name) ---------------------------------------------------------------
def nccl_world_one_worker(rank: int, world: int) -> dict[str, object]:
    """World size 1 on NCCL: epsilon 0 equals torch DDP over NCCL on the same device, and in the
    planned iterations no bucket is copied to the host (no device-to-host copy as large as a bucket)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import deft
    from deft.profiler import nvtx
    from deft.profiler.kineto import read_trace

    torch.cuda.set_device(0)
    dev = "cuda:0"
    model = make_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # the harness's default group is gloo, which deft's primary link would follow: NCCL by name; solo off:
    # this checks deft's bucket path on the device, which one rank otherwise skips
    ddp = deft.DistributedDataParallel(model, device_ids=[0], config={"epsilon": 0.0, "warmup_iters": 1,
                                                                      "profile_iters": 2, "links": NCCL_LINK,
                                                                      "solo": False})
    train(ddp, opt, rank, dev, range(STEPS - 2))
    trace = "/tmp/deft-cuda-nccl-trace.json"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train(ddp, opt, rank, dev, range(STEPS - 2, STEPS))
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace)
    ddp.flush()
    smallest = min(p.numel() * p.element_size() for p in model.parameters() if p.numel() >= 256)
    host_copies = [e.args.get("bytes") for e in read_trace(trace).events
                   if e.cat == "gpu_memcpy" and "DtoH" in e.name and int(e.args.get("bytes") or 0) >= smallest]
    ref = make_model().to(dev)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    tddp = nn.parallel.DistributedDataParallel(ref, device_ids=[0], process_group=dist.new_group(backend="nccl"))
    train(tddp, ref_opt, rank, dev, range(STEPS))
    torch.cuda.synchronize()
    return {"worst": worst_diff(model, ref), "link_calls": ddp.link_stats, "host_copies": host_copies,
            "nvtx": nvtx.nvtx_enabled()}


def gloo_future_stream_worker(rank: int, world: int) -> list[float]:
    """The exact pattern of pytorch/pytorch#155714 on CUDA tensors: ten gloo all-reduces, each future waited
    for on a high-priority side stream and its tensor read there (corrupt without pytorch/pytorch#170812)."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    expected = float(sum(range(world)))
    tensors = [torch.full((1_000_000,), float(rank), device="cuda") for _ in range(10)]
    futs = [dist.all_reduce(t, async_op=True).get_future() for t in tensors]  # type: ignore[union-attr]
    side = torch.cuda.Stream(priority=-1)
    seen = []
    for fut, t in zip(futs, tensors, strict=True):
        with torch.cuda.stream(side):
            fut.wait()
            seen.append(float(t[-1].item()) - expected)
    return seen


def gloo_cuda_parity_worker(rank: int, world: int, schedule_path: str | None) -> dict[str, object]:
    """Two ranks on one GPU, both links gloo on CUDA tensors. Without a schedule: epsilon 0 equals torch
    DDP on the same device. With ``schedule_path`` (two iterations merged, one bucket per link): every
    iteration is applied exactly once and the parameters equal torch DDP's gradient accumulation."""
    import deft

    torch.cuda.set_device(0)
    dev = "cuda:0"
    model = make_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg: dict[str, object] = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "links": TWO_GLOO_LINKS}
    if schedule_path is not None:
        cfg["schedule_path"] = schedule_path
    ddp = deft.DistributedDataParallel(model, config=cfg)
    train(ddp, opt, rank, dev, range(STEPS))
    ddp.flush()
    ref = make_model().to(dev)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    # the reference merges exactly the iterations deft's log says each update merged
    train_groups(nn.parallel.DistributedDataParallel(ref), ref_opt, rank, dev, [its for _, its in ddp.update_log])
    torch.cuda.synchronize()
    applied = sorted(i for _, its in ddp.update_log for i in its)
    merged = max(len(its) for _, its in ddp.update_log)
    return {"worst": worst_diff(model, ref), "applied": applied, "links": ddp.link_stats, "merged": merged,
            "params": [float(p.double().sum()) for p in model.parameters()]}


def grad_scaler_worker(rank: int, world: int) -> dict[str, object]:
    """fp16 autocast + GradScaler; rank 0's input of iteration 5 is inf, so every rank skips that step
    and lowers the scale, as with torch DDP on the same device."""
    import deft

    torch.cuda.set_device(0)
    dev = "cuda:0"

    def run(wrapped: nn.Module, model: nn.Module, opt: torch.optim.Optimizer) -> float:
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
        for step in range(STEPS):
            x, y = batch(rank, step, dev)
            if step == 5 and rank == 0:
                x = x * float("inf")
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(wrapped(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return float(scaler.get_scale())

    model = make_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = deft.DistributedDataParallel(model, config={"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2,
                                                      "links": TWO_GLOO_LINKS})
    scale = run(ddp, model, opt)
    ddp.flush()
    ref = make_model().to(dev)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ref_scale = run(nn.parallel.DistributedDataParallel(ref), ref, ref_opt)
    return {"worst": worst_diff(model, ref), "scale": scale, "ref_scale": ref_scale,
            "nonfinite": ddp.plan_info.get("nonfinite_steps")}


def checkpoint_worker(rank: int, world: int, schedule_path: str, directory: str) -> dict[str, object]:
    """A checkpoint taken with an update pending (iteration 4 of a pair) on CUDA, loaded into a fresh
    wrapper, resumes to the parameters of the uninterrupted run, bit for bit."""
    import deft

    torch.cuda.set_device(0)
    dev = "cuda:0"
    cfg = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "links": TWO_GLOO_LINKS,
           "schedule_path": schedule_path}

    def build() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
        m = make_model().to(dev)
        o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        return m, o, deft.DistributedDataParallel(m, optimizer=o, config=cfg)

    full, full_opt, full_ddp = build()
    train(full_ddp, full_opt, rank, dev, range(STEPS))
    full_ddp.flush()
    _first, first_opt, first_ddp = build()
    stop = 0
    while stop < STEPS - 2 and not (stop > 3 and first_ddp.pending_updates):
        train(first_ddp, first_opt, rank, dev, range(stop, stop + 1))
        stop += 1
    pending = len(first_ddp.pending_updates)
    path = Path(directory) / f"rank{rank}.pt"
    torch.save({"ddp": first_ddp.state_dict(), "opt": first_opt.state_dict()}, path)
    second, second_opt, second_ddp = build()
    state = torch.load(path, weights_only=True)
    second_ddp.load_state_dict(state["ddp"])
    second_opt.load_state_dict(state["opt"])
    train(second_ddp, second_opt, rank, dev, range(stop, STEPS))
    second_ddp.flush()
    torch.cuda.synchronize()
    return {"pending": pending, "equal": all(torch.equal(a, b) for a, b in
                                             zip(full.parameters(), second.parameters(), strict=True))}


def _numel() -> tuple[int, int]:
    total = sum(p.numel() for p in make_model().parameters())
    return (total // 2, total - total // 2)


# -- the GPU tests ------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_world_one_on_nccl_equals_torch_ddp_and_keeps_buckets_on_the_device() -> None:
    (res,) = values(run_ranks(nccl_world_one_worker, 1, timeout=300))
    assert res["worst"] < 1e-5 and res["nvtx"] is True  # NVTX ranges on by default on CUDA
    assert res["host_copies"] == []
    assert res["link_calls"]["primary"]["calls"] > 0


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_gloo_futures_on_cuda_tensors_are_not_corrupted() -> None:
    for seen in values(run_ranks(gloo_future_stream_worker, 2, timeout=300)):
        assert seen == [0.0] * 10


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_two_ranks_one_gpu_gloo_epsilon_zero_equals_torch_ddp() -> None:
    res = values(run_ranks(gloo_cuda_parity_worker, 2, (None,), timeout=300))
    for r in res:
        assert r["worst"] < 1e-5 and r["applied"] == list(range(STEPS)) and r["merged"] == 1
    assert res[0]["params"] == res[1]["params"]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_merged_updates_on_two_links_apply_every_gradient_once(tmp_path: Path) -> None:
    sched = tmp_path / "merged.json"
    merged_schedule(str(sched), _numel())
    res = values(run_ranks(gloo_cuda_parity_worker, 2, (str(sched),), timeout=300))
    for r in res:
        assert r["applied"] == list(range(STEPS)) and r["merged"] == 2
        assert r["worst"] < 1e-5
        assert r["links"]["primary"]["calls"] > 0 and r["links"]["second"]["calls"] > 0
    assert res[0]["params"] == res[1]["params"]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_grad_scaler_fp16_skips_an_injected_inf_like_torch_ddp() -> None:
    for r in values(run_ranks(grad_scaler_worker, 2, timeout=300)):
        assert r["scale"] == r["ref_scale"] < 2.0**10
        assert r["worst"] < 1e-3  # fp16 autocast: the same kernels, summed in another order by gloo


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_checkpoint_round_trip_on_cuda(tmp_path: Path) -> None:
    sched = tmp_path / "merged.json"
    merged_schedule(str(sched), _numel())
    for r in values(run_ranks(checkpoint_worker, 2, (str(sched), str(tmp_path)), timeout=300)):
        assert r["pending"] > 0 and r["equal"] is True


TRAIN_SCRIPT = """
import os, torch, torch.distributed as dist
from torch import nn
import deft
dist.init_process_group("gloo")
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
ddp = deft.DistributedDataParallel(model, config={"epsilon": 0.0, "warmup_iters": 1})
for step in range(12):
    x, y = torch.randn(16, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    opt.zero_grad()
ddp.flush()
"""


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.skipif(shutil.which("nsys") is None, reason="nsys not installed")
def test_deft_profile_nsys_run_is_read_back(tmp_path: Path) -> None:
    from deft import Profile

    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / "prof.json"
    run = subprocess.run([sys.executable, "-m", "deft.profiler.cli", "--backend", "nsys", "--iters", "2",
                          "--no-png", "--out", str(out), str(script)], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-3000:]
    prof = Profile.load(out)
    assert prof.source == "nsys" and prof.link_names == ("primary",)
    assert all(t.backward_s > 0 and t.comm_s["primary"] > 0 for t in prof.times)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_int8_codec_encodes_and_decodes_on_the_device() -> None:
    """deft's int8 codec on CUDA tensors (its draws from a CUDA generator): the payload stays on the
    device and two ranks' payloads decode to their average within the per-element bound."""
    from deft.runtime.codecs import int8

    grads = [torch.randn(1000, device="cuda") * (r + 1) for r in range(2)]
    payloads = [int8.encode(g, torch.Generator(device="cuda").manual_seed(r)) for r, g in enumerate(grads)]
    assert all(p.is_cuda and p.dtype == torch.int8 for p in payloads)
    out = int8.decode(payloads, 1000)
    bound = torch.zeros(1000, device="cuda")
    for g in grads:  # (1 / R) sum_r s_r per element, s the block's largest over 127
        for lo in range(0, 1000, 256):
            bound[lo:lo + 256] += g[lo:lo + 256].abs().max() / 127 / 2
    assert out.is_cuda and bool(((out - (grads[0] + grads[1]) / 2).abs() <= bound * (1 + 1e-5)).all())
