"""Optimizer interception: deft applies each due update inside the user's ``optimizer.step()``.

torch's step pre/post hooks let deft put the averaged gradient of every due update into ``p.grad``
just before the optimizer reads it, and clear it after. Two ways to find the optimizer:

* given (``optimizer=`` at construction): hooks on that optimizer alone (*bound*);
* not given: torch's *global* optimizer-step hooks see every optimizer; the first one that steps a
  trainable parameter of the module is claimed.

The global hooks are installed in both cases: they also catch a *second* optimizer stepping the
module's parameters, which would silently never see a gradient (one optimizer per module; several
``param_groups`` are fine). A wrapper whose inner optimizer shares the claimed one's
``param_groups`` (Lookahead-style) is the same optimizer.

Hooks hold a weak reference to their owner, so a dropped wrapper stops intercepting.

Merged updates (``config.merge_lr_scaling``): the one optimizer step that applies an update merging
``k`` iterations runs with every param group's ``lr`` multiplied by ``1``, ``k`` or ``sqrt k``
(:func:`scale_lr` before, :func:`restore_lr` right after, in the step's pre and post hooks), so an LR
scheduler stepping after ``optimizer.step()`` sees and sets its own values.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from deft.errors import DeftError
from deft.preserver.gaussian_walk import merge_lr_factor

#: A param group's learning rate: a float, or a tensor (torch accepts both).
LearningRate = float | torch.Tensor


class OptimizerBinding:
    """Finds the module's one optimizer and calls ``before()``/``after()`` (the runtime's bound methods,
    held weakly) right before and right after each of its steps."""

    def __init__(self, params: list[torch.Tensor], before: Callable[[], None], after: Callable[[], None],
                 optimizer: torch.optim.Optimizer | None) -> None:
        self._mine = {id(p) for p in params}
        self._before, self._after = weakref.WeakMethod(before), weakref.WeakMethod(after)
        self.optimizer: torch.optim.Optimizer | None = None
        self.internal = False  # deft's own step (an earlier due update): no interception
        self._bound = optimizer is not None
        self._handles: list[RemovableHandle] = []
        if optimizer is not None:
            if not self._steps_mine(optimizer):
                raise DeftError("the optimizer given to deft.DistributedDataParallel steps none of the module's "
                                "trainable parameters")
            self.optimizer = optimizer
            self._handles += [optimizer.register_step_pre_hook(_hook(self, "pre", bound=True)),
                              optimizer.register_step_post_hook(_hook(self, "post", bound=True))]
        self._handles += [register_optimizer_step_pre_hook(_hook(self, "pre", bound=False)),
                          register_optimizer_step_post_hook(_hook(self, "post", bound=False))]

    def _steps_mine(self, opt: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._mine for g in opt.param_groups for p in g["params"])

    def claims(self, opt: torch.optim.Optimizer) -> bool:
        """Is ``opt`` the module's optimizer? Claims it the first time; a second optimizer over the
        module's trainable parameters is an error."""
        if self.optimizer is not None:
            if opt is self.optimizer:
                return True
            if opt.param_groups is self.optimizer.param_groups:
                return False  # a wrapper's inner optimizer (Lookahead-style), stepped inside the claimed one
            if self._steps_mine(opt):
                raise DeftError(f"a second optimizer ({type(opt).__name__}) steps parameters of a "
                                "deft.DistributedDataParallel module, which already has one "
                                f"({type(self.optimizer).__name__}); deft applies each update through one "
                                "optimizer per module: use one optimizer with several param_groups")
            return False
        if not self._steps_mine(opt):
            return False
        self.optimizer = opt
        return True

    def fire(self, which: str, opt: torch.optim.Optimizer, bound: bool) -> None:
        before, after = self._before(), self._after()
        if before is None or after is None or self.internal:
            return
        if bound:
            (before if which == "pre" else after)()
        elif not self._bound:
            # Global hooks: the pre hook claims (and checks for a second optimizer); the post hook
            # only follows the claimed optimizer.
            if which == "pre" and self.claims(opt):
                before()
            elif which == "post" and opt is self.optimizer:
                after()
        elif which == "pre":
            self.claims(opt)  # bound: the global hook only checks for a second optimizer

    def step_internally(self) -> None:
        """Run ``optimizer.step()`` for an update the user's step does not apply (several due at once)."""
        if self.optimizer is None:
            raise DeftError("deft needs the optimizer to apply pending updates: pass optimizer= to "
                            "deft.DistributedDataParallel or call optimizer.step() once before")
        self.internal = True
        try:
            self.optimizer.step()
        finally:
            self.internal = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _hook(binding: OptimizerBinding, which: str, bound: bool
          ) -> Callable[[torch.optim.Optimizer, tuple[object, ...], dict[str, object]], None]:
    """The one hook factory: a weak reference to the binding, so a dropped wrapper stops intercepting."""
    ref = weakref.ref(binding)

    def hook(opt: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        b = ref()
        if b is not None:
            b.fire(which, opt, bound)
    return hook


# -- learning-rate scaling of merged updates (config.merge_lr_scaling) -----------------------------
def scale_lr(optimizer: torch.optim.Optimizer, factor: float) -> list[LearningRate] | None:
    """Multiply every param group's ``lr`` by ``factor`` for one step; returns the previous values for
    :func:`restore_lr` (``None`` when ``factor == 1``: nothing changed). The group's ``lr`` objects are
    replaced, not mutated (a tensor ``lr`` stays the user's tensor), so restoring gives back exactly what
    an LR scheduler set."""
    if factor == 1.0:
        return None
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = g["lr"] * factor
    return saved


def restore_lr(optimizer: torch.optim.Optimizer, saved: list[LearningRate] | None) -> None:
    """Undo :func:`scale_lr`."""
    if saved is None:
        return
    for g, lr in zip(optimizer.param_groups, saved, strict=True):
        g["lr"] = lr


@contextmanager
def merged_lr(optimizer: torch.optim.Optimizer, k: int, scaling: str) -> Iterator[float]:
    """One optimizer step of a merged update of ``k`` iterations: ``lr`` times
    :func:`deft.preserver.gaussian_walk.merge_lr_factor` ``(k, scaling)`` inside, restored after."""
    factor = merge_lr_factor(k, scaling)
    saved = scale_lr(optimizer, factor)
    try:
        yield factor
    finally:
        restore_lr(optimizer, saved)
