"""The profile iterations' codec in a live run (``config.profile_codec``), against real torch DDP.

The first iteration's sends go speculatively in fp16 from its first gradient and are judged at the end
of its backward on a sample of the gradients (sent again where the verdict differs), which decides
the profile iterations' codec too (on whole gradients where the sends are not judged); each then sends
every bucket with the codec. fp16
rounding is element-wise, so torch DDP with a hook that sends every element through torch's fp16 hook
from iteration 0 on computes exactly what deft must (the hook of tests/test_runtime_codecs.py); with
``"never"`` deft must equal exact torch DDP.
The runs stop before the plan (``profile_iters`` longer than the run): every iteration is a
synchronous one whose maths is known.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values
from tests.test_runtime_codecs import batch, make_model, mixed_hook
from tests.test_runtime_comm_hooks import bf16_reference_hook

STEPS = 10


def config(mode: str, epsilon: float = 0.01) -> dict[str, object]:
    return {"epsilon": epsilon, "profile_codec": mode, "warmup_iters": 1, "profile_iters": STEPS + 2,
            "timeout_s": 60, "links": [{"name": "primary"}, {"name": "second"}]}


def train(model: nn.Module, wrapped: nn.Module, opt: torch.optim.Optimizer, rank: int, start: int, stop: int,
          state: dict[str, Any] | None = None) -> None:
    for t in range(start, stop):
        if state is not None:
            state["t"] = t
        x, y = batch(rank, t)
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        if hasattr(wrapped, "observe_loss"):
            wrapped.observe_loss(loss)
        opt.step()
        opt.zero_grad()


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def worst(a: nn.Module, b: nn.Module) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item()
               for x, y in zip(a.parameters(), b.parameters(), strict=True))


def parity_worker(rank: int, world: int, mode: str, epsilon: float) -> dict[str, Any]:
    """deft against torch DDP with torch's fp16 hook on every element from iteration 0, and exact."""
    import deft

    ours = make_model()
    opt = sgd(ours)
    ddp = deft.DistributedDataParallel(ours, optimizer=opt, config=config(mode, epsilon))
    train(ours, ddp, opt, rank, 0, STEPS)
    ddp.flush()

    coded = make_model()
    tddp = nn.parallel.DistributedDataParallel(coded)
    state = {"coded": {id(p) for p in coded.parameters()}, "start": 0, "t": 0}
    tddp.register_comm_hook(state, mixed_hook)
    train(coded, tddp, sgd(coded), rank, 0, STEPS, state)

    exact = make_model()
    train(exact, nn.parallel.DistributedDataParallel(exact), sgd(exact), rank, 0, STEPS)
    return {"record": ddp.plan_info["profile_codec"], "vs_coded": worst(ours, coded), "vs_exact": worst(ours, exact),
            "links": ddp.link_stats, "params": [p.sum().item() for p in ours.parameters()]}


@pytest.mark.slow
def test_always_sends_the_profile_iterations_in_fp16_as_torch_ddps_fp16_hook_does() -> None:
    a, b = values(run_ranks(parity_worker, 2, ("always", 0.01), timeout=180))
    assert a["record"]["codec"] == "fp16" and a["record"] == b["record"]
    first = a["record"]["first"]
    assert first["codec"] == "fp16" and "profile_codec = \"always\"" in first["reason"], first
    assert first["speculative"] == "fp16"  # the speculative sends stood: nothing sent twice
    assert "on the same sample" in a["record"]["reason"], a["record"]  # the judged sample decided both
    assert a["vs_coded"] < 1e-5 and b["vs_coded"] < 1e-5, (a["vs_coded"], b["vs_coded"])
    assert a["vs_exact"] > 1e-5  # the codec really rounded: the exact run fails the same check
    assert a["params"] == b["params"]
    assert all(a["links"][k]["bytes"] > 0 for k in ("primary", "second"))  # both links carried buckets


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "epsilon", "why", "first_codec", "first_why"), [
    ("never", 0.01, "never", None, ""),  # "never": the first iteration's sends are not judged either
    ("always", 1e-12, "accepts no codec", "", "accepts no codec on the first iteration's sampled gradients"),
])
def test_an_exact_profile_keeps_torch_ddps_exact_parameters(mode: str, epsilon: float, why: str,
                                                            first_codec: str | None, first_why: str) -> None:
    a, b = values(run_ranks(parity_worker, 2, (mode, epsilon), timeout=180))
    assert a["record"]["codec"] == "" and why in a["record"]["reason"] and a["record"] == b["record"]
    sends = a["record"]["first"]
    assert (None if sends is None else sends["codec"]) == first_codec, sends
    assert first_why in ("" if sends is None else sends["reason"]), sends
    # "always" refused: the first iteration went in fp16 and was sent again exact (its fp16 results dropped)
    assert (None if sends is None else sends["speculative"]) == (None if mode == "never" else "fp16"), sends
    assert a["vs_exact"] < 1e-5 and b["vs_exact"] < 1e-5, (a["vs_exact"], b["vs_exact"])
    assert a["vs_coded"] > 1e-5
    assert a["params"] == b["params"]


