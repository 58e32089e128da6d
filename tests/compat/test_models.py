"""Drop-in with models and launches users have: a HuggingFace GPT-2, a HuggingFace ResNet (batch norms,
evaluated between iterations, resumed from a checkpoint), ``torch.compile`` before or after wrapping,
world sizes 3 and 4, a meta-device model, a model with lazy parameters, and the default epsilon on a
schedule that merges updates.

Exact cases compare with torch DDP to 1e-5 as in :mod:`tests.compat.test_loops`; the default-epsilon
case checks what the preserver promises a user (no crash, finite parameters, the loss of torch DDP's
run within its spread) on a schedule where steps have no update due.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values
from tests.compat._harness import Loop, Recipe, mlp, run
from tests.compat.test_loops import RECIPES, _plain, check_exact
from tests.compat.test_optimizers import RECIPES as OPTIMIZER_RECIPES


# -- HuggingFace GPT-2 ------------------------------------------------------------------------------------
def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _gpt2_batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 * t + rank)
    ids = torch.randint(0, 96, (4, 16), generator=g)
    return ids, ids


def _gpt2_optimizer(m: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in m.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-3)


def _gpt2_step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """The HuggingFace way: labels in, ``.loss`` out, attention mask, clip, warm-up then cosine."""
    if t == 0:
        from transformers import get_cosine_schedule_with_warmup

        loop.sched = get_cosine_schedule_with_warmup(loop.opt, 3, 20)  # type: ignore[attr-defined]
    out = loop.wrapped(input_ids=x, attention_mask=torch.ones_like(x), labels=y)
    out.loss.backward()
    loop.log.values.append(float(torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 1.0)))
    loop.opt.step()
    loop.sched.step()  # type: ignore[attr-defined]
    loop.opt.zero_grad()
    loop.log.losses.append(out.loss.item())


GPT2 = Recipe(_gpt2, _gpt2_step, optimizer=_gpt2_optimizer, steps=20, batch=_gpt2_batch)


def gpt2_worker(rank: int, world: int, mode: str, workdir: str) -> dict[str, Any]:
    return run(GPT2, rank, mode, 0.0, workdir)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["forced", "measured"])
def test_huggingface_gpt2_matches_torch_ddp(mode: str, tmp_path: Any) -> None:
    check_exact(values(run_ranks(gpt2_worker, 2, (mode, str(tmp_path)), timeout=240)))


# -- HuggingFace ResNet -----------------------------------------------------------------------------------
def _resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                       num_labels=4)
    return ResNetForImageClassification(cfg)


def _resnet_batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's images on its own scale: the ranks' batch statistics differ."""
    g = torch.Generator().manual_seed(11 * t + rank)
    return torch.randn(4, 3, 32, 32, generator=g) * (1 + rank), torch.randint(0, 4, (4,), generator=g)


EVALUATED = (4, 9, 14)
RESNET_STEPS = 16


def _resnet_step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Labels in, ``.loss`` out; at ``EVALUATED`` iterations an evaluation forward first, whose output
    reads the batch norms' running statistics (rank 0's, broadcast before it as before any forward); after
    the last iteration (its forward broadcast as it follows a training forward), this rank's statistics:
    rank 0's carried through this rank's own update."""
    if t in EVALUATED:
        loop.wrapped.eval()
        with torch.no_grad():
            loop.log.values.append(float(loop.wrapped(pixel_values=x).logits.square().sum()))
        loop.wrapped.train()
    out = loop.wrapped(pixel_values=x, labels=y)
    out.loss.backward()
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(out.loss.item())
    if t == RESNET_STEPS - 1:
        loop.log.values += [float(b.double().sum()) for b in loop.model.buffers()]


RESNET = {"straight": Recipe(_resnet, _resnet_step, steps=RESNET_STEPS, batch=_resnet_batch),
          "resumed": Recipe(_resnet, _resnet_step, steps=RESNET_STEPS, batch=_resnet_batch, restart_at=7)}


def resnet_worker(rank: int, world: int, recipe: str, workdir: str) -> dict[str, Any]:
    return run(RESNET[recipe], rank, "forced", 0.0, workdir)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RESNET))
def test_huggingface_resnet_with_batch_norms_matches_torch_ddp(recipe: str, tmp_path: Any) -> None:
    check_exact(values(run_ranks(resnet_worker, 2, (recipe, str(tmp_path)), timeout=240)))


# -- a forward pre-hook of the model's own -----------------------------------------------------------------
def _weight_normed() -> nn.Module:
    """The MLP with ``torch.nn.utils.weight_norm`` on two layers: a forward pre-hook, registered before
    wrapping, computes each layer's weight from its parameters ``weight_g`` and ``weight_v``."""
    import warnings

    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for parametrizations, still documented
        torch.nn.utils.weight_norm(model.mid)  # type: ignore[attr-defined]
        torch.nn.utils.weight_norm(model.head)  # type: ignore[attr-defined]
    return model


