"""Lag-free forward stage: overlap communication with the next forward without staleness.

DeFT's delayed updates fill the forward stage with the previous iteration's buckets but apply their
update an iteration late, which costs accuracy. ByteScheduler's observation gives another way to use
the forward: the forward of layer ``l`` needs only layer ``l``'s own update. So an update may finish
*in* the next forward (``Update.finish_in_forward``): the buckets nearest the output, which the next
forward needs last, are sent after the others and their parameters are updated just before their
layer's forward. The parameters every layer sees are exactly torch DDP's (``epsilon == 0`` allows it).

The plans (cycle 1, one update per iteration), all simulated and the fastest kept:

* the no-delay plan (:func:`deft.solver.plan.no_delay_plan`: every bucket in its own backward);
* *forward sets* ``R = {0..j}``: the ``j + 1`` buckets nearest the output (bucket 0 is ready first in
  backward and needed last in forward) are sent in the next forward stage in forward order
  (``j, j-1, .., 0``: earliest deadline first), launched right after the backward; every other bucket
  is sent in backward as it becomes ready (WFBP order); each bucket goes to the link that finishes it
  first given what that link already carries (list scheduling). :func:`candidate`;
* *early sends*: every bucket sent in the backward stage, as soon as a link is free, earliest deadline
  first (:func:`deadline_first`), then improved by a first-improvement local search over links and
  launch orders (:func:`local_search`, the simulator as the objective); the buckets still in flight
  at the step are *deferred* (:attr:`deft.schedule.Update.deferred`): the step does not wait for
  them, the next forward of their module does. This fills the links while the backward has produced
  only the output side's gradients, which the forward sets leave idle until the backward ends. Tried
  on a few partitions (:data:`PARTITION_SCALES`): the partition's capacity trades start-ups (fewer,
  larger pieces) against balancing the links and the deadlines (more, smaller ones).

The deadline of bucket ``b`` is its module's forward start, so the search minimises the forward stall
plus the step's wait. None of this is the exact deadline knapsack, but on the digits-CNN profile the
best plan comes close to a lower bound of every lag-free plan (the buckets ready late in
the backward must be sent before the next forward reaches them; the bound and the measurement:
benchmarks/results/replay.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from deft._json import JsonValue
from deft.config import DeftConfig
from deft.errors import ContractError
from deft.profile import Profile
from deft.schedule import CommTask, Schedule, StagePlan, Update
from deft.solver.partition import partition, profile_for_schedule
from deft.solver.plan import WINDOW_SHARE, no_delay_plan
from deft.solver.simulate import simulate_schedule


def _assign(profile: Profile, order: list[int], ready: list[float], free: dict[str, float]) -> list[CommTask]:
    """List scheduling of ``order`` onto the links (earliest finish), updating ``free``."""
    tasks = []
    for b in order:
        name = min(profile.link_names, key=lambda lk: (max(free[lk], ready[b]) + profile.comm_time(b, lk),
                                                       profile.link_names.index(lk)))
        free[name] = max(free[name], ready[b]) + profile.comm_time(b, name)
        tasks.append(CommTask(b, 0, name))
    return tasks


def candidate(part: Profile, j: int, base: Schedule) -> Schedule:
    """The schedule with forward set ``{0..j}`` on the partitioned profile ``part`` (``j = -1``: none)."""
    n = part.n
    ready = list(part.ready_s)
    free = {lk: 0.0 for lk in part.link_names}
    backward = _assign(part, [b for b in range(n) if b > j], ready, free)
    end = part.backward_s
    forward = [CommTask(t.bucket, 1, t.link)
               for t in _assign(part, list(range(j, -1, -1)), [end] * n, free)]
    return replace(base, stages=(StagePlan(0, "forward", tuple(forward)), StagePlan(0, "backward", tuple(backward))),
                   updates=(Update((0,), 0, finish_in_forward=bool(forward)),))


#: The search's simulations: 1 warm-up and 2 measured iterations (a cycle-1 schedule is in its steady
#: state after one, so on the reference profiles these times equal the default length's to rounding),
#: at most ``SEARCH_EVALUATIONS`` per partition in the local search (each evaluation is one simulation,
#: the search's cost). Against 2 and 4 they give the same plans on the reference, compat-suite and
#: testbed profiles in less time (benchmarks/results/planner.md).
SEARCH_WARMUP, SEARCH_ITERATIONS, SEARCH_EVALUATIONS = 1, 2, 120
#: Partitions tried by the early-send search, as multiples of the no-delay plan's capacity (the
#: largest bucket's primary-link time): 1 is the no-delay plan's own partition; coarser pieces pay
#: fewer start-ups, finer ones balance the links and the deadlines better.
PARTITION_SCALES = (1.0, 2.0, 0.5)
#: A search simulation runs the warm-up, the measured iterations and one more (the engine's last), each
#: costing about the same per bucket: its work is ``SIM_ITERATIONS x buckets`` (SearchBudget's unit).
SIM_ITERATIONS = SEARCH_WARMUP + SEARCH_ITERATIONS + 1
#: Simulated bucket-iterations per second of one core, measured on the testbed machine quiet
#: (benchmarks/results/planner.md, "The lag-free search in its window").
SIM_WORK_PER_SECOND = 45_000.0
#: The share of a background decision's plan-lag window the lag-free search may spend, as much as the
#: knapsacks' (:data:`deft.solver.plan.WINDOW_SHARE`; the search runs first, the preserver's knapsacks
#: after it). A quarter cut the GPT-2's early-send search on two 250 Mbit/s links short of the plan the
#: whole search finds (benchmarks/results/planner.md, "The lag-free search in its window").
SEARCH_WINDOW_SHARE = WINDOW_SHARE


@dataclass
class SearchBudget:
    """The simulations the lag-free search (:func:`lagfree_plan`) may run, in simulated bucket-iterations
    (one search simulation of an ``n``-bucket profile costs ``SIM_ITERATIONS * n``).

    Invariant: a simulation starts only where it fits in what is left, so a holder spends at most
    ``units``. Deterministic in the profile, not in the load: the same budget gives the same plan on
    a busy machine, only later. Past it the search keeps the best plan found so far (the no-delay plan
    at least). The forward sets get at most :data:`FORWARD_SET_SHARE` of it, spread evenly over the
    buckets; each partition's local search an equal share of the rest."""

    units: float
    spent: float = 0.0

    @classmethod
    def for_window(cls, window_s: float) -> SearchBudget:
        """The search of a decision made while training goes on for ``window_s`` seconds (the plan-lag
        window): :data:`SEARCH_WINDOW_SHARE` of it at :data:`SIM_WORK_PER_SECOND`."""
        if not (math.isfinite(window_s) and window_s >= 0.0):
            raise ContractError("lagfree_plan", "window_s", f"expected a finite number of seconds >= 0, got {window_s}")
        return cls(SIM_WORK_PER_SECOND * SEARCH_WINDOW_SHARE * window_s)

    def simulations(self, n_buckets: int, share: float = 1.0) -> int:
        """How many search simulations of an ``n_buckets`` profile fit in ``share`` of what is left."""
        return int(max(0.0, self.units - self.spent) * share // (SIM_ITERATIONS * max(n_buckets, 1)))

    def spend(self, n_buckets: int, simulations: int) -> None:
        self.spent += simulations * SIM_ITERATIONS * max(n_buckets, 1)


#: The most of a :class:`SearchBudget` the forward-set candidates take (the local searches the rest).
FORWARD_SET_SHARE = 0.5


def spread(n: int, k: int) -> list[int]:
    """``k`` of ``0 .. n-1``, evenly spaced with both ends included (all of them where ``k >= n``)."""
    if k >= n:
        return list(range(n))
    if k <= 0:
        return []
    if k == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def deadline_first(part: Profile) -> list[CommTask]:
    """Every bucket sent in the backward, each as soon as a link can take it, earliest deadline first.

    List scheduling over the backward's ready times ``ready_s`` (from the backward start, links free
    then): at the earliest moment ``t = max(min free link, min ready of the unsent)`` the bucket sent
    next is, among those ready by ``t``, the one the next forward needs first (the highest id: the
    forward runs buckets ``n-1 .. 0``), on the link that finishes it first. Bucket 0, ready first and
    needed last, so fills the links while the backward has nothing else ready.
    """
    ready = part.ready_s
    free = {lk: 0.0 for lk in part.link_names}
    unsent = set(range(part.n))
    tasks = []
    while unsent:
        t = max(min(free.values()), min(ready[b] for b in unsent))
        b = max(x for x in unsent if ready[x] <= t)
        link = min(part.link_names, key=lambda lk: (max(free[lk], ready[b]) + part.comm_time(b, lk),
                                                    part.link_names.index(lk)))
        free[link] = max(free[link], ready[b]) + part.comm_time(b, link)
        tasks.append(CommTask(b, 0, link))
        unsent.remove(b)
    return tasks


def early_schedule(template: Schedule, order: list[CommTask], deferred: tuple[int, ...] | None = None) -> Schedule:
    """Every bucket of ``order`` sent in the backward stage (listed order per link), the buckets of
    ``deferred`` (default: all) applied in the next forward (:attr:`deft.schedule.Update.deferred`).
    ``template`` gives the buckets, links and meta."""
    d = tuple(range(template.n_buckets)) if deferred is None else tuple(sorted(deferred))
    return replace(template, stages=(StagePlan(0, "forward"), StagePlan(0, "backward", tuple(order))),
                   updates=(Update((0,), 0, finish_in_forward=bool(d), deferred=d),))


def _neighbours(order: list[CommTask], links: tuple[str, ...]) -> list[list[CommTask]]:
    """The local search's moves, in a fixed order: move one send to another link (same place in the
    launch order), or swap a send with the next send of its link."""
    out = []
    for i, task in enumerate(order):
        for lk in links:
            if lk != task.link:
                out.append([*order[:i], CommTask(task.bucket, 0, lk), *order[i + 1:]])
    for i, task in enumerate(order):
        j = next((j for j in range(i + 1, len(order)) if order[j].link == task.link), None)
        if j is not None:
            moved = list(order)
            moved[i], moved[j] = order[j], order[i]
            out.append(moved)
    return out


def local_search(part: Profile, template: Schedule, starts: list[list[CommTask]],
                 budget: int = SEARCH_EVALUATIONS) -> tuple[list[CommTask], float, int]:
    """First-improvement hill climbing over launch orders and links (:func:`_neighbours`), every bucket
    deferred, minimising the simulated iteration time (:func:`simulate_schedule`).

    Deterministic (fixed move order, an improvement must exceed one part in 1e9), at most
    ``max(budget, len(starts))`` simulations; starts from the best of ``starts``. Returns the order,
    its simulated time and the simulations run.
    """
    def cost(order: list[CommTask]) -> float:
        return float(simulate_schedule(part, early_schedule(template, order), iterations=SEARCH_ITERATIONS,
                                       warmup=SEARCH_WARMUP).iteration_s)

    scored = [(cost(o), i) for i, o in enumerate(starts)]
    best_s, first = min(scored)
    best, used, improved = starts[first], len(starts), True
    while improved and used < budget:
        improved = False
        for cand in _neighbours(best, part.link_names):
            if used >= budget:
                break
            used += 1
            c = cost(cand)
            if c < best_s * (1 - 1e-9):
                best, best_s, improved = cand, c, True
                break
    return best, best_s, used


def needed_deferred(part: Profile, sched: Schedule) -> tuple[int, ...]:
    """The buckets of ``sched`` (every bucket deferred) whose send ends after the step in its simulated
    steady state: only those need to wait in the forward. Waiting for the others at the step changes
    no simulated time (they are done by then) and saves the runtime a per-module optimizer call."""
    res = simulate_schedule(part, sched)
    t0, t1 = res.window
    steps = {e.iteration: e.start_s for e in res.events if e.kind in ("update", "step")}
    late = {e.bucket for e in res.events
            if e.kind == "comm" and e.iteration in steps and t0 <= steps[e.iteration] < t1
            and e.end_s > steps[e.iteration] + 1e-12}
    return tuple(sorted(late))


def _template(part: Profile, base: Schedule, capacity_s: float) -> Schedule:
    """``base`` on the buckets of ``part`` (the partition at ``capacity_s``, recorded in the meta so
    :func:`profile_for_schedule` finds it again)."""
    return replace(base, bucket_numel=tuple(b.numel for b in part.buckets),
                   bucket_nbytes=tuple(b.nbytes for b in part.buckets),
                   stages=(StagePlan(0, "forward"),
                           StagePlan(0, "backward", tuple(CommTask(b, 0, base.links[0]) for b in range(part.n)))),
                   updates=(Update((0,), 0),), meta={**base.meta, "capacity_s": capacity_s})


def _partitioned(profile: Profile, cfg: DeftConfig, base: Schedule, scale: float) -> tuple[Profile, Schedule]:
    """``profile`` partitioned at ``scale`` x the no-delay plan ``base``'s capacity, and the template."""
    capacity = base.meta["capacity_s"]
    assert isinstance(capacity, float)
    p_s = partition(profile, cfg, capacity_s=capacity * scale, best_effort=True)
    return p_s, _template(p_s, base, capacity * scale)


def _forward_sets(part: Profile, base: Schedule, budget: SearchBudget | None) -> list[tuple[int, Schedule, float]]:
    """The forward-set candidates simulated (every one, or those ``budget`` affords): ``(j, plan, time)``."""
    sets = range(part.n) if budget is None else spread(part.n, budget.simulations(part.n, FORWARD_SET_SHARE))
    out = []
    for j in sets:
        sched = candidate(part, j, base)
        # A cycle-1 schedule is in its steady state after an iteration or two: the short simulation
        # gives the default one's time to rounding on the reference profiles at a fraction of the cost (the
        # search runs in the planning iteration, which training waits for).
        res = simulate_schedule(part, sched, iterations=SEARCH_ITERATIONS, warmup=SEARCH_WARMUP)
        out.append((j, sched, float(res.iteration_s)))
    if budget is not None:
        budget.spend(part.n, len(sets))
    return out


def lagfree_plan(profile: Profile, config: DeftConfig | None = None,
                 scales: Sequence[float] = PARTITION_SCALES, budget: SearchBudget | None = None) -> Schedule:
    """The fastest lag-free plan (module docstring): the no-delay plan, one finishing in the forward
    with the forward set launched after the backward, or one sending every bucket in the backward
    (earliest deadline first, improved by :func:`local_search`, on the partitions ``scales``, multiples
    of the no-delay plan's capacity) that defers the buckets still in flight at the step.

    ``budget``: the simulations the search may run (None: every forward set, and
    :data:`SEARCH_EVALUATIONS` per partition); ``meta["candidates"]`` lists what was simulated."""
    if not scales or not all(math.isfinite(x) and x > 0 for x in scales):
        raise ContractError("lagfree_plan", "scales", f"expected finite capacity multiples > 0, got {list(scales)}")
    cfg = DeftConfig.resolve(config)
    base = no_delay_plan(profile, cfg)
    part = profile_for_schedule(profile, base, cfg)
    best, best_s = base, base.predicted_iteration_s
    tried: list[list[JsonValue]] = []  # [candidate, predicted seconds]: the forward set j, or "early x<scale>"
    mode = "no_delay"
    for j, sched, sched_s in _forward_sets(part, base, budget):
        tried.append([j, sched_s])
        if sched_s < best_s * (1 - 1e-9):
            best, best_s, mode = sched, sched_s, "lag-free forward"
    best_part = part
    capacity = base.meta.get("capacity_s")
    seen: set[tuple[int, ...]] = set()
    todo = list(scales) if isinstance(capacity, float) and capacity > 0 else [1.0]
    for i, scale in enumerate(todo):
        p_s, tmpl = (part, base) if scale == 1.0 else _partitioned(profile, cfg, base, scale)
        sizes = tuple(b.nbytes for b in p_s.buckets)
        if sizes in seen:
            continue
        seen.add(sizes)
        starts = [deadline_first(p_s)]
        if scale == 1.0 and best is not base:  # the best forward set, sent from the backward stage
            starts.append(list(best.stage(0, "backward").comms)
                          + [CommTask(t.bucket, 0, t.link) for t in best.stage(0, "forward").comms])
        # this partition's share of what is left: the partitions still to come get as much
        evaluations = SEARCH_EVALUATIONS if budget is None else min(
            SEARCH_EVALUATIONS, budget.simulations(p_s.n, 1.0 / (len(todo) - i)))
        if evaluations < len(starts):
            continue
        order, order_s, used = local_search(p_s, tmpl, starts, evaluations)
        if budget is not None:
            budget.spend(p_s.n, used)
        tried.append([f"early x{scale:g}", order_s])
        if order_s < best_s * (1 - 1e-9):
            best, best_s, best_part = early_schedule(tmpl, order), order_s, p_s
            mode = f"lag-free forward, early sends (partition x{scale:g})"
    if best.updates[0].deferred:  # an early-send plan (candidate() and no_delay_plan defer nothing)
        best = early_schedule(best, list(best.stage(0, "backward").comms), needed_deferred(best_part, best))
    if best is not base:  # the stored prediction at the simulator's default length, as every other plan's
        res = simulate_schedule(best_part, best)
        best = replace(best, predicted_iteration_s=float(res.iteration_s),
                       predicted_bubble_ratio=float(res.bubble_ratio))
    forward_set = sorted([t.bucket for t in best.stage(0, "forward").comms] + list(best.updates[0].deferred))
    meta = {**best.meta, "mode": mode, "forward_set": forward_set, "no_delay_s": base.predicted_iteration_s,
            "candidates": tried}
    return replace(best, meta=meta)
