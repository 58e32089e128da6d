"""``deft.DistributedDataParallel``: torch DDP's interface, DeFT's schedule.

Use it like torch DDP; a torch DDP constructor line works as it is::

    ddp = deft.DistributedDataParallel(model, device_ids=[rank])   # optimizer=, config=, profile= optional
    loss = loss_fn(ddp(x), y); loss.backward(); ddp.observe_loss(loss)   # observe_loss is optional
    optimizer.step(); optimizer.zero_grad()

This module is the facade: torch-compatible construction (the control plane, the links, rank 0's
state on every rank), the buffers' broadcast and the public API, forwarded to one training mode chosen
at construction (:mod:`deft.runtime.mode`: DeFT's schedule, or local steps). One module per job
(docs/DESIGN.md, "Runtime", has the table).

Note: the wrapper is registered as a virtual subclass of torch's (``isinstance(ddp,
torch.nn.parallel.DistributedDataParallel)`` is True; torch's class is an ``abc.ABC`` through
``Joinable``). Code written for torch DDP decides on that check: the saving idiom ``model.module if
isinstance(model, DistributedDataParallel) else model``, Accelerate's ``unwrap_model``, Lightning
Fabric's module state dict, and ``torch.distributed.checkpoint``'s state dicts, whose keys drop the
wrapper's ``module.`` prefix only for a DDP. It inherits nothing from torch's class: what torch DDP's
callers read after the check (``no_sync``, ``module``, ``require_backward_grad_sync``,
``require_forward_param_sync``, ``static_graph``, ``_get_ddp_logging_data``, ...) is deft's own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, SupportsIndex

import torch
import torch.distributed as dist
from torch import nn

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import DeftError
from deft.profile import Profile
from deft.runtime.buffer_sync import BufferSync
from deft.runtime.checkpoint import check_stamp, decode_record, encode_record, record_key, stamp, take_records
from deft.runtime.codecs.first_iteration import TimedBroadcast
from deft.runtime.codecs.hooks import CommHook
from deft.runtime.compat import (
    Device,
    check_device_ids,
    check_sync_batch_norm,
    check_torch_args,
    for_compiled,
    refuse_join,
    shared_config,
    torch_device_ids,
    trainable,
    warn_shared_rendezvous_store,
)
from deft.runtime.control import ControlPlane, broadcast_state, digest, wait_work
from deft.runtime.eager import outside_graphs
from deft.runtime.executor import PendingUpdate
from deft.runtime.links import CommLink, make_buffer_group, make_control_group, make_links
from deft.runtime.mode import SyncSwitch, Wiring, start_mode
from deft.runtime.phase import Phase
from deft.runtime.planning import check_schedule_file, resolve_profile
from deft.runtime.records import PlanInfoView
from deft.runtime.updates import LogEntry
from deft.schedule import Schedule

#: The constructor's arguments a pickled or copied wrapper is built again with (``__reduce_ex__``).
_REBUILT_WITH = ("device_ids", "output_device", "dim", "broadcast_buffers", "init_sync", "find_unused_parameters",
                 "gradient_as_bucket_view", "static_graph", "forward_sync_buffers")


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
    (:mod:`deft.runtime.compat`). The wrapper keeps torch DDP's attributes of them (``process_group``,
    ``device_ids``, ``output_device``, ``dim``, ``bucket_bytes_cap``, ...) and its
    ``require_backward_grad_sync`` flag, which :meth:`no_sync` sets.
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
        self._rebuild_args = {k: v for k, v in locals().items() if k in _REBUILT_WITH}  # __reduce_ex__
        del check_reduction, skip_all_reduce_unused_params, batched_grad_copy
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
        # what torch DDP leaves alone (set by _set_params_and_buffers_to_ignore_for_model)
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._names, self._params, self.device = trainable(module, self.parameters_to_ignore)
        path = self.config.schedule_path
        if path is not None and (dist.get_rank() == 0 or os.path.exists(path)):
            check_schedule_file(self.config, self._params)
        self.config, self._compiled = for_compiled(module, self.config)
        check_device_ids(device_ids, output_device, self.device)
        check_sync_batch_norm(module, self.device)
        warn_shared_rendezvous_store(os.environ)
        self._cuda = self.device.type == "cuda"
        self._ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        # torch DDP all-reduces on process_group (default: the default group): deft's primary link follows its backend
        self._group_backend = str(dist.get_backend(process_group))
        self._connect(init_sync)
        # torch DDP's attributes of its arguments, as torch sets them (read by user code and trainers)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.device_ids, self.output_device = torch_device_ids(device_ids, output_device, self.device)
        self.device_type = self.device.type
        self.dim, self.find_unused_parameters = dim, find_unused_parameters
        self.gradient_as_bucket_view, self.static_graph = gradient_as_bucket_view, static_graph
        self.bucket_bytes_cap = int(self.config.bucket_cap_mb * 1024 * 1024)
        self.broadcast_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
        self._sync_buffers = self.broadcast_buffers if forward_sync_buffers is None else bool(forward_sync_buffers)
        self._buffers_due = True  # the next forward broadcasts the buffers (torch DDP's first forward does)
        self._build(given_profile, optimizer)
        self._rebuild_args |= {"config": self.config, "profile": given_profile}
        # deft's record travels in state_dict() under this rank's key (deft.runtime.checkpoint, its Note)
        self._record_to_load: dict[int | None, object] = {}
        self.register_state_dict_post_hook(_add_record)
        self.register_load_state_dict_pre_hook(_take_record)
        self.register_load_state_dict_post_hook(_load_record)

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
        # CPU buffers on the control group: broadcast beside the forward's first modules (deft.runtime.buffer_sync)
        self._buffer_sync = BufferSync(self.module, self._control, self._synced_buffers) \
            if self._buffer_group is None and not self._cuda else None
        self._init_broadcast: TimedBroadcast | None = None
        if init_sync:
            state = [p for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore] + \
                self._synced_buffers()
            # set the group up first (NCCL creates its communicator at the first collective), so the
            # broadcast's time measures the link (codecs.first_iteration: the first iteration's judgement)
            wait_work(dist.all_reduce(torch.zeros(1, device=self.device), group=self._primary.group, async_op=True),
                      self._primary.name, "first collective", self.rank, cfg.timeout_s)
            start = time.perf_counter()
            broadcast_state(state, self._primary.group, self._primary.name, self.rank, cfg.timeout_s)
            self._init_broadcast = TimedBroadcast(time.perf_counter() - start,
                                                  sum(t.numel() * t.element_size() for t in state))

    def _build(self, given_profile: Profile | None, optimizer: torch.optim.Optimizer | None) -> None:
        """The training mode (:func:`deft.runtime.mode.start_mode`), its hooks installed."""
        self._sync = SyncSwitch()
        wiring = Wiring(self.config, self.module, self._names, self._params, self.device, self._compiled,
                        self._control, self._links, self._ranks, self._init_broadcast, self._sync, self._buffer_sync)
        self._mode = start_mode(wiring, given_profile, optimizer)

    # -- public API ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:  # the wrapped module's own signature
        self._sync_buffers_now()
        out = self._mode.forward(args, kwargs)
        self._buffers_synced()
        return out

    @outside_graphs
    def _sync_buffers_now(self) -> None:
        """Collective: buffers (BatchNorm statistics) follow rank 0 at a forward that comes after a
        training forward outside ``no_sync()``, evaluation forwards included: torch DDP's rule."""
        sync, self._buffers_due = self._buffers_due, torch.is_grad_enabled() and not self._sync.off
        # one rank's buffers are rank 0's already: nothing to send (torch DDP sends them anyway)
        if sync and self._sync_buffers and self.world > 1 and self._synced_buffers():
            if self._buffer_group is not None:
                broadcast_state(self._synced_buffers(), self._buffer_group, f"{self._primary.name} (buffers)",
                                self.rank, self.config.timeout_s, stream_ordered=True, what="buffers")
            elif self._buffer_sync is not None:
                self._buffer_sync.start()  # waited for before the first module reading a buffer
            else:
                broadcast_state(self._synced_buffers(), self._control.group, "control", self.rank,
                                self.config.timeout_s, what="buffers")

    def _synced_buffers(self) -> list[torch.Tensor]:
        """The module's buffers that follow rank 0 (all but those torch DDP's ignore list names)."""
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    @outside_graphs
    def _buffers_synced(self) -> None:
        """The forward ended: the buffers' broadcast is over, whether or not a module read one."""
        if self._buffer_sync is not None:
            self._buffer_sync.finish()

    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Report this iteration's loss (optional; feeds the preserver's convergence statistics, and in
        local-steps mode ``local_period = "adacomm"``'s period)."""
        self._mode.observe_loss(float(loss.detach().item()) if isinstance(loss, torch.Tensor) else float(loss))

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
        return self._mode.calibrate(closure, tol, ncv, maxiter)

    @property
    def schedule(self) -> Schedule:
        """The schedule running now (the DDP-like synchronous one during warm-up; local-steps mode runs
        none and raises :class:`deft.errors.DeftError`)."""
        return self._mode.schedule

    @property
    def iteration(self) -> int:
        """The index of the current (or next) training iteration."""
        return self._mode.iteration

    @property
    def phase(self) -> Phase:
        """Where the current iteration stands (:class:`deft.runtime.phase.Phase`)."""
        return self._mode.phase

    @property
    def pending_updates(self) -> list[PendingUpdate]:
        """Updates whose gradients are queued but not yet applied, oldest first: the iterations each
        merges so far and the buckets already sent."""
        return self._mode.pending_updates

    @property
    def update_log(self) -> list[LogEntry]:
        """Every applied update: (the iteration at whose step it was applied, the iterations it merges)."""
        return self._mode.update_log

    @property
    def plan_info(self) -> PlanInfoView:
        """What deft decided, read-only (:mod:`deft.runtime.records` lists the keys; in local-steps mode
        only ``local_steps``: :meth:`deft.runtime.local_steps.LocalSteps.info`)."""
        return self._mode.plan_info

    @property
    def profile(self) -> Profile | None:
        """The profile the running schedule was planned from (corrected by adaptation; None before)."""
        return self._mode.profile

    @property
    def last_grad_norm(self) -> float | None:
        """With :meth:`clip_grad_norm_on_update`: the last update's norm before clipping."""
        return self._mode.last_grad_norm

    @property
    def link_stats(self) -> dict[str, dict[str, int]]:
        """Collectives and bytes sent per link so far."""
        return {n: {"calls": lk.stats.calls, "bytes": lk.stats.bytes} for n, lk in self._links.items()}

    @property
    def comm_hook(self) -> CommHook | None:
        """The registered comm hook and its state (None: plain all-reduces)."""
        return self._mode.comm_hook

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future[torch.Tensor]]) -> None:
        """torch DDP's ``register_comm_hook``: ``hook(state, bucket) -> Future`` runs on every bucket deft
        sends, on the scheduled link and stage (see :mod:`deft.runtime.codecs.hooks`). torch's own hooks
        work unchanged (fp16/bf16 compression, PowerSGD). Register it once, before training (and
        before ``load_state_dict`` when resuming: the checkpoint restores the hook's state)."""
        if not callable(hook):
            raise DeftError(f"register_comm_hook: hook must be callable(state, bucket), got {type(hook).__name__}")
        self._mode.register_comm_hook(state, hook)

    def flush(self) -> None:
        """Communicate and apply every pending update now (collective: every rank calls it).

        For the end of training or before an evaluation that must see every gradient. A group cut
        short merges the iterations it has; the schedule restarts its cycle at the next iteration.
        """
        self._mode.flush()

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
        self._mode.clip_on_update(None if max_norm is None else (float(max_norm), float(norm_type)))

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag behind ``no_sync()``: False makes the backward of the next training forward only
        accumulate (the forward decides, as in torch), True restores communication."""
        return not self._sync.off

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync.require_sync(value)

    @property
    def require_forward_param_sync(self) -> bool:
        """torch DDP's flag: does the next forward broadcast rank 0's buffers (``broadcast_buffers``)?
        Set by each forward as torch sets it (False after one under ``no_sync()`` or without gradients)."""
        return self._buffers_due

    @require_forward_param_sync.setter
    def require_forward_param_sync(self, value: bool) -> None:
        self._buffers_due = bool(value)

    def will_sync_module_buffers(self) -> bool:
        """torch DDP's: will the next forward broadcast the module's buffers?"""
        return self._buffers_due and self._sync_buffers and self.world > 1 and bool(self._synced_buffers())

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch DDP's logging record (Lightning's teardown reads it): none here; deft's is :attr:`plan_info`."""
        return {}

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """torch DDP's: the named parameters and buffers of ``module`` that a wrapper built after this
        leaves alone: no gradient reduced (each rank keeps its own), nothing broadcast."""
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, params_and_buffers_to_ignore)

    def _set_static_graph(self) -> None:
        """torch DDP's static-graph hint: deft records the graph's use of each parameter in its first
        training forward whatever the hint says, so there is nothing to set."""
        self.static_graph = True

    def no_sync(self) -> AbstractContextManager[None]:
        """Like torch DDP's: the backward of a forward run inside only accumulates (micro-batches of one
        iteration; as in torch, the forward decides); the first backward of a forward outside
        completes the iteration's gradient and communicates it as scheduled."""
        return self._sync.suspended()

    def trigger_sync_in_backward(self) -> AbstractContextManager[None]:
        """Backwards inside communicate even where their forward ran under :meth:`no_sync` (what
        Accelerate's ``trigger_sync_in_backward`` does to torch DDP's reducer)."""
        return self._sync.triggered()

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> AbstractContextManager[None]:
        """torch DDP's uneven-inputs context: refused (:func:`deft.runtime.compat.refuse_join`)."""
        raise refuse_join("ddp.join()")

    def join_hook(self, **kwargs: Any) -> Any:
        """What ``torch.distributed.algorithms.Join([ddp])`` asks for: refused, as :meth:`join`."""
        raise refuse_join("Join([ddp])")

    def close(self) -> None:
        """Remove deft's hooks from the parameters and the optimizer (the wrapper is unusable after)."""
        self._mode.close()
        if self._buffer_sync is not None:
            self._buffer_sync.close()

    # -- checkpoint (deft.runtime.checkpoint) ----------------------------------------------------
    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """``torch.save(ddp)``, ``copy.deepcopy(ddp)``, as torch DDP allows them: the module (deft's hooks
        on it dead: :mod:`deft.runtime.saved_hooks`), the constructor's arguments and deft's record.
        Loading builds the wrapper again on the default process group (collective: every rank loads
        it at the same point, where the group exists, as torch DDP's load needs) and restores the record."""
        if self._ranks is not None:
            raise DeftError("torch.save or copy.deepcopy of the wrapper: supported with the default process group "
                            "only, as torch DDP's pickling is; save ddp.state_dict() or ddp.module instead")
        record = self.get_deft_state() if self._mode.takes_record() else None
        return (_rebuilt, (self.module, self._rebuild_args, record))

    def get_deft_state(self) -> torch.Tensor:
        """deft's runtime state, which ``state_dict()`` holds under this rank's key
        (:func:`deft.runtime.checkpoint.record_key`): the mode's record as one uint8 tensor, so the
        state_dict saves with safetensors too (:func:`deft.runtime.checkpoint.encode_record`)."""
        return encode_record(stamp(self._mode.state(), shared_config(self.config)))

    def set_deft_state(self, state: object) -> None:
        """Restore :meth:`get_deft_state` (or the record itself, a dict); a record of another world
        size or config is refused first (:func:`deft.runtime.checkpoint.check_stamp`)."""
        doc = decode_record(state, self.device)
        check_stamp(doc, self.world, shared_config(self.config))
        self._mode.load_state(doc)


