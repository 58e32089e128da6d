"""The control plane: deft's own small collectives between ranks, every one bounded in time.

deft exchanges a few things besides gradients: digests that prove the ranks agree (config, model,
schedule), JSON documents (rank 0's schedule and decisions; never pickle), rank 0's parameters and
buffers, the gradient ready order, the observed loss and the profile's max-reduction. They all run
on a CPU gloo *control group* of their own, created with ``config.timeout_s``, so that a dead or
stalled peer fails them within that time instead of hanging.

Invariant: every wait on a collective deft launched goes through :func:`wait_work` (the executor's
too), which turns a failure or a timeout into a :class:`~deft.errors.CommunicationError` naming this
rank, the link and the collective.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeAlias, TypeVar

import torch
import torch.distributed as dist

from deft.errors import CommunicationError, ContractError

#: What a comm hook may return: torch.futures.Future, or the C++ future of ``work.get_future()``.
FUTURE_TYPES = (torch.futures.Future, torch._C.Future)

#: A launched collective deft waits on: a ``Work``, or a future (a comm hook's, or ``work.get_future()``,
#: which is a ``torch._C.Future``; :class:`torch.futures.Future` derives from it).
Collective: TypeAlias = "dist.Work | torch._C.Future[object]"

#: A JSON document the ranks exchange. Every rank's has the same schema (the same code builds it), so
#: the documents received are typed as the one sent; they went through :mod:`json`, so a tuple in it
#: comes back as a list.
JsonDocT = TypeVar("JsonDocT", bound=Mapping[str, object])


def wait_work(work: Collective, link: str, what: str, rank: int, timeout_s: float,
              stream_ordered: bool = False) -> object:
    """Wait for one launched collective (a Work, or a comm hook's Future, whose value is returned); a
    failure or ``timeout_s`` becomes a CommunicationError.

    ``stream_ordered`` (a Work of an NCCL group): only order the current CUDA stream after the
    collective, as torch DDP's reducer does. NCCL's ``Work.wait(timeout)`` would block the host until
    the kernel finished (every wait a device sync, measured on an H100: benchmarks/results/gpu.md);
    the group's own timeout (``timeout_s`` too, :mod:`deft.runtime.links`) and NCCL's watchdog stop a
    rank whose peer died instead.
    """
    try:
        if isinstance(work, FUTURE_TYPES):
            if not work.done() and not future_done_event(work).wait(timeout_s):
                raise TimeoutError(f"not done after {timeout_s:g} s")
            # done, so wait() returns at once; on CUDA it also orders the current stream after the value's
            # events, which value() does not (the gloo + CUDA corruption of pytorch/pytorch#155714)
            return work.wait()
        if stream_ordered:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout_s))
        return None
    except Exception as e:  # gloo/NCCL raise RuntimeError or DistBackendError
        raise CommunicationError(f"rank {rank}: {what} on link {link!r} failed or timed out after at most "
                                 f"{timeout_s:g} s: {e}. A peer rank probably died or stalled; check the other "
                                 "ranks' logs.") from None


def future_done_event(fut: torch._C.Future[object]) -> threading.Event:
    """An Event set when ``fut`` completes (at once if it has), so a wait on it blocks with a timeout.

    A torch Future has no timed wait. Polling ``done()`` with short sleeps woke the waiting thread
    thousands of times a second to take the GIL, which the comm hook's own callbacks (PowerSGD
    compresses on gloo's threads) and the model's compute need on a CPU host; the done-callback wakes
    it once. The callback runs on the thread that completes the future, or here if it is done."""
    event = threading.Event()
    fut.add_done_callback(lambda _: event.set())
    return event


def digest(doc: object) -> str:
    """16 hex digits of the SHA-256 of ``doc`` as canonical JSON."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


class ControlPlane:
    """Agreement checks, JSON broadcast/gather and state broadcast on the control group."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.root = dist.get_global_rank(group, 0)  # rank 0 of the group, as a global rank

    def wait(self, work: Collective, what: str, link: str = "control") -> None:
        wait_work(work, link, what, self.rank, self.timeout_s)

    # -- agreement -------------------------------------------------------------------------------
    def check_agreement(self, what: str, mine: str, doc: Mapping[str, object] | None = None) -> None:
        """All-gather a 16-hex-digit digest; fail naming the ranks that differ from rank 0.

        With ``doc`` (the JSON the digest was made from), a mismatch also gathers the documents and
        names the differing fields (at most five).
        """
        t = torch.tensor(list(mine.encode()[:16].ljust(16, b"-")), dtype=torch.uint8)
        every = [torch.empty_like(t) for _ in range(self.world)]
        self.wait(dist.all_gather(every, t, group=self.group, async_op=True), f"all-gather of the {what} digest")
        digests = [bytes(x.tolist()).decode() for x in every]
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        if not bad:
            return
        detail = ""
        if doc is not None:
            docs = self.all_gather_json(doc, what)
            ref, other = docs[0], docs[bad[0]]
            keys = sorted(k for k in set(ref) | set(other) if ref.get(k) != other.get(k))
            detail = "; " + ", ".join(f"{k}: rank 0 has {ref.get(k)!r}, rank {bad[0]} has {other.get(k)!r}"
                                      for k in keys[:5])
        raise ContractError(f"rank {self.rank}", what,
                            f"rank(s) {bad} differ from rank 0 (digests {[digests[r] for r in bad]} vs "
                            f"{digests[0]}){detail}; every rank must use the same {what}")

    # -- JSON documents (uint8 bytes, length first; never pickle) -----------------------------------
    def all_gather_json(self, doc: JsonDocT, what: str) -> list[JsonDocT]:
        """Every rank's JSON document, in rank order."""
        payload = json.dumps(doc, sort_keys=True, default=str).encode()
        n = torch.tensor([len(payload)], dtype=torch.int64)
        lengths = [torch.empty_like(n) for _ in range(self.world)]
        self.wait(dist.all_gather(lengths, n, group=self.group, async_op=True), f"all-gather of the {what} length")
        size = max(int(x) for x in lengths)
        mine = torch.zeros(size, dtype=torch.uint8)
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        self.wait(dist.all_gather(every, mine, group=self.group, async_op=True), f"all-gather of the {what}")
        return [json.loads(bytes(t[:int(k)].tolist()).decode()) for t, k in zip(every, lengths, strict=True)]

    def broadcast_json(self, doc: JsonDocT, what: str) -> JsonDocT:
        """Rank 0's JSON document on every rank (the others' ``doc`` is ignored)."""
        payload = json.dumps(doc).encode() if self.rank == 0 else b""
        n = torch.tensor([len(payload)], dtype=torch.int64)
        self.wait(dist.broadcast(n, src=self.root, group=self.group, async_op=True), f"broadcast of the {what} length")
        buf = torch.zeros(int(n), dtype=torch.uint8)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.wait(dist.broadcast(buf, src=self.root, group=self.group, async_op=True), f"broadcast of the {what}")
        return json.loads(bytes(buf.tolist()).decode())

    def broadcast_ints(self, values: list[int], what: str) -> list[int]:
        """Rank 0's list of integers (same length on every rank) on every rank."""
        t = torch.tensor(values, dtype=torch.int64)
        self.wait(dist.broadcast(t, src=self.root, group=self.group, async_op=True), f"broadcast of the {what}")
        return [int(i) for i in t.tolist()]

    def mean(self, value: float, what: str) -> float:
        """The mean over ranks of one float (NaN anywhere gives NaN)."""
        t = torch.tensor([value], dtype=torch.float64)
        self.wait(dist.all_reduce(t, group=self.group, async_op=True), f"all-reduce of the {what}")
        return float(t) / self.world

    def max_rows(self, rows: list[list[float]], what: str) -> list[list[float]]:
        """Element-wise maximum over ranks of a float table."""
        t = torch.tensor(rows, dtype=torch.float64)
        self.wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                  f"max-reduce of the {what}")
        return t.tolist()


