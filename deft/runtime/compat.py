"""torch DDP's constructor, as deft takes it: which arguments act, which are hints deft does not need,
which it refuses, and torch DDP's device rule.

The positional arguments of ``deft.DistributedDataParallel`` are torch DDP's, in torch's order, so a
torch DDP line carries over; deft's own (``optimizer``, ``config``, ``profile``) are keyword-only.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch._utils import _get_device_index

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import DeftError

log = logging.getLogger("deft.runtime")

#: torch DDP arguments deft refuses: each changes what is communicated in a way deft's schedule replaces.
UNSUPPORTED = ("delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision", "device_mesh",
               "bucket_cap_mb_list")


#: A device as torch DDP's ``device_ids``/``output_device`` take it: an index, a name or a device.
Device = int | str | torch.device


def check_torch_args(given: dict[str, object], device_ids: object) -> None:
    """Refuse what deft does not support (``given``: the :data:`UNSUPPORTED` arguments as passed), an
    optimizer passed where torch DDP has ``device_ids``, and an uninitialized process group."""
    bad = [k for k in UNSUPPORTED if given.get(k) is not None]
    if bad:
        raise DeftError(f"deft.DistributedDataParallel does not support torch DDP's {bad}; remove them "
                        "(mixed precision: use torch.autocast in the training loop)")
    if isinstance(device_ids, torch.optim.Optimizer):
        raise DeftError("the second positional argument is torch DDP's device_ids; pass the optimizer as "
                        "optimizer=... (deft's own arguments optimizer, config, profile are keyword-only)")
    if not (dist.is_available() and dist.is_initialized()):
        raise DeftError("deft.DistributedDataParallel needs torch.distributed to be initialized first: "
                        "launch with torchrun and call torch.distributed.init_process_group()")


def warn_shared_rendezvous_store(environ: Mapping[str, str]) -> bool:
    """Warn (and return True) where torchrun may restart this job on a rendezvous store it shares with
    the workers (``--rdzv-backend c10d``, ``--standalone``): in a restarted attempt torch's
    ``new_group`` can read the previous attempt's addresses and fail or hang (pytorch/pytorch#135712),
    and deft creates groups of its own (the control plane, the links). torch DDP alone creates none."""
    shared = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not (shared and restarts.isdigit() and int(restarts) > 0 and environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
        return False  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes TORCHELASTIC_USE_AGENT_STORE False
    log.warning("deft: torchrun may restart this job (--max-restarts %s) on a rendezvous store shared with the "
                "workers; a restarted attempt can fail to create deft's process groups (pytorch/pytorch#135712). "
                "Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment (or use --rdzv-backend "
                "static)", restarts)
    return True


def check_device_ids(device_ids: object, output_device: object, device: torch.device) -> None:
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
        d = torch.device(device.type, given) if isinstance(given, int) else torch.device(str(given))
        if d.type != device.type or (d.index is not None and device.index is not None and d.index != device.index):
            raise DeftError(f"device_ids/output_device name {d} but the module's parameters are on {device}; "
                            "move the module to that device first, as with torch DDP")


def check_sync_batch_norm(module: torch.nn.Module, device: torch.device) -> None:
    """torch DDP's rule at construction: ``SyncBatchNorm`` layers only work with GPU modules (their
    forward would fail in the first iteration on the CPU)."""
    if device.type != "cpu":
        return
    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.SyncBatchNorm):
            which = f"module {name!r}" if name else "the module"
            raise DeftError(f"{which} is a SyncBatchNorm, which works only with GPU modules (torch DDP refuses it "
                            "on the CPU too); use torch.nn.BatchNorm (broadcast_buffers keeps its statistics "
                            "rank 0's) or move the module to a GPU")


def torch_device_ids(device_ids: Sequence[object] | None, output_device: object,
                     device: torch.device) -> tuple[list[int] | None, int | None]:
    """torch DDP's ``device_ids`` and ``output_device`` attributes: ``None`` for a CPU module or none
    given, else the devices' indices (``output_device`` defaulting to the first)."""
    if not device_ids or device.type == "cpu":
        return None, None
    ids = [_get_device_index(d, True) for d in device_ids]
    return ids, _get_device_index(output_device if output_device is not None else device_ids[0], True)


def trainable(module: torch.nn.Module, ignored: Collection[str] = ()
              ) -> tuple[list[str], list[torch.Tensor], torch.device]:
    """The module's trainable parameters (names, tensors) but those ``ignored`` names (torch DDP's
    ``_ddp_params_and_buffers_to_ignore``), and the one device they are on."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored]
    lazy = [n for n, p in named if isinstance(p, torch.nn.parameter.UninitializedParameter)]
    if lazy:  # torch DDP refuses it too: no shape to bucket or broadcast until a forward infers one
        raise DeftError(f"the module has uninitialized (lazy) parameters ({', '.join(lazy[:3])}"
                        f"{', ...' if len(lazy) > 3 else ''}): run one forward on a sample batch to "
                        "initialize them, then wrap the module, as torch DDP requires")
    if not named:
        raise DeftError("the module has no parameter that requires a gradient")
    devices = {p.device for _, p in named}
    if len(devices) != 1:
        raise DeftError(f"deft needs all trainable parameters on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type == "meta":  # torch DDP refuses it too: there is nothing to broadcast or train
        raise DeftError("the module's parameters are on the meta device (shapes without data): materialize "
                        "them first (module.to_empty(device=...) and initialize them), then wrap the module, "
                        "as torch DDP requires")
    return [n for n, _ in named], [p for _, p in named], device


def shared_config(cfg: DeftConfig) -> JsonDict:
    """The settings every rank must share; NIC names and file paths may differ per host."""
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("profile_path", "schedule_path")}
    links = d["links"]
    assert isinstance(links, list)
    d["links"] = [{k: v for k, v in lk.items() if k != "ifname"} for lk in links if isinstance(lk, Mapping)]
    return d


def for_compiled(module: torch.nn.Module, cfg: DeftConfig) -> tuple[DeftConfig, str | None]:
    """The config for ``module`` and why it runs compiled (``torch.compile(model)`` or ``model.compile()``,
    itself or a submodule), or None. A compiled graph runs the forward without deft's per-module hooks
    between layers, and updating a parameter its backward saved is an in-place error there: a compiled
    module gets whole updates at the step (``forward_updates = false``). Wrapping first and compiling
    the wrapper, as torch advises for DDP, keeps them: deft's hooks run between graphs
    (:mod:`deft.runtime.eager`)."""
    for name, m in module.named_modules():
        if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None:
            why = f"the module{' ' + repr(name) if name else ''} is compiled (torch.compile before wrapping)"
            if cfg.forward_updates:
                log.warning("deft: %s: updates are applied whole at the step (forward_updates = false)", why)
            return replace(cfg, forward_updates=False), why
    return cfg, None


def refuse_join(what: str) -> DeftError:
    """torch DDP's uneven-inputs support (``join()``, ``Join([ddp])``, Accelerate's
    ``join_uneven_inputs``) is not deft's: a rank that runs out of batches would leave the others'
    scheduled collectives waiting. Refused when the context is entered, before any training in it."""
    return DeftError(f"{what}: deft.DistributedDataParallel does not support uneven inputs (torch DDP's join); "
                     "give every rank the same number of batches, e.g. DistributedSampler(..., drop_last=True) "
                     "or a loader cut to the shortest rank's length")
