"""PowerSGD's per-bucket memory carried across bucket layouts.

PowerSGD keeps error feedback and warm-start P/Q per bucket index. When the bucket layout changes
(ready order, a planned partition, a re-plan, the adaptation going back to the warm-up's schedule)
:func:`carry_buckets` moves that memory to the new buckets, because none of it depends on where a
bucket starts: the error is one residual per gradient element (``e = (g + e_old) - decompressed``,
the uncompressed tensors' elements included), and the warm-start state is one ``Q`` per compressed
tensor (``P = M Q`` is recomputed from it before it is read). So per-tensor PowerSGD after a layout
change compresses exactly as it would have without one. Dropping it instead (torch DDP never
re-buckets after PowerSGD starts, so it has no such step) would lose the residual not yet sent, which
for a large matrix compressed at a low rank is most of the recent iterations' gradient
(``benchmarks/results/peers.md``). Batched PowerSGD pads a whole bucket into one square matrix, so
its memory does depend on the bucket: it is dropped (:func:`forget_buckets`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from deft.runtime.buckets import FlatLayout
from deft.runtime.codecs.hooks import CommHook
from deft.runtime.codecs.wire import powersgd_matrix


def forget_buckets(hook: CommHook | None) -> None:
    """Drop the hook's per-bucket memory (the bucket layout changed; module docstring)."""
    st = None if hook is None else hook.state
    if isinstance(st, powerSGD_hook.PowerSGDState):
        st.error_dict.clear()
        st.p_memory_dict.clear()
        st.q_memory_dict.clear()


def _compressed_q(shapes: Sequence[torch.Size], st: powerSGD_hook.PowerSGDState) -> list[tuple[int, int, int]]:
    """Where torch's ``powerSGD_hook`` keeps each compressed tensor's ``Q`` in a bucket's
    ``q_memory_dict`` entry: ``(position in the bucket's gradients, offset, length)``.

    The hook views every gradient as ``n x (numel / n)``, compresses some
    (:func:`~deft.runtime.codecs.wire.powersgd_matrix`), groups the compressed ones by matrix shape in
    order of first appearance, and lays their ``Q``
    (``m x r`` each) out group by group; a batched group is one ``(batch, m, r)`` block, so tensor
    ``j`` of a group is still at ``j m r`` past the group's start, as in the unbatched layout."""
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for pos, sh in enumerate(shapes):
        n, m, r = powersgd_matrix(sh, st)
        if r:
            groups.setdefault((n, m), []).append((pos, m * r))
    out, at = [], 0
    for members in groups.values():
        for pos, length in members:
            out.append((pos, at, length))
            at += length
    return out


def _p_length(shapes: Sequence[torch.Size], st: powerSGD_hook.PowerSGDState) -> int:
    """Elements of a bucket's ``p_memory_dict`` entry: ``n r`` per compressed tensor."""
    total = 0
    for sh in shapes:
        n, _, r = powersgd_matrix(sh, st)
        total += n * r
    return total


def _gradient_shapes(layout: FlatLayout, params: Sequence[torch.Tensor], b: int) -> list[torch.Size] | None:
    """The shapes of bucket ``b``'s gradients as :func:`~deft.runtime.codecs.hooks.hook_bucket` hands them
    to the hook (a split parameter's piece is 1-D); None when the bucket is not one contiguous slice of one dtype."""
    segs = [s for s in layout.segments[b] if s.end > s.start]
    if len(segs) != 1:
        return None
    start, end = segs[0].start, segs[0].end
    shapes = []
    for i in layout.bucket_params[b]:
        s = layout.slots[i]
        lo, hi = max(s.dtype_offset, start), min(s.dtype_offset + s.numel, end)
        whole = lo == s.dtype_offset and hi == s.dtype_offset + s.numel
        shapes.append(params[i].shape if whole else torch.Size([hi - lo]))
    return shapes


def carry_buckets(hook: CommHook | None, old: FlatLayout, new: FlatLayout, params: Sequence[torch.Tensor]) -> None:
    """Move the hook's per-bucket memory from the buckets of ``old`` to those of ``new`` (module
    docstring).

    For torch's per-tensor ``powerSGD_hook``:

    * **error feedback**: every element's residual goes to the same element of its new bucket (an
      element no old bucket held a residual for gets 0, which is what the hook itself starts from);
    * **warm start**: a new bucket gets a ``Q`` memory when every tensor it compresses was compressed
      whole in some old bucket (each ``Q`` is copied; ``P`` is only allocated: the hook overwrites it
      with ``M Q`` before reading it), and otherwise none, so the hook draws fresh random ``Q`` for it.

    Batched PowerSGD's memory is dropped (:func:`forget_buckets`); other hooks keep none."""
    st = None if hook is None else hook.state
    if not isinstance(st, powerSGD_hook.PowerSGDState):
        return
    if hook is None or hook.hook is not powerSGD_hook.powerSGD_hook:
        forget_buckets(hook)
        return
    residual = _residuals_by_param(st, old, params)
    q_of = _q_by_param(st, old, params)
    errors, p_mem, q_mem = _bucket_memories(st, new, params, residual, q_of)
    st.error_dict.clear()
    st.error_dict.update(errors)
    st.p_memory_dict.clear()
    st.p_memory_dict.update(p_mem)
    st.q_memory_dict.clear()
    st.q_memory_dict.update(q_mem)


