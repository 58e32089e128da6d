"""The scheduled run: DeFT's gradient schedule as the wrapper's training mode (``config.local_steps = 0``).

The per-iteration phase machine (:mod:`deft.runtime.phase`): gradient capture, then calls to its
collaborators at a few named events (a forward begins, a gradient is ready, the backward ends, the
step begins and ends), installing what they decide:

* :class:`deft.runtime.executor.Executor` queues, sends and reduces the buckets of the running schedule;
* :class:`deft.runtime.updates.UpdateApplier` puts due updates into ``p.grad`` and through the optimizer;
* :class:`deft.runtime.course.Course` decides between iterations (warm-up, profile, plan, adaptation);
* :class:`deft.runtime.tracing.Tracing` shows a trace tool what runs.

The checkpoint record is :class:`deft.runtime.checkpoint.RuntimeState`.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from deft._json import JsonDict
from deft.errors import DeftError
from deft.profile import Profile
from deft.runtime.buckets import FlatLayout
from deft.runtime.checkpoint import RuntimeState, StateDoc, check_mode
from deft.runtime.codecs.hooks import CommHook, from_config
from deft.runtime.course import Course
from deft.runtime.eager import ForwardHooks, forget_compiled, outside_graphs
from deft.runtime.executor import Executor, PendingUpdate
from deft.runtime.first_use import FirstUseRecorder
from deft.runtime.grad_stats import check_probe_args, probe_curvature
from deft.runtime.links import CommLink
from deft.runtime.optimizer_hooks import OptimizerBinding
from deft.runtime.pending_grads import settle_for_step
from deft.runtime.phase import Phase
from deft.runtime.records import PlanInfoView
from deft.runtime.saved_hooks import DeadOnSave
from deft.runtime.switch_interval import SWITCH
from deft.runtime.tensors import batch_size
from deft.runtime.tracing import Tracing
from deft.runtime.updates import LogEntry, UpdateApplier
from deft.schedule import Schedule

if TYPE_CHECKING:
    from deft.runtime.mode import Wiring

log = logging.getLogger("deft.runtime")


class ScheduledRun:
    """The facade's events under DeFT's schedule (module docstring)."""

    def __init__(self, wiring: Wiring, given_profile: Profile | None,
                 optimizer: torch.optim.Optimizer | None) -> None:
        cfg = self.config = wiring.config
        self.module, self._names, self._params, self.device = wiring.module, wiring.names, wiring.params, wiring.device
        self.rank, self.world, self._cuda = wiring.rank, wiring.world, wiring.device.type == "cuda"
        self._control, self._links, self._sync = wiring.control, wiring.links, wiring.sync
        self._executor = Executor(self._params, self._links, self.rank, self.world, cfg.timeout_s, self.device)
        self._optim = OptimizerBinding(self._params, self._before_step, self._after_user_step, optimizer,
                                       fresh=self._finish_deferred, settle=self._settle_member,
                                       stepped=self._member_stepped)
        # installed once, before any compile sees the module (deft.runtime.eager); the others listen
        self._forward_hooks = ForwardHooks(self.module)
        dropped = forget_compiled(self.module)
        if dropped:
            log.info("deft: code torch.compile made for %s before deft's hooks existed is dropped: it compiles "
                     "again with them", ", ".join(dropped))
        self._updates = UpdateApplier(self.module, self._names, self._params, self._executor, self._optim, cfg,
                                      self._forward_hooks, wiring.compiled, self._used_before_forward)
        self._course = Course(cfg, self._control, self.module, self._names, self._params, self._links,
                              self._executor, self._optim, self._updates.log, given_profile, wiring.ranks,
                              self._install, self._forward_hooks, from_config(cfg), wiring.init_broadcast)
        self._tracing = Tracing(self.module, self._params, self._executor, dist.get_rank(), self._cuda,
                                self._course.calendar.warm_end, self._course.profile_iters, self._forward_hooks)
        # the buffers' first reads too, where none was compiled before the hooks (deft.runtime.buffer_sync)
        self._buffer_sync = wiring.buffers if wiring.compiled is None else None
        self._first_use: FirstUseRecorder | None = (
            FirstUseRecorder(self._params, self._buffer_sync.buffers if self._buffer_sync is not None else None)
            if cfg.forward_updates else None)
        self._watching: FirstUseRecorder | None = None  # the first use being recorded in this forward
        self._training_forward = False  # the forward running now records gradients
        self._t = 0  # index of the current (or next) training iteration
        self._phase = Phase.IDLE
        self._step_open = False  # the user's step began (its post hook ends the iteration)
        self._micro_batches = False  # a backward under no_sync() in this iteration (its sum is in p.grad)
        self._withdrawn = False  # the iteration a forward began was withdrawn (_withdraw): it begins again
        self._course.install_warmup(list(reversed(range(len(self._params)))), t0=0)
        me = DeadOnSave(self)  # the hooks on the user's module pickle with it, and load dead (saved_hooks)
        self._switch = _hold_switch_interval(self, cfg.switch_interval_ms, self._links)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, me, i))
                       for i, p in enumerate(self._params)]
        # Whoever reads the module's state_dict gets the parameters torch DDP would have.
        self._hooks.append(self.module.register_state_dict_pre_hook(functools.partial(_state_dict_hook, me)))

    # -- the facade's events ---------------------------------------------------------------------------
    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # deft's bookkeeping around the module, eagerly under Dynamo (deft.runtime.eager): only the call
        # of the module between them is traced when the wrapper is compiled
        run = self._forward_begins(args, kwargs)
        return self._forward_ends(run(*args, **kwargs))

    @outside_graphs
    def _forward_begins(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
        """The iteration's state before the module runs; what runs it (the module, or once, a watched call)."""
        self._optim.close_open_step()  # several optimizers, one of which did not step: the step ends here
        self._updates.stop_watching()  # from here, the forward's pre-hooks apply the deferred updates
        self._training_forward = torch.is_grad_enabled()
        if not self._training_forward:
            return self.module  # evaluation: no gradient communication, nothing counted
        self._course.loop_pauses()  # the loop's own work of the last iteration ends here
        if self._phase is Phase.BACKWARD_DONE:
            if not self._updates.exposed:
                raise DeftError(f"the forward of a new iteration started before optimizer.step() of iteration "
                                f"{self._t}; deft runs forward, backward, optimizer.step() once per iteration, "
                                "with an optimizer over this module's parameters (wrap forwards that are not "
                                "training, e.g. metrics, in torch.no_grad())")
            self._next_micro_batch()
        if self._phase is Phase.IDLE:
            self._begin_iteration()
            self._course.note_batch(batch_size(args, kwargs))
        self._sync.forward_begins()
        self._watching, self._first_use = self._first_use, None
        if self._watching is not None:  # once, in the first training forward (deft.runtime.first_use)
            return functools.partial(_watched_call, self._watching, self.module)
        return self.module

    @outside_graphs
    def _forward_ends(self, out: Any) -> Any:
        self._updates.finish_deferred()  # parameters of modules this forward did not run
        if not self._training_forward:
            return out
        if self._watching is not None:
            self._updates.record_first_use(self._watching.first)
            if self._buffer_sync is not None:
                self._buffer_sync.watch(self._forward_hooks, self.module, self._watching.buffer_readers)
            self._watching = None
        self._course.forward_ends(out)
        self._tracing.forward_ends(out)
        return out

    def observe_loss(self, loss: float) -> None:
        self._course.losses.append(loss)

    def calibrate(self, closure: Callable[[], torch.Tensor], tol: float, ncv: int | None,
                  maxiter: int) -> JsonDict | None:
        """Rank 0's curvature probe for the preserver, on every rank (the facade's ``calibrate``)."""
        self._require_idle("calibrate()")
        check_probe_args(closure, tol, ncv, maxiter)
        if self.config.epsilon == 0 or not self.config.preserver or self.world < 2:
            return None
        # Every rank: an update finishing in the forward is applied now, so the closure's forward (rank 0
        # only) cannot trigger it on one rank. The forward changes batch-norm running statistics on
        # rank 0; the next iteration's buffer broadcast (broadcast_buffers) gives them to every rank.
        self._updates.finish_deferred()
        doc = probe_curvature(closure, self._optim.single, self._params, tol, ncv, maxiter) if self.rank == 0 else {}
        doc = self._control.broadcast_json(doc, "curvature probe")
        self._course.record.calibrations.append({"iteration": self._t, **doc})
        if "error" in doc:
            log.warning("deft: curvature probe failed (%s); the preserver keeps the secant estimate", doc["error"])
            return None
        self._course.use_curvature(doc)
        return doc

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future[torch.Tensor]]) -> None:
        if self._course.codecs.comm_hook is not None:
            raise DeftError(f"register_comm_hook: a comm hook ({self._course.codecs.comm_hook.name}) is already "
                            "registered (from this call or the config's compression); one hook per model")
        self._require_idle("register_comm_hook()")
        self._course.register_hook(self._t, CommHook(state, hook, getattr(hook, "__name__", type(hook).__name__)))

    def flush(self) -> None:
        self._optim.close_open_step()
        self._require_idle("flush()")
        self._updates.finish_deferred()
        if self._executor.idle:
            return
        if self._course.stats is not None:
            self._course.stats.discard()  # groups cut short: no clean per-group statistics
        self._updates.drain(self._t)

    def clip_on_update(self, clip: tuple[float, float] | None) -> None:
        self._updates.set_clip(clip)

    def close(self) -> None:
        if self._switch is not None:
            self._switch()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._updates.close()
        self._optim.remove()
        self._course.close()
        self._tracing.close()
        self._forward_hooks.close()

    # -- views -----------------------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        return self._t

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def schedule(self) -> Schedule:
        assert self._executor.schedule is not None
        return self._executor.schedule

    @property
    def pending_updates(self) -> list[PendingUpdate]:
        return self._executor.pending()

    @property
    def update_log(self) -> list[LogEntry]:
        return self._updates.log

    @property
    def plan_info(self) -> PlanInfoView:
        return self._course.record.view()

    @property
    def profile(self) -> Profile | None:
        return self._course.profile

    @property
    def last_grad_norm(self) -> float | None:
        return self._updates.last_grad_norm

    @property
    def comm_hook(self) -> CommHook | None:
        return self._course.codecs.comm_hook

    # -- checkpoint (deft.runtime.checkpoint) ----------------------------------------------------------
    def state(self) -> StateDoc:
        if not self.takes_record():
            raise DeftError(f"deft's record cannot be taken after the backward of iteration {self._t} and before "
                            "its optimizer step: save after the step, or take the wrapper's state_dict(), which is "
                            "torch DDP's there (the module's alone)")
        self._require_idle("deft's state can only be saved; saving")
        self._updates.finish_deferred()  # no collective: waits only for what every rank launched
        ex = self._executor
        ex.settle_all()  # in-flight buckets become reduced values; recorded as launched
        assert ex.schedule is not None and ex.layout is not None
        return RuntimeState(rank=self.rank, world=self.world, t=self._t, t0=ex.t0, order=list(ex.layout.order),
                            schedule=ex.schedule, groups=ex.group_states(), update_log=list(self._updates.log),
                            comm_hook=self._course.codecs.comm_hook_state(),
                            codec_hooks=self._course.codecs.hook_states(),
                            **self._course.state()).to_dict()

    def load_state(self, state: object) -> None:
        check_mode(state, local_steps=False)
        st = RuntimeState.from_dict(state)
        self._require_idle("deft's state can only be loaded; loading")
        st.check_owner(self.rank, self.world)
        self._updates.drop_after_step(keep=False)  # they read groups the loaded ones replace
        # first, so that a damaged codec state is refused before anything of this wrapper changes
        self._course.codecs.load_hook_states(st.codec_hooks, "deft checkpoint")
        layout = FlatLayout(st.order, self._names, self._params, st.schedule.bucket_numel, "deft checkpoint: schedule")
        self._executor.forget_groups()
        self._withdrawn = False  # the loaded state begins its next iteration afresh
        self._course.restore(st)
        self._install(st.schedule, layout, st.t0)
        self._executor.restore_groups(st.groups, "deft checkpoint")
        self._t = st.t
        self._updates.log[:] = st.update_log
        self._course.codecs.load_comm_hook_state(st.comm_hook, "deft checkpoint")

    # -- the phase machine's events (deft.runtime.phase) -----------------------------------------------
    def _finish_deferred(self) -> None:
        """Before the optimizer's ``state_dict()``: the updates finishing in the next forward are
        applied now, as before the module's (no collective: every rank launched them)."""
        self._updates.finish_deferred()

    def _used_before_forward(self, t: int, what: str) -> None:
        """The loop used a parameter with a deferred update after the step of iteration ``t``: the
        updates are applied first (:mod:`deft.runtime.param_watch`), which costs their overlap."""
        if self._course.record.used_before_forward is None:
            log.warning("deft: the loop used %s between optimizer.step() and the next forward (after iteration "
                        "%d); deft applies the updates it leaves finishing in the forward before such a use, as "
                        "torch DDP's step would have applied them, and they do not overlap that forward. Using "
                        "parameters there every few iterations keeps most of the overlap", what, t)
        self._course.record.used(t, what)

    def takes_record(self) -> bool:
        """Can :meth:`state` be taken now? Not after a backward and before its step (the loop has not
        cleared the gradients, as a skipped step's are): the wrapper's ``state_dict()`` is then torch
        DDP's, the module's alone (the step's gradients are in neither), unless deft queues gradients of
        earlier iterations (a merged update), which that checkpoint would lose: refused."""
        if self._phase in (Phase.IDLE, Phase.FORWARD) or self._skipped():
            return True
        held = [list(u.iterations) for u in self.pending_updates if any(i < self._t for i in u.iterations)]
        if held:
            raise DeftError(f"a checkpoint of the wrapper (state_dict(), torch.save) after the backward of iteration "
                            f"{self._t} and before its optimizer step, while deft still holds the gradients of "
                            f"iterations {held} (a merged update): the checkpoint would lose them. Save after "
                            "optimizer.step(), or set epsilon = 0")
        return False

    def _skipped(self) -> bool:
        """After a backward, the loop cleared the gradients without a step: GradScaler skipped it."""
        return self._phase is Phase.BACKWARD_DONE and self._updates.exposed and self._updates.cleared()

    def _require_idle(self, what: str) -> None:
        if self._phase is Phase.BACKWARD_DONE and self._updates.exposed:
            # the last step was skipped (GradScaler found inf/NaN), or none comes (the end of a loop whose
            # last backward no step takes): the iteration is over, its gradients dropped. state() is
            # refused before this where they are still in p.grad (takes_record)
            self._skip_step()
        if self._phase is Phase.FORWARD:
            self._withdraw()
        if self._phase is not Phase.IDLE:
            raise DeftError(f"{what} must be called between iterations (after optimizer.step()); iteration "
                            f"{self._t} is in its {self._phase} phase, between its first gradient and its step")

    def _withdraw(self) -> None:
        """Iteration ``t`` was begun and no gradient of it reached deft: a forward with gradients enabled
        and no backward (evaluation outside ``torch.no_grad()``), or the micro-batches of an accumulation
        so far (their sum stays in ``p.grad``, which no checkpoint holds, torch DDP's neither). The loop
        now needs deft between iterations, as torch DDP allows there, so the executor withdraws the
        iteration, and the next training forward (or micro-batch) begins it again.

        Note: only the executor's part is undone. The course's timing and the traces keep the first
        begin (the next begin does not repeat them), so that iteration is timed from its first forward,
        as it is when nothing comes between."""
        self._executor.withdraw_iteration()
        self._phase = Phase.IDLE
        self._withdrawn = True

    def _begin_iteration(self) -> None:
        """A forward begins (or a first gradient arrives through the bare module)."""
        if self._withdrawn:  # begun before (_withdraw): the executor's part again, nothing else
            self._withdrawn = False
            self._phase = Phase.FORWARD
            self._executor.begin_iteration(self._t)
            return
        self._updates.stop_watching()
        self._updates.drop_after_step()
        self._phase = Phase.FORWARD
        self._micro_batches = False
        self._course.before_forward(self._t, self._cuda)
        self._tracing.begin(self._t, self._executor.layout)
        self._executor.begin_iteration(self._t)
        self._course.forward_begins()
        self._tracing.forward_begins(self._t)

    def _on_grad(self, index: int, p: torch.Tensor) -> None:
        """A parameter's gradient of this backward is accumulated (post-accumulate-grad hook)."""
        if p.grad is None:
            return
        if self._phase is Phase.IDLE:  # backward through the bare module: still an iteration
            self._begin_iteration()
        self._course.gradient_seen(index)
        if self._sync.backward_accumulates() and self._phase is Phase.FORWARD:
            # a micro-batch: its gradient stays in p.grad, this rank's sum so far as under torch DDP; the
            # backward that communicates adds to it (or _take_left_grads takes it, its parameter unused there)
            self._micro_batches = True
            return
        if self._phase is Phase.FORWARD:
            self._phase = Phase.BACKWARD
            self._course.adaptation.backward_begins(time.perf_counter())
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._tracing.first_gradient()
        self._executor.add_grad(index, p.grad)
        p.grad = None
        self._tracing.after_gradient()

    def _take_left_grads(self) -> None:
        """The backward ends: a gradient still in ``p.grad`` is one the backward did not reach (carried or
        left by the loop, :meth:`deft.runtime.updates.UpdateApplier.drop_after_step`); it is that
        parameter's gradient of this iteration, as torch DDP's reducer takes what ``p.grad`` holds."""
        if self._sync.backward_accumulates():
            return  # under no_sync() it stays in p.grad, for the backward that communicates
        for i, p in enumerate(self._params):
            if p.grad is not None:
                self._executor.add_grad(i, p.grad)
                p.grad = None

    def _on_backward_end(self) -> None:
        if self._phase is Phase.BACKWARD:
            self._course.backward_ends(time.perf_counter())
            self._take_left_grads()
            self._executor.end_backward()
            self._phase = Phase.BACKWARD_DONE
            self._expose()
            self._course.loop_resumes(self._t)
        self._tracing.backward_ends()

    def _expose(self) -> None:
        """End of backward (or the step, if no backward ended): the due updates into ``p.grad``
        (:meth:`deft.runtime.updates.UpdateApplier.expose`), whole when something couples them or the
        preserver's statistics need the whole gradient at the step."""
        if self._updates.exposing:
            return
        ex = self._executor
        self._updates.finish_deferred()  # an update finishing in a forward that did not run through deft
        lasts = ex.due(self._t)
        coupled, record = self._updates.couples(), self._course.record
        if coupled is not None and any(ex.finishes_in_forward(last) for last in lasts) \
                and record.finish_in_forward is None:
            record.finish_in_forward = f"off: whole updates applied at the step: {coupled}"
            log.warning("deft: updates are applied whole at the step, not module by module in the forward: %s",
                        coupled)
        # Whole also before the first step has shown deft the optimizer (a deferred part needs its
        # hyperparameters) and while the preserver measures the whole averaged gradient.
        whole = coupled is not None or self._optim.optimizer is None or self._course.measuring()
        updates = [ex.take_update(last, whole=whole) for last in lasts]
        self._course.on_due(lasts, updates, self._t, self.device)
        self._updates.expose(updates, self._t, partial=bool(ex.deferred), placeholders=self._course.planned)

    def _before_step(self) -> None:
        """Before the user's ``optimizer.step()``: the due update's gradient is in ``p.grad``."""
        self._course.loop_pauses()
        try:
            self._prepare_step()
        finally:
            self._course.loop_resumes(self._t)  # the optimizer's own step is the loop's

    def _prepare_step(self) -> None:
        if self._withdrawn:  # a step after a checkpoint taken in the iteration: its state as before that
            self._begin_iteration()
        if self._phase is Phase.IDLE:
            # no iteration: the step applies whatever gradients the caller set, as under torch DDP
            # (torch.distributed.checkpoint's get_state_dict steps zero gradients at lr 0 to create the state)
            self._step_open = False
            return
        if self._phase is Phase.FORWARD and self._micro_batches:
            raise DeftError(f"optimizer.step() of iteration {self._t} follows only backwards whose forward ran "
                            "under no_sync(): torch DDP would step every rank on its own local gradient (the "
                            "ranks drift apart). End the accumulation with a forward and backward outside "
                            "no_sync(), or run the last backward under ddp.trigger_sync_in_backward(). Local "
                            "SGD (Accelerate's LocalSGD keeps no_sync() open for the whole run, stepping each "
                            "rank alone) is deft's config local_steps=H instead")
        self._step_open = True
        if self._phase in (Phase.FORWARD, Phase.BACKWARD):
            self._take_left_grads()
            self._executor.end_backward()  # no backward, or one without gradients for deft: unused = zero
            self._phase = Phase.BACKWARD_DONE
            self._tracing.backward_ends()
        self._expose()
        self._updates.before_step()

    def _settle_member(self, params: list[torch.Tensor]) -> None:
        """Before another optimizer of the same step (several optimizers) reads its parameters' gradients;
        after the step (an optimizer joining), what the step left there becomes plain values."""
        if self._step_open:
            self._updates.settle(params)
        else:
            settle_for_step(params)

    def _member_stepped(self) -> None:
        """Right after each optimizer's step in the iteration's step."""
        if self._step_open:
            self._updates.give_back()

    def _next_micro_batch(self) -> None:
        """A training forward began after backward() without optimizer.step(). ``p.grad`` kept: the loop
        accumulates without no_sync(), the gradients are carried into the next step, the sum applied as
        torch DDP applies it (:meth:`deft.runtime.updates.UpdateApplier.carry`). ``p.grad`` cleared: the
        step was skipped. Either way this iteration ends here and the micro-batch is the next one."""
        if not self._updates.carry():
            self._skip_step()
            return
        self._step_open = True
        self._after_step()

    def _skip_step(self) -> None:
        """A forward began after backward() without optimizer.step(): the step was skipped (GradScaler
        found inf/NaN, or the loop chose to). As with torch DDP, the exposed update is dropped; updates
        applied before it stay applied, other queued gradients stay queued."""
        self._updates.skip()
        self._course.record.skipped_steps.append(self._t)
        self._step_open = True
        self._after_step()

    def _after_user_step(self) -> None:
        t = self._t
        self._course.loop_pauses()
        self._after_step(stepped=True)
        self._updates.watch_until_forward(t)
        self._course.loop_resumes(t)  # zero_grad, the schedule, the next batch: the loop's, until its forward

    def _after_step(self, stepped: bool = False) -> None:
        """After the user's ``optimizer.step()`` (``stepped``; else a skipped step or a carried micro-batch
        at the next forward): the iteration ends; warm-up, planning, re-checks follow."""
        self._updates.restore_lr()
        if not self._step_open:
            return
        self._step_open = False
        self._updates.end_step(self._t, stepped)
        self._sync.iteration_ends()
        self._phase = Phase.IDLE
        self._course.iteration_ends()
        self._t += 1
        self._tracing.after_step(self._t)
        self._course.after_step(self._t, self.flush)

    # -- installing schedules ----------------------------------------------------------------------
    def _install(self, schedule: Schedule, layout: FlatLayout, t0: int) -> None:
        """The one way a schedule starts running: executor, trace ranges, statistics follow the layout."""
        old = self._executor.layout
        if old is not None and (old.bucket_params, old.bucket_numel) != (layout.bucket_params, layout.bucket_numel):
            self._course.codecs.carry_buckets(old, layout)  # memory follows its elements
        self._executor.install(schedule, layout, t0, self._course.codecs.hooks_for(schedule))
        self._updates.set_forward_hooks(any(u.finish_in_forward for u in schedule.updates))
        self._tracing.set_layout(layout)
        if self._course.stats is not None:
            self._course.stats.on_layout()


@outside_graphs
def _watched_call(recorder: FirstUseRecorder, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's forward under ``recorder``; eager, so its function mode sees every real call."""
    with recorder.watching(module):
        return module(*args, **kwargs)


def _hold_switch_interval(owner: ScheduledRun, ms: float, links: dict[str, CommLink]) -> weakref.finalize | None:
    """Python's switch interval at ``ms`` while ``owner`` lives or until the returned finalizer is called
    (:mod:`deft.runtime.switch_interval`), where a link is gloo (its threads run hooks' callbacks)."""
    if ms <= 0 or not any(link.backend == "gloo" for link in links.values()):
        return None
    return weakref.finalize(owner, SWITCH.release, SWITCH.hold(ms / 1000))


def _grad_hook(me: DeadOnSave[ScheduledRun], index: int, p: torch.Tensor) -> None:
    """Gradient capture; through a weak reference, so a dropped wrapper does not keep capturing."""
    d = me()
    if d is not None:
        d._on_grad(index, p)


def _state_dict_hook(me: DeadOnSave[ScheduledRun], module: nn.Module, prefix: str, keep_vars: bool) -> None:
    d = me()
    if d is not None:
        d._updates.finish_deferred()
