"""Drop-in under the loops people write: each recipe with torch DDP and deft side by side.

At ``epsilon = 0`` deft must give torch DDP's run: parameters (after ``ddp.flush()``), every loss,
everything the loop logged (gradient norms, GradScaler's scale), to 1e-5, on every schedule mode of
:mod:`tests.compat._harness` (a forced schedule that defers buckets past the step; a plan made at once
from a given profile, with adaptation; deft's own profile and a plan made in the background, with
adaptation). The loops are torch's documented ones: the AMP recipe is the one from torch's "Automatic
Mixed Precision" page (``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``, no
``unscale_``).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values
from tests.compat._harness import MLP, Loop, Recipe, close, mlp, run, worst_relative

loss_fn = nn.CrossEntropyLoss()


def _plain(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _amp_documented(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """torch's AMP recipe, verbatim (bf16 autocast on the CPU)."""
    assert loop.scaler is not None
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        output = loop.wrapped(x)
        loss = loss_fn(output, y)
    loop.scaler.scale(loss).backward()
    loop.scaler.step(loop.opt)
    loop.scaler.update()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())
    loop.log.values.append(loop.scaler.get_scale())


def _amp_fp16_inf(at: int) -> Any:
    def step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """fp16 autocast, rank 0's loss made infinite at iteration ``at`` (what GradScaler exists for)."""
        assert loop.scaler is not None
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            loss = loss_fn(loop.wrapped(x), y)
        scaled = loop.scaler.scale(loss * float("inf") if t == at and loop.rank == 0 else loss)
        scaled.backward()
        loop.scaler.step(loop.opt)
        loop.scaler.update()
        loop.opt.zero_grad()
        loop.log.losses.append(loss.item())
        loop.log.values.append(loop.scaler.get_scale())
    return step


_amp_inf_early = _amp_fp16_inf(2)   # before planning
_amp_inf_late = _amp_fp16_inf(14)   # after planning, under the deferring schedule


def _saved(loop: Loop) -> None:
    """A checkpoint of the wrapper, as torch DDP's loops take one anywhere: what it holds, logged."""
    state = loop.wrapped.state_dict()
    loop.log.saved.extend(float(state[f"module.{n}"].double().sum()) for n, _ in loop.model.named_parameters())


def _state_dict_around_the_step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """The wrapper's ``state_dict()`` between ``backward()`` and GradScaler's step, and after the step
    before ``zero_grad()``, where torch DDP allows both; rank 0's loss is infinite at iteration 14, so
    that step is skipped."""
    assert loop.scaler is not None
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        loss = loss_fn(loop.wrapped(x), y)
    loop.scaler.scale(loss * float("inf") if t == 14 and loop.rank == 0 else loss).backward()
    if t % 4 == 1:
        _saved(loop)
    loop.scaler.step(loop.opt)
    loop.scaler.update()
    if t in (13, 14):
        _saved(loop)
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())
    loop.log.values.append(loop.scaler.get_scale())


def _clip_from(start: int) -> Any:
    def step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = loss_fn(loop.wrapped(x), y)
        loss.backward()
        if t >= start:
            norm = torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 0.5)
            loop.log.values.append(float(norm))
        loop.opt.step()
        loop.opt.zero_grad()
        loop.log.losses.append(loss.item())
    return step


_clip_always = _clip_from(0)
_clip_late = _clip_from(15)


