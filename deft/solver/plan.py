"""The DeFT planner: two-stage knapsack scheduling with current and future task queues (paper III.B-C).

What is planned
---------------
Buckets ``0..n-1`` (of the partitioned profile, see :mod:`deft.solver.partition`); bucket ``i``'s
gradient is ready in backward at ``R_i = B_0 + ... + B_i`` (``B_i`` its backward time), so the last
bucket ``n-1`` is ready only when backward ends (the hard dependency: it is never sent in its own
backward). One knapsack per link ``j``; a bucket weighs its real all-reduce time on that link
(``Profile.comm_time``) and is worth its time on the primary link (the paper maximizes the
communicated time). With ``s = capacity_scale``, ``F`` the total forward and ``B`` the total backward
time, a forward stage offers every link ``s*F`` and a backward stage ends at ``E = s*B``.

The state machine (Algorithm 2, made precise)
---------------------------------------------
Per iteration ``t``, starting from empty queues. The *current queue* holds the unsent buckets of the
oldest unfinished update group; the *future queue* the iterations whose gradients are accumulated
but not yet grouped.

* Case 1 (forward, current queue non-empty): knapsack over the current queue, capacity ``s*F`` per
  link; the chosen buckets are sent (old gradients: no dependency on the forward).
* Backward, current queue non-empty: knapsack over it with capacity ``E`` per link.
  - Case 2: not all of it fits. Send the chosen ones; iteration ``t``'s gradient joins the future
    queue (merged into it, not sent).
  - Case 3: all of it fits. Send it first (from the stage start: old, no dependency); the group is
    complete. Then as in Case 4, with each link busy until its share of the old buckets is done.
* Case 4 (current queue empty): iteration ``t``'s gradient merged with the future queue forms a new
  group ending at ``t``. Algorithm 1 (:func:`recursive_knapsack`) picks which of its buckets
  ``0..n-2`` to send now, then :func:`repair_ready_order` makes that choice feasible under the ready
  times; the rest becomes the current queue.

A group's update is applied at the optimizer step of the iteration in which its last bucket is sent.
The machine runs until the queue state at the start of an iteration (current buckets, its group's
size and age, future queue length) repeats; the repeating part, started at an iteration with an
empty future queue so no group straddles the cycle boundary, and unrolled until every group's
communication lies within one cycle, is the emitted :class:`~deft.schedule.Schedule`.

Where this deviates from the paper, and why
-------------------------------------------
* Per-link weights: the paper gives the second knapsack ``mu`` times less capacity with one weight
  per item; we give every link the same capacity (time) and each item its measured time per link,
  which is the same model when times scale by ``mu`` and exact when they do not.
* Algorithm 1's capacity: at recursion level ``k`` (items ``k..``, the first ready at ``R_k``) a link
  can carry new buckets only after it is free of old ones (``busy_j``) and after ``R_k``, so its
  capacity is ``E - max(busy_j, R_k)``. The paper passes ``B - B_first`` in Case 4 (no old buckets,
  the same) and ``B - sum(old)`` in Case 3 (ignoring the ready time at the top level).
* Ties in Algorithm 1 go to the deeper level, as the paper's ``>`` does; the recursion stops once
  an upper bound on what deeper levels can pack falls below the best found (they cannot win).
* Algorithm 1 is a heuristic: a knapsack of capacity ``E - R_k`` ignores that later items become
  ready later. :func:`repair_ready_order` therefore checks each link exactly (ready order after the
  old buckets, each starting at ``max(link free, ready)``, all finished by ``E``), drops the bucket
  whose removal frees the most lateness until feasible, then offers the dropped and the unchosen
  buckets to any link where they still fit (using slack the heuristic left). The schedule never
  promises overlap the dependencies forbid.
* Oversized buckets: when even the partition cannot bring a bucket under the stage capacity (the
  latency ``alpha`` alone exceeds the forward time), every stage's capacity is raised to the largest
  bucket's cheapest time (``meta["bucket_floor_s"]``): that bubble is accepted so the bucket is ever
  sent; the paper's partition simply assumes this never happens.
* Buckets worth nothing (zero time on the primary link) are sent with the first opportunity on the
  primary link: the knapsack would never pick them, and a group with an unsent bucket never ends.
* Enough capacity for no delay: if torch-DDP-style WFBP (:func:`no_delay_plan`) finishes every
  all-reduce within the backward stage as scaled (``s*B``), the plan is the no-delay plan (cycle 1,
  ``K = (1,)``): this is where the preserver's growing capacity ends. At ``s = 1`` that needs nothing
  exposed at all; in particular the last bucket's tail is *not* a reason to stop: the planner offers
  to delay it into the next forward, the paper's move for GPT-2 (Sec. V.B.3), and the preserver
  decides whether that stale update is acceptable.
* Budget and determinism: every knapsack's CP-SAT search is bounded by deterministic work, never by
  the clock (:mod:`deft.solver.knapsack`), so the same profile and config give the same schedule,
  byte for byte, on an idle or a busy machine. ``config.solver_time_limit_s`` is read as that
  budget: ``WORK_PER_SECOND`` units of CP-SAT deterministic time per second. Past
  ``EXACT_BUDGET_LIMITS`` such budgets spent (an :class:`ExactBudget`: one plan's own, or one a
  caller shares over several plans, as the preserver does over its tries), the remaining knapsacks
  are solved greedily (``meta["exact_budget_exhausted"]``). The schedule's ``meta`` records the work
  this plan spent (``solver_work``), not wall time; :attr:`PlanResult.solve_s` has the wall time.
* Cycle cap: if no repetition appears within ``4 * max_cycle`` iterations (or the unrolled cycle is
  longer than ``max_cycle``, or the coverage rate alone rules out a cycle that short), the plan runs
  ``max_cycle`` iterations from empty queues and *flushes* in the last backward (everything left is
  sent, the last bucket after its gradient is ready), which returns the queues to empty and closes
  the cycle. This is valid but exceeds that stage's capacity; it is recorded as backward case 0 and
  ``meta["cycle_capped"]``.

The solver never imports torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError
from deft.profile import Profile
from deft.schedule import CommTask, Schedule, StagePlan, Update, synchronous_schedule
from deft.solver import knapsack
from deft.solver.partition import default_capacity, partition
from deft.solver.simulate import simulate_schedule

__all__ = [
    "CASE_FLUSH",
    "DEFAULT_MAX_CYCLE",
    "EXACT_BUDGET_LIMITS",
    "WINDOW_SHARE",
    "WORK_PER_SECOND",
    "ExactBudget",
    "GroupRecord",
    "IterationRecord",
    "KnapsackRecord",
    "Packing",
    "PlanResult",
    "RecursiveChoice",
    "Send",
    "accumulate_plan",
    "link_finish",
    "no_delay_plan",
    "plan",
    "plan_trace",
    "recursive_knapsack",
    "repair_ready_order",
]

CASE_FLUSH = 0  # backward "case" of the forced flush that closes a capped cycle (not a paper case)
DEFAULT_MAX_CYCLE = 64
# Total CP-SAT work of one budget (one plan's, or one shared by a decision's plans: ExactBudget), in
# units of the per-knapsack budget, before the greedy takes over.
EXACT_BUDGET_LIMITS = 20
# CP-SAT deterministic time granted per second of ``config.solver_time_limit_s``: chosen from a unit's
# wall time on a small machine (benchmarks/results/knapsack.md) so that a budget costs about the wall
# time its name says on a quiet machine, while the answer never depends on the load.
WORK_PER_SECOND = 0.5
# The share of the plan-lag window a background decision's knapsacks may spend (ExactBudget.for_window):
# the rest of the decision (the lag-free search, the preserver's simulations) takes about as long again
# on a many-bucket profile (benchmarks/results/planner.md, "The plan-lag window").
WINDOW_SHARE = 0.5
# Iterations of the state machine searched for a repeating queue state, per iteration of max_cycle.
_SEARCH_PER_CYCLE = 4
_SOURCE = "plan"
# Float slack when re-checking times the knapsack proved feasible in exact arithmetic.
_REL_TOL = 1e-9


# ------------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class Send:
    """Bucket ``bucket`` of update group ``group`` sent on ``link``; ``origin`` = t - group's last iteration."""

    bucket: int
    group: int
    link: str
    origin: int