def _spectral_normed() -> nn.Module:
    """The MLP with ``torch.nn.utils.spectral_norm`` on two layers: a forward pre-hook reads the layer's
    ``weight_orig`` and, in training, updates its buffers ``weight_u``, ``weight_v`` (rank 0's before it,
    broadcast as torch DDP does) by a power iteration."""
    model = mlp()
    torch.nn.utils.spectral_norm(model.mid)
    torch.nn.utils.spectral_norm(model.head)
    return model


PRE_HOOKED = {"weight_norm": _weight_normed, "spectral_norm": _spectral_normed}


def pre_hooked_worker(rank: int, world: int, model: str, workdir: str) -> dict[str, Any]:
    return run(Recipe(PRE_HOOKED[model], _plain), rank, "forced", 0.0, workdir)


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(PRE_HOOKED))
def test_a_pre_hook_registered_before_wrapping_sees_the_deferred_updates_as_under_torch_ddp(
        model: str, tmp_path: Any) -> None:
    # deft applies a lag-free plan's deferred update (and waits for rank 0's buffers) in a pre-hook of its
    # own, ahead of the module's earlier ones, as torch DDP has both in place before the module is called.
    check_exact(values(run_ranks(pre_hooked_worker, 2, (model, str(tmp_path)), timeout=180)))


# -- world sizes -------------------------------------------------------------------------------------------
def world_worker(rank: int, world: int, recipe: str, workdir: str) -> dict[str, Any]:
    return run(RECIPES[recipe], rank, "forced", 0.0, workdir)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "recipe"), [(3, "amp_bf16_documented"), (4, "plain"), (4, "grad_norm_logging"),
                                               (8, "clip_from_start")])
def test_world_sizes_three_to_eight(world: int, recipe: str, tmp_path: Any) -> None:
    out = values(run_ranks(world_worker, world, (recipe, str(tmp_path)), timeout=240))
    check_exact(out)
    assert all(v["deft"]["params"] == out[0]["deft"]["params"] for v in out)


# -- torch.compile ------------------------------------------------------------------------------------------
def _compiled_mlp() -> nn.Module:
    return torch.compile(mlp(), backend="aot_eager")  # type: ignore[return-value]


def compile_worker(rank: int, world: int, order: str, recipe: str, workdir: str) -> dict[str, Any]:
    """``order``: ``"before"`` compiles the model and wraps the compiled one; ``"after"`` wraps, then
    compiles the wrapper (torch's own advice for DDP) and trains through the loop ``recipe`` names."""
    if order == "before":
        return run(Recipe(_compiled_mlp, _plain), rank, "forced", 0.0, workdir)
    import tests.compat._harness as h

    wrap = h.deft_wrapper

    def compiled_after(model: nn.Module, *a: Any) -> nn.Module:
        return torch.compile(wrap(model, *a), backend="aot_eager")  # type: ignore[return-value]

    h.deft_wrapper = compiled_after  # type: ignore[assignment]
    try:
        return run(RECIPES[recipe], rank, "forced", 0.0, workdir)
    finally:
        h.deft_wrapper = wrap  # type: ignore[assignment]


@pytest.mark.slow
# after wrapping also torch's documented AMP loop (GradScaler's unscale reads every gradient at the step)
@pytest.mark.parametrize(("order", "recipe"), [("before", "plain"), ("after", "plain"),
                                               ("after", "amp_bf16_documented")])
def test_torch_compile_before_or_after_wrapping(order: str, recipe: str, tmp_path: Any) -> None:
    check_exact(values(run_ranks(compile_worker, 2, (order, recipe, str(tmp_path)), timeout=240)))


#: Iterations of the wrapper compiled after wrapping before its graphs must be stable: the watched first
#: forward, then the forced schedule's deferred updates from iteration 1 on.
COMPILE_WARM = 3


