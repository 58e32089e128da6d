"""Drop-in under the optimizers people use: each with torch DDP and deft side by side at epsilon 0.

The recipes of :mod:`tests.compat.test_loops`, with what changes there: torch's other per-parameter
optimizers (SGD nesterov, centered RMSprop, Adagrad, Adam amsgrad on its for-loop path and fused), param
groups with their own rates, learning rates changed by a scheduler or by hand after the step or between
``backward()`` and ``step()``, and several optimizers over one module (torch's Muon with AdamW, SGD with
Adam resumed from a checkpoint, GradScaler stepping each, one stepping every other iteration, two in
turns). Each must give torch DDP's run in every schedule mode (:func:`tests.compat.test_loops.check_recipe`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values
from tests.compat._harness import Loop, Recipe, mlp, run
from tests.compat.test_loops import MODES, _plain, check_recipe, loss_fn


def _one_cycle(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """A learning-rate schedule stepped after every optimizer step (``OneCycleLR``), the rate logged."""
    if "sched" not in loop.kept:
        loop.kept["sched"] = torch.optim.lr_scheduler.OneCycleLR(loop.opt, max_lr=0.1, total_steps=30)
    _plain(loop, t, x, y)
    loop.kept["sched"].step()
    loop.log.values.append(loop.opt.param_groups[0]["lr"])


def _lr_set_by_hand(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """The rate and the momentum written into the param groups by hand after the step (a warm-up)."""
    _plain(loop, t, x, y)
    for group in loop.opt.param_groups:
        group["lr"] = 0.05 * min(1.0, (t + 2) / 10)
        group["momentum"] = 0.9 if t % 2 else 0.5


def _nesterov(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _rmsprop(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5, centered=True)


def _adagrad(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(m.parameters(), lr=0.05)


def _adam_no_foreach(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=3e-3, foreach=False, amsgrad=True)


def _adam_fused(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=3e-3, fused=True)


def _param_groups(m: nn.Module) -> torch.optim.Optimizer:
    body = [p for n, p in m.named_parameters() if n.startswith("body")]
    rest = [p for n, p in m.named_parameters() if not n.startswith("body")]
    return torch.optim.SGD([{"params": body, "lr": 0.01}, {"params": rest, "weight_decay": 1e-2}],
                           lr=0.05, momentum=0.9)


class Optimizers(torch.optim.Optimizer):
    """Several optimizers stepped one after another, as a loop steps them (``for opt in optimizers:
    opt.step()``); the harness's one ``opt`` (its state_dict holds each one's)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {str(i): o.state_dict() for i, o in enumerate(self.optimizers)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        for i, o in enumerate(self.optimizers):
            o.load_state_dict(state_dict[str(i)])


def _muon_and_adamw(m: nn.Module) -> torch.optim.Optimizer:
    """torch's Muon for the matrices, AdamW for the rest (Muon takes 2-D parameters only)."""
    matrices = [p for p in m.parameters() if p.ndim == 2]
    rest = [p for p in m.parameters() if p.ndim != 2]
    return Optimizers(torch.optim.Muon(matrices, lr=0.02, momentum=0.95),
                      torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01))


def _sgd_and_adam(m: nn.Module) -> torch.optim.Optimizer:
    """The body's parameters under SGD, the rest under Adam."""
    body = [p for n, p in m.named_parameters() if n.startswith("body")]
    rest = [p for n, p in m.named_parameters() if not n.startswith("body")]
    return Optimizers(torch.optim.SGD(body, lr=0.05, momentum=0.9), torch.optim.Adam(rest, lr=3e-3))


def _amp_two_optimizers(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """torch's AMP recipe with two optimizers: ``scaler.step`` for each (each unscaled and checked for
    inf at its own step), one ``scaler.update()``; rank 0's loss infinite at iteration 14."""
    assert loop.scaler is not None and isinstance(loop.opt, Optimizers)
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        loss = loss_fn(loop.wrapped(x), y)
    loop.scaler.scale(loss * float("inf") if t == 14 and loop.rank == 0 else loss).backward()
    for o in loop.opt.optimizers:
        loop.scaler.step(o)
    loop.scaler.update()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())
    loop.log.values.append(loop.scaler.get_scale())


