"""The schemes DeFT is compared with, as their papers define them (pure Python, no torch).

Every function here works on plain per-tensor numbers so that it can be tested against brute force;
:mod:`deft.solver.simulate` adapts them to a :class:`~deft.profile.Profile` and executes the result.

Cost model shared by all of them (MG-WFBP eq. 10, US-Byte eq. 1): one all-reduce of ``M`` bytes takes
``T(M) = alpha + beta * M`` seconds, one at a time per link. Merging two messages therefore saves one
``alpha`` (MG-WFBP eq. 11) and splitting one costs one more ``alpha``.

* **torch DDP** (:func:`ddp_buckets`): wait-free backpropagation (WFBP) with tensor fusion: tensors in
  backward-ready order are packed into buckets, a bucket closes once it reaches its cap (1 MiB for the
  first bucket, then ``bucket_cap_mb``, torch's ``_DEFAULT_FIRST_BUCKET_BYTES`` rule).
* **MG-WFBP** (:func:`mgwfbp_merge`): merge consecutive layers so that the last all-reduce ends as early
  as possible; ``method="paper"`` is Algorithm 1 of Shi et al. (the one compared under MG-WFBP's name),
  ``method="optimal"`` a dynamic program over contiguous groups that is exactly optimal for the same
  timing model (:func:`mgwfbp_time`), a named option.
* **ByteScheduler** (:func:`partition_sizes`): tensors cut into ``partition`` bytes, the input side
  first (priority), a piece handed to the link only while the remaining credit exceeds its size (its
  Algorithm 1, Peng et al.); the queueing itself is dynamic and lives in the simulator.
* **US-Byte** (:func:`usbyte_phase1`, :func:`usbyte_priorities`, :func:`usbyte_plan`): Algorithms 1 and 2
  of Gao et al. (US-Byte, IEEE TPDS 2023): unequal-sized blocks (a variable number of basic blocks per
  all-reduce) during backward, a greedy priority order for that phase, then sequential (input first)
  order afterwards.

Indexing: MG-WFBP and US-Byte functions index layers from the input (``0``) to the output (``L-1``),
as the brief of ``mgwfbp_merge`` asks; backward runs from ``L-1`` down to ``0``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_BYTES = 25 * 1024 * 1024


# --------------------------------------------------------------------------------------------------
# torch DDP
# --------------------------------------------------------------------------------------------------
def ddp_buckets(nbytes: Sequence[int], cap_bytes: int = DDP_BUCKET_BYTES, *,
                first_cap_bytes: int | None = DDP_FIRST_BUCKET_BYTES) -> list[list[int]]:
    """torch DDP's bucket assignment of tensors given in backward-ready order (index 0 ready first).

    A bucket takes tensors until its size reaches its cap, then closes: the first bucket's cap is
    ``first_cap_bytes`` (torch: 1 MiB, so the first all-reduce starts early), the others ``cap_bytes``.
    ``first_cap_bytes=None`` uses ``cap_bytes`` for every bucket. Returns the buckets as lists of tensor
    indices, in the order they are all-reduced; every index appears exactly once, in order.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
    caps = [first_cap_bytes if first_cap_bytes is not None else cap_bytes, cap_bytes]
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, b in enumerate(nbytes):
        if b < 0:
            raise ValueError(f"nbytes[{i}] must be >= 0, got {b}")
        current.append(i)
        size += b
        if size >= caps[min(len(buckets), 1)]:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


# --------------------------------------------------------------------------------------------------
# MG-WFBP
# --------------------------------------------------------------------------------------------------
def _check_layers(backward_s: Sequence[float], nbytes: Sequence[float], alpha: float, beta: float) -> None:
    if len(backward_s) != len(nbytes):
        raise ValueError(f"backward_s has {len(backward_s)} layers but nbytes has {len(nbytes)}")
    if not backward_s:
        raise ValueError("expected at least one layer")
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got {alpha}, {beta}")
    if any(t < 0 for t in backward_s) or any(p < 0 for p in nbytes):
        raise ValueError("backward times and sizes must be >= 0")


def _backward_ends(backward_s: Sequence[float]) -> list[float]:
    """End of layer i's backward, measured from the start of backward (layer L-1 runs first)."""
    ends = [0.0] * len(backward_s)
    t = 0.0
    for i in range(len(backward_s) - 1, -1, -1):
        t += backward_s[i]
        ends[i] = t
    return ends