STOP = 4


def resume_worker(rank: int, world: int) -> dict[str, Any]:
    """A checkpoint taken in the coded profile iterations resumes in a fresh wrapper to the same bits."""
    import deft

    model = make_model()
    opt = sgd(model)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=config("always"))
    train(model, ddp, opt, rank, 0, STEPS)
    ddp.flush()
    full = [p.tolist() for p in model.parameters()]
    ddp.close()

    model = make_model()
    opt = sgd(model)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=config("always"))
    train(model, ddp, opt, rank, 0, STOP)
    buf = io.BytesIO()
    torch.save({"ddp": ddp.state_dict(), "opt": opt.state_dict()}, buf)
    ddp.close()

    model = make_model()
    with torch.no_grad():  # garbage: the checkpoint must restore everything
        for p in model.parameters():
            p.mul_(-3.0)
    opt = sgd(model)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=config("always"))
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    ddp.load_state_dict(ckpt["ddp"])
    opt.load_state_dict(ckpt["opt"])
    codec_after_load = ddp.plan_info["profile_codec"]["codec"]
    train(model, ddp, opt, rank, STOP, STEPS)
    ddp.flush()
    return {"full": full, "resumed": [p.tolist() for p in model.parameters()], "codec": codec_after_load}


@pytest.mark.slow
def test_a_checkpoint_in_the_coded_profile_resumes_bit_for_bit() -> None:
    for r in values(run_ranks(resume_worker, 2, timeout=240)):
        assert r["codec"] == "fp16"
        assert r["resumed"] == r["full"]


def overflow_worker(rank: int, world: int) -> dict[str, Any]:
    """torch's documented AMP loop (GradScaler) whose first step overflows (an inf loss, as fp16 overflow
    gives): nothing is judged on it, so the profile stays exact, and training goes on as torch DDP's."""
    import deft

    def run(wrap: Any) -> tuple[nn.Module, Any]:
        model = make_model()
        opt = sgd(model)
        wrapped = wrap(model, opt)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for t in range(6):
            x, y = batch(rank, t)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(wrapped(x), y)
            if t == 0:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return model, wrapped

    ours, ddp = run(lambda m, o: deft.DistributedDataParallel(m, optimizer=o, config=config("always")))
    ddp.flush()
    ref, _ = run(lambda m, o: nn.parallel.DistributedDataParallel(m))
    return {"record": ddp.plan_info["profile_codec"], "vs_torch": worst(ours, ref),
            "skipped": ddp.plan_info.get("skipped_steps", [])}


@pytest.mark.slow
def test_an_overflowing_first_step_leaves_the_profile_exact_as_torch_ddp() -> None:
    a, b = values(run_ranks(overflow_worker, 2, timeout=180))
    assert a["record"]["codec"] == "" and "no gradient statistics" in a["record"]["reason"], a["record"]
    assert a["record"] == b["record"]
    first = a["record"]["first"]  # the first iteration's sends, judged on its (infinite) sample: exact
    assert first["codec"] == "" and "no usable sample" in first["reason"], first
    assert first["speculative"] == "fp16"  # sent in fp16 first, then again exact
    assert a["skipped"] == b["skipped"] == [0]  # GradScaler skipped the first step on every rank
    assert a["vs_torch"] < 1e-5 and b["vs_torch"] < 1e-5, (a["vs_torch"], b["vs_torch"])


