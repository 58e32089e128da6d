"""The bytes a codec puts on the wire for one bucket: the one definition (the profile's ``wire_nbytes``,
the plan's codec choice and the simulator's link times all read it).

* **16 bits** (torch's fp16/bf16 hooks): 2 bytes per element.
* **int8** (:mod:`deft.runtime.codecs.int8`): one all-gather of ``m`` bytes per rank (the rounded
  blocks and their float32 scales); it costs what an all-reduce of ``R m / 2`` bytes costs
  (:func:`int8_nbytes`), fewer bytes than 16 bits under four ranks (:func:`int8_fewer_bytes`).
* **PowerSGD** views each gradient of ``n`` rows as an ``n x m`` matrix and sends ``(n + m) r``
  elements (``r = min(n, m, rank)``; P is ``n x r``, Q is ``m x r``) where ``(n + m) r *
  min_compression_rate < n m``, the whole tensor elsewhere (1-D tensors: ``m = 1``)
  (:func:`powersgd_matrix`); batched PowerSGD pads the bucket to an ``s x s`` square,
  ``s = ceil(sqrt(numel))``, and sends ``2 s r`` elements.
* **A user's hook**: unknown (``None``); the caller assumes the bucket's own size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from deft.runtime.codecs import int8
from deft.runtime.codecs.hooks import CommHook


def int8_nbytes(n: int, world: int) -> int:
    """The bytes of an all-reduce that costs what int8's all-gather of a bucket of ``n`` elements over
    ``world`` ranks costs (module docstring)."""
    return math.ceil(world * int8.payload_nbytes(n) / 2)


def int8_fewer_bytes(world: int) -> bool:
    """Whether int8 puts fewer bytes on the wire than a 16-bit all-reduce over ``world`` ranks (under
    four; the scales and the last block's padding ignored)."""
    return int8_nbytes(int8.BLOCK, world) < 2 * int8.BLOCK


def wire_nbytes(hook: CommHook, shapes: Sequence[Sequence[int]], element_size: int) -> int | None:
    """Bytes the hook puts on the wire for one bucket whose gradients have ``shapes`` (module docstring).

    ``None`` for a hook whose maths deft does not know. Summed over the hook's collectives, as each
    carries its tensor through the same all-reduce (PowerSGD: the uncompressed tensors, P, then Q).
    """
    numel = sum(math.prod(sh) for sh in shapes)
    if hook.hook in (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook):
        return 2 * numel
    if hook.hook is int8.int8_compress_hook:
        return int8_nbytes(numel, dist.get_world_size() if dist.is_initialized() else 1)
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