def mgwfbp_time(backward_s: Sequence[float], nbytes: Sequence[float], alpha: float, beta: float,
                groups: Sequence[Sequence[int]]) -> float:
    """MG-WFBP's timing model (its eqs. 6, 7, 24): when the last all-reduce ends, from backward start.

    A group of layers ``i..j`` is one all-reduce of ``alpha + beta * sum(nbytes[i..j])`` that starts once
    its lowest layer ``i`` has finished backward and the previous group's all-reduce has ended. Groups
    are all-reduced from the output side down. The iteration time is ``t_f`` plus this value.
    """
    _check_layers(backward_s, nbytes, alpha, beta)
    ends = _backward_ends(backward_s)
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(len(backward_s))):
        raise ValueError("groups must partition the layer indices 0..L-1")
    t = -math.inf
    for g in sorted(groups, key=lambda g: -min(g)):
        lo, hi = min(g), max(g)
        if sorted(g) != list(range(lo, hi + 1)):
            raise ValueError(f"group {list(g)} is not contiguous")
        t = max(t, ends[lo]) + alpha + beta * sum(nbytes[lo:hi + 1])
    return t


def mgwfbp_merge(backward_s: Sequence[float], nbytes: Sequence[float], alpha: float, beta: float,
                 method: str = "paper") -> list[list[int]]:
    """Contiguous groups of layers (input = 0 .. output = L-1) to all-reduce together.

    ``method="paper"``: Algorithm 1 of MG-WFBP. Walking from the output layer down, layer ``l`` becomes a
    *merged-gradient layer* (its gradient waits for layer ``l-1``'s) when
    ``tau_b[l-1] + t_b[l-1] - tau_c[l] < alpha`` (its eq. 38): waiting for the next layer costs less than
    the start-up time a separate all-reduce would add; communication start times are recomputed after
    each merge.

    ``method="optimal"``: the exact minimum of :func:`mgwfbp_time` over all contiguous groupings, by
    dynamic programming. ``E(i)``, the earliest end of the all-reduces of layers ``i..L-1`` when layer
    ``i`` is the lowest of its group, satisfies
    ``E(i) = min_{j >= i} max(E(j+1), end_b(i)) + alpha + beta * P(i..j)`` with ``E(L) = -inf``;
    ``max(x, r) + c`` is non-decreasing in ``x``, so an optimal plan's suffix is itself optimal. O(L^2).

    Groups are returned in ascending layer order, each as ascending indices.
    """
    _check_layers(backward_s, nbytes, alpha, beta)
    if method == "paper":
        return _mgwfbp_paper(backward_s, nbytes, alpha, beta)
    if method == "optimal":
        return _mgwfbp_optimal(backward_s, nbytes, alpha, beta)
    raise ValueError(f"method must be 'paper' or 'optimal', got {method!r}")


def _mgwfbp_paper(backward_s: Sequence[float], nbytes: Sequence[float], a: float, b: float) -> list[list[int]]:
    n = len(backward_s)
    p = [float(x) for x in nbytes]
    tc = [a + b * x for x in p]
    ends = _backward_ends(backward_s)  # tau_b[l] + t_b[l]; tau_b never changes under merging
    merged = [False] * n

    def comm_start() -> list[float]:  # CALCULATECOMMSTART, lines 20-25
        tau = [0.0] * n
        tau[n - 1] = ends[n - 1]
        for i in range(n - 2, -1, -1):
            tau[i] = max(tau[i + 1] + tc[i + 1], ends[i])
        return tau

    tau_c = comm_start()
    for i in range(n - 1, 0, -1):  # the paper's l = L .. 2
        if ends[i - 1] - tau_c[i] < a:  # eq. (38)
            tc[i] = 0.0
            p[i - 1] += p[i]
            tc[i - 1] = a + b * p[i - 1]
            tau_c = comm_start()
            merged[i] = True
    groups: list[list[int]] = []
    current: list[int] = []
    for i in range(n - 1, -1, -1):
        current.append(i)
        if not merged[i]:
            groups.append(sorted(current))
            current = []
    return sorted(groups)


