"""deft's 8-bit codec as a torch DDP comm hook: block-scaled, stochastically rounded; all-gathered, or
reduce-scattered then all-gathered where that puts fewer bytes on the wire.

The rounding
------------
A tensor ``x`` is cut into blocks of :data:`BLOCK` elements (the last one padded with zeros). Block ``k``
gets the scale ``s_k = max_{i in k} |x_i| / 127`` and every element is sent as the integer

    q_i = clamp(floor(x_i / s_k + U_i), -127, 127),    U ~ Uniform[0, 1) from the rank's generator,

(a block of zeros: ``s_k = 0``, ``q = 0``): ``E[s q] = x`` exactly, ``Var(s q) = s² p (1 - p) <= s² / 4``,
``p`` the fractional part. A payload is the ``q`` (int8) followed by the scales' float32 bytes.

The gather path (:func:`int8_compress_hook` where it is cheaper, always at two ranks)
------------------------------------------------------------------------------------
Rank ``r`` rounds its bucket ``g_r`` (``n`` elements) with the draws ``torch.rand(padded)`` of its
generator; the ranks all-gather every rank's payload and every rank decodes the same average

    ĝ_i = (sum_r s_{r,k(i)} q_{r,i}) / R      (summed in rank order, float32)

from the same bytes, so the ranks agree bit for bit. On gloo the payload is all-gathered in equal pieces
of about :data:`GATHER_PIECE` bytes, issued together in the call (the same bytes, in one future), and
decoded on the state's thread for the group, which waits for the pieces' Works, not in a callback on
their futures: that would run on gloo's worker thread, which waits there for the GIL while the training
thread holds it, and the link's next collective waits behind it. (Taking a gloo all-gather's future at
all does that: on its completion gloo's thread waits for the GIL, an all-reduce's does not;
``tests/test_int8_hook.py`` holds the GIL and watches the link's next send.)
``ĝ`` is unbiased for ``ḡ = mean_r g_r`` and the ranks' draws are independent, so

    E|ĝ - ḡ|² <= (1 / (4 R²)) sum_r sum_k n_k s_{r,k}² = P / (4 · 127² · R),

``P = mean_r sum_k n_k max_{i in k} g_{r,i}²`` (``n_k`` the block's elements), what :func:`block_maxima`
measures; the preserver judges ``P`` against the gradient's noise (:mod:`deft.preserver.codec_error`).

The scatter path (gloo, CPU buffers, three ranks or more, where it is cheaper)
------------------------------------------------------------------------------
The ``nb = ceil(n / BLOCK)`` blocks are padded with zero blocks to ``R c`` blocks, ``c = ceil(nb / R)``,
and chunk ``j`` is blocks ``j c .. (j + 1) c - 1``. Rank ``r`` rounds all of them with the draws
``torch.rand(R c BLOCK)`` of its generator; an all-to-all gives rank ``j`` chunk ``j`` of every rank,
which it decodes and averages in rank order (float32), as the gather path does,

    a_i = (sum_r s_{r,k(i)} q_{r,i}) / R,

and rounds again, with the next draws ``torch.rand(c BLOCK)`` of the same generator, to ``(t, q')``
(``t_k = max_{i in k} |a_i| / 127``). The ranks exchange these chunks (gloo point-to-point sends, tagged
with the call's number) and every rank decodes ``ĝ_i = t_{k(i)} q'_i`` from the same bytes: bit for bit
the same everywhere, the chunk's owner included. Two roundings, both unbiased: ``e = e1 + e2`` with
``e1 = a - ḡ`` (the first, bounded as above) and ``e2 = ĝ - a``, unbiased given ``a`` (so uncorrelated
with ``e1``) with ``E[|e2|² | a] <= sum_k n_k t_k² / 4``. Every ``|s_{r,k} q_{r,i}| <= max_{i in k}
|g_{r,i}|``, so ``max_{i in k} |a_i| <= mean_r max_{i in k} |g_{r,i}|`` and, by Jensen,
``sum_k n_k max_{i in k} a_i² <= P``:

    E|ĝ - ḡ|² <= P / (4 · 127² · R) + P / (4 · 127²) = (R + 1) P / (4 · 127² · R),

``R + 1`` times the gather path's bound: the second rounding is of the average, which no averaging
shrinks. The preserver charges it at every world size where this path may run
(:func:`deft.preserver.codec_error.int8_rounding_factor`).

Bytes (:mod:`deft.runtime.codecs.wire`): a ring all-gather sends ``(R - 1) m`` bytes per rank
(``m = nb (BLOCK + 4)``), as a ring all-reduce of ``R m / 2`` bytes does: half of fp16's ``2 n`` at two
ranks, as much at four, more beyond. The scatter path sends ``2 (R - 1) c (BLOCK + 4)`` per rank, an
all-reduce of ``R c (BLOCK + 4)``, about ``n`` bytes at every ``R``: a quarter of float32's. The hook
takes, bucket by bucket, the path with fewer bytes (:func:`uses_scatter`; a tie goes to the gather path,
one rounding): never the scatter path at two ranks, where both send ``m``.

Non-finite gradients (an fp16 overflow under a GradScaler) stay non-finite on either path: a block
holding ``inf`` or ``nan`` has a non-finite scale and decodes to ``nan`` on every rank (on the scatter
path its average, then its second scale, are ``nan``), so the scaler's check skips the step as it would
after the exact all-reduce. A block of zeros decodes to zeros exactly.

State: a seed and the number of calls, the same on every rank; each call's draws come from a generator
seeded by ``(seed, calls, rank)`` (:meth:`Int8State.generator`), so ranks draw independently, runs
repeat, and a checkpoint (:meth:`Int8State.state_dict`) resumes the rounding of the uninterrupted run
on every rank.

Note (why point-to-point, and a thread): the second exchange can only start once the all-to-all's
chunks are in. Started from the all-to-all's callback on the same group, it would be issued on each rank
at a moment of its own, between the collectives the training thread issues there (other buckets'
all-reduces), and gloo matches collectives by the order they are issued. gloo's point-to-point sends
are matched by their tag instead, so a thread of the state's (:class:`Int8State`), one per group, runs
the group's second exchanges, in call order, without waiting on the training thread. deft's links share
one state, each link on its own group: their exchanges overlap, as their all-reduces do.
"""