def _residuals_by_param(st: powerSGD_hook.PowerSGDState, old: FlatLayout,
                        params: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per parameter (registration index), its error-feedback residual gathered from ``old``'s buckets.

    The residual is one value per gradient element wherever the bucket starts, so a parameter's is
    the same tensor under any layout. A bucket whose memory does not match ``old`` (not one
    contiguous slice of one dtype, or of another size) is skipped: its elements start again from 0,
    as the hook itself would."""
    residual: dict[int, torch.Tensor] = {}
    for b, err in st.error_dict.items():
        if b >= old.n_buckets or _gradient_shapes(old, params, b) is None:
            continue
        start = next(s for s in old.segments[b] if s.end > s.start).start
        if err.numel() != sum(s.end - s.start for s in old.segments[b]):
            continue
        for i in old.bucket_params[b]:
            s = old.slots[i]
            lo, hi = max(s.dtype_offset, start), min(s.dtype_offset + s.numel, start + err.numel())
            if hi <= lo:
                continue
            if i not in residual:
                residual[i] = torch.zeros(s.numel, dtype=err.dtype, device=err.device)
            residual[i][lo - s.dtype_offset:hi - s.dtype_offset] = err[lo - start:hi - start]
    return residual


def _q_by_param(st: powerSGD_hook.PowerSGDState, old: FlatLayout,
                params: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per parameter (registration index) compressed in an old bucket, its warm-start ``Q`` (a view
    into that bucket's ``q_memory_dict`` entry, :func:`_compressed_q`). A bucket whose ``Q`` memory
    does not have the length the layout implies is skipped, so no ``Q`` is read at a wrong offset."""
    q_of: dict[int, torch.Tensor] = {}
    for b, qmem in st.q_memory_dict.items():
        shapes = _gradient_shapes(old, params, b) if b < old.n_buckets else None
        if shapes is None:
            continue
        members = old.bucket_params[b]
        places = _compressed_q(shapes, st)
        if not places or places[-1][1] + places[-1][2] != qmem.numel():
            continue
        for pos, at, length in places:
            q_of[members[pos]] = qmem[at:at + length]
    return q_of


def _bucket_memories(st: powerSGD_hook.PowerSGDState, new: FlatLayout, params: Sequence[torch.Tensor],
                     residual: dict[int, torch.Tensor], q_of: dict[int, torch.Tensor]
                     ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """``new``'s error, ``P`` and ``Q`` memories per bucket from the per-parameter ``residual`` and ``q_of``.

    A bucket gets an error memory whenever any residual was kept (elements without one: 0), and ``P``
    and ``Q`` memories only when every tensor it compresses is whole and has a ``Q`` of the right
    length: the hook keeps one ``Q`` block per bucket and, when there is one, draws no fresh ``Q``
    for any of the bucket's tensors; without them it draws a fresh random ``Q``, as for a new bucket."""
    errors: dict[int, torch.Tensor] = {}
    p_mem: dict[int, torch.Tensor] = {}
    q_mem: dict[int, torch.Tensor] = {}
    for b in range(new.n_buckets):
        shapes = _gradient_shapes(new, params, b)
        if shapes is None:
            continue
        start, end = next((s.start, s.end) for s in new.segments[b] if s.end > s.start)
        members = new.bucket_params[b]
        if residual:
            like = next(iter(residual.values()))
            err = torch.zeros(end - start, dtype=like.dtype, device=like.device)
            for i in members:
                s = new.slots[i]
                lo, hi = max(s.dtype_offset, start), min(s.dtype_offset + s.numel, end)
                if i in residual and hi > lo:
                    err[lo - start:hi - start] = residual[i][lo - s.dtype_offset:hi - s.dtype_offset]
            errors[b] = err
        places = _compressed_q(shapes, st)
        whole = all(shapes[pos] == params[members[pos]].shape for pos, _, _ in places)
        if places and whole and all(members[pos] in q_of and q_of[members[pos]].numel() == length
                                    for pos, _, length in places):
            like = q_of[members[places[0][0]]]
            q = torch.empty(places[-1][1] + places[-1][2], dtype=like.dtype, device=like.device)
            for pos, at, length in places:
                q[at:at + length] = q_of[members[pos]]
            q_mem[b] = q
            p_mem[b] = torch.empty(_p_length(shapes, st), dtype=like.dtype, device=like.device)
    return errors, p_mem, q_mem
