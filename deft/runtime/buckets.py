"""Buckets: the flat gradient in backward-ready order, cut into contiguous element ranges.

Layout
------
The trainable parameters are ordered as their gradients become ready in backward (observed in the
first iteration, as torch DDP rebuilds its buckets; reverse registration order before that). The
*flat gradient* is their concatenation in that order; bucket ``b`` is the element range
``[sum(numel[:b]), sum(numel[:b+1]))`` of it, exactly as ``Schedule.bucket_numel`` says. A bucket may
split a parameter (the planner's partition does that to large tensors).

Storage is one flat buffer *per dtype*: the parameters of one dtype are laid out in flat order, so
the part of a bucket that has a given dtype is one contiguous slice of that dtype's buffer (same-dtype
parameters inside an element range are consecutive in that dtype's order). A bucket therefore maps
to one slice per dtype it touches, and is all-reduced in the parameters' own dtype (fp32, fp16, bf16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deft.errors import ContractError


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient lives: its dtype buffer and offset there, its flat offset."""

    index: int  # index in registration order of the trainable parameters
    name: str
    numel: int
    dtype: torch.dtype
    flat_offset: int
    dtype_offset: int


@dataclass(frozen=True)
class Segment:
    """The part of a bucket that has one dtype: ``buffer[dtype][start:end]``."""

    dtype: torch.dtype
    start: int
    end: int


class FlatLayout:
    """Parameters in flat order and the buckets cutting that order (module docstring)."""

    def __init__(self, order: Sequence[int], names: Sequence[str], params: Sequence[torch.Tensor],
                 bucket_numel: Sequence[int], source: str = "<schedule>") -> None:
        if sorted(order) != list(range(len(params))):
            raise ContractError(source, "order", "the parameter order must be a permutation of the parameters")
        total = sum(p.numel() for p in params)
        if sum(bucket_numel) != total:
            raise ContractError(source, "bucket_numel",
                                f"buckets hold {sum(bucket_numel)} elements but the model has {total} trainable "
                                "elements (was it planned for another model?)")
        self.order = tuple(order)
        self.bucket_numel = tuple(int(n) for n in bucket_numel)
        self.dtype_numel: dict[torch.dtype, int] = {}
        slots: list[ParamSlot | None] = [None] * len(params)
        flat = 0
        for i in self.order:
            p = params[i]
            off = self.dtype_numel.get(p.dtype, 0)
            slots[i] = ParamSlot(i, names[i], p.numel(), p.dtype, flat, off)
            self.dtype_numel[p.dtype] = off + p.numel()
            flat += p.numel()
        self.slots: tuple[ParamSlot, ...] = tuple(s for s in slots if s is not None)
        self.total = flat
        # Per bucket: its dtype segments and the parameters overlapping it; per parameter: its buckets.
        self.segments: list[tuple[Segment, ...]] = []
        self.bucket_params: list[tuple[int, ...]] = []
        self.param_buckets: list[list[int]] = [[] for _ in params]
        ordered = [self.slots[i] for i in self.order]
        j, start = 0, 0
        for b, n in enumerate(self.bucket_numel):
            end = start + n
            segs: dict[torch.dtype, list[int]] = {}
            members = []
            while j < len(ordered) and ordered[j].flat_offset < end:
                s = ordered[j]
                lo, hi = max(start, s.flat_offset), min(end, s.flat_offset + s.numel)
                if hi > lo or s.numel == 0:
                    members.append(s.index)
                    self.param_buckets[s.index].append(b)
                    d0 = s.dtype_offset + lo - s.flat_offset
                    d1 = s.dtype_offset + hi - s.flat_offset
                    if s.dtype in segs:
                        segs[s.dtype][1] = d1  # contiguous: same-dtype params are consecutive
                    else:
                        segs[s.dtype] = [d0, d1]
                if s.flat_offset + s.numel <= end:
                    j += 1
                else:
                    break  # the parameter continues in the next bucket
            self.segments.append(tuple(Segment(d, a, z) for d, (a, z) in segs.items()))
            self.bucket_params.append(tuple(members))
            start = end
        # Zero-element parameters beyond the last cut belong to the last bucket.
        while j < len(ordered):
            s = ordered[j]
            if not self.param_buckets[s.index]:
                self.param_buckets[s.index].append(len(self.bucket_numel) - 1)
                self.bucket_params[-1] = (*self.bucket_params[-1], s.index)
            j += 1

    @property
    def n_buckets(self) -> int:
        return len(self.bucket_numel)

    def bucket_names(self, b: int) -> tuple[str, ...]:
        """The names of bucket ``b``'s parameters, a piece of a cut one as its element range
        (``"fc.weight[0:3400000]"``, the partition's names: :attr:`deft.profile.Profile.gradient_ready`
        reads the pieces of one parameter as ready together)."""
        start = sum(self.bucket_numel[:b])
        end = start + self.bucket_numel[b]
        out = []
        for i in self.bucket_params[b]:
            s = self.slots[i]
            lo, hi = max(start, s.flat_offset) - s.flat_offset, min(end, s.flat_offset + s.numel) - s.flat_offset
            out.append(s.name if (lo, hi) == (0, s.numel) or s.numel == 0 else f"{s.name}[{lo}:{hi}]")
        return tuple(out)

    def bucket_nbytes(self) -> tuple[int, ...]:
        return tuple(sum((s.end - s.start) * _itemsize(s.dtype) for s in segs) for segs in self.segments)

    def new_buffers(self, device: torch.device) -> dict[torch.dtype, torch.Tensor]:
        return {d: torch.zeros(n, dtype=d, device=device) for d, n in self.dtype_numel.items()}

    def param_view(self, buffers: dict[torch.dtype, torch.Tensor], index: int) -> torch.Tensor:
        s = self.slots[index]
        return buffers[s.dtype][s.dtype_offset:s.dtype_offset + s.numel]

    def bucket_views(self, buffers: dict[torch.dtype, torch.Tensor], b: int) -> list[torch.Tensor]:
        return [buffers[s.dtype][s.start:s.end] for s in self.segments[b] if s.end > s.start]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def ddp_like_bucket_numel(order: Sequence[int], params: Sequence[torch.Tensor], cap_mb: float,
                          first_cap_mb: float = 1.0) -> tuple[int, ...]:
    """torch DDP's bucketing of whole parameters in ready order: the first bucket is capped at
    ``first_cap_mb`` (DDP's 1 MB), the rest at ``cap_mb``; a bucket never mixes dtypes."""
    cuts: list[int] = []
    size = nbytes = 0
    dtype: torch.dtype | None = None
    cap = min(first_cap_mb, cap_mb) * 2**20
    for i in order:
        p = params[i]
        b = p.numel() * p.element_size()
        if size and (nbytes + b > cap or p.dtype != dtype):
            cuts.append(size)
            size = nbytes = 0
            cap = cap_mb * 2**20
        size += p.numel()
        nbytes += b
        dtype = p.dtype
    if size or not cuts:
        cuts.append(size)
    return tuple(cuts)
