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
:func:`_scaled_model`) warm-started from it, stopped by ``time_limit_s`` or when the
certified relative gap is at most ``relative_gap``. Trivial instances (nothing to choose,
everything fits) never reach the solver. When CP-SAT finds no solution in time the local
search's answer is returned with method ``"exact->greedy"``.

``"greedy"``: the paper's heuristic: knapsacks by capacity ascending, items by value
descending; fill the smallest knapsack first, each time with the largest remaining item that
still fits. ``O(N log N + N*M)``.
"""

from __future__ import annotations

import functools
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from deft.errors import ContractError

__all__ = ["METHODS", "KnapsackSolution", "solve"]

METHODS = ("exact", "greedy")

_SOURCE = "knapsack.solve"
_MAX_NUMBER = 1e200
# Capacity of each knapsack in the integer model: c_j * 2**K_j lies in [2**29, 2**30), so one
# integer unit is at most 2**-29 of the capacity (2 ns of a 1 s stage). Large enough that the
# rounding never matters for scheduling, small enough to keep CP-SAT's LP well conditioned.
_WEIGHT_BITS = 30
# The total candidate value maps to [2**39, 2**40): values are rounded at ~1e-12 relative.
_VALUE_BITS = 40
# CP-SAT workers. One worker was as fast as or faster than the 8-worker portfolio on the
# DeFT-like instances of benchmarks/bench_knapsack.py (2 shared cores), leaves the cores to
# training, and makes the search deterministic when it ends by the gap rather than the clock.
_NUM_WORKERS = 1
# Largest array a local-search move type may scan (elements); beyond it (hundreds of items) the
# 1-for-2 and exchange moves are skipped and CP-SAT does that work.
_MOVE_CELLS = 1 << 18


@dataclass(frozen=True)
class KnapsackSolution:
    """An assignment of items to knapsacks, with its value and a certified bound on the optimum."""

    link_of: tuple[int | None, ...]  # knapsack index per item, or None (item not packed)
    value: float  # total value packed (math.fsum of the packed items' values)
    bound: float  # proven upper bound on the optimum (== value up to model rounding when optimal)
    optimal: bool  # optimality proven
    method: str  # "exact" | "greedy" | "exact->greedy" (exact found nothing and fell back)
    solve_s: float  # wall time of the whole solve() call, seconds

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
    method: str, time_limit_s: float, relative_gap: float,
) -> tuple[list[float], list[list[float]], list[float]]:
    if method not in METHODS:
        raise ContractError(_SOURCE, "method", f"expected one of {', '.join(METHODS)}, got {method!r}")
    for name, x in (("time_limit_s", time_limit_s), ("relative_gap", relative_gap)):
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0:
            raise ContractError(_SOURCE, name, f"expected a finite number >= 0, got {x!r}")
    if time_limit_s <= 0:
        raise ContractError(_SOURCE, "time_limit_s", f"expected > 0, got {time_limit_s!r}")
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


def _greedy(v: list[float], w: list[list[float]], c: list[float], cand: list[list[int]]) -> list[int | None]:
    """The paper's heuristic; ``cand[j]`` lists the items allowed in knapsack ``j``.

    Fits are tested in exact integer arithmetic, so the result is exactly feasible.
    """
    link_of: list[int | None] = [None] * len(v)
    rank = sorted(range(len(v)), key=lambda i: (-v[i], i))
    for j in sorted(range(len(c)), key=lambda j: (c[j], j)):
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
    target: float, deadline: float,
) -> list[int | None]:
    """Local search from a feasible assignment: apply the best value-raising move until none is
    left. Moves (``a`` packed, ``b`` unpacked): insert ``b``; swap ``a`` out for ``b``; swap
    ``a`` out for two unpacked items; move ``a`` to another knapsack, optionally taking a
    packed item of that knapsack in exchange, and insert ``b`` into the room made. Moves are
    screened in floats and each applied one is checked exactly, so feasibility is kept. Stops
    early once the value reaches ``target`` or the clock passes ``deadline``.

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
    ninf = -np.inf
    for _ in range(4 * n):  # every move raises the value; the cap only bounds the cost
        if math.fsum(value[assign >= 0]) >= target or time.perf_counter() >= deadline:
            break
        best_gain = 0.0
        best_move: list[tuple[int, int]] = []  # (item, new knapsack or -1)
        packed = [np.flatnonzero(assign == j) for j in range(m)]
        slack = [c[j] - math.fsum(weight[packed[j], j]) for j in range(m)]
        for j in range(m):
            free = np.flatnonzero((assign < 0) & allowed[:, j])
            if free.size == 0:
                continue
            wf, vf, pj = weight[free, j], value[free], packed[j]
            fits = wf <= slack[j]
            if fits.any():
                b = int(np.argmax(np.where(fits, vf, ninf)))
                if vf[b] > best_gain:
                    best_gain, best_move = float(vf[b]), [(int(free[b]), j)]
            if pj.size == 0:
                continue
            wp, vp = weight[pj, j], value[pj]
            # a out, b in
            g = np.where(wf[None, :] - wp[:, None] <= slack[j], vf[None, :] - vp[:, None], ninf)
            a, b = np.unravel_index(int(np.argmax(g)), g.shape)
            if g[a, b] > best_gain:
                best_gain, best_move = float(g[a, b]), [(int(pj[a]), -1), (int(free[b]), j)]
            # a out, b1 and b2 in (b1 < b2)
            if free.size > 1 and pj.size * free.size**2 <= _MOVE_CELLS:
                w2 = wf[:, None] + wf[None, :]
                v2 = np.where(np.triu(np.ones((free.size, free.size), dtype=bool), 1), vf[:, None] + vf[None, :], ninf)
                g3 = np.where(w2[None, :, :] - wp[:, None, None] <= slack[j], v2[None, :, :] - vp[:, None, None], ninf)
                a, b1, b2 = np.unravel_index(int(np.argmax(g3)), g3.shape)
                if g3[a, b1, b2] > best_gain:
                    best_gain = float(g3[a, b1, b2])
                    best_move = [(int(pj[a]), -1), (int(free[b1]), j), (int(free[b2]), j)]
            # a moves j -> k, optionally a2 moves k -> j, b goes into j
            for k in range(m):
                if k == j:
                    continue
                mov = allowed[pj, k]
                if not mov.any():
                    continue
                pk = packed[k]
                room_j = slack[j] + wp  # per a: room in j once a left
                ok_k = mov & (weight[pj, k] <= slack[k])  # a alone fits into k
                g = np.where(ok_k[:, None] & (wf[None, :] <= room_j[:, None]), vf[None, :], ninf)
                a, b = np.unravel_index(int(np.argmax(g)), g.shape)
                if g[a, b] > best_gain:
                    best_gain, best_move = float(g[a, b]), [(int(pj[a]), k), (int(free[b]), j)]
                back = allowed[pk, j]
                if pk.size == 0 or not back.any() or pj.size * pk.size * free.size > _MOVE_CELLS:
                    continue
                # a2 in k comes back to j: k must hold a instead of a2, j gets a2 and b instead of a
                fit_k = (weight[pj, k][:, None] - weight[pk, k][None, :] <= slack[k]) & mov[:, None] & back[None, :]
                room = slack[j] + wp[:, None] - weight[pk, j][None, :]  # (a, a2)
                g = np.where(fit_k[:, :, None] & (wf[None, None, :] <= room[:, :, None]), vf[None, None, :], ninf)
                a, a2, b = np.unravel_index(int(np.argmax(g)), g.shape)
                if g[a, a2, b] > best_gain:
                    best_gain = float(g[a, a2, b])
                    best_move = [(int(pj[a]), k), (int(pk[a2]), j), (int(free[b]), j)]
        if not best_move:
            break
        trial = assign.copy()
        for i, k in best_move:
            trial[i] = k
        if _overfilled([k if k >= 0 else None for k in trial.tolist()], w, c):
            break  # float rounding let an exact-fit move through; stop rather than overfill
        assign = trial
    return [k if k >= 0 else None for k in assign.tolist()]


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