def compiled_steady_worker(rank: int, world: int, workdir: str, steady: int) -> list[float]:
    """The wrapper compiled after wrapping, its ``steady`` iterations after :data:`COMPILE_WARM` under
    ``torch.compiler.set_stance("fail_on_recompile")``; the losses."""
    from tests.compat._harness import batch, deft_wrapper

    model = mlp()
    wrapped = torch.compile(deft_wrapper(model, "forced", 0.0, workdir, rank), backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []

    def step(t: int) -> None:
        x, y = batch(rank, t)
        loss = nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))

    for t in range(COMPILE_WARM):
        step(t)
    with torch.compiler.set_stance("fail_on_recompile"):
        for t in range(COMPILE_WARM, COMPILE_WARM + steady):
            step(t)
    return losses


@pytest.mark.slow
def test_the_wrapper_compiled_after_wrapping_does_not_recompile_every_iteration(tmp_path: Any) -> None:
    """Dynamo runs deft's bookkeeping between graphs instead of tracing it: traced, the iteration's state
    (which buckets are in flight, the iteration number) became guards and every iteration a recompile,
    until Dynamo's recompile limit sent the frames back to eager."""
    out = values(run_ranks(compiled_steady_worker, 2, (str(tmp_path), 6), timeout=240))
    assert all(len(v) == COMPILE_WARM + 6 and all(math.isfinite(x) for x in v) for v in out)


# -- refused at construction ---------------------------------------------------------------------------------
def _on_meta() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(4, 4)


def _lazy() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 4))


#: A model torch DDP refuses too, and what deft's refusal must say (which parameters, what to do).
REFUSED = {"meta": (_on_meta, ("meta", "to_empty")), "lazy": (_lazy, ("uninitialized", "0.weight", "run one forward"))}


def refused_worker(rank: int, world: int, kind: str) -> str:
    import deft

    try:
        deft.DistributedDataParallel(REFUSED[kind][0]())
    except deft.DeftError as e:
        return str(e)
    return "accepted"


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_a_model_torch_ddp_refuses_is_refused_at_construction_with_what_to_do(kind: str) -> None:
    for said in values(run_ranks(refused_worker, 2, (kind,), timeout=60)):
        assert all(words in said for words in REFUSED[kind][1]), said


# -- the default epsilon on a merging schedule -------------------------------------------------------------
def default_epsilon_worker(rank: int, world: int, recipe: str, workdir: str) -> dict[str, Any]:
    return run(RECIPES[recipe], rank, "merged", None, workdir)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["amp_bf16_documented", "amp_fp16_inf_after_plan", "clip_from_start",
                                    "grad_norm_after_step", "grad_norm_logging", "plain"])
def test_default_epsilon_on_a_merging_schedule_trains(recipe: str, tmp_path: Any) -> None:
    check_merged_runs(values(run_ranks(default_epsilon_worker, 2, (recipe, str(tmp_path)), timeout=180)), recipe)


@pytest.mark.slow
def test_merged_updates_apply_each_iteration_once_on_eight_ranks(tmp_path: Any) -> None:
    out = values(run_ranks(default_epsilon_worker, 8, ("plain", str(tmp_path)), timeout=240))
    check_merged_runs(out, "plain")
    assert all(v["deft"]["params"] == out[0]["deft"]["params"] for v in out)


def check_merged_runs(out: list[Any], recipe: str) -> None:
    """Two iterations per update: every other step has no update due. GradScaler still finds gradients
    to check there (no "No inf checks were recorded"), every iteration is applied exactly once (a
    skipped step drops its pair), the parameters stay finite and the loss goes down. (Half as many
    steps as torch DDP's run: the maths is gradient accumulation's, not torch DDP's, so no equality.)"""
    for v in out:
        ours = v["deft"]
        assert all(math.isfinite(x) for p in ours["params"] for x in p)
        steps = RECIPES[recipe].steps
        merged = sorted(t for its in v["updates"] for t in its)
        assert len(set(merged)) == len(merged) and steps - len(merged) == (2 if "inf" in recipe else 0), v["updates"]
        # merged after the warm-up iteration; the last pair may be cut short by flush()
        assert all(len(its) == 2 for its in v["updates"][1:-1]), v["updates"]
        assert sum(ours["losses"][-4:]) < sum(ours["losses"][:4]), ours["losses"]
        if ours["scale"] is not None:
            assert math.isfinite(ours["scale"]) and ours["scale"] >= 1.0