@dataclass(frozen=True)
class KnapsackRecord:
    """One knapsack decision: which problem, over which buckets, and how well it was solved."""

    stage: str  # "forward" | "backward"
    purpose: str  # "current" (Cases 1-3) | "recursive" (Algorithm 1, Cases 3-4)
    items: tuple[int, ...]
    capacities: tuple[float, ...]
    value: float
    bound: float
    optimal: bool
    method: str
    solve_s: float
    level: int | None = None  # Algorithm 1: recursion level whose answer won
    levels: int = 1  # knapsacks solved for this decision


@dataclass(frozen=True)
class IterationRecord:
    """What the state machine did in one iteration."""

    iteration: int
    forward_case: int | None  # 1, or None when the current queue was empty
    backward_case: int  # 2, 3, 4, or CASE_FLUSH
    current_before: tuple[int, ...]  # current queue at the start of the iteration
    future_before: tuple[int, ...]  # iterations in the future queue at the start
    forward: tuple[Send, ...]
    backward: tuple[Send, ...]
    completed: tuple[int, ...]  # groups whose update is applied after this iteration's step
    knapsacks: tuple[KnapsackRecord, ...]
    dropped: tuple[int, ...] = ()  # buckets the ready-time repair removed from Algorithm 1's choice
    current_after: tuple[int, ...] = ()
    future_after: tuple[int, ...] = ()

    @property
    def cases(self) -> tuple[int | None, int]:
        return (self.forward_case, self.backward_case)


@dataclass(frozen=True)
class GroupRecord:
    """An update group: the iterations it merges and the iteration after whose step it is applied."""

    iterations: tuple[int, ...]
    complete_at: int | None

    @property
    def last(self) -> int:
        return self.iterations[-1]


@dataclass(frozen=True)
class PlanResult:
    """The schedule plus everything that led to it (for tests, reports and the timeline)."""

    schedule: Schedule
    profile: Profile  # the partitioned profile the schedule refers to
    iterations: tuple[IterationRecord, ...]
    groups: tuple[GroupRecord, ...]
    cycle_start: int  # first simulated iteration of the emitted cycle
    period: int  # period N of the queue states; schedule.cycle = N * unroll
    unroll: int
    mode: str  # "deft" | "no_delay" | "capped"
    solve_s: float = 0.0  # wall time spent in knapsack solves (information only; not in the schedule)


