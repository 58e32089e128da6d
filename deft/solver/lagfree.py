"""Lag-free forward stage: overlap communication with the next forward without staleness.

DeFT's delayed updates fill the forward stage with the previous iteration's buckets but apply their
update an iteration late, which costs accuracy. ByteScheduler's observation gives another way to use
the forward: the forward of layer ``l`` needs only layer ``l``'s own update. So an update may finish
*in* the next forward (``Update.finish_in_forward``): the buckets nearest the output, which the next
forward needs last, are sent after the others and their parameters are updated just before their
layer's forward. The parameters every layer sees are exactly torch DDP's (``epsilon == 0`` allows it).

The plan (cycle 1, one update per iteration):

* the *forward set* ``R = {0..j}`` are the ``j + 1`` buckets nearest the output (bucket 0 is ready
  first in backward and needed last in forward); every other bucket is sent in backward as it
  becomes ready (WFBP order), then ``R`` in forward order (``j, j-1, .., 0``: earliest deadline
  first), launched right after the backward;
* each bucket goes to the link that finishes it first given what that link already carries (list
  scheduling, as :func:`deft.solver.plan.no_delay_plan` does);
* ``j`` is chosen by simulating every candidate (``j = -1`` is the no-delay plan) with the
  discrete-event simulator, which models the per-layer wait of the next forward, and keeping the
  fastest. The deadline of bucket ``b`` is its layer's forward start, so the search minimises the
  forward stall plus the step's wait for the backward set.

This is a search over a one-parameter family, not the exact deadline knapsack: with buckets in ready
order on a FIFO link the family contains the orders that respect both WFBP readiness and forward
deadlines, which is where the optimum lies when the link is the bottleneck.
"""

from __future__ import annotations

from dataclasses import replace

from deft.config import DeftConfig
from deft.profile import Profile
from deft.schedule import CommTask, Schedule, StagePlan, Update
from deft.solver.partition import profile_for_schedule
from deft.solver.plan import no_delay_plan
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


SEARCH_ITERATIONS = 8


def lagfree_plan(profile: Profile, config: DeftConfig | None = None) -> Schedule:
    """The fastest lag-free plan (module docstring): the no-delay plan or one finishing in the forward."""
    cfg = DeftConfig.resolve(config)
    base = no_delay_plan(profile, cfg)
    part = profile_for_schedule(profile, base, cfg)
    best, best_s, tried = base, base.predicted_iteration_s, []
    for j in range(part.n):
        sched = candidate(part, j, base)
        # A cycle-1 schedule is in its steady state after an iteration or two: 8 simulated iterations
        # give the 24-iteration time to 1e-13 on the reference profiles at a third of the cost (the
        # search runs in the planning iteration, which training waits for).
        res = simulate_schedule(part, sched, iterations=SEARCH_ITERATIONS)
        tried.append([j, float(res.iteration_s)])
        if res.iteration_s < best_s * (1 - 1e-9):
            best, best_s = replace(sched, predicted_iteration_s=float(res.iteration_s),
                                   predicted_bubble_ratio=float(res.bubble_ratio)), float(res.iteration_s)
    if best is not base:  # the stored prediction at the simulator's default length, as every other plan's
        res = simulate_schedule(part, best)
        best = replace(best, predicted_iteration_s=float(res.iteration_s),
                       predicted_bubble_ratio=float(res.bubble_ratio))
    forward_set = [t.bucket for t in best.stage(0, "forward").comms]
    meta = {**base.meta, "mode": "lag-free forward" if forward_set else "no_delay",
            "forward_set": sorted(forward_set), "no_delay_s": base.predicted_iteration_s,
            "candidates": tried}
    return replace(best, meta=meta)