# No ``from __future__ import annotations``: torch DDP's register_comm_hook reads the hook's annotations
# as objects (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``) and refuses strings.
import math
import queue
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

#: Elements per scale: 4 bytes of scale per 256 bytes of data (1.6 %).
BLOCK = 256
#: The largest magnitude sent: ``q`` in ``[-LEVELS, LEVELS]``.
LEVELS = 127
#: The scatter path's point-to-point tags: the call's number modulo this, plus one.
TAGS = 2 ** 24
#: On gloo the gather path all-gathers a payload in equal pieces of about this many bytes, issued together
#: in the call: on a shaped link one all-gather of a 1-2 MB payload ran 1.3-1.45x as long as an all-reduce of
#: as many bytes, pieces of this size as long (benchmarks/results/codec_paths.md, "the gather path").
GATHER_PIECE = 2 ** 18


class Int8State:
    """The hook's state: the process group (set by deft per link), the seed and the calls so far, and
    a thread per process group that runs the scatter path's second exchanges on it and decodes the
    gather path's pieces on gloo (started at the group's first use).

    Call ``c`` on rank ``r`` draws from a generator seeded by ``(seed, c, r)``, so the state is the same
    on every rank (every rank calls the hook for the same buckets) and a checkpoint saved on one rank
    resumes every rank's stream, each with its own draws."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, seed: int = 0) -> None:
        self.process_group = process_group
        self.seed = seed
        self.calls = 0
        self._jobs: dict[object, queue.SimpleQueue[Callable[[], None]]] = {}

    def generator(self, calls: int, rank: int, device: torch.device) -> torch.Generator:
        """The generator of call ``calls`` on rank ``rank`` (module docstring)."""
        mixed = (self.seed * 0x9E3779B97F4A7C15 + calls * 0xBF58476D1CE4E5B9 + rank * 0x94D049BB133111EB) % 2 ** 63
        return torch.Generator(device=device).manual_seed(mixed)

    def rng(self, device: torch.device) -> torch.Generator:
        """The generator of the next call on this rank (counts the call)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.calls += 1
        return self.generator(self.calls - 1, rank, device)

    def submit(self, job: Callable[[], None], group: object = None) -> None:
        """Run ``job`` on ``group``'s thread, after the jobs submitted for ``group`` before it. One thread per
        group: a group's exchanges go in call order, and the links' groups do not wait on each other (one
        state serves every link's buckets; a single thread would run the links' exchanges one at a time).
        Called from the thread that calls the hook, as the hook is."""
        jobs = self._jobs.get(group)
        if jobs is None:
            jobs = self._jobs[group] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs,), name=f"deft-int8-{len(self._jobs)}", daemon=True).start()
        jobs.put(job)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, doc: dict[str, object]) -> None:
        seed, calls = doc.get("seed"), doc.get("calls")
        if not isinstance(seed, int) or not isinstance(calls, int) or calls < 0:
            raise TypeError(f"expected {{'seed': int, 'calls': int >= 0}}, got {doc!r}")
        self.seed, self.calls = seed, calls


def _serve(jobs: "queue.SimpleQueue[Callable[[], None]]") -> None:
    while True:
        jobs.get()()


def padded_numel(n: int) -> int:
    """Elements sent for a bucket of ``n``: whole blocks."""
    return math.ceil(n / BLOCK) * BLOCK


