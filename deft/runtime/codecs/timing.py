"""Timing a codec on the profile's buckets, the same result on every rank.

A codec's cost in the profile (DESIGN.md, "Compression in the profile") is its bytes on the wire per
bucket (:func:`deft.runtime.codecs.wire.wire_nbytes`) and its compute: the hook run on each bucket
(once per class of buckets alike) on a one-rank process group (its collectives then move nothing), on
a scratch copy of its state, timed from the call to its future's completion: encode, the hook's own
compute between its collectives, decode (:func:`time_hook`). :func:`measure_codec` takes the maximum
over the ranks, so every rank prices the same codec.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from deft.errors import DeftError
from deft.runtime.buckets import FlatLayout
from deft.runtime.codecs import int8
from deft.runtime.codecs.hooks import CommHook, HookBucket, codec_name, hook_bucket, hook_result
from deft.runtime.codecs.wire import wire_nbytes
from deft.runtime.control import ControlPlane


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


def measure_here(hook: CommHook, layout: FlatLayout, params: Sequence[torch.Tensor], group: dist.ProcessGroup,
                 device: torch.device, hosts: tuple[int, int] | None = None) -> Codec:
    """This rank's :class:`Codec` for ``layout``: wire bytes from :func:`wire_nbytes` (``hosts``: the
    links' ``(hosts, ranks per host)`` where they all-reduce hierarchically), compute from
    :func:`time_hook` on random gradients on ``group`` (a one-rank group). A bucket mixing dtypes
    cannot be hooked at all (the executor refuses it), so it is given its plain size and no compute."""
    buffers = layout.new_buffers(device)
    buckets, wire, known = [], [], True
    filled: set[tuple[object, ...]] = set()
    for b in range(layout.n_buckets):
        views = layout.bucket_views(buffers, b)
        if len(views) != 1:
            wire.append(sum(v.numel() * v.element_size() for v in views))
            continue
        view = views[0]
        hb = hook_bucket(layout, params, b, view, is_last=b == layout.n_buckets - 1)
        if _alike(hb) not in filled:  # only the first of buckets alike is timed (time_hook)
            filled.add(_alike(hb))
            view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(b)).to(view.dtype))
        size = wire_nbytes(hook, [tuple(g.shape) for g in hb.gradients()], view.element_size(),
                           int8.scatter_supported(None, view.device), hosts)
        known &= size is not None
        wire.append(size if size is not None else view.numel() * view.element_size())
        buckets.append(hb)
    seconds = time_hook(hook, group, buckets)
    per_bucket = dict.fromkeys(range(layout.n_buckets), 0.0)
    if seconds is not None:
        per_bucket.update({hb.index(): sec for hb, sec in zip(buckets, seconds, strict=True)})
    return Codec(codec_name(hook), tuple(wire), tuple(per_bucket[b] for b in range(layout.n_buckets)),
                 wire_known=known, timed=seconds is not None)



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
    if isinstance(st, int8.Int8State):
        return True, int8.Int8State(group, seed=st.seed + 1)  # the training's draws stay untouched
    return False, None


def time_hook(hook: CommHook, group: dist.ProcessGroup, buckets: Sequence[HookBucket],
               repeats: int = 3) -> list[float] | None:
    """Seconds of the hook's compute per bucket: the hook on ``group`` (one rank: its collectives move
    nothing), from the call to its future's value, the median of ``repeats`` runs after one untimed
    run (which allocates PowerSGD's memories), once per class of buckets alike (Note [buckets alike]
    in :func:`_time_buckets`); the buckets' buffers are overwritten.
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
    """Each bucket's seconds; buckets alike (:func:`_alike`) are timed once, on the first of them.

    Note [buckets alike]: a hook's compute is a function of the gradients it is handed, their shapes,
    dtype and device (and, for PowerSGD, whether the bucket is the iteration's last), not of their
    values; a model of repeated blocks (a transformer's layers) has many buckets alike, and timing each
    costs the planning iteration ``(repeats + 1)`` runs of the codec over the whole model."""
    timed: dict[tuple[object, ...], float] = {}
    out = []
    for bucket in buckets:
        key = _alike(bucket)
        if key not in timed:
            timed[key] = _time_one(hook, state, bucket, repeats)
        out.append(timed[key])
    return out


def _alike(bucket: HookBucket) -> tuple[object, ...]:
    """What a hook's compute on ``bucket`` depends on: its gradients' shapes, dtype, device, last-ness."""
    buf = bucket.buffer()
    return (tuple(tuple(g.shape) for g in bucket.gradients()), buf.dtype, buf.device, bucket.is_last())


def _time_one(hook: CommHook, state: object, bucket: HookBucket, repeats: int) -> float:
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
    return sorted(runs)[len(runs) // 2]


def measure_codec(hook: CommHook | None, layout: FlatLayout, params: Sequence[torch.Tensor],
                solo: dist.ProcessGroup | None, device: torch.device, control: ControlPlane,
                hosts: tuple[int, int] | None = None) -> Codec | None:
    """Collective: the comm hook's wire bytes and compute per bucket of the profiled layout, the same on
    every rank (the codec timed by :func:`measure_here` on each rank's one-rank group ``solo``; the
    maximum over ranks). A failure on any rank raises the same error on every rank, after the
    collective, so no rank is left waiting. None without a hook."""
    if hook is None:
        return None
    assert solo is not None
    n = layout.n_buckets
    codec: Codec | None = None
    error: str | None = None
    try:
        codec = measure_here(hook, layout, params, solo, device, hosts)
        row = [*codec.codec_s, 0.0]
    except Exception as e:  # every rank must leave the collective below: a flag, then the same error
        row, error = [0.0] * n + [1.0], f"{type(e).__name__}: {e}"
    seconds = control.max_rows([row], "comm hook codec times")[0]
    if seconds[-1] > 0 or codec is None:
        raise DeftError(f"comm hook {hook.name!r} failed while deft timed its codec on a one-rank group"
                        + (f" on rank {control.rank}: {error}" if error else
                           f" on a rank other than {control.rank} (its error says which bucket and why)"))
    return dataclasses.replace(codec, codec_s=tuple(seconds[:-1]))
