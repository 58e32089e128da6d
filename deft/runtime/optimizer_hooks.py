"""Optimizer interception: deft applies each due update inside the user's ``optimizer.step()``.

torch's step pre/post hooks let deft put the averaged gradient of every due update into ``p.grad``
just before the optimizer reads it, and clear it after. Two ways to find the optimizer:

* given (``optimizer=`` at construction): hooks on that optimizer (*bound*);
* not given: torch's *global* optimizer-step hooks see every optimizer; the first one that steps a
  trainable parameter of the module is claimed.

The global hooks are installed in both cases: they also see the module's other optimizers.

Several optimizers (the *members*: Muon for the matrices and AdamW for the rest, separate optimizers
for the embeddings, GradScaler's documented loop over two optimizers) are an iteration's step when
they step one after another between a backward and the next forward: the first member's pre hook
calls ``before()``, the step ends (``after()``) at the post hook of the last member still to step, or
at the next forward when a member does not step in this iteration (:meth:`OptimizerBinding.close_open_step`;
GradScaler skips an optimizer whose gradients hold inf), or when a member steps a second time. Each
member's pre hook first calls ``settle(params)`` on its own parameters, so that what the loop does to a
member's gradients before that member steps (GradScaler unscales each optimizer at its own step) is
what it applies. An optimizer over the module's parameters joins the members at its first step: as
the iteration's first to step, inside an open step, or after it and before the next forward (the
first iteration shows deft the optimizers one by one: the step has ended when the second steps, and
``p.grad`` holds what the first left, torch DDP's averaged gradient). Members that step in turns
(one per iteration) are as right: each iteration's step is the members that stepped in it. A wrapper
whose inner optimizer shares a member's ``param_groups`` (Lookahead-style) is that member.

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
from typing import Any

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
    """Finds the module's optimizers and calls ``before()``/``after()`` (the runtime's bound methods,
    held weakly) right before and right after each iteration's step, ``settle(params)`` before each
    member's own step and ``stepped()`` after it, and ``fresh()`` before a member's ``state_dict()`` is
    taken, so that a checkpoint of the optimizer alone holds every update applied, and before its
    ``load_state_dict()``, so that no update in flight writes into the state loaded (module docstring)."""

    def __init__(self, params: list[torch.Tensor], before: Callable[[], None], after: Callable[[], None],
                 optimizer: torch.optim.Optimizer | None, fresh: Callable[[], None] | None = None,
                 settle: Callable[[list[torch.Tensor]], None] | None = None,
                 stepped: Callable[[], None] | None = None) -> None:
        self._params = params
        self._mine = {id(p) for p in params}
        self._before, self._after = weakref.WeakMethod(before), weakref.WeakMethod(after)
        self._fresh = None if fresh is None else weakref.WeakMethod(fresh)
        self._settle = None if settle is None else weakref.WeakMethod(settle)
        self._stepped_cb = None if stepped is None else weakref.WeakMethod(stepped)
        self.members: list[torch.optim.Optimizer] = []
        self.internal = False  # deft's own step (an earlier due update): no interception
        self._given = optimizer
        self._stepped: list[torch.optim.Optimizer] = []  # members that stepped in the open step
        self._open = False  # an iteration's step began and has not ended
        self._window = False  # the step ended and no forward has begun: a new optimizer may still join
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

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first member (None until an optimizer has stepped the module's parameters)."""
        return self.members[0] if self.members else None

    @property
    def single(self) -> torch.optim.Optimizer | None:
        """The optimizer when there is exactly one: what the preserver's statistics model (None with
        several, whose walk they do not)."""
        return self.members[0] if len(self.members) == 1 else None

    def param_groups(self) -> list[dict[str, Any]]:
        """Every member's param groups, members in the order they joined."""
        return [g for opt in self.members for g in opt.param_groups]

    def state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """The optimizer state of ``p`` in whichever member holds it (empty if none)."""
        for opt in self.members:
            if p in opt.state:
                return opt.state[p]
        return {}

    def _adopt(self, opt: torch.optim.Optimizer) -> None:
        """``opt`` is one of the module's optimizers: its ``state_dict()`` first finishes what is in flight."""
        self.members.append(opt)
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

    def _member(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
        """``opt`` if it is a member (by identity: two equal optimizers are two members), else None."""
        for m in self.members:
            if opt is m:
                return m
        return None

    def _inner(self, opt: torch.optim.Optimizer) -> bool:
        """A wrapper's inner optimizer, stepped inside a member (it shares that member's param groups)."""
        return any(opt is not m and opt.param_groups is m.param_groups for m in self.members)

    def claims(self, opt: torch.optim.Optimizer) -> bool:
        """Is ``opt`` one of the module's optimizers? Any optimizer stepping the module's parameters
        joins the members when it first steps (after the step's end and before the next forward: with
        what is still in flight applied first, and ``p.grad`` holding what the step left there)."""
        if self._member(opt) is not None:
            return True
        if self._inner(opt) or not self._steps_mine(opt):
            return False
        if self._window:
            fn = self._fresh() if self._fresh is not None else None
            if fn is not None:
                fn()  # updates still in flight go through the members they were made for
            settle = self._settle() if self._settle is not None else None
            if settle is not None:
                settle(self.params_of(opt))  # what the step left in p.grad, as values
        self._adopt(opt)
        return True

    def fire(self, which: str, opt: torch.optim.Optimizer, bound: bool, args: StepArgs) -> StepArgs | None:
        """One step hook: ``before()``, ``settle()`` or ``after()`` when it is a member's; returns the
        step's arguments with the closure wrapped when the step has one (:func:`wrap_closure`)."""
        before, after = self._before(), self._after()
        if before is None or after is None or self.internal:
            return None
        if not bound and opt is self._given:
            return None  # its own (bound) hooks act
        if which == "post":
            if self._open and self._member(opt) is not None:
                fn = self._stepped_cb() if self._stepped_cb is not None else None
                if fn is not None:
                    fn()  # what this member's step left in p.grad, before the loop's next line
                if self._all_stepped():
                    self._end(after)
            return None
        if not self.claims(opt):
            return None
        member = self._member(opt)
        assert member is not None
        if self._open and any(m is member for m in self._stepped):
            self._end(after)  # stepped again: the last iteration's step ended without its other members
        first = not self._open
        mine = self.params_of(member)
        settle = self._settle() if self._settle is not None else None

        def call() -> None:
            # the step begins here, not at the pre hook: a closure's forward runs in between
            self._open, self._window = True, False
            self._stepped.append(member)
            if first:
                before()
            elif settle is not None:
                settle(mine)
        wrapped = wrap_closure(opt, args, call)
        if wrapped is None:
            call()
        return wrapped

    def params_of(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The module's parameters that ``opt`` steps."""
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        return [p for p in self._params if id(p) in ids]

    def first_params(self) -> list[torch.Tensor]:
        """What the iteration's first stepping member settles: its own parameters and those of no
        member (which no later pre hook would settle)."""
        stepping = self._stepped[0] if self._stepped else None
        others = {id(p) for m in self.members if m is not stepping for g in m.param_groups for p in g["params"]}
        return [p for p in self._params if id(p) not in others]

    def _all_stepped(self) -> bool:
        return all(any(m is s for s in self._stepped) for m in self.members)

    def _end(self, after: Callable[[], None]) -> None:
        self._open, self._stepped, self._window = False, [], True
        after()

    def close_open_step(self) -> None:
        """A forward begins: a step some member did not take part in ends here; no optimizer joins now."""
        after = self._after()
        if self._open and after is not None:
            self._end(after)
        self._window = False

    def step_internally(self) -> None:
        """Run every member's ``step()`` for an update the user's step does not apply (several due at
        once; a deferred part): each applies the gradients of its own parameters. A member's parameters
        that are not deft's (torch DDP's ignore list, frozen when the module was wrapped) are stepped by
        the user's steps alone, as under torch DDP: their ``p.grad`` is hidden meanwhile."""
        if not self.members:
            raise DeftError("deft needs the optimizer to apply pending updates: pass optimizer= to "
                            "deft.DistributedDataParallel or call optimizer.step() once before")
        self.internal = True
        try:
            with self._foreign_grads_hidden():
                for opt in self.members:
                    opt.step()
        finally:
            self.internal = False

    @contextmanager
    def _foreign_grads_hidden(self) -> Iterator[None]:
        """``p.grad`` of the members' parameters outside deft's set as None, given back after."""
        hidden = [(p, p.grad) for g in self.param_groups() for p in g["params"]
                  if id(p) not in self._mine and p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            yield
        finally:
            for p, grad in hidden:
                p.grad = grad

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
#: What the learning-rate helpers scale: an optimizer, or several optimizers' param groups
#: (:meth:`OptimizerBinding.param_groups`).
Groups = torch.optim.Optimizer | list[dict[str, Any]]


def _groups(of: Groups) -> list[dict[str, Any]]:
    return of.param_groups if isinstance(of, torch.optim.Optimizer) else of


def scale_lr(of: Groups, factor: float) -> list[LearningRate] | None:
    """Multiply every param group's ``lr`` by ``factor`` for one step; returns the previous values for
    :func:`restore_lr` (``None`` when ``factor == 1``: nothing changed). The group's ``lr`` objects are
    replaced, not mutated (a tensor ``lr`` stays the user's tensor), so restoring gives back exactly what
    an LR scheduler set."""
    if factor == 1.0:
        return None
    groups = _groups(of)
    saved = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = g["lr"] * factor
    return saved


def restore_lr(of: Groups, saved: list[LearningRate] | None) -> None:
    """Undo :func:`scale_lr`."""
    if saved is None:
        return
    for g, lr in zip(_groups(of), saved, strict=True):
        g["lr"] = lr


@contextmanager
def merged_lr(of: Groups, k: int, scaling: str) -> Iterator[float]:
    """One optimizer step of a merged update of ``k`` iterations: ``lr`` times
    :func:`deft.preserver.gaussian_walk.merge_lr_factor` ``(k, scaling)`` inside, restored after."""
    factor = merge_lr_factor(k, scaling)
    saved = scale_lr(of, factor)
    try:
        yield factor
    finally:
        restore_lr(of, saved)
