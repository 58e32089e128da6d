"""A hierarchical all-reduce for several ranks per host: reduce inside the host, all-reduce across
hosts, broadcast inside the host.

With ``M`` ranks on each of ``H`` hosts (``N = H M``), gloo's flat ring sends ``2 (N - 1) / N`` of the
bytes from every rank, and every host's NIC carries the ring's hop to the next host: ``1.5 S`` per
host for an all-reduce of ``S`` bytes at ``2 x 2``. Ranks of one host reach each other at the host's
own address, which the kernel routes over the loopback, so traffic inside a host costs no NIC time.
The hierarchical all-reduce of ``x`` (``x_r`` on rank ``r``, ``L(h)`` the leader, rank ``h M``):

1. ``reduce`` to ``L(h)`` on the host's group:     ``y_h = sum over the host's ranks of x_r``;
2. ``all_reduce`` on the leaders' group (the NIC):  ``z = sum_h y_h``, bit-identical on every leader;
3. ``broadcast`` from ``L(h)`` on the host's group: every rank holds ``z``.

Every host's NIC carries ``2 (H - 1) / H S`` (gloo's ring among the ``H`` leaders): ``S`` at ``H = 2``.
The result is the SUM over all ``N`` ranks, the same bits on every rank (each step's result is
computed in one place and copied); the sum's order differs from the flat ring's, so the two agree
bit-for-bit only where the sums are exact (integers in floating point) and to rounding elsewhere.

Note: leader-only rather than sharded. The sharded form (each local rank ``l`` all-reduces shard
``l`` across hosts, then an all-gather inside the host) carries the same bytes over each NIC; on the
testbed at 2 x 2 it was no faster (benchmarks/results/peers_hosts.md, "Where the bytes go with
several ranks per host"), and it needs ``M`` cross-host groups per link and padding for sizes not
divisible by ``M``. gloo's ``reduce_scatter`` has no future (``Work::getFuture not implemented``), so
a sharded reduction inside the host would be ``M`` reduces or a full all-reduce anyway.

Note: ordering. gloo matches a group's collectives by the order they were issued. Step 1 is issued by
the caller, in call order; steps 2 and 3 are issued from the completion callbacks of the step before,
on gloo's threads, where two all-reduces in flight may complete in either order on different ranks.
So each later step goes through an :class:`InOrder` that issues it in call order, and step 3 runs on a
second group of the host's ranks: on the first, a later call's step 1 (issued by the caller) could
otherwise pass an earlier call's step 3 on one rank and not on another. This is the chaining torch's
PowerSGD hook does (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py), kept in order.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from deft.netif import new_group_on_nic
from deft.runtime.control import future_done_event

log = logging.getLogger("deft.runtime")

#: torchrun's variables for one rank: ranks per host, this rank's index on its host, its host's index.
LAYOUT_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")


@dataclass(frozen=True)
class HostLayout:
    """``hosts`` hosts of ``per_host`` ranks each, host-major (rank ``h * per_host + l``), as torchrun lays
    them out."""

    hosts: int
    per_host: int

    @property
    def hierarchical(self) -> bool:
        """Whether the layout has both traffic inside hosts and traffic across them."""
        return self.hosts > 1 and self.per_host > 1

    def host_ranks(self, h: int) -> list[int]:
        return [h * self.per_host + j for j in range(self.per_host)]

    @property
    def leaders(self) -> list[int]:
        return [h * self.per_host for h in range(self.hosts)]


def env_row(env: Mapping[str, str]) -> tuple[int, int, int]:
    """This rank's ``(LOCAL_WORLD_SIZE, LOCAL_RANK, GROUP_RANK)``; ``(-1, -1, -1)`` when one is missing or
    not an integer."""
    try:
        a, b, c = (int(env[k]) for k in LAYOUT_VARIABLES)
    except (KeyError, ValueError):
        return (-1, -1, -1)
    return (a, b, c)


def layout_of(rows: Sequence[Sequence[int]]) -> tuple[HostLayout | None, str]:
    """The layout every rank's ``env_row`` (``rows[r]`` of rank ``r``) describes, or None and why not.

    Regular means: every rank names the same ``M`` ranks per host, ``N`` is a multiple of ``M``, and
    rank ``r`` is local rank ``r mod M`` of host ``r // M``. Anything else (a variable missing on some
    rank, hosts of different sizes, ranks not host-major) is not guessed at: the caller stays flat."""
    n = len(rows)
    if n == 0:
        return None, "no ranks"
    missing = [r for r, row in enumerate(rows) if tuple(row) == (-1, -1, -1)]
    if missing:
        return None, f"rank(s) {missing} lack torchrun's {'/'.join(LAYOUT_VARIABLES)}"
    sizes = sorted({int(row[0]) for row in rows})
    if len(sizes) != 1:
        return None, f"hosts of different sizes (LOCAL_WORLD_SIZE {sizes})"
    m = sizes[0]
    if m < 1 or n % m:
        return None, f"{n} ranks do not split into hosts of {m}"
    for r, row in enumerate(rows):
        if (int(row[1]), int(row[2])) != (r % m, r // m):
            return None, (f"rank {r} is local rank {row[1]} of host {row[2]}, not {r % m} of {r // m}: "
                          "ranks are not laid out host-major")
    return HostLayout(hosts=n // m, per_host=m), ""


def gather_layout(group: dist.ProcessGroup, env: Mapping[str, str], timeout_s: float) -> tuple[HostLayout | None,
                                                                                              str]:
    """Collective on ``group`` (a CPU gloo group of every rank, in rank order): every rank's ``env_row``
    gathered, so that every rank decides from the same rows."""
    mine = torch.tensor(env_row(env), dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    assert work is not None
    work.wait(timeout=timedelta(seconds=timeout_s))
    return layout_of([[int(v) for v in row.tolist()] for row in rows])


class InOrder:
    """Runs launches in ticket order, whatever the order they become ready in: ``ready(i, launch)``
    runs ``launch`` (None: nothing, the ticket is skipped) once every ticket before ``i`` has run.

    One thread at a time runs the launches, with no lock held (a launch's callbacks may make tickets
    ready here or in another :class:`InOrder`, on any thread, without a lock-order deadlock): a thread
    that finds another running leaves its launch to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._ready: dict[int, Callable[[], None] | None] = {}
        self._running = False

    def ready(self, ticket: int, launch: Callable[[], None] | None) -> None:
        with self._lock:
            self._ready[ticket] = launch
            if self._running:
                return
            self._running = True
        while True:
            with self._lock:
                if self._next not in self._ready:
                    self._running = False
                    return
                run = self._ready.pop(self._next)
                self._next += 1
            if run is not None:
                run()


