"""torch DDP communication hooks on deft's scheduled buckets (``ddp.register_comm_hook(state, hook)``).

A torch comm hook is ``hook(state, bucket) -> torch.futures.Future`` whose value is the bucket's
gradient *averaged* over the ranks (a flat tensor, or a one-element list of it). deft calls the hook
once for each bucket of each update group, when the schedule launches that bucket, on the link the
schedule chose, so torch's own hooks (``default_hooks.fp16_compress_hook``, ``bf16_compress_hook``,
``powerSGD_hook.powerSGD_hook``, ``batched_powerSGD_hook``) compress exactly what deft would have
all-reduced. Rules that keep the runtime's invariants:

* **The link's process group.** A hook whose ``state`` is ``None`` or a process group (torch's
  default hooks) gets the group of the link carrying the bucket; a state with a ``process_group``
  attribute (``PowerSGDState``) has it set to that group for the call. The hook's collectives then
  travel on the scheduled link, in the schedule's order on every rank.
* **One bucket at a time.** Hooked buckets run one after another in launch order (the executor
  chains them): a hook starts collectives from its futures' callbacks and shares its state across
  buckets, so concurrent hooks would issue collectives in a different order on different ranks and
  make two runs of the same training differ.
* **Exactly once.** Each bucket of each update group is launched once, so the hook (and any error
  feedback it keeps per ``bucket.index()``, deft's bucket id) sees each gradient once; a merged
  update hands it the merged (summed) gradient of its iterations once, and deft divides by the
  number of iterations afterwards. ``bucket.is_last()`` is true for the group's last launched bucket
  (PowerSGD counts iterations with it).
* **Results.** The hook's averaged result is copied into the group's buffer and multiplied by the
  world size, so the buffer holds a sum as after a plain all-reduce; the update divides by
  ``world * k`` as always.
* **Errors.** A hook that does not return a Future, a future that fails, or a result of the wrong
  size raises a :class:`~deft.errors.CommunicationError` naming the bucket, the update and the link;
  nothing is applied then.
* **Checkpoints.** The hook's state is saved in ``state_dict()`` (PowerSGD: error feedback, P/Q
  memories, iteration counter and random state) and restored on load, so a resumed run compresses
  exactly as the uninterrupted one.

The config knob ``compression = "fp16" | "bf16" | "powersgd"`` (with ``powersgd_rank``,
``powersgd_start_iter``) registers the corresponding torch hook without code.

What the profile learns of a hook (DESIGN.md, "Compression in the profile"):

* **Bytes on the wire** (:func:`wire_nbytes`), from the hook's maths, for torch's hooks: fp16/bf16
  send 2 bytes per element; PowerSGD views each gradient of ``n`` rows as an ``n x m`` matrix, sends
  ``(n + m) r`` elements (``r = min(n, m, rank)``; P is ``n x r``, Q is ``m x r``) where
  ``(n + m) r * min_compression_rate < n m`` and the whole tensor elsewhere (1-D tensors: ``m = 1``);
  batched PowerSGD pads the bucket to a ``s x s`` square, ``s = ceil(sqrt(numel))``, and sends
  ``2 s r`` elements. A user's hook: unknown (``None``), the bucket's own size is assumed.
* **Codec compute** (:func:`time_codec`): the hook run on each bucket with a one-rank process group
  (its collectives then move nothing), on a scratch copy of its state, timed from the call to its
  future's completion: encode, the hook's own compute between its collectives, decode.
* **When PowerSGD compresses** (:func:`plain_iterations`): PowerSGD all-reduces plainly until its
  iteration counter reaches ``start_powerSGD_iter``; the runtime warms up ``warmup_iters`` compressed
  iterations after that, then profiles.
* **Per-bucket memory** (:func:`carry_buckets`): PowerSGD keeps error feedback and warm-start P/Q per
  bucket index. When the bucket layout changes (ready order, a planned partition, a re-plan, the
  adaptation going back to the warm-up's schedule) that memory is moved to the new buckets, because
  none of it depends on where a bucket starts: the error is one residual per gradient element
  (``e = (g + e_old) - decompressed``, the uncompressed tensors' elements included), and the
  warm-start state is one ``Q`` per compressed tensor (``P = M Q`` is recomputed from it before it is
  read). So per-tensor PowerSGD after a layout change compresses exactly as it would have without
  one. Dropping it instead (torch DDP's PowerSGD has no such step: it never re-buckets after its
  start) would lose the residual not yet sent, which for a large matrix compressed at a low rank is
  most of the recent iterations' gradient (runs in which a layout switch restarted the error
  feedback: ``benchmarks/results/peers.md``). Batched PowerSGD pads a whole bucket into one square
  matrix, so its memory does depend on the bucket: it is dropped (:func:`forget_buckets`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from deft.config import DeftConfig
from deft.errors import ContractError, DeftError
from deft.runtime import int8_hook
from deft.runtime.buckets import FlatLayout
from deft.runtime.checkpoint import StateDoc
from deft.runtime.control import ControlPlane

#: ``hook(state, bucket)``: torch's hooks declare their own state and ``GradBucket`` types (deft passes a
#: :class:`HookBucket`), so the parameters are left open; a value of ``[tensor]`` is accepted too
#: (:func:`hook_result`), as torch DDP does.
Hook = Callable[..., torch.futures.Future[torch.Tensor]]


class HookBucket:
    """What torch's hooks read of a ``torch.distributed.GradBucket``, for one deft bucket."""

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor], is_last: bool) -> None:
        self._index, self._buffer, self._gradients = index, buffer, gradients
        self._parameters, self._is_last = parameters, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


