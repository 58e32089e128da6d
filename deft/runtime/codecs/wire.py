"""The bytes a codec puts on the wire for one bucket: the one definition (the profile's ``wire_nbytes``,
the plan's codec choice and the simulator's link times all read it).

* **16 bits** (torch's fp16/bf16 hooks): 2 bytes per element.
* **int8** (:mod:`deft.runtime.codecs.int8`), bucket by bucket the cheaper of its two paths
  (:func:`int8_nbytes`): one all-gather of ``m`` bytes per rank (the rounded blocks and their float32
  scales), which costs what an all-reduce of ``R m / 2`` bytes costs; or, on gloo with three ranks or
  more, an all-to-all and an exchange of ``R`` chunks of ``c`` blocks, an all-reduce of ``R c (BLOCK + 4)``
  bytes, about one byte an element at every ``R``. Whether int8 sends fewer bytes than 16 bits is
  computed from these at the run's world size (:func:`int8_fewer_bytes`), not assumed.
* **PowerSGD** views each gradient of ``n`` rows as an ``n x m`` matrix and sends ``(n + m) r``
  elements (``r = min(n, m, rank)``; P is ``n x r``, Q is ``m x r``) where ``(n + m) r *
  min_compression_rate < n m``, the whole tensor elsewhere (1-D tensors: ``m = 1``)
  (:func:`powersgd_matrix`); batched PowerSGD pads the bucket to an ``s x s`` square,
  ``s = ceil(sqrt(numel))``, and sends ``2 s r`` elements.
* **A user's hook**: unknown (``None``); the caller assumes the bucket's own size.

Where the links all-reduce hierarchically (several ranks per host, :mod:`deft.runtime.hierarchy`) a
plain bucket's all-reduce crosses each host's NIC once, but a hook's collectives run on the link's flat
group and cross it more: the bytes above are then multiplied by :func:`flat_path_factor`, so that they
stay the bytes of an all-reduce (the link's hierarchical one) that costs what the hook's sends cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from deft.runtime.codecs import int8
from deft.runtime.codecs.hooks import CommHook


def int8_nbytes(n: int, world: int, scatter_ok: bool = True) -> int:
    """The bytes of an all-reduce that costs what int8's path for a bucket of ``n`` elements over
    ``world`` ranks costs (module docstring); ``scatter_ok``: the scatter path may run
    (:func:`deft.runtime.codecs.int8.scatter_supported`)."""
    if int8.uses_scatter(n, world, scatter_ok):
        return int8.scatter_nbytes(n, world)
    return int8.gather_nbytes(n, world)


def int8_fewer_bytes(world: int, numels: Sequence[int] = (2 ** 20,), scatter_ok: bool = True) -> bool:
    """Whether int8 puts fewer bytes on the wire than a 16-bit all-reduce, summed over buckets of
    ``numels`` elements at ``world`` ranks (default: one bucket of a million elements, where the scales'
    and the padding's share is small): the honest break-even of the path the hook takes."""
    return sum(int8_nbytes(n, world, scatter_ok) for n in numels) < 2 * sum(numels)


def flat_path_factor(hosts: int, per_host: int, all_to_all: bool) -> float:
    """How many times the bytes a collective on the flat group puts on each host's NIC exceed those of
    the hierarchical all-reduce priced at the same size, ``hosts`` H of ``per_host`` M ranks (N = H M;
    1 where H or M is 1, the links then flat):

    * a ring over the N ranks in rank order (torch's 16-bit hooks, int8's all-gather path): each host's
      NIC carries ``2 (N - 1) / N X``, the hierarchical all-reduce ``2 (H - 1) / H X``: the factor is
      ``(N - 1) H / (N (H - 1))`` (1.5 at 2 x 2);
    * ``all_to_all``, int8's scatter path (an all-to-all, then an exchange, of N chunks of ``X / N``):
      each rank sends ``N - M`` of its chunks across hosts in each, M ranks a host, so each NIC carries
      ``2 M (N - M) / N X = 2 M (H - 1) / H X``: the factor is M."""
    if hosts < 2 or per_host < 2:
        return 1.0
    if all_to_all:
        return float(per_host)
    n = hosts * per_host
    return (n - 1) * hosts / (n * (hosts - 1))


def wire_nbytes(hook: CommHook, shapes: Sequence[Sequence[int]], element_size: int,
                scatter_ok: bool = True, hosts: tuple[int, int] | None = None) -> int | None:
    """Bytes the hook puts on the wire for one bucket whose gradients have ``shapes`` (module docstring).

    ``None`` for a hook whose maths deft does not know; ``scatter_ok``: int8's scatter path may run;
    ``hosts``: ``(H, M)`` where the links all-reduce hierarchically (:func:`flat_path_factor`).
    Summed over the hook's collectives, as each
    carries its tensor through the same all-reduce (PowerSGD: the uncompressed tensors, P, then Q).
    """
    # the world the hook's collectives span: every rank (the hierarchy's hosts x ranks per host)
    world = hosts[0] * hosts[1] if hosts is not None else dist.get_world_size() if dist.is_initialized() else 1
    size = _flat_wire_nbytes(hook, shapes, element_size, scatter_ok, world)
    if size is None or hosts is None:
        return size
    numel = sum(math.prod(sh) for sh in shapes)
    scatter = hook.hook is int8.int8_compress_hook and int8.uses_scatter(numel, world, scatter_ok)
    return math.ceil(size * flat_path_factor(hosts[0], hosts[1], scatter))


def _flat_wire_nbytes(hook: CommHook, shapes: Sequence[Sequence[int]], element_size: int,
                      scatter_ok: bool, world: int) -> int | None:
    numel = sum(math.prod(sh) for sh in shapes)
    if hook.hook in (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook):
        return 2 * numel
    if hook.hook is int8.int8_compress_hook:
        return int8_nbytes(numel, world, scatter_ok)
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


