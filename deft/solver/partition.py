"""Tensor partition and fusion of buckets before planning (DeFT paper, section III.D).

DeFT packs buckets into per-stage knapsacks whose capacity is a stage's computation time. A bucket
whose communication takes longer than the smallest knapsack never fits and is delayed forever, so
buckets are first *split*; and a run of tiny buckets whose all-reduce time is mostly the per-message
latency ``alpha`` wastes that latency once per bucket, so such runs are *fused* (US-Byte / MG-WFBP).

Model of a piece
----------------
The runtime lays buckets out as contiguous ranges of the flat gradient in backward-ready order, so
the new buckets are contiguous element ranges of the concatenation of the old ones, in order. A piece
holding the fraction ``f = numel_piece / numel_bucket`` of bucket ``b`` gets

* ``forward_s = f * forward_s(b)`` and ``backward_s = f * backward_s(b)`` (compute split in
  proportion to size). The gradient of one parameter appears at once, when its layer's backward
  ends, so the simulator makes a send of a piece of a cut parameter wait for the backward of the
  parameter's last piece (:attr:`deft.profile.Profile.gradient_ready`), as the runtime does and
  the planners do (``Profile.ready_s``); the paper's model (each piece
  ready after its own share of the backward) let a piece go up to ``(k - 1) / k`` of the layer's
  backward too early (measured: benchmarks/results/replay.md);
* on each link with a *measured* time ``c``: ``alpha + (c - alpha) * f`` with ``alpha`` the link's
  fitted latency (clamped to ``c``): every message pays the latency once, the rest scales with bytes.
  Links without a measured time keep using the link's fitted model on the piece's bytes.

Under a codec (``Profile.codec``) a piece's wire bytes and codec compute are the same fraction ``f``
of the bucket's (``wire_nbytes``, ``codec_s``): proportional, an approximation for PowerSGD, whose
wire size depends on the matrix shapes a piece cuts; links without a measured time use the model on
the piece's wire bytes.

Fusing ``k`` consecutive buckets adds their compute times and, per link with measured times, their
communication times minus ``(k - 1) * alpha`` (``k - 1`` fewer messages).

Rules (each enforced on the result)
-----------------------------------
1. Order and contiguity: the element ranges of the new buckets tile ``0 .. total numel`` in order,
   and ``sum numel``, ``sum nbytes``, ``sum forward_s`` and ``sum backward_s`` are unchanged.
2. No bucket (split or fused) exceeds ``config.partition_numel`` elements. Exception: under a PowerSGD
   codec nothing is split (:func:`keeps_tensors_whole`); rules 2 and 3 then hold for fused buckets only.
3. No bucket's communication time on the primary link exceeds ``capacity_s`` (default
   :func:`default_capacity`: the smallest knapsack in primary-link time, as the paper states it,
   "typically the forward time divided by mu").
   If even one element costs more than ``capacity_s`` (the latency ``alpha`` alone does), this is
   impossible and a :class:`~deft.errors.ContractError` names the link; with ``best_effort=True``
   (what the planner uses) such a bucket is split only as far as that helps (at most
   ``BEST_EFFORT_MAX_PIECES`` pieces beyond the numel cap's) and stays over the cap. Best effort
   also stays over the cap rather than cut pieces whose bandwidth part is under ``alpha`` (a
   capacity under ``2 alpha``): those pay mostly latency, and rule 4 would fuse them back.
4. Fusion: consecutive buckets are fused while the fused bucket's bandwidth part (time minus
   ``alpha``) on the primary link stays at most ``alpha``, i.e. while latency dominates, and rules
   2 and 3 still hold. With ``alpha == 0`` nothing is fused (there is nothing to save).

The result is the input profile itself when nothing had to change (so partitioning is idempotent and
keeps the profile's digest), else a new profile whose ``meta["partition"]`` records, for every new
bucket, the ``[old bucket, start, stop)`` element segments it is made of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from deft.config import DeftConfig
from deft.errors import ContractError
from deft.profile import PARAM_RANGE, Bucket, BucketTimes, Profile
from deft.schedule import Schedule

__all__ = ["BEST_EFFORT_MAX_PIECES", "default_capacity", "link_slowdowns", "partition"]

_SOURCE = "partition"
# Best effort never splits one bucket into more pieces than this (beyond the numel cap's count).
BEST_EFFORT_MAX_PIECES = 64


@dataclass(frozen=True)
class _Segment:
    """Elements ``[start, stop)`` of old bucket ``bucket``."""

    bucket: int
    start: int
    stop: int


@dataclass(frozen=True)
class _Piece:
    """A new bucket under construction: its segments, sizes and times."""

    segments: tuple[_Segment, ...]
    params: tuple[str, ...]
    numel: int
    nbytes: int
    times: BucketTimes
    wire: int  # bytes on the wire per send (== nbytes without a codec)
    coded: bool = False  # its profile bucket(s) are sent with the profile's codec (Bucket.wire_nbytes set)


def link_slowdowns(profile: Profile) -> tuple[float, ...]:
    """``mu_j`` per link: its total all-reduce time over the primary link's (the primary's is 1).

    The paper's ``mu`` (gloo 1.65x slower than NCCL) is the second link's. A link without time to
    compare with (the primary's total is 0) counts as 1.
    """
    primary = profile.link_names[0]
    base = math.fsum(profile.comm_time(b, primary) for b in range(profile.n))
    if base <= 0:
        return tuple(1.0 for _ in profile.link_names)
    return tuple(math.fsum(profile.comm_time(b, name) for b in range(profile.n)) / base for name in profile.link_names)


def default_capacity(profile: Profile) -> float:
    """The smallest knapsack, in time on the primary link (paper III.D: "the smallest knapsack capacity
    (typically the forward time divided by mu)").

    A stage offers every link its computation time ``T`` (the smaller positive of the total forward and
    backward times); link ``j`` carries ``T / mu_j`` of primary-link all-reduce time in it
    (:func:`link_slowdowns`), so the smallest is ``T / max(1, max_j mu_j)``. A bucket under it fits
    every knapsack of every stage alone.
    """
    positive = [x for x in (profile.forward_s, profile.backward_s) if x > 0]
    if not positive:
        raise ContractError(_SOURCE, "profile.times", "forward_s and backward_s are all 0: no capacity to plan in")
    # (never 0: a link absurdly slower than the primary could underflow the quotient)
    return max(min(positive) / max(1.0, *link_slowdowns(profile)), math.ulp(0.0))


def partition(profile: Profile, config: DeftConfig, capacity_s: float | None = None, *,
              best_effort: bool = False) -> Profile:
    """Split and fuse ``profile``'s buckets so the planner's knapsacks can hold every one.

    See the module docstring for the rules. ``capacity_s`` is the smallest knapsack capacity in
    seconds (default :func:`default_capacity`). When rule 3 is impossible for a bucket, this raises,
    unless ``best_effort``: then that bucket is split only as far as it helps (by the numel cap, or
    down to single elements when latency is not the obstacle) and stays above ``capacity_s`` (the
    planner then accepts a bubble for it, see :mod:`deft.solver.plan`).
    """
    if not isinstance(profile, Profile):
        raise ContractError(_SOURCE, "profile", f"expected a deft.Profile, got {type(profile).__name__}")
    if not isinstance(config, DeftConfig):
        raise ContractError(_SOURCE, "config", f"expected a deft.DeftConfig, got {type(config).__name__}")
    if capacity_s is None:
        capacity_s = default_capacity(profile)
    if isinstance(capacity_s, bool) or not isinstance(capacity_s, (int, float)) or not math.isfinite(capacity_s) \
            or capacity_s <= 0:
        raise ContractError(_SOURCE, "capacity_s", f"expected a finite number > 0, got {capacity_s!r}")

    primary = profile.links[0]
    sizes = _param_sizes(profile)
    pieces: list[_Piece] = []
    changed = False
    whole = keeps_tensors_whole(profile)
    for b in profile.buckets:
        parts = 1 if whole else _split_count(profile, b.id, config.partition_numel, float(capacity_s), best_effort)
        changed |= parts > 1
        pieces.extend(_split(profile, b.id, parts, sizes))
    fused = _fuse(profile, pieces, config.partition_numel, float(capacity_s))
    changed |= len(fused) != len(pieces)
    if not changed:
        return profile

    buckets = tuple(Bucket(i, p.params, p.numel, p.nbytes, p.wire if p.coded else None)
                    for i, p in enumerate(fused))
    times = tuple(p.times for p in fused)
    meta = dict(profile.meta)
    meta["partition"] = {
        "capacity_s": float(capacity_s),
        "partition_numel": config.partition_numel,
        "primary_link": primary.name,
        "source_buckets": profile.n,
        "segments": [[[s.bucket, s.start, s.stop] for s in p.segments] for p in fused],
    }
    return replace(profile, buckets=buckets, times=times, meta=meta)


# ------------------------------------------------------------------------------------------------
# splitting


def keeps_tensors_whole(profile: Profile) -> bool:
    """Under a codec that is not element-wise (PowerSGD, an unknown hook) no bucket is split: PowerSGD
    compresses each gradient *matrix* of a bucket to rank ``r`` and sends a 1-D piece of a split
    parameter uncompressed, so cutting a large weight into pieces sent more than torch DDP + PowerSGD's
    whole buckets (measured: benchmarks/results/peers.md, "What deft loses"). The
    knapsack then treats an over-capacity bucket as the planner's bubble, as for ``best_effort``;
    fusing whole buckets keeps their matrices whole and is still done."""
    return profile.compressed and not profile.elementwise_codec


def _split_count(profile: Profile, b: int, partition_numel: int, capacity: float, best_effort: bool) -> int:
    """Fewest equal pieces of bucket ``b`` meeting the numel cap and the primary-link time cap."""
    bucket = profile.buckets[b]
    numel = bucket.numel
    parts = max(1, math.ceil(numel / partition_numel)) if numel > 0 else 1
    primary = profile.links[0].name
    if profile.comm_time(b, primary) <= capacity and parts == 1:
        return 1
    # Start from the latency model's estimate, then verify on the real piece times (uneven rounding).
    c = profile.comm_time(b, primary)
    alpha = min(profile.links[0].alpha_s, c)
    if c > capacity:
        if alpha >= capacity or numel == 0:
            if best_effort:  # more pieces would only pay the latency more often
                return parts
            raise ContractError(
                _SOURCE, f"links[0] ({primary})",
                f"bucket {b} takes {c:.6g} s and cannot be split below the capacity {capacity:.6g} s "
                f"(per-message latency alpha_s = {profile.links[0].alpha_s:.6g} s, numel = {numel})",
            )
        est = (c - alpha) / (capacity - alpha)  # may overflow for a denormal capacity
        need = numel if not math.isfinite(est) or est >= numel else math.ceil(est)
        most = _best_effort_pieces(c, alpha)
        if best_effort and need > max(parts, most):
            # Out of reach without latency-bound pieces (a capacity under 2 alpha) or far out of reach (a
            # near-zero capacity): the pieces that still pay, and the planner's bubble.
            return min(numel, max(parts, most))
        parts = max(parts, need)
    parts = min(parts, numel) if numel > 0 else 1
    while _largest_piece_time(profile, b, parts) > capacity:
        if parts >= numel:
            if best_effort:
                return parts
            raise ContractError(
                _SOURCE, f"links[0] ({primary})",
                f"bucket {b}: one element already takes longer than the capacity {capacity:.6g} s",
            )
        parts += 1
    return parts


def _best_effort_pieces(c: float, alpha: float) -> int:
    """The most pieces best effort cuts a bucket of primary-link time ``c`` into: at most
    :data:`BEST_EFFORT_MAX_PIECES`, and none whose bandwidth part ``(c - alpha) / k`` is under
    ``alpha``. Such a piece is latency-bound: rule 4 would fuse it back, and each one more adds
    ``alpha`` to the link's time. Without this bound a small model profiled with alpha close to the
    capacity is cut into hundreds of pieces, and the lag-free planner's time grows with their number
    (benchmarks/results/planner.md)."""
    if alpha <= 0:
        return BEST_EFFORT_MAX_PIECES
    return max(1, min(BEST_EFFORT_MAX_PIECES, math.floor((c - alpha) / alpha * (1 + 1e-9))))


def _bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges tiling ``0..numel`` whose sizes differ by at most one."""
    return [(numel * k // parts, numel * (k + 1) // parts) for k in range(parts)]


def _piece_times(profile: Profile, b: int, frac: float) -> BucketTimes:
    t = profile.times[b]
    comm: dict[str, float] = {}
    for name, c in t.comm_s.items():
        alpha = min(profile.link(name).alpha_s, c)
        comm[name] = alpha + (c - alpha) * frac
    return BucketTimes(forward_s=t.forward_s * frac, backward_s=t.backward_s * frac, comm_s=comm,
                       codec_s=t.codec_s * frac)


def _piece_nbytes(bucket: Bucket, start: int, stop: int) -> int:
    """Bytes of elements ``[start, stop)``: exact for one dtype, else proportional with exact sums."""
    if bucket.numel == 0:
        return bucket.nbytes
    if bucket.nbytes % bucket.numel == 0:
        return (stop - start) * (bucket.nbytes // bucket.numel)
    return bucket.nbytes * stop // bucket.numel - bucket.nbytes * start // bucket.numel


def _piece_wire(bucket: Bucket, start: int, stop: int) -> int:
    """Wire bytes of elements ``[start, stop)``: the same share of the bucket's, with exact sums."""
    if bucket.numel == 0:
        return bucket.wire
    return bucket.wire * stop // bucket.numel - bucket.wire * start // bucket.numel


def _comm_on(profile: Profile, times: BucketTimes, nbytes: int, link: str) -> float:
    """What ``Profile.comm_time`` will say for a bucket with these times and (wire) bytes."""
    measured = times.comm_s.get(link)
    return measured if measured is not None else profile.link(link).time(nbytes)


def _largest_piece_time(profile: Profile, b: int, parts: int) -> float:
    bucket = profile.buckets[b]
    primary = profile.links[0].name
    worst = 0.0
    for start, stop in _bounds(bucket.numel, parts):
        frac = (stop - start) / bucket.numel if bucket.numel else 1.0
        t = _piece_times(profile, b, frac)
        worst = max(worst, _comm_on(profile, t, _piece_wire(bucket, start, stop), primary))
    return worst


def _split(profile: Profile, b: int, parts: int, sizes: dict[str, int]) -> list[_Piece]:
    bucket = profile.buckets[b]
    if parts == 1:
        return [_Piece((_Segment(b, 0, bucket.numel),), bucket.params, bucket.numel, bucket.nbytes, profile.times[b],
                       bucket.wire, bucket.wire_nbytes is not None)]
    out = []
    for start, stop in _bounds(bucket.numel, parts):
        frac = (stop - start) / bucket.numel
        out.append(_Piece(
            segments=(_Segment(b, start, stop),),
            params=_range_names(bucket, start, stop, sizes),
            numel=stop - start,
            nbytes=_piece_nbytes(bucket, start, stop),
            times=_piece_times(profile, b, frac),
            wire=_piece_wire(bucket, start, stop),
            coded=bucket.wire_nbytes is not None,
        ))
    return out


def _param_sizes(profile: Profile) -> dict[str, int]:
    """Element counts of parameters, from ``meta["param_numel"]`` when the profiler recorded them."""
    raw = profile.meta.get("param_numel")
    if not isinstance(raw, dict):
        return {}
    return {str(k): int(v) for k, v in raw.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def _size_of(name: str, sizes: dict[str, int]) -> int | None:
    if name in sizes:
        return sizes[name]
    m = PARAM_RANGE.match(name)
    return int(m.group(3)) - int(m.group(2)) if m else None


def _range_names(bucket: Bucket, start: int, stop: int, sizes: dict[str, int]) -> tuple[str, ...]:
    """Names of the parameter ranges that elements ``[start, stop)`` of ``bucket`` cover.

    Exact (``"fc.weight[0:6500000]"``) when the bucket holds one parameter or every parameter's size
    is known and they add up to the bucket; otherwise one name ``"a|b|c[start:stop]"`` stating the
    range within the concatenation of the bucket's parameters (the profile does not say more).
    """
    params = bucket.params
    known = [_size_of(p, sizes) for p in params]
    if len(params) == 1:
        known = [bucket.numel]
    if not params or any(k is None for k in known) or sum(k for k in known if k is not None) != bucket.numel:
        label = "|".join(params) if params else f"bucket{bucket.id}"
        return (f"{label}[{start}:{stop}]",)
    names: list[str] = []
    offset = 0
    for p, size in zip(params, known, strict=True):
        assert size is not None
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi:
            names.append(p if (lo, hi) == (offset, offset + size) else _sub_range(p, lo - offset, hi - offset))
        offset += size
    return tuple(names)


def _sub_range(name: str, lo: int, hi: int) -> str:
    """``name[lo:hi]``, composing with a range the name already carries (re-partitioned profiles)."""
    m = PARAM_RANGE.match(name)
    if m:
        base = int(m.group(2))
        return f"{m.group(1)}[{base + lo}:{base + hi}]"
    return f"{name}[{lo}:{hi}]"


# ------------------------------------------------------------------------------------------------
# fusion


def _fuse(profile: Profile, pieces: list[_Piece], partition_numel: int, capacity: float) -> list[_Piece]:
    """Greedy left-to-right fusion of latency-dominated runs (rule 4 of the module docstring)."""
    primary = profile.links[0]
    alpha = primary.alpha_s
    if alpha <= 0 or len(pieces) < 2:
        return pieces
    out = [pieces[0]]
    for piece in pieces[1:]:
        cand = _merge(profile, out[-1], piece)
        t = _comm_on(profile, cand.times, cand.wire, primary.name)
        # Relative slack: fused times are float sums, and "bandwidth part == alpha" must not hinge on ulps.
        # A bucket is sent with one codec or none (Schedule.codecs): coded and exact pieces never fuse.
        if t - alpha <= alpha * (1 + 1e-9) and t <= capacity and cand.numel <= partition_numel \
                and out[-1].coded == piece.coded:
            out[-1] = cand
        else:
            out.append(piece)
    return out


def _merge(profile: Profile, a: _Piece, b: _Piece) -> _Piece:
    comm: dict[str, float] = {}
    for name in set(a.times.comm_s) | set(b.times.comm_s):
        ca = _comm_on(profile, a.times, a.wire, name)
        cb = _comm_on(profile, b.times, b.wire, name)
        if name in a.times.comm_s and name in b.times.comm_s:
            comm[name] = ca + cb - min(profile.link(name).alpha_s, ca, cb)
        # else: one side is unmeasured; let the fused bucket fall back to the link model on its bytes
    segs = list(a.segments)
    for s in b.segments:
        if segs and segs[-1].bucket == s.bucket and segs[-1].stop == s.start:
            segs[-1] = _Segment(s.bucket, segs[-1].start, s.stop)
        else:
            segs.append(s)
    return _Piece(
        segments=tuple(segs),
        params=a.params + b.params,
        numel=a.numel + b.numel,
        nbytes=a.nbytes + b.nbytes,
        times=BucketTimes(a.times.forward_s + b.times.forward_s, a.times.backward_s + b.times.backward_s, comm,
                          a.times.codec_s + b.times.codec_s),
        wire=a.wire + b.wire,
        coded=a.coded,
    )


def profile_for_schedule(profile: Profile, schedule: Schedule, config: DeftConfig) -> Profile:
    """The profile whose buckets ``schedule`` refers to: ``profile`` itself or its DeFT partition.

    The planner partitions buckets (section III.D) before planning; a schedule records only the bucket
    sizes, so the partition is recomputed (with the capacity recorded in ``schedule.meta["capacity_s"]``
    when the planner left one) and must reproduce them.
    """
    sizes = tuple(b.nbytes for b in profile.buckets)
    if sizes == schedule.bucket_nbytes:
        return profile
    caps: list[float | None] = [None]
    cap = schedule.meta.get("capacity_s")
    if isinstance(cap, (int, float)) and not isinstance(cap, bool):
        caps.insert(0, float(cap))
    for c in caps:
        parted = partition(profile, config, capacity_s=c, best_effort=True)
        if tuple(b.nbytes for b in parted.buckets) == schedule.bucket_nbytes:
            return parted
    raise ContractError("<schedule>", "bucket_nbytes",
                        f"the schedule's {schedule.n_buckets} buckets match neither the profile's {profile.n} "
                        "nor its partition; was it planned on another profile?")
