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
the caller, in call order; steps 2 and 3 are issued when the step before completes, where two
all-reduces in flight may complete in either order on different ranks.
So each later step goes through an :class:`InOrder` that issues it in call order, and step 3 runs on a
second group of the host's ranks: on the first, a later call's step 1 (issued by the caller) could
otherwise pass an earlier call's step 3 on one rank and not on another. This is the chaining torch's
PowerSGD hook does (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py), kept in order.
A step's completion is learnt by a thread per step waiting on its futures in issue order
(:class:`deft.runtime.completions.Completions`), not by a callback on gloo's thread, which would hold
the group until it has the GIL; the waits in issue order cost nothing, as every step is issued in call
order anyway.

Note: a lost link. A dead NIC fails (or stalls) step 2 on the leaders only; the host's other ranks wait
in step 3 for a broadcast that does not come, on groups that never fail (their traffic is on the
loopback). The runtime bounds their wait as the leaders' (the link's deadline, or ``timeout_s`` on the
primary link) and the ranks agree the link is lost (:mod:`deft.runtime.failover`). A broadcast left
pending would fail only when the leader's process exits, on the other ranks' gloo threads during their
interpreter's shutdown, which can crash them. So the leader owes step 3 of every call, in call order
(:class:`LeaderBroadcasts`), and :meth:`HierarchicalAllReduce.release` sends what it owes once the link
is lost: every rank drops a lost link's results, so what the broadcasts carry is never read.
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
from deft.runtime.completions import Completions
from deft.runtime.control import future_done_event
from deft.runtime.link_queue import serial_gloo_group

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
    waits on it as on a flat all-reduce's (``wait(timeout)``, ``is_completed``, ``get_future``).
    ``step``: the step it is in, which a wait that runs out names (:class:`HierarchicalAllReduce`)."""

    def __init__(self, future: torch.futures.Future[list[torch.Tensor]], step: list[str] | None = None) -> None:
        super().__init__()
        self._future = future
        self._step = step if step is not None else []

    def wait(self, timeout: timedelta | None = None) -> bool:
        waited = timeout is None or self._future.done() or future_done_event(self._future).wait(timeout.total_seconds())
        if not waited:
            assert timeout is not None
            at = f", {self.step}" if self.step else ""
            raise TimeoutError(f"hierarchical all-reduce not done after {timeout.total_seconds():g} s{at}")
        self._future.wait()  # raises the collective's error
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    @property
    def step(self) -> str:
        """The step it is in (empty before the first), for a message that it is late."""
        return self._step[-1] if self._step else ""

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

    def held(self) -> list[dist.ProcessGroup]:
        """The groups this rank's steps run on."""
        return [self.reduce, self.broadcast, *([] if self.leaders is None else [self.leaders])]


def make_hierarchy_groups(layout: HostLayout, backend: str, ifname: str | None, timeout_s: float,
                          serial: bool = False) -> HierarchyGroups:
    """Collective over the world: every rank creates every host's two groups, then the leaders' group,
    in the same order (``dist.new_group`` is collective), all bound to the link's NIC: ranks of one host
    reach each other at its address over the loopback, so only the leaders' group crosses the NIC.
    ``serial`` (``link_queue``): the leaders' group runs one step 2 at a time, in the order
    :class:`InOrder` issues them (:mod:`deft.runtime.link_queue`)."""
    rank = dist.get_rank()
    mine: list[dist.ProcessGroup] = []
    for h in range(layout.hosts):
        pair = [new_group_on_nic(backend, ifname, timeout_s, layout.host_ranks(h)) for _ in range(2)]
        if rank in layout.host_ranks(h):
            mine = pair
    leaders = (serial_gloo_group(ifname, timeout_s, layout.leaders) if serial
               else new_group_on_nic(backend, ifname, timeout_s, layout.leaders))
    return HierarchyGroups(layout, rank, mine[0], mine[1], leaders if rank in layout.leaders else None)


class LeaderBroadcasts:
    """The host's first rank's step 3 of every call, in ticket order: the broadcast the host's other ranks
    wait for. ``owe`` when the call is made, ``send`` when its step 2 completed (in ticket order).

    A call whose step 2 failed is ``stuck``: the others still wait for its broadcast, so it and every later
    call stay owed, unsent (a later call's broadcast sent first would be matched to it, sizes and all).
    :meth:`release` sends every owed broadcast, of whatever its buffer holds, in order: the host's other
    ranks' waits then end, their results unused (module docstring, Note on a lost link)."""

    def __init__(self, groups: HierarchyGroups) -> None:
        self._groups = groups
        self._lock = threading.Lock()
        self._owed: dict[int, torch.Tensor] = {}
        self._stuck = False
        self._released = False

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        work = dist.broadcast(tensor, src=self._groups.leader, group=self._groups.broadcast, async_op=True)
        assert work is not None
        return work

    def owe(self, ticket: int, tensor: torch.Tensor) -> None:
        with self._lock:
            self._owed[ticket] = tensor

    def forget(self, ticket: int) -> None:
        """Step 1 failed: the host's other ranks skip this call's step 3 too."""
        with self._lock:
            self._owed.pop(ticket, None)

    def stick(self) -> None:
        with self._lock:
            self._stuck = True

    def send(self, ticket: int) -> dist.Work:
        with self._lock:
            if self._stuck or self._released:
                why = "the link is lost" if self._released else "an earlier call's step 2 failed on this link"
                raise RuntimeError(f"step 3 not sent: {why}")
            return self._broadcast(self._owed.pop(ticket))

    def release(self) -> None:
        with self._lock:
            self._released = True
            for ticket in sorted(self._owed):
                self._broadcast(self._owed.pop(ticket))