class HierarchicalWork(dist.Work):
    """The handle of one hierarchical all-reduce: a ``dist.Work`` over its future, so that the runtime
    waits on it as on a flat all-reduce's (``wait(timeout)``, ``is_completed``, ``get_future``)."""

    def __init__(self, future: torch.futures.Future[list[torch.Tensor]]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        waited = timeout is None or self._future.done() or future_done_event(self._future).wait(timeout.total_seconds())
        if not waited:
            assert timeout is not None
            raise TimeoutError(f"hierarchical all-reduce not done after {timeout.total_seconds():g} s")
        self._future.wait()  # raises the collective's error
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future


@dataclass
class HierarchyGroups:
    """One rank's groups of one link: its host's two (reduce, broadcast) and the leaders' (None on the
    other ranks)."""

    layout: HostLayout
    rank: int
    reduce: dist.ProcessGroup
    broadcast: dist.ProcessGroup
    leaders: dist.ProcessGroup | None

    @property
    def leader(self) -> int:
        return self.rank - self.rank % self.layout.per_host


def make_hierarchy_groups(layout: HostLayout, backend: str, ifname: str | None, timeout_s: float) -> HierarchyGroups:
    """Collective over the world: every rank creates every host's two groups, then the leaders' group,
    in the same order (``dist.new_group`` is collective), all bound to the link's NIC: ranks of one host
    reach each other at its address over the loopback, so only the leaders' group crosses the NIC."""
    rank = dist.get_rank()
    mine: list[dist.ProcessGroup] = []
    for h in range(layout.hosts):
        pair = [new_group_on_nic(backend, ifname, timeout_s, layout.host_ranks(h)) for _ in range(2)]
        if rank in layout.host_ranks(h):
            mine = pair
    leaders = new_group_on_nic(backend, ifname, timeout_s, layout.leaders)
    return HierarchyGroups(layout, rank, mine[0], mine[1], leaders if rank in layout.leaders else None)


class HierarchicalAllReduce:
    """``(tensor) -> HierarchicalWork``: the asynchronous in-place SUM all-reduce of the module docstring
    on one link's :class:`HierarchyGroups`. Calls must be made in the same order on every rank."""

    def __init__(self, groups: HierarchyGroups) -> None:
        self.groups = groups
        self._tickets = itertools.count()
        self._lock = threading.Lock()
        self._across = InOrder()
        self._inside = InOrder()

    def __call__(self, tensor: torch.Tensor) -> HierarchicalWork:
        out: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        g = self.groups
        later = [self._across, self._inside] if g.leaders is not None else [self._inside]
        with self._lock:  # the ticket and step 1 together: call order is issue order
            ticket = next(self._tickets)
            try:
                first = dist.reduce(tensor, dst=g.leader, group=g.reduce, async_op=True)
                failed = None
            except Exception as e:
                first, failed = None, e
        if failed is not None:
            self._fail(ticket, out, failed, later)
            return HierarchicalWork(out)

        def broadcast() -> None:
            self._then(lambda: dist.broadcast(tensor, src=g.leader, group=g.broadcast, async_op=True), ticket, out,
                       lambda: out.set_result([tensor]), [])

        def across() -> None:
            self._then(lambda: dist.all_reduce(tensor, group=g.leaders, async_op=True), ticket, out,
                       lambda: self._inside.ready(ticket, broadcast), [self._inside])

        self._then(lambda: first, ticket, out,
                   lambda: later[0].ready(ticket, across if g.leaders is not None else broadcast), later)
        return HierarchicalWork(out)

    def _then(self, launch: Callable[[], dist.Work | None], ticket: int, out: torch.futures.Future[list[torch.Tensor]],
              next_step: Callable[[], None], skip: list[InOrder]) -> None:
        """``launch()`` a step and, when it completes, ``next_step``; if either fails, the error goes on
        ``out`` and this ticket is skipped in the later steps' ``skip`` (the calls after it still run, in
        order)."""
        def done(f: torch.futures.Future[object]) -> None:
            try:
                f.value()
            except Exception as e:
                self._fail(ticket, out, e, skip)
                return
            next_step()
        try:
            work = launch()
            assert work is not None
            work.get_future().add_done_callback(done)
        except Exception as e:
            self._fail(ticket, out, e, skip)

    @staticmethod
    def _fail(ticket: int, out: torch.futures.Future[list[torch.Tensor]], e: Exception, skip: list[InOrder]) -> None:
        if not out.done():
            out.set_exception(e)  # type: ignore[arg-type]  # torch types the exception as the value type
        for step in skip:
            step.ready(ticket, None)