def _rebuilt(module: nn.Module, args: dict[str, Any], record: torch.Tensor | None) -> DistributedDataParallel:
    """A pickled or copied wrapper (:meth:`DistributedDataParallel.__reduce_ex__`), built again."""
    ddp = DistributedDataParallel(module, **args)
    if record is not None:
        ddp.set_deft_state(record)
    return ddp


def _add_record(ddp: DistributedDataParallel, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict()``'s post-hook: this rank's record, after the module's parameters (whose pre-hook
    finished the deferred updates). None between a backward and its step: that state_dict is torch
    DDP's (``ScheduledRun.takes_record``), and the wrapper it is loaded into starts afresh."""
    if ddp._mode.takes_record():
        state_dict[prefix + record_key(ddp.rank)] = ddp.get_deft_state()


def _take_record(ddp: DistributedDataParallel, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict()``'s pre-hook: the records out of ``state_dict`` (no unexpected keys), kept
    for the post-hook, so that the record is loaded after the parameters, as it was saved."""
    ddp._record_to_load = take_records(state_dict, prefix)


def _load_record(ddp: DistributedDataParallel, incompatible_keys: Any) -> None:
    """``load_state_dict()``'s post-hook: this rank's record, or else the one record given (a single
    file saved by one rank: refused where it holds that rank's own pending state)."""
    found, ddp._record_to_load = ddp._record_to_load, {}
    if not found:
        return  # torch DDP's state_dict, or the module's: deft starts as after a module checkpoint
    own = ddp.rank if ddp.rank in found else None if None in found else min(r for r in found if r is not None)
    ddp.set_deft_state(found[own])


# isinstance(ddp, torch DDP) holds for deft's wrapper (module docstring, its Note)
torch.nn.parallel.DistributedDataParallel.register(DistributedDataParallel)