SCALE = 1e4  # the loss's factor in bf16_worker: gradients far beyond fp16's headroom (world x 64)


def bf16_worker(rank: int, world: int) -> dict[str, Any]:
    """A loss scaled by ``SCALE`` (the learning rate divided by it): fp16 has no headroom for its
    gradients, bf16 does. The first iteration's fp16 sends are dropped and it is sent again in bf16; the
    profile iterations go in bf16 too: torch DDP with torch's ``bf16_compress_hook`` from iteration 0."""
    import deft

    def run(model: nn.Module, wrapped: nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.05 / SCALE, momentum=0.9)
        for t in range(STEPS):
            x, y = batch(rank, t)
            loss = nn.functional.mse_loss(wrapped(x), y) * SCALE
            loss.backward()
            if hasattr(wrapped, "observe_loss"):
                wrapped.observe_loss(loss)
            opt.step()
            opt.zero_grad()

    ours = make_model()
    ddp = deft.DistributedDataParallel(ours, config=config("always", 0.05))
    run(ours, ddp)
    ddp.flush()
    ref = make_model()
    tddp = nn.parallel.DistributedDataParallel(ref)
    tddp.register_comm_hook(None, bf16_reference_hook)  # torch's bf16 hook (refused by name off CUDA)
    run(ref, tddp)
    exact = make_model()
    run(exact, nn.parallel.DistributedDataParallel(exact))
    return {"record": ddp.plan_info["profile_codec"], "vs_bf16": worst(ours, ref), "vs_exact": worst(ours, exact)}


@pytest.mark.slow
def test_a_first_iteration_fp16_cannot_carry_is_sent_again_in_bf16_as_torch_ddps_bf16_hook() -> None:
    a, b = values(run_ranks(bf16_worker, 2, timeout=180))
    assert a["record"] == b["record"]
    first = a["record"]["first"]
    assert first["speculative"] == "fp16" and first["codec"] == "bf16", first
    assert a["record"]["codec"] == "bf16", a["record"]
    assert a["vs_bf16"] < 1e-5 and b["vs_bf16"] < 1e-5, (a["vs_bf16"], b["vs_bf16"])
    assert a["vs_exact"] > 1e-5  # bf16 really rounded


def compute_bound_worker(rank: int, world: int, init_sync: bool = True) -> dict[str, Any]:
    """The default ``profile_codec = "auto"`` on a model of convolutions over large images with 1.5 K
    parameters: its all-reduce (6 KB on loopback) ends within the backward, which takes milliseconds."""
    import deft

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 5, padding=2), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten())
    opt = sgd(model)
    cfg = {**config("auto"), "profile_iters": 2}
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=cfg, init_sync=init_sync)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(16, 3, 96, 96, generator=g), torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(ddp(x), y)  # random targets: noisy gradients the codec's bound accepts
        loss.backward()
        ddp.observe_loss(loss)
        opt.step()
        opt.zero_grad()
    return {"record": ddp.plan_info["profile_codec"]}


@pytest.mark.slow
def test_auto_keeps_the_profile_exact_where_the_compute_is_the_bound() -> None:
    a, b = values(run_ranks(compute_bound_worker, 2, timeout=180))
    assert a["record"] == b["record"]
    rec = a["record"]
    assert rec["codec"] == "" and "saves too little" in rec["reason"], rec
    assert rec["exposed_s"] < rec["compute_s"]
    # the construction's broadcast predicts a short all-reduce: the first sends went at once, exact
    first = rec["first"]
    assert first["codec"] == "" and "cannot be the bound" in first["reason"], first
    assert "sent exact, not judged" in first["reason"] and first["exposed_s"] <= first["compute_s"]
    assert first["speculative"] == ""


