"""``deft.DistributedDataParallel``: torch DDP's interface, DeFT's schedule.

Use it like torch DDP; a torch DDP constructor line works as it is::

    ddp = deft.DistributedDataParallel(model, device_ids=[rank])   # optimizer=, config=, profile= optional
    loss = loss_fn(ddp(x), y); loss.backward(); ddp.observe_loss(loss)   # observe_loss is optional
    optimizer.step(); optimizer.zero_grad()

This module is the facade and the per-iteration state machine (:mod:`deft.runtime.phase`); the work
is done by one module per job:

============================  ===================================================================
:mod:`~deft.runtime.control`   deft's own bounded collectives: agreement digests, JSON broadcast
:mod:`~deft.runtime.links`     one process group per configured link (NIC), traffic counters
:mod:`~deft.runtime.buckets`   the flat gradient layout: parameters in ready order, bucket ranges
:mod:`~deft.runtime.executor`  launch and wait rules of a cyclic schedule, update groups
:mod:`~deft.runtime.optimizer_hooks`  finding the optimizer, applying updates inside its step
:mod:`~deft.runtime.warmup_timer`  per-bucket timing during the profile iterations -> a Profile
:mod:`~deft.runtime.planning`  rank 0 plans (fallbacks), all ranks agree, preserver re-checks
:mod:`~deft.runtime.grad_stats`  gradient-noise statistics and the preserver's WalkStats
:mod:`~deft.runtime.checkpoint`  the typed, versioned runtime record in ``state_dict()``
:mod:`~deft.runtime.tracing`   NVTX / torch.profiler ranges and trace export
============================  ===================================================================

The life of a run, the invariants (every gradient applied exactly once, a step that is not due
changes nothing, bounded waits, exact resume) and the semantics worth knowing are in
``docs/DESIGN.md`` (section "Runtime").
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deft.config import DeftConfig
from deft.errors import ContractError, DeftError
from deft.preserver.curvature import adam_preconditioner, top_eigenvalue
from deft.preserver.gaussian_walk import merge_lr_factor
from deft.profile import Profile
from deft.profiler import nvtx
from deft.runtime.adapt import (
    Adapter,
    Synchronous,
    SynchronousClock,
    plan_digest,
    synchronous_candidate,
    window_medians,
)
from deft.runtime.background import Background
from deft.runtime.buckets import FlatLayout, ddp_like_bucket_numel
from deft.runtime.checkpoint import RuntimeState
from deft.runtime.comm_hooks import CommHook, carry_buckets, from_config, plain_iterations, profile_codec
from deft.runtime.control import ControlPlane, broadcast_state, digest
from deft.runtime.executor import Executor, Pending, PendingUpdate
from deft.runtime.grad_stats import GradStats, walk_stats
from deft.runtime.links import CommLink, make_control_group, make_links, make_solo_group
from deft.runtime.optimizer_hooks import OptimizerBinding, merged_lr, restore_lr, scale_lr
from deft.runtime.phase import Phase
from deft.runtime.planning import (
    Planning,
    check_schedule_file,
    make_schedule,
    resolve_profile,
)
from deft.runtime.tensors import tensors_in
from deft.runtime.tracing import TRACE_DIR_ENV, ForwardRanges, TraceRecorder, profile_iters_from_env, recording
from deft.runtime.warmup_timer import Codec, WarmupTimer
from deft.schedule import Schedule, synchronous_schedule

log = logging.getLogger("deft.runtime")

#: Warm-up buckets are no larger than torch DDP's first bucket (1 MB): they are also the profile's
#: buckets, and the planner needs per-layer resolution of compute and ready times.
PROFILE_BUCKET_CAP_MB = 1.0
#: After planning, statistics run only in this many iterations before each preserver re-check. In
#: them every update is applied whole at the step (the statistics need the whole averaged gradient), so
#: a lag-free plan loses its forward overlap there: measured on the testbed (digits CNN, 250 Mbit/s,
#: recheck_every 64), 545 ms per iteration inside a 32-iteration window against 445 outside. 8 keeps
#: twice the samples the first plan is made from (warm-up + profile, 4) at a quarter of that cost
#: (about 1 % of a long run at the default recheck_every of 200, against 3.6 % with 32).
STATS_WINDOW = 8

#: torch optimizers whose update of a parameter reads only that parameter, its gradient and its own state:
#: an update finishing in the forward may apply them one module at a time (exact type, not subclasses).
PER_PARAMETER_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                            torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                            torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adadelta)

_UNSUPPORTED = ("delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision", "device_mesh",
                "bucket_cap_mb_list")


class DistributedDataParallel(nn.Module):
    """Drop-in replacement of ``torch.nn.parallel.DistributedDataParallel`` running a DeFT schedule.

    The positional arguments are torch DDP's, in torch's order, so a torch DDP line carries over;
    deft's own (``optimizer``, ``config``, ``profile``) are keyword-only. Of torch's arguments,
    ``process_group``, ``broadcast_buffers``, ``init_sync`` and ``bucket_cap_mb`` (the warm-up buckets'
    cap, as ``config.bucket_cap_mb``) act as in torch; ``device_ids``/``output_device`` are checked
    against the parameters' device; ``find_unused_parameters`` is always on in effect (deft handles
    unused parameters like torch DDP with it set); ``dim``, ``check_reduction``,
    ``gradient_as_bucket_view``, ``static_graph``, ``skip_all_reduce_unused_params``,
    ``batched_grad_copy`` are performance hints deft does not need; the others raise.
    """

    def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0,
                 broadcast_buffers: bool | None = True, init_sync: bool = True, process_group: Any = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: Any = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, *, optimizer: torch.optim.Optimizer | None = None,
                 config: DeftConfig | str | os.PathLike[str] | dict[str, Any] | None = None,
                 profile: Profile | str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        del dim, check_reduction, gradient_as_bucket_view, static_graph, skip_all_reduce_unused_params
        del batched_grad_copy, find_unused_parameters
        given = dict(delay_all_reduce_named_params=delay_all_reduce_named_params,
                     param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
                     device_mesh=device_mesh, bucket_cap_mb_list=bucket_cap_mb_list)
        bad = [k for k in _UNSUPPORTED if given[k] is not None]
        if bad:
            raise DeftError(f"deft.DistributedDataParallel does not support torch DDP's {bad}; remove them "
                            "(mixed precision: use torch.autocast in the training loop)")
        if isinstance(device_ids, torch.optim.Optimizer):
            raise DeftError("the second positional argument is torch DDP's device_ids; pass the optimizer as "
                            "optimizer=... (deft's own arguments optimizer, config, profile are keyword-only)")
        if not (dist.is_available() and dist.is_initialized()):
            raise DeftError("deft.DistributedDataParallel needs torch.distributed to be initialized first: "
                            "launch with torchrun and call torch.distributed.init_process_group()")
        self.module = module
        cfg = DeftConfig.resolve(config)
        if bucket_cap_mb is not None:
            cfg = replace(cfg, bucket_cap_mb=float(bucket_cap_mb))
        self.config = cfg
        # Bad files fail here, before any collective. Only rank 0 reads a schedule file when planning,
        # so another rank without the file (multi-node) skips the check.
        given_profile = resolve_profile(profile, cfg)
        if cfg.schedule_path is not None and (dist.get_rank() == 0 or os.path.exists(cfg.schedule_path)):
            check_schedule_file(cfg, module)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise DeftError("the module has no parameter that requires a gradient")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        devices = {p.device for p in self._params}
        if len(devices) != 1:
            raise DeftError(f"deft needs all trainable parameters on one device, got {sorted(map(str, devices))}")
        self.device = self._params[0].device
        _check_device_ids(device_ids, output_device, self.device)
        self._cuda = self.device.type == "cuda"

        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        self._control = ControlPlane(make_control_group(cfg, ranks), cfg.timeout_s)
        self.rank, self.world = self._control.rank, self._control.world
        shared = _config_shared(cfg)
        self._control.check_agreement("config", digest(shared), shared)
        model_doc = {n: [list(p.shape), str(p.dtype)] for n, p in zip(self._names, self._params, strict=True)}
        self._control.check_agreement("model (trainable parameter names, shapes, dtypes)",
                                      digest({"params": list(model_doc.items())}), model_doc)
        self._links: dict[str, CommLink] = make_links(cfg, self._cuda, ranks)
        self._primary = next(iter(self._links.values()))
        if init_sync:
            broadcast_state(list(module.parameters()) + list(module.buffers()), self._primary.group,
                            self._primary.name, self.rank, cfg.timeout_s)
        self.broadcast_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
        self._sync_buffers = self.broadcast_buffers if forward_sync_buffers is None else bool(forward_sync_buffers)

        self._executor = Executor(self._params, self._links, self.rank, self.world, cfg.timeout_s, self.device)
        self._executor.comm_hook = from_config(cfg)
        self._executor.on_bucket_ready = self._bucket_ready
        self._executor.on_launch = self._launched
        self._executor.on_hook_start = self._hook_started
        self._ranks = ranks
        self._solo: Any = None  # this rank's one-rank group, for timing a comm hook's codec
        self._planning = Planning(cfg, self._control, given_profile, cfg.schedule_path)
        self._profile_iters = profile_iters_from_env(cfg.profile_iters)
        self._place_profile()
        # Trace output: torch.profiler over the profile iterations (DEFT_TRACE_DIR), and forward
        # ranges only when some tool was asked for at construction (no forward hooks otherwise).
        trace_dir = os.environ.get(TRACE_DIR_ENV) or None
        self._tracer = None if trace_dir is None else TraceRecorder(
            trace_dir, dist.get_rank(), self._cuda, self._warm_end, self._profile_iters)
        self._fwd_ranges = ForwardRanges(module, self._params) if trace_dir or nvtx.nvtx_enabled() else None
        self._bwd_tok: nvtx.Range | None = None
        self._reopen_bwd = False

        # Iteration state.
        self._t = 0                      # index of the current (or next) training iteration
        self._phase = Phase.IDLE
        self._order_seen: dict[int, None] = {}  # parameters in the order their gradients arrived
        self._ready_order: list[int] | None = None  # rank 0's observed order, once agreed
        self._planned = False
        self.update_log: list[tuple[int, tuple[int, ...]]] = []
        self.plan_info: dict[str, Any] = {}
        self.profile: Profile | None = None  # the profile the schedule was planned from
        self._losses: collections.deque[float] = collections.deque(maxlen=64)
        self._batch: int | None = None
        self._timer: WarmupTimer | None = None
        self._stats: GradStats | None = None
        self._no_sync = False
        self._clip: tuple[float, float] | None = None
        self._step_open = False
        self.last_grad_norm: float | None = None
        # Gradients exposed in p.grad after backward: (parameter, tensor, version) to see changes.
        self._exposed: list[tuple[torch.Tensor, torch.Tensor | None, int]] | None = None
        self._exposed_partial = False
        self._exposed_iterations: tuple[int, ...] | None = None
        self._lr_saved: list[Any] | None = None  # the param groups' lr while a merged update's step runs scaled
        self._grads_touched = False  # code between backward() and step() modifies gradients
        # Updates finishing in the forward: module pre-hooks, and the hyperparameters of the step that
        # began the update (a learning-rate scheduler may have stepped since).
        self._owned: dict[int, list[int]] = {}
        self._fwd_hooks: list[Any] = []
        self._finish_hparams: list[dict[str, Any]] = []
        # Closing the loop (deft.runtime.adapt): per-iteration times of the running schedule.
        self._adapt_on = False
        self._adapter: Adapter | None = None  # rank 0
        self._last_walk: Any = None  # the preserver's statistics at the last plan (rank 0 re-plans with them)
        self._calibrated: dict[str, Any] | None = None  # rank 0's Lanczos probe (calibrate), on every rank
        self._fwd_start: float | None = None
        self._bwd_start: float | None = None
        self._iter_s: list[float] = []
        self._bwd_s: list[float] = []
        # The warm-up's synchronous schedule, a measured candidate (deft.runtime.adapt, step 4).
        self._sync_clock = SynchronousClock()
        self._sync_candidate: Schedule | None = None
        self._warm_layout: FlatLayout | None = None
        # Planning in the background (config.plan_lag_iters; deft.runtime.background.Background): the
        # iteration at which the plan, or the adaptation's decision, is collected and installed.
        self._plan_due: int | None = None
        self._stats_reason = ""
        self._adapt_due: int | None = None
        self._adapt_job: Background | None = None  # rank 0
        self._adapt_from = ""  # the digest of the schedule the decision in flight was measured on
        self._install_warmup(list(reversed(range(len(self._params)))), t0=0)

        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(_grad_hook(me, i)) for i, p in enumerate(self._params)]
        self._optim = OptimizerBinding(self._params, self, optimizer)
        # Whoever reads the module's state_dict gets the parameters torch DDP would have.
        self._hooks.append(module.register_state_dict_pre_hook(_state_dict_hook(me)))

    # -- public API ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            out = self.module(*args, **kwargs)  # evaluation: no communication, nothing counted
            self._finish_deferred()  # parameters of modules the evaluation did not run
            return out
        if self._phase is Phase.BACKWARD_DONE:
            if not self._exposed:
                raise DeftError(f"the forward of a new iteration started before optimizer.step() of iteration "
                                f"{self._t}; deft runs forward, backward, optimizer.step() once per iteration, "
                                "with an optimizer over this module's parameters (wrap forwards that are not "
                                "training, e.g. metrics, in torch.no_grad())")
            self._skip_step()  # gradients were there and no step took them: a skipped step
        if self._phase is Phase.IDLE:
            # Buffers (e.g. BatchNorm statistics) follow rank 0 at the first forward of an iteration,
            # which is when torch DDP broadcasts them too (also with no_sync() micro-batches).
            if self._sync_buffers and any(True for _ in self.module.buffers()):
                broadcast_state(list(self.module.buffers()), self._control.group, "control", self.rank,
                                self.config.timeout_s)
            self._begin_iteration()
            self._note_batch(args, kwargs)
        out = self.module(*args, **kwargs)
        self._finish_deferred()  # parameters of modules this forward did not run
        if self._timer is not None:
            self._timer.end_forward(out)
        if self._fwd_ranges is not None:
            self._fwd_ranges.end()
        if recording():
            for t in tensors_in(out):
                if t.requires_grad:
                    t.register_hook(self._backward_starts)
        return out

    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Report this iteration's loss (optional; feeds the preserver's convergence statistics)."""
        self._losses.append(float(loss.detach().item()) if isinstance(loss, torch.Tensor) else float(loss))

    def calibrate(self, closure: Any, *, tol: float = 0.05, ncv: int | None = 4, maxiter: int = 300
                  ) -> dict[str, Any] | None:
        """Optional, collective: measure the top Hessian eigenvalue for the preserver's stability check.

        ``closure()`` returns the training loss of one global-batch-sized batch computed through
        ``ddp.module`` (not ``ddp``: it is not a training iteration). Rank 0 runs Lanczos on
        Hessian-vector products (:func:`deft.preserver.curvature.top_eigenvalue`; on the digits CNN
        ~14 products, 16 s at ``tol=0.05, ncv=4``: benchmarks/results/stability.md) and broadcasts the
        value; the next plan and re-check use it instead of the free secant estimate. Call it between
        iterations, typically right before training and again before a re-check if the sharpness
        grows. Does nothing (returns ``None``) when the preserver could not accept a stale schedule
        (epsilon 0, preserver off, one rank). Bad arguments raise on every rank; a probe that fails on
        rank 0 (e.g. Lanczos does not converge) is reported on every rank, not raised, and the secant
        estimate stays in use. The other ranks wait for the probe up to ``config.timeout_s``.
        """
        self._require_idle("calibrate()")
        # Argument errors are the caller's: raised on every rank before any collective.
        if not callable(closure):
            raise DeftError(f"calibrate(closure): expected a callable returning the loss, got {type(closure).__name__}")
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1:
            raise DeftError(f"calibrate(tol=...): expected a relative tolerance in (0, 1), got {tol!r}")
        if ncv is not None and (isinstance(ncv, bool) or not isinstance(ncv, int) or ncv < 3):
            raise DeftError(f"calibrate(ncv=...): expected None or an integer >= 3 (Lanczos vectors), got {ncv!r}")
        if isinstance(maxiter, bool) or not isinstance(maxiter, int) or maxiter < 1:
            raise DeftError(f"calibrate(maxiter=...): expected an integer >= 1, got {maxiter!r}")
        if self.config.epsilon == 0 or not self.config.preserver or self.world < 2:
            return None
        # Every rank: an update finishing in the forward is applied now, so the closure's forward (rank 0
        # only) cannot trigger it on one rank. The forward changes batch-norm running statistics on
        # rank 0; the next iteration's buffer broadcast (broadcast_buffers) gives them to every rank.
        self._finish_deferred()
        doc: dict[str, Any] = {}
        if self.rank == 0:
            try:
                opt = self._optim.optimizer
                pre = None
                if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and opt.state:
                    pre = adam_preconditioner(opt, self._params)  # exact for linearised Adam (scale 1 in the spec)
                est = top_eigenvalue(closure, self._params, tol=tol, ncv=ncv, maxiter=maxiter, preconditioner=pre)
                doc = {**est.to_dict(), "preconditioned": pre is not None}
            except Exception as e:  # tell the other ranks; the secant estimate stays in use
                log.exception("deft: calibrate() failed on rank 0")
                doc = {"error": f"{type(e).__name__}: {e}"}
        doc = self._control.broadcast_json(doc, "curvature probe")
        self.plan_info.setdefault("calibrations", []).append({"iteration": self._t, **doc})
        if "error" in doc:
            log.warning("deft: curvature probe failed (%s); the preserver keeps the secant estimate", doc["error"])
            return None
        self._calibrated = doc
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
    def link_stats(self) -> dict[str, dict[str, int]]:
        """Collectives and bytes sent per link so far."""
        return {n: {"calls": lk.stats.calls, "bytes": lk.stats.bytes} for n, lk in self._links.items()}

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """torch DDP's ``register_comm_hook``: ``hook(state, bucket) -> Future`` runs on every bucket deft
        sends, on the scheduled link and stage (see :mod:`deft.runtime.comm_hooks`). torch's own hooks
        work unchanged (fp16/bf16 compression, PowerSGD). Register it once, before training (and
        before ``load_state_dict`` when resuming: the checkpoint restores the hook's state)."""
        if not callable(hook):
            raise DeftError(f"register_comm_hook: hook must be callable(state, bucket), got {type(hook).__name__}")
        if self._executor.comm_hook is not None:
            raise DeftError(f"register_comm_hook: a comm hook ({self._executor.comm_hook.name}) is already "
                            "registered (from this call or the config's compression); one hook per model")
        self._require_idle("register_comm_hook()")
        if self._planning.measuring and self._warm_end < self._t <= self._plan_at and not self._planned:
            # the profile iterations so far ran without the hook: a profile mixing both would be wrong
            raise DeftError(f"register_comm_hook: profiling began at iteration {self._warm_end} without a hook; "
                            "register the hook before training starts (or before iteration "
                            f"{self._warm_end}), as with torch DDP")
        self._executor.comm_hook = CommHook(state, hook, getattr(hook, "__name__", type(hook).__name__))
        if self._t <= self._warm_end and not self._planned:
            self._place_profile()

    def _place_profile(self) -> None:
        """Warm-up ends (and the profile iterations begin) ``warmup_iters`` (at least 1) iterations after
        the comm hook begins to compress: PowerSGD sends plainly for its first ``start_powerSGD_iter``
        iterations, and a profile of those would plan the steady state on uncompressed times (DESIGN.md,
        "Compression in the profile"); its first compressed iterations are slow too (it allocates its
        error feedback and P/Q memories, and measured on the testbed torch DDP + PowerSGD took 342, 299
        and 354 ms in its first three against 200-210 after), so the warm-up counts from there. A given
        profile or schedule is taken as it is: nothing is measured, so nothing waits."""
        plain = plain_iterations(self._executor.comm_hook) if self._planning.measuring else 0
        self._warm_end = plain + max(1, self.config.warmup_iters)
        self._plan_at = self._warm_end + (self._profile_iters if self._planning.measuring else 0)
        # The preserver's statistics before planning: the last n iterations before the hook compresses
        # (exact all-reduced gradients, the walk's inputs; the compressed warm-up and profile iterations
        # then run without their cost), or the first n when it compresses sooner; without a hook,
        # every iteration before planning. n is the warm-up + profile length. Measured (loopback, digits
        # CNN, PowerSGD from iteration 9): 367 ms per plain iteration with the statistics against
        # 245 ms without (torch DDP + PowerSGD: 215), so 13 iterations of them cost deft ~1.5 s.
        n = self._plan_at - plain
        self._stats_window = (max(0, plain - n), max(plain, n))

    @property
    def comm_hook(self) -> CommHook | None:
        """The registered comm hook and its state (None: plain all-reduces)."""
        return self._executor.comm_hook

    def flush(self) -> None:
        """Communicate and apply every pending update now (collective: every rank calls it).

        For the end of training or before an evaluation that must see every gradient. A group cut
        short merges the iterations it has; the schedule restarts its cycle at the next iteration.
        """
        self._require_idle("flush()")
        self._finish_deferred()
        ex = self._executor
        if not ex.groups:
            return
        if self._stats is not None:
            self._stats.discard()  # groups cut short: no clean per-group statistics
        for upd in ex.drain():
            self._set_grads(upd.grads)
            self._step_merged(len(upd.iterations))
            self.update_log.append((self._t - 1, upd.iterations))
        self._clear_grads()
        ex.t0 = self._t

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
        self._clip = None if max_norm is None else (float(max_norm), float(norm_type))

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
        for h in self._hooks + self._fwd_hooks:
            h.remove()
        self._hooks, self._fwd_hooks = [], []
        self._optim.remove()
        if self._timer is not None:
            self._timer.close()
        if self._fwd_ranges is not None:
            self._fwd_ranges.close()

    # -- checkpoint (deft.runtime.checkpoint) ----------------------------------------------------
    def get_extra_state(self) -> dict[str, Any]:
        """deft's runtime state for ``state_dict()``: tensors and plain types only."""
        self._require_idle("deft's state can only be saved; saving")
        self._finish_deferred()  # no collective: waits only for what every rank launched
        ex = self._executor
        ex.settle_all()  # in-flight buckets become reduced values; recorded as launched
        assert ex.schedule is not None and ex.layout is not None
        return RuntimeState(rank=self.rank, world=self.world, t=self._t, t0=ex.t0, planned=self._planned,
                            plan_at=self._plan_at, order_known=self._ready_order is not None,
                            order=list(ex.layout.order), schedule=ex.schedule, groups=ex.group_states(),
                            update_log=list(self.update_log), plan_info=self.plan_info,
                            comm_hook=None if ex.comm_hook is None else ex.comm_hook.state_dict()).to_dict()

    def set_extra_state(self, state: Any) -> None:
        st = RuntimeState.from_dict(state)
        self._require_idle("deft's state can only be loaded; loading")
        st.check_owner(self.rank, self.world)
        layout = FlatLayout(st.order, self._names, self._params, st.schedule.bucket_numel, "deft checkpoint: schedule")
        self._executor.groups.clear()
        # A decision in flight belongs to the run being replaced: wait for its thread (it works on this
        # object's adapter and profile), then drop its result.
        if self._adapt_job is not None:
            self._adapt_job.result()
        self._plan_due = self._adapt_due = None
        self._adapt_job = None
        self._planning.discard()
        self._install(st.schedule, layout, st.t0)
        self._executor.restore_groups(st.groups, "deft checkpoint")
        self._t = st.t
        self._planned = st.planned
        self._ready_order = st.order if st.order_known else None
        self._plan_at = st.plan_at
        if not self._planned and self._t > self._warm_end:
            # Timings of a half-done profiling phase (or of a plan still in flight when the checkpoint was
            # taken) are not in it: profile and plan again from here.
            self._warm_end = self._t
            self._plan_at = self._t + (self._profile_iters if self._planning.measuring else 0)
            self._stats_window = (0, self._plan_at)
            if self.rank == 0:
                log.warning("deft: the checkpoint was taken at iteration %d, before planning finished; deft "
                            "profiles again from here and plans at iteration %d (torch DDP's schedule until the "
                            "plan is in)", self._t, self._plan_at)
        self.update_log = list(st.update_log)
        self.plan_info = st.plan_info
        if st.comm_hook is not None:
            if self._executor.comm_hook is None:
                raise ContractError("deft checkpoint", "_extra_state.comm_hook",
                                    "the checkpoint holds a comm hook's state but no hook is registered: call "
                                    "ddp.register_comm_hook(...) before load_state_dict")
            self._executor.comm_hook.load_state_dict(st.comm_hook, "deft checkpoint")

    # -- the iteration state machine (deft.runtime.phase) -----------------------------------------
    def _require_idle(self, what: str) -> None:
        if self._phase is Phase.BACKWARD_DONE and self._exposed:
            self._skip_step()  # the last step was skipped (GradScaler found inf/NaN): the iteration is over
        if self._phase is not Phase.IDLE:
            raise DeftError(f"{what} must be called between iterations (after optimizer.step()); iteration "
                            f"{self._t} is in its {self._phase} phase. A forward with gradients enabled starts "
                            "an iteration: run evaluation under torch.no_grad()")

    def _begin_iteration(self) -> None:
        self._phase = Phase.FORWARD
        now = time.perf_counter()
        if self.config.adapt:
            self._sync_clock.forward(self._t, now, self._warm_end if self._planning.measuring else 1, self._plan_at)
        if self._adapt_on:
            if self._fwd_start is not None:
                self._iter_s.append(now - self._fwd_start)
            self._fwd_start = now
        profiling = self._warm_end <= self._t < self._plan_at and not self._planned
        if profiling and self._timer is None:
            assert self._executor.layout is not None
            self._timer = WarmupTimer(self.module, self._params, self._executor.layout, self._links, self._cuda)
        if self._timer is not None and not self._executor.groups and self._executor.layout is not None:
            # a profile iteration: the timer rotates the buckets over the links (no bucket sent twice)
            self._executor.install(self._timer.schedule(), self._executor.layout, self._t)
        if self._tracer is not None and self._tracer.maybe_start(self._t):
            self._mark_layout()
        self._executor.begin_iteration(self._t)
        if self._timer is not None:  # after deft's own set-up: the forward is the model's alone
            self._timer.begin_iteration()
        if self._fwd_ranges is not None:
            self._fwd_ranges.begin(self._t)

    def _on_grad(self, index: int, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if self._phase is Phase.IDLE:  # backward through the bare module: still an iteration
            self._begin_iteration()
        if self._ready_order is None:
            self._order_seen.setdefault(index)
        if self._no_sync and self._phase is Phase.FORWARD:
            self._executor.add_grad(index, p.grad, final=False)  # a micro-batch: accumulate only
            p.grad = None
            return
        if self._phase is Phase.FORWARD:
            self._phase = Phase.BACKWARD
            if self._adapt_on:
                self._bwd_start = time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            if self._fwd_ranges is not None:
                self._fwd_ranges.end()
            if self._bwd_tok is None and recording():
                self._open_bwd()
        self._executor.add_grad(index, p.grad)
        p.grad = None
        if self._reopen_bwd:
            self._reopen_bwd = False
            self._open_bwd()

    def _on_backward_end(self) -> None:
        if self._phase is Phase.BACKWARD:
            if self._adapt_on and self._bwd_start is not None:
                self._bwd_s.append(time.perf_counter() - self._bwd_start)
            self._executor.end_backward()
            self._phase = Phase.BACKWARD_DONE
            self._expose()
        self._close_bwd()

    def _expose(self) -> None:
        """End of backward (or the step, if no backward ended): the due updates' averaged gradients go
        into ``p.grad``, where torch DDP leaves them, so GradScaler, clipping and any code between
        ``backward()`` and ``step()`` see them. Earlier updates due at the same step are applied
        through internal steps; an update finishing in the forward exposes only its parameters whose
        buckets were sent in backward (the rest are applied in the next forward)."""
        if self._exposed is not None:
            return
        ex = self._executor
        self._finish_deferred()  # an update finishing in a forward that did not run through deft
        lasts = ex.due(self._t)
        coupled = self._couples()
        if coupled is not None and any(ex.groups[last].finish_in_forward for last in lasts) \
                and "finish_in_forward" not in self.plan_info:
            self.plan_info["finish_in_forward"] = f"off: whole updates applied at the step: {coupled}"
            log.warning("deft: updates are applied whole at the step, not module by module in the forward: %s",
                        coupled)
        # The preserver's statistics need the whole averaged gradient at the step: in their window
        # (before each re-check) updates are applied whole.
        measuring = self._stats is not None and self._stats_wanted()
        updates = [ex.take_update(last, whole=coupled is not None or measuring) for last in lasts]
        if ex.deferred:
            opt = self._optim.optimizer
            assert opt is not None
            factor = merge_lr_factor(len(updates[-1].iterations), self.config.merge_lr_scaling)
            self._finish_hparams = [{k: (v * factor if k == "lr" else v) for k, v in g.items() if k != "params"}
                                    for g in opt.param_groups]
        if self._stats is not None:
            assert ex.layout is not None
            for last, upd in zip(lasts, updates, strict=True):
                if last in ex.groups:  # finishing in the next forward: no whole gradient at this step
                    self._stats.drop(last)
                    continue
                self._stats.update(last, ex.layout, upd.grads, self._control.group, self.device)
                # lag-free, one iteration: computed at the parameters now (only while statistics are
                # gathered: each observation copies the parameters and the gradient)
                if upd.iterations == (self._t,) and self._stats_wanted():
                    self._stats.observe_point(self._params, upd.grads)
        for upd in updates[:-1]:
            self._set_grads(upd.grads)
            self._step_merged(len(upd.iterations))
            self.update_log.append((self._t, upd.iterations))
        if updates:
            self._set_grads(updates[-1].grads)
            self._exposed_iterations = updates[-1].iterations  # logged when the step takes it
        else:
            self._clear_grads()
        self._exposed = [(p, p.grad, p.grad._version) for p in self._params if p.grad is not None]
        self._exposed_partial = bool(ex.deferred)

    def _grads_changed(self) -> bool:
        """Did code between backward() and step() modify the exposed gradients (GradScaler's unscale_,
        clip_grad_norm_, ...)? In-place changes bump a tensor's version counter."""
        return any(p.grad is not g or (g is not None and g._version != v) for p, g, v in self._exposed or ())

    def _before_step(self) -> None:
        """Before the user's ``optimizer.step()``: the due update's gradient is in ``p.grad``."""
        if self._phase is Phase.IDLE:
            self._clear_grads()  # a step without an iteration changes nothing
            self._step_open = False
            return
        self._step_open = True
        if self._phase in (Phase.FORWARD, Phase.BACKWARD):
            self._executor.end_backward()  # no backward, or one without gradients for deft: unused = zero
            self._phase = Phase.BACKWARD_DONE
            self._close_bwd()
        self._expose()
        if self._grads_changed():
            self._grads_touched = True
            if self._exposed_partial:
                raise DeftError("the gradients were modified between backward() and optimizer.step() (GradScaler's "
                                "unscale_, clip_grad_norm_, ...), but this update finishes in the next forward and "
                                "its other parameters cannot get the same change. deft switches to whole updates "
                                "when it sees this during warm-up; here it appeared only after planning: set "
                                "forward_updates = false in the config")
        # The user's step applies the exposed update: a merge of k iterations steps with the lr scaled
        # (config.merge_lr_scaling), restored in _after_step before any LR scheduler runs.
        if self._exposed_iterations is not None and self._optim.optimizer is not None:
            self._lr_saved = scale_lr(self._optim.optimizer, merge_lr_factor(len(self._exposed_iterations),
                                                                             self.config.merge_lr_scaling))

    def _skip_step(self) -> None:
        """A forward began after backward() without optimizer.step(): the step was skipped (GradScaler
        found inf/NaN, or the loop chose to). As with torch DDP, the exposed update is dropped; updates
        applied before it stay applied, other queued gradients stay queued."""
        ex = self._executor
        self._exposed_iterations = None  # dropped, not applied
        if self._exposed:
            ex.finish()  # its deferred part, if any, is dropped too
        self.plan_info.setdefault("skipped_steps", []).append(self._t)
        self._step_open = True
        self._after_step()

    def _after_step(self) -> None:
        """After the user's ``optimizer.step()``: the iteration ends; warm-up, planning, re-checks follow."""
        if self._lr_saved is not None and self._optim.optimizer is not None:
            restore_lr(self._optim.optimizer, self._lr_saved)
            self._lr_saved = None
        if not self._step_open:
            return
        self._step_open = False
        self._exposed = None
        if self._exposed_iterations is not None:
            self.update_log.append((self._t, self._exposed_iterations))
            self._exposed_iterations = None
        self._clear_grads()
        self._phase = Phase.IDLE
        if self._timer is not None:
            self._timer.end_iteration()
        self._t += 1
        if self._tracer is not None:
            path = self._tracer.after_step(self._t)
            if path is not None:
                log.info("deft: rank %d wrote its torch.profiler trace to %s", self.rank, path)
                self._tracer = None
                if self._fwd_ranges is not None and not nvtx.nvtx_enabled():
                    self._fwd_ranges.close()
                    self._fwd_ranges = None
        if self._ready_order is None:
            self._adopt_ready_order()
        if not self._planned and self._stats is None:
            self._stats = GradStats.start(self.config, self.world)
        if not self._planned and self._plan_due is None and self._t >= self._plan_at:
            self._plan()
            return
        if not self._planned and self._plan_due is not None and self._job_ready(self._plan_due, self._planning.job):
            self._finish_plan()
            return
        if self._planned and self._planning.recheck_on:
            self._maybe_recheck()
        if self._adapt_on:
            self._maybe_adapt()
        self._maybe_switch()

    def _step_merged(self, k: int) -> None:
        """deft's own optimizer step for an update merging ``k`` iterations (lr scaled by the config)."""
        opt = self._optim.optimizer
        if opt is None:
            self._optim.step_internally()  # raises the error that names the missing optimizer
            return
        with merged_lr(opt, k, self.config.merge_lr_scaling):
            self._optim.step_internally()

    def _set_grads(self, grads: list[torch.Tensor | None]) -> None:
        for p, g in zip(self._params, grads, strict=True):
            p.grad = g
        if self._clip is not None:
            with_grad = [p for p in self._params if p.grad is not None]
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(with_grad, *self._clip))

    def _clear_grads(self) -> None:
        for p in self._params:
            p.grad = None

    def _note_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # the first dimension of the first tensor argument, looking into lists and dicts (HF-style inputs)
        for a in tensors_in(list(args) + list(kwargs.values())):
            if a.dim() > 0:
                self._batch = int(a.shape[0])
                return

    # -- updates finishing in the forward (Update.finish_in_forward) -----------------------------
    def _couples(self) -> str | None:
        """Why an update cannot be applied one module at a time (None: it can)."""
        if self._grads_touched:
            return ("gradients are modified between backward() and step() (GradScaler's unscale_, "
                    "clip_grad_norm_, ...): every parameter must see the change")
        if self._clip is not None:
            return "clip_grad_norm_on_update couples all parameters (the norm is global)"
        opt = self._optim.optimizer
        if opt is not None and type(opt) not in PER_PARAMETER_OPTIMIZERS:
            return (f"{type(opt).__name__} is not one of torch's per-parameter optimizers "
                    f"({', '.join(o.__name__ for o in PER_PARAMETER_OPTIMIZERS)})")
        return None

    def _set_forward_hooks(self, on: bool) -> None:
        for h in self._fwd_hooks:
            h.remove()
        self._fwd_hooks = []
        if not on:
            return
        index = {id(p): i for i, p in enumerate(self._params)}
        me = weakref.ref(self)
        self._owned = {}
        for m in self.module.modules():
            own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
            if own:
                self._owned[id(m)] = own
                self._fwd_hooks.append(m.register_forward_pre_hook(_forward_pre_hook(me)))

    def _before_module(self, m: nn.Module) -> None:
        """Forward pre-hook: the module's deferred parameters get their update now."""
        own = self._owned.get(id(m))
        if own and self._executor.deferred:
            self._apply_deferred(self._executor.finish(own))

    def _finish_deferred(self) -> None:
        if self._executor.deferred:
            self._apply_deferred(self._executor.finish())

    def _apply_deferred(self, grads: list[torch.Tensor | None]) -> None:
        """One internal optimizer step over the parameters in ``grads`` (others ``None``: untouched), with
        the hyperparameters of the step at which their update began."""
        if all(g is None for g in grads):
            return
        opt = self._optim.optimizer
        assert opt is not None
        now = [{k: g[k] for k in snap} for g, snap in zip(opt.param_groups, self._finish_hparams, strict=True)]
        try:
            for g, snap in zip(opt.param_groups, self._finish_hparams, strict=True):
                g.update(snap)
            for p, gr in zip(self._params, grads, strict=True):
                p.grad = gr
            self._optim.step_internally()
        finally:
            for g, values in zip(opt.param_groups, now, strict=True):
                g.update(values)
            self._clear_grads()

    # -- layouts and schedules -------------------------------------------------------------------
    def _install(self, schedule: Schedule, layout: FlatLayout, t0: int) -> None:
        """The one way a schedule starts running: executor, trace ranges, statistics follow the layout."""
        old = self._executor.layout
        if old is not None and (old.bucket_params, old.bucket_numel) != (layout.bucket_params, layout.bucket_numel):
            carry_buckets(self._executor.comm_hook, old, layout, self._params)  # memory follows its elements
        self._executor.install(schedule, layout, t0)
        self._set_forward_hooks(any(u.finish_in_forward for u in schedule.updates))
        if self._fwd_ranges is not None:
            self._fwd_ranges.set_layout(layout)
        self._mark_layout()
        if self._stats is not None:
            self._stats.on_layout()

    def _install_warmup(self, order: list[int], t0: int) -> None:
        """torch DDP's behaviour during warm-up: buckets of whole parameters in ready order, sent in backward.

        Their cap is :data:`PROFILE_BUCKET_CAP_MB`, except under a chained comm hook (PowerSGD, a user's
        hook: :attr:`CommHook.chained`), where it is ``bucket_cap_mb`` as in torch DDP. Such sends run one
        at a time over all links and each pays the hook's collectives (PowerSGD: three) and its per-call
        compute, so the warm-up iterations (PowerSGD's plain ones included) and the profile iterations
        would pay that once per 1 MB bucket: measured on the testbed (digits CNN, 250 Mbit/s), deft +
        PowerSGD's first compressed iterations (profile, planning) took 390-1110 ms on 1 MB buckets
        against torch's 210-360, and their per-bucket times were too noisy to choose a bucket count.
        The planner may still fuse these buckets (it never splits a tensor under PowerSGD); a smaller
        ``bucket_cap_mb`` gives it finer ones."""
        hook = self._executor.comm_hook
        serial = hook is not None and hook.chained
        cap = self.config.bucket_cap_mb if serial else min(self.config.bucket_cap_mb, PROFILE_BUCKET_CAP_MB)
        layout = FlatLayout(order, self._names, self._params, ddp_like_bucket_numel(order, self._params, cap),
                            "<warm-up buckets>")
        self._install(synchronous_schedule(layout.bucket_numel, layout.bucket_nbytes(), (self._primary.name,)),
                      layout, t0)

    def _adopt_ready_order(self) -> None:
        """After the first iteration: rank 0's observed ready order, broadcast, becomes the layout."""
        seen = list(self._order_seen)
        rest = [i for i in reversed(range(len(self._params))) if i not in self._order_seen]
        self._ready_order = self._control.broadcast_ints(seen + rest, "gradient ready order")
        self._install_warmup(self._ready_order, t0=self._t)

    def _order_for(self, profile: Profile | None) -> list[int]:
        """The flat order: the given profile's bucket order when it names exactly our parameters."""
        observed = list(self._ready_order or reversed(range(len(self._params))))
        if profile is None or self._planning.given_profile is None:
            return observed
        names = [n.removeprefix("module.") for b in profile.buckets for n in b.params]
        index = {n: i for i, n in enumerate(self._names)}
        if len(names) == len(index) and set(names) == set(index):
            return [index[n] for n in names]
        return observed

    def _plan(self) -> None:
        """Collective: measure (or take) a profile, rank 0 plans, every rank installs the same schedule."""
        started = time.perf_counter()
        profile = self._planning.given_profile
        if self._planning.measuring:
            assert self._timer is not None
            backends = {n: lk.backend for n, lk in self._links.items()}
            profile = self._timer.profile(self._control, self.world, backends, type(self.module).__name__,
                                          self._names, self._profile_codec())
            self._timer.close()
            self._timer = None
            out = os.environ.get("DEFT_PROFILE_OUT")
            if out and self.rank == 0:
                profile.save(out)
        self.profile = profile
        stats, stats_reason = self._walk_stats()
        if stats is None and self.rank == 0 and self.config.epsilon > 0 and self.config.preserver \
                and self._planning.schedule_path is None:
            log.warning("deft: the preserver cannot test delayed updates (%s); it keeps the no-delay schedule",
                        stats_reason)
        self._last_walk = stats
        self._stats_reason = stats_reason
        lag = self.config.plan_lag_iters
        if lag > 0 and self._executor.layout is not None and self._planning.schedule_path is None:
            # Rank 0 plans in a thread; every rank trains on with the synchronous schedule of the first
            # profile iteration and switches when it is done, at most lag iterations from now
            # (deft.runtime.planning).
            self._planning.start(profile, stats, self.world)
            self._plan_due = self._t + lag
            self._executor.install(self._synchronous(self._executor.layout), self._executor.layout, self._t)
            self._sync_clock.exclude(time.perf_counter() - started)
            return
        schedule, info = self._planning.agree(profile, stats, self.world)
        self._install_plan(schedule, info, {}, started)

    def _synchronous(self, layout: FlatLayout) -> Schedule:
        """torch DDP's timing on ``layout``, its buckets over the links the profile measured (the primary
        alone when the profile was given): what runs while rank 0 plans, and what adaptation may go back to."""
        links = tuple(self._links) if self._planning.measuring else (self._primary.name,)
        return synchronous_candidate(layout, links)

    def _job_ready(self, due: int, job: Background | None) -> bool:
        """Collective while a background decision is in flight: collect it at this iteration boundary?
        At ``due`` (the ``plan_lag_iters`` limit) yes; before, when rank 0's thread is done (rank 0's
        word, broadcast, so every rank answers alike)."""
        if self._t >= due:
            return True
        done = int(job is not None and job.done()) if self.rank == 0 else 0
        return bool(self._control.broadcast_ints([done], "background planning state")[0])

    def _finish_plan(self) -> None:
        """Collective: collect the plan :meth:`_plan` began in the background and install it."""
        self._plan_due = None
        started = time.perf_counter()
        schedule, info, timing = self._planning.finish()
        self._install_plan(schedule, info, {"background": {"lag_iters": self.config.plan_lag_iters,
                                                           **{k: round(v, 4) for k, v in timing.items()}}}, started)

    def _install_plan(self, schedule: Schedule, info: dict[str, Any], extra: dict[str, Any], started: float) -> None:
        """Every rank: run the agreed plan from this iteration on (the end of :meth:`_plan`); the time since
        ``started`` was deft's own work, not the schedule's."""
        stats_reason, profile = self._stats_reason, self.profile
        if not self._planning.recheck_on:
            self._stats = None
        layout = FlatLayout(self._order_for(profile), self._names, self._params, schedule.bucket_numel,
                            str(self._planning.schedule_path or "schedule"))
        self._warm_layout = self._executor.layout
        self._install(schedule, layout, self._t)
        self._planned = True
        # Steps the scaler skipped before the plan (warm-up, profile, the background lag) stay on record.
        kept = {k: self.plan_info[k] for k in ("skipped_steps",) if k in self.plan_info}
        self.plan_info = {**info, "t0": self._t, "stats_reason": stats_reason, **extra, **kept}
        # Adapt deft's own plans (not a schedule file) when there is a profile to correct.
        self._adapt_on = self.config.adapt and profile is not None and self._planning.schedule_path is None
        if self._adapt_on:
            self._adapter = Adapter(self.config) if self.rank == 0 else None
            self._reset_window()
            assert self._warm_layout is not None
            self._sync_candidate = self._synchronous(self._warm_layout)
        self._sync_clock.exclude(time.perf_counter() - started)  # planning is deft's, not the schedule's
        log.info("deft: rank %d runs schedule %s from iteration %d (cycle %d, K=%s)", self.rank,
                 schedule.digest(), self._t, schedule.cycle, schedule.batch_sequence)

    # -- preserver re-check during training -----------------------------------------------------
    def _stats_wanted(self) -> bool:
        """Gather statistics now? Before planning, in the window :meth:`_place_profile` sets (every
        iteration without a comm hook); after it, only in the window of iterations before each re-check
        (the estimator's EMA forgets older steps anyway)."""
        if not self._planned:  # (a plan in flight was made from the statistics so far)
            return self._plan_due is None and self._stats_window[0] <= self._t < self._stats_window[1]
        every = self.config.recheck_every
        return every <= STATS_WINDOW or (self._t % every) >= every - STATS_WINDOW

    def _walk_stats(self) -> tuple[Any, str]:
        return walk_stats(self.config, self._control, self._losses, self._stats, self._optim.optimizer, self._batch,
                          self._calibrated)

    def _maybe_recheck(self) -> None:
        if self._t % self.config.recheck_every != 0 or self._planning.pending is not None:
            return
        stats, stats_reason = self._walk_stats()
        record = self._planning.recheck(self._t, stats, stats_reason, self.schedule, self.profile)
        self.plan_info.setdefault("rechecks", []).append(record)

    def _maybe_switch(self) -> None:
        """At a cycle boundary (the next iteration is position 0): apply every pending update
        (:meth:`flush`) and run the re-planned schedule from this iteration on."""
        if self._planning.pending is None or self._executor.position(self._t) != 0:
            return
        schedule, info = self._planning.pending
        self._planning.pending = None
        before = len(self.update_log)
        self.flush()
        if info.get("layout") == "warm-up" and self._warm_layout is not None:
            layout = self._warm_layout  # the warm-up's schedule on the layout it was measured on
        else:
            layout = FlatLayout(self._order_for(self.profile), self._names, self._params, schedule.bucket_numel,
                                "re-planned schedule")
        old = self.schedule.digest()
        self._install(schedule, layout, self._t)
        self._reset_window()
        if info.get("source") != "adapt" and self._adapter is not None:
            # The re-check replaced the schedule, for accuracy: adaptation must not go "back" to one measured
            # before (it may be what the re-check rejected); the warm-up's synchronous schedule stays.
            self._adapter.best = None
        self.plan_info.setdefault("switches", []).append({
            "iteration": self._t, "from": old, "to": schedule.digest(), "cycle": schedule.cycle,
            "batch_sequence": list(schedule.batch_sequence), "flushed_updates": len(self.update_log) - before,
            **info})
        log.info("deft: rank %d switches to re-planned schedule %s at iteration %d (K=%s)", self.rank,
                 schedule.digest(), self._t, schedule.batch_sequence)

    # -- closing the loop (deft.runtime.adapt) ----------------------------------------------------
    def _reset_window(self) -> None:
        """Start a new measurement window at the next forward (the switch iteration itself is skipped)."""
        self._fwd_start = self._bwd_start = None
        self._iter_s, self._bwd_s = [], []

    def _maybe_adapt(self) -> None:
        """Collective, every ``adapt_window`` measured iterations: rank 0 compares the slowest rank's
        median iteration with the prediction and may switch schedules (:class:`deft.runtime.adapt.Adapter`).
        With ``plan_lag_iters`` > 0 rank 0 decides (and re-plans) in a background thread and every rank
        collects the decision at the first iteration boundary where it is done, that many iterations
        later at the latest (:meth:`_finish_adapt`)."""
        if self._adapt_due is not None:
            if self._job_ready(self._adapt_due, self._adapt_job):
                self._finish_adapt()
            return
        if self._planning.pending is not None or len(self._iter_s) < self.config.adapt_window:
            return
        measured, backward, synchronous_s = self._control.max_rows(
            [[*window_medians(self._iter_s, self._bwd_s), self._sync_clock.median()]], "iteration times")[0]
        self._reset_window()
        self._adapt_from = self.schedule.digest()
        decide = None
        if self.rank == 0:
            assert self._adapter is not None
            if self._adapter.synchronous is None and self._sync_candidate is not None and synchronous_s > 0:
                self._adapter.synchronous = Synchronous(self._sync_candidate, synchronous_s)
            decide = self._adapt_decision(self._adapter, self.schedule, self.profile, measured, backward,
                                          self._last_walk)
        lag = self.config.plan_lag_iters
        if lag > 0:
            self._adapt_job = None if decide is None else Background(decide, "deft-adapter", self.config.planner_nice)
            self._adapt_due = self._t + lag
            return
        self._apply_adapt(decide() if decide is not None else {})

    def _adapt_decision(self, adapter: Adapter, running: Schedule, profile: Profile | None, measured: float,
                        backward: float, walk: Any) -> Callable[[], dict[str, Any]]:
        """Rank 0's decision as a function of its inputs only (it may run on a background thread)."""
        cfg = self.config

        def decide() -> dict[str, Any]:
            try:
                assert profile is not None

                def replan(corrected: Profile) -> Schedule:
                    return make_schedule(cfg, corrected, None if cfg.epsilon == 0 else walk, None).schedule

                new, corrected, record = adapter.decide(running, profile, measured, backward, replan)
                doc: dict[str, Any] = {"record": record, "done": adapter.done}
                if new is not None:
                    doc["schedule"] = new.to_dict()
                if corrected is not None:
                    doc["profile"] = corrected.to_dict()
                return doc
            except Exception as e:  # adaptation never ends a run: keep the running schedule, stop adapting
                log.exception("deft: adaptation failed")
                return {"record": {"error": f"{type(e).__name__}: {e}"}, "done": True}
        return decide

    def _finish_adapt(self) -> None:
        """Collective: collect the decision :meth:`_maybe_adapt` began in the background and apply it."""
        job, self._adapt_job, self._adapt_due = self._adapt_job, None, None
        doc: dict[str, Any] = {}
        if job is not None:
            doc, waited = job.result()
            if "error" in doc:  # Background's own error document: the adaptation stops, with the reason
                doc = {"record": {"error": doc["error"]}, "done": True}
            doc = {**doc, "record": {**doc.get("record", {}), "background": {
                "lag_iters": self.config.plan_lag_iters, "plan_s": round(job.seconds, 4),
                "waited_s": round(waited, 4)}}}
        self._apply_adapt(doc)

    def _apply_adapt(self, doc: dict[str, Any]) -> None:
        """Collective: rank 0's adaptation decision to every rank; a new schedule waits for a boundary."""
        doc = self._control.broadcast_json(doc, "adaptation decision")
        self._reset_window()  # the iterations beside the planner's thread are not the schedule's own
        record = {"iteration": self._t, **doc["record"]}
        # A re-check may have switched schedules while rank 0 decided in the background: the decision, and
        # the profile it corrected in the old schedule's buckets, are about a schedule no longer running.
        moved = self.schedule.digest() != self._adapt_from
        superseded = moved and ("schedule" in doc or "profile" in doc)
        if superseded:
            record["superseded"] = (f"the running schedule changed from {self._adapt_from} to "
                                    f"{self.schedule.digest()} while rank 0 decided; adaptation goes on with it")
        if "profile" in doc and not moved:
            self.profile = Profile.from_dict(doc["profile"], "profile corrected by rank 0")
            out = os.environ.get("DEFT_PROFILE_OUT")
            if out and self.rank == 0:  # `deft simulate` on it predicts what this run measures
                self.profile.save(out)
        if "schedule" in doc and not moved:
            schedule = Schedule.from_dict(doc["schedule"], "schedule re-planned by rank 0")
            self._control.check_agreement("schedule", schedule.digest())
            back = self._sync_candidate is not None and plan_digest(schedule) == plan_digest(self._sync_candidate)
            if self._planning.pending is None:  # a re-check's re-plan, made during the lag, goes first
                self._planning.pending = (schedule, {"source": "adapt", **({"layout": "warm-up"} if back else {})})
            else:
                record["superseded"] = "a re-check's re-planned schedule was already waiting"
        # A superseded decision is void, "done" with it: the schedule the re-check chose is measured next.
        self._adapt_on = superseded or not doc["done"]
        self.plan_info.setdefault("adapt", []).append(record)

    # -- executor observers: warm-up timing, statistics, trace ranges ------------------------------
    def _bucket_ready(self, b: int) -> None:
        if self._bwd_tok is not None:
            nvtx.pop_range(self._bwd_tok)
            self._bwd_tok = None
            self._reopen_bwd = True
        if self._timer is not None:
            self._timer.bucket_ready(b)
        if self._stats is not None and self._stats_wanted():
            ex = self._executor
            g = ex.groups.get(ex.group_last(self._t))
            if g is not None and g.complete and ex.layout is not None:
                self._stats.refresh(ex.layout, self._params, self._optim.optimizer)
                k = len(g.iterations)
                self._stats.bucket(g.last, b, ex.layout.bucket_views(g.buffers, b), (self._batch or 1) * k, k)

    def _profile_codec(self) -> Codec | None:
        """Collective: the comm hook's wire bytes and compute per bucket of the profiled layout (the
        codec timed on one-rank groups, which every rank creates in the same order; max over ranks)."""
        hook, layout = self._executor.comm_hook, self._executor.layout
        if hook is None or layout is None:
            return None
        if self._solo is None:  # created once (dist.new_group is collective over the world)
            self._solo = make_solo_group(self._primary.backend, self.config.timeout_s, self._ranks)
        n = layout.n_buckets
        try:
            codec: Codec | None = profile_codec(hook, layout, self._params, self._solo, self.device)
            assert codec is not None
            row, error = [*codec.codec_s, 0.0], None
        except Exception as e:  # every rank must leave the collective below: a flag, then the same error
            codec, row, error = None, [0.0] * n + [1.0], f"{type(e).__name__}: {e}"
        seconds = self._control.max_rows([row], "comm hook codec times")[0]
        if seconds[-1] > 0:
            raise DeftError(f"comm hook {hook.name!r} failed while deft timed its codec on a one-rank group"
                            + (f" on rank {self.rank}: {error}" if error else
                               f" on a rank other than {self.rank} (its error says which bucket and why)"))
        assert codec is not None
        return replace(codec, codec_s=tuple(seconds[:-1]))

    def _hook_started(self, b: int, t: float) -> None:
        if self._timer is not None:
            self._timer.hook_started(b, t)

    def _launched(self, b: int, link: str, views: list[torch.Tensor], works: list[Any], t_start: float,
                  group: int) -> None:
        if self._timer is not None:
            self._timer.launched(b, link, works, t_start, self._wait_work)

    def _wait_work(self, work: Any, link: str, b: int) -> None:
        what = "profiling all-reduce" + (f" of bucket {b}" if b >= 0 else "")
        self._executor.wait(Pending(work, link, f"{what} in iteration {self._t}"))

    def _backward_starts(self, grad: torch.Tensor) -> None:
        """Tensor hook on the forward's output: the backward of this iteration begins."""
        if self._bwd_tok is None and self._phase in (Phase.FORWARD, Phase.BACKWARD) \
                and not self._executor.backward_done:
            self._open_bwd()

    def _open_bwd(self) -> None:
        b = self._executor.next_unready()
        if b is not None:
            self._bwd_tok = nvtx.push_range("bwd", b, self._t)

    def _close_bwd(self) -> None:
        if self._bwd_tok is not None:
            nvtx.pop_range(self._bwd_tok)
            self._bwd_tok = None
        self._reopen_bwd = False

    def _mark_layout(self) -> None:
        """Each bucket's size as a trace mark (for parsers that see no sizes), when a tool records."""
        layout = self._executor.layout
        if layout is None or not recording():
            return
        for b, (numel, nbytes) in enumerate(zip(layout.bucket_numel, layout.bucket_nbytes(), strict=True)):
            nvtx.mark_layout(b, numel, nbytes)