@dataclass
class ExactBudget:
    """CP-SAT's deterministic work (units) the knapsacks of one or more plans may spend; past it the
    paper's greedy answers the rest (close to the optimum: benchmarks/results/knapsack.md).

    Invariant: the exact search starts only while ``spent < units``, so a holder of the budget spends at
    most ``units`` plus one knapsack's ``work_limit``. Spending is deterministic work, so plans sharing
    one budget in the same order come out the same under any load. A plan given none has its own
    (:meth:`for_config`); the preserver shares one over its tries, so that a decision's planning time is
    bounded by one budget, not one per try: with a budget per try, a many-bucket profile spent several
    budgets only to fall back to the no-delay plan (benchmarks/results/planner.md)."""

    units: float
    spent: float = 0.0

    @classmethod
    def for_config(cls, config: DeftConfig) -> ExactBudget:
        """:data:`EXACT_BUDGET_LIMITS` knapsack budgets of ``config.solver_time_limit_s`` each."""
        return cls(EXACT_BUDGET_LIMITS * WORK_PER_SECOND * config.solver_time_limit_s)

    @classmethod
    def for_window(cls, config: DeftConfig, window_s: float) -> ExactBudget:
        """The budget of a decision made while training goes on for ``window_s`` seconds (the plan-lag
        window): :meth:`for_config`'s, or the CP-SAT work of :data:`WINDOW_SHARE` of the window at
        ``WORK_PER_SECOND`` if that is less, so that the knapsacks do not outlast the window the ranks
        train through before they wait for the plan. Deterministic in its inputs, as every budget."""
        if not (math.isfinite(window_s) and window_s >= 0.0):
            raise ContractError(_SOURCE, "window_s", f"expected a finite number of seconds >= 0, got {window_s}")
        default = cls.for_config(config)
        return cls(min(default.units, WORK_PER_SECOND * WINDOW_SHARE * window_s))

    @property
    def exhausted(self) -> bool:
        return self.spent >= self.units


@dataclass(frozen=True)
class Packing:
    """An answer of a knapsack over some buckets: bucket -> link index, and the value packed."""

    assignment: dict[int, int]
    value: float
    bound: float = 0.0
    optimal: bool = True
    method: str = ""
    solve_s: float = 0.0


@dataclass(frozen=True)
class RecursiveChoice:
    """Algorithm 1's answer: the winning level's packing, and how many levels were solved."""

    assignment: dict[int, int]
    value: float
    level: int | None
    packings: tuple[Packing, ...] = field(default=())


# ------------------------------------------------------------------------------------------------
# Algorithm 1 and the ready-time check (pure functions over bucket ids)


def link_finish(busy_until: float, items: Sequence[int], ready: Sequence[float], weight: Sequence[float]) -> float:
    """When a link that is busy until ``busy_until`` finishes ``items`` sent in ready order.

    Each item starts at ``max(link free, its ready time)``; ``weight[b]`` is bucket ``b``'s time on
    this link and ``ready[b]`` its ready time (both indexed by bucket id).
    """
    t = busy_until
    for b in sorted(items, key=lambda b: (ready[b], b)):
        t = max(t, ready[b]) + weight[b]
    return t


def recursive_knapsack(
    items: Sequence[int], ready: Sequence[float], end: float, busy_until: Sequence[float],
    values: Sequence[float], weights: Sequence[Sequence[float]],
    solve: Callable[[tuple[int, ...], tuple[float, ...]], Packing],
) -> RecursiveChoice:
    """Algorithm 1 (RecursiveKnapsack) of the paper, iteratively and for several links.

    ``items`` are bucket ids in ready order; ``values[b]`` and ``weights[b][j]`` are indexed by
    bucket id. Level ``k`` solves a knapsack over ``items[k:]`` with capacity
    ``end - max(busy_until[j], ready[items[k]])`` on link ``j`` (the window in which the link is free
    and the level's first item is ready); the best level wins, ties going to the deeper level (the
    paper returns ``order1`` only if strictly better than the recursion's ``order2``).

    Pruning (same answer, fewer solves): level ``k`` can pack at most
    ``min(sum of its values, sum_j cap_j * max value/weight on link j)``; that bound never grows with
    ``k`` (capacities shrink, item sets shrink), so once it is below the best value found, no deeper
    level can win and the recursion stops.
    """
    n_links = len(busy_until)
    m = len(items)
    # Suffix sums of values and suffix maxima of value per weight, per link.
    suffix_value = [0.0] * (m + 1)
    suffix_ratio = [[0.0] * n_links for _ in range(m + 1)]
    for k in range(m - 1, -1, -1):
        b = items[k]
        suffix_value[k] = suffix_value[k + 1] + values[b]
        for j in range(n_links):
            w = weights[b][j]
            ratio = values[b] / w if w > 0 else (math.inf if values[b] > 0 else 0.0)
            suffix_ratio[k][j] = max(suffix_ratio[k + 1][j], ratio)
    best: tuple[int, Packing] | None = None
    packings: list[Packing] = []
    for k in range(m):
        sub = tuple(items[k:])
        start = ready[sub[0]]
        caps = tuple(max(0.0, end - max(busy, start)) for busy in busy_until)
        if best is not None:
            by_caps = math.fsum(c * r if c > 0 else 0.0 for c, r in zip(caps, suffix_ratio[k], strict=True))
            if min(suffix_value[k], by_caps) < best[1].value:
                break
        p = solve(sub, caps)
        packings.append(p)
        if best is None or p.value >= best[1].value:
            best = (k, p)
    if best is None:
        return RecursiveChoice({}, 0.0, None, ())
    return RecursiveChoice(dict(best[1].assignment), best[1].value, best[0], tuple(packings))


