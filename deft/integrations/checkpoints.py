"""A trainer's checkpoint taken after a backward and before its step.

deft withdraws an iteration no gradient of which reached it yet (a forward alone, or the micro-batches
of an accumulation under ``no_sync()`` so far), so a checkpoint there flushes and takes deft's record
as between steps. After a backward and before the step (Lightning's manual optimization accumulating
over ``manual_backward`` calls, a checkpoint in between) the iteration is half done: deft cannot flush
and its record cannot be taken (:meth:`deft.DistributedDataParallel.get_deft_state` needs an iteration
boundary). The parameters and the optimizer's state are torch DDP's all the same, so the checkpoint
holds what torch DDP's holds, and the resumed run profiles again. Unless an update of an earlier
iteration is still queued (a merged schedule, never at ``epsilon = 0``): that checkpoint would lose it,
so it is refused, before anything is written.
"""

from __future__ import annotations

from deft.errors import DeftError
from deft.runtime.ddp import DistributedDataParallel


def check_nothing_held(ddp: DistributedDataParallel, where: str, advice: str) -> None:
    """Refuse ``where`` (a checkpoint after a backward, before its step) while ``ddp`` holds the gradients
    of an earlier iteration; ``advice``: how to save elsewhere, in the trainer's terms."""
    held = [list(u.iterations) for u in ddp.pending_updates if any(i < ddp.iteration for i in u.iterations)]
    if held:
        raise DeftError(f"{where}: after a backward and before its optimizer step, while deft still holds the "
                        f"gradients of iterations {held} (a merged update), the checkpoint would lose them. "
                        f"{advice}, or deft_config={{'epsilon': 0.0}}")
