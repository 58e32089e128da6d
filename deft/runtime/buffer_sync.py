"""torch DDP's per-forward broadcast of rank 0's buffers, waited for where the forward first reads one.

torch DDP broadcasts rank 0's buffers (batch-norm statistics, masks, position tables) before every
forward that follows a training forward, and the forward waits for it before the module runs. deft
keeps the rule (``broadcast_buffers``; :meth:`deft.DistributedDataParallel._sync_buffers_now`). Where a
plan overlaps the last iteration's sends with the next forward (a lag-free plan's deferred buckets),
that broadcast, a message of a few kilobytes on the control group, queues on the primary link's NIC
behind those sends' bytes, and the whole forward would wait for it.

So on the CPU control group (:class:`BufferSync`) the broadcast is launched where torch DDP's is, from
a snapshot of rank 0's buffers taken then, and waited for just before the first module whose forward
reads a buffer begins: its forward pre-hook (:class:`deft.runtime.eager.ForwardHooks`), the module the
first training forward recorded reading each buffer first (:mod:`deft.runtime.first_use`; a buffer that
forward did not read: its owner). The modules before it (a network's first convolution) compute while
the broadcast travels. The forward's end waits for whatever is still in flight.

Invariant: every buffer is read and written only after it holds rank 0's values of the forward's start,
as under torch DDP: the snapshot is what torch DDP sends, and no module that reads a buffer runs before
the wait. Where the first reads are unknown (the first forward, whose reads are being recorded; no
record because updates are not applied in the forward; a module compiled before wrapping, whose code
may predate the hooks; a buffer added or replaced since the record) the broadcast is waited for at once,
as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from deft.runtime.control import ControlPlane, StateBroadcast, start_broadcast
from deft.runtime.eager import ForwardHooks


class BufferSync:
    """The buffers' broadcast on the control plane's group (module docstring): :meth:`start` it where
    torch DDP broadcasts, :meth:`finish` it (the forward's end); after :meth:`watch`, the first module
    reading a buffer finishes it before it runs."""

    def __init__(self, module: nn.Module, control: ControlPlane) -> None:
        self._module = module
        self._buffers = list(module.buffers())
        self._control = control
        self._pending: StateBroadcast | None = None
        self._wait_at: set[int] = set()  # id() of the hooked modules whose pre-hook waits
        self._handle: RemovableHandle | None = None

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self._buffers

    def watch(self, hooks: ForwardHooks, module: nn.Module, first_reads: Mapping[int, nn.Module]) -> None:
        """From now on, wait in the pre-hook of the module that reads each buffer first (``first_reads``:
        buffer index -> module, recorded over one forward; a buffer absent from it: its owner)."""
        owners = {id(b): m for m in module.modules() for b in m.buffers(recurse=False)}
        self._wait_at = {id(hooks.hooked(first_reads[i] if i in first_reads else owners[id(b)]))
                         for i, b in enumerate(self._buffers)}
        if self._handle is None:
            self._handle = hooks.listen(pre=self._module_begins)

    def start(self) -> None:
        """Launch the broadcast of rank 0's buffers as they are now; waited for at once until :meth:`watch`,
        and for good once the module's buffers are not the ones watched (one added or replaced: where it
        is first read was never recorded)."""
        self.finish()  # a forward that raised left one in flight
        buffers = list(self._module.buffers())
        if [id(b) for b in buffers] != [id(b) for b in self._buffers]:
            self._buffers, self._wait_at = buffers, set()
        self._pending = start_broadcast(self._buffers, self._control.group)
        if not self._wait_at:
            self.finish()

    def finish(self) -> None:
        """Wait for the broadcast in flight, if any, and copy rank 0's values into this rank's buffers."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish("control", "buffers", self._control.rank, self._control.timeout_s)

    def _module_begins(self, m: nn.Module) -> None:
        if self._pending is not None and id(m) in self._wait_at:
            self.finish()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