def repair_ready_order(
    assignment: dict[int, int], ready: Sequence[float], end: float, busy_until: Sequence[float],
    weights: Sequence[Sequence[float]], values: Sequence[float], fill: Sequence[int] = (),
) -> tuple[dict[int, int], tuple[int, ...]]:
    """Make ``assignment`` (bucket -> link) feasible under ready times; return it and the dropped buckets.

    Feasible on link ``j``: :func:`link_finish` of its buckets after ``busy_until[j]`` is at most
    ``end``. While a link is late, drop from the latest link the bucket whose removal gives the
    earliest finish (ties: the least valuable). Then offer the dropped buckets and the unchosen
    ``fill`` candidates, most valuable (then earliest ready) first, to the link where they would
    finish earliest, keeping each only if that link stays feasible: slack left by the heuristic or
    by a drop is used, never overfilled. Returns a feasible assignment (the empty one always is when
    ``busy_until <= end``) and the dropped buckets that found no place again.
    """
    n_links = len(busy_until)
    tol = _REL_TOL * max(end, 1e-30)
    out = dict(assignment)

    def col(j: int) -> list[float]:
        return [w[j] for w in weights]

    def on(j: int) -> list[int]:
        return [b for b, k in out.items() if k == j]

    dropped: list[int] = []
    while True:
        late = [(link_finish(busy_until[j], on(j), ready, col(j)) - end, j) for j in range(n_links)]
        worst, j = max(late)
        if worst <= tol:
            break
        items = on(j)
        wj = col(j)
        victim = min(items, key=lambda b: (link_finish(busy_until[j], [x for x in items if x != b], ready, wj),
                                           values[b], -b))
        del out[victim]
        dropped.append(victim)
    offers = {*dropped, *(b for b in fill if b not in out)}
    for b in sorted(offers, key=lambda b: (-values[b], ready[b], b)):
        options = sorted(
            (link_finish(busy_until[j], [*on(j), b], ready, col(j)), j) for j in range(n_links)
        )
        for fin, j in options:
            if fin - end <= tol:
                out[b] = j
                break
    return out, tuple(sorted(b for b in dropped if b not in out))


# ------------------------------------------------------------------------------------------------
# the state machine


#: The queue state at the start of an iteration: the current queue, its group's size and age (iterations
#: since the group's last one), and the length of the future queue. The machine's next moves depend on
#: nothing else, so a repeated state starts a cycle.
QueueState = tuple[frozenset[int], int, int, int]


