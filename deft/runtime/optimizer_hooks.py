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

``optimizer.step(closure)`` (torch's documented form; Lightning's precision plugins step this way): the
closure runs forward and backward inside the step, after the pre hook, so the pre hook does not call
``before()`` itself; it wraps the closure, whose wrapper calls ``before()`` once the closure returns,
right before the optimizer reads ``p.grad`` (:func:`wrap_closure`). An optimizer that evaluates its
closure several times per step (``torch.optim.LBFGS``: each evaluation needs the averaged gradient at
the parameters it just moved to) is refused at its first step, before anything is applied.

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

#: An optimizer step's call arguments as torch's step hooks get them: ``(args, kwargs)``, ``args[0]`` the optimizer.
StepArgs = tuple[tuple[object, ...], dict[str, object]]


class OptimizerBinding:
    """Finds the module's one optimizer and calls ``before()``/``after()`` (the runtime's bound methods,
    held weakly) right before and right after each of its steps, and ``fresh()`` before its
    ``state_dict()`` is taken, so that a checkpoint of the optimizer alone holds every update applied,
    and before its ``load_state_dict()``, so that no update in flight writes into the state loaded."""

    def __init__(self, params: list[torch.Tensor], before: Callable[[], None], after: Callable[[], None],
                 optimizer: torch.optim.Optimizer | None, fresh: Callable[[], None] | None = None) -> None:
        self._mine = {id(p) for p in params}
        self._before, self._after = weakref.WeakMethod(before), weakref.WeakMethod(after)
        self._fresh = None if fresh is None else weakref.WeakMethod(fresh)
        self.optimizer: torch.optim.Optimizer | None = None
        self.internal = False  # deft's own step (an earlier due update): no interception
        self._bound = optimizer is not None
        self._handles: list[RemovableHandle] = []
        if optimizer is not None:
            if not self._steps_mine(optimizer):
                raise DeftError("the optimizer given to deft.DistributedDataParallel steps none of the module's "
                                "trainable parameters")
            self._adopt(optimizer)
            self._handles += [optimizer.register_step_pre_hook(_hook(self, "pre", bound=True)),
                              optimizer.register_step_post_hook(_post_hook(self, bound=True))]
        self._handles += [register_optimizer_step_pre_hook(_hook(self, "pre", bound=False)),
                          register_optimizer_step_post_hook(_post_hook(self, bound=False))]

    def _adopt(self, opt: torch.optim.Optimizer) -> None:
        """``opt`` is the module's optimizer: its ``state_dict()`` first finishes what is in flight."""
        self.optimizer = opt
        fresh = self._fresh
        if fresh is None:
            return

        def before_state_dict(_: torch.optim.Optimizer) -> None:
            fn = fresh()
            if fn is not None:
                fn()

        def before_load(_: torch.optim.Optimizer, state: dict[str, object]) -> None:
            fn = fresh()  # the state loaded replaces what an update in flight would write to
            if fn is not None:
                fn()

        self._handles += [opt.register_state_dict_pre_hook(before_state_dict),
                          opt.register_load_state_dict_pre_hook(before_load)]

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
        self._adopt(opt)
        return True

    def fire(self, which: str, opt: torch.optim.Optimizer, bound: bool, args: StepArgs) -> StepArgs | None:
        """One step hook: ``before()`` or ``after()`` when it is the module's optimizer's; returns the
        step's arguments with the closure wrapped when the step has one (:func:`wrap_closure`)."""
        before, after = self._before(), self._after()
        if before is None or after is None or self.internal:
            return None
        if bound:
            act = True
        elif not self._bound:
            # Global hooks: the pre hook claims (and checks for a second optimizer); the post hook
            # only follows the claimed optimizer.
            act = self.claims(opt) if which == "pre" else opt is self.optimizer
        else:
            act = False
            if which == "pre":
                self.claims(opt)  # bound: the global hook only checks for a second optimizer
        if not act:
            return None
        if which == "post":
            after()
            return None
        wrapped = wrap_closure(opt, args, before)
        if wrapped is None:
            before()
        return wrapped

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
          ) -> Callable[[torch.optim.Optimizer, tuple[object, ...], dict[str, object]], StepArgs | None]:
    """The one hook factory: a weak reference to the binding, so a dropped wrapper stops intercepting."""
    ref = weakref.ref(binding)

    def hook(opt: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> StepArgs | None:
        b = ref()
        return None if b is None else b.fire(which, opt, bound, (args, kwargs))
    return hook


def _post_hook(binding: OptimizerBinding, bound: bool
               ) -> Callable[[torch.optim.Optimizer, tuple[object, ...], dict[str, object]], None]:
    """A post hook returns nothing (torch's signature)."""
    fire = _hook(binding, "post", bound)

    def hook(opt: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        fire(opt, args, kwargs)
    return hook


def wrap_closure(opt: torch.optim.Optimizer, step_args: StepArgs, before: Callable[[], None]) -> StepArgs | None:
    """``optimizer.step(closure)``: the step's arguments with the closure replaced by one that calls
    ``before()`` after it returns (None: the step has no closure). ``args[0]`` is the optimizer itself
    (torch passes the bound call's arguments). Refuses an optimizer that calls its closure more than once
    per step, by type before the step, or at the second call."""
    args, kwargs = step_args
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None
    if not callable(closure):
        raise DeftError(f"optimizer.step(closure): the closure is not callable ({type(closure).__name__})")
    if isinstance(opt, torch.optim.LBFGS):
        raise DeftError("deft.DistributedDataParallel does not support torch.optim.LBFGS: it evaluates its "
                        "closure several times per step, each needing the averaged gradient at parameters it "
                        "just moved, while deft applies one update per step; use torch DDP for LBFGS")
    calls = 0

    def deft_closure() -> object:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise DeftError(f"{type(opt).__name__}.step(closure) called its closure a second time in one step; "
                            "deft applies one update per step (the first evaluation's gradient)")
        loss = closure()
        before()  # the closure's backward put the due update into p.grad: the optimizer reads it next
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": deft_closure}
    return (args[0], deft_closure, *args[2:]), kwargs


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
