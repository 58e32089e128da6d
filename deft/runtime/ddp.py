"""``deft.DistributedDataParallel``: torch DDP's interface, DeFT's schedule (DESIGN.md sections 1 and 5).

Use it like torch DDP; only the constructor line changes::

    ddp = deft.DistributedDataParallel(model)          # optimizer=..., config=..., profile=...
    loss = loss_fn(ddp(x), y); loss.backward(); ddp.observe_loss(loss)   # observe_loss is optional
    optimizer.step(); optimizer.zero_grad()

Life of a run
-------------
1. Construction (collective): the ranks compare digests of their config and of the model's trainable
   parameters (names, shapes, dtypes) and fail naming the rank that differs; one process group per
   link is created; parameters and buffers are broadcast from rank 0.
2. Warm-up (``max(1, warmup_iters)`` iterations) and profiling (``profile_iters``) run like torch DDP:
   buckets of whole parameters in ready order (``min(bucket_cap_mb, 1 MB)``, for the profile's
   resolution) all-reduced in backward on the primary link, one update per iteration. The first
   iteration records the order in which gradients become ready; rank 0's order is broadcast and the
   flat gradient is laid out in it. Profile iterations are timed (:mod:`deft.profiler.timing`).
3. Planning: rank 0 plans (preserver if enabled and statistics exist, else the planner;
   ``epsilon == 0``: the no-delay plan), or loads ``config.schedule_path``; it broadcasts the schedule
   JSON, every rank validates it and the ranks compare its digest. From then on the executor
   (:mod:`deft.runtime.executor`) runs it.
4. Re-check (preserver plans only, ``epsilon > 0``, two ranks or more): the gradient-noise statistics
   keep running on the all-reduced buffers (in the 32 iterations before each check); every
   ``recheck_every`` iterations rank 0 runs :meth:`deft.preserver.feedback.Recheck.check` and, if it
   asks, re-plans with :func:`deft.preserver.feedback.preserve`; decision and schedule are broadcast
   as JSON bytes, validated and digest-checked. At the next cycle boundary every rank flushes the
   pending updates and runs the new schedule. ``plan_info["rechecks"]`` and
   ``plan_info["switches"]`` record each check and switch. (A pending switch is not checkpointed; a
   resumed run re-checks only after a new plan.)

Profiling hooks (:mod:`deft.runtime.tracing`): per-bucket ``deft/fwd|bwd|comm`` ranges
(:mod:`deft.profiler.nvtx`) when a tool records; ``DEFT_PROFILE_ITERS`` overrides
``profile_iters``; ``DEFT_PROFILE_OUT`` receives rank 0's timing profile; ``DEFT_TRACE_DIR`` makes every
rank record the profile iterations with torch.profiler and export ``rank{r}.json.gz`` there.

Invariants (DESIGN.md section 5)
--------------------------------
* Every gradient computed on every rank is added exactly once into the buffer of its update group,
  all-reduced exactly once (sum over ranks) and applied exactly once, divided by
  ``world * k`` (``k`` iterations merged: the mean over ranks and iterations, as gradient accumulation
  with a mean loss). All ranks apply identical updates. ``update_log`` lists (iteration at whose
  ``optimizer.step()`` the update was applied, iterations merged).
* A step that is not due changes nothing: every parameter's ``grad`` is ``None`` during the step, so
  torch optimizers skip every parameter and leave ``optimizer.state`` (momentum, Adam moments, step
  counts) untouched. If several updates are due at one step, all but the last run through an internal
  ``optimizer.step()``.
* Communication overlaps computation: collectives are launched asynchronously at stage start / as
  buckets become ready, and waited for only when their update is applied (or at ``flush()`` /
  checkpoint). Each link sees the same collectives in the same order on every rank.
* ``state_dict()`` (through ``get_extra_state``) carries the iteration counter, the schedule, the
  position, the queued local gradient buffers and which buckets are already reduced; resuming from it
  continues exactly. The pending buffers hold this rank's *local* gradients, so every rank saves and
  loads its own checkpoint when an update is pending (loading another rank's pending state fails).
* A dead or stalled peer makes every wait fail within ``config.timeout_s`` with a
  :class:`~deft.errors.CommunicationError` naming this rank, the link and the collective.

Semantics worth knowing
-----------------------
* One forward-backward-step per iteration (micro-batches under ``no_sync()``). Forwards under
  ``torch.no_grad()`` are evaluation: no communication, no queue change, not counted.
* Gradients are captured (``register_post_accumulate_grad_hook``) and ``p.grad`` is set to ``None``
  during backward; the averaged gradients appear in ``p.grad`` only inside a due ``optimizer.step()``.
  Code that reads or clips ``p.grad`` between ``backward()`` and ``step()`` sees ``None``; use
  :meth:`DistributedDataParallel.clip_grad_norm_on_update` for clipping. Micro-batches go under
  :meth:`DistributedDataParallel.no_sync` as with torch DDP. ``torch.amp.GradScaler`` is not
  supported (it unscales ``p.grad`` before the step, where deft has not written it yet).
* A parameter no rank used in any merged iteration keeps ``grad = None`` for that update (torch DDP's
  ``find_unused_parameters=True`` behaviour); parameters with ``requires_grad=False`` are ignored.
* One optimizer per module (several ``param_groups`` are fine; it may cover a subset of the
  parameters): a second optimizer stepping the module's parameters raises, since it would never see a
  gradient. A wrapper whose inner optimizer shares its ``param_groups`` (Lookahead-style) is one.
* Learning-rate schedulers advance per iteration, as the user calls them; an update merging ``k``
  iterations uses the learning rate current at its application.
* ``process_group``: deft builds its own groups (a gloo control group and one group per link, all
  with ``config.timeout_s``) over the ranks of ``process_group`` (default: the world); creating a
  group is collective over the whole world, so every process constructs the wrapper.
* A planner that cannot plan the measured profile degrades to the no-delay plan, then to torch DDP's
  synchronous schedule (``plan_info`` says which and why): planning never ends a run.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from deft.config import DeftConfig
from deft.errors import CommunicationError, ContractError, DeftError
from deft.profile import Profile
from deft.profiler import nvtx
from deft.profiler.timing import WarmupTimer, tensors_in
from deft.runtime.buckets import FlatLayout, ddp_like_bucket_numel
from deft.runtime.executor import Executor, Pending
from deft.runtime.links import CommLink, make_control_group, make_links
from deft.runtime.tracing import TRACE_DIR_ENV, ForwardRanges, TraceRecorder, profile_iters_from_env, recording
from deft.schedule import Schedule, synchronous_schedule

log = logging.getLogger("deft.runtime")

_STATE_VERSION = 1
PROFILE_BUCKET_CAP_MB = 1.0


class DistributedDataParallel(nn.Module):
    """Drop-in replacement of ``torch.nn.parallel.DistributedDataParallel`` running a DeFT schedule."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 config: DeftConfig | str | os.PathLike[str] | dict[str, Any] | None = None,
                 profile: Profile | str | os.PathLike[str] | None = None, process_group: Any = None, *,
                 broadcast_buffers: bool = True, device_ids: Any = None, output_device: Any = None,
                 find_unused_parameters: bool = True) -> None:
        """``broadcast_buffers`` works as in torch DDP; ``device_ids``, ``output_device`` and
        ``find_unused_parameters`` are accepted so a torch DDP constructor line carries over: deft
        uses the parameters' device and always handles unused parameters."""
        super().__init__()
        del device_ids, output_device, find_unused_parameters
        if not (dist.is_available() and dist.is_initialized()):
            raise DeftError("deft.DistributedDataParallel needs torch.distributed to be initialized first: "
                            "launch with torchrun and call torch.distributed.init_process_group()")
        self.module = module
        self.config = DeftConfig.resolve(config)
        cfg = self.config
        self._given_profile = _resolve_profile(profile, cfg)  # bad files fail here, before any collective
        if self._given_profile is not None:
            unknown = [n for n in self._given_profile.link_names if n not in cfg.link_names]
            if unknown:
                raise ContractError("profile", "links", f"link(s) {unknown} are not in the config's links "
                                    f"{list(cfg.link_names)}; name the config's links like the profile's")
        # Like the profile: a wrong schedule file fails before any collective. Only rank 0 reads it when
        # planning, so another rank without the file (multi-node) skips the check.
        if cfg.schedule_path is not None and (dist.get_rank() == 0 or os.path.exists(cfg.schedule_path)):
            _check_schedule_file(cfg, module)
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        self._control = make_control_group(cfg, ranks)
        self.rank = dist.get_rank(self._control)
        self.world = dist.get_world_size(self._control)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise DeftError("the module has no parameter that requires a gradient")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        devices = {p.device for p in self._params}
        if len(devices) != 1:
            raise DeftError(f"deft needs all trainable parameters on one device, got {sorted(map(str, devices))}")
        self.device = self._params[0].device
        self._cuda = self.device.type == "cuda"
        shared = _config_shared(cfg)
        self._check_agreement("config", _digest(shared), shared)
        model_doc = {n: [list(p.shape), str(p.dtype)] for n, p in zip(self._names, self._params, strict=True)}
        self._check_agreement("model (trainable parameter names, shapes, dtypes)",
                              _digest({"params": list(model_doc.items())}), model_doc)
        self._links: dict[str, CommLink] = make_links(cfg, self._cuda, ranks)
        self._primary = next(iter(self._links.values()))
        self._broadcast_state(list(module.parameters()) + list(module.buffers()), self._primary.group,
                              self._primary.name)
        self._executor = Executor(self._params, self._links, self.rank, self.world, cfg.timeout_s, self.device)
        self._executor.on_bucket_ready = self._bucket_ready
        self._executor.on_launch = self._launched
        self._warm_end = max(1, cfg.warmup_iters)
        self._profile_iters = profile_iters_from_env(cfg.profile_iters)
        trace_dir = os.environ.get(TRACE_DIR_ENV) or None
        # Trace output: torch.profiler over the profile iterations (DEFT_TRACE_DIR), and forward
        # ranges only when some tool was asked for at construction (no forward hooks otherwise).
        self._tracer = None if trace_dir is None else TraceRecorder(
            trace_dir, dist.get_rank(), self._cuda, self._warm_end, self._profile_iters)
        self._fwd_ranges = ForwardRanges(module, self._params) if trace_dir or nvtx.nvtx_enabled() else None
        self._bwd_tok: nvtx.Range | None = None
        self._reopen_bwd = False
        self._install_sync(list(reversed(range(len(self._params)))), t0=0)

        # Iteration state.
        self._t = 0                      # index of the current (or next) training iteration
        self._phase = "idle"             # idle -> forward -> backward -> backward_done -> (step) idle
        self._order_seen: list[int] = []
        self._order_seen_set: set[int] = set()
        self._ready_order: list[int] | None = None
        self._order_known = False
        self.update_log: list[tuple[int, tuple[int, ...]]] = []
        self._losses: collections.deque[float] = collections.deque(maxlen=64)
        self._batch: int | None = None
        self._planned = False
        self._given_schedule = cfg.schedule_path
        measuring = self._given_profile is None and self._given_schedule is None
        self._plan_at = self._warm_end + (self._profile_iters if measuring else 0)
        self._timer: WarmupTimer | None = None
        self._stats: _GradStats | None = None
        self._stats_window = 32  # after planning: iterations of statistics before each re-check
        self._recheck_on = False  # all ranks: the preserver re-checks the running schedule
        self._recheck: Any = None  # rank 0: deft.preserver.feedback.Recheck
        self._preserve_result: Any = None
        self._pending_switch: tuple[Schedule, dict[str, Any]] | None = None
        self.plan_info: dict[str, Any] = {}
        self.profile: Profile | None = None  # the profile the schedule was planned from
        self._no_sync = False
        self.broadcast_buffers = broadcast_buffers
        self._clip: tuple[float, float] | None = None
        self.last_grad_norm: float | None = None

        # Gradient capture.
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(_grad_hook(me, i)) for i, p in enumerate(self._params)]
        # Optimizer interception.
        self._optimizer: torch.optim.Optimizer | None = None
        self._internal_step = False
        self._step_open = False
        self._bound = optimizer is not None  # hooks on that optimizer; the global ones only check
        self._opt_hooks: list[Any] = []
        if optimizer is not None:
            self._bind_optimizer(optimizer)
        # Global hooks in both cases: they find the optimizer when none is given, and they catch a second
        # optimizer stepping the module's parameters (which would otherwise silently never see a gradient).
        self._opt_hooks += [register_optimizer_step_pre_hook(_global_pre(me)),
                            register_optimizer_step_post_hook(_global_post(me))]

    # -- public API ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)  # evaluation: no communication, nothing counted
        if self._phase == "backward_done":
            raise DeftError(f"the forward of a new iteration started before optimizer.step() of iteration "
                            f"{self._t}; deft runs forward, backward, optimizer.step() once per iteration, "
                            "with an optimizer over this module's parameters (wrap forwards that are not "
                            "training, e.g. metrics, in torch.no_grad())")
        if self._phase == "idle":
            # Buffers (e.g. BatchNorm statistics) follow rank 0 at the first forward of an iteration,
            # which is when torch DDP broadcasts them too (also with no_sync() micro-batches).
            if self.broadcast_buffers and any(True for _ in self.module.buffers()):
                self._broadcast_state(list(self.module.buffers()), self._control, "control")
            self._begin_iteration()
            self._note_batch(args, kwargs)
        out = self.module(*args, **kwargs)
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
        value = float(loss.detach().item()) if isinstance(loss, torch.Tensor) else float(loss)
        self._losses.append(value)

    @property
    def schedule(self) -> Schedule:
        """The schedule running now (the DDP-like synchronous one during warm-up)."""
        assert self._executor.schedule is not None
        return self._executor.schedule

    @property
    def iteration(self) -> int:
        return self._t

    @property
    def link_stats(self) -> dict[str, dict[str, int]]:
        """Collectives and bytes sent per link so far."""
        return {n: {"calls": lk.stats.calls, "bytes": lk.stats.bytes} for n, lk in self._links.items()}

    def flush(self) -> None:
        """Communicate and apply every pending update now (collective: every rank calls it).

        For the end of training or before an evaluation that must see every gradient. A group cut
        short merges the iterations it has; the schedule restarts its cycle at the next iteration.
        """
        if self._phase != "idle":
            raise DeftError("flush() must be called between iterations (after optimizer.step()); "
                            f"iteration {self._t} is in its {self._phase.replace('_', ' ')} phase. A forward with "
                            "gradients enabled starts an iteration: run evaluation under torch.no_grad()")
        ex = self._executor
        if not ex.groups:
            return
        if self._optimizer is None:
            raise DeftError("flush() needs the optimizer: pass optimizer= to deft.DistributedDataParallel "
                            "or call optimizer.step() once before")
        if self._stats is not None:
            self._stats.discard()  # groups cut short: no clean per-group statistics
        for upd in ex.drain():
            self._set_grads(upd.grads)
            self._run_internal_step()
            self.update_log.append((self._t - 1, upd.iterations))
        self._clear_grads()
        ex.t0 = self._t

    def clip_grad_norm_on_update(self, max_norm: float | None, norm_type: float = 2.0) -> None:
        """Clip every update's averaged gradient to ``max_norm`` right before the optimizer applies it.

        deft's replacement for calling ``torch.nn.utils.clip_grad_norm_`` between ``backward()`` and
        ``step()`` (there ``p.grad`` is ``None`` under deft, so that call would clip nothing). A merged
        update is clipped as one step's gradient, as with gradient accumulation. ``None`` turns it off;
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
        for h in self._hooks + self._opt_hooks:
            h.remove()
        self._hooks, self._opt_hooks = [], []
        if self._timer is not None:
            self._timer.close()
        if self._fwd_ranges is not None:
            self._fwd_ranges.close()

    # -- iteration machinery -------------------------------------------------------------------
    def _begin_iteration(self) -> None:
        self._phase = "forward"
        profiling = self._warm_end <= self._t < self._plan_at and not self._planned
        if profiling and self._timer is None:
            layout = self._executor.layout
            assert layout is not None
            self._timer = WarmupTimer(self.module, self._params, layout, self._links, self._cuda)
        # The timer labels its timed launches; the real ones stay unlabelled meanwhile.
        self._executor.label_launches = self._timer is None
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
        if self._phase == "idle":  # backward through the bare module: still an iteration
            self._begin_iteration()
        if not self._order_known and index not in self._order_seen_set:
            self._order_seen.append(index)
            self._order_seen_set.add(index)
        if self._no_sync and self._phase == "forward":
            self._executor.add_grad(index, p.grad, final=False)  # a micro-batch: accumulate only
            p.grad = None
            return
        if self._phase == "forward":
            self._phase = "backward"
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
        if self._phase == "backward":
            self._executor.end_backward()
            self._phase = "backward_done"
        self._close_bwd()

    # -- trace ranges (deft.runtime.tracing) -----------------------------------------------------
    def _backward_starts(self, grad: torch.Tensor) -> None:
        """Tensor hook on the forward's output: the backward of this iteration begins."""
        if self._bwd_tok is None and self._phase in ("forward", "backward") and not self._executor.backward_done:
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

    def _on_layout(self, layout: FlatLayout) -> None:
        if self._fwd_ranges is not None:
            self._fwd_ranges.set_layout(layout)
        self._mark_layout()

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
                k = len(g.iterations)
                self._stats.bucket(g.last, b, ex.layout.bucket_views(g.buffers, b), (self._batch or 1) * k, k)

    def _launched(self, b: int, link: str, views: list[torch.Tensor], works: list[Any], t_start: float,
                  group: int) -> None:
        if self._timer is not None:
            self._timer.launched(b, link, views, works, t_start, self._wait_work, iteration=self._t, group=group)

    def _wait_work(self, work: Any, link: str, b: int) -> None:
        what = "profiling all-reduce" + (f" of bucket {b}" if b >= 0 else "")
        self._executor.wait(Pending(work, link, f"{what} in iteration {self._t}"))

    # -- optimizer interception ----------------------------------------------------------------
    def _bind_optimizer(self, opt: torch.optim.Optimizer) -> None:
        mine = {id(p) for p in self._params}
        theirs = [p for g in opt.param_groups for p in g["params"]]
        if not any(id(p) in mine for p in theirs):
            raise DeftError("the optimizer given to deft.DistributedDataParallel steps none of the module's "
                            "trainable parameters")
        self._optimizer = opt
        me = weakref.ref(self)
        self._opt_hooks.append(opt.register_step_pre_hook(_bound_pre(me)))
        self._opt_hooks.append(opt.register_step_post_hook(_bound_post(me)))

    def _claims(self, opt: torch.optim.Optimizer) -> bool:
        """Global hooks: is ``opt`` the optimizer of this module? Binds it the first time; another
        optimizer over the module's trainable parameters is an error."""
        if self._optimizer is not None:
            if opt is self._optimizer:
                return True
            if opt.param_groups is self._optimizer.param_groups:
                return False  # a wrapper's inner optimizer (Lookahead-style), stepped inside the bound one
            mine = {id(p) for p in self._params}
            if any(id(p) in mine for g in opt.param_groups for p in g["params"]):
                raise DeftError(f"a second optimizer ({type(opt).__name__}) steps parameters of a "
                                "deft.DistributedDataParallel module, which already has one "
                                f"({type(self._optimizer).__name__}); deft applies each update through one "
                                "optimizer per module: use one optimizer with several param_groups")
            return False
        mine = {id(p) for p in self._params}
        if not any(id(p) in mine for g in opt.param_groups for p in g["params"]):
            return False
        self._optimizer = opt
        return True

    def _pre_step(self) -> None:
        if self._internal_step:
            return
        if self._phase == "idle":
            self._clear_grads()  # a step without an iteration changes nothing
            self._step_open = False
            return
        self._step_open = True
        ex = self._executor
        if self._phase in ("forward", "backward"):
            if self._phase == "forward":
                self._executor.begin_backward()
            ex.end_backward()
            self._phase = "backward_done"
            self._close_bwd()
        lasts = ex.due(self._t)
        updates = [ex.take_update(last) for last in lasts]
        if self._stats is not None:
            assert ex.layout is not None
            for last, upd in zip(lasts, updates, strict=True):
                self._stats.update(last, ex.layout, upd.grads, self._control, self.device)
        for upd in updates[:-1]:
            self._set_grads(upd.grads)
            self._run_internal_step()
            self.update_log.append((self._t, upd.iterations))
        if updates:
            self._set_grads(updates[-1].grads)
            self.update_log.append((self._t, updates[-1].iterations))
        else:
            self._clear_grads()

    def _post_step(self) -> None:
        if self._internal_step or not self._step_open:
            return
        self._step_open = False
        self._clear_grads()
        self._phase = "idle"
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
        if not self._order_known:
            self._adopt_ready_order()
        if not self._planned and self._stats is None:
            self._stats = _GradStats.start(self.config, self.world)
        if not self._planned and self._t >= self._plan_at:
            self._plan()
        elif self._planned and self._recheck_on:
            self._maybe_recheck()
            self._maybe_switch()

    def _run_internal_step(self) -> None:
        assert self._optimizer is not None
        self._internal_step = True
        try:
            self._optimizer.step()
        finally:
            self._internal_step = False

    def _set_grads(self, grads: list[torch.Tensor | None]) -> None:
        for p, g in zip(self._params, grads, strict=True):
            p.grad = g
        if self._clip is not None:
            with_grad = [p for p in self._params if p.grad is not None]
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(with_grad, *self._clip))

    def _clear_grads(self) -> None:
        for p in self._params:
            p.grad = None

    # -- layout and planning -------------------------------------------------------------------
    def _install_sync(self, order: list[int], t0: int) -> None:
        # DDP-like buckets, but no larger than DDP's first bucket (1 MB): these are also the profile's
        # buckets, and the planner (which merges small buckets and splits big ones by element
        # count) needs per-layer resolution of compute and ready times, not a 25 MB lump whose
        # compute it would spread by element count over layers that cost very differently.
        numel = ddp_like_bucket_numel(order, self._params, min(self.config.bucket_cap_mb, PROFILE_BUCKET_CAP_MB))
        layout = FlatLayout(order, self._names, self._params, numel, "<warm-up buckets>")
        sched = synchronous_schedule(layout.bucket_numel, layout.bucket_nbytes(), (self._primary.name,))
        self._executor.install(sched, layout, t0)
        self._on_layout(layout)

    def _adopt_ready_order(self) -> None:
        """After the first iteration: rank 0's observed ready order, broadcast, becomes the layout."""
        seen = list(self._order_seen)
        rest = [i for i in reversed(range(len(self._params))) if i not in set(seen)]
        order = torch.tensor(seen + rest, dtype=torch.int64)
        self._wait(dist.broadcast(order, src=dist.get_global_rank(self._control, 0), group=self._control,
                                  async_op=True), "control", "broadcast of the gradient ready order")
        self._order_known = True
        self._ready_order = [int(i) for i in order.tolist()]
        self._install_sync(self._ready_order, t0=self._t)

    def _plan(self) -> None:
        """Collective: measure (or take) a profile, rank 0 plans, everyone installs the same schedule."""
        profile = self._given_profile
        if profile is None and self._given_schedule is None:
            assert self._timer is not None
            backends = {n: lk.backend for n, lk in self._links.items()}
            profile = self._timer.profile(self._control, self.world, backends, type(self.module).__name__,
                                          self._names, self._wait_work)
            self._timer.close()
            self._timer = None
            out = os.environ.get("DEFT_PROFILE_OUT")
            if out and self.rank == 0:
                profile.save(out)
        self.profile = profile
        stats, stats_reason = self._walk_stats()
        if stats is None and self.rank == 0 and self.config.epsilon > 0 and self.config.preserver \
                and self._given_schedule is None:
            log.warning("deft: the preserver cannot test delayed updates (%s); it keeps the no-delay schedule",
                        stats_reason)
        doc: dict[str, Any]
        if self.rank == 0:
            try:
                sched, info = self._make_schedule(profile, stats)
                doc = {"schedule": sched.to_dict(), "info": info}
            except Exception as e:  # tell the other ranks instead of leaving them waiting
                doc = {"error": f"{type(e).__name__}: {e}"}
        else:
            doc = {}
        doc = self._broadcast_json(doc, "schedule")
        if "error" in doc:
            raise DeftError(f"rank 0 could not produce a schedule: {doc['error']}")
        schedule = Schedule.from_dict(doc["schedule"], "schedule broadcast by rank 0")
        self._check_agreement("schedule", schedule.digest())
        order = self._order_for(profile)
        layout = FlatLayout(order, self._names, self._params, schedule.bucket_numel,
                            str(self._given_schedule or "schedule"))
        self._executor.install(schedule, layout, self._t)
        self._on_layout(layout)
        self._planned = True
        info = dict(doc.get("info", {}))
        cfg = self.config
        # Re-checks need live statistics, a profile to re-plan from, and the preserver's own plan.
        self._recheck_on = (info.get("source") == "preserver" and cfg.preserver and cfg.epsilon > 0
                            and self.world >= 2 and profile is not None and self._given_schedule is None)
        if self._recheck_on:
            if self._stats is None:
                self._stats = _GradStats.start(cfg, self.world)
            if self._stats is not None:
                self._stats.on_layout()
            if self.rank == 0 and self._preserve_result is not None:
                from deft.preserver.feedback import Recheck

                self._recheck = Recheck(cfg, self._preserve_result)
        else:
            self._stats = None
        self.plan_info = info
        self.plan_info["t0"] = self._t
        self.plan_info["stats_reason"] = stats_reason
        log.info("deft: rank %d runs schedule %s from iteration %d (cycle %d, K=%s)", self.rank,
                 schedule.digest(), self._t, schedule.cycle, schedule.batch_sequence)

    def _make_schedule(self, profile: Profile | None, stats: Any) -> tuple[Schedule, dict[str, Any]]:
        """Rank 0 only. A planner that cannot plan this profile degrades to the no-delay plan, then
        to DDP's synchronous schedule: a run never dies because planning could not improve on DDP."""
        cfg = self.config
        if self._given_schedule is not None:
            return Schedule.load(self._given_schedule), {"source": str(self._given_schedule)}
        assert profile is not None
        from deft.solver.plan import no_delay_plan, plan

        try:
            if cfg.epsilon == 0:
                return no_delay_plan(profile, cfg), {"source": "no_delay_plan (epsilon = 0)"}
            if cfg.preserver:
                from deft.preserver.feedback import preserve

                res = preserve(profile, cfg, stats, planner=plan, no_delay_planner=no_delay_plan)
                self._preserve_result = res
                return res.schedule, {"source": "preserver", "accepted": bool(res.accepted),
                                      "tries": len(res.tries),
                                      "stats": None if stats is None else stats.to_dict()}
            return plan(profile, cfg), {"source": "plan"}
        except DeftError as e:
            first = f"{type(e).__name__}: {e}"
        log.warning("deft: planning failed (%s); falling back", first)
        try:
            return no_delay_plan(profile, cfg), {"source": "no_delay_plan (fallback)", "fallback": first}
        except DeftError as e:
            second = f"{type(e).__name__}: {e}"
        log.warning("deft: no-delay planning failed too (%s); running torch DDP's synchronous schedule", second)
        sched = synchronous_schedule(tuple(b.numel for b in profile.buckets), tuple(b.nbytes for b in profile.buckets),
                                     (profile.link_names[0],))
        return sched, {"source": "synchronous (fallback)", "fallback": [first, second]}

    def _order_for(self, profile: Profile | None) -> list[int]:
        """The flat order: the given profile's bucket order when it names exactly our parameters."""
        observed = list(self._ready_order or reversed(range(len(self._params))))
        if profile is None or self._given_profile is None:
            return observed
        names = [n.removeprefix("module.") for b in profile.buckets for n in b.params]
        index = {n: i for i, n in enumerate(self._names)}
        if len(names) == len(index) and set(names) == set(index):
            return [index[n] for n in names]
        return observed

    # -- preserver re-check during training -----------------------------------------------------
    def _stats_wanted(self) -> bool:
        """Gather statistics now? Always before planning; after it, only in the window of iterations
        before each re-check (the estimator's EMA forgets older steps anyway)."""
        if not self._planned:
            return True
        every = self.config.recheck_every
        return every <= self._stats_window or (self._t % every) >= every - self._stats_window

    def _maybe_recheck(self) -> None:
        """Every ``recheck_every`` iterations (collective): rank 0 re-evaluates the running schedule
        with the statistics measured now (:class:`deft.preserver.feedback.Recheck`) and, when the check
        fails, re-plans with :func:`deft.preserver.feedback.preserve`. The decision and the new
        schedule travel as JSON bytes; every rank validates the schedule and the ranks compare its
        digest. The switch waits for the next cycle boundary (:meth:`_maybe_switch`)."""
        cfg = self.config
        if self._t % cfg.recheck_every != 0 or self._pending_switch is not None:
            return
        stats, stats_reason = self._walk_stats()
        doc: dict[str, Any] = {}
        if self.rank == 0:
            try:
                decision = None if self._recheck is None else self._recheck.check(self._t, stats)
                if decision is not None:
                    doc["check"] = {"ratio": decision.ratio, "replan": decision.replan, "reason": decision.reason}
                    if decision.replan:
                        from deft.preserver.feedback import preserve
                        from deft.solver.plan import no_delay_plan, plan

                        assert self.profile is not None
                        res = preserve(self.profile, cfg, stats, planner=plan, no_delay_planner=no_delay_plan)
                        self._recheck.reset(res)
                        doc["schedule"] = res.schedule.to_dict()
                        doc["info"] = {"source": "preserver (re-plan)", "accepted": bool(res.accepted),
                                       "tries": len(res.tries), "reason": res.reason,
                                       "stats": None if stats is None else stats.to_dict()}
            except Exception as e:  # re-planning never ends a run: keep the running schedule
                doc = {"error": f"{type(e).__name__}: {e}"}
        doc = self._broadcast_json(doc, "re-check decision")
        record: dict[str, Any] = {"iteration": self._t, "schedule": self.schedule.digest()}
        if "error" in doc:
            log.warning("deft: preserver re-check at iteration %d failed (%s); keeping the schedule",
                        self._t, doc["error"])
            record["error"] = doc["error"]
        elif "check" not in doc:
            record["skipped"] = f"no check: {stats_reason}" if stats is None else "nothing to check"
        else:
            record.update(doc["check"])
        if "schedule" in doc:
            schedule = Schedule.from_dict(doc["schedule"], "schedule re-planned and broadcast by rank 0")
            self._check_agreement("schedule", schedule.digest())
            record["new_schedule"] = schedule.digest()
            if schedule.digest() == self.schedule.digest():
                record["unchanged"] = True
            else:
                self._pending_switch = (schedule, dict(doc.get("info", {})))
        self.plan_info.setdefault("rechecks", []).append(record)

    def _maybe_switch(self) -> None:
        """At a cycle boundary (the next iteration is position 0): apply every pending update
        (:meth:`flush`) and run the re-planned schedule from this iteration on."""
        if self._pending_switch is None or self._executor.position(self._t) != 0:
            return
        schedule, info = self._pending_switch
        self._pending_switch = None
        before = len(self.update_log)
        self.flush()
        layout = FlatLayout(self._order_for(self.profile), self._names, self._params, schedule.bucket_numel,
                            "re-planned schedule")
        old = self.schedule.digest()
        self._executor.install(schedule, layout, self._t)
        self._on_layout(layout)
        if self._stats is not None:
            self._stats.on_layout()
        self.plan_info.setdefault("switches", []).append({
            "iteration": self._t, "from": old, "to": schedule.digest(), "cycle": schedule.cycle,
            "batch_sequence": list(schedule.batch_sequence), "flushed_updates": len(self.update_log) - before,
            **info})
        log.info("deft: rank %d switches to re-planned schedule %s at iteration %d (K=%s)", self.rank,
                 schedule.digest(), self._t, schedule.batch_sequence)

    # -- preserver statistics --------------------------------------------------------------------
    def _walk_stats(self) -> tuple[Any, str]:
        """WalkStats for the preserver from the live statistics (collective on the control group), or None and why.

        ``loss``: the mean over ranks of the last observed loss; ``lr``: the optimizer's first group
        (for SGD with momentum the effective step ``lr / (1 - momentum)``);
        ``batch``: ranks x the first dimension of the forward's first tensor argument.
        """
        if self.config.epsilon == 0 or not self.config.preserver:
            return None, "not needed"
        mean_loss = torch.tensor([self._losses[-1] if self._losses else float("nan")], dtype=torch.float64)
        self._wait(dist.all_reduce(mean_loss, group=self._control, async_op=True), "control",
                   "all-reduce of the observed loss")
        loss = float(mean_loss) / self.world
        estimate = self._stats.estimate() if self._stats is not None else None
        if loss != loss:
            return None, "no loss observed (call ddp.observe_loss(loss) every iteration)"
        if estimate is None or estimate.sigma is None:
            return None, f"gradient noise not estimated yet ({estimate})"
        if self._optimizer is None or self._batch is None:
            return None, "optimizer or batch size unknown"
        from deft.preserver.feedback import WalkStats

        group = self._optimizer.param_groups[0]
        lr = float(group.get("lr", 0.0))
        if lr <= 0:
            return None, f"learning rate {lr} is not positive"
        momentum = float(group.get("momentum", 0.0) or 0.0)
        if isinstance(self._optimizer, torch.optim.SGD) and 0.0 < momentum < 1.0:
            # Heavy-ball SGD moves lr / (1 - momentum) per unit gradient in steady state: that is the
            # step the walk must see, or a stale or merged update looks 1/(1 - momentum) times cheaper.
            lr = lr / (1.0 - momentum)
        stats = WalkStats.from_estimate(max(loss, self.config.s_star), estimate, lr, self._batch * self.world,
                                        self.config.s_star)
        return stats, "estimated during warm-up"

    def _note_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # the first dimension of the first tensor argument, looking into lists and dicts (HF-style inputs)
        for a in tensors_in(list(args) + list(kwargs.values())):
            if a.dim() > 0:
                self._batch = int(a.shape[0])
                return

    # -- collectives of deft itself ------------------------------------------------------------
    def _wait(self, work: Any, link: str, what: str) -> None:
        _wait_plain(work, link, what, self.rank, self.config.timeout_s)

    def _check_agreement(self, what: str, digest: str, doc: dict[str, Any] | None = None) -> None:
        """All-gather a 16-hex-digit digest; fail naming the ranks that differ from rank 0.

        With ``doc`` (the JSON the digest was made from), a mismatch also gathers the documents and
        names the differing fields.
        """
        mine = torch.tensor(list(digest.encode()[:16].ljust(16, b"-")), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        self._wait(dist.all_gather(every, mine, group=self._control, async_op=True), "control",
                   f"all-gather of the {what} digest")
        digests = [bytes(t.tolist()).decode() for t in every]
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        if not bad:
            return
        detail = ""
        if doc is not None:
            docs = self._all_gather_json(doc, what)
            ref, other = docs[0], docs[bad[0]]
            keys = sorted(k for k in set(ref) | set(other) if ref.get(k) != other.get(k))
            detail = "; " + ", ".join(f"{k}: rank 0 has {ref.get(k)!r}, rank {bad[0]} has {other.get(k)!r}"
                                      for k in keys[:5])
        raise ContractError(f"rank {self.rank}", what,
                            f"rank(s) {bad} differ from rank 0 (digests {[digests[r] for r in bad]} vs "
                            f"{digests[0]}){detail}; every rank must use the same {what}")

    def _all_gather_json(self, doc: dict[str, Any], what: str) -> list[dict[str, Any]]:
        """Every rank's JSON document (uint8 bytes, padded to the longest; never pickle)."""
        payload = json.dumps(doc, sort_keys=True, default=str).encode()
        n = torch.tensor([len(payload)], dtype=torch.int64)
        lengths = [torch.empty_like(n) for _ in range(self.world)]
        self._wait(dist.all_gather(lengths, n, group=self._control, async_op=True), "control",
                   f"all-gather of the {what} length")
        size = max(int(x) for x in lengths)
        mine = torch.zeros(size, dtype=torch.uint8)
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        self._wait(dist.all_gather(every, mine, group=self._control, async_op=True), "control",
                   f"all-gather of the {what}")
        return [json.loads(bytes(t[:int(k)].tolist()).decode()) for t, k in zip(every, lengths, strict=True)]

    def _broadcast_json(self, doc: dict[str, Any], what: str) -> dict[str, Any]:
        """Rank 0's JSON document to every rank as uint8 bytes (length first); never pickle."""
        src = dist.get_global_rank(self._control, 0)
        payload = json.dumps(doc).encode() if self.rank == 0 else b""
        n = torch.tensor([len(payload)], dtype=torch.int64)
        self._wait(dist.broadcast(n, src=src, group=self._control, async_op=True), "control",
                   f"broadcast of the {what} length")
        buf = torch.zeros(int(n), dtype=torch.uint8)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._wait(dist.broadcast(buf, src=src, group=self._control, async_op=True), "control",
                   f"broadcast of the {what}")
        return json.loads(bytes(buf.tolist()).decode())

    def _broadcast_state(self, tensors: list[torch.Tensor], group: Any, link: str) -> None:
        """Rank 0's values of ``tensors`` everywhere, one flat broadcast per dtype (like DDP's)."""
        src = dist.get_global_rank(group, 0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for dtype, ts in by_dtype.items():
                flat = torch.cat([t.detach().reshape(-1) for t in ts]) if ts else torch.empty(0, dtype=dtype)
                self._wait(dist.broadcast(flat, src=src, group=group, async_op=True), link,
                           f"broadcast of rank 0's parameters/buffers ({dtype})")
                off = 0
                for t in ts:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()

    # -- checkpoint ----------------------------------------------------------------------------
    def get_extra_state(self) -> dict[str, Any]:
        """deft's runtime state for ``state_dict()``: tensors and plain types only."""
        if self._phase != "idle":
            raise DeftError("deft's state can only be saved between iterations (after optimizer.step()); "
                            f"iteration {self._t} is in its {self._phase.replace('_', ' ')} phase. A forward with "
                            "gradients enabled starts an iteration: run evaluation under torch.no_grad()")
        ex = self._executor
        ex.settle_all()  # in-flight buckets become reduced values; recorded as launched
        assert ex.schedule is not None and ex.layout is not None
        return {
            "version": _STATE_VERSION, "rank": self.rank, "world": self.world, "t": self._t, "t0": ex.t0,
            "planned": self._planned, "plan_at": self._plan_at, "order_known": self._order_known,
            "order": torch.tensor(list(ex.layout.order), dtype=torch.int64),
            "schedule": json.dumps(ex.schedule.to_dict()), "groups": ex.group_states(),
            "update_log": [[t, list(its)] for t, its in self.update_log],
            "plan_info": json.dumps(self.plan_info, default=str),
        }

    def set_extra_state(self, state: Any) -> None:
        src = "deft checkpoint"
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ContractError(src, "_extra_state.version", f"expected deft runtime state version {_STATE_VERSION}")
        if self._phase != "idle":
            raise DeftError("deft's state can only be loaded between iterations")
        groups = state["groups"]
        unsent = any(len(g["launched"]) < len(json.loads(state["schedule"])["bucket_numel"]) for g in groups)
        if groups and (state["world"] != self.world or (unsent and state["rank"] != self.rank)):
            raise ContractError(src, "_extra_state.rank",
                                f"this checkpoint holds rank {state['rank']}'s (of {state['world']}) local "
                                f"gradients not yet communicated; load it on rank {state['rank']} of "
                                f"{state['world']} (this is rank {self.rank} of {self.world}) or call "
                                "ddp.flush() before saving")
        schedule = Schedule.from_dict(json.loads(state["schedule"]), f"{src}: schedule")
        order = [int(i) for i in state["order"].tolist()]
        layout = FlatLayout(order, self._names, self._params, schedule.bucket_numel, f"{src}: schedule")
        ex = self._executor
        ex.groups.clear()
        ex.install(schedule, layout, int(state["t0"]))
        self._on_layout(layout)
        ex.restore_groups(groups, src)
        self._t = int(state["t"])
        self._planned = bool(state["planned"])
        self._order_known = bool(state["order_known"])
        if self._order_known:
            self._ready_order = order
        self._plan_at = int(state["plan_at"])
        if not self._planned and self._t > self._warm_end:
            # Timings of a half-done profiling phase are gone: profile again from here.
            measuring = self._given_profile is None and self._given_schedule is None
            self._warm_end = self._t
            self._plan_at = self._t + (self._profile_iters if measuring else 0)
        self.update_log = [(int(t), tuple(int(i) for i in its)) for t, its in state["update_log"]]
        self.plan_info = json.loads(state.get("plan_info", "{}"))


class _GradStats:
    """The preserver's gradient-noise statistics, from the buffers deft all-reduces anyway.

    Glue around :mod:`deft.preserver.noise`. When bucket ``b`` of an update group is complete (the
    bucket is ready in the group's last iteration), this rank's ``|g_r|²`` and projections on the two
    directions are accumulated for that group (``local_stats`` per bucket, summed: the quantities are
    sums over elements). The buffer holds the *sum* of the group's ``k`` local gradients, so the
    local mean gradient over ``k x batch`` samples is ``buffer / k``: ``|g_r|²`` is scaled by ``1/k²``
    and the projections by ``1/k``. When the group's update is applied, the ranks all-gather those
    scalars (control group; every rank applies the same updates, so the collective is matched), the
    estimator gets ``|ḡ|²`` of the averaged gradient, and the directions absorb it. Pieces are the
    layout's bucket segments, in bucket order; a new layout restarts the directions.

    Cost per update: one pass of dot products over the gradient and one all-gather of four scalars
    per rank; after planning it runs only in the window of iterations before each re-check.
    """

    def __init__(self, noise: Any, directions: Any, direction_cls: Any, local_stats: Any, local_cls: Any,
                 gather: Any) -> None:
        self.noise, self.directions, self._direction_cls = noise, directions, direction_cls
        self._local_stats, self._local_cls, self._gather = local_stats, local_cls, gather
        self._first_piece: dict[int, int] = {}  # bucket -> index of its first piece in u_a, u_b
        self._acc: dict[int, list[Any]] = {}    # group key -> [sq, pa, pb, has_dirs, batch]

    @classmethod
    def start(cls, cfg: DeftConfig, world: int) -> _GradStats | None:
        if cfg.epsilon == 0 or not cfg.preserver or world < 2:
            return None
        try:
            from deft.preserver.noise import DirectionPair, LocalStats, NoiseEstimator, all_gather_stats, local_stats
        except ImportError:
            return None
        return cls(NoiseEstimator(), DirectionPair(), DirectionPair, local_stats, LocalStats, all_gather_stats)

    def on_layout(self) -> None:
        """A new flat layout: the directions' pieces no longer match; start them over."""
        self.directions = self._direction_cls()
        self._first_piece = {}
        self._acc.clear()

    def _dirs_of(self, first: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        pair = self.directions.get()
        if pair is None:
            return None
        a, b = pair
        if first + n > len(a):
            return None
        return a[first:first + n], b[first:first + n]

    def bucket(self, key: int, b: int, views: list[torch.Tensor], batch: int, k: int) -> None:
        acc = self._acc.setdefault(key, [0.0, 0.0, 0.0, True, batch])
        dirs = self._dirs_of(self._first_piece.get(b, 0), len(views))
        st = self._local_stats(views, dirs, batch)
        acc[0] += st.sq_norm / (k * k)
        if dirs is None:
            acc[3] = False
        else:
            acc[1] += st.proj_a / k
            acc[2] += st.proj_b / k

    def discard(self) -> None:
        """Forget every accumulated group (their updates are applied without an estimate)."""
        self._acc.clear()

    def update(self, key: int, layout: FlatLayout, grads: list[torch.Tensor | None], control: Any,
               device: torch.device) -> None:
        acc = self._acc.pop(key, None)
        if acc is None:  # the same on every rank: bucket() ran for the same groups everywhere
            return
        sq, pa, pb, has_dirs, batch = acc
        mean = {d: torch.zeros(n, dtype=torch.float32, device=device) for d, n in layout.dtype_numel.items()}
        for i, gr in enumerate(grads):
            if gr is not None:
                s = layout.slots[i]
                mean[s.dtype][s.dtype_offset:s.dtype_offset + s.numel] = gr.reshape(-1).float()
        pieces: list[torch.Tensor] = []
        self._first_piece = {}
        for b in range(layout.n_buckets):
            self._first_piece[b] = len(pieces)
            pieces += [mean[s.dtype][s.start:s.end] for s in layout.segments[b] if s.end > s.start]
        mean_sq = sum(float(torch.dot(v.double(), v.double())) for v in mean.values())
        dot = self.directions.dot() if has_dirs else None
        local = self._local_cls(sq_norm=sq, proj_a=pa if has_dirs else None, proj_b=pb if has_dirs else None,
                                batch=batch)
        self.noise.update(self._gather(local, control), mean_sq, dot)
        self.directions.observe(pieces)

    def estimate(self) -> Any:
        return self.noise.estimate


# -- hook trampolines (weak references, so a dropped wrapper does not keep capturing) ----------
def _grad_hook(me: weakref.ref[DistributedDataParallel], index: int) -> Any:
    def hook(p: torch.Tensor) -> None:
        d = me()
        if d is not None:
            d._on_grad(index, p)
    return hook


def _global_pre(me: weakref.ref[DistributedDataParallel]) -> Any:
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        d = me()
        if d is not None and d._claims(opt) and not d._bound:
            d._pre_step()
    return hook


def _global_post(me: weakref.ref[DistributedDataParallel]) -> Any:
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        d = me()
        if d is not None and opt is d._optimizer and not d._bound:
            d._post_step()
    return hook


def _bound_pre(me: weakref.ref[DistributedDataParallel]) -> Any:
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        d = me()
        if d is not None:
            d._pre_step()
    return hook


def _bound_post(me: weakref.ref[DistributedDataParallel]) -> Any:
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        d = me()
        if d is not None:
            d._post_step()
    return hook


def _wait_plain(work: Any, link: str, what: str, rank: int, timeout_s: float) -> None:
    from datetime import timedelta

    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        raise CommunicationError(f"rank {rank}: {what} on link {link!r} failed or timed out after at most "
                                 f"{timeout_s:g} s: {e}. A peer rank probably died or stalled.") from None


def _config_shared(cfg: DeftConfig) -> dict[str, Any]:
    """The settings every rank must share; NIC names and file paths may differ per host."""
    d = cfg.to_dict()
    for lk in d["links"]:
        lk.pop("ifname", None)
    d.pop("profile_path", None)
    d.pop("schedule_path", None)
    return d


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _check_schedule_file(cfg: DeftConfig, module: nn.Module) -> None:
    """``config.schedule_path`` must be a valid schedule over this model's trainable elements and the
    config's links (rank 0 loads it again when planning; every rank checks here)."""
    path = str(cfg.schedule_path)
    sched = Schedule.load(path)
    total = sum(p.numel() for p in module.parameters() if p.requires_grad)
    if sum(sched.bucket_numel) != total:
        raise ContractError(path, "bucket_numel",
                            f"the schedule's buckets hold {sum(sched.bucket_numel)} elements but the model has "
                            f"{total} trainable elements (was it planned for another model?); plan one for this "
                            "model or remove schedule_path from the config")
    unknown = [n for n in sched.links if n not in cfg.link_names]
    if unknown:
        raise ContractError(path, "links", f"link(s) {unknown} are not in the config's links "
                            f"{list(cfg.link_names)}; name the config's links like the schedule's")


def _resolve_profile(profile: Profile | str | os.PathLike[str] | None, cfg: DeftConfig) -> Profile | None:
    if isinstance(profile, Profile):
        return profile
    if profile is not None:
        return Profile.load(profile)
    if cfg.profile_path is not None:
        return Profile.load(cfg.profile_path)
    return None

