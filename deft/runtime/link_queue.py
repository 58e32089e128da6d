"""One send in flight per gloo link (``link_queue = true``): the link's collectives run one after another,
in launch order.

The plan prices a link as a queue (:mod:`deft.solver.simulate`): a send starts when the one before it
on the link has ended, and the one the next forward needs first is launched first, so it ends first.
A gloo process group runs two collectives at once (``ProcessGroupGloo`` starts two worker threads per
transport device): two sends in flight share the NIC, and the first ends about when the second would
have, late for its deadline, while the two together take as long as one after the other.

:func:`serial_gloo_group` restores the queue the plan priced in gloo itself: the link's group is built
with one worker thread, which takes its collectives in the order they were launched. Nothing changes
above the group: a send is still launched at once (an all-reduce, or a comm hook's call, int8's
included), its handle is gloo's own Work, and a send that fails leaves the ones behind it to gloo,
as on any group whose transport failed (:mod:`deft.runtime.failover` judges the link lost).

Invariants:

* Every rank launches a link's sends in the same order (the schedule's), so the collectives match;
  gloo numbers them at launch, whatever its threads.
* The group is a gloo group like any other (``dist.get_backend`` reads ``"gloo"``), bound to its
  link's NIC, with the link's timeout; only its worker threads differ, and the group is checked to
  have exactly one before it is used.

Note [why not a queue in Python]
Launching each send from the completion callback of the one before it gives the same order, but every
launch then waits for the GIL on gloo's thread while the training thread holds it (the forward and
backward on the CPU), and the link idles meanwhile (benchmarks/results/gloo_callbacks.md). A comm
hook's call cannot wait in such a queue either when it numbers its calls (int8's draws and tags follow
the call order).

Note [why torch DDP does not need it]
Torch DDP launches its buckets the same way and gets the same sharing, but waits for all of them at
the step: only the sum of the sends matters to it, and the sum does not change. deft waits for each
bucket where its deadline is (the step, or the forward of its module), so which one ends first does.

Note [how the group is built]
``dist.new_group`` builds a gloo backend with ``ProcessGroupGloo(store, rank, size, timeout=...)``,
whose two threads per device are fixed in C++; the constructor that takes ``ProcessGroupGloo._Options``
(threads, devices, timeout) is not reachable through ``new_group`` (gloo ignores ``pg_options``). So for
the one call, the name ``ProcessGroupGloo`` in ``torch.distributed.distributed_c10d`` is a subclass
that builds its options from the same inputs (``GLOO_SOCKET_IFNAME``'s devices, the timeout) with one
thread; everything else ``new_group`` does (the store's prefix, the group's registration, its sequence
numbers) is torch's own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from deft.errors import DeftError
from deft.netif import new_group_on_nic

#: gloo worker threads of a serial link's group: one, so its collectives run in launch order
SERIAL_THREADS = 1

_building = threading.Lock()  # one group built with the name replaced at a time


def serial_gloo_group(ifname: str | None, timeout_s: float, ranks: Sequence[int] | None) -> dist.ProcessGroup:
    """A gloo group over ``ranks`` (None: every rank) on NIC ``ifname``, with the link's timeout, whose
    collectives run one at a time in launch order (module docstring). Collective, as ``dist.new_group``."""
    with _building, _one_thread_gloo():
        group = new_group_on_nic("gloo", ifname, timeout_s, ranks)
    if group == dist.GroupMember.NON_GROUP_MEMBER:  # this rank is not in it: nothing runs here
        return group
    threads = worker_threads(group)
    if dist.get_backend(group) != "gloo" or threads != SERIAL_THREADS:
        raise DeftError(f"link_queue: torch {torch.__version__} built the link's gloo group with {threads} "
                        f"worker threads, expected {SERIAL_THREADS}; set link_queue = false")
    return group


def worker_threads(group: dist.ProcessGroup) -> int | None:
    """The gloo worker threads of ``group``'s CPU backend (None: its backend does not say)."""
    options = getattr(group._get_backend(torch.device("cpu")), "options", None)
    return int(options._threads) if options is not None else None


@contextmanager
def _one_thread_gloo() -> Iterator[None]:
    """``ProcessGroupGloo`` as ``dist.new_group`` calls it, building its backend with one worker thread
    (Note [how the group is built])."""
    real = c10d.ProcessGroupGloo

    class OneThreadGloo(real):  # type: ignore[misc,valid-type]
        def __init__(self, store: dist.Store, rank: int, size: int,
                     timeout: timedelta = timedelta(seconds=1800)) -> None:
            options = real._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            names = os.environ.get("GLOO_SOCKET_IFNAME")  # as the timeout constructor reads it
            options._devices = ([real.create_device(interface=n) for n in names.split(",")] if names
                                else [real.create_default_device()])
            options._threads = SERIAL_THREADS
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneThreadGloo  # type: ignore[misc]
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = real  # type: ignore[misc]
