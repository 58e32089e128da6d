"""Applying updates: what ``p.grad`` holds at the user's step, deferred forward updates, merged steps.

Invariants (docs/DESIGN.md, "Runtime"):

* **Exposed at the step.** At the end of backward the due update's averaged gradient is put into
  ``p.grad``, where torch DDP leaves it, so GradScaler, clipping and any code between ``backward()``
  and ``step()`` see it; the user's ``optimizer.step()`` applies it. A parameter whose bucket is still
  in flight gets a future (:class:`deft.runtime.pending_grads.PendingGrad`): touched, it waits and is
  torch DDP's value, applied by this step; untouched, it is applied just before its first use in the
  next forward. Earlier updates due at the same step are applied first, through internal steps
  (:meth:`UpdateApplier.expose`).
* **Exactly once.** Every update is applied by exactly one optimizer step: the user's, an internal
  one, or (an update finishing in the forward) one internal step per module just before its forward,
  for the parameters whose buckets were still in flight at the step. A skipped step (GradScaler found
  inf/NaN) drops the exposed update as torch DDP does, deferred part included.
* **Accumulated when the loop keeps it.** A training forward after ``backward()`` without a step, with
  the exposed gradients still in ``p.grad``, accumulates (micro-batches without ``no_sync()``): what
  ``p.grad`` holds is carried (:meth:`UpdateApplier.carry`) into the next backward, which adds to it
  before deft reduces it, as torch DDP's autograd and reducer do; the next step applies the sum. Gone
  from ``p.grad`` (``zero_grad()`` after a skipped step), it is a skipped step. Likewise what the loop
  leaves in ``p.grad`` after a step (:meth:`UpdateApplier.drop_after_step`), and a gradient left in
  ``p.grad`` whose parameter the backward did not reach is reduced as that parameter's gradient.
* **Applied whole when it must be.** A deferred part gets the step's hyperparameters as they were at
  the step (an LR scheduler may have stepped since), and is possible only when the optimizer updates
  each parameter from its own gradient and state and deft itself does nothing global to the
  gradients (:meth:`UpdateApplier.couples`). What the loop does to them needs no such rule: it touches
  the futures, which makes them whole.
* **Stepped values wherever the loop looks.** Between the user's step and the next forward, the loop's
  first torch function on a parameter with a deferred update, or on its optimizer state, applies the
  deferred updates first (:class:`deft.runtime.param_watch.ParamWatch`), as does the optimizer's
  ``state_dict()`` or ``load_state_dict()`` and the module's ``state_dict()``: what the loop reads or
  writes there is what torch DDP's step left.
* **Merged steps.** The one step applying an update that merges ``k`` iterations runs with every
  param group's ``lr`` times ``merge_lr_factor(k, config.merge_lr_scaling)``, restored right after.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from deft.config import DeftConfig
from deft.errors import DeftError
from deft.preserver.gaussian_walk import merge_lr_factor
from deft.runtime.eager import ForwardHooks
from deft.runtime.executor import DueUpdate, Executor
from deft.runtime.first_use import first_use_modules
from deft.runtime.optimizer_hooks import LearningRate, OptimizerBinding, merged_lr, restore_lr, scale_lr
from deft.runtime.param_watch import ParamWatch
from deft.runtime.pending_grads import PendingGrad, settle_for_step
from deft.schedule import Schedule

#: torch optimizers whose update of a parameter reads only that parameter, its gradient and its own state:
#: an update finishing in the forward may apply them one module at a time (exact type, not subclasses).
PER_PARAMETER_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                            torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                            torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adadelta, torch.optim.Muon)

#: One entry of the update log: (the iteration whose step applied it, the iterations it merges).
LogEntry = tuple[int, tuple[int, ...]]


class UpdateApplier:
    """Puts due updates into ``p.grad`` and through the optimizer (module docstring)."""

    def __init__(self, module: nn.Module, names: list[str], params: list[torch.Tensor], executor: Executor,
                 optim: OptimizerBinding, config: DeftConfig, hooks: ForwardHooks, compiled: str | None = None,
                 on_used: Callable[[int, str], None] | None = None) -> None:
        self._module, self._names, self._params, self._executor, self.optim = module, names, params, executor, optim
        self._hooks = hooks  # the wrapper's forward hooks (deft.runtime.eager)
        self._scaling = config.merge_lr_scaling
        self._compiled = compiled  # why the module runs compiled (then updates are applied whole), or None
        self.log: list[LogEntry] = []
        self.clip: tuple[float, float] | None = None  # clip_grad_norm_on_update: (max_norm, norm_type)
        self.last_grad_norm: float | None = None
        # Whether p.grad holds something between backward() and step() (None: not exposed yet).
        self._exposed: bool | None = None
        self._exposed_iterations: tuple[int, ...] | None = None
        self._lr_saved: list[LearningRate] | None = None  # the groups' lr while a merged step runs scaled
        # Accumulation without no_sync(): what p.grad held at the next forward, and the iterations it sums.
        self._carried: list[torch.Tensor | None] | None = None
        self._carry_into_backward = False  # the carried gradients go into p.grad, not past the reduction
        self._carried_iterations: list[tuple[int, ...]] = []
        # Updates finishing in the forward: module pre-hooks, and the step's hyperparameters.
        self._owned: dict[int, list[int]] = {}  # id(module) -> parameters updated before its forward
        self.first_use: dict[int, nn.Module] = {}  # parameter -> module of its first use (recorded once)
        self._listening: RemovableHandle | None = None  # before_module, listening to the forward's hooks
        # id(group) -> (the group, its values at the step), for the deferred part; the step's merge factor
        self._finish_hparams: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        self._finish_factor = 1.0
        self._taken: dict[int, PendingGrad] = {}  # the futures the step's settle took out of p.grad
        self._settled: set[int] = set()  # parameters an optimizer of this step was about to read
        self._given_back: set[int] = set()  # taken futures back in p.grad after their optimizer's step
        self._left: list[torch.Tensor | None] = []  # what the last step left in p.grad (keep_after_step)
        # the loop's use of a deferred parameter before the forward; weakly, as the watch outlives no wrapper
        self._watch = ParamWatch(_weakly(self._used))
        weakref.finalize(self, self._watch.disarm)
        self._on_used = on_used  # told (iteration, what) of each such use
        self._t = 0  # the iteration the watch was armed after

    def set_clip(self, clip: tuple[float, float] | None) -> None:
        """``clip_grad_norm_on_update``: clip each update to ``(max_norm, norm_type)`` (None: off)."""
        self.clip = clip

    def record_first_use(self, first: dict[int, nn.Module]) -> None:
        """Where each parameter is first used (the first training forward's record)."""
        self.first_use = first

    @property
    def exposed(self) -> bool:
        """Is an update (or an empty one: no update due) in ``p.grad``, waiting for the step?"""
        return bool(self._exposed)

    @property
    def exposing(self) -> bool:
        """Has this iteration's end of backward (or step) run :meth:`expose` already?"""
        return self._exposed is not None

    # -- why an update must be applied whole ----------------------------------------------------------
    def couples(self) -> str | None:
        """Why an update cannot be applied one module at a time (None: it can)."""
        if self._compiled is not None:
            return f"{self._compiled}: its graph runs without deft's hooks between layers"
        if self.clip is not None:
            return "clip_grad_norm_on_update couples all parameters (the norm is global)"
        for opt in self.optim.members:
            if type(opt) not in PER_PARAMETER_OPTIMIZERS:
                return (f"{type(opt).__name__} is not one of torch's per-parameter optimizers "
                        f"({', '.join(o.__name__ for o in PER_PARAMETER_OPTIMIZERS)})")
        return None

    # -- the step ---------------------------------------------------------------------------------------
    def expose(self, updates: list[DueUpdate], t: int, partial: bool, placeholders: bool) -> None:
        """The due ``updates`` (oldest first) at the step of iteration ``t``: all but the last applied by
        internal steps, the last put into ``p.grad`` for the user's step. ``partial``: part of the last
        finishes in the next forward (with this step's hyperparameters); its parameters' ``p.grad`` are
        :class:`PendingGrad` futures. ``placeholders``: when nothing is due, zeros stand in ``p.grad``
        (a GradScaler must find gradients to check) and the step changes nothing."""
        if partial:
            self._finish_factor = merge_lr_factor(len(updates[-1].iterations), self._scaling)
            self._finish_hparams = {}
            self._snapshot_hparams(self.optim.param_groups())
        for upd in updates[:-1]:
            self.set_grads(upd.grads)
            self.step_merged(len(upd.iterations))
            self.log.append((t, upd.iterations))
        if self._carried is not None:  # carried past the reduction (a schedule that merges or delays)
            self._expose_with_carried(updates[-1] if updates else None)
        elif updates:
            self.set_grads(updates[-1].grads)
            self._exposed_iterations = updates[-1].iterations  # logged when the step takes it
            for i in self._executor.deferred:  # futures: waited for only if the loop touches them
                self._params[i].grad = PendingGrad(self._params[i], self._resolver(i))
        elif placeholders:
            for p in self._params:
                p.grad = PendingGrad.zeros(p)
        else:
            self.clear_grads()
        self._exposed = any(p.grad is not None for p in self._params)

    def _expose_with_carried(self, last: DueUpdate | None) -> None:
        """Accumulation under a schedule that merges or delays: ``p.grad`` is the carried gradient plus
        the last due update's (whole: its deferred part is waited for, as a loop touching it would), so
        the user's step applies the sum."""
        carried, self._carried = self._carried, None
        assert carried is not None
        grads: list[torch.Tensor | None] = list(last.grads) if last is not None else [None] * len(self._params)
        if last is not None and self._executor.deferred:
            for i, g in enumerate(self._executor.finish()):
                if g is not None:
                    grads[i] = g
        self.set_grads([c if g is None else g if c is None else g + c for g, c in zip(grads, carried, strict=True)])
        self._exposed_iterations = last.iterations if last is not None else ()

    def carry(self) -> bool:
        """A training forward after ``backward()`` with no step between: if the loop left gradients in
        ``p.grad`` (it accumulates micro-batches without ``no_sync()``), they stay there, copies of their
        own, for the next backward to add to, as torch DDP's autograd does, and that backward's update
        applies the sum (a placeholder carries nothing); return True. If the loop cleared them (a skipped
        step: ``p.grad`` None, or all zeros after ``zero_grad(set_to_none=False)``), return False.

        Note: every rank takes the same decision. Whether ``p.grad`` is kept is the loop's control flow
        (``zero_grad()`` or not), and every rank runs the same loop; GradScaler's skip decision reads the
        all-reduced gradient, the same on every rank. Either way no collective follows from it: both
        paths only wait for buckets every rank launched. What is carried is the same on every rank too,
        so all-reducing it with the next gradient (torch DDP's order of operations) changes nothing but
        the rounding, which is then torch DDP's. That holds where every iteration's update is due at its
        own step; under a schedule that merges or delays, the next backward's update may not be, and
        the carried gradient is added to what the next step applies instead (:meth:`_expose_with_carried`)."""
        if self.cleared():
            return False
        kept = [p.grad for p in self._params]
        # a deferred gradient the loop kept is waited for; the rest of the deferred (dropped by the loop) too
        carried = [None if g is None or (isinstance(g, PendingGrad) and g.placeholder)
                   else (g.value() if isinstance(g, PendingGrad) else g).detach().clone() for g in kept]
        self._executor.finish()
        self.clear_grads()
        self._carried = carried
        # into p.grad when the next iteration begins (drop_after_step), or added at the step (expose)
        self._carry_into_backward = _each_iteration_at_its_step(self._executor.schedule)
        if self._exposed_iterations is not None:
            self._carried_iterations.append(self._exposed_iterations)
            self._exposed_iterations = None
        return True

    def cleared(self) -> bool:
        """Did the loop clear ``p.grad`` since the update was exposed (a skipped step: None, or zeros)?"""
        # zero_grad(set_to_none=False) leaves zeros (an update's future it zeroed holds them): cleared all
        # the same, a skipped step to record; a future nothing touched, and a placeholder, are kept
        return all(g is None or (not (isinstance(g, PendingGrad) and (g.placeholder or not g.resolved))
                                 and not bool(_plain(g).any())) for g in (p.grad for p in self._params))

    def _resolver(self, i: int) -> Callable[[], torch.Tensor]:
        """Parameter ``i``'s deferred gradient, now: its bucket is waited for and it stops being deferred."""
        def resolve() -> torch.Tensor:
            g = self._executor.finish([i])[i]
            assert g is not None  # deferred parameters are the used ones
            return g
        return resolve

    def before_step(self) -> None:
        """Right before the user's ``optimizer.step()`` applies the exposed update: gradients the loop
        touched are applied by it, untouched deferred ones in the next forward (:mod:`pending_grads`).
        With several optimizers, the first to step settles its own parameters (and those of none), each
        other its own as it steps (:meth:`settle`)."""
        self.settle(self.optim.first_params())
        # A merge of k iterations steps with the lr scaled, restored in after_step before any LR scheduler.
        if self._exposed_iterations and self.optim.members:
            self._lr_saved = scale_lr(self.optim.param_groups(), merge_lr_factor(len(self._exposed_iterations),
                                                                                 self._scaling))

    def settle(self, params: list[torch.Tensor]) -> None:
        """Right before an optimizer reads the gradients of ``params`` (:func:`settle_for_step`)."""
        index = {id(p): i for i, p in enumerate(self._params)}
        cleared = {index[id(p)] for p in params if p.grad is None} & self._executor.deferred
        if cleared:  # the loop set p.grad to None (zero_grad(), a frozen layer): the step skips them, as torch DDP's
            self._executor.finish(cleared)
        self._taken |= {index[id(p)]: g for p in params
                        if isinstance(g := p.grad, PendingGrad) and (g.placeholder or not g.resolved)}
        self._settled |= {index[id(p)] for p in params}
        if self._executor.deferred:  # the hyperparameters their optimizer steps with, now
            ids = {id(p) for p in params}
            self._snapshot_hparams([g for g in self.optim.param_groups() if any(id(p) in ids for p in g["params"])])
        settle_for_step(params)

    def _snapshot_hparams(self, groups: list[dict[str, Any]]) -> None:
        """The deferred part's hyperparameters: ``groups``' values now (an optimizer about to step; an LR
        scheduler may step before the deferred part is applied)."""
        f = self._finish_factor
        for g in groups:
            self._finish_hparams[id(g)] = (g, {k: (v * f if k == "lr" else v) for k, v in g.items() if k != "params"})

    def skip(self) -> None:
        """The step was skipped: the exposed update is dropped, its deferred part too."""
        self._exposed_iterations = None
        self._carried_iterations = []  # accumulated micro-batches are dropped with it
        if self._exposed:
            self._executor.finish()

    def restore_lr(self) -> None:
        """Right after the user's step: the learning rates a merged step scaled are restored."""
        if self._lr_saved is not None and self.optim.members:
            restore_lr(self.optim.param_groups(), self._lr_saved)
            self._lr_saved = None

    def end_step(self, t: int, stepped: bool = False) -> None:
        """The iteration ``t`` ends: the exposed update, if the step took it, goes into the log.
        ``stepped``: the user's ``optimizer.step()`` ended it, and ``p.grad`` keeps what torch DDP's would
        hold until the next training forward (:meth:`keep_after_step`); else it is cleared."""
        self._exposed = None
        if self._exposed_iterations is not None:
            self.log.extend((t, its) for its in [*self._carried_iterations, self._exposed_iterations] if its)
            self._carried_iterations = []
            self._exposed_iterations = None
        if stepped:
            self.keep_after_step()
        else:
            self.clear_grads()
        self._taken, self._settled, self._given_back = {}, set(), set()

    def keep_after_step(self) -> None:
        """After the user's step, ``p.grad`` holds the averaged gradient as under torch DDP: what the step
        applied stays; a deferred one the step did not touch comes back as an after-step future (read:
        waited for, still applied in the next forward); a placeholder comes back as zeros. Taken out of
        deft's buffers at the next training forward (:meth:`drop_after_step`). A future no optimizer
        settled (several optimizers, one of which did not step: GradScaler skipped it) becomes its value,
        applied by no step, as torch DDP leaves it."""
        for p in self._params:
            g = p.grad
            if isinstance(g, PendingGrad) and not (g.after or g.placeholder):
                p.grad = g.value()
        unsettled = self._executor.deferred - self._settled
        if unsettled:  # ... and one the loop cleared from p.grad is dropped (GradScaler: a skipped optimizer)
            self._executor.finish(unsettled)
        self.give_back()
        self._left = [p.grad for p in self._params]

    def give_back(self) -> None:
        """Right after an optimizer's step: the futures its settle took out of ``p.grad`` come back as
        after-step futures (or zeros: a placeholder), before the loop's next line, as torch DDP's
        ``p.grad`` would hold them (with several optimizers, after each one's step)."""
        for i, g in self._taken.items():
            if i in self._given_back:
                continue
            self._given_back.add(i)
            p = self._params[i]
            if p.grad is None:
                p.grad = PendingGrad.zeros(p) if g.placeholder else PendingGrad.after_step(p, self._reader(i))

    def drop_after_step(self, keep: bool = True) -> None:
        """A training forward begins: what :meth:`keep_after_step` left in ``p.grad`` leaves deft's buffers
        before they are used again. Cleared by the loop (``zero_grad()``: None, or zeros) or a placeholder,
        nothing follows. Left there (a parameter outside the optimizer, whose ``zero_grad()`` does not
        reach it; a loop that never zeroes), the next backward adds to it, as torch DDP's does: it stays in
        ``p.grad`` as a copy of its own (an after-step future waited for). So do the gradients
        :meth:`carry` took when every iteration's update is due at its own step. ``keep`` False: dropped
        all the same (a checkpoint loaded replaces the state)."""
        if self._carried is not None and self._carry_into_backward:  # for the next backward to add to (carry)
            carried, self._carried = self._carried, None
            self._left = []
            for p, c in zip(self._params, carried, strict=True):
                p.grad = c if keep else None
            return
        left = [(p, g) for p, g in zip(self._params, self._left, strict=False) if g is not None and p.grad is g]
        self._left = []
        for p, _ in left:
            p.grad = None
        left = [(p, g) for p, g in left if keep and not (isinstance(g, PendingGrad) and g.placeholder)]
        if not left:
            return
        values = [g.value() if isinstance(g, PendingGrad) else g for _, g in left]
        nonzero = torch.stack([v.ne(0).any() for v in values]).tolist()  # one wait for the device, not one each
        for (p, _), v, kept in zip(left, values, nonzero, strict=True):
            if kept:
                p.grad = v.detach().clone()

    def _reader(self, i: int) -> Callable[[], torch.Tensor]:
        """Parameter ``i``'s averaged gradient after the step: waited for, left deferred."""
        def read() -> torch.Tensor:
            g = self._executor.peek(i)
            if g is None:
                raise DeftError(f"the gradient of parameter {i} was read after deft applied its deferred "
                                "update; read gradients before the next forward, evaluation or state_dict()")
            return g
        return read

    def step_merged(self, k: int) -> None:
        """deft's own optimizer step for an update merging ``k`` iterations (lr scaled by the config)."""
        if not self.optim.members:
            self.optim.step_internally()  # raises the error that names the missing optimizer
            return
        with merged_lr(self.optim.param_groups(), k, self._scaling):
            self.optim.step_internally()

    def set_grads(self, grads: list[torch.Tensor | None]) -> None:
        for p, g in zip(self._params, grads, strict=True):
            p.grad = g
        if self.clip is not None:
            with_grad = [p for p in self._params if p.grad is not None]
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(with_grad, *self.clip))

    def clear_grads(self) -> None:
        for p in self._params:
            p.grad = None

    def drain(self, t: int) -> None:
        """``flush()``: every queued update applied now, oldest first; the cycle restarts at ``t``."""
        with self._after_step_kept():  # flush() finished the deferred first: the after-step futures hold values
            for upd in self._executor.drain():
                self.set_grads(upd.grads)
                self.step_merged(len(upd.iterations))
                self.log.append((t - 1, upd.iterations))
            self.clear_grads()
        self._executor.restart_cycle(t)

    @contextlib.contextmanager
    def _after_step_kept(self) -> Iterator[Callable[[list[torch.Tensor | None]], None]]:
        """Around deft's own steps between the user's step and the next backward (a checkpoint, an
        evaluation, ``flush()``, a deferred update in the forward): an after-step future about to be
        applied takes its value first (the yielded function, given the gradients about to be applied),
        and ``p.grad`` is given back what it held (what :meth:`keep_after_step` left, the loop's own, or
        what the next backward adds to), after the steps cleared it."""
        before = [p.grad for p in self._params]

        def resolve(grads: list[torch.Tensor | None]) -> None:
            for p, g in zip(self._params, grads, strict=True):
                if g is not None and isinstance(p.grad, PendingGrad) and p.grad.after and not p.grad.resolved:
                    p.grad._value = g
        try:
            yield resolve
        finally:
            for p, was in zip(self._params, before, strict=True):
                p.grad = was

    # -- the loop between the step and the next forward (deft.runtime.param_watch) ----------------------
    def watch_until_forward(self, t: int) -> None:
        """After the user's step of iteration ``t``: while updates are left finishing in the forward, the
        loop's first use of one of their parameters, or of its optimizer state, applies them first."""
        deferred = sorted(self._executor.deferred)
        if not deferred or not self.optim.members:
            return
        watched: list[tuple[str, torch.Tensor]] = []
        for i in deferred:
            p = self._params[i]
            watched.append((self._names[i], p))
            state = self.optim.state_of(p)
            watched += [(f"the optimizer's {key!r} of {self._names[i]}", v) for key, v in state.items()
                        if isinstance(v, torch.Tensor)]
        self._t = t
        self._watch.arm(watched)

    def stop_watching(self) -> None:
        """A forward begins (or the deferred updates were applied): the watch ends."""
        self._watch.disarm()

    def _used(self, what: str) -> None:
        """The loop used ``what`` before the forward: the deferred updates are applied now."""
        if self._on_used is not None:
            self._on_used(self._t, what)
        self.finish_deferred()

    # -- updates finishing in the forward (Update.finish_in_forward) -----------------------------------
    def set_forward_hooks(self, on: bool) -> None:
        """While the schedule has updates finishing in the forward: as a module where a parameter is
        first used (:mod:`deft.runtime.first_use`) begins its forward, that parameter's deferred update
        is applied (the wrapper's :class:`~deft.runtime.eager.ForwardHooks`, listened to meanwhile)."""
        if self._listening is not None:
            self._listening.remove()
            self._listening = None
        if not on:
            return
        self._owned = first_use_modules(self._module, self._params, self.first_use, self._hooks.hooked)
        self._listening = self._hooks.listen(pre=self.before_module)

    def before_module(self, m: nn.Module) -> None:
        """Forward pre-hook: the module's deferred parameters get their update now."""
        own = self._owned.get(id(m))
        if own and self._executor.deferred:
            self._apply_deferred(self._executor.finish(own))

    def finish_deferred(self) -> None:
        """Every deferred parameter gets its update now (the forward did not run its module, a
        checkpoint or evaluation needs torch DDP's parameters). Between the end of backward and the
        step (a backward inside the wrapper's forward, as Lightning's manual optimization runs it, with
        no step yet), the futures in ``p.grad`` are waited for instead: the step applies them."""
        self._watch.disarm()
        if self._exposed is not None:
            for p in self._params:
                g = p.grad
                if isinstance(g, PendingGrad) and not (g.after or g.placeholder or g.resolved):
                    g.value()
        if self._executor.deferred:
            self._apply_deferred(self._executor.finish())

    def _apply_deferred(self, grads: list[torch.Tensor | None]) -> None:
        """One internal optimizer step over the parameters in ``grads`` (others ``None``: untouched), with
        the hyperparameters of the step at which their update began."""
        self._watch.disarm()  # a forward runs the module: its pre-hooks apply the rest, the step below is deft's
        if all(g is None for g in grads):
            return
        assert self.optim.members
        # Groups added since that step (add_param_group, an optimizer joined) took no part in it: their
        # parameters stay as they are.
        snapshots = list(self._finish_hparams.values())
        added = {id(p) for g in self.optim.param_groups() if id(g) not in self._finish_hparams for p in g["params"]}
        now = [(g, {k: g[k] for k in snap}) for g, snap in snapshots]
        with self._after_step_kept() as resolve:
            resolve(grads)
            try:
                for g, snap in snapshots:
                    g.update(snap)
                for p, gr in zip(self._params, grads, strict=True):
                    p.grad = None if id(p) in added else gr
                self.optim.step_internally()
            finally:
                for g, values in now:
                    g.update(values)
                self.clear_grads()

    def close(self) -> None:
        self._watch.disarm()
        self.set_forward_hooks(False)


def _each_iteration_at_its_step(schedule: Schedule | None) -> bool:
    """Is every iteration's update applied by its own step (no merge, no delay), as torch DDP's are?"""
    return schedule is not None and all(u.positions == (u.apply_after,) for u in schedule.updates)


def _plain(g: torch.Tensor) -> torch.Tensor:
    """A gradient's value: a resolved future's own, else the tensor."""
    return g.value() if isinstance(g, PendingGrad) else g


def _weakly(method: Callable[[str], None]) -> Callable[[str], None]:
    """``method`` called through a weak reference to its object (nothing once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(what: str) -> None:
        fn = ref()
        if fn is not None:
            fn(what)
    return call
