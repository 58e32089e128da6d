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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from deft.config import DeftConfig
from deft.errors import ContractError, DeftError

Hook = Callable[[Any, Any], torch.futures.Future]


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


@dataclass
class CommHook:
    """A registered hook and its state."""

    state: Any
    hook: Hook
    name: str

    def launch(self, group: Any, bucket: HookBucket) -> torch.futures.Future:
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
    def state_dict(self) -> dict[str, Any] | None:
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

    def load_state_dict(self, saved: dict[str, Any] | None, source: str) -> None:
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
            st.load_state_dict(saved["state"])
            return
        raise ContractError(source, "_extra_state.comm_hook",
                            f"cannot load a saved hook state into {type(st).__name__}")


def from_config(cfg: DeftConfig) -> CommHook | None:
    """The hook the config's ``compression`` names (None: plain all-reduce)."""
    if cfg.compression == "none":
        return None
    if cfg.compression == "fp16":
        return CommHook(None, default_hooks.fp16_compress_hook, "fp16")
    if cfg.compression == "bf16":
        return CommHook(None, default_hooks.bf16_compress_hook, "bf16")
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                                        start_powerSGD_iter=cfg.powersgd_start_iter, use_error_feedback=True,
                                        warm_start=True, random_seed=0)
    return CommHook(state, powerSGD_hook.powerSGD_hook, f"powersgd (rank {cfg.powersgd_rank})")


def hook_result(value: Any) -> torch.Tensor:
    """A hook future's value: a tensor or a one-element list of one."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected the future's value to be a tensor or [tensor], got {type(value).__name__}")
    return value