def payload_nbytes(n: int) -> int:
    """``m``: the int8 payload of one rank for a bucket of ``n`` elements (data and float32 scales)."""
    return padded_numel(n) + 4 * (padded_numel(n) // BLOCK)


def chunk_blocks(n: int, world: int) -> int:
    """``c``: the blocks of each rank's chunk on the scatter path."""
    return math.ceil(math.ceil(n / BLOCK) / world)


def gather_nbytes(n: int, world: int) -> int:
    """The bytes of the all-reduce that costs what the gather path's all-gather costs (``R m / 2``)."""
    return math.ceil(world * payload_nbytes(n) / 2)


def scatter_nbytes(n: int, world: int) -> int:
    """The bytes of the all-reduce that costs what the scatter path's two exchanges cost (``R c (BLOCK + 4)``)."""
    return world * chunk_blocks(n, world) * (BLOCK + 4)


def uses_scatter(n: int, world: int, scatter_ok: bool = True) -> bool:
    """Whether a bucket of ``n`` elements goes by the scatter path: where it may run (``scatter_ok``:
    gloo and CPU buffers, :func:`scatter_supported`) and it sends fewer bytes than the gather path."""
    return scatter_ok and world >= 3 and scatter_nbytes(n, world) < gather_nbytes(n, world)


def scatter_supported(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether the scatter path may run on ``group`` for buffers on ``device``: gloo's tagged
    point-to-point sends on CPU tensors (module docstring, Note)."""
    return device.type == "cpu" and dist.is_initialized() and dist.get_backend(group) == "gloo"


def block_maxima(x: torch.Tensor) -> torch.Tensor:
    """``max_{i in k} |x_i|`` of each block ``k`` of the flat ``x`` (float32), without a padded copy.
    ``BLOCK`` times the sum of their squares bounds the error (``P`` for one rank, counting the last
    block as whole: its padding's zeros are sent exactly, so that overstates, never understates)."""
    flat = x.reshape(-1)
    whole = flat.numel() // BLOCK * BLOCK
    parts = []
    if whole:
        parts.append(flat[:whole].view(-1, BLOCK).abs().amax(1))
    if whole < flat.numel():
        parts.append(flat[whole:].abs().amax().reshape(1))
    return torch.cat(parts).float() if parts else flat.new_zeros(0, dtype=torch.float32)


def encode(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One rank's payload: the rounded blocks (int8), then the blocks' float32 scales as int8 bytes.
    (A non-finite block's ``q`` is whatever the cast makes of NaN: its scale makes it NaN when decoded.)"""
    flat = x.reshape(-1).float()
    n = flat.numel()
    padded, whole = padded_numel(n), n // BLOCK * BLOCK
    scale = block_maxima(flat) / LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a block of zeros sends zeros
    q = torch.empty(padded, dtype=torch.float32, device=flat.device)
    if whole:
        torch.div(flat[:whole].view(-1, BLOCK), safe[:whole // BLOCK, None], out=q[:whole].view(-1, BLOCK))
    if whole < n:
        torch.div(flat[whole:], safe[-1], out=q[whole:n])
    q[n:] = 0.0
    # clamp: x / s may exceed 127 by a rounding of the division
    q.add_(torch.rand(padded, generator=generator, device=flat.device)).floor_().clamp_(-LEVELS, LEVELS)
    return torch.cat([q.to(torch.int8), scale.view(torch.int8)])


def decode(payloads: list[torch.Tensor], n: int) -> torch.Tensor:
    """``(1 / R) sum_r s_r q_r`` over the gathered payloads, in rank order (float32, ``n`` elements)."""
    data = padded_numel(n)
    total = torch.zeros(data // BLOCK, BLOCK, dtype=torch.float32, device=payloads[0].device)
    for p in payloads:
        scale = p[data:].view(torch.float32)
        total.add_(p[:data].view(-1, BLOCK).float() * scale[:, None])
    return total.view(-1)[:n].div_(len(payloads))


def int8_compress_hook(state: Int8State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch DDP comm hook: the bucket averaged over the ranks through the 8-bit codec (module docstring),
    by the path with fewer bytes; the result is written into the bucket's buffer, as
    ``fp16_compress_hook`` does."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    n = buffer.numel()
    gloo_cpu = scatter_supported(group, buffer.device)  # gloo's point-to-point sends and its pieces
    if group is not None and uses_scatter(n, world, gloo_cpu):
        return _scatter(state, group, buffer)
    payload = encode(buffer, state.rng(buffer.device))
    gathered = [torch.empty_like(payload) for _ in range(world)]
    pieces = max(1, round(payload.numel() / GATHER_PIECE)) if gloo_cpu else 1
    piece = math.ceil(payload.numel() / pieces)  # equal pieces, none much smaller than the rest
    works = [dist.all_gather([g[lo:lo + piece] for g in gathered], payload[lo:lo + piece], group=group,
                             async_op=True) for lo in range(0, payload.numel(), piece)]

    def average(parts: Sequence[dist.Work | torch.futures.Future[object]]) -> torch.Tensor:
        for part in parts:
            part.wait()  # a piece that failed (a lost link) fails the bucket's future: nothing decoded
        buffer.copy_(decode(gathered, n))
        return buffer

    if not gloo_cpu:  # the device's streams: torch's callback orders the decode after the collectives
        futs = [w.get_future() for w in works]
        return torch.futures.collect_all(futs).then(lambda _: average(futs))
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def finish() -> None:
        try:
            result.set_result(average(works))
        except Exception as e:  # the future carries it to whoever waits
            result.set_exception(e)  # type: ignore[arg-type]  # torch types the exception as the value type

    state.submit(finish, group)  # decoded off gloo's threads (module docstring)
    return result


def round_blocks(blocks: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)`` of the float32 blocks ``(B, BLOCK)`` (module docstring), ``U`` the next ``B BLOCK``
    draws of ``generator``: ``q`` int8 ``(B, BLOCK)``, ``s`` float32 ``(B,)``."""
    scale = blocks.abs().amax(1) / LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a block of zeros sends zeros
    q = blocks / safe[:, None]
    u = torch.rand(blocks.numel(), generator=generator, device=blocks.device).view_as(blocks)
    return q.add_(u).floor_().clamp_(-LEVELS, LEVELS).to(torch.int8), scale


def chunk_payloads(q: torch.Tensor, scale: torch.Tensor, chunks: int) -> torch.Tensor:
    """``(chunks, c (BLOCK + 4))`` int8: each chunk's ``q`` then its scales' bytes."""
    return torch.cat([q.reshape(chunks, -1), scale.reshape(chunks, -1).view(torch.int8)], dim=1)


def _chunk_values(rows: torch.Tensor, p: int) -> torch.Tensor:
    """``s q`` of the chunk in row ``p`` of ``rows`` (:func:`chunk_payloads`), float32 ``(c, BLOCK)``."""
    c = rows.shape[1] // (BLOCK + 4)
    return rows[p, :c * BLOCK].view(c, BLOCK).float() * rows[p, c * BLOCK:].view(torch.float32)[:, None]


def chunk_average(rows: torch.Tensor) -> torch.Tensor:
    """``a``: the chunks of ``rows`` decoded and averaged, summed in row order (float32 ``(c, BLOCK)``)."""
    total = torch.zeros(rows.shape[1] // (BLOCK + 4), BLOCK, dtype=torch.float32, device=rows.device)
    for p in range(rows.shape[0]):
        total.add_(_chunk_values(rows, p))
    return total.div_(rows.shape[0])


def chunk_concat(rows: torch.Tensor) -> torch.Tensor:
    """The chunks of ``rows`` decoded and laid end to end (float32, flat)."""
    return torch.cat([_chunk_values(rows, p) for p in range(rows.shape[0])]).view(-1)


def _exchange(rows: torch.Tensor, me: int, group: dist.ProcessGroup, tag: int) -> None:
    """Row ``me`` of ``rows`` to every rank of ``group``, and every other rank's row from it (tagged
    point-to-point sends: module docstring, Note)."""
    works = []
    for p in range(rows.shape[0]):
        if p != me:
            peer = dist.get_global_rank(group, p)
            works += [dist.isend(rows[me], peer, group=group, tag=tag), dist.irecv(rows[p], peer, group=group, tag=tag)]
    for w in works:
        if w is not None:  # (None only for a rank outside the group)
            w.wait()


def _scatter(state: Int8State, group: dist.ProcessGroup, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """The scatter path (module docstring): the all-to-all started in the call, the rest on the state's
    thread for ``group``."""
    world, me, n = dist.get_world_size(group), dist.get_rank(group), buffer.numel()
    tag = state.calls % TAGS + 1
    gen = state.rng(buffer.device)
    c = chunk_blocks(n, world)
    blocks = torch.zeros(world * c, BLOCK, dtype=torch.float32, device=buffer.device)
    blocks.view(-1)[:n] = buffer.reshape(-1)
    send = chunk_payloads(*round_blocks(blocks, gen), world)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def finish() -> None:
        try:
            work.wait()
            rows = torch.empty_like(send)
            rows[me] = chunk_payloads(*round_blocks(chunk_average(recv), gen), 1)[0]
            _exchange(rows, me, group, tag)
            buffer.view(-1).copy_(chunk_concat(rows)[:n])
            result.set_result(buffer)
        except Exception as e:  # the future carries it to whoever waits
            result.set_exception(e)  # type: ignore[arg-type]  # torch types the exception as the value type

    state.submit(finish, group)
    return result
