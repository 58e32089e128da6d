"""deft under the HuggingFace ``Trainer``: ``from deft.integrations.transformers import Trainer``.

The ``Trainer`` wraps the model through Accelerate (``accelerator.prepare``), so deft's :class:`Trainer`
only makes the accelerator it builds deft's (:class:`deft.integrations.accelerate.Accelerator`, adopted
right after ``create_accelerator_and_postprocess``, before anything is prepared). The rest is the
``Trainer``'s own: ``gradient_accumulation_steps`` (through ``accelerator.no_sync``, deft's
``no_sync()``), ``max_grad_norm`` (``accelerator.clip_grad_norm_``), the optimizer, scheduler, logging,
evaluation and checkpoints; each iteration's loss reaches deft's preserver through
``accelerator.backward``. Tested on the transformers versions the ``deft[transformers]`` extra pins.

A ``Trainer`` checkpoint is the user's model, the optimizer, the scheduler and each rank's RNG state:
it has no place for deft's record. So deft's pending updates are applied before each checkpoint
(:class:`FlushBeforeSave`, collective: the ``Trainer`` runs callbacks on every rank) and at the end of
training; a run resumed from a checkpoint holds every gradient and starts deft's warm-up afresh.
Without transformers installed, importing this module raises ``ImportError`` naming
``pip install deft[transformers]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import transformers
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - exercised without the extra installed
    raise ImportError("deft.integrations.transformers needs transformers: pip install deft[transformers]") from e

from deft.integrations.accelerate import Accelerator, DeftConfigLike
from deft.profile import Profile


class FlushBeforeSave(TrainerCallback):
    """Collective: deft's pending updates applied before the ``Trainer`` saves a checkpoint (after the
    step whose ``control.should_save`` is set, at a step's or an epoch's end) and when training ends, so
    the saved model and optimizer hold every gradient (``Accelerator.flush``)."""

    def __init__(self, accelerator: Callable[[], Accelerator]) -> None:
        self._accelerator = accelerator

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if control.should_save:
            self._accelerator().flush()

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if control.should_save:
            self._accelerator().flush()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._accelerator().flush()


class Trainer(transformers.Trainer):
    """transformers' ``Trainer`` with deft's wrapper in place of torch DDP.

    ``deft_config`` and ``deft_profile`` are deft's ``config=`` and ``profile=`` (keyword-only); the
    other arguments are the ``Trainer``'s. The ``TrainingArguments``' DDP settings
    (``ddp_find_unused_parameters``, ``ddp_bucket_cap_mb``, ``ddp_broadcast_buffers``) reach deft's
    wrapper as they reach torch DDP's.
    """

    def __init__(self, *args: Any, deft_config: DeftConfigLike = None, deft_profile: Profile | str | None = None,
                 **kwargs: Any) -> None:
        # read by create_accelerator_and_postprocess, which the Trainer's __init__ calls
        self.deft_config, self.deft_profile = deft_config, deft_profile
        super().__init__(*args, **kwargs)
        self.add_callback(FlushBeforeSave(lambda: self.accelerator))

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator = Accelerator.adopt(self.accelerator, deft_config=self.deft_config,
                                             deft_profile=self.deft_profile)