class _Machine:
    """Queues, groups and knapsack solving for one plan; see the module docstring."""

    def __init__(self, profile: Profile, config: DeftConfig, scale: float, budget: ExactBudget | None = None) -> None:
        self.n = profile.n
        self.links = profile.link_names
        self.w = [[profile.comm_time(b, name) for name in self.links] for b in range(self.n)]
        self.v = [self.w[b][0] for b in range(self.n)]
        self.ready = profile.ready_s
        # A bucket that no partition brings under the capacity (latency alone exceeds it) would never
        # be sent; every stage is granted room for the largest one, i.e. accepts that bubble.
        self.floor = max(min(row) for row in self.w)
        self.cap_forward = max(scale * profile.forward_s, self.floor)
        self.end_backward = max(scale * profile.backward_s, self.floor)
        self.method = config.solver
        self.work_limit = WORK_PER_SECOND * config.solver_time_limit_s
        self.budget = budget if budget is not None else ExactBudget.for_config(config)
        self.budget_exhausted = False  # this plan solved a knapsack greedily for want of budget
        self.relative_gap = config.solver_relative_gap
        self._cache: dict[tuple[tuple[int, ...], tuple[float, ...]], Packing] = {}
        self.solve_s = 0.0  # wall time, information only
        self.work = 0.0  # CP-SAT deterministic time this plan spent (of self.budget's)
        self.calls = 0
        self.reset()

    def reset(self) -> None:
        self.current: list[int] = []
        self.current_group: int | None = None
        self.future: list[int] = []
        self.groups: list[list[int]] = []
        self.complete: list[int | None] = []

    # -- knapsack with a cache: the machine is a deterministic function of the queue state, and a
    #    repeated state must not cost a second search.
    def solve(self, items: tuple[int, ...], caps: tuple[float, ...]) -> Packing:
        key = (items, caps)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        method = self.method
        if method == "exact" and self.budget.exhausted:
            # A plan may need thousands of knapsacks; past the budget the greedy answers the rest.
            method = "greedy"
            self.budget_exhausted = True
        sol = knapsack.solve(
            [self.v[b] for b in items], [self.w[b] for b in items], list(caps),
            method=method, work_limit=self.work_limit, relative_gap=self.relative_gap,
        )
        self.calls += 1
        self.solve_s += sol.solve_s
        self.work += sol.work
        self.budget.spent += sol.work
        assignment = {b: j for b, j in zip(items, sol.link_of, strict=True) if j is not None}
        # Worthless buckets (value = time on the primary link = 0): the knapsack never packs them,
        # and they cost nothing on the primary link, so they go there.
        for b in items:
            if b not in assignment and self.v[b] == 0.0:
                assignment[b] = 0
        packing = Packing(assignment, sol.value, sol.bound, sol.optimal, sol.method, sol.solve_s)
        self._cache[key] = packing
        return packing

    @staticmethod
    def _record(stage: str, purpose: str, items: tuple[int, ...], caps: tuple[float, ...],
                p: Packing) -> KnapsackRecord:
        return KnapsackRecord(stage, purpose, items, caps, p.value, p.bound, p.optimal, p.method, p.solve_s)

    def state_key(self, t: int) -> QueueState:
        if self.current:
            g = self.current_group
            assert g is not None
            grp = self.groups[g]
            return (frozenset(self.current), len(grp), t - grp[-1], len(self.future))
        return (frozenset(), 0, 0, len(self.future))

    def _sends(self, assignment: dict[int, int], group: int, t: int) -> list[Send]:
        last = self.groups[group][-1]
        return [Send(b, group, self.links[assignment[b]], t - last) for b in sorted(assignment)]

    def _finish_current(self, sent: dict[int, int], t: int) -> list[int]:
        """Remove sent buckets from the current queue; return [group] if it is now complete."""
        self.current = [b for b in self.current if b not in sent]
        if not self.current and self.current_group is not None:
            g = self.current_group
            self.complete[g] = t
            self.current_group = None
            return [g]
        return []

    def step(self, t: int, flush: bool = False) -> IterationRecord:
        """One iteration of the state machine (module docstring); ``flush`` sends everything left in its
        backward (the capped cycle's last iteration)."""
        current_before, future_before = tuple(sorted(self.current)), tuple(self.future)
        records: list[KnapsackRecord] = []
        completed: list[int] = []
        fwd: list[Send] = []
        bwd: list[Send] = []
        dropped: tuple[int, ...] = ()

        # ---- forward: Case 1
        forward_case: int | None = None
        if self.current:
            forward_case = 1
            fwd = self._case1(t, records, completed)

        # ---- backward: Cases 2-4
        busy = [0.0 for _ in self.links]
        if self.current:
            bwd += self._send_current_in_backward(t, flush, busy, records, completed)
            if self.current:
                # Case 2: the current queue outlasts this backward; t's gradient waits, merged.
                self.future.append(t)
                return self._done(t, forward_case, 2, current_before, future_before, fwd, bwd, completed,
                                  records, dropped)
            backward_case = CASE_FLUSH if flush else 3
        else:
            backward_case = CASE_FLUSH if flush else 4

        # ---- Cases 3 and 4: a new group of the future queue and iteration t
        sends, dropped = self._new_group(t, flush, busy, records, completed)
        bwd += sends
        return self._done(t, forward_case, backward_case, current_before, future_before, fwd, bwd, completed,
                          records, dropped)

    def _case1(self, t: int, records: list[KnapsackRecord], completed: list[int]) -> list[Send]:
        """Case 1: the forward stage sends what its knapsack (capacity ``s*F`` per link) picks from the
        current queue; those gradients are old, so nothing in the forward delays them."""
        items = tuple(sorted(self.current))
        caps = tuple(self.cap_forward for _ in self.links)
        pk = self.solve(items, caps)
        records.append(self._record("forward", "current", items, caps, pk))
        assert self.current_group is not None
        fwd = self._sends(pk.assignment, self.current_group, t)
        completed += self._finish_current(pk.assignment, t)
        return fwd

    def _send_current_in_backward(self, t: int, flush: bool, busy: list[float], records: list[KnapsackRecord],
                                  completed: list[int]) -> list[Send]:
        """Cases 2 and 3: the backward stage first sends what its knapsack (capacity ``E`` per link) picks
        from the current queue (everything when flushing), from the stage start; ``busy[j]`` becomes
        the time link ``j`` spends on these old buckets, before it can take the new group's."""
        items = tuple(sorted(self.current))
        caps = tuple(self.end_backward for _ in self.links)
        if flush:
            old = self._spread(items, busy)
        else:
            pk = self.solve(items, caps)
            records.append(self._record("backward", "current", items, caps, pk))
            old = pk.assignment
        assert self.current_group is not None
        sends = self._sends(old, self.current_group, t)
        for b, j in old.items():
            busy[j] += self.w[b][j]
        completed += self._finish_current(old, t)
        return sends

    def _new_group(self, t: int, flush: bool, busy: list[float], records: list[KnapsackRecord],
                   completed: list[int]) -> tuple[list[Send], tuple[int, ...]]:
        """Cases 3 and 4: the future queue and iteration ``t`` form a new update group; the part of it
        that fits this backward after each link's ``busy`` time is sent now (Algorithm 1 and the
        ready-time repair, or everything when flushing), the rest becomes the current queue. Returns
        the sends, in ready order, and the buckets the repair dropped."""
        group = len(self.groups)
        self.groups.append([*self.future, t])
        self.complete.append(None)
        self.future = []
        dropped: tuple[int, ...] = ()
        if flush:
            new = self._spread(tuple(range(self.n)), busy, after_ready=True)
        else:
            new, dropped = self._recursive_choice(busy, records)
        sends = [Send(b, group, self.links[new[b]], 0) for b in sorted(new, key=lambda b: (self.ready[b], b))]
        self.current = [b for b in range(self.n) if b not in new]
        self.current_group = group if self.current else None
        if not self.current:
            self.complete[group] = t
            completed.append(group)
        return sends, dropped

    def _recursive_choice(self, busy: list[float], records: list[KnapsackRecord]
                          ) -> tuple[dict[int, int], tuple[int, ...]]:
        """Algorithm 1 over the new group's buckets ``0..n-2`` (bucket ``n-1`` is ready only when backward
        ends), made feasible under the ready times by :func:`repair_ready_order`; worthless buckets
        ride along on the primary link. Returns bucket -> link and the buckets the repair dropped."""
        cand = tuple(range(self.n - 1))  # bucket n-1 is ready only when backward ends
        t0 = time.perf_counter()
        choice = recursive_knapsack(cand, self.ready, self.end_backward, busy, self.v, self.w, self.solve)
        new, dropped = repair_ready_order(choice.assignment, self.ready, self.end_backward, busy, self.w, self.v,
                                          fill=cand)
        # Worthless buckets ride along on the primary when their gradient is ready in time.
        for b in cand:
            if b not in new and self.v[b] == 0.0 and self.ready[b] <= self.end_backward:
                new[b] = 0
        if choice.packings:
            records.append(KnapsackRecord(
                "backward", "recursive", cand, tuple(max(0.0, self.end_backward - x) for x in busy),
                choice.value, max(p.bound for p in choice.packings),
                all(p.optimal for p in choice.packings), self.method, time.perf_counter() - t0,
                choice.level, len(choice.packings),
            ))
        return new, dropped

    def _spread(self, items: tuple[int, ...], busy: list[float], after_ready: bool = False) -> dict[int, int]:
        """Flush: every item on the link that finishes it first (list scheduling), no capacity."""
        free = list(busy)
        out: dict[int, int] = {}
        for b in sorted(items, key=lambda b: (self.ready[b], b)) if after_ready else items:
            start = [max(f, self.ready[b]) if after_ready else f for f in free]
            j = min(range(len(free)), key=lambda j: (start[j] + self.w[b][j], j))
            free[j] = start[j] + self.w[b][j]
            out[b] = j
        return out

    def _done(self, t: int, fcase: int | None, bcase: int, cur: tuple[int, ...], fut: tuple[int, ...],
              fwd: list[Send], bwd: list[Send], completed: list[int], records: list[KnapsackRecord],
              dropped: tuple[int, ...]) -> IterationRecord:
        return IterationRecord(
            iteration=t, forward_case=fcase, backward_case=bcase, current_before=cur, future_before=fut,
            forward=tuple(fwd), backward=tuple(bwd), completed=tuple(completed), knapsacks=tuple(records),
            dropped=dropped, current_after=tuple(sorted(self.current)), future_after=tuple(self.future),
        )

    def group_records(self) -> tuple[GroupRecord, ...]:
        return tuple(GroupRecord(tuple(g), c) for g, c in zip(self.groups, self.complete, strict=True))


