"""The 0/1 multiple knapsack problem DeFT solves per stage (paper section III.C, Problem 2).

Problem
-------
Items ``i = 0..N-1`` (buckets waiting to be communicated) with value ``v_i >= 0``; knapsacks
``j = 0..M-1`` (one per communication link) with capacity ``c_j >= 0``; item ``i`` weighs
``w_ij >= 0`` in knapsack ``j`` (its communication time on link ``j``). Choose ``x_ij`` in {0, 1}::

    maximize    sum_ij v_i x_ij
    subject to  sum_i w_ij x_ij <= c_j     for every knapsack j
                sum_j x_ij      <= 1       for every item i

DeFT uses ``v_i`` = the item's communication time on the primary link, so the objective is the
communication time hidden under the stage's computation.

Invariants of every :class:`KnapsackSolution` returned by :func:`solve`
-----------------------------------------------------------------------
* Feasible exactly: for every knapsack the *real-number* sum of its items' weights is at most its
  capacity (so ``math.fsum(weights) <= capacity`` holds too; a naive left-to-right ``sum`` may
  exceed it by an ulp of rounding, which is not an infeasibility).
* ``value == math.fsum(values of packed items)``.
* ``value <= bound`` and ``bound`` is a proven upper bound on the optimum (the optimum measured
  the same way, i.e. the fsum of the packed values).
* ``optimal`` is True only when optimality is proven; the bound then exceeds the value by at
  most the rounding of the integer model (``len(values) * 2**-39`` of the total value, see
  :func:`_scaled_model`), otherwise ``bound - value`` is the remaining certified gap.
* Items of value 0 are never packed (they add nothing) and neither are items that fit no
  knapsack.

Methods
-------
``"exact"``: the greedy, improved by a local search (:func:`_improve`); if the LP bound
(:func:`_lp_bound`) already certifies it within ``relative_gap`` it is returned, otherwise
OR-Tools CP-SAT solves an integer model (floats scaled by powers of two, see
:func:`_scaled_model`) warm-started from it, stopped by its ``work_limit`` or when the
certified relative gap is at most ``relative_gap``. Trivial instances (nothing to choose,
everything fits) never reach the solver. When CP-SAT finds no solution within its work limit
the local search's answer is returned with method ``"exact->greedy"``.

``"greedy"``: the paper's heuristic (DeFT III.C): "start with the backpack with smaller
capacity, and try to prioritize placing the bucket with longer time". Capacities are compared
in the units of the values (the primary link's time): knapsack ``j`` holds
``c_j * sum_i v_i / sum_i w_ij`` of them, i.e. ``c_j / mu_j`` when link ``j`` is ``mu_j`` times
slower (the paper's gloo knapsack, ``F / mu`` in NCCL units). Items by value descending; each
knapsack takes the largest remaining item that still fits. ``O(N log N + N*M)``.

Determinism
-----------
The answer is a function of the input alone, never of the machine's load: the local search is
bounded by a count of the moves it scans, CP-SAT runs with one worker, a fixed seed and a
*deterministic* time budget (``work_limit``, in CP-SAT's deterministic time units, each of the order
of a second of one core's work; measured: benchmarks/results/knapsack.md). A wall-clock limit stays
only as a safety net: if CP-SAT reaches ``wall_limit_s`` before its work
budget (a badly overloaded machine), :func:`solve` raises :class:`SolverTimeout` rather than
return an answer that depends on the load.
"""

from __future__ import annotations

import functools
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from deft.errors import ContractError, DeftError

if TYPE_CHECKING:  # pragma: no cover - imported where CP-SAT runs
    from ortools.sat.python import cp_model

__all__ = ["METHODS", "KnapsackSolution", "SolverTimeout", "default_wall_limit", "load_cp_sat", "solve"]

METHODS = ("exact", "greedy")