def nonfinite_worker(rank: int, world: int, workdir: str) -> dict[str, Any]:
    return run(RECIPES["amp_fp16_inf_before_plan"], rank, "measured", None, workdir)


@pytest.mark.slow
def test_default_epsilon_skips_a_nonfinite_gradient_in_its_statistics(tmp_path: Any) -> None:
    """fp16 overflow on one rank while the preserver gathers its statistics (before planning), default
    epsilon, deft planning on its own: no crash, GradScaler skips the step as torch DDP's does, and the
    statistics say which iteration they left out."""
    out = values(run_ranks(nonfinite_worker, 2, (str(tmp_path),), timeout=180))
    for v in out:
        assert v["nonfinite_steps"] == [2], v["nonfinite_steps"]
        assert 2 not in {t for its in v["updates"] for t in its}
        assert v["deft"]["values"][:4] == v["torch"]["values"][:4]  # the scale halved at the same step
        assert all(math.isfinite(x) for p in v["deft"]["params"] for x in p)


def preserver_worker(rank: int, world: int, recipe: str, workdir: str) -> dict[str, Any]:
    r = {**RECIPES, **OPTIMIZER_RECIPES}[recipe]
    # enough warm-up for the noise estimate, so the preserver really decides
    return run(Recipe(r.model, r.step, r.optimizer, steps=40, scaler=r.scaler), rank, "measured", None, workdir,
               observe=True, extra={"warmup_iters": 6, "profile_iters": 3,
                                    # a tenth of the default CP-SAT budget per knapsack: the first plan's
                                    # preserver tries may spend 200 budgets, minutes on a loaded 2-core
                                    # machine (one CI run hit pytest's 300 s); the plan is still exact
                                    # within its budget, and this test checks what it does, not its quality
                                    "solver_time_limit_s": 0.1})


@pytest.mark.slow
@pytest.mark.timeout(600)  # above run_ranks' 480 s below (pyproject's 300 s would cut it short)
@pytest.mark.parametrize("recipe", ["amp_bf16_documented", "clip_from_iteration_15", "grad_norm_logging"])
def test_default_epsilon_with_the_preserver_deciding(recipe: str, tmp_path: Any) -> None:
    """README's loop (``observe_loss``) at the default epsilon, deft profiling and planning on its own in the
    background with adaptation: whatever schedule the preserver picks (lag-free, merged or delayed), nothing
    crashes, every iteration's gradient is applied exactly once (none of a step GradScaler skipped), the
    parameters are finite and agree across ranks, and training makes progress."""
    # The preserver's exact knapsacks in rank 0's background plan take from seconds to minutes on the
    # shared 2-core machine (every rank waits for them at the due iteration, by design): a generous
    # limit, since this test checks what the plan does, not how fast it is found.
    out = values(run_ranks(preserver_worker, 2, (recipe, str(tmp_path)), timeout=480))
    for v in out:
        ours = v["deft"]
        assert v["plan"] == "preserver" and v["stats_reason"].startswith("estimated during warm-up"), v
        applied = sorted(t for its in v["updates"] for t in its)
        assert len(set(applied)) == len(applied) and set(applied) <= set(range(40)), v["updates"]
        assert len(applied) >= 38, v["updates"]  # a skipped step drops at most its merged group
        assert all(math.isfinite(x) for p in ours["params"] for x in p)
        assert sum(ours["losses"][-5:]) < sum(ours["losses"][:5]), ours["losses"]
    assert out[0]["deft"]["params"] == out[1]["deft"]["params"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_several_optimizers_at_the_default_epsilon(tmp_path: Any) -> None:
    """Muon and AdamW at the default epsilon, deft planning on its own: the preserver says why it does not
    judge delayed updates (its walk models one optimizer), every iteration's gradient is applied exactly
    once, the parameters agree across ranks and training makes progress."""
    out = values(run_ranks(preserver_worker, 2, ("muon_and_adamw", str(tmp_path)), timeout=480))
    for v in out:
        ours = v["deft"]
        assert "several" in v["stats_reason"], v["stats_reason"]
        assert sorted(t for its in v["updates"] for t in its) == list(range(40)), v["updates"]
        assert all(math.isfinite(x) for p in ours["params"] for x in p)
        assert sum(ours["losses"][-5:]) < sum(ours["losses"][:5]), ours["losses"]
    assert out[0]["deft"]["params"] == out[1]["deft"]["params"]