# ------------------------------------------------------------------------------------------------
# public entry points


def _check(profile: Profile, config: DeftConfig | None, capacity_scale: float) -> DeftConfig:
    if not isinstance(profile, Profile):
        raise ContractError(_SOURCE, "profile", f"expected a deft.Profile, got {type(profile).__name__}")
    cfg = DeftConfig.resolve(config)
    if isinstance(capacity_scale, bool) or not isinstance(capacity_scale, (int, float)) \
            or not math.isfinite(capacity_scale) or capacity_scale <= 0:
        raise ContractError(_SOURCE, "capacity_scale", f"expected a finite number > 0, got {capacity_scale!r}")
    if profile.backward_s <= 0:
        raise ContractError(_SOURCE, "profile.times",
                            "total backward_s is 0: buckets have no ready times to plan against")
    return cfg


def _partition_capacity(profile: Profile, scale: float) -> float:
    # The layout must not change with capacity_scale >= 1 (the preserver re-plans with growing
    # scales; the runtime's bucket layout should stay put), so only a shrinking scale shrinks it.
    return default_capacity(profile) * min(1.0, scale)


def _list_schedule(profile: Profile) -> tuple[tuple[str, ...], float]:
    """WFBP onto several links: in ready order, each bucket to the link that finishes it first."""
    ready = profile.ready_s
    names = profile.link_names
    free = [0.0 for _ in names]
    assign: list[str] = []
    for b in range(profile.n):
        fin = [max(free[j], ready[b]) + profile.comm_time(b, names[j]) for j in range(len(names))]
        j = min(range(len(names)), key=lambda j: (fin[j], j))
        free[j] = fin[j]
        assign.append(names[j])
    return tuple(assign), max(free)


#: The simulated window of a no-delay plan (warm-up, measured iterations): every one of its iterations
#: starts after the previous one's update is applied (the step waits for every send of the backward),
#: so the simulated timeline repeats from the second iteration on, and the second iteration alone
#: predicts what the default window does (to the last bit of a double, on the example profiles, coded
#: and not; the same plans on the planner benchmark's profiles) at a fraction of its cost, which counts
#: because the codec choice prices n + 2 of them per codec before the plan.
NO_DELAY_WINDOW = (1, 1)


def _with_predictions(profile: Profile, schedule: Schedule, window: tuple[int, int] | None = None) -> Schedule:
    res = simulate_schedule(profile, schedule) if window is None else \
        simulate_schedule(profile, schedule, warmup=window[0], iterations=window[1])
    return replace(schedule, predicted_iteration_s=float(res.iteration_s),
                   predicted_bubble_ratio=float(res.bubble_ratio))