def _second_optimizer_every_other_step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """The first optimizer steps every iteration, the second every other one (its gradients zeroed
    either way): a step that ends at the next forward."""
    assert isinstance(loop.opt, Optimizers)
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    first, second = loop.opt.optimizers
    first.step()
    if t % 2:
        second.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _optimizers_in_turns(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Block-coordinate training: one optimizer steps in even iterations, the other in odd ones; both
    zero their gradients every iteration."""
    assert isinstance(loop.opt, Optimizers)
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    loop.opt.optimizers[t % 2].step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


def _lr_set_before_step(loop: Loop, t: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """The rate written into the param groups between ``backward()`` and ``step()`` (a warm-up computed
    from the iteration, as some loops do right before stepping)."""
    loss = loss_fn(loop.wrapped(x), y)
    loss.backward()
    for group in loop.opt.param_groups:
        group["lr"] = 0.05 * min(1.0, (t + 1) / 8)
    loop.opt.step()
    loop.opt.zero_grad()
    loop.log.losses.append(loss.item())


RECIPES: dict[str, Recipe] = {
    "one_cycle_lr_schedule": Recipe(mlp, _one_cycle),
    "lr_and_momentum_set_by_hand": Recipe(mlp, _lr_set_by_hand),
    "lr_set_between_backward_and_step": Recipe(mlp, _lr_set_before_step),
    "sgd_nesterov": Recipe(mlp, _plain, optimizer=_nesterov),
    "rmsprop_centered": Recipe(mlp, _plain, optimizer=_rmsprop),
    "adagrad": Recipe(mlp, _plain, optimizer=_adagrad),
    "adam_amsgrad_for_loop": Recipe(mlp, _plain, optimizer=_adam_no_foreach),
    "adam_fused": Recipe(mlp, _plain, optimizer=_adam_fused),
    "param_groups": Recipe(mlp, _plain, optimizer=_param_groups),
    "muon_and_adamw": Recipe(mlp, _plain, optimizer=_muon_and_adamw),
    "sgd_and_adam_checkpointed": Recipe(mlp, _plain, optimizer=_sgd_and_adam, restart_at=13),
    "amp_fp16_two_optimizers": Recipe(mlp, _amp_two_optimizers, optimizer=_sgd_and_adam, scaler=True),
    "second_optimizer_every_other_step": Recipe(mlp, _second_optimizer_every_other_step, optimizer=_sgd_and_adam),
    "optimizers_in_turns": Recipe(mlp, _optimizers_in_turns, optimizer=_sgd_and_adam),
}
#: Recipes whose loop touches every gradient between backward() and step() (GradScaler's unscale).
READS_EVERY_GRADIENT = {"amp_fp16_two_optimizers"}
#: Recipes that change only the optimizer's own maths or hyperparameters: the forced schedule (a deferred
#: part applied with the step's hyperparameters, module by module) is the mode where deft could differ;
#: the others plan and adapt as for SGD.
ONE_MODE = {"sgd_nesterov", "rmsprop_centered", "adagrad", "adam_amsgrad_for_loop", "adam_fused", "param_groups",
            "one_cycle_lr_schedule", "lr_and_momentum_set_by_hand"}
CASES = [(recipe, mode) for recipe in sorted(RECIPES) for mode in MODES if mode == "forced" or recipe not in ONE_MODE]


def optimizers_worker(rank: int, world: int, recipe: str, mode: str, workdir: str) -> dict[str, Any]:
    return run(RECIPES[recipe], rank, mode, 0.0, workdir)


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "mode"), CASES)
def test_optimizer_recipe_matches_torch_ddp_at_epsilon_zero(recipe: str, mode: str, tmp_path: Any) -> None:
    out = values(run_ranks(optimizers_worker, 2, (recipe, mode, str(tmp_path)), timeout=180))
    check_recipe(RECIPES[recipe], mode, recipe in READS_EVERY_GRADIENT, out)
