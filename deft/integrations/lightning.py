"""deft under Lightning: ``Trainer(strategy="deft")``.

::

    import deft.integrations.lightning  # registers "deft" with Lightning's StrategyRegistry
    trainer = lightning.Trainer(strategy="deft", accelerator="gpu", devices=8)
    # or, with deft's config:  strategy=DeftStrategy(deft_config={"epsilon": 0.0})

:class:`DeftStrategy` is Lightning's ``DDPStrategy`` with ``deft.DistributedDataParallel`` where it builds
torch DDP; launching, process groups, samplers, precision plugins and loops stay Lightning's. Importing
this module registers the name in ``lightning.pytorch`` and, when installed, in the standalone
``pytorch_lightning`` package (each has its own registry and its own ``DDPStrategy``: a twin class
with the same methods is registered there). Other ``DDPStrategy`` arguments are torch DDP's and reach
deft's wrapper (``bucket_cap_mb``, ``broadcast_buffers``...), which refuses those it does not support.

What differs from the plain ``DDPStrategy``, and why:

* ``block_backward_sync`` (Lightning's accumulation, ``accumulate_grad_batches``) enters deft's
  ``no_sync()``: one reduction per optimizer step, as with torch DDP. (Lightning's own test for it
  names torch DDP's class, so deft's wrapper would otherwise reduce every micro-batch: correct, slower.)
* ``ddp_comm_hook`` (with ``ddp_comm_state`` / ``ddp_comm_wrapper``) goes to deft's
  ``register_comm_hook`` where ``DDPStrategy`` registers it, on CUDA devices only: on another device
  Lightning's strategy leaves it out, and so does this one (with a warning), so that the run equals
  ``strategy="ddp"``'s (on the CPU, deft's own ``compression`` config sends in 16 bits). Post-local
  SGD's model averaging is refused (deft's ``local_steps`` config is its counterpart).
* Checkpoints: Lightning saves the LightningModule's ``state_dict`` and the optimizer's on every rank,
  and writes rank 0's. Before the module's state is taken, deft is flushed (collective: every rank is
  in ``save_checkpoint``), so both hold every update, whatever the schedule; the wrapper's record
  (iteration, schedule, update log), now with nothing pending, goes in the checkpoint under ``"deft"``
  and is loaded into the new wrapper on resume, so a resumed run keeps its plan instead of profiling
  again. So between the micro-batches of an accumulated step (a validation there saves too): the
  micro-batches' gradients so far stay in ``p.grad``, which neither checkpoint holds (nor ``"ddp"``'s).
  Inside manual optimization's own accumulation (after a ``manual_backward``, before its step) nothing
  can be flushed: see :mod:`deft.integrations.checkpoints`.
* ``teardown`` flushes (after a clean run only: a failed rank would leave its peers waiting), removes
  deft's hooks, and hands back the bare LightningModule.
* Manual optimization (``automatic_optimization = False``): Lightning runs the whole ``training_step``
  (forward, ``manual_backward``, ``step``) inside the wrapper's forward, and calls torch DDP's reducer
  before and after each ``manual_backward`` (``prepare_for_backward``, a static graph's first flush),
  which deft needs none of: its hooks see the backward and the step wherever they run. Supported with
  one optimizer and one ``manual_backward`` per ``training_step`` (stepping every call, or every few
  to accumulate; ``clip_gradients``, the LR schedulers). Refused with a ``DeftError``: several
  optimizers, at setup (Lightning's manual optimization with several is a GAN's backward-and-step per
  network inside one forward, while deft's iteration is one backward per forward); a second
  ``manual_backward`` in one ``training_step``, before it runs.

* After each optimizer step the step's loss (the mean of its micro-batches' ``training_step`` losses)
  goes to ``observe_loss``, which the preserver needs to consider delayed or merged updates (one
  ``.item()`` per step).

The optimizer step itself needs nothing: Lightning's precision plugins call ``optimizer.step(closure)``
(forward and backward inside the step), which deft handles itself (docs/USAGE.md, "What deft does to
your loop").
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any

import torch

try:
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
except ImportError as e:  # pragma: no cover - the extra is installed where the tests run
    try:
        from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry  # type: ignore[assignment]
    except ImportError:
        raise ImportError("deft.integrations.lightning needs Lightning: pip install deft[lightning]") from e

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import DeftError
from deft.integrations.checkpoints import check_nothing_held
from deft.runtime.ddp import DistributedDataParallel
from deft.runtime.phase import Phase

#: The name ``Trainer(strategy=...)`` takes.
NAME = "deft"
#: The checkpoint key holding deft's record (the wrapper's ``get_deft_state()``).
CHECKPOINT_KEY = "deft"

if TYPE_CHECKING:
    _Base = DDPStrategy
else:
    _Base = object


class DeftMethods(_Base):
    """What :class:`DeftStrategy` changes in Lightning's ``DDPStrategy`` (a mixin, so that the same
    methods serve ``lightning.pytorch`` and ``pytorch_lightning``, whose ``DDPStrategy`` classes differ)."""

    strategy_name = NAME

    def __init__(self, *args: Any, deft_config: DeftConfig | JsonDict | str | os.PathLike[str] | None = None,
                 **kwargs: Any) -> None:
        if kwargs.get("model_averaging_period") is not None:
            raise DeftError("strategy='deft' does not run Lightning's post-local SGD model averaging; deft's own "
                            "local steps do that job: deft_config={'local_steps': H}")
        super().__init__(*args, **kwargs)
        self.deft_config = deft_config
        self._deft_record: Any = None  # a checkpoint's record, loaded into the wrapper when it is built
        self._deft_failed = False
        self._deft_losses: list[torch.Tensor] = []  # this step's micro-batch losses, for observe_loss
        self._deft_backwards = 0  # manual optimization: manual_backward calls in this training_step
        self._deft_steps = 0  # optimizer steps so far

    @property
    def deft_ddp(self) -> DistributedDataParallel | None:
        """The live wrapper (None outside fitting, before setup and after teardown)."""
        return self.model if isinstance(self.model, DistributedDataParallel) else None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(NAME, cls, description="deft.DistributedDataParallel (DeFT's schedule)",
                                   override=True)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        module = self.lightning_module
        if trainer.state.fn == "fit" and module is not None and not module.automatic_optimization \
                and len(self.optimizers) > 1:
            self._deft_failed = True  # nothing to flush at teardown: no rank has trained
            raise DeftError(f"strategy='deft' with manual optimization takes one optimizer; configure_optimizers "
                            f"returned {len(self.optimizers)}. Lightning runs the whole training_step inside the "
                            "wrapper's forward, and deft's iteration is one backward per forward: a "
                            "backward-and-step per optimizer (a GAN's generator and discriminator) needs "
                            "strategy='ddp' (or 'ddp_find_unused_parameters_true'); one optimizer with a param "
                            "group per part of the model works")

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.deft_ddp is None:
            super().pre_backward(closure_loss)
            return
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            if self._deft_backwards:
                raise DeftError("strategy='deft' with manual optimization runs one manual_backward() per "
                                "training_step: deft's iteration is the wrapper's forward (Lightning's whole "
                                "training_step) and its one backward. Accumulate over training_steps instead "
                                "(manual_backward every step, optimizer step every few), or use strategy='ddp'")
            self._deft_backwards += 1

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.deft_ddp is None:  # torch DDP's reducer, which deft's wrapper has none of, is all it does
            super().post_backward(closure_loss)

    def _setup_model(self, model: Any) -> Any:
        ddp = DistributedDataParallel(model, device_ids=self.determine_ddp_device_ids(), config=self.deft_config,
                                      **self._ddp_kwargs)
        record, self._deft_record = self._deft_record, None
        if record is not None:
            ddp.set_deft_state(record)
        return ddp

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._deft_backwards = 0  # manual_backward calls in this training_step
        ddp = self.deft_ddp
        steps = self._deft_steps
        out = super().training_step(*args, **kwargs)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if ddp is not None and isinstance(loss, torch.Tensor):
            self._deft_losses.append(loss.detach())
        module = self.lightning_module
        if ddp is not None and module is not None and not module.automatic_optimization and self._deft_steps > steps:
            self._observe(ddp)  # manual optimization: the step ran inside, before the loss came back
        return out

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._deft_steps += 1
        ddp = self.deft_ddp
        module = self.lightning_module
        if ddp is not None and module is not None and module.automatic_optimization:
            self._observe(ddp)
        return out

    def _observe(self, ddp: DistributedDataParallel) -> None:
        """The step's loss, the mean over its micro-batches, to ``observe_loss``."""
        if self._deft_losses:
            ddp.observe_loss(torch.stack(self._deft_losses).float().mean())
        self._deft_losses.clear()

    def _register_ddp_hooks(self) -> None:
        hook = self._ddp_comm_hook
        ddp = self.deft_ddp
        if hook is None or ddp is None:
            return
        if self.root_device.type != "cuda":  # DDPStrategy._register_ddp_hooks: CUDA only
            if self.global_rank == 0:
                warnings.warn(f"DeftStrategy: ddp_comm_hook is not registered on {self.root_device.type}, as "
                              "strategy='ddp' leaves it out there; deft_config={'compression': ...} compresses "
                              "on any device", stacklevel=2)
            return
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        ddp.register_comm_hook(self._ddp_comm_state, hook)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        ddp = self.deft_ddp
        with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
            yield None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        ddp = self.deft_ddp
        if ddp is not None and ddp.phase in (Phase.IDLE, Phase.FORWARD):
            ddp.flush()  # collective: Lightning takes the state on every rank (between micro-batches too)
        state = super().lightning_module_state_dict()  # deft's state_dict hook finishes what is deferred
        if ddp is not None:
            check_nothing_held(ddp, "a Lightning checkpoint", "Save between optimizer steps")
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        ddp = self.deft_ddp
        if ddp is not None and ddp.phase is Phase.IDLE:  # after a backward and before its step it profiles again
            checkpoint[CHECKPOINT_KEY] = ddp.get_deft_state()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        record = checkpoint.get(CHECKPOINT_KEY)
        ddp = self.deft_ddp
        if record is not None and ddp is not None:
            ddp.set_deft_state(record)
        else:
            self._deft_record = record

    def on_exception(self, exception: BaseException) -> None:
        self._deft_failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        ddp = self.deft_ddp
        if ddp is not None:
            if not self._deft_failed:
                ddp.flush()  # the LightningModule leaves fit() with every update applied
            ddp.close()
            self.model = self.lightning_module
        super().teardown()


class DeftStrategy(DeftMethods, DDPStrategy):
    """``Trainer(strategy="deft")``: ``DDPStrategy`` building ``deft.DistributedDataParallel``.

    ``deft_config``: deft's config (a ``DeftConfig``, a dict or a TOML path; None: ``$DEFT_CONFIG`` or the
    defaults). Every other argument is ``DDPStrategy``'s.
    """


def _register_twin() -> type | None:
    """The same strategy in the standalone ``pytorch_lightning`` package, when it is installed."""
    try:
        import pytorch_lightning.strategies as pls
    except ImportError:
        return None
    if pls.DDPStrategy is DDPStrategy:
        return None
    twin = type("DeftStrategy", (DeftMethods, pls.DDPStrategy), {"__doc__": DeftStrategy.__doc__})
    twin.register_strategies(pls.StrategyRegistry)  # type: ignore[attr-defined]
    return twin


DeftStrategy.register_strategies(StrategyRegistry)
#: :class:`DeftStrategy`'s twin for ``pytorch_lightning`` (None where it is not installed).
PytorchLightningDeftStrategy = _register_twin()
