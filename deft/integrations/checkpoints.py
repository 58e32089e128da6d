"""A trainer's checkpoint taken between the micro-batches of an accumulated step.

Lightning saves at every ``val_check_interval`` batches and Accelerate's ``save_state`` wherever the loop
calls it, aligned with optimizer steps or not. Between micro-batches deft cannot flush (the iteration is
half done) and its record cannot be taken (:meth:`deft.DistributedDataParallel.get_deft_state` needs an
iteration boundary); the parameters and the optimizer's state are torch DDP's all the same (the first
micro-batch's forward applied what the last step left finishing), so the checkpoint holds what torch
DDP's holds, and the resumed run profiles again. Unless an update of an earlier iteration is still
queued (a merged schedule, never at ``epsilon = 0``): that checkpoint would lose it, so it is refused,
before anything is written.
"""

from __future__ import annotations

from deft.errors import DeftError
from deft.runtime.ddp import DistributedDataParallel


def check_nothing_held(ddp: DistributedDataParallel, where: str, advice: str) -> None:
    """Refuse ``where`` (a checkpoint between micro-batches) while ``ddp`` holds the gradients of an
    earlier iteration; ``advice``: how to save elsewhere, in the trainer's terms."""
    held = [u.iterations for u in ddp.pending_updates if u.iterations and max(u.iterations) < ddp.iteration]
    if held:
        raise DeftError(f"{where}: between the micro-batches of an accumulated step, while deft still holds the "
                        f"gradients of iterations {held} (a merged update), the checkpoint would lose them. "
                        f"{advice}, or deft_config={{'epsilon': 0.0}}")
