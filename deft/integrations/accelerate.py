"""deft under Accelerate: ``from deft.integrations.accelerate import Accelerator`` is the one-line switch.

:class:`Accelerator` is Accelerate's own, building ``deft.DistributedDataParallel`` where Accelerate
builds torch DDP (``prepare_model`` in a multi-CPU or multi-GPU run). Everything around the wrapper
stays Accelerate's: device placement, the autocast patching of the model's forward
(``mixed_precision="bf16"``/``"fp16"``), ``accumulate()`` and ``no_sync`` (deft's ``no_sync()``),
``backward`` and the GradScaler, ``clip_grad_norm_`` (deft's due gradient is in ``p.grad`` at the
step, as torch DDP's is), the prepared optimizer, scheduler and data loaders. What differs:

* ``torch.compile`` (``dynamo_backend``) compiles the wrapper, as torch advises for DDP, so deft's
  per-module hooks stay (regional compilation compiles the model's blocks before wrapping);
* :meth:`Accelerator.backward` reports each iteration's loss to deft (``observe_loss``);
* :meth:`Accelerator.unwrap_model` returns the user's model from deft's wrapper too;
* :meth:`Accelerator.save_state` / :meth:`Accelerator.load_state` also keep each rank's deft record
  (see there), so a resumed run continues the schedule and applies every gradient once;
* ``join_uneven_inputs`` is a no-op with even batches (Accelerate's default) and refused with uneven ones:
  deft does not support uneven inputs.

Accelerate's other distributed modes (FSDP, DeepSpeed, Megatron-LM, XLA, tensor parallelism) build no
torch DDP for deft to replace: :class:`Accelerator` refuses them at construction. Without Accelerate
installed, importing this module raises ``ImportError`` naming ``pip install deft[accelerate]``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeAlias

import torch
from torch import nn

try:
    import accelerate
    from accelerate.utils import DistributedType, is_compiled_module
except ImportError as e:  # pragma: no cover - exercised without the extra installed
    raise ImportError("deft.integrations.accelerate needs Accelerate: pip install deft[accelerate]") from e

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import DeftError
from deft.profile import Profile
from deft.runtime.compat import refuse_join
from deft.runtime.ddp import DistributedDataParallel

#: Accelerate's modes in which it builds torch DDP (or nothing, one process): the ones deft can take.
SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

#: Each rank's deft records in a ``save_state`` folder (Accelerate's own files are saved by the main
#: process only; these, like its ``random_states_<rank>.pkl``, by every rank).
RECORD_FILE = "deft_state_{rank}.pt"

DeftConfigLike: TypeAlias = "DeftConfig | str | os.PathLike[str] | JsonDict | None"


class Accelerator(accelerate.Accelerator):
    """Accelerate's ``Accelerator`` with ``deft.DistributedDataParallel`` in place of torch DDP.

    ``deft_config`` (a :class:`deft.DeftConfig`, a dict or a TOML/JSON path) and ``deft_profile`` are
    deft's ``config=`` and ``profile=``; the other arguments are Accelerate's. A
    ``DistributedDataParallelKwargs`` handler's torch DDP arguments and comm hook reach deft's wrapper
    as they reach torch DDP's.
    """

    def __init__(self, *args: Any, deft_config: DeftConfigLike = None, deft_profile: Profile | str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deft_setup(deft_config, deft_profile)

    @classmethod
    def adopt(cls, accelerator: accelerate.Accelerator, *, deft_config: DeftConfigLike = None,
              deft_profile: Profile | str | None = None) -> Accelerator:
        """Make an ``accelerate.Accelerator`` built elsewhere (the HuggingFace ``Trainer`` builds its
        own) this class, before it prepared a model; returns the same object."""
        if not isinstance(accelerator, accelerate.Accelerator):
            raise TypeError(f"expected an accelerate.Accelerator, got {type(accelerator).__name__}")
        if isinstance(accelerator, cls):
            return accelerator
        if accelerator._models:
            raise DeftError("Accelerator.adopt: the accelerator has prepared a model already; adopt it before "
                            "prepare() so that deft's wrapper is built in place of torch DDP")
        accelerator.__class__ = cls  # the same state and handlers, deft's prepare_model
        assert isinstance(accelerator, cls)
        accelerator._deft_setup(deft_config, deft_profile)
        return accelerator

    def _deft_setup(self, deft_config: DeftConfigLike, deft_profile: Profile | str | None) -> None:
        if self.distributed_type not in SUPPORTED:
            raise DeftError(f"deft replaces torch DDP; Accelerate's {self.distributed_type} mode builds none "
                            f"(deft runs in {[str(t) for t in SUPPORTED]})")
        if self.parallelism_config is not None and self.parallelism_config.tp_enabled:
            raise DeftError("deft replaces torch DDP; tensor parallelism (parallelism_config.tp_size > 1) is not "
                            "data parallelism deft can schedule")
        self.deft_config = DeftConfig.resolve(deft_config)
        self.deft_profile = deft_profile
        self.deft_wrappers: list[DistributedDataParallel] = []
        self._deft_loss: torch.Tensor | None = None  # the iteration's loss so far (backward)

    # -- the wrapper where Accelerate builds torch DDP -------------------------------------------------
    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Accelerate's ``prepare_model``, with deft's wrapper where it builds torch DDP.

        Accelerate places the model and patches its forward for autocast (its ``evaluation_mode`` path:
        all of ``prepare_model`` but the DDP wrapper); deft then wraps it, with the handler's torch DDP
        arguments and comm hook; a whole-model ``torch.compile`` compiles the wrapper last, as
        Accelerate compiles torch DDP's. The user's model is the one Accelerate saves and loads
        (``save_state`` keeps Accelerate's checkpoint layout: torch DDP's and deft's are interchangeable).
        """
        if evaluation_mode or getattr(model, "_is_accelerate_prepared", False) or not self._deft_wraps(model):
            return super().prepare_model(model, device_placement, evaluation_mode)
        prepared = super().prepare_model(model, device_placement, evaluation_mode=True)
        compiled = is_compiled_module(prepared)
        inner = prepared._orig_mod if compiled else prepared  # compiled below, around the wrapper
        kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        device_ids = [self.local_process_index] if self.distributed_type == DistributedType.MULTI_GPU else None
        if os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP", "false") == "true":
            device_ids = None
        wrapper = DistributedDataParallel(inner, device_ids=device_ids, **kwargs, config=self.deft_config,
                                          profile=self.deft_profile)
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(wrapper)
        self.deft_wrappers.append(wrapper)
        out = torch.compile(wrapper, **self.state.dynamo_plugin.to_kwargs()) if compiled else wrapper
        out.__dict__["_is_accelerate_prepared"] = True  # what Accelerate marks a prepared model with
        assert isinstance(out, nn.Module)
        return out

    def _deft_wraps(self, model: nn.Module) -> bool:
        """Where Accelerate would build torch DDP: a distributed run and a model with a trainable parameter."""
        return self.distributed_type != DistributedType.NO and self.num_processes > 1 \
            and any(p.requires_grad for p in model.parameters())

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's ``backward``; the iteration's loss (its micro-batches' losses as given, summed)
        also reaches every deft wrapper's ``observe_loss`` after the iteration's last backward: the
        preserver's convergence statistics need it to accept a schedule with delayed updates (so do not
        call ``observe_loss`` yourself as well)."""
        given = loss.detach()
        self._deft_loss = given if self._deft_loss is None else self._deft_loss + given
        super().backward(loss, **kwargs)
        if self.sync_gradients and self.deft_wrappers:
            for w in self.deft_wrappers:
                w.observe_loss(self._deft_loss)
            self._deft_loss = None

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """The user's model, from deft's wrapper too (compiled or not: the compile was of the wrapper)."""
        core = _core(model)
        if isinstance(core, DistributedDataParallel):
            model = core.module
        result: nn.Module = super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        return result

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """Accelerate's: backwards inside communicate even where their forward ran under ``no_sync``
        (deft's :meth:`~deft.runtime.ddp.DistributedDataParallel.trigger_sync_in_backward`)."""
        core = _core(model)
        if not isinstance(core, DistributedDataParallel):
            with super().trigger_sync_in_backward(model):
                yield
            return
        with core.trigger_sync_in_backward():
            yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Accelerate's, for deft's wrapper: with even batches (Accelerate's default: its loaders give every
        rank as many batches) there is nothing to join, as Accelerate's ``Join(enable=False)`` for torch
        DDP; uneven inputs (``even_batches=False``) are refused, as deft's ``join()`` refuses them."""
        if not any(isinstance(_core(j), DistributedDataParallel) for j in joinables):
            with super().join_uneven_inputs(joinables, even_batches):
                yield
            return
        if not (self.even_batches if even_batches is None else even_batches):
            raise refuse_join("Accelerator.join_uneven_inputs(even_batches=False)")
        yield

    def free_memory(self, *objects: Any) -> Any:
        self.deft_wrappers = []
        return super().free_memory(*objects)

    def flush(self) -> None:
        """Collective: every deft wrapper this accelerator built applies its pending updates now
        (``DistributedDataParallel.flush``): before an evaluation or a save that must see every gradient."""
        for w in self.deft_wrappers:
            w.flush()

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """Accelerate's ``save_state``, and each rank's deft records beside it (``deft_state_<rank>.pt``).

        Call it on every rank, as Accelerate asks. Accelerate saves the model, optimizer and scheduler
        from the main process only; the model's parameters are every rank's (deft's pending updates
        are finished or kept aside, never half-applied), but deft's record (the iteration, the
        schedule, the update log) also holds this rank's *local* gradients not yet communicated, so
        every rank writes its own, and :meth:`load_state` gives each rank its own back. Nothing is
        communicated and no pending update is applied early: training resumes exactly where it stopped.
        Between the micro-batches of an accumulated step too: the record is the state before the step's
        first micro-batch, whose gradients so far are in ``p.grad``, which torch DDP's checkpoint does not
        hold either.
        """
        records = [w.get_deft_state() for w in self.deft_wrappers]  # first: a refusal writes nothing
        location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        if records:
            torch.save({"records": records}, Path(location) / RECORD_FILE.format(rank=self.process_index))
        return str(location)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """Accelerate's ``load_state``, then each rank's deft records (:meth:`save_state`), if the folder
        has them (a checkpoint of a torch DDP run has none: deft then starts its warm-up afresh)."""
        super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        folder = _loaded_folder(self, input_dir)
        path = folder / RECORD_FILE.format(rank=self.process_index)
        if not self.deft_wrappers or not path.exists():
            return
        records = torch.load(path, weights_only=True)["records"]
        if len(records) != len(self.deft_wrappers):
            raise DeftError(f"{path}: {len(records)} deft record(s) for {len(self.deft_wrappers)} prepared "
                            "deft model(s): prepare the same models as the run that saved it")
        for w, record in zip(self.deft_wrappers, records, strict=True):
            w.set_deft_state(record)


def _core(model: object) -> object:
    """The module under a whole-model ``torch.compile``, else the module itself."""
    return model._orig_mod if isinstance(model, nn.Module) and is_compiled_module(model) else model


def _loaded_folder(acc: accelerate.Accelerator, input_dir: str | None) -> Path:
    """The folder ``load_state`` read: ``input_dir``, or the latest automatic checkpoint."""
    if input_dir is not None:
        return Path(os.path.expanduser(input_dir))
    root = Path(acc.project_dir) / "checkpoints"  # Accelerate's own pick: the highest number in the name
    return max(root.iterdir(), key=lambda p: int(re.findall(r"([0-9]+)(?=[^/]*$)", p.name)[0]))
