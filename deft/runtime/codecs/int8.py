"""deft's 8-bit codec as a torch DDP comm hook: block-scaled, stochastically rounded, all-gathered.

The maths
---------
Rank ``r`` cuts its bucket ``g_r`` (``n`` elements) into blocks of :data:`BLOCK` elements (the last one
padded with zeros). Block ``k`` gets the scale ``s_{r,k} = max_{i in k} |g_{r,i}| / 127`` and every element
is sent as the integer

    q_{r,i} = floor(g_{r,i} / s_{r,k} + U_{r,i}),    U ~ Uniform[0, 1) from the rank's own generator,

in ``[-127, 127]`` (stochastic rounding: ``E[s q] = g`` exactly, ``Var(s q) = s² p (1 - p) <= s² / 4``,
``p`` the fractional part). The ranks all-gather every rank's ``q`` and ``s`` (one int8 tensor each, the
scales' float32 bytes at its end) and every rank decodes the same average

    ĝ_i = (1 / R) sum_r s_{r,k(i)} q_{r,i}

from the same bytes in rank order, so the ranks agree bit for bit. ``ĝ`` is unbiased for the exact
all-reduce's average ``ḡ = mean_r g_r``, and the ranks' draws are independent, so

    E|ĝ - ḡ|² <= (1 / (4 R²)) sum_r sum_k n_k s_{r,k}² = P / (4 · 127² · R),

``P = mean_r sum_k n_k max_{i in k} g_{r,i}²`` (``n_k`` the block's elements) is what
:func:`block_peak` measures; the preserver judges ``P`` against the gradient's noise
(:mod:`deft.preserver.codec_error`).

Bytes: a ring all-gather sends ``(R - 1) m`` bytes per rank (``m = n + 4 ceil(n / BLOCK)`` padded to the
blocks), a ring all-reduce of ``w`` bytes ``2 (R - 1) / R · w``, so the hook costs what an all-reduce of
``R m / 2`` bytes costs (:func:`deft.runtime.codecs.wire.int8_nbytes`): half of fp16's ``2 n`` at two
ranks, three quarters at three, as much at four and more beyond. One collective, started in the call:
launches on two links may overlap as torch's fp16 hook's do.

Non-finite gradients (an fp16 overflow under a GradScaler) stay non-finite: a block holding ``inf`` or
``nan`` has a non-finite scale and decodes to ``nan`` on every rank, so the scaler's check skips the step
as it would after the exact all-reduce. A block of zeros decodes to zeros exactly.

State: a seed and the number of calls, the same on every rank; each call's draws come from a generator
seeded by ``(seed, calls, rank)`` (:class:`Int8State`), so ranks draw independently, runs repeat, and a
checkpoint (:meth:`Int8State.state_dict`) resumes the rounding of the uninterrupted run on every rank.
"""

# No ``from __future__ import annotations``: torch DDP's register_comm_hook reads the hook's annotations
# as objects (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``) and refuses strings.
import math

import torch
import torch.distributed as dist

#: Elements per scale: 4 bytes of scale per 256 bytes of data (1.6 %).
BLOCK = 256
#: The largest magnitude sent: ``q`` in ``[-LEVELS, LEVELS]``.
LEVELS = 127


class Int8State:
    """The hook's state: the process group (set by deft per link), the seed and the calls so far.

    Call ``c`` on rank ``r`` draws from a generator seeded by ``(seed, c, r)``, so the state is the same
    on every rank (every rank calls the hook for the same buckets) and a checkpoint saved on one rank
    resumes every rank's stream, each with its own draws."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, seed: int = 0) -> None:
        self.process_group = process_group
        self.seed = seed
        self.calls = 0

    def rng(self, device: torch.device) -> torch.Generator:
        """The generator of the next call on this rank (counts the call)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        mixed = (self.seed * 0x9E3779B97F4A7C15 + self.calls * 0xBF58476D1CE4E5B9 + rank * 0x94D049BB133111EB) % 2 ** 63
        self.calls += 1
        return torch.Generator(device=device).manual_seed(mixed)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, doc: dict[str, object]) -> None:
        seed, calls = doc.get("seed"), doc.get("calls")
        if not isinstance(seed, int) or not isinstance(calls, int) or calls < 0:
            raise TypeError(f"expected {{'seed': int, 'calls': int >= 0}}, got {doc!r}")
        self.seed, self.calls = seed, calls


def padded_numel(n: int) -> int:
    """Elements sent for a bucket of ``n``: whole blocks."""
    return math.ceil(n / BLOCK) * BLOCK


def payload_nbytes(n: int) -> int:
    """``m``: the int8 payload of one rank for a bucket of ``n`` elements (data and float32 scales)."""
    return padded_numel(n) + 4 * (padded_numel(n) // BLOCK)


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
    """torch DDP comm hook: the bucket averaged over the ranks through the 8-bit codec (module docstring);
    the result is written into the bucket's buffer, as ``fp16_compress_hook`` does."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    n = buffer.numel()
    payload = encode(buffer, state.rng(buffer.device))
    gathered = [torch.empty_like(payload) for _ in range(world)]
    fut = dist.all_gather(gathered, payload, group=group, async_op=True).get_future()

    def average(_: torch.futures.Future[object]) -> torch.Tensor:
        buffer.copy_(decode(gathered, n))
        return buffer

    return fut.then(average)