#: Hooks that start one collective synchronously and keep no cross-bucket state but int8's count of calls,
#: read in the call (their codec names, ``fp16``, ``bf16`` and ``int8``, are
#: :data:`deft.profile.ELEMENTWISE_CODECS`).
SINGLE_COLLECTIVE_HOOKS = (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook,
                           int8_hook.int8_compress_hook)

#: torch's hooks that write their result into the bucket's own buffer (and its gradient views) and
#: never resize it, as an in-place all-reduce does: deft hands them its buffer itself, no copy.
#: (``batched_powerSGD_hook`` pads the buffer to a square in place, and a user's hook may do anything:
#: those get a copy.)
IN_PLACE_HOOKS = (*SINGLE_COLLECTIVE_HOOKS, powerSGD_hook.powerSGD_hook)


@dataclass
class CommHook:
    """A registered hook and its state."""

    state: object  # None, a process group, a PowerSGDState, or a user's state (passed through)
    hook: Hook
    name: str

    @property
    def chained(self) -> bool:
        """Whether launches must run one at a time (``Executor._chained``). torch's fp16/bf16/plain
        hooks start their one collective inside the call and keep no state between buckets,
        so their launches on different links may overlap like plain all-reduces (same launch order on
        every rank); any other hook (PowerSGD starts collectives from callbacks and shares state) is
        chained. The simulator's ``serial`` links follow this (:func:`deft.solver.simulate.serial_codec`)."""
        return self.hook not in SINGLE_COLLECTIVE_HOOKS

    @property
    def in_place(self) -> bool:
        """Whether the hook may be given deft's own bucket buffer (:data:`IN_PLACE_HOOKS`): it leaves its
        averaged result there, as a plain in-place all-reduce does, so deft neither copies the bucket
        before the call nor the result back after it."""
        return self.hook in IN_PLACE_HOOKS

    def launch(self, group: dist.ProcessGroup, bucket: HookBucket) -> torch.futures.Future[torch.Tensor]:
        """Call the hook with ``group`` as its process group; the Future it returns."""
        state = self.state
        if state is None or isinstance(state, dist.ProcessGroup):
            fut = self.hook(group, bucket)
        elif hasattr(state, "process_group"):
            previous = state.process_group
            state.process_group = group
            try:
                fut = self.hook(state, bucket)
            finally:
                state.process_group = previous
        else:
            fut = self.hook(state, bucket)
        return fut

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> StateDoc | None:
        """The hook state as tensors and plain types (``weights_only`` loadable); None: nothing to keep."""
        st = self.state
        if st is None or isinstance(st, dist.ProcessGroup):
            return None
        if isinstance(st, powerSGD_hook.PowerSGDState):
            kind, keys, pos, has_gauss, gauss = st.rng.get_state()
            doc = {slot: getattr(st, slot) for slot in st.__slots__ if slot not in ("process_group", "rng")}
            doc["rng"] = {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}
            return {"kind": "PowerSGDState", "state": doc}
        if hasattr(st, "state_dict") and hasattr(st, "load_state_dict"):
            return {"kind": "state_dict", "state": st.state_dict()}
        raise DeftError(f"the comm hook state {type(st).__name__} cannot be checkpointed: give it state_dict() and "
                        "load_state_dict(), or use a PowerSGDState / a process group")

    def load_state_dict(self, saved: StateDoc | None, source: str, field: str = "_extra_state.comm_hook") -> None:
        """Restore :meth:`state_dict`; a state the hook's own ``load_state_dict`` refuses is a
        :class:`ContractError` naming ``field``."""
        st = self.state
        if saved is None:
            return
        if saved.get("kind") == "PowerSGDState":
            if not isinstance(st, powerSGD_hook.PowerSGDState):
                raise ContractError(source, "_extra_state.comm_hook", f"the checkpoint holds a PowerSGD state but "
                                    f"the registered hook's state is {type(st).__name__}")
            doc = dict(saved["state"])
            rng = doc.pop("rng")
            for slot, value in doc.items():
                setattr(st, slot, value)
            st.rng = np.random.RandomState()
            st.rng.set_state((rng["kind"], rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                              rng["gauss"]))
            return
        if hasattr(st, "load_state_dict"):
            try:
                st.load_state_dict(saved["state"])
            except (TypeError, KeyError, ValueError) as e:
                raise ContractError(source, field, f"{type(st).__name__}.load_state_dict refused it: {e}") from e
            return
        raise ContractError(source, field, f"cannot load a saved hook state into {type(st).__name__}")


