"""``deft.DistributedDataParallel``: torch DDP's interface, DeFT's schedule.

Use it like torch DDP; a torch DDP constructor line works as it is::

    ddp = deft.DistributedDataParallel(model, device_ids=[rank])   # optimizer=, config=, profile= optional
    loss = loss_fn(ddp(x), y); loss.backward(); ddp.observe_loss(loss)   # observe_loss is optional
    optimizer.step(); optimizer.zero_grad()

This module is the facade: torch-compatible construction, the public API and the per-iteration phase
machine (:mod:`deft.runtime.phase`), which calls its collaborators at a few named events (a forward
begins, a gradient is ready, the backward ends, the step begins and ends) and installs what they
decide. One module per job (docs/DESIGN.md, "Runtime", has the table).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError, DeftError
from deft.profile import Profile
from deft.runtime.buckets import FlatLayout
from deft.runtime.checkpoint import RuntimeState, StateDoc
from deft.runtime.codecs.first_iteration import TimedBroadcast
from deft.runtime.codecs.hooks import CommHook, from_config
from deft.runtime.compat import Device, check_device_ids, check_torch_args, for_compiled, shared_config, trainable
from deft.runtime.control import ControlPlane, broadcast_state, digest, wait_work
from deft.runtime.course import Course
from deft.runtime.executor import Executor, PendingUpdate
from deft.runtime.first_use import FirstUseRecorder
from deft.runtime.grad_stats import check_probe_args, probe_curvature
from deft.runtime.links import CommLink, make_buffer_group, make_control_group, make_links
from deft.runtime.local_steps import LocalSteps
from deft.runtime.optimizer_hooks import OptimizerBinding
from deft.runtime.phase import Phase
from deft.runtime.planning import check_schedule_file, resolve_profile
from deft.runtime.records import PlanInfoView
from deft.runtime.tensors import batch_size
from deft.runtime.tracing import Tracing
from deft.runtime.updates import LogEntry, UpdateApplier
from deft.schedule import Schedule

log = logging.getLogger("deft.runtime")
#: The version of local-steps mode's checkpoint record (``get_extra_state``).
LOCAL_STATE_VERSION = 1


class DistributedDataParallel(nn.Module):
    """Drop-in replacement of ``torch.nn.parallel.DistributedDataParallel`` running a DeFT schedule.

    The positional arguments are torch DDP's, in torch's order, so a torch DDP line carries over;
    deft's own (``optimizer``, ``config``, ``profile``) are keyword-only. Of torch's arguments,
    ``process_group``, ``broadcast_buffers``, ``init_sync`` and ``bucket_cap_mb`` (the warm-up buckets'
    cap, as ``config.bucket_cap_mb``) act as in torch; ``device_ids``/``output_device`` are checked
    against the parameters' device; ``find_unused_parameters`` is always on in effect (deft handles
    unused parameters like torch DDP with it set); ``dim``, ``check_reduction``,
    ``gradient_as_bucket_view``, ``static_graph``, ``skip_all_reduce_unused_params``,
    ``batched_grad_copy`` are performance hints deft does not need; the others raise
    (:mod:`deft.runtime.compat`).
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[Device] | None = None,
                 output_device: Device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = True, init_sync: bool = True,
                 process_group: dist.ProcessGroup | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: object = None, param_to_hook_all_reduce: object = None,
                 mixed_precision: object = None, device_mesh: object = None,
                 skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: object = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, *, optimizer: torch.optim.Optimizer | None = None,
                 config: DeftConfig | str | os.PathLike[str] | JsonDict | None = None,
                 profile: Profile | str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        del dim, check_reduction, gradient_as_bucket_view, static_graph, skip_all_reduce_unused_params
        del batched_grad_copy, find_unused_parameters
        check_torch_args(dict(delay_all_reduce_named_params=delay_all_reduce_named_params,
                              param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
                              device_mesh=device_mesh, bucket_cap_mb_list=bucket_cap_mb_list), device_ids)
        self.module = module
        cfg = DeftConfig.resolve(config)
        # A given bucket_cap_mb caps the first bucket too, as torch 2.13's DDP does (first_bucket_cap_mb).
        self.config = cfg if bucket_cap_mb is None else replace(cfg, bucket_cap_mb=float(bucket_cap_mb),
                                                                 first_bucket_cap_mb=float(bucket_cap_mb))
        # Bad files fail here, before any collective. Only rank 0 reads a schedule file when planning,
        # so another rank without the file (multi-node) skips the check.
        given_profile = resolve_profile(profile, self.config)
        path = self.config.schedule_path
        if path is not None and (dist.get_rank() == 0 or os.path.exists(path)):
            check_schedule_file(self.config, module)
        self._names, self._params, self.device = trainable(module)
        self.config, self._compiled = for_compiled(module, self.config)
        check_device_ids(device_ids, output_device, self.device)
        self._cuda = self.device.type == "cuda"
        self._ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        # torch DDP all-reduces on process_group (default: the default group): deft's primary link follows its backend
        self._group_backend = str(dist.get_backend(process_group))
        self._connect(init_sync)
        self.broadcast_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
        self._sync_buffers = self.broadcast_buffers if forward_sync_buffers is None else bool(forward_sync_buffers)
        self._buffers_due = True  # the next forward broadcasts the buffers (torch DDP's first forward does)
        self._build(given_profile, optimizer)

    def _connect(self, init_sync: bool) -> None:
        """Collective: the control plane, the ranks' agreement on config and model, the links, and
        rank 0's parameters and buffers on every rank (``init_sync``)."""
        cfg = self.config
        self._control = ControlPlane(make_control_group(cfg, self._ranks), cfg.timeout_s)
        self.rank, self.world = self._control.rank, self._control.world
        shared = shared_config(cfg)
        self._control.check_agreement("config", digest(shared), shared)
        model_doc = {n: [list(p.shape), str(p.dtype)] for n, p in zip(self._names, self._params, strict=True)}
        self._control.check_agreement("model (trainable parameter names, shapes, dtypes)",
                                      digest({"params": list(model_doc.items())}), model_doc)
        self._links: dict[str, CommLink] = make_links(cfg, self._cuda, self._ranks, self._group_backend)
        self._primary = next(iter(self._links.values()))
        self._buffer_group = make_buffer_group(cfg, self._primary, self._cuda, self._ranks)
        self._init_broadcast: TimedBroadcast | None = None
        if init_sync:
            state = list(self.module.parameters()) + list(self.module.buffers())
            # set the group up first (NCCL creates its communicator at the first collective), so the
            # broadcast's time measures the link (codecs.first_iteration: the first iteration's judgement)
            wait_work(dist.all_reduce(torch.zeros(1, device=self.device), group=self._primary.group, async_op=True),
                      self._primary.name, "first collective", self.rank, cfg.timeout_s)
            start = time.perf_counter()
            broadcast_state(state, self._primary.group, self._primary.name, self.rank, cfg.timeout_s)
            self._init_broadcast = TimedBroadcast(time.perf_counter() - start,
                                                  sum(t.numel() * t.element_size() for t in state))

    def _build(self, given_profile: Profile | None, optimizer: torch.optim.Optimizer | None) -> None:
        """The collaborators, the iteration state, the warm-up schedule and the hooks."""
        cfg = self.config
        self._executor = Executor(self._params, self._links, self.rank, self.world, cfg.timeout_s, self.device)
        self._optim = OptimizerBinding(self._params, self._before_step, self._after_step, optimizer)
        self._updates = UpdateApplier(self.module, self._params, self._executor, self._optim, cfg, self._compiled)
        self._course = Course(cfg, self._control, self.module, self._names, self._params, self._links,
                              self._executor, self._optim, self._updates.log, given_profile, self._ranks,
                              self._install, from_config(cfg), self._init_broadcast)
        self._tracing = Tracing(self.module, self._params, self._executor, dist.get_rank(), self._cuda,
                                self._course.calendar.warm_end, self._course.profile_iters)
        self._first_use: FirstUseRecorder | None = FirstUseRecorder(self._params) if cfg.forward_updates else None
        self._t = 0  # index of the current (or next) training iteration
        self._phase = Phase.IDLE
        self._step_open = False  # the user's step began (its post hook ends the iteration)
        self._no_sync = False
        self._course.install_warmup(list(reversed(range(len(self._params)))), t0=0)
        # Local-steps mode (config.local_steps > 0): its own collaborator at the step events; no gradient
        # capture, no schedule (deft.runtime.local_steps).
        self._local = LocalSteps(cfg, self._params, self._links, self.rank, self.world) if cfg.local_steps else None
        me = weakref.ref(self)
        self._hooks = [] if self._local is not None else \
            [p.register_post_accumulate_grad_hook(_grad_hook(me, i)) for i, p in enumerate(self._params)]
        # Whoever reads the module's state_dict gets the parameters torch DDP would have.
        self._hooks.append(self.module.register_state_dict_pre_hook(_state_dict_hook(me)))

    # -- public API ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:  # the wrapped module's own signature
        self._sync_buffers_now()
        if self._local is not None:
            return self.module(*args, **kwargs)  # gradients stay local; the step events do the rest
        if not torch.is_grad_enabled():
            out = self.module(*args, **kwargs)  # evaluation: no gradient communication, nothing counted
            self._updates.finish_deferred()  # parameters of modules the evaluation did not run
            return out
        if self._phase is Phase.BACKWARD_DONE:
            if not self._updates.exposed:
                raise DeftError(f"the forward of a new iteration started before optimizer.step() of iteration "
                                f"{self._t}; deft runs forward, backward, optimizer.step() once per iteration, "
                                "with an optimizer over this module's parameters (wrap forwards that are not "
                                "training, e.g. metrics, in torch.no_grad())")
            self._skip_step()  # gradients were there and no step took them: a skipped step
        if self._phase is Phase.IDLE:
            self._begin_iteration()
            self._course.note_batch(batch_size(args, kwargs))
        if self._first_use is not None:  # once, in the first training forward (deft.runtime.first_use)
            recorder, self._first_use = self._first_use, None
            with recorder.watching(self.module):
                out = self.module(*args, **kwargs)
            self._updates.first_use = recorder.first
        else:
            out = self.module(*args, **kwargs)
        self._updates.finish_deferred()  # parameters of modules this forward did not run
        self._course.forward_ends(out)
        self._tracing.forward_ends(out)
        return out

    def _sync_buffers_now(self) -> None:
        """Collective: buffers (BatchNorm statistics) follow rank 0 at a forward that comes after a
        training forward outside ``no_sync()``, evaluation forwards included: torch DDP's rule."""
        sync, self._buffers_due = self._buffers_due, torch.is_grad_enabled() and not self._no_sync
        # one rank's buffers are rank 0's already: nothing to send (torch DDP sends them anyway)
        if sync and self._sync_buffers and self.world > 1 and any(True for _ in self.module.buffers()):
            if self._buffer_group is not None:
                broadcast_state(list(self.module.buffers()), self._buffer_group, f"{self._primary.name} (buffers)",
                                self.rank, self.config.timeout_s, stream_ordered=True)
            else:
                broadcast_state(list(self.module.buffers()), self._control.group, "control", self.rank,
                                self.config.timeout_s)

    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Report this iteration's loss (optional; feeds the preserver's convergence statistics, and in
        local-steps mode ``local_period = "adacomm"``'s period)."""
        value = float(loss.detach().item()) if isinstance(loss, torch.Tensor) else float(loss)
        self._course.losses.append(value)
        if self._local is not None:
            self._local.observe_loss(value)

    def calibrate(self, closure: Callable[[], torch.Tensor], *, tol: float = 0.05, ncv: int | None = 4,
                  maxiter: int = 300) -> JsonDict | None:
        """Optional, collective: measure the top Hessian eigenvalue for the preserver's stability check.

        ``closure()`` returns the training loss of one global-batch-sized batch computed through
        ``ddp.module`` (not ``ddp``: it is not a training iteration). Rank 0 runs Lanczos on
        Hessian-vector products (:func:`deft.runtime.grad_stats.probe_curvature`; its cost:
        benchmarks/results/stability.md) and broadcasts the value; the next plan and re-check use it
        instead of the free secant estimate. Call it between iterations, typically right before
        training and again before a re-check if the sharpness grows. Does nothing (returns ``None``)
        when the preserver could not accept a stale schedule (epsilon 0, preserver off, one rank). Bad
        arguments raise on every rank; a probe that fails on rank 0 (e.g. Lanczos does not converge) is
        reported on every rank, not raised, and the secant estimate stays in use. The other ranks wait
        for the probe up to ``config.timeout_s``.
        """
        self._require_idle("calibrate()")
        check_probe_args(closure, tol, ncv, maxiter)
        if self.config.epsilon == 0 or not self.config.preserver or self.world < 2 or self._local is not None:
            return None
        # Every rank: an update finishing in the forward is applied now, so the closure's forward (rank 0
        # only) cannot trigger it on one rank. The forward changes batch-norm running statistics on
        # rank 0; the next iteration's buffer broadcast (broadcast_buffers) gives them to every rank.
        self._updates.finish_deferred()
        doc = probe_curvature(closure, self._optim.optimizer, self._params, tol, ncv, maxiter) if self.rank == 0 else {}
        doc = self._control.broadcast_json(doc, "curvature probe")
        self._course.record.calibrations.append({"iteration": self._t, **doc})
        if "error" in doc:
            log.warning("deft: curvature probe failed (%s); the preserver keeps the secant estimate", doc["error"])
            return None
        self._course.calibrated = doc
        return doc

    @property
    def schedule(self) -> Schedule:
        """The schedule running now (the DDP-like synchronous one during warm-up)."""
        assert self._executor.schedule is not None
        return self._executor.schedule

    @property
    def iteration(self) -> int:
        """The index of the current (or next) training iteration."""
        return self._t

    @property
    def phase(self) -> Phase:
        """Where the current iteration stands (:class:`deft.runtime.phase.Phase`)."""
        return self._phase

    @property
    def pending_updates(self) -> list[PendingUpdate]:
        """Updates whose gradients are queued but not yet applied, oldest first: the iterations each
        merges so far and the buckets already sent."""
        return self._executor.pending()

    @property
    def update_log(self) -> list[LogEntry]:
        """Every applied update: (the iteration at whose step it was applied, the iterations it merges)."""
        return self._updates.log

    @property
    def plan_info(self) -> PlanInfoView:
        """What deft decided, read-only (:mod:`deft.runtime.records` lists the keys; in local-steps mode
        only ``local_steps``: :meth:`deft.runtime.local_steps.LocalSteps.info`)."""
        if self._local is not None:
            return PlanInfoView({"local_steps": self._local.info()})
        return self._course.record.view()

    @property
    def profile(self) -> Profile | None:
        """The profile the running schedule was planned from (corrected by adaptation; None before)."""
        return self._course.profile

    @property
    def last_grad_norm(self) -> float | None:
        """With :meth:`clip_grad_norm_on_update`: the last update's norm before clipping."""
        return self._updates.last_grad_norm

    @property
    def link_stats(self) -> dict[str, dict[str, int]]:
        """Collectives and bytes sent per link so far."""
        return {n: {"calls": lk.stats.calls, "bytes": lk.stats.bytes} for n, lk in self._links.items()}

    @property
    def comm_hook(self) -> CommHook | None:
        """The registered comm hook and its state (None: plain all-reduces)."""
        return self._course.codecs.comm_hook

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future[torch.Tensor]]) -> None:
        """torch DDP's ``register_comm_hook``: ``hook(state, bucket) -> Future`` runs on every bucket deft
        sends, on the scheduled link and stage (see :mod:`deft.runtime.codecs.hooks`). torch's own hooks
        work unchanged (fp16/bf16 compression, PowerSGD). Register it once, before training (and
        before ``load_state_dict`` when resuming: the checkpoint restores the hook's state)."""
        if not callable(hook):
            raise DeftError(f"register_comm_hook: hook must be callable(state, bucket), got {type(hook).__name__}")
        if self._local is not None:
            raise DeftError("register_comm_hook: local-steps mode (config.local_steps > 0) communicates no "
                            "gradients after its warm-up and averages parameters exactly; there is no bucket to hook")
        if self._course.codecs.comm_hook is not None:
            raise DeftError(f"register_comm_hook: a comm hook ({self._course.codecs.comm_hook.name}) is already "
                            "registered (from this call or the config's compression); one hook per model")
        self._require_idle("register_comm_hook()")
        self._course.register_hook(self._t, CommHook(state, hook, getattr(hook, "__name__", type(hook).__name__)))

    def flush(self) -> None:
        """Communicate and apply every pending update now (collective: every rank calls it).

        For the end of training or before an evaluation that must see every gradient. A group cut
        short merges the iterations it has; the schedule restarts its cycle at the next iteration.
        """
        self._require_idle("flush()")
        if self._local is not None:
            self._local.flush()  # the averaging in flight, applied now
            return
        self._updates.finish_deferred()
        if self._executor.idle:
            return
        if self._course.stats is not None:
            self._course.stats.discard()  # groups cut short: no clean per-group statistics
        self._updates.drain(self._t)

    def clip_grad_norm_on_update(self, max_norm: float | None, norm_type: float = 2.0) -> None:
        """Clip every update's averaged gradient to ``max_norm`` right before the optimizer applies it.

        Calling ``torch.nn.utils.clip_grad_norm_`` between ``backward()`` and ``step()`` works too (the
        due update's gradient is in ``p.grad`` then, as with torch DDP); this variant also clips updates
        deft applies outside the user's step (several due at once, ``flush()``). A merged update is
        clipped as one step's gradient, as with gradient accumulation. ``None`` turns it off;
        ``last_grad_norm`` holds the norm before clipping of the last update.
        """
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 or None, got {max_norm}")
        self._updates.clip = None if max_norm is None else (float(max_norm), float(norm_type))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Like torch DDP's: backwards inside only accumulate (micro-batches of one iteration); the
        first backward outside completes the iteration's gradient and communicates it as scheduled."""
        previous = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = previous

    def close(self) -> None:
        """Remove deft's hooks from the parameters and the optimizer (the wrapper is unusable after)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._updates.close()
        self._optim.remove()
        self._course.close()
        self._tracing.close()

    # -- checkpoint (deft.runtime.checkpoint) ----------------------------------------------------
    def get_extra_state(self) -> StateDoc:
        """deft's runtime state for ``state_dict()``: tensors and plain types only."""
        self._require_idle("deft's state can only be saved; saving")
        if self._local is not None:
            return {"version": LOCAL_STATE_VERSION, "mode": "local_steps", "rank": self.rank, "world": self.world,
                    "t": self._t, "local_steps": self._local.state_dict()}
        self._updates.finish_deferred()  # no collective: waits only for what every rank launched
        ex = self._executor
        ex.settle_all()  # in-flight buckets become reduced values; recorded as launched
        assert ex.schedule is not None and ex.layout is not None
        return RuntimeState(rank=self.rank, world=self.world, t=self._t, t0=ex.t0, order=list(ex.layout.order),
                            schedule=ex.schedule, groups=ex.group_states(), update_log=list(self._updates.log),
                            comm_hook=self._course.codecs.comm_hook_state(),
                            codec_hooks=self._course.codecs.hook_states(),
                            **self._course.state()).to_dict()

    def set_extra_state(self, state: object) -> None:
        local = isinstance(state, dict) and state.get("mode") == "local_steps"
        if local != (self._local is not None):
            raise ContractError("deft checkpoint", "_extra_state.mode",
                                f"the checkpoint was saved {'in' if local else 'outside'} local-steps mode and this "
                                f"wrapper runs {'in' if self._local is not None else 'outside'} it "
                                "(config.local_steps must match)")
        if self._local is not None:
            assert isinstance(state, dict)
            self._require_idle("deft's state can only be loaded; loading")
            self._load_local(state)
            return
        st = RuntimeState.from_dict(state)
        self._require_idle("deft's state can only be loaded; loading")
        st.check_owner(self.rank, self.world)
        # first, so that a damaged codec state is refused before anything of this wrapper changes
        self._course.codecs.load_hook_states(st.codec_hooks, "deft checkpoint")
        layout = FlatLayout(st.order, self._names, self._params, st.schedule.bucket_numel, "deft checkpoint: schedule")
        self._executor.forget_groups()
        self._course.restore(st)
        self._install(st.schedule, layout, st.t0)
        self._executor.restore_groups(st.groups, "deft checkpoint")
        self._t = st.t
        self._updates.log[:] = st.update_log
        self._course.codecs.load_comm_hook_state(st.comm_hook, "deft checkpoint")

    def _load_local(self, state: dict[str, Any]) -> None:
        """Local-steps mode's checkpoint: an averaging in flight holds this rank's own snapshot."""
        assert self._local is not None
        if state.get("version") != LOCAL_STATE_VERSION:
            raise ContractError("deft checkpoint", "_extra_state.version", f"expected local-steps state version "
                                f"{LOCAL_STATE_VERSION}, got {state.get('version')!r}")
        doc = state.get("local_steps")
        pending = isinstance(doc, dict) and doc.get("pending") is not None
        if state.get("world") != self.world or (pending and state.get("rank") != self.rank):
            raise ContractError("deft checkpoint", "_extra_state.rank",
                                f"this checkpoint holds rank {state.get('rank')}'s (of {state.get('world')}) "
                                f"snapshot of an averaging in flight; load it on rank {state.get('rank')} of "
                                f"{state.get('world')} (this is rank {self.rank} of {self.world}) or call "
                                "ddp.flush() before saving")
        self._local.load_state_dict(doc)
        self._t = int(state["t"])

    # -- the phase machine's events (deft.runtime.phase) ----------------------------------------
    def _require_idle(self, what: str) -> None:
        if self._phase is Phase.BACKWARD_DONE and self._updates.exposed:
            self._skip_step()  # the last step was skipped (GradScaler found inf/NaN): the iteration is over
        if self._phase is not Phase.IDLE:
            raise DeftError(f"{what} must be called between iterations (after optimizer.step()); iteration "
                            f"{self._t} is in its {self._phase} phase. A forward with gradients enabled starts "
                            "an iteration: run evaluation under torch.no_grad()")

    def _begin_iteration(self) -> None:
        """A forward begins (or a first gradient arrives through the bare module)."""
        self._phase = Phase.FORWARD
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
        if self._no_sync and self._phase is Phase.FORWARD:
            self._executor.add_grad(index, p.grad, final=False)  # a micro-batch: accumulate only
            p.grad = None
            return
        if self._phase is Phase.FORWARD:
            self._phase = Phase.BACKWARD
            self._course.adaptation.backward_begins(time.perf_counter())
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._tracing.first_gradient()
        self._executor.add_grad(index, p.grad)
        p.grad = None
        self._tracing.after_gradient()

    def _on_backward_end(self) -> None:
        if self._phase is Phase.BACKWARD:
            self._course.backward_ends(time.perf_counter())
            self._executor.end_backward()
            self._phase = Phase.BACKWARD_DONE
            self._expose()
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
        if self._local is not None:
            self._local.before_step()  # the warm-up's gradient mean; then nothing
            return
        if self._phase is Phase.IDLE:
            self._updates.clear_grads()  # a step without an iteration changes nothing
            self._step_open = False
            return
        self._step_open = True
        if self._phase in (Phase.FORWARD, Phase.BACKWARD):
            self._executor.end_backward()  # no backward, or one without gradients for deft: unused = zero
            self._phase = Phase.BACKWARD_DONE
            self._tracing.backward_ends()
        self._expose()
        self._updates.before_step()

    def _skip_step(self) -> None:
        """A forward began after backward() without optimizer.step(): the step was skipped (GradScaler
        found inf/NaN, or the loop chose to). As with torch DDP, the exposed update is dropped; updates
        applied before it stay applied, other queued gradients stay queued."""
        self._updates.skip()
        self._course.record.skipped_steps.append(self._t)
        self._step_open = True
        self._after_step()

    def _after_step(self) -> None:
        """After the user's ``optimizer.step()``: the iteration ends; warm-up, planning, re-checks follow."""
        if self._local is not None:
            self._local.after_step()  # an averaging applied or launched at its step
            self._t += 1
            return
        self._updates.restore_lr()
        if not self._step_open:
            return
        self._step_open = False
        self._updates.end_step(self._t)
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


def _grad_hook(me: weakref.ref[DistributedDataParallel], index: int) -> Callable[[torch.Tensor], None]:
    """Gradient capture; a weak reference, so a dropped wrapper does not keep capturing."""
    def hook(p: torch.Tensor) -> None:
        d = me()
        if d is not None:
            d._on_grad(index, p)
    return hook


def _state_dict_hook(me: weakref.ref[DistributedDataParallel]) -> Callable[[nn.Module, str, bool], None]:
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        d = me()
        if d is not None:
            d._updates.finish_deferred()
    return hook