def _no_delay(profile: Profile, cfg: DeftConfig, scale: float, capacity_s: float, reason: str) -> Schedule:
    assign, finish = _list_schedule(profile)
    sched = synchronous_schedule(
        tuple(b.numel for b in profile.buckets), tuple(b.nbytes for b in profile.buckets),
        profile.link_names, assign,
    )
    meta: JsonDict = {
        "planner": "deft.solver.plan", "mode": "no_delay", "reason": reason, "solver": cfg.solver,
        "capacity_scale": scale, "capacity_s": capacity_s, "cases": [[None, None]], "knapsack_calls": 0,
        "optimal": True, "solver_work": 0.0, "wfbp_finish_s": finish, "backward_s": profile.backward_s,
        "forward_s": profile.forward_s, "cycle_capped": False,
    }
    return _with_predictions(profile, replace(sched, profile_digest=profile.digest(), meta=meta), NO_DELAY_WINDOW)


def no_delay_plan(profile: Profile, config: DeftConfig | None = None) -> Schedule:
    """What ``epsilon == 0`` allows: cycle 1, every bucket in its own backward, one update per iteration.

    Buckets go to links by list scheduling in ready order onto the link that finishes them first.
    The parameters are exactly torch DDP's (only the order and the links of all-reduces change).
    """
    cfg = _check(profile, config, 1.0)
    cap = _partition_capacity(profile, 1.0)
    return _no_delay(partition(profile, cfg, cap, best_effort=True), cfg, 1.0, cap, "requested")