def from_config(cfg: DeftConfig) -> CommHook | None:
    """The hook the config's ``compression`` names (None: plain all-reduce, or deft's own choice per
    bucket with ``"auto"``: :func:`codec_hook`)."""
    if cfg.compression in ("none", "auto"):
        return None
    if cfg.compression in CODEC_HOOKS or cfg.compression == "int8":
        return codec_hook(cfg.compression)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                                        start_powerSGD_iter=cfg.powersgd_start_iter, use_error_feedback=True,
                                        warm_start=True, random_seed=0)
    return CommHook(state, powerSGD_hook.powerSGD_hook, f"powersgd (rank {cfg.powersgd_rank})")


#: The element-wise codecs by name (``Schedule.codecs``, ``Profile.codec``): torch's hooks.
CODEC_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def codec_hook(name: str) -> CommHook:
    """The hook of the element-wise codec ``name``: torch's ``"fp16"``, ``"bf16"`` (stateless) or deft's
    ``"int8"`` (:mod:`deft.runtime.int8_hook`, a generator); one collective started in the call, in place;
    what a schedule's per-bucket codec runs."""
    if name == "int8":
        return CommHook(int8_hook.Int8State(), int8_hook.int8_compress_hook, name)
    return CommHook(None, CODEC_HOOKS[name], name)


