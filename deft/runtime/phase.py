"""Where an iteration stands: the phase of deft's per-iteration state machine.

One training iteration is forward -> backward -> ``optimizer.step()``::

    IDLE --forward with grad enabled (or a first gradient)--> FORWARD
    FORWARD --first gradient outside no_sync()--> BACKWARD
    BACKWARD --end of the autograd pass--> BACKWARD_DONE
    FORWARD | BACKWARD | BACKWARD_DONE --optimizer.step()--> IDLE   (the iteration counter advances)
    FORWARD --flush(), a checkpoint, before any gradient--> IDLE   (withdrawn: the next forward begins it again)

Forwards under ``torch.no_grad()`` never leave IDLE (evaluation). ``flush()``, checkpoints and
schedule switches happen only in IDLE, between iterations. An iteration no gradient of which reached
deft yet (a forward with gradients enabled and no backward, or the micro-batches of an accumulation so
far) is withdrawn for them, not refused, as torch DDP allows them there.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    BACKWARD_DONE = "backward done"

    def __str__(self) -> str:
        return self.value