def _log_norm(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Reading only: the global gradient norm, for a dashboard."""
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    grads = [p.grad for p in loop.model.parameters() if p.grad is not None]
    loop.log.values.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
    loop.log.values.append(float(len(grads)))
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _log_norm_after(checkpoint: bool) -> Any:
    def step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """The norm read after ``optimizer.step()`` (``checkpoint``: and after a ``state_dict()`` there,
        which applies deft's deferred updates), skipping the parameters without a gradient, as many
        loops do; ``zero_grad()`` at the top of the next iteration."""
        loop.opt.zero_grad()
        loss = loss_fn(loop.wrapped(x), y)
        loss.backward()
        loop.opt.step()
        if checkpoint and t % 4 == 3:
            loop.wrapped.state_dict()
        grads = [p.grad for p in loop.model.parameters() if p.grad is not None]
        loop.log.values.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
                               if grads else 0.0)
        loop.log.values.append(float(len(grads)))
        loop.log.losses.append(loss.item())
    return step


def _zero_to_zeros_after_step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """``zero_grad(set_to_none=False)`` right after the step (the default before torch 2.0)."""
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    loop.opt.step()
    loop.opt.zero_grad(set_to_none=False)
    loop.log.values.append(float(sum(float(p.grad.abs().sum()) for p in loop.model.parameters()
                                     if p.grad is not None)))
    loop.log.losses.append(loss.item())


def _no_sync(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    with loop.wrapped.no_sync():  # type: ignore[operator]
        (0.5 * loss_fn(loop.wrapped(x[:8]), y[:8])).backward()
    loss = 0.5 * loss_fn(loop.wrapped(x[8:]), y[8:])
    loss.backward()
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(norm=True)


def _bn_eval(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """BatchNorm with broadcast buffers; every rank evaluates mid-training under no_grad, then trains on."""
    _plain(loop, t, x, y)
    if t % 8 == 7:
        loop.wrapped.eval()
        with torch.no_grad():
            probe = torch.linspace(-1, 1, 16 * 16).reshape(16, 16)
            loop.log.values.extend(loop.wrapped(probe).flatten().tolist())
        loop.wrapped.train()


def _functional_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(functional=True)


def _two_forwards(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Two forwards of the wrapper, one backward of their summed loss (a siamese or contrastive pair)."""
    loss = loss_fn(loop.wrapped(x), y) + loss_fn(loop.wrapped(x.flip(0)), y.flip(0))
    loss.backward()
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _pseudo_labels(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Pseudo-labels from a forward without gradients in training mode, then the training forward on
    a perturbed batch (FixMatch's shape)."""
    with torch.no_grad():
        pseudo = loop.wrapped(x).argmax(1)
    loss = loss_fn(loop.wrapped(x + 0.1 * torch.sin(x)), torch.where(pseudo == y, pseudo, y))
    loss.backward()
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _input_gradient_penalty(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """WGAN-GP's penalty: the gradient of the output with respect to the input, through
    ``torch.autograd.grad(create_graph=True)``, its norm's distance from 1 added to the loss."""
    x = x.clone().requires_grad_(True)
    out = loop.wrapped(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = loss_fn(out, y) + 0.1 * ((g.norm(2, dim=1) - 1) ** 2).mean()
    loss.backward()
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _parameter_gradient_penalty(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """A penalty on the gradient's norm (gradient regularisation): ``torch.autograd.grad`` of the loss
    with respect to the parameters with ``create_graph=True``, its squared norm added to the loss."""
    loss = loss_fn(loop.wrapped(x), y)
    grads = torch.autograd.grad(loss, list(loop.model.parameters()), create_graph=True)
    total = loss + 0.01 * sum((g ** 2).sum() for g in grads)
    total.backward()
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(total.item())


def _clip_by_value(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """``clip_grad_value_`` between backward and step."""
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_value_(loop.model.parameters(), 0.05)
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _checkpointed_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(checkpointed=True)


def _head_only(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.head.parameters(), lr=0.05, momentum=0.9)  # type: ignore[union-attr]


def _unfreeze_into_the_optimizer(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Fine-tuning: the head trains alone, then the rest joins the optimizer as a new param group (with
    the model's zero_grad, so the parameters outside the optimizer hold no old gradients when they join)."""
    if t == 15:
        head = {id(p) for p in loop.opt.param_groups[0]["params"]}
        loop.opt.add_param_group({"params": [p for p in loop.model.parameters() if id(p) not in head], "lr": 0.02})
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    loop.opt.step()
    loop.model.zero_grad()
    loop.log.losses.append(loss.item())


def _unfreeze_after_optimizer_zero_grad(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """As above with the optimizer's ``zero_grad()``: until they join, the parameters outside the
    optimizer keep summing their gradients, and the new group's first step applies that sum."""
    if t == 15:
        head = {id(p) for p in loop.opt.param_groups[0]["params"]}
        loop.opt.add_param_group({"params": [p for p in loop.model.parameters() if id(p) not in head], "lr": 0.002})
    _plain(loop, t, x, y)


def _head_trained_model_clipped(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """The optimizer holds the head only; the clip and the logged norm take every parameter of the model,
    whose body keeps summing its gradients (the optimizer's ``zero_grad()`` leaves them)."""
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    loop.log.values.append(float(torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 5.0)))
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _never_zeroed(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """No ``zero_grad()`` at all: every step applies the sum of all gradients so far."""
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    loop.opt.step()
    loop.log.losses.append(loss.item())


def _zero_grad_first(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """``zero_grad()`` at the top of the iteration, as many loops (and Lightning's automatic optimization,
    inside its closure after the forward) have it: the last step's gradients are still in ``p.grad``
    while the forward runs, where deft applies what it left finishing."""
    loop.opt.zero_grad()
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    loop.opt.step()
    loop.log.losses.append(loss.item())


def _eval_with_gradients(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Evaluation under ``model.eval()`` alone (gradients enabled, no backward) after the step, then a
    checkpoint of the wrapper, and once deft's ``flush()``: torch DDP allows both there."""
    _plain(loop, t, x, y)
    if t % 5 == 2 or t == 0:
        loop.wrapped.eval()
        probe = torch.linspace(-1, 1, 16 * 16).reshape(16, 16)
        loop.log.values.extend(loop.wrapped(probe).detach().flatten().tolist())
        loop.wrapped.train()
        loop.log.values.append(float(loop.wrapped.state_dict()["module.head.weight"].sum()))
        if loop.is_deft and t == 7:
            loop.wrapped.flush()  # type: ignore[operator]


def _between_backward_and_step(edit: Callable[[Loop, int], None]) -> Any:
    def step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = loss_fn(loop.wrapped(x), y)
        loss.backward()
        edit(loop, t)
        loop.opt.step()
        loop.opt.zero_grad()
        loop.log.losses.append(loss.item())
    return step


def _head_left_out(loop: Loop, t: int) -> None:
    """Every other step leaves the head out: its ``p.grad`` set to None (the optimizer skips it)."""
    if t % 2:
        for p in loop.model.head.parameters():  # type: ignore[union-attr]
            p.grad = None


def _zero_grad_instead(loop: Loop, t: int) -> None:
    """Now and then the loop drops the whole step's gradient (``zero_grad()``: None) before stepping."""
    if t % 5 == 3:
        loop.model.zero_grad()


def _grad_data_replaced(loop: Loop, t: int) -> None:
    """Each gradient replaced through ``.data`` (older clipping code): the step applies the new tensor."""
    for p in loop.model.parameters():
        if p.grad is not None:
            p.grad.data = p.grad.data.clamp(-0.05, 0.05)


def _first_layer_frozen() -> nn.Module:
    """The body's first layer frozen when the module is wrapped: torch DDP and deft leave it out."""
    m = mlp()
    for p in m.body[0].parameters():  # type: ignore[index]
        p.requires_grad_(False)
    return m


def _unfrozen_after_wrapping(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Fine-tuning that unfreezes a layer of the wrapped module (Lightning's ``BackboneFinetuning``): its
    gradient is averaged by neither wrapper; each rank's optimizer steps it once per step on its own."""
    if t == 8:
        for p in loop.model.body[0].parameters():  # type: ignore[index]
            p.requires_grad_(True)
    _zero_grad_first(loop, t, x, y)


def _middle_layer_ignored() -> nn.Module:
    """torch DDP's ignore list names a weight in the middle of the model (each rank trains its own)."""
    m = mlp()
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(m, ["body.2.weight"])
    return m


def _small_sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.002)


def _adam(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)


RECIPES: dict[str, Recipe] = {
    "plain": Recipe(mlp, _plain),
    "amp_bf16_documented": Recipe(mlp, _amp_documented, scaler=True),
    "amp_fp16_inf_before_plan": Recipe(mlp, _amp_inf_early, scaler=True),
    "amp_fp16_inf_after_plan": Recipe(mlp, _amp_inf_late, scaler=True),
    "grad_set_to_none_for_the_head": Recipe(mlp, _between_backward_and_step(_head_left_out)),
    "zero_grad_between_backward_and_step": Recipe(mlp, _between_backward_and_step(_zero_grad_instead)),
    "grad_data_replaced": Recipe(mlp, _between_backward_and_step(_grad_data_replaced)),
    "state_dict_between_backward_and_step": Recipe(mlp, _state_dict_around_the_step, scaler=True),
    "clip_from_start": Recipe(mlp, _clip_always),
    "clip_from_iteration_15": Recipe(mlp, _clip_late),
    "grad_norm_logging": Recipe(mlp, _log_norm),
    "grad_norm_after_step": Recipe(mlp, _log_norm_after(checkpoint=False)),
    "grad_norm_after_step_and_state_dict": Recipe(mlp, _log_norm_after(checkpoint=True)),
    "zero_grad_to_zeros_after_step": Recipe(mlp, _zero_to_zeros_after_step),
    "no_sync": Recipe(mlp, _no_sync),
    "batchnorm_eval_mid_training": Recipe(_bn_model, _bn_eval),
    "checkpoint_and_resume": Recipe(mlp, _plain, optimizer=_adam, restart_at=13),
    "checkpoint_of_the_module": Recipe(mlp, _plain, optimizer=_adam, restart_at=13, restart_from="module"),
    "checkpoint_through_dcp": Recipe(mlp, _plain, optimizer=_adam, restart_at=13, restart_from="dcp"),
    "checkpoint_by_pickling_the_wrapper": Recipe(mlp, _plain, optimizer=_adam, restart_at=13, restart_from="pickle"),
    "functional_parameter_use": Recipe(_functional_model, _plain, optimizer=_adam),
    "activation_checkpointing": Recipe(_checkpointed_model, _plain, optimizer=_adam),
    "two_forwards_one_backward": Recipe(mlp, _two_forwards),
    "pseudo_labels_from_a_no_grad_forward": Recipe(mlp, _pseudo_labels),
    "input_gradient_penalty": Recipe(mlp, _input_gradient_penalty),
    "parameter_gradient_penalty": Recipe(mlp, _parameter_gradient_penalty),
    "clip_grad_value": Recipe(mlp, _clip_by_value),
    "add_param_group_mid_training": Recipe(mlp, _unfreeze_into_the_optimizer, optimizer=_head_only),
    "add_param_group_after_optimizer_zero_grad": Recipe(mlp, _unfreeze_after_optimizer_zero_grad,
                                                        optimizer=_head_only),
    "optimizer_over_the_head_model_clipped": Recipe(mlp, _head_trained_model_clipped, optimizer=_head_only),
    "gradients_never_zeroed": Recipe(mlp, _never_zeroed, optimizer=_small_sgd),
    "zero_grad_before_the_forward": Recipe(mlp, _zero_grad_first),
    "evaluation_with_gradients_then_checkpoint": Recipe(mlp, _eval_with_gradients, optimizer=_adam, restart_at=13),
    "layer_unfrozen_after_wrapping": Recipe(_first_layer_frozen, _unfrozen_after_wrapping, ranks_agree=False),
    "ignore_list_with_zero_grad_before_the_forward": Recipe(_middle_layer_ignored, _zero_grad_first,
                                                            ranks_agree=False),
}


def _ema_after_step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """An EMA of the weights, torch's ``AveragedModel`` made from the wrapped model, updated after every step."""
    if "ema" not in loop.kept:
        ema_fn = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        loop.kept["ema"] = torch.optim.swa_utils.AveragedModel(loop.model, multi_avg_fn=ema_fn)
    _plain(loop, t, x, y)
    loop.kept["ema"].update_parameters(loop.model)
    if t % 6 == 5:
        loop.log.values.extend(loop.kept["ema"].module.head.weight.flatten().tolist())


def _weight_clipping(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """WGAN's critic: every weight clamped into [-0.2, 0.2] right after the step, through ``p.data``."""
    _plain(loop, t, x, y)
    for p in loop.model.parameters():
        p.data.clamp_(-0.2, 0.2)


def _penalty_before_forward(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """An L2 penalty computed from the parameters before the forward and added to its loss."""
    penalty = 1e-2 * sum((p ** 2).sum() for p in loop.model.parameters())
    loss = loss_fn(loop.wrapped(x), y) + penalty
    loss.backward()
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _optimizer_state_logged(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Adam's second moments summed after the step, for a dashboard."""
    _plain(loop, t, x, y)
    loop.log.values.append(float(sum(float(s["exp_avg_sq"].sum()) for s in loop.opt.state.values())))


def _rollback(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """A rollback to a snapshot in memory (after a loss spike): the module's and the optimizer's state
    copied after the step of iteration 7, loaded after that of iteration 15, the optimizer first."""
    _plain(loop, t, x, y)
    if t == 7:
        loop.kept["snapshot"] = copy.deepcopy((loop.model.state_dict(), loop.opt.state_dict()))
    if t == 15:
        model_state, opt_state = loop.kept["snapshot"]
        loop.opt.load_state_dict(opt_state)
        loop.model.load_state_dict(model_state)


def _whole_model_saved(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """torch's "save the entire model" after the step, now and then: ``torch.save(model)`` (the module
    pickled with its hooks), loaded back and run on a probe."""
    _plain(loop, t, x, y)
    if t % 4 == 1:
        buf = io.BytesIO()
        torch.save(loop.model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        loop.log.values.extend(loaded(torch.linspace(-1, 1, 4 * 16).reshape(4, 16)).flatten().tolist())


def _wrapper_copied(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """``copy.deepcopy`` of the wrapper after the step (a frozen copy to evaluate, on every rank), run
    on a probe under ``torch.no_grad()`` then and later."""
    _plain(loop, t, x, y)
    if t == 5:
        loop.kept["copy"] = copy.deepcopy(loop.wrapped)
    if t >= 5 and t % 3 == 2:
        with torch.no_grad():
            out = loop.kept["copy"](torch.linspace(-1, 1, 4 * 16).reshape(4, 16))
        loop.log.values.extend(out.flatten().tolist())


#: Loops that use the parameters (or their optimizer state) between the step and the next forward.
USE_AFTER_STEP: dict[str, Recipe] = {
    "ema_after_step": Recipe(mlp, _ema_after_step),
    "weight_clipping_after_step": Recipe(mlp, _weight_clipping),
    "penalty_before_forward": Recipe(mlp, _penalty_before_forward),
    "optimizer_state_logged_after_step": Recipe(mlp, _optimizer_state_logged, optimizer=_adam),
    "rollback_to_a_snapshot": Recipe(mlp, _rollback),
    "whole_model_saved_after_step": Recipe(mlp, _whole_model_saved),
    "wrapper_deep_copied_after_step": Recipe(mlp, _wrapper_copied),
}
#: ... of which those where a hook applies the deferred updates before the use (the optimizer's
#: ``load_state_dict``; the wrapper's record, taken by its copy), not the watch.
APPLIED_BY_HOOKS = {"rollback_to_a_snapshot", "wrapper_deep_copied_after_step"}


#: Recipes whose loop touches every gradient between backward() and step().
READS_EVERY_GRADIENT = {"amp_bf16_documented", "amp_fp16_inf_before_plan", "amp_fp16_inf_after_plan",
                        "state_dict_between_backward_and_step", "grad_data_replaced",
                        "clip_from_start", "grad_norm_logging", "optimizer_over_the_head_model_clipped",
                        "clip_grad_value"}


#: The schedule modes of :mod:`tests.compat._harness` every recipe runs in.
MODES = ("forced", "given", "measured")


def compat_worker(rank: int, world: int, recipe: str, mode: str, workdir: str) -> dict[str, Any]:
    return run({**RECIPES, **USE_AFTER_STEP}[recipe], rank, mode, 0.0, workdir)


def check_exact(out: list[dict[str, Any]], ranks_agree: bool = True) -> None:
    for v in out:
        ref, ours = v["torch"], v["deft"]
        worst = worst_relative(ours["params"], ref["params"])
        assert worst < 1e-5, f"parameters differ from torch DDP's by {worst:.3g}"
        assert close(ours["losses"], ref["losses"]), (ours["losses"], ref["losses"])
        assert close(ours["values"], ref["values"]), (ours["values"], ref["values"])
        assert close(ours["saved"], ref["saved"]), (ours["saved"], ref["saved"])
        assert ours["scale"] == ref["scale"]
    assert (out[0]["deft"]["params"] == out[1]["deft"]["params"]) == ranks_agree


def check_recipe(r: Recipe, mode: str, reads_every_gradient: bool, out: list[dict[str, Any]]) -> None:
    """What every recipe must show in ``mode`` (``reads_every_gradient``: its loop touches every gradient
    between backward() and step())."""
    check_exact(out, r.ranks_agree)
    if mode in ("forced", "given"):
        # Both schedules defer buckets past the step. A loop that reads every gradient before the step
        # (GradScaler's inf check, a global clip, a logged norm) waits for them there, so no update is
        # left finishing after its step; any other loop keeps the overlap.
        assert (out[0]["deferred"] == 0) == reads_every_gradient, out[0]
    if mode == "forced":  # one update per iteration, each applied once (none of a skipped step)
        # a wrapper resumed from the module's own state_dict starts counting iterations afresh
        first = r.restart_at if r.restart_from == "module" and r.restart_at is not None else 0
        assert out[0]["updates"] == [[t - first] for t in range(first, r.steps)
                                     if t not in _skipped(out[0])], out[0]["updates"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_matches_torch_ddp_at_epsilon_zero(recipe: str, mode: str, tmp_path: Any) -> None:
    out = values(run_ranks(compat_worker, 2, (recipe, mode, str(tmp_path)), timeout=180))
    check_recipe(RECIPES[recipe], mode, recipe in READS_EVERY_GRADIENT, out)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(USE_AFTER_STEP))
def test_a_loop_using_parameters_after_the_step_matches_torch_ddp(recipe: str, tmp_path: Any) -> None:
    """Under a schedule that leaves updates finishing in the next forward, a loop using the parameters
    before that forward sees what torch DDP's step left, and deft says it gave up the overlap there."""
    out = values(run_ranks(compat_worker, 2, (recipe, "forced", str(tmp_path)), timeout=180))
    check_exact(out)
    used = out[0]["used_before_forward"]
    assert (used is None) == (recipe in APPLIED_BY_HOOKS), out[0]
    assert out[0]["updates"] == [[t] for t in range(USE_AFTER_STEP[recipe].steps)], out[0]["updates"]


@pytest.mark.slow
def test_a_loop_that_uses_no_parameter_after_the_step_keeps_the_overlap(tmp_path: Any) -> None:
    """The plain loop (zero_grad, the next batch) uses no parameter there: nothing is recorded, every
    update after the first is left finishing in the forward (the first step shows deft the optimizer,
    whose hyperparameters a deferred update needs: that update is whole)."""
    out = values(run_ranks(compat_worker, 2, ("plain", "forced", str(tmp_path)), timeout=180))
    assert out[0]["used_before_forward"] is None
    assert out[0]["deferred"] == RECIPES["plain"].steps - 1


def _skipped(v: dict[str, Any]) -> set[int]:
    """Iterations whose step GradScaler skipped (the scale halved after them)."""
    scales = v["torch"]["values"] if v["torch"]["scale"] is not None else []
    prev = 2.0 ** 12
    out = set()
    for t, s in enumerate(scales):
        if s < prev:
            out.add(t)
        prev = s
    return out


#: The documented loops that touch gradients between backward() and step(), and the plain one.
QUEUED_RECIPES = ("plain", "amp_bf16_documented", "amp_fp16_inf_after_plan", "clip_from_start", "grad_norm_logging")


def queued_worker(rank: int, world: int, recipe: str, workdir: str) -> dict[str, Any]:
    return run(RECIPES[recipe], rank, "forced", 0.0, workdir, extra={"link_queue": True})  # the default codecs


@pytest.mark.slow
@pytest.mark.parametrize("recipe", QUEUED_RECIPES)
def test_recipe_with_the_link_queue_matches_torch_ddp_at_epsilon_zero(recipe: str, tmp_path: Any) -> None:
    # link_queue (opt-in): each gloo link's sends one at a time, the forced schedule deferring two buckets
    out = values(run_ranks(queued_worker, 2, (recipe, str(tmp_path)), timeout=180))
    check_exact(out)
    assert (out[0]["deferred"] == 0) == (recipe in READS_EVERY_GRADIENT), out[0]