def hook_result(value: object) -> torch.Tensor:
    """A hook future's value: a tensor or a one-element list of one."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected the future's value to be a tensor or [tensor], got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Codec:
    """What a comm hook does to each bucket of the profiled layout: its name, the bytes it puts on the
    wire (``wire_known``: from its maths, else the bucket's size) and its compute (``timed``: measured,
    else 0)."""

    name: str
    wire_nbytes: tuple[int, ...]
    codec_s: tuple[float, ...]
    wire_known: bool = True
    timed: bool = True


def profile_codec(hook: CommHook, layout: FlatLayout, params: Sequence[torch.Tensor], group: dist.ProcessGroup,
                  device: torch.device) -> Codec:
    """This rank's :class:`Codec` for ``layout``: wire bytes from :func:`wire_nbytes`, compute from
    :func:`time_codec` on random gradients on ``group`` (a one-rank group). A bucket mixing dtypes
    cannot be hooked at all (the executor refuses it), so it is given its plain size and no compute."""
    buffers = layout.new_buffers(device)
    buckets, wire, known = [], [], True
    for b in range(layout.n_buckets):
        views = layout.bucket_views(buffers, b)
        if len(views) != 1:
            wire.append(sum(v.numel() * v.element_size() for v in views))
            continue
        view = views[0]
        view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(b)).to(view.dtype))
        hb = hook_bucket(layout, params, b, view, is_last=b == layout.n_buckets - 1)
        size = wire_nbytes(hook, [tuple(g.shape) for g in hb.gradients()], view.element_size())
        known &= size is not None
        wire.append(size if size is not None else view.numel() * view.element_size())
        buckets.append(hb)
    seconds = time_codec(hook, group, buckets)
    per_bucket = dict.fromkeys(range(layout.n_buckets), 0.0)
    if seconds is not None:
        per_bucket.update({hb.index(): sec for hb, sec in zip(buckets, seconds, strict=True)})
    return Codec(codec_name(hook), tuple(wire), tuple(per_bucket[b] for b in range(layout.n_buckets)),
                 wire_known=known, timed=seconds is not None)


def hook_bucket(layout: FlatLayout, params: Sequence[torch.Tensor], b: int, view: torch.Tensor,
                is_last: bool) -> HookBucket:
    """Bucket ``b`` as the hook sees it: ``view`` (one dtype), its gradients shaped like their parameters
    (a parameter split over buckets: its 1-D piece), the parameters."""
    start = layout.segments[b][0].start if layout.segments[b] else 0
    grads, owners = [], []
    for i in layout.bucket_params[b]:
        s = layout.slots[i]
        lo, hi = max(s.dtype_offset, start), min(s.dtype_offset + s.numel, start + view.numel())
        piece = view[lo - start:hi - start]
        whole = lo == s.dtype_offset and hi == s.dtype_offset + s.numel
        grads.append(piece.view(params[i].shape) if whole else piece)
        owners.append(params[i])
    return HookBucket(b, view, grads, owners, is_last=is_last)


def codec_name(hook: CommHook) -> str:
    """The codec's name in a profile: ``fp16``, ``bf16``, ``powersgd (rank r)``, else the hook's name."""
    st = hook.state
    if hook.hook is default_hooks.fp16_compress_hook:
        return "fp16"
    if hook.hook is default_hooks.bf16_compress_hook:
        return "bf16"
    if hook.hook is int8_hook.int8_compress_hook:
        return "int8"
    if isinstance(st, powerSGD_hook.PowerSGDState):
        if hook.hook is powerSGD_hook.powerSGD_hook:
            return f"powersgd (rank {st.matrix_approximation_rank})"
        if hook.hook is powerSGD_hook.batched_powerSGD_hook:
            return f"batched_powersgd (rank {st.matrix_approximation_rank})"
    return hook.name or "comm hook"


def wire_nbytes(hook: CommHook, shapes: Sequence[Sequence[int]], element_size: int) -> int | None:
    """Bytes the hook puts on the wire for one bucket whose gradients have ``shapes`` (module docstring).

    ``None`` for a hook whose maths deft does not know. Summed over the hook's collectives, as each
    carries its tensor through the same all-reduce (PowerSGD: the uncompressed tensors, P, then Q).
    """
    numel = sum(math.prod(sh) for sh in shapes)
    if hook.hook in (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook):
        return 2 * numel
    if hook.hook is int8_hook.int8_compress_hook:
        return int8_hook.wire_nbytes(numel, dist.get_world_size() if dist.is_initialized() else 1)
    st = hook.state
    if not isinstance(st, powerSGD_hook.PowerSGDState):
        return None
    rank = st.matrix_approximation_rank
    if hook.hook is powerSGD_hook.batched_powerSGD_hook:
        side = math.ceil(math.sqrt(numel))
        return 2 * side * rank * element_size
    if hook.hook is not powerSGD_hook.powerSGD_hook:
        return None
    elements = 0
    for sh in shapes:
        n, m, r = powersgd_matrix(sh, st)
        elements += (n + m) * r if r else math.prod(sh)
    return elements * element_size


def powersgd_matrix(shape: Sequence[int], st: powerSGD_hook.PowerSGDState) -> tuple[int, int, int]:
    """How torch's ``powerSGD_hook`` treats a gradient of ``shape``: viewed as ``n x m``
    (``n = shape[0]``), compressed at rank ``r = min(n, m, rank)`` when ``(n + m) r *
    min_compression_rate < n m``; ``r == 0`` means sent whole. P is ``n x r``, Q is ``m x r``."""
    size = math.prod(shape)
    n = shape[0] if len(shape) else 1
    m = size // n if n else 0
    r = min(n, m, st.matrix_approximation_rank)
    return n, m, (r if (n + m) * r * st.min_compression_rate < size else 0)


def plain_iterations(hook: CommHook | None) -> int:
    """Iterations (one update each) the hook still sends uncompressed: PowerSGD's
    ``start_powerSGD_iter - iter``; 0 for every other hook."""
    st = None if hook is None else hook.state
    if isinstance(st, powerSGD_hook.PowerSGDState):
        return max(0, st.start_powerSGD_iter - st.iter)
    return 0


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

    The hook views every gradient as ``n x (numel / n)``, compresses some (:func:`powersgd_matrix`),
    groups the compressed ones by matrix shape in order of first appearance, and lays their ``Q``
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
    """The shapes of bucket ``b``'s gradients as :func:`hook_bucket` hands them to the hook (a split
    parameter's piece is 1-D); None when the bucket is not one contiguous slice of one dtype."""
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
    docstring, "Per-bucket memory").

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