def _mgwfbp_optimal(backward_s: Sequence[float], nbytes: Sequence[float], a: float, b: float) -> list[list[int]]:
    n = len(backward_s)
    ends = _backward_ends(backward_s)
    prefix = [0.0]
    for x in nbytes:
        prefix.append(prefix[-1] + x)
    best = [math.inf] * (n + 1)
    best[n] = -math.inf
    choice = [n] * n
    for i in range(n - 1, -1, -1):
        for j in range(i, n):
            t = max(best[j + 1], ends[i]) + a + b * (prefix[j + 1] - prefix[i])
            if t < best[i]:
                best[i], choice[i] = t, j
    groups = []
    i = 0
    while i < n:
        groups.append(list(range(i, choice[i] + 1)))
        i = choice[i] + 1
    return groups


# --------------------------------------------------------------------------------------------------
# ByteScheduler
# --------------------------------------------------------------------------------------------------
def partition_sizes(nbytes: int, partition_bytes: int) -> list[int]:
    """ByteScheduler's ``task.partition(unit)``: full ``partition_bytes`` pieces and one remainder."""
    if partition_bytes <= 0:
        raise ValueError(f"partition_bytes must be > 0, got {partition_bytes}")
    if nbytes <= 0:
        return [max(nbytes, 0)]
    full, rest = divmod(nbytes, partition_bytes)
    return [partition_bytes] * full + ([rest] if rest else [])


# --------------------------------------------------------------------------------------------------
# US-Byte
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UsbyteOp:
    """One all-reduce of US-Byte: ``nbytes`` of layer ``layer`` (input = 0), started at ``start_s``.

    ``phase`` is 1 (during backward) or 2 (after backward, sequential order); ``start_s`` is the model's
    start time measured from the start of backward.
    """

    layer: int
    nbytes: int
    phase: int
    start_s: float


@dataclass(frozen=True)
class UsbytePlan:
    ops: tuple[UsbyteOp, ...]
    priorities: tuple[int, ...]  # P1 per layer (input = 0); smaller = sent first in phase 1
    iteration_s: float  # the model's t_iter (eq. 12): backward + exposed communication + forward


def usbyte_phase1(backward_s: Sequence[float], nbytes: Sequence[int], alpha: float, beta: float,
                  sp: int, priority: Sequence[int]) -> tuple[list[UsbyteOp], list[int], float]:
    """US-Byte Algorithm 1: the all-reduces issued during backward, for phase-1 priorities ``priority``.

    Walking backward layer by layer, while the link is free before the current layer ``l`` ends its
    backward, the computed layer with the highest priority (smallest value) and remaining blocks is sent,
    with ``dB`` basic blocks of ``sp`` bytes chosen so that the all-reduce ends about when layer ``l``
    ends: Case 1 (gap < alpha) one block; Case 2 ``ceil((gap - alpha) / (beta sp))`` blocks; Case 3 all
    remaining blocks. A layer's blocks become available when its backward ends. Two consecutive
    all-reduces of the same layer are one all-reduce (the paper's ``i = i - 1``): we re-size the previous
    one from its own start. The last block of a layer may be partial (the paper's ``Delta t``): we use
    exact byte counts. Returns (ops, remaining bytes per layer, time the link is free after phase 1).
    """
    n = len(backward_s)
    ends = _backward_ends(backward_s)
    rem_bytes = [0] * n  # computed but not yet sent
    ops: list[UsbyteOp] = []
    cursor = ends[n - 1]

    def t_ar(x: float) -> float:
        return alpha + beta * x if x > 0 else 0.0

    for lay_l in range(n - 1, -1, -1):
        while ends[lay_l] - cursor > 0:
            avail = [i for i in range(n) if rem_bytes[i] > 0]
            if not avail:
                cursor = ends[lay_l]
                break
            lay = min(avail, key=lambda i: (priority[i], -i))
            if ops and ops[-1].layer == lay:
                last = ops.pop()
                rem_bytes[lay] += last.nbytes
                cursor = last.start_s
            gap = ends[lay_l] - cursor
            blocks_left = math.ceil(rem_bytes[lay] / sp)
            if gap < alpha:
                db = 1
            elif gap < t_ar(rem_bytes[lay]):
                db = math.ceil((gap - alpha) / (beta * sp)) if beta > 0 else blocks_left
            else:
                db = blocks_left
            db = max(1, min(db, blocks_left))
            size = min(db * sp, rem_bytes[lay])
            ops.append(UsbyteOp(layer=lay, nbytes=size, phase=1, start_s=cursor))
            rem_bytes[lay] -= size
            cursor += t_ar(size)
        rem_bytes[lay_l] = int(nbytes[lay_l])
    return ops, rem_bytes, cursor


