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
* **torch's 16-bit casts without their callback.** ``fp16_compress_hook`` and ``bf16_compress_hook``
  on CPU tensors run as :func:`cast_send`: the same cast, division and all-reduce, but the copy back
  into the buffer is the executor's, where it takes the result, not a ``then`` callback: that
  callback runs on gloo's worker thread, which first waits for the GIL while the training thread
  holds it, and holds the link meanwhile (one thread per link with ``link_queue``). The bits are the
  hook's own.
* **Errors.** A hook that does not return a Future, a future that fails, or a result of the wrong
  size raises a :class:`~deft.errors.CommunicationError` naming the bucket, the update and the link;
  nothing is applied then.
* **Checkpoints.** The hook's state is saved in ``state_dict()`` (PowerSGD: error feedback, P/Q
  memories, iteration counter and random state) and restored on load, so a resumed run compresses
  exactly as the uninterrupted one.

The config knob ``compression = "fp16" | "bf16" | "int8" | "powersgd"`` (with ``powersgd_rank``,
``powersgd_start_iter``) registers the corresponding hook without code (:func:`from_config`).
PowerSGD all-reduces plainly until its iteration counter reaches ``start_powerSGD_iter``
(:func:`plain_iterations`); the runtime warms up ``warmup_iters`` compressed iterations after that,
then profiles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from deft.config import DeftConfig
from deft.errors import ContractError, DeftError
from deft.runtime.buckets import FlatLayout
from deft.runtime.checkpoint import StateDoc
from deft.runtime.codecs import int8

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


#: Hooks that start their collectives synchronously, in the call, and keep no cross-bucket state but int8's
#: count of calls, read in the call (their codec names, ``fp16``, ``bf16`` and ``int8``, are
#: :data:`deft.profile.ELEMENTWISE_CODECS`): one collective, or int8's all-gather in pieces. int8's
#: reduce-scatter path exchanges its rounded chunks after its all-to-all by point-to-point sends matched by
#: tag, on the state's thread for the group in call order, so they cannot interleave with the other
#: collectives differently on different ranks.
SINGLE_COLLECTIVE_HOOKS = (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook,
                           int8.int8_compress_hook)

#: torch's 16-bit casts and their dtype, run as :func:`cast_send` on CPU tensors (module docstring)
CAST_HOOKS: dict[Hook, torch.dtype] = {default_hooks.fp16_compress_hook: torch.float16,
                                       default_hooks.bf16_compress_hook: torch.bfloat16}

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
        hooks and deft's int8 start their collectives inside the call and keep no state between buckets,
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
        """Call the hook with ``group`` as its process group; the Future it returns (torch's 16-bit
        casts on CPU tensors: :func:`cast_send`'s, whose value is the averaged cast, not yet copied back)."""
        state = self.state
        dtype = CAST_HOOKS.get(self.hook)
        if dtype is not None and bucket.buffer().device.type == "cpu" \
                and (state is None or isinstance(state, dist.ProcessGroup)):
            return cast_send(dtype, group, bucket)
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

    def load_state_dict(self, saved: StateDoc | None, source: str, field: str = "deft_state.comm_hook") -> None:
        """Restore :meth:`state_dict`; a state the hook's own ``load_state_dict`` refuses is a
        :class:`ContractError` naming ``field``."""
        st = self.state
        if saved is None:
            return
        if saved.get("kind") == "PowerSGDState":
            if not isinstance(st, powerSGD_hook.PowerSGDState):
                raise ContractError(source, "deft_state.comm_hook", f"the checkpoint holds a PowerSGD state but "
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
    ``"int8"`` (:mod:`deft.runtime.codecs.int8`, a generator); collectives started in the call, in place;
    what a schedule's per-bucket codec runs."""
    if name == "int8":
        return CommHook(int8.Int8State(), int8.int8_compress_hook, name)
    return CommHook(None, CODEC_HOOKS[name], name)


def cast_send(dtype: torch.dtype, group: dist.ProcessGroup, bucket: HookBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``_compress_hook`` (default_hooks.py) without its ``decompress`` callback: the bucket cast
    to ``dtype`` and divided by the world size, all-reduced on ``group``; the future's value is
    ``[that sum]``, which the executor copies into the buffer (``buffer.copy_``, as ``decompress`` does)
    where it takes the result. Invariant: the same operations in the same order as the hook, so the
    same bits."""
    compressed = bucket.buffer().to(dtype).div_(group.size())
    work = dist.all_reduce(compressed, group=group, async_op=True)
    assert work is not None
    return cast("torch.futures.Future[torch.Tensor]", work.get_future())


def hook_result(value: object) -> torch.Tensor:
    """A hook future's value: a tensor or a one-element list of one."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected the future's value to be a tensor or [tensor], got {type(value).__name__}")
    return value



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
    if hook.hook is int8.int8_compress_hook:
        return "int8"
    if isinstance(st, powerSGD_hook.PowerSGDState):
        if hook.hook is powerSGD_hook.powerSGD_hook:
            return f"powersgd (rank {st.matrix_approximation_rank})"
        if hook.hook is powerSGD_hook.batched_powerSGD_hook:
            return f"batched_powersgd (rank {st.matrix_approximation_rank})"
    return hook.name or "comm hook"


def plain_iterations(hook: CommHook | None) -> int:
    """Iterations (one update each) the hook still sends uncompressed: PowerSGD's
    ``start_powerSGD_iter - iter``; 0 for every other hook."""
    st = None if hook is None else hook.state
    if isinstance(st, powerSGD_hook.PowerSGDState):
        return max(0, st.start_powerSGD_iter - st.iter)
    return 0