def _grad_hook(me: weakref.ref[DistributedDataParallel], index: int) -> Any:
    """Gradient capture; a weak reference, so a dropped wrapper does not keep capturing."""
    def hook(p: torch.Tensor) -> None:
        d = me()
        if d is not None:
            d._on_grad(index, p)
    return hook


def _forward_pre_hook(me: weakref.ref[DistributedDataParallel]) -> Any:
    def hook(m: nn.Module, args: Any) -> None:
        d = me()
        if d is not None:
            d._before_module(m)
    return hook


def _state_dict_hook(me: weakref.ref[DistributedDataParallel]) -> Any:
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        d = me()
        if d is not None:
            d._finish_deferred()
    return hook


def _check_device_ids(device_ids: Any, output_device: Any, device: torch.device) -> None:
    """torch DDP's single-device rule: ``device_ids`` is None for a CPU module, else the one device
    the module is on (an int index or a device); ``output_device`` likewise."""
    if device_ids is None:
        return
    if device.type == "cpu":
        raise DeftError(f"device_ids must be None for a module on the CPU (as with torch DDP), got {device_ids!r}")
    if not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1:
        raise DeftError(f"device_ids must be None or a list of the one device the module is on (torch DDP's "
                        f"single-device rule), got {device_ids!r}")
    for given in (device_ids[0], output_device):
        if given is None:
            continue
        d = torch.device(device.type, given) if isinstance(given, int) else torch.device(given)
        if d.type != device.type or (d.index is not None and device.index is not None and d.index != device.index):
            raise DeftError(f"device_ids/output_device name {d} but the module's parameters are on {device}; "
                            "move the module to that device first, as with torch DDP")


def _config_shared(cfg: DeftConfig) -> dict[str, Any]:
    """The settings every rank must share; NIC names and file paths may differ per host."""
    d = cfg.to_dict()
    for lk in d["links"]:
        lk.pop("ifname", None)
    d.pop("profile_path", None)
    d.pop("schedule_path", None)
    return d