def usbyte_iteration(backward_s: Sequence[float], forward_s: Sequence[float], nbytes: Sequence[int],
                     alpha: float, beta: float, sp: int, priority: Sequence[int]) -> UsbytePlan:
    """Phase 1 (Algorithm 1) then phase 2 (eqs. 9-11, sequential order, Theorem 1) and t_iter (eq. 12)."""
    ops, rem, cursor = usbyte_phase1(backward_s, nbytes, alpha, beta, sp, priority)
    n = len(backward_s)
    backward_end = _backward_ends(backward_s)[0]
    t = max(backward_end, cursor)
    done = [backward_end] * n  # when each layer's last block has been all-reduced
    for op in ops:
        done[op.layer] = max(done[op.layer], op.start_s + alpha + beta * op.nbytes)
    all_ops = list(ops)
    for lay in range(n):  # P2[l] = l: the input layer first
        if rem[lay] > 0:
            all_ops.append(UsbyteOp(layer=lay, nbytes=rem[lay], phase=2, start_s=t))
            t += alpha + beta * rem[lay]
            done[lay] = t
    tf = max(backward_end, done[0])
    for lay in range(1, n):
        tf = max(tf + forward_s[lay - 1], done[lay])
    return UsbytePlan(ops=tuple(all_ops), priorities=tuple(priority), iteration_s=tf + forward_s[n - 1])


def usbyte_priorities(backward_s: Sequence[float], forward_s: Sequence[float], nbytes: Sequence[int],
                      alpha: float, beta: float, sp: int) -> list[int]:
    """US-Byte Algorithm 2: greedy phase-1 priorities, starting from sequential order.

    From the output layer down, if layer ``l`` is first sent by phase-1 all-reduce ``i``, all of it would
    be done at ``tau = tau_ar[i] + T(M_l)``; when that falls within the backward of layer ``k-1`` (eq. 13)
    layer ``l``'s priority is raised above layer ``k``'s (ADJUSTPRIORITY), kept if the model's iteration
    time drops, in which case the walk continues below ``k``. O(L^3) model evaluations at most.
    """
    n = len(backward_s)
    ends = _backward_ends(backward_s)
    prio = list(range(n))  # P1[l] = l: input first
    best = usbyte_iteration(backward_s, forward_s, nbytes, alpha, beta, sp, prio).iteration_s
    lay = n - 1
    while lay >= 0:
        ops, _, _ = usbyte_phase1(backward_s, nbytes, alpha, beta, sp, prio)
        first = next((op for op in ops if op.layer == lay), None)
        if first is None:
            lay -= 1
            continue
        tau = first.start_s + alpha + beta * nbytes[lay]
        k = 0
        for kk in range(lay, -1, -1):
            if kk == 0 or ends[kk] < tau <= ends[kk - 1]:
                k = kk
                break
        cand = list(prio)
        cand[lay] = prio[k]
        for j in range(k, lay):
            cand[j] = prio[j] + 1
        t = usbyte_iteration(backward_s, forward_s, nbytes, alpha, beta, sp, cand).iteration_s
        if t < best:
            best, prio = t, cand
            lay = k
        lay -= 1
    return prio


def usbyte_plan(backward_s: Sequence[float], forward_s: Sequence[float], nbytes: Sequence[int],
                alpha: float, beta: float, sp: int) -> UsbytePlan:
    """The complete US-Byte schedule: Algorithm 2's priorities, then Algorithm 1 and phase 2."""
    if len(forward_s) != len(backward_s):
        raise ValueError("forward_s and backward_s must have one entry per layer")
    _check_layers(backward_s, [float(x) for x in nbytes], alpha, beta)
    if sp <= 0:
        raise ValueError(f"basic partition size must be > 0, got {sp}")
    prio = usbyte_priorities(backward_s, forward_s, nbytes, alpha, beta, sp)
    return usbyte_iteration(backward_s, forward_s, nbytes, alpha, beta, sp, prio)