@pytest.mark.slow
def test_without_the_constructions_broadcast_the_first_sends_go_at_once_exact() -> None:
    # init_sync=False (the ranks built the same model): nothing timed the links before the first iteration
    a, b = values(run_ranks(compute_bound_worker, 2, (False,), timeout=180))
    assert a["record"] == b["record"]
    first = a["record"]["first"]
    assert first["codec"] == "" and "init_sync off" in first["reason"], first
    assert first["speculative"] == ""


def clip_log_worker(rank: int, world: int) -> dict[str, Any]:
    """The loop that clips and logs the gradient norm between backward() and step() (torch's
    ``clip_grad_norm_``, whose return value users log), through the coded profile iterations."""
    import deft

    def run(model: nn.Module, wrapped: nn.Module, state: dict[str, Any] | None) -> list[float]:
        opt, norms = sgd(model), []
        for t in range(STEPS):
            if state is not None:
                state["t"] = t
            x, y = batch(rank, t)
            nn.functional.mse_loss(wrapped(x), y).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            opt.zero_grad()
        return norms

    ours = make_model()
    ddp = deft.DistributedDataParallel(ours, config=config("always"))
    our_norms = run(ours, ddp, None)
    ddp.flush()
    ref = make_model()
    tddp = nn.parallel.DistributedDataParallel(ref)
    state = {"coded": {id(p) for p in ref.parameters()}, "start": 0, "t": 0}
    tddp.register_comm_hook(state, mixed_hook)
    ref_norms = run(ref, tddp, state)
    return {"codec": ddp.plan_info["profile_codec"]["codec"], "vs_coded": worst(ours, ref),
            "norms": our_norms, "ref_norms": ref_norms}


@pytest.mark.slow
def test_clipping_and_a_logged_norm_see_torch_ddps_fp16_gradients_in_the_coded_profile() -> None:
    for r in values(run_ranks(clip_log_worker, 2, timeout=180)):
        assert r["codec"] == "fp16"
        assert r["vs_coded"] < 1e-5, r["vs_coded"]
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        assert max(r["norms"]) > 0.5  # the clip really acted


def gpt2_worker(rank: int, world: int) -> dict[str, Any]:
    """A HuggingFace GPT-2 in the HuggingFace loop (labels in, ``.loss`` out, clipping with the norm
    logged, AdamW with warm-up then cosine) through the speculative first iteration and the coded
    profile iterations, against torch DDP with torch's ``fp16_compress_hook`` from iteration 0."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import deft
    from tests.compat.test_models import _gpt2, _gpt2_batch, _gpt2_optimizer

    def run(model: nn.Module, wrapped: nn.Module) -> list[float]:
        from transformers import get_cosine_schedule_with_warmup

        opt = _gpt2_optimizer(model)
        sched = get_cosine_schedule_with_warmup(opt, 3, 20)
        norms = []
        for t in range(STEPS):
            x, _ = _gpt2_batch(rank, t)
            out = wrapped(input_ids=x, attention_mask=torch.ones_like(x), labels=x)
            out.loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            sched.step()
            opt.zero_grad()
        return norms

    ours = _gpt2()
    # epsilon 0.05: fp16's rounding bound on these gradients, with the sample's 100x margin, is far inside it
    ddp = deft.DistributedDataParallel(ours, config=config("always", 0.05))
    our_norms = run(ours, ddp)
    ddp.flush()
    ref = _gpt2()
    tddp = nn.parallel.DistributedDataParallel(ref)
    tddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    ref_norms = run(ref, tddp)
    return {"record": ddp.plan_info["profile_codec"], "vs_fp16": worst(ours, ref), "norms": our_norms,
            "ref_norms": ref_norms}


@pytest.mark.slow
def test_a_huggingface_gpt2_loop_goes_speculatively_coded_as_torch_ddps_fp16_hook() -> None:
    a, b = values(run_ranks(gpt2_worker, 2, timeout=240))
    assert a["record"] == b["record"]
    first = a["record"]["first"]
    assert first["speculative"] == "fp16" and first["codec"] == "fp16", first  # kept, not sent again
    assert a["record"]["codec"] == "fp16"
    for r in (a, b):
        assert r["vs_fp16"] < 1e-5, r["vs_fp16"]
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
