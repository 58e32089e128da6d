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
the broadcast travels. The forward's end waits for whatever is still in flight. Rank 0 never waits
before a module: its buffers are the values sent.

A batch norm in training mode reads its running statistics only to update them, and the update is
affine in the old value: ``r' = (1 - m) r + m s`` (``s`` the batch's statistic, ``m`` its momentum),
``n' = n + 1`` for its count. So where the recorded forward saw no module but the batch norm itself
read them and no hook but deft's is on it (a user's pre-hook would read them first), the other ranks do
not wait: the batch norm updates this rank's values ``r_local``, the
forward's end adds ``(1 - m)^k (r_0 - r_local)`` (``k`` its updates in this forward; ``r_0`` rank 0's
value) and ``n_0 - n_local`` to the count, which is torch DDP's result ``(1 - m)^k r_0 + ...`` up to
rounding (:class:`_CatchUp`). On a slow link the broadcast waits behind the bytes the NIC holds of the
sends a plan defers into the forward (benchmarks/results/buffers_catch_up.md); caught up, no forward
waits for it.

Invariant: every buffer is read and written only after it holds rank 0's values of the forward's start,
as under torch DDP, except a batch norm's running statistics updated in training mode (a forward with
``momentum`` set, this rank's values finite), whose result is corrected to torch DDP's before any other
module the recorded forward saw reading a buffer runs: the snapshot is what torch DDP sends, and no
other module reading a buffer runs before the wait. Where the reads are unknown (the first forward,
whose reads are being recorded; no record because updates are not applied in the forward; a module
compiled before wrapping, whose code may predate the hooks; a buffer added or replaced since the
record) the broadcast is waited for at once, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from deft.runtime.control import ControlPlane, StateBroadcast, start_broadcast
from deft.runtime.eager import ForwardHooks


class _CatchUp:
    """One forward's batch norms updated on this rank's running statistics (module docstring): each
    buffer's value before its first update and the factor ``(1 - m)^k`` its difference from rank 0's
    keeps, applied by :meth:`merge` when rank 0's values arrive."""

    def __init__(self) -> None:
        self.before: dict[int, torch.Tensor] = {}  # id(buffer) -> this rank's value before the forward's update
        self.factor: dict[int, float] = {}  # id(statistic) -> (1 - momentum)^updates (a count keeps all)

    def hold(self, bn: _BatchNorm) -> bool:
        """``bn`` updates its running statistics now: note it; False where they cannot be caught up (not
        in training mode, no ``momentum`` (a cumulative average), this rank's values not finite)."""
        if not (bn.training and bn.track_running_stats and bn.momentum is not None
                and bn.running_mean is not None and bn.running_var is not None):
            return False
        keep = 1.0 - float(bn.momentum)
        stats = (bn.running_mean, bn.running_var)
        if id(bn.running_mean) not in self.before:
            if not all(bool(torch.isfinite(t).all()) for t in stats):
                return False
            for t in (*stats, bn.num_batches_tracked):
                if t is not None:
                    self.before[id(t)] = t.detach().clone()
            self.factor.update((id(t), 1.0) for t in stats)
        for t in stats:
            self.factor[id(t)] *= keep
        return True

    def merge(self, t: torch.Tensor, value: torch.Tensor) -> None:
        """``t`` := rank 0's ``value`` carried through this forward's updates of ``t``.

        Note: autograd saved the running statistics with the batch norm's inputs, and an in-place change
        now would fail the backward's version check; the backward of a batch norm in training mode reads
        only the batch's own statistics, so the change goes through ``.data`` (no version bump)."""
        with torch.no_grad():
            before = self.before.get(id(t))
            if before is None:
                t.copy_(value)
            elif t.is_floating_point():
                t.data.add_(value - before, alpha=self.factor[id(t)])
            else:
                t.data.add_(value - before)


def _catches_up(m: nn.Module) -> bool:
    """``m`` is a batch norm whose forward is torch's own (its reads of its buffers: the update alone)."""
    return isinstance(m, _BatchNorm) and type(m).forward is _BatchNorm.forward


class BufferSync:
    """The buffers' broadcast on the control plane's group (module docstring): :meth:`start` it where
    torch DDP broadcasts, :meth:`finish` it (the forward's end); after :meth:`watch`, the first module
    reading a buffer finishes it before it runs, a batch norm reading only its own is caught up."""

    def __init__(self, module: nn.Module, control: ControlPlane,
                 synced: Callable[[], list[torch.Tensor]] | None = None) -> None:
        self._module = module
        self._synced = synced if synced is not None else lambda: list(module.buffers())  # those that follow rank 0
        self._buffers = self._synced()
        self._control = control
        self._pending: StateBroadcast | None = None
        self._watched = False
        self._wait_at: set[int] = set()  # id() of the hooked modules whose pre-hook waits
        self._bn: set[int] = set()  # id() of the batch norms caught up (each its own hooked module)
        self._caught = _CatchUp()
        self._hooks: ForwardHooks | None = None
        self._handle: RemovableHandle | None = None

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self._buffers

    def watch(self, hooks: ForwardHooks, module: nn.Module, readers: Mapping[int, Sequence[nn.Module]]) -> None:
        """From now on, wait in the pre-hook of the module that reads each buffer first (``readers``:
        buffer index -> the modules reading it over one forward, first reader first; a buffer absent from
        it: its owner), or catch it up where its only reader is its owner, a batch norm."""
        owners = {id(b): m for m in module.modules() for b in m.buffers(recurse=False)}
        self._wait_at, self._bn = set(), set()
        for i, b in enumerate(self._buffers):
            owner = owners[id(b)]
            read = list(readers.get(i, ())) or [owner]
            if _catches_up(owner) and all(m is owner for m in read) and hooks.hooked(owner) is owner:
                self._bn.add(id(owner))
            else:
                self._wait_at.add(id(hooks.hooked(read[0])))
        self._watched, self._hooks = True, hooks
        if self._handle is None:
            self._handle = hooks.listen(pre=self._module_begins)

    def start(self) -> None:
        """Launch the broadcast of rank 0's buffers as they are now; waited for at once until :meth:`watch`,
        and for good once the module's buffers are not the ones watched (one added or replaced: where it
        is read was never recorded)."""
        self.finish()  # a forward that raised left one in flight
        buffers = self._synced()
        if [id(b) for b in buffers] != [id(b) for b in self._buffers]:
            self._buffers, self._wait_at, self._bn, self._watched = buffers, set(), set(), False
        self._pending = start_broadcast(self._buffers, self._control.group)
        if not self._watched:
            self.finish()

    def finish(self) -> None:
        """Wait for the broadcast in flight, if any, and bring rank 0's values into this rank's buffers
        (those of batch norms updated since: carried through the updates, :class:`_CatchUp`)."""
        pending, self._pending = self._pending, None
        caught, self._caught = self._caught, _CatchUp()
        if pending is None:
            return
        for t, value in pending.received("control", "buffers", self._control.rank, self._control.timeout_s):
            if not pending.src_rank:
                caught.merge(t, value)

    def _module_begins(self, m: nn.Module) -> None:
        if self._pending is None or self._pending.src_rank:
            return
        if id(m) in self._wait_at or (id(m) in self._bn and not self._catches_up(cast(_BatchNorm, m))):
            self.finish()

    def _catches_up(self, bn: _BatchNorm) -> bool:
        """``bn``'s update may run on this rank's statistics: no hook of another's sees them before the
        forward's end corrects them, and :meth:`_CatchUp.hold` takes them."""
        return self._hooks is not None and self._hooks.only_ours(bn) and self._caught.hold(bn)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