_SOURCE = "knapsack.solve"
_MAX_NUMBER = 1e200
# Capacity of each knapsack in the integer model: c_j * 2**K_j lies in [2**29, 2**30), so one
# integer unit is at most 2**-29 of the capacity (2 ns of a 1 s stage). Large enough that the
# rounding never matters for scheduling, small enough to keep CP-SAT's LP well conditioned.
_WEIGHT_BITS = 30
# The total candidate value maps to [2**39, 2**40): values are rounded at ~1e-12 relative.
_VALUE_BITS = 40
# CP-SAT workers. One worker was as fast as the multi-worker portfolio on DeFT-like instances
# (measured: benchmarks/results/knapsack.md), leaves the cores to training, and (with a
# deterministic budget and a fixed seed) makes the search deterministic.
_NUM_WORKERS = 1
_RANDOM_SEED = 0
# Largest array a local-search move type may scan (elements); beyond it (hundreds of items) the
# 1-for-2 and exchange moves are skipped and CP-SAT does that work.
_MOVE_CELLS = 1 << 18
# The local search stops after scanning this many array elements in all (a deterministic bound on its
# work, unlike a time limit; instances of up to ~100 items converge far earlier).
_SEARCH_CELLS = 1 << 26


class SolverTimeout(DeftError, RuntimeError):
    """CP-SAT hit the wall-clock safety limit before its deterministic work budget.

    Raised instead of returning the solution found so far, which would depend on the machine's load.
    """


@dataclass(frozen=True)
class KnapsackSolution:
    """An assignment of items to knapsacks, with its value and a certified bound on the optimum."""

    link_of: tuple[int | None, ...]  # knapsack index per item, or None (item not packed)
    value: float  # total value packed (math.fsum of the packed items' values)
    bound: float  # proven upper bound on the optimum (== value up to model rounding when optimal)
    optimal: bool  # optimality proven
    method: str  # "exact" | "greedy" | "exact->greedy" (exact found nothing and fell back)
    solve_s: float  # wall time of the whole solve() call, seconds (information only: never decides anything)
    work: float = 0.0  # CP-SAT deterministic time spent (0 when CP-SAT was not needed)

    def items_in(self, j: int) -> list[int]:
        """Indices of the items packed into knapsack ``j``, ascending."""
        return [i for i, k in enumerate(self.link_of) if k == j]

    @property
    def gap(self) -> float:
        """Certified relative gap ``(bound - value) / bound`` (0 when the bound is 0)."""
        return (self.bound - self.value) / self.bound if self.bound > 0 else 0.0


# ----------------------------------------------------------------------------------------------
# validation


def _is_sequence(x: object) -> bool:
    return isinstance(x, np.ndarray) or (isinstance(x, Sequence) and not isinstance(x, (str, bytes)))


def _number(x: object, field: str) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise ContractError(_SOURCE, field, f"expected a number, got {type(x).__name__} {x!r}")
    f = float(x)
    if not math.isfinite(f) or f < 0:
        raise ContractError(_SOURCE, field, f"expected a finite number >= 0, got {f!r}")
    if f > _MAX_NUMBER:  # keeps every sum finite
        raise ContractError(_SOURCE, field, f"expected at most {_MAX_NUMBER:g}, got {f!r}")
    return f


def _validate(
    values: Sequence[float], weights: Sequence[Sequence[float]], capacities: Sequence[float],
    method: str, work_limit: float, relative_gap: float, wall_limit_s: float | None,
) -> tuple[list[float], list[list[float]], list[float]]:
    if method not in METHODS:
        raise ContractError(_SOURCE, "method", f"expected one of {', '.join(METHODS)}, got {method!r}")
    limits = [("work_limit", work_limit), ("relative_gap", relative_gap)]
    for name, x in [*limits, *([("wall_limit_s", wall_limit_s)] if wall_limit_s is not None else [])]:
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0:
            raise ContractError(_SOURCE, name, f"expected a finite number >= 0, got {x!r}")
        if x == 0 and name != "relative_gap":
            raise ContractError(_SOURCE, name, f"expected > 0, got {x!r}")
    for name, seq in (("values", values), ("weights", weights), ("capacities", capacities)):
        if not _is_sequence(seq):
            raise ContractError(_SOURCE, name, f"expected a sequence, got {type(seq).__name__}")
    v = [_number(x, f"values[{i}]") for i, x in enumerate(values)]
    c = [_number(x, f"capacities[{j}]") for j, x in enumerate(capacities)]
    if len(weights) != len(v):
        raise ContractError(
            _SOURCE, "weights", f"expected one row per item ({len(v)} values), got {len(weights)} rows"
        )
    w: list[list[float]] = []
    for i, row in enumerate(weights):
        if not _is_sequence(row):
            raise ContractError(_SOURCE, f"weights[{i}]", f"expected a sequence, got {type(row).__name__}")
        if len(row) != len(c):
            raise ContractError(
                _SOURCE, f"weights[{i}]",
                f"expected one weight per knapsack ({len(c)} capacities), got {len(row)}",
            )
        w.append([_number(x, f"weights[{i}][{j}]") for j, x in enumerate(row)])
    return v, w, c