def accumulate_plan(profile: Profile, config: DeftConfig | None, k: int) -> Schedule:
    """Merge ``k`` iterations without staleness: cycle ``k``, one update group of all ``k`` positions,
    every bucket sent in the backward of the last one (WFBP over the links, as :func:`no_delay_plan`)
    and the update applied right after it.

    This is gradient accumulation run by the schedule: the communication of ``k`` iterations costs one
    all-reduce per bucket, and no update is ever applied to parameters that moved since its gradient
    was computed. DeFT's Algorithm 2 instead sends leftovers in the next forward, which makes updates
    stale; the preserver offers both and prefers this one when they are close in speed (staleness
    measured far more harmful than merging: benchmarks/RESULTS.md, update-timing check).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ContractError(_SOURCE, "k", f"expected an integer >= 1, got {k!r}")
    one = no_delay_plan(profile, config)
    if k == 1:
        return one
    stages = tuple(StagePlan(p, stage, one.stage(0, "backward").comms if (p, stage) == (k - 1, "backward") else ())
                   for p in range(k) for stage in ("forward", "backward"))
    sched = replace(one, cycle=k, stages=stages, updates=(Update(tuple(range(k)), k - 1),),
                    meta={**one.meta, "mode": "accumulate", "reason": f"{k} iterations merged, no staleness"})
    cfg = _check(profile, config, 1.0)
    part = partition(profile, cfg, _partition_capacity(profile, 1.0), best_effort=True)
    return _with_predictions(part, sched)


def plan(profile: Profile, config: DeftConfig | None = None, *, capacity_scale: float = 1.0,
         budget: ExactBudget | None = None) -> Schedule:
    """The DeFT schedule of ``profile``; see :func:`plan_trace` and the module docstring."""
    return plan_trace(profile, config, capacity_scale=capacity_scale, budget=budget).schedule


def plan_trace(profile: Profile, config: DeftConfig | None = None, *, capacity_scale: float = 1.0,
               max_cycle: int = DEFAULT_MAX_CYCLE, budget: ExactBudget | None = None) -> PlanResult:
    """Plan and return the schedule with the per-iteration record of cases, queues and knapsacks.

    ``config.epsilon == 0`` forbids delayed updates, so the result is :func:`no_delay_plan`'s.
    ``budget``: the CP-SAT work its exact knapsacks may spend, shared with whoever else holds it (None:
    this plan's own, :meth:`ExactBudget.for_config`).
    """
    cfg = _check(profile, config, capacity_scale)
    if isinstance(max_cycle, bool) or not isinstance(max_cycle, int) or max_cycle < 1:
        raise ContractError(_SOURCE, "max_cycle", f"expected an integer >= 1, got {max_cycle!r}")
    scale = float(capacity_scale)
    cap = _partition_capacity(profile, scale)
    part = partition(profile, cfg, cap, best_effort=True)

    if cfg.epsilon == 0:  # the config forbids any delayed update: only reorder and assign links
        return PlanResult(_no_delay(part, cfg, scale, cap, "epsilon == 0"), part, (), (), 0, 1, 1, "no_delay")
    # Enough capacity: WFBP finishes within the (scaled) backward stage, so nothing needs a delay. The
    # last bucket's tail alone never qualifies at s = 1 (the delayed tail is offered instead).
    _, finish = _list_schedule(part)
    if finish <= scale * part.backward_s * (1 + _REL_TOL):
        sched = _no_delay(part, cfg, scale, cap, "wfbp finishes within the backward stage's capacity")
        return PlanResult(sched, part, (), (), 0, 1, 1, "no_delay")

    m = _Machine(part, cfg, scale, budget)
    limit = _SEARCH_PER_CYCLE * max_cycle
    # Each update needs every bucket sent once (at least its cheapest link's time), and an iteration
    # offers at most s*(F+B) per link: a cycle shorter than their ratio cannot exist. Skip the search.
    need = math.fsum(min(row) for row in m.w)
    offer = len(m.links) * scale * (part.forward_s + part.backward_s)
    if need > max_cycle * offer:
        limit = 0
    records: list[IterationRecord] = []
    start, period, keys = _run_until_repeat(m, limit, records)
    if period > 0:
        found = _steady_cycle(m, records, keys, start, period, limit, max_cycle)
        if found is not None:
            s, unroll = found
            sched = _emit(part, cfg, scale, cap, m, records, s, period, unroll, capped=False)
            return PlanResult(sched, part, tuple(records), m.group_records(), s, period, unroll, "deft", m.solve_s)

    # Capped: close a cycle of max_cycle iterations by flushing in its last backward.
    m.reset()
    records = [m.step(t, flush=(t == max_cycle - 1)) for t in range(max_cycle)]
    sched = _emit(part, cfg, scale, cap, m, records, 0, max_cycle, 1, capped=True)
    return PlanResult(sched, part, tuple(records), m.group_records(), 0, max_cycle, 1, "capped", m.solve_s)


def _run_until_repeat(m: _Machine, limit: int, records: list[IterationRecord]
                      ) -> tuple[int, int, list[QueueState]]:
    """Step the machine from empty queues until the queue state at the start of an iteration repeats
    (at most ``limit`` iterations), recording each iteration in ``records``.

    The machine is a deterministic function of that state, so from the first repetition on it runs
    in a cycle. Returns (first iteration of the repeating part, its period, the state before each
    recorded iteration); ``(-1, -1, ...)`` when no state repeated within ``limit``.
    """
    keys: list[QueueState] = []
    seen: dict[QueueState, int] = {}
    for t in range(limit):
        key = m.state_key(t)
        if key in seen:
            return seen[key], t - seen[key], keys
        seen[key] = t
        keys.append(key)
        records.append(m.step(t))
    return -1, -1, keys


def _steady_cycle(m: _Machine, records: list[IterationRecord], keys: list[QueueState], start: int, period: int,
                  limit: int, max_cycle: int) -> tuple[int, int] | None:
    """Where the emitted cycle starts and how often the period is unrolled, or ``None`` (then capped).

    The cycle starts at an iteration of the repeating part whose future queue is empty, so no update
    group straddles the cycle boundary. Its groups may complete after the period ends (delayed
    updates), so the machine runs on (appending to ``records``, at most until ``2 * limit``) until
    every group ending in the period is complete; the period is unrolled until each group's
    communication lies within one cycle, which must not exceed ``max_cycle`` iterations.
    """
    s = next(i for i in range(start, start + period) if keys[i][3] == 0)

    def window() -> list[int]:
        return [i for i, g in enumerate(m.groups) if s <= g[-1] < s + period]

    t = len(records)
    while t < 2 * limit and (t < s + period or any(m.complete[i] is None for i in window())):
        records.append(m.step(t))
        t += 1
    groups = window()
    lags = [done - m.groups[i][-1] for i in groups if (done := m.complete[i]) is not None]
    if not groups or len(lags) != len(groups):
        return None
    unroll = max(lags) // period + 1
    return (s, unroll) if period * unroll <= max_cycle else None


def _emit(profile: Profile, cfg: DeftConfig, scale: float, capacity_s: float, m: _Machine,
          records: list[IterationRecord],
          s: int, period: int, unroll: int, capped: bool) -> Schedule:
    """The cycle: iterations ``s .. s+period-1`` repeated ``unroll`` times (see the module docstring)."""
    cycle = period * unroll
    stages: list[StagePlan] = []
    cases: list[list[int | None]] = []
    for r in range(unroll):
        for q in range(period):
            rec = records[s + q]
            pos = r * period + q
            stages.append(StagePlan(pos, "forward", tuple(CommTask(x.bucket, x.origin, x.link) for x in rec.forward)))
            stages.append(StagePlan(pos, "backward", tuple(CommTask(x.bucket, x.origin, x.link) for x in rec.backward)))
            cases.append([rec.forward_case, rec.backward_case])
    updates: list[Update] = []
    window = sorted((g for g in range(len(m.groups)) if s <= m.groups[g][-1] < s + period),
                    key=lambda g: m.groups[g][0])
    for r in range(unroll):
        for g in window:
            done = m.complete[g]
            assert done is not None
            updates.append(Update(tuple(i - s + r * period for i in m.groups[g]), done - s + r * period))
    in_cycle = records[s:s + period]
    ks = [k for rec in in_cycle for k in rec.knapsacks]
    meta: JsonDict = {
        "planner": "deft.solver.plan", "mode": "capped" if capped else "deft", "solver": cfg.solver,
        "capacity_scale": scale, "capacity_s": capacity_s, "cases": cases, "cycle_start": s, "period": period,
        "unroll": unroll, "cycle_capped": capped, "knapsack_calls": m.calls, "solver_work": m.work,
        "exact_budget_exhausted": m.budget_exhausted,
        "optimal": all(k.optimal for k in ks),
        "max_gap": max(((k.bound - k.value) / k.bound if k.bound > 0 else 0.0) for k in ks) if ks else 0.0,
        "dropped_by_repair": sum(len(rec.dropped) for rec in in_cycle),
        "forward_capacity_s": m.cap_forward, "backward_end_s": m.end_backward, "bucket_floor_s": m.floor,
        "forward_s": profile.forward_s, "backward_s": profile.backward_s,
    }
    sched = Schedule(
        cycle=cycle, links=profile.link_names,
        bucket_numel=tuple(b.numel for b in profile.buckets), bucket_nbytes=tuple(b.nbytes for b in profile.buckets),
        stages=tuple(stages), updates=tuple(updates), profile_digest=profile.digest(), meta=meta,
    )
    return _with_predictions(profile, sched)