def scratch_state(hook: CommHook, group: dist.ProcessGroup) -> tuple[bool, object]:
    """A state for timing the codec alone on ``group``: ``(known, state)``; ``known`` is False for a
    user's state that deft cannot copy (its codec is not timed)."""
    st = hook.state
    if st is None or isinstance(st, dist.ProcessGroup):
        return True, group
    if isinstance(st, powerSGD_hook.PowerSGDState):
        fresh = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=st.matrix_approximation_rank,
            start_powerSGD_iter=st.start_powerSGD_iter, min_compression_rate=st.min_compression_rate,
            use_error_feedback=st.use_error_feedback, warm_start=st.warm_start,
            orthogonalization_epsilon=st.orthogonalization_epsilon, random_seed=0,
            compression_stats_logging_frequency=10**9, batch_tensors_with_same_shape=st.batch_tensors_with_same_shape)
        fresh.iter = fresh.start_powerSGD_iter  # on the compressed path
        return True, fresh
    if isinstance(st, int8_hook.Int8State):
        return True, int8_hook.Int8State(group, seed=st.seed + 1)  # the training's draws stay untouched
    return False, None


def time_codec(hook: CommHook, group: dist.ProcessGroup, buckets: Sequence[HookBucket],
               repeats: int = 3) -> list[float] | None:
    """Seconds of the hook's compute per bucket: the hook on ``group`` (one rank: its collectives move
    nothing), from the call to its future's value, the median of ``repeats`` runs after one untimed
    run (which allocates PowerSGD's memories); the buckets' buffers are overwritten.
    ``None``: a state deft cannot copy (:func:`scratch_state`).

    The training's random streams are left as they were: PowerSGD draws its initial Q by calling
    ``torch.manual_seed`` inside ``torch.random.fork_rng(devices=[])``, which restores the CPU
    generator but not the CUDA ones that ``manual_seed`` also reseeds, so the timing runs inside a
    fork of the CPU generator and of every initialized CUDA device's (dropout and data order then
    draw the same numbers with and without the codec timing)."""
    known, state = scratch_state(hook, group)
    if not known:
        return None
    cuda_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda_devices):
        return _time_buckets(hook, state, buckets, repeats)


def _time_buckets(hook: CommHook, state: object, buckets: Sequence[HookBucket], repeats: int) -> list[float]:
    out = []
    for bucket in buckets:
        runs = []
        cuda = bucket.buffer().is_cuda  # a CUDA future's wait() orders streams only: synchronize to time the work
        for k in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize(bucket.buffer().device)
            t0 = time.perf_counter()
            try:
                hook_result(hook.hook(state, bucket).wait())
            except Exception as e:  # name the bucket: the caller names the hook and the rank
                raise RuntimeError(f"bucket {bucket.index()} ({bucket.buffer().numel()} elements): "
                                   f"{type(e).__name__}: {e}") from e
            if cuda:
                torch.cuda.synchronize(bucket.buffer().device)
            if k:
                runs.append(time.perf_counter() - t0)
        out.append(sorted(runs)[len(runs) // 2])
    return out


def agree_codec(hook: CommHook | None, layout: FlatLayout, params: Sequence[torch.Tensor],
                solo: dist.ProcessGroup | None, device: torch.device, control: ControlPlane) -> Codec | None:
    """Collective: the comm hook's wire bytes and compute per bucket of the profiled layout, the same on
    every rank (the codec timed by :func:`profile_codec` on each rank's one-rank group ``solo``; the
    maximum over ranks). A failure on any rank raises the same error on every rank, after the
    collective, so no rank is left waiting. None without a hook."""
    if hook is None:
        return None
    assert solo is not None
    n = layout.n_buckets
    codec: Codec | None = None
    error: str | None = None
    try:
        codec = profile_codec(hook, layout, params, solo, device)
        row = [*codec.codec_s, 0.0]
    except Exception as e:  # every rank must leave the collective below: a flag, then the same error
        row, error = [0.0] * n + [1.0], f"{type(e).__name__}: {e}"
    seconds = control.max_rows([row], "comm hook codec times")[0]
    if seconds[-1] > 0 or codec is None:
        raise DeftError(f"comm hook {hook.name!r} failed while deft timed its codec on a one-rank group"
                        + (f" on rank {control.rank}: {error}" if error else
                           f" on a rank other than {control.rank} (its error says which bucket and why)"))
    return dataclasses.replace(codec, codec_s=tuple(seconds[:-1]))