# ----------------------------------------------------------------------------------------------
# exact arithmetic helpers


def _exact_ints(xs: Sequence[float]) -> list[int]:
    """The floats ``xs`` as integers over their common power-of-two denominator (exact, no rounding)."""
    ratios = [x.as_integer_ratio() for x in xs]
    den = max((d for _, d in ratios), default=1)
    return [n * (den // d) for n, d in ratios]


def _value(link_of: Sequence[int | None], v: list[float]) -> float:
    return math.fsum(v[i] for i, k in enumerate(link_of) if k is not None)


# ----------------------------------------------------------------------------------------------
# greedy and the LP bound


def knapsack_order(v: Sequence[float], w: Sequence[Sequence[float]], c: Sequence[float]) -> list[int]:
    """Knapsacks from the smallest to the largest capacity in the units of the values (ties: index).

    Knapsack ``j`` holds ``c_j * V / W_j`` value units, with ``V = sum_i v_i`` and ``W_j = sum_i w_ij``
    over the items worth something: ``c_j / mu_j`` when every item weighs ``mu_j`` times its value
    there (the paper's Problem 2). A knapsack no item weighs anything in is unbounded (last).
    """
    total = math.fsum(x for x in v if x > 0)

    def size(j: int) -> float:
        load = math.fsum(w[i][j] for i in range(len(v)) if v[i] > 0)
        return c[j] * total / load if load > 0 else math.inf

    return sorted(range(len(c)), key=lambda j: (size(j), j))


def _greedy(v: list[float], w: list[list[float]], c: list[float], cand: list[list[int]]) -> list[int | None]:
    """The paper's heuristic (see the module docstring); ``cand[j]`` lists the items allowed in ``j``.

    Fits are tested in exact integer arithmetic, so the result is exactly feasible.
    """
    link_of: list[int | None] = [None] * len(v)
    rank = sorted(range(len(v)), key=lambda i: (-v[i], i))
    for j in knapsack_order(v, w, c):
        allowed = set(cand[j])
        order = [i for i in rank if i in allowed]
        if not order:
            continue
        *ints, room = _exact_ints([*(w[i][j] for i in order), c[j]])
        for i, wi in zip(order, ints, strict=True):
            if link_of[i] is None and wi <= room:
                link_of[i] = j
                room -= wi
    return link_of


def _lp_bound(v: list[float], w: list[list[float]], c: list[float], cand: list[list[int]]) -> float:
    """An upper bound: ``min(total value, sum_j Dantzig bound of knapsack j alone)``.

    Valid because any solution's value in knapsack ``j`` is at most the optimum of the single
    knapsack ``j`` over all items, which is at most its LP relaxation (Dantzig: items by value
    per weight, the last one fractionally). Computed in exact integer/rational arithmetic and
    rounded up to a float, so it is a bound, not an estimate.
    """
    items = sorted({i for row in cand for i in row})
    total = math.fsum(v[i] for i in items)
    v_int = _exact_ints(v)  # over a common denominator, which cancels in ratio comparisons
    den = max((x.as_integer_ratio()[1] for x in v), default=1)
    cap_total = Fraction(total) * den
    exact = Fraction(0)
    for j, cap in enumerate(c):
        if not cand[j]:
            continue
        *w_int, room = _exact_ints([*(w[i][j] for i in cand[j]), cap])
        wj = dict(zip(cand[j], w_int, strict=True))
        order = _by_ratio(cand[j], v, v_int, [w[i][j] for i in cand[j]], wj)
        acc = 0
        for i in order:
            if wj[i] <= room:
                acc += v_int[i]
                room -= wj[i]
            else:
                exact += Fraction(v_int[i] * room, wj[i])
                break
        exact += acc
        if exact >= cap_total:
            return total
    exact /= den
    bound = float(exact)
    return bound if Fraction(bound) >= exact else math.nextafter(bound, math.inf)


def _by_ratio(items: list[int], v: list[float], v_int: list[int], wf: list[float], w_int: dict[int, int]) -> list[int]:
    """``items`` by value per weight, descending, compared exactly (weight 0 first).

    Sorted by the float ratio first; float division is monotone, so only items with equal float
    ratios can be out of exact order, and those runs are re-sorted by exact cross products.
    """
    ratio = {i: (v[i] / x if x > 0 else math.inf) for i, x in zip(items, wf, strict=True)}
    order = sorted(items, key=lambda i: -ratio[i])

    def cmp(a: int, b: int) -> int:
        # v_a / w_a > v_b / w_b  <=>  v_a w_b > v_b w_a (zero weights never reach here: ratio inf)
        d = v_int[b] * w_int[a] - v_int[a] * w_int[b]
        return (d > 0) - (d < 0)

    out: list[int] = []
    k = 0
    while k < len(order):
        e = k + 1
        while e < len(order) and ratio[order[e]] == ratio[order[k]]:
            e += 1
        run = order[k:e]
        if len(run) > 1 and math.isfinite(ratio[run[0]]):
            run.sort(key=functools.cmp_to_key(cmp))
        out.extend(run)
        k = e
    return out


def _improve(
    v: list[float], w: list[list[float]], c: list[float], cand: list[list[int]], link_of: list[int | None],
    target: float, max_cells: int = _SEARCH_CELLS,
) -> list[int | None]:
    """Local search from a feasible assignment: apply the best value-raising move until none is
    left. Moves (``a`` packed, ``b`` unpacked): insert ``b``; swap ``a`` out for ``b``; swap
    ``a`` out for two unpacked items; move ``a`` to another knapsack, optionally taking a
    packed item of that knapsack in exchange, and insert ``b`` into the room made. Moves are
    screened in floats and each applied one is checked exactly, so feasibility is kept. Stops
    early once the value reaches ``target`` or the array elements scanned pass ``max_cells``
    (a deterministic bound: the same input always stops at the same move).

    The greedy's result has no improving insert or 1-1 swap (it took the largest item that fit),
    so the 1-for-2 and cross-knapsack moves do the work. On value == weight instances this
    closes most of the room the greedy leaves, and the LP bound then often certifies the
    requested gap without running CP-SAT.
    """
    n, m = len(v), len(c)
    value = np.asarray(v, dtype=float)
    weight = np.asarray(w, dtype=float).reshape(n, m)
    allowed = np.zeros((n, m), dtype=bool)
    for j, row in enumerate(cand):
        allowed[row, j] = True
    assign = np.array([-1 if k is None else k for k in link_of], dtype=np.int64)
    cells = 0
    for _ in range(4 * n):  # every move raises the value; the cap only bounds the cost
        if math.fsum(value[assign >= 0]) >= target or cells >= max_cells:
            break
        best = _best_move(value, weight, allowed, c, assign)
        cells += best.cells
        if not best.changes:
            break
        trial = assign.copy()
        for i, k in best.changes:
            trial[i] = k
        if _overfilled([k if k >= 0 else None for k in trial.tolist()], w, c):
            break  # float rounding let an exact-fit move through; stop rather than overfill
        assign = trial
    return [k if k >= 0 else None for k in assign.tolist()]


@dataclass
class _Move:
    """The best value-raising move of one neighbourhood scan of :func:`_improve`.

    Candidates are offered in a fixed order and only a strictly larger gain replaces the best, so the
    first of equal moves wins and the search is a function of its input. ``cells`` counts the array
    elements the scan looked at: the deterministic measure of work that bounds the search.
    """

    gain: float = 0.0
    changes: list[tuple[int, int]] = field(default_factory=list)  # (item, new knapsack or -1)
    cells: int = 0

    def offer(self, gain: float, changes: list[tuple[int, int]]) -> None:
        if gain > self.gain:
            self.gain, self.changes = gain, changes


def _best_move(value: np.ndarray, weight: np.ndarray, allowed: np.ndarray, c: list[float],
               assign: np.ndarray) -> _Move:
    """Scan every move of :func:`_improve` from ``assign`` (knapsack per item, -1: unpacked).

    Per knapsack ``j`` in index order: insert an unpacked item, swap a packed item for one or two
    unpacked ones, then move a packed item to each other knapsack ``k`` (optionally taking one of
    ``k``'s items back) to make room for an unpacked one.
    """
    m = len(c)
    best = _Move()
    packed = [np.flatnonzero(assign == j) for j in range(m)]
    slack = [c[j] - math.fsum(weight[packed[j], j]) for j in range(m)]
    for j in range(m):
        free = np.flatnonzero((assign < 0) & allowed[:, j])
        if free.size == 0:
            continue
        wf, vf, pj = weight[free, j], value[free], packed[j]
        best.cells += free.size * (1 + pj.size * (1 + (free.size if pj.size * free.size**2 <= _MOVE_CELLS else 0)))
        _offer_insert(best, j, free, wf, vf, slack[j])
        if pj.size == 0:
            continue
        _offer_swaps(best, j, free, wf, vf, pj, weight[pj, j], value[pj], slack[j])
        for k in range(m):
            if k != j:
                _offer_transfers(best, j, k, free, wf, vf, pj, packed[k], weight, allowed, slack)
    return best


_NINF = -np.inf  # the gain of a move that does not fit


def _offer_insert(best: _Move, j: int, free: np.ndarray, wf: np.ndarray, vf: np.ndarray, slack_j: float) -> None:
    """Insert the most valuable unpacked item that fits the room left in knapsack ``j``."""
    fits = wf <= slack_j
    if fits.any():
        b = int(np.argmax(np.where(fits, vf, _NINF)))
        best.offer(float(vf[b]), [(int(free[b]), j)])


def _offer_swaps(best: _Move, j: int, free: np.ndarray, wf: np.ndarray, vf: np.ndarray, pj: np.ndarray,
                 wp: np.ndarray, vp: np.ndarray, slack_j: float) -> None:
    """Take packed item ``a`` out of knapsack ``j`` and put one unpacked item ``b``, or two (``b1 < b2``),
    in its place. The 1-for-2 swap scans ``|packed| x |free|^2`` cells and is skipped past ``_MOVE_CELLS``."""
    g = np.where(wf[None, :] - wp[:, None] <= slack_j, vf[None, :] - vp[:, None], _NINF)
    a, b = np.unravel_index(int(np.argmax(g)), g.shape)
    best.offer(float(g[a, b]), [(int(pj[a]), -1), (int(free[b]), j)])
    if free.size > 1 and pj.size * free.size**2 <= _MOVE_CELLS:
        w2 = wf[:, None] + wf[None, :]
        v2 = np.where(np.triu(np.ones((free.size, free.size), dtype=bool), 1), vf[:, None] + vf[None, :], _NINF)
        g3 = np.where(w2[None, :, :] - wp[:, None, None] <= slack_j, v2[None, :, :] - vp[:, None, None], _NINF)
        a, b1, b2 = np.unravel_index(int(np.argmax(g3)), g3.shape)
        best.offer(float(g3[a, b1, b2]), [(int(pj[a]), -1), (int(free[b1]), j), (int(free[b2]), j)])


def _offer_transfers(best: _Move, j: int, k: int, free: np.ndarray, wf: np.ndarray, vf: np.ndarray,
                     pj: np.ndarray, pk: np.ndarray, weight: np.ndarray, allowed: np.ndarray,
                     slack: list[float]) -> None:
    """Move packed item ``a`` from knapsack ``j`` to ``k``, optionally bringing ``k``'s item ``a2`` back
    to ``j``, and insert unpacked ``b`` into the room made in ``j``: the moves across knapsacks that the
    greedy (which fills one knapsack at a time) never considers."""
    mov = allowed[pj, k]
    if not mov.any():
        return
    wp = weight[pj, j]
    best.cells += pj.size * free.size * (1 + pk.size)
    room_j = slack[j] + wp  # per a: room in j once a left
    ok_k = mov & (weight[pj, k] <= slack[k])  # a alone fits into k
    g = np.where(ok_k[:, None] & (wf[None, :] <= room_j[:, None]), vf[None, :], _NINF)
    a, b = np.unravel_index(int(np.argmax(g)), g.shape)
    best.offer(float(g[a, b]), [(int(pj[a]), k), (int(free[b]), j)])
    back = allowed[pk, j]
    if pk.size == 0 or not back.any() or pj.size * pk.size * free.size > _MOVE_CELLS:
        return
    # a2 in k comes back to j: k must hold a instead of a2, j gets a2 and b instead of a
    fit_k = (weight[pj, k][:, None] - weight[pk, k][None, :] <= slack[k]) & mov[:, None] & back[None, :]
    room = slack[j] + wp[:, None] - weight[pk, j][None, :]  # (a, a2)
    g = np.where(fit_k[:, :, None] & (wf[None, None, :] <= room[:, :, None]), vf[None, None, :], _NINF)
    a, a2, b = np.unravel_index(int(np.argmax(g)), g.shape)
    best.offer(float(g[a, a2, b]), [(int(pj[a]), k), (int(pk[a2]), j), (int(free[b]), j)])


# ----------------------------------------------------------------------------------------------
# the exact path (CP-SAT)


@dataclass
class _IntModel:
    """Integer data of the relaxed model: weights per (item, knapsack), capacities, values."""

    weight: dict[tuple[int, int], int]
    capacity: list[int]
    value: list[int]
    value_exp: int  # integer objective * 2**-value_exp = float objective


def _scaled_model(v: list[float], w: list[list[float]], c: list[float], cand: list[list[int]]) -> _IntModel:
    """Scale the float instance to an integer *relaxation* (powers of two: the scaling is exact).

    Knapsack ``j`` is scaled by ``2**K_j`` with ``c_j * 2**K_j`` in ``[2**29, 2**30)``; values by
    ``2**K_v`` with the total in ``[2**39, 2**40)``. Weights are rounded down, capacities and
    values up, so every float-feasible assignment is feasible in the integer model with at least
    its float value: CP-SAT's bound is a proven bound on the float problem. The price: a
    solution may overfill a knapsack by less than one unit (2**-29 of its capacity) per item,
    which only a near-exact fill can do; :func:`solve` checks that exactly and cuts it off.
    (Rounding the other way, weights up and capacities down, would make every solution feasible
    but lose the bound and miss exact fills such as capacity == sum of some weights.)
    """
    weight: dict[tuple[int, int], int] = {}
    capacity: list[int] = []
    for j, cap in enumerate(c):
        k = _WEIGHT_BITS - math.frexp(cap)[1] if cap > 0 else 0
        capacity.append(math.ceil(math.ldexp(cap, k)))
        for i in cand[j]:
            weight[i, j] = math.floor(math.ldexp(w[i][j], k))
    items = {i for row in cand for i in row}
    total = math.fsum(v[i] for i in items)
    kv = _VALUE_BITS - math.frexp(total)[1] if total > 0 else 0
    # a positive value must count, even if scaling made it tiny; items that fit nowhere are not
    # in the model (their scaled value could even overflow)
    value = [max(math.ceil(math.ldexp(x, kv)), 1) if i in items else 0 for i, x in enumerate(v)]
    return _IntModel(weight, capacity, value, kv)


def load_cp_sat() -> None:
    """Import OR-Tools' CP-SAT, which the exact method solves with (imported where it runs, so that
    ``import deft`` stays light): the import is costly, most of it the pandas that ``cp_model`` imports.
    The runtime calls it on a thread when a run starts, so the first plan does not pay it."""
    from ortools.sat.python import cp_model  # noqa: F401  (imported for its side effect: loaded)


def _cp_sat(
    m: _IntModel, n: int, hint: list[int | None], cuts: list[tuple[int, list[int]]],
    work: float, relative_gap: float, wall_s: float,
) -> tuple[list[int | None] | None, int | None, bool, float]:
    """Solve the integer model within ``work`` units of CP-SAT's deterministic time; returns
    (assignment or None, proven bound, proven optimal, deterministic time spent). Raises
    :class:`SolverTimeout` when the wall clock (``wall_s`` seconds) stops the search first.

    ``cuts`` lists (knapsack j, item set S) whose weights exceed capacity j exactly: at most
    ``|S| - 1`` of them may go into j (this removes only float-infeasible assignments).
    """
    from ortools.sat.python import cp_model

    model, keys, xs = _cp_model(m, hint, cuts)
    solver = cp_model.CpSolver()
    # Only deterministic limits decide where the search ends (same input, same answer, whatever the
    # load); the wall clock is a safety net that raises instead of answering.
    solver.parameters.max_deterministic_time = work
    solver.parameters.max_time_in_seconds = wall_s
    solver.parameters.relative_gap_limit = relative_gap
    solver.parameters.num_workers = _NUM_WORKERS
    solver.parameters.random_seed = _RANDOM_SEED
    status = solver.solve(model)
    if status == cp_model.MODEL_INVALID:  # a bug in this module, never the caller's input
        raise RuntimeError(f"knapsack: CP-SAT rejected the model: {model.validate()}")
    spent = float(solver.deterministic_time)
    if status != cp_model.OPTIMAL and spent < work and solver.wall_time >= wall_s:
        raise SolverTimeout(
            f"{_SOURCE}: CP-SAT ran {solver.wall_time:.1f} s of wall time (the safety limit, wall_limit_s = "
            f"{wall_s:g}) after only {spent:.3g} of its {work:g} units of deterministic work; the machine is "
            "too loaded to finish, and an answer cut short by the clock would depend on the load")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, None, False, spent
    link_of: list[int | None] = [None] * n
    for (i, j), x in zip(keys, xs, strict=True):
        if solver.boolean_value(x):
            link_of[i] = j
    objective = round(solver.objective_value)
    # CP-SAT reports both as doubles with some noise (~1e-4 at 2**40); the optimum of an integer
    # objective is an integer, so floor(bound + 0.5) still bounds it
    bound = max(math.floor(solver.best_objective_bound + 0.5), objective)
    return link_of, bound, status == cp_model.OPTIMAL and bound <= objective, spent


def _cp_model(m: _IntModel, hint: list[int | None], cuts: list[tuple[int, list[int]]]
              ) -> tuple[cp_model.CpModel, list[tuple[int, int]], list[cp_model.IntVar]]:
    """The CP-SAT model of the integer relaxation: one boolean per allowed (item, knapsack) pair (the
    ``keys``, in ``m.weight`` order, and their variables ``xs``), each knapsack's capacity, at most one
    knapsack per item, the ``cuts`` (see :func:`_cp_sat`) and the total value as objective. The
    local search's assignment ``hint`` is the solver's starting point."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    per_knapsack: list[tuple[list[cp_model.IntVar], list[int]]] = [([], []) for _ in m.capacity]
    per_item: dict[int, list[cp_model.IntVar]] = {}
    obj_coef: list[int] = []
    keys = list(m.weight)
    xs = [model.new_bool_var("") for _ in keys]
    for (i, j), x in zip(keys, xs, strict=True):
        vars_j, coefs_j = per_knapsack[j]
        vars_j.append(x)
        coefs_j.append(m.weight[i, j])
        per_item.setdefault(i, []).append(x)
        obj_coef.append(m.value[i])
        model.add_hint(x, hint[i] == j)
    for (vars_j, coefs_j), cap in zip(per_knapsack, m.capacity, strict=True):
        if vars_j and sum(coefs_j) > cap:  # otherwise the constraint cannot bind
            model.add(cp_model.LinearExpr.weighted_sum(vars_j, coefs_j) <= cap)
    for xs_i in per_item.values():
        if len(xs_i) > 1:
            model.add_at_most_one(xs_i)
    if cuts:
        var = dict(zip(keys, xs, strict=True))
        for j, items in cuts:
            model.add(cp_model.LinearExpr.sum([var[i, j] for i in items]) <= len(items) - 1)
    model.maximize(cp_model.LinearExpr.weighted_sum(xs, obj_coef))
    return model, keys, xs


def _overfilled(link_of: Sequence[int | None], w: list[list[float]], c: list[float]) -> list[tuple[int, list[int]]]:
    """(knapsack, its items) for every knapsack whose exact weight sum exceeds its capacity."""
    bad = []
    for j, cap in enumerate(c):
        items = [i for i, k in enumerate(link_of) if k == j]
        if items:
            *ints, cap_int = _exact_ints([*(w[i][j] for i in items), cap])
            if sum(ints) > cap_int:
                bad.append((j, items))
    return bad


# ----------------------------------------------------------------------------------------------
# entry point


def default_wall_limit(work_limit: float) -> float:
    """The wall-clock safety net for a work budget: generous enough (60 s, or 60 s per unit of work)
    that only a machine loaded far beyond normal reaches it."""
    return 60.0 * max(1.0, work_limit)


def solve(
    values: Sequence[float],
    weights: Sequence[Sequence[float]],
    capacities: Sequence[float],
    method: str = "exact",
    work_limit: float = 0.5,
    relative_gap: float = 1e-3,
    *,
    wall_limit_s: float | None = None,
) -> KnapsackSolution:
    """Solve the 0/1 multiple knapsack problem (see the module docstring for the guarantees).

    ``weights[i][j]`` is item ``i``'s weight in knapsack ``j``. ``work_limit`` (CP-SAT deterministic
    time units) and ``relative_gap`` apply to ``method="exact"``: the search stops when the
    certified gap ``(bound - value) / value`` is at most ``relative_gap`` or the work budget is spent,
    so the answer depends on the input only. ``wall_limit_s`` (default
    :func:`default_wall_limit`) is a safety net: reaching it first raises :class:`SolverTimeout`.
    Raises :class:`~deft.errors.ContractError` (a ``ValueError``) naming a bad argument and index.
    """
    t0 = time.perf_counter()
    v, w, c = _validate(values, weights, capacities, method, work_limit, relative_gap, wall_limit_s)
    wall = default_wall_limit(work_limit) if wall_limit_s is None else float(wall_limit_s)
    n = len(v)
    # pre-filter: an item may go into knapsack j only if it is worth something and fits alone
    cand = [[i for i in range(n) if v[i] > 0 and w[i][j] <= c[j]] for j in range(len(c))]

    def done(link_of: list[int | None], bound: float, optimal: bool, how: str, spent: float = 0.0
             ) -> KnapsackSolution:
        value = _value(link_of, v)
        return KnapsackSolution(
            link_of=tuple(link_of), value=value, bound=max(bound, value), optimal=optimal, method=how,
            solve_s=time.perf_counter() - t0, work=spent,
        )

    greedy = _greedy(v, w, c, cand)
    g_value = _value(greedy, v)
    lp = max(_lp_bound(v, w, c, cand), g_value)
    if method == "greedy":
        return done(greedy, lp, g_value >= lp, "greedy")

    n_cand = len({i for row in cand for i in row})
    if sum(k is not None for k in greedy) == n_cand or g_value >= lp:
        # everything that can be packed is packed, or the greedy meets the LP bound
        return done(greedy, g_value, True, "exact")
    start = _improve(v, w, c, cand, greedy, lp / (1 + relative_gap))
    s_value = _value(start, v)
    if lp - s_value <= relative_gap * s_value:
        # the LP bound already certifies the improved greedy within the requested gap: no search
        return done(start, lp, s_value >= lp, "exact")

    link_of, bound, optimal, spent = _search_with_cuts(v, w, c, cand, start, lp, work_limit, relative_gap,
                                                       wall, t0)
    if link_of is None:  # CP-SAT found no (exactly feasible) answer within its work budget
        return done(start, bound, False, "exact->greedy", spent)
    if _value(link_of, v) < s_value:  # value rounding may prefer a set a few ulps worse
        link_of = start
    return done(link_of, bound, optimal, "exact", spent)


def _search_with_cuts(
    v: list[float], w: list[list[float]], c: list[float], cand: list[list[int]], start: list[int | None],
    lp: float, work_limit: float, relative_gap: float, wall: float, t0: float,
) -> tuple[list[int | None] | None, float, bool, float]:
    """CP-SAT on the integer relaxation (:func:`_scaled_model`) from the local search's ``start``,
    re-solved with a cut while its answer overfills a knapsack exactly (the relaxation's price, see
    :func:`_scaled_model`); all the solves together spend at most ``work_limit``.

    Returns (the exactly feasible assignment, or ``None`` when CP-SAT found none or the budget ran out
    first; the proven bound, at most the LP bound ``lp``; proven optimal; deterministic work spent).
    ``wall`` seconds from ``t0`` is the clock's safety net (:class:`SolverTimeout`).
    """
    model = _scaled_model(v, w, c, cand)
    cuts: list[tuple[int, list[int]]] = []
    spent = 0.0
    while True:
        left = work_limit - spent
        link_of, bound_int, optimal, used = _cp_sat(model, len(v), start, cuts, left, relative_gap,
                                                    max(wall - (time.perf_counter() - t0), 1e-3))
        spent += used
        if link_of is None or bound_int is None:
            return None, lp, False, spent
        # the bound of the model with cuts is still a bound: the cuts remove only infeasible sets
        bound = min(lp, math.ldexp(bound_int, -model.value_exp))
        bad = _overfilled(link_of, w, c)
        if not bad:
            return link_of, bound, optimal, spent
        if spent >= work_limit:
            return None, bound, False, spent
        # a near-exact fill that rounding let through: forbid that set in that knapsack, re-solve
        cuts.extend(bad)