def _cp_sat(
    m: _IntModel, n: int, hint: list[int | None], cuts: list[tuple[int, list[int]]],
    deadline: float, relative_gap: float, deterministic_budget: float = 1.0,
) -> tuple[list[int | None] | None, int | None, bool]:
    """Solve the integer model by ``deadline`` (a ``time.perf_counter()`` value); returns
    (assignment or None, proven bound, proven optimal).

    ``cuts`` lists (knapsack j, item set S) whose weights exceed capacity j exactly: at most
    ``|S| - 1`` of them may go into j (this removes only float-infeasible assignments).
    """
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

    solver = cp_model.CpSolver()
    # what is left after importing OR-Tools (first call only) and building the model
    solver.parameters.max_time_in_seconds = max(deadline - time.perf_counter(), 1e-3)
    # A deterministic budget of the same size ends the search at the same point on every run (rank 0
    # plans, but a plan that changes between runs of the same profile is hard to reason about); the
    # wall-clock limit above stays as the hard cap on a loaded machine.
    solver.parameters.max_deterministic_time = deterministic_budget
    solver.parameters.relative_gap_limit = relative_gap
    solver.parameters.num_workers = _NUM_WORKERS
    status = solver.solve(model)
    if status == cp_model.MODEL_INVALID:  # a bug in this module, never the caller's input
        raise RuntimeError(f"knapsack: CP-SAT rejected the model: {model.validate()}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, None, False
    link_of: list[int | None] = [None] * n
    for (i, j), x in zip(keys, xs, strict=True):
        if solver.boolean_value(x):
            link_of[i] = j
    objective = round(solver.objective_value)
    # CP-SAT reports both as doubles with some noise (~1e-4 at 2**40); the optimum of an integer
    # objective is an integer, so floor(bound + 0.5) still bounds it
    bound = max(math.floor(solver.best_objective_bound + 0.5), objective)
    return link_of, bound, status == cp_model.OPTIMAL and bound <= objective


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


def solve(
    values: Sequence[float],
    weights: Sequence[Sequence[float]],
    capacities: Sequence[float],
    method: str = "exact",
    time_limit_s: float = 1.0,
    relative_gap: float = 1e-3,
) -> KnapsackSolution:
    """Solve the 0/1 multiple knapsack problem (see the module docstring for the guarantees).

    ``weights[i][j]`` is item ``i``'s weight in knapsack ``j``. ``time_limit_s`` and
    ``relative_gap`` apply to ``method="exact"``: the search stops when the certified gap
    ``(bound - value) / value`` is at most ``relative_gap`` or the time is up. Raises
    :class:`~deft.errors.ContractError` (a ``ValueError``) naming the bad argument and index.
    """
    t0 = time.perf_counter()
    v, w, c = _validate(values, weights, capacities, method, time_limit_s, relative_gap)
    n = len(v)
    # pre-filter: an item may go into knapsack j only if it is worth something and fits alone
    cand = [[i for i in range(n) if v[i] > 0 and w[i][j] <= c[j]] for j in range(len(c))]

    def done(link_of: list[int | None], bound: float, optimal: bool, how: str) -> KnapsackSolution:
        value = _value(link_of, v)
        return KnapsackSolution(
            link_of=tuple(link_of), value=value, bound=max(bound, value), optimal=optimal, method=how,
            solve_s=time.perf_counter() - t0,
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
    deadline = t0 + time_limit_s
    # spend at most a tenth of the budget on the local search: CP-SAT takes over from its result
    start = _improve(v, w, c, cand, greedy, lp / (1 + relative_gap), t0 + 0.1 * time_limit_s)
    s_value = _value(start, v)
    if lp - s_value <= relative_gap * s_value:
        # the LP bound already certifies the improved greedy within the requested gap: no search
        return done(start, lp, s_value >= lp, "exact")

    model = _scaled_model(v, w, c, cand)
    cuts: list[tuple[int, list[int]]] = []
    while True:
        link_of, bound_int, optimal = _cp_sat(model, n, start, cuts, deadline, relative_gap, time_limit_s)
        if link_of is None or bound_int is None:
            return done(start, lp, False, "exact->greedy")
        # the bound of the model with cuts is still a bound: the cuts remove only infeasible sets
        bound = min(lp, math.ldexp(bound_int, -model.value_exp))
        bad = _overfilled(link_of, w, c)
        if not bad:
            break
        if time.perf_counter() >= deadline:
            return done(start, bound, False, "exact->greedy")
        # a near-exact fill that rounding let through: forbid that set in that knapsack, re-solve
        cuts.extend(bad)
    if _value(link_of, v) < s_value:  # value rounding may prefer a set a few ulps worse
        link_of = start
    return done(link_of, bound, optimal, "exact")