class HierarchicalAllReduce:
    """``(tensor) -> HierarchicalWork``: the asynchronous in-place SUM all-reduce of the module docstring
    on one link's :class:`HierarchyGroups`. Calls must be made in the same order on every rank."""

    def __init__(self, groups: HierarchyGroups) -> None:
        self.groups = groups
        self._tickets = itertools.count()
        self._lock = threading.Lock()
        self._across = InOrder()
        self._inside = InOrder()
        self._sends = LeaderBroadcasts(groups) if groups.leaders is not None else None
        self._ended = Completions()  # a thread per step issues the next (module docstring, Note on ordering)

    def release(self) -> None:
        """The link is lost on every rank (:mod:`deft.runtime.failover`) and no call follows: on the host's
        first rank, every broadcast the host's other ranks still wait for is sent (module docstring, Note
        on a lost link)."""
        if self._sends is not None:
            self._sends.release()

    def __call__(self, tensor: torch.Tensor) -> HierarchicalWork:
        out: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        g, sends = self.groups, self._sends
        step = [f"in step 1 (reduce to rank {g.leader}, the host's first rank)"]  # the last: where it is
        with self._lock:  # the ticket and step 1 together: call order is issue order
            ticket = next(self._tickets)
            if sends is not None:
                sends.owe(ticket, tensor)
            try:
                first = dist.reduce(tensor, dst=g.leader, group=g.reduce, async_op=True)
                failed = None
            except Exception as e:
                first, failed = None, e
        if sends is None:
            later: list[tuple[InOrder, Callable[[], None] | None]] = [(self._inside, None)]
        else:
            later = [(self._across, None), (self._inside, lambda: sends.forget(ticket))]
        if failed is not None:
            self._fail(ticket, out, failed, later)
            return HierarchicalWork(out, step)

        def broadcast() -> None:
            step.append("in step 3 (broadcast inside the host)" if sends is not None else
                        f"in step 3 (waiting for rank {g.leader}, the host's first rank, to broadcast the sum of "
                        "its step across the hosts)")
            self._then("broadcast", lambda: dist.broadcast(tensor, src=g.leader, group=g.broadcast, async_op=True)
                       if sends is None else sends.send(ticket), ticket, out, lambda: out.set_result([tensor]), [])

        def across() -> None:
            assert sends is not None
            step.append("in step 2 (all-reduce across the hosts' first ranks)")
            self._then("across", lambda: dist.all_reduce(tensor, group=g.leaders, async_op=True), ticket, out,
                       lambda: queued(3, self._inside, broadcast), [(self._inside, sends.stick)])

        def queued(n: int, order: InOrder, launch: Callable[[], None]) -> None:
            step.append(f"step {n} queued behind an earlier all-reduce's")
            order.ready(ticket, launch)

        self._then("reduce", lambda: first, ticket, out,
                   lambda: queued(2, self._across, across) if sends is not None else
                   queued(3, self._inside, broadcast), later)
        return HierarchicalWork(out, step)

    def _then(self, on: str, launch: Callable[[], dist.Work | None], ticket: int,
              out: torch.futures.Future[list[torch.Tensor]], next_step: Callable[[], None],
              skip: list[tuple[InOrder, Callable[[], None] | None]]) -> None:
        """``launch()`` a step (``on``: "reduce", "across" or "broadcast") and, when it completes,
        ``next_step``; if either fails, the error goes on ``out`` and this ticket runs its ``skip`` launch
        (None: nothing) in place of the later steps (the calls after it still run, in order)."""
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
            fut = work.get_future()
            self._ended.watch(on, fut, then=lambda: done(fut))
        except Exception as e:
            self._fail(ticket, out, e, skip)

    @staticmethod
    def _fail(ticket: int, out: torch.futures.Future[list[torch.Tensor]], e: Exception,
              skip: list[tuple[InOrder, Callable[[], None] | None]]) -> None:
        if not out.done():
            out.set_exception(e)  # type: ignore[arg-type]  # torch types the exception as the value type
        for step, instead in skip:
            step.ready(ticket, instead)