@dataclass
class StateBroadcast:
    """Rank 0's values of some tensors on their way to every rank (:func:`start_broadcast`): one flat
    broadcast per dtype, launched; :meth:`finish` waits and copies them in."""

    parts: list[tuple[list[torch.Tensor], torch.Tensor, Collective]]  # (tensors, their flat, its broadcast)
    src_rank: bool  # this rank is the group's rank 0: its tensors are the source, nothing to copy in

    def received(self, link: str, what: str, rank: int, timeout_s: float,
                 stream_ordered: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Wait for each broadcast; each tensor with rank 0's value of it (a view of what was received)."""
        for ts, flat, work in self.parts:
            wait_work(work, link, f"broadcast of rank 0's {what} ({flat.dtype})", rank, timeout_s, stream_ordered)
            off = 0
            for t in ts:
                yield t, flat[off:off + t.numel()].view_as(t)
                off += t.numel()

    def finish(self, link: str, what: str, rank: int, timeout_s: float, stream_ordered: bool = False) -> None:
        """Wait for each broadcast and copy rank 0's values into the tensors (rank 0's own: left as they are)."""
        for t, value in self.received(link, what, rank, timeout_s, stream_ordered):
            if not self.src_rank:
                with torch.no_grad():
                    t.copy_(value)


def start_broadcast(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> StateBroadcast:
    """Launch the broadcast of rank 0's values of ``tensors``, one flat per dtype (like torch DDP's): a
    snapshot taken now, so what rank 0's tensors hold later does not change what is sent."""
    src = dist.get_global_rank(group, 0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    parts = []
    with torch.no_grad():
        for dtype, ts in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1) for t in ts]) if ts else torch.empty(0, dtype=dtype)
            parts.append((ts, flat, dist.broadcast(flat, src=src, group=group, async_op=True)))
    return StateBroadcast(parts, dist.get_rank(group) == 0)


def broadcast_state(tensors: list[torch.Tensor], group: dist.ProcessGroup, link: str, rank: int,
                    timeout_s: float, stream_ordered: bool = False, what: str = "parameters/buffers") -> None:
    """Rank 0's values of ``tensors`` everywhere, one flat broadcast per dtype (like torch DDP's)."""
    start_broadcast(tensors, group).finish(link, what, rank, timeout_s, stream_ordered)
