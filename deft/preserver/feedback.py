"""The preserver's feedback loop (DeFT section IV.C.3): accept a schedule only if it converges like DDP.

A schedule's cycle of ``N`` iterations applies ``m`` updates merging ``K = k_1..k_m`` iterations
(:attr:`deft.schedule.Schedule.batch_sequence`). The Gaussian walk predicts the loss after one period
of the steady state (:func:`steady_period`: the cycle, or the shortest repeating part of its update
pattern, so that a cycle written out twice is judged as itself) for plain data parallelism (``N``
steps of batch ``B``) and for the schedule (``m`` steps of ``k_i B``; only the updates applied within
the period count, see :func:`applied_sequence`); their ratio (:func:`schedule_ratio`) must lie in
``[1 - epsilon, 1 + epsilon]``. Otherwise the knapsack
capacity is multiplied by ``config.capacity_growth`` (more communication per stage, so fewer delayed
updates) and the solver re-plans, at most ``config.preserver_max_tries`` times; if no try passes, deft
falls back to the no-delay schedule. A ratio above ``1 + epsilon`` (the walk predicts the schedule *better*, which
happens near ``S*`` where larger batches rebound less) is rejected too, as in the paper: that
prediction rests on the plug-in approximation where it is weakest.

What ``epsilon`` means for a user
---------------------------------
=====================  ============================================================================
``epsilon``            behaviour
=====================  ============================================================================
``0``                  No delayed update at all: every iteration applies its own update, exactly
                       like torch DDP (same parameters to float tolerance). deft only reorders the
                       communication and spreads it over the links. Safest, least speed-up when
                       communication exceeds computation.
``0.01`` (default)     The paper's setting. Merged updates are accepted while the predicted loss at
                       the end of a cycle is within 1% of DDP's. Far from convergence (loss well
                       above ``S*``) this allows little merging when the gradient is strong
                       (``lr * mu`` not small against the loss), more as training slows down.
``0.05``               Trades more accuracy risk for speed: schedules whose cycle loses up to ~5% of
                       the predicted progress. Reasonable when communication dominates and the
                       final accuracy is checked anyway.
``0.2``                Aggressive: most solver schedules pass; convergence per iteration can be
                       visibly slower. For bandwidth-starved settings or experiments only. Whatever
                       epsilon allows, a schedule the walk predicts slower to a target than the
                       no-delay plan is not taken (see "Speed" below).
preserver disabled     (``preserver = false``) The solver's first schedule is used as is, with no
                       convergence test and no re-check during training: fastest plan, no
                       guarantee about convergence.
=====================  ============================================================================

What each setting did in a training run is in benchmarks/RESULTS.md ("What the accuracy knob does"): the
larger values lost accuracy there because a stale schedule passed (see :func:`applied_sequence` and
``STALENESS_MARGIN``). That short, high-learning-rate run is harsh on stale updates; long runs with
decaying learning rates are less so.

Stability
---------
The walk sees only the batch sequence; it cannot tell a lag-free merge from a stale update. When
:class:`WalkStats` carries the top Hessian eigenvalue and the optimizer's update rule, every try is
also checked by :func:`deft.preserver.stability.check_stability`: a schedule whose delayed-update
recurrence is unstable along the sharpest direction (curvature beyond ``margin`` x its stability
edge) is rejected whatever its ratio (:func:`judge`); lag-free schedules have torch DDP's edge and are
never rejected on these grounds. Each try records the radius, edge and verdict (``Try.stability``,
``meta["preserver"]["log"]``); :class:`Recheck` re-plans when the running schedule becomes unstable.
With the check available the walk stops charging a stale update's lag as missing progress
(:func:`applied_sequence`): the two would price the same staleness twice.

Without the check (no curvature estimate, or an optimizer :meth:`~deft.preserver.stability.OptimizerSpec.from_torch`
does not model) a schedule that needs it is refused (``"stability unchecked"``, :func:`needs_stability_check`):
torch DDP's maths is the safe path, and the walk alone does not see what staleness costs. One
iteration of delay shrinks heavy ball's edge from ``2 (1 + β)`` to ``1 - β`` in ``h`` (38-fold at
``β = 0.9``; :mod:`deft.preserver.stability`), so whether a stale update is safe depends on a curvature
nobody measured. Lag-free merges stay: at the optimizer's own learning rate a merge of ``k`` is one
step every ``k`` iterations, radius ``ρ_1^{1/k}``, torch DDP's edge whatever the curvature; what it
costs is progress, which the walk prices without a curvature. A merge whose learning rate is scaled
(``merge_lr_scaling``) steps ``f(k)`` times further and has ``1 / f(k)`` of that edge, so it needs the
check too. The reason on record names the opt-ins (:data:`UNCHECKED_OPT_IN`): ``ddp.calibrate(closure)``
measures the curvature, ``stale_unchecked = true`` lets the walk alone judge them (it then prices a
stale update's lag as missing progress: :func:`applied_sequence`), and ``preserver = false`` takes the
solver's plan untested.

The learning rate
-----------------
Both the walk and the check read ``stats.lr`` (and the spec's): :func:`deft.preserver.stability.planning_lr`,
the rate the plan will run at (a warm-up's peak, not its current fraction). When the optimizer's
rate grows beyond what was judged anyway (:func:`lr_outgrown`), the runtime re-checks at once
(:meth:`Recheck.check` with ``trigger``), re-planning if the running schedule no longer passes.

Speed
-----
Epsilon bounds how much progress per iteration a schedule may lose; it does not ask whether the time
it saves buys that back. :func:`judge` therefore also drops a try predicted no faster per iteration
than the no-delay plan (which keeps torch DDP's parameters; its accuracy is then not judged at all)
and rejects one the walk predicts *slower to a target*: one period keeps ``p``
(:func:`progress_kept`) of the baseline's loss decrease in ``t / t_no_delay`` of the no-delay plan's
time, so it is behind at every wall time when ``p < t / t_no_delay``. A merge of ``k`` with the same
learning rate keeps ``p ~ 1/k`` where the gradient dominates the noise and ``p ~ 1`` where the noise
dominates. Without this rule the walk's test alone accepted a merge of the character LM that was faster
per iteration yet ended at a worse loss and reached the target later (measured at epsilon 0.5, three
seeds: benchmarks/results/preserver_validation.md).

Statistics
----------
:class:`WalkStats` carries the current loss, ``mu = |g|²``, ``sigma² = gᵀΣg`` (per sample; for Adam in
its preconditioned metric, ``gᵀPg`` and ``gᵀPΣPg``: :mod:`deft.preserver.gaussian_walk`), the
learning rate and the batch of one iteration *across all ranks* (ranks x per-rank batch), since the
all-reduced update averages that many samples. ``mu`` and ``sigma`` come from
:mod:`deft.preserver.noise`; while they are unknown (before training, or with one rank) the preserver
keeps the no-delay schedule and :class:`Recheck` asks for a re-plan once they are known.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError
from deft.preserver.gaussian_walk import convergence_ratio, expected_loss_after, expected_next_loss, merge_lr_factor
from deft.preserver.noise import WALK_METRICS
from deft.preserver.stability import Plan, StabilityCheck, applied_updates, check_stability
from deft.schedule import Schedule
from deft.solver.plan import ExactBudget, accumulate_plan, no_delay_plan, plan

if TYPE_CHECKING:  # pragma: no cover
    from deft.preserver.noise import NoiseEstimate
    from deft.preserver.stability import OptimizerSpec
    from deft.profile import Profile

log = logging.getLogger("deft.preserver")

#: ``plan(profile, config, *, capacity_scale) -> Schedule`` (deft.solver.plan.plan)
Planner = Callable[..., Schedule]
#: ``no_delay_plan(profile, config) -> Schedule`` (deft.solver.plan.no_delay_plan)
NoDelayPlanner = Callable[..., Schedule]
#: ``accumulate_plan(profile, config, k) -> Schedule`` (deft.solver.plan.accumulate_plan)
AccumulatePlanner = Callable[..., Schedule]


@dataclass(frozen=True)
class WalkStats:
    """The walk's inputs at the current point of training (see the module docstring).

    * ``loss``: a smoothed training loss (one batch's loss is itself noisy), ``>= s_star``;
    * ``mu``, ``sigma``: from :class:`deft.preserver.noise.NoiseEstimator`, in the optimizer's metric
      (``metric``: ``"euclidean"`` for SGD, ``"adam"``: measured on gradients scaled by Adam's
      ``sqrt(P)``; :mod:`deft.preserver.gaussian_walk`, "The walk in the optimizer's geometry");
    * ``lr``: the step size of plain SGD in that metric (the walk models ``z -= lr * g_B``; for momentum
      SGD the steady-state step is ``lr / (1 - momentum)``, for Adam the raw ``lr``:
      :func:`deft.preserver.noise.walk_geometry` decides);
    * ``batch``: the global batch of one iteration (all ranks);
    * ``curvature``, ``optimizer`` (optional, together): the top Hessian eigenvalue of the training loss
      (:mod:`deft.preserver.curvature`) and the optimizer's update rule
      (:meth:`deft.preserver.stability.OptimizerSpec.from_torch`). With both, a schedule whose update
      recurrence is unstable along the sharpest direction (:func:`deft.preserver.stability.check_stability`)
      is rejected whatever its walk ratio. Without them, ``unchecked`` says why (for the record).
    """

    loss: float
    mu: float
    sigma: float
    lr: float
    batch: float
    s_star: float = 0.0
    curvature: float | None = None
    optimizer: OptimizerSpec | None = None
    metric: str = "euclidean"
    unchecked: str = ""  # without curvature or optimizer: why the stability check cannot run

    def __post_init__(self) -> None:
        # One evaluation validates every field with errors that name it.
        expected_next_loss(self.loss, self.mu, self.sigma, self.lr, self.batch, self.s_star)
        if self.metric not in WALK_METRICS:
            raise ContractError("preserver", "metric",
                                f"expected one of {', '.join(WALK_METRICS)}, got {self.metric!r}")
        if (self.curvature is None) != (self.optimizer is None):
            raise ContractError("preserver", "curvature" if self.curvature is None else "optimizer",
                                "curvature and optimizer are given together (the stability check needs both)")

    @classmethod
    def from_estimate(cls, loss: float, estimate: NoiseEstimate | None, lr: float, batch: float,
                      s_star: float = 0.0, metric: str = "euclidean") -> WalkStats | None:
        """From a :class:`deft.preserver.noise.NoiseEstimate`; ``None`` while mu or sigma is unknown."""
        if estimate is None or estimate.sigma is None:
            return None
        return cls(loss=loss, mu=estimate.mu, sigma=estimate.sigma, lr=lr, batch=batch, s_star=s_star,
                   metric=metric)

    def to_dict(self) -> JsonDict:
        return dataclasses.asdict(self)

    @property
    def prices_lag(self) -> bool:
        """Whether the walk counts a stale update's lag as missing progress (:func:`applied_sequence`):
        only while the stability check, which prices staleness itself, is not available."""
        return self.curvature is None or self.optimizer is None

    def stability(self, schedule: Schedule | Plan) -> StabilityCheck | None:
        """The schedule's stability along the sharpest direction; ``None`` without curvature."""
        if self.curvature is None or self.optimizer is None:
            return None
        return check_stability(schedule, self.curvature, self.optimizer)


@dataclass(frozen=True)
class Try:
    """One round of the feedback loop; ``kind`` names the planner (``capacity_scale`` is set for "deft" only)."""

    capacity_scale: float | None
    k: tuple[int, ...]
    ratio: float | None
    accepted: bool
    applied: tuple[int, ...] = ()  # the updates the ratio counted (applied_sequence, lag priced or not)
    window: int = 0  # the steady-state period the ratio was taken over (steady_period)
    kind: str = "deft"  # "deft" (the planner at a capacity), "accumulate" (lag-free merge) or "no_delay"
    plan: Plan = ()  # when each update lands and how stale it is (deft.preserver.stability.applied_updates)
    stability: StabilityCheck | None = None  # when the curvature was known
    rejected_on: str | None = None  # why a try was not accepted: one of REJECTIONS
    progress: float | None = None  # progress_kept, when the statistics were known
    schedule: Schedule | None = dataclasses.field(default=None, repr=False, compare=False)  # for Recheck

    def to_dict(self) -> JsonDict:
        """The try's record; with its schedule, what that schedule was predicted to take per iteration
        and the CP-SAT work its knapsacks spent (where a decision's time went)."""
        doc: JsonDict = {"kind": self.kind, "capacity_scale": self.capacity_scale, "k": list(self.k),
                         "applied": list(self.applied),
                         "window": self.window, "ratio": _json_float(self.ratio), "accepted": self.accepted,
                         "rejected_on": self.rejected_on, "progress": _json_float(self.progress),
                         "stability": None if self.stability is None else self.stability.to_dict()}
        if self.schedule is not None:
            doc["predicted_s"] = _json_float(self.schedule.predicted_iteration_s)
            work = self.schedule.meta.get("solver_work")
            if isinstance(work, (int, float)):
                doc["solver_work"] = float(work)
        return doc


@dataclass(frozen=True)
class PreserveResult:
    """The chosen schedule (its ``meta["preserver"]`` records the outcome), every try, whether a try
    passed the test (``False``: the no-delay fallback was used) and why."""

    schedule: Schedule
    tries: tuple[Try, ...]
    accepted: bool
    reason: str = ""
    no_delay_s: float = 0.0  # the no-delay plan's predicted iteration time (0: not predicted), for Recheck

    @property
    def stats_were_unknown(self) -> bool:
        """The fallback was taken because mu and sigma were unknown, not because tries failed."""
        return not self.accepted and not any(t.capacity_scale is not None for t in self.tries)


def _json_float(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def steady_period(schedule: Schedule) -> int:
    """The shortest ``p`` dividing the cycle with an update pattern that repeats every ``p`` iterations.

    Shifting every update group (its positions and ``apply_after``) by ``p`` positions, modulo the
    cycle, gives the same groups. A planner may write one steady state as a cycle of 3 or, unrolled,
    of 6 (:mod:`deft.solver.plan`); both have period 3, so the preserver judges both alike.
    """
    n = schedule.cycle
    pattern = {(u.positions, u.apply_after) for u in schedule.updates}
    for p in range(1, n):
        if n % p:
            continue
        shifted = set()
        for positions, after in pattern:
            moved = tuple(x + p for x in positions)
            if moved[0] >= n:  # the group moves into the next cycle: write it in this one
                moved, after = tuple(x - n for x in moved), after - n
            if moved[-1] >= n:  # it would straddle the cycle boundary: no group of a p-periodic pattern does
                break
            shifted.add((moved, after + p))
        else:
            if shifted == pattern:
                return p
    return n


def applied_sequence(schedule: Schedule, lag_priced: bool = True) -> tuple[int, ...]:
    """Batch multiples of the updates one steady-state period applies, in order.

    The period is :func:`steady_period` (the cycle unless it repeats a shorter pattern); the groups
    are those of its first repetition. The paper compares ``N`` steps of ``B`` with the schedule's
    ``K`` over one cycle, which ignores when an update lands. A delayed update applied after the
    cycle's last iteration (``apply_after >= cycle``) is stale: its gradient was computed
    ``apply_after - last`` iterations before it is applied.

    * ``lag_priced`` (used when the stability check is not available, i.e. the curvature is unknown):
      only the updates applied *within* the period count; a stale one lands in the next window, so
      its lag is counted as progress missing from every window. A schedule whose only change is
      staleness (K all ones, updates one iteration late) then gets a ratio below 1 that grows with
      ``lr * mu`` against the loss. This is a proxy, and a conservative one on purpose: with momentum,
      one step of staleness costs much accuracy in training (measured: benchmarks/RESULTS.md).
    * not ``lag_priced`` (the curvature and the optimizer are known): every update of the period
      counts, wherever it lands. In the steady state each period applies as many updates as it
      starts (the one that lands late is replaced by the previous period's), so the walk's
      first-order progress is the merges' alone. What staleness really costs is second order: the
      gradient applied was taken ``lag`` steps back, ``g(w_t) - g(w_{t-lag}) ~ H (w_t - w_{t-lag})``,
      which is exactly the delayed recurrence :func:`deft.preserver.stability.check_stability`
      prices along the sharpest direction (where it costs most). Counting the lag in the walk as
      well would charge it twice. In training, every stale schedule that the Lanczos curvature calls
      unstable lost accuracy, while the one it calls stable (the MLP's stale-by-one ``K=[1, 1]``)
      matched torch DDP although the lag-priced walk rejected it at epsilon 0.01 (measured, three
      seeds: benchmarks/results/preserver_validation.md and its _seed1, _seed2 companions).
    """
    p = steady_period(schedule)
    return tuple(u.k for u in schedule.updates if u.positions[0] < p and (u.apply_after < p or not lag_priced))


def schedule_ratio(schedule: Schedule, stats: WalkStats, merge_lr_scaling: str = "none") -> float:
    """``E_baseline / E_schedule`` over one steady-state period (:func:`steady_period`): that many steps
    of ``B`` against the updates the period applies (:func:`applied_sequence`, the lag priced while
    ``stats`` has no curvature); 1.0 for a no-delay schedule. The same steady state written as a longer
    cycle gets the same ratio. A merged update steps with ``lr`` times the factor of ``merge_lr_scaling``
    (``config.merge_lr_scaling``)."""
    return convergence_ratio(stats.loss, stats.mu, stats.sigma, stats.lr, stats.batch,
                             applied_sequence(schedule, stats.prices_lag), stats.s_star,
                             window=steady_period(schedule), merge_lr_scaling=merge_lr_scaling)


#: Why a try was not taken (``Try.rejected_on``), in the order they are tested. The first is about
#: speed alone: such a try is not judged on accuracy grounds at all.
NO_FASTER = "no faster"  # predicted no faster per iteration than the no-delay plan
UNCHECKED = "stability unchecked"  # needs the stability check, which cannot run (needs_stability_check)
UNSTABLE = "unstable"  # the update recurrence diverges along the sharpest direction (stability)
WALK_RATIO = "walk ratio"  # the walk's loss ratio outside [1 - epsilon, 1 + epsilon]
SLOWER_TO_TARGET = "slower to target"  # the walk's progress per second below the no-delay plan's
REJECTIONS = (NO_FASTER, UNCHECKED, UNSTABLE, WALK_RATIO, SLOWER_TO_TARGET)
#: How a user lets deft take the schedules refused as :data:`UNCHECKED` (said in the preserver's reason).
UNCHECKED_OPT_IN = ("call ddp.calibrate(closure) so that the curvature is measured, or set stale_unchecked = true "
                    "to let the walk alone judge them (preserver = false: the solver's plan, untested)")


def needs_stability_check(schedule: Schedule, merge_lr_scaling: str = "none") -> bool:
    """Whether ``schedule``'s stability depends on the curvature (module docstring, "Stability"): it has
    a stale update, or a merged one stepped with a scaled learning rate. A lag-free schedule at the
    optimizer's learning rate has torch DDP's edge and does not."""
    return _is_stale(schedule) or (merge_lr_scaling != "none" and any(k > 1 for k in schedule.batch_sequence))


def progress_kept(schedule: Schedule, stats: WalkStats, merge_lr_scaling: str = "none") -> float:
    """The walk's predicted loss *decrease* over one steady-state period, the schedule's over plain data
    parallelism's: ``(s - E_schedule) / (s - E_baseline)``, counting every update of the period (a rate:
    :func:`schedule_ratio` compares loss *levels* and may charge a stale update's lag, which in the
    steady state is a constant offset of a few iterations, not a slower rate). 1.0 when the walk predicts
    no decrease for the baseline (``mu`` and ``sigma`` both 0: no evidence either way).

    Why a second statistic: the ratio says how far behind a period leaves the schedule, this says how
    fast it moves. A merge of ``k`` with the same learning rate keeps ``~1/k`` of the progress where the
    gradient dominates the noise (one step instead of ``k``) and ``~1`` where noise dominates (the
    larger batch averages it away): the critical-batch-size picture of McCandlish et al. (2018)."""
    period = steady_period(schedule)
    applied = applied_sequence(schedule, lag_priced=False)
    e_base = expected_loss_after(stats.loss, [stats.batch] * period, stats.mu, stats.sigma, stats.lr, stats.s_star)
    e_sched = expected_loss_after(stats.loss, [k * stats.batch for k in applied], stats.mu, stats.sigma,
                                  [stats.lr * merge_lr_factor(k, merge_lr_scaling) for k in applied],
                                  stats.s_star) if applied else stats.loss
    drop = stats.loss - e_base
    return 1.0 if drop <= 0.0 else (stats.loss - e_sched) / drop


class Verdict(NamedTuple):
    """What :func:`judge` concluded about one schedule."""

    ratio: float  # schedule_ratio
    stability: StabilityCheck | None  # None without a curvature
    progress: float  # progress_kept
    rejected_on: str | None  # one of REJECTIONS, None when it passes


def judge(schedule: Schedule, stats: WalkStats, config: DeftConfig, no_delay_s: float = 0.0) -> Verdict:
    """The verdict on one schedule; ``rejected_on`` is ``None`` when it passes.

    In order (:data:`REJECTIONS`):

    1. ``"no faster"``: predicted per iteration no faster than the no-delay plan (``no_delay_s``), which
       keeps torch DDP's parameters; a schedule that gains nothing per iteration is not worth any risk,
       so its accuracy is not judged (its ratio and stability are still recorded).
    2. ``"stability unchecked"``: it needs the stability check (:func:`needs_stability_check`) and the
       curvature or the optimizer's rule is unknown, unless ``config.stale_unchecked``.
    3. ``"unstable"``: its delayed-update recurrence diverges along the sharpest direction (only with the
       curvature known; lag-free schedules never do: :mod:`deft.preserver.stability`).
    4. ``"walk ratio"``: the paper's test, :func:`passes`.
    5. ``"slower to target"``: the walk predicts it reaches a loss later than the no-delay plan. Over a
       period the schedule makes ``p = progress_kept`` of the baseline's progress in
       ``t_schedule / t_no_delay`` of the no-delay plan's time; it is slower to any nearby loss when
       ``p < t_schedule / t_no_delay``. Epsilon bounds how much progress per iteration may be lost; this
       refuses to lose it when the time saved per iteration does not buy it back (a merge of 2 where the
       gradient dominates needs a 2x faster iteration). Independent of epsilon, so a larger epsilon still
       accepts a superset and never gives a slower schedule.

    Rules 1 and 5 need both predicted times (``schedule.predicted_iteration_s`` and ``no_delay_s``
    positive); without them they are skipped."""
    ratio = schedule_ratio(schedule, stats, config.merge_lr_scaling)
    chk = stats.stability(schedule)
    progress = progress_kept(schedule, stats, config.merge_lr_scaling)
    t_s = schedule.predicted_iteration_s
    timed = t_s > 0.0 and no_delay_s > 0.0
    why = None
    if timed and t_s >= no_delay_s:
        why = NO_FASTER
    elif chk is None and not config.stale_unchecked and needs_stability_check(schedule, config.merge_lr_scaling):
        why = UNCHECKED
    elif chk is not None and not chk.stable:
        log.info("preserver: K=%s rejected as unstable: %s", schedule.batch_sequence, chk.reason)
        why = UNSTABLE
    elif not passes(schedule.batch_sequence, ratio, config.epsilon):
        why = WALK_RATIO
    elif timed and progress < t_s / no_delay_s:
        why = SLOWER_TO_TARGET
    return Verdict(ratio, chk, progress, why)


def _judged(schedule: Schedule, stats: WalkStats, config: DeftConfig, no_delay_s: float, *,
            capacity_scale: float | None, kind: str = "deft") -> Try:
    """One try, judged by :func:`judge`."""
    v = judge(schedule, stats, config, no_delay_s)
    return Try(k=schedule.batch_sequence, ratio=v.ratio, accepted=v.rejected_on is None,
               applied=applied_sequence(schedule, stats.prices_lag), window=steady_period(schedule),
               plan=applied_updates(schedule), stability=v.stability, rejected_on=v.rejected_on,
               progress=v.progress, schedule=schedule, capacity_scale=capacity_scale, kind=kind)


def passes(k: tuple[int, ...], ratio: float, epsilon: float) -> bool:
    """The acceptance test. ``epsilon == 0`` accepts only schedules without merged updates."""
    if epsilon == 0.0:
        return all(x == 1 for x in k) and ratio == 1.0
    return 1.0 - epsilon <= ratio <= 1.0 + epsilon


def _checked(schedule: object, who: str) -> Schedule:
    if not isinstance(schedule, Schedule):
        raise ContractError("preserver", who, f"expected the planner to return a Schedule, got {type(schedule)!r}")
    return schedule


def unchecked_note(tries: Sequence[Try], stats: WalkStats | None) -> str:
    """What the record says when tries were refused as :data:`UNCHECKED`: how many, why, and the opt-ins
    (empty when none was)."""
    n = sum(t.rejected_on == UNCHECKED for t in tries)
    if not n:
        return ""
    why = (stats.unchecked if stats is not None else "") or "no curvature or optimizer rule"
    return (f"{n} tr{'y' if n == 1 else 'ies'} with stale updates (or lr-scaled merges) refused, the stability "
            "check could not run "
            f"({why}): torch DDP's maths is the safe path; to allow them, {UNCHECKED_OPT_IN}")


def _finish(schedule: Schedule, tries: list[Try], accepted: bool, config: DeftConfig,
            stats: WalkStats | None, reason: str, no_delay_s: float = 0.0) -> PreserveResult:
    chosen = next(t for t in reversed(tries) if t.schedule is schedule)  # every path records its schedule
    note = unchecked_note(tries, stats)
    reason = f"{reason}; {note}" if note else reason
    record: JsonDict = {
        "accepted": accepted,
        "reason": reason,
        "ratio": _json_float(chosen.ratio),
        "tries": len([t for t in tries if t.capacity_scale is not None]),
        "capacity_scale": chosen.capacity_scale,
        "epsilon": config.epsilon,
        "stats": None if stats is None else stats.to_dict(),
        "log": [t.to_dict() for t in tries],
    }
    meta: JsonDict = {**schedule.meta, "preserver": record}
    return PreserveResult(schedule=dataclasses.replace(schedule, meta=meta), tries=tuple(tries), accepted=accepted,
                          reason=reason, no_delay_s=no_delay_s)


#: A stale schedule (updates applied after their cycle) is taken over the fastest lag-free candidate
#: only when predicted this much faster: one iteration of staleness costs far more accuracy than merging
#: pairs (measured: benchmarks/RESULTS.md, update-timing check), and neither the walk
#: (lag priced or not) nor a curvature estimate taken at planning resolves that risk well enough to
#: take it for a small gain.
STALENESS_MARGIN = 0.25
#: Largest number of iterations a lag-free merge (:func:`deft.solver.plan.accumulate_plan`) may merge.
#: At the same learning rate, merging 2 kept torch DDP's accuracy (measured:
#: benchmarks/results/preserver_validation.md), while larger merges that the walk accepted lost accuracy
#: and validation loss. The walk cannot price them: its noise estimate after a few warm-up iterations is
#: often sigma = 0, and then a merge of k looks like k steps of progress lost, not the ~1/sqrt(k).
MAX_MERGE = 2


def _is_stale(schedule: Schedule) -> bool:
    return any(u.apply_after >= schedule.cycle or u.apply_after != u.last for u in schedule.updates)


def _delays_nothing(schedule: Schedule) -> bool:
    """Every update is one iteration's gradient applied right after it: torch DDP's maths."""
    return not _is_stale(schedule) and all(k == 1 for k in schedule.batch_sequence)


def prefer_lag_free(lag_free: Schedule, candidate: Schedule) -> bool:
    """Whether the lag-free merge ``lag_free`` is taken over an accepted ``candidate``: against a fresh
    candidate when strictly faster; against a stale one (an update applied after its cycle, or not
    right after its last iteration) unless the candidate is predicted more than
    :data:`STALENESS_MARGIN` faster, i.e. ``t_candidate >= (1 - STALENESS_MARGIN) t_lag_free``."""
    if not _is_stale(candidate):
        return lag_free.predicted_iteration_s < candidate.predicted_iteration_s
    return candidate.predicted_iteration_s >= (1.0 - STALENESS_MARGIN) * lag_free.predicted_iteration_s


def _best_merge(profile: Profile, config: DeftConfig, stats: WalkStats, accumulate_planner: AccumulatePlanner | None,
                tries: list[Try], no_delay_s: float) -> Schedule | None:
    """The fastest lag-free merge (largest ``k``) that passes :func:`judge`, or None.

    The walk's ratio falls as ``k`` grows (more progress merged away), so the search stops at the
    first ``k`` that fails on ratio or stability; one that is only too slow may be followed by a
    larger, faster one.
    """
    merge = accumulate_plan if accumulate_planner is None else accumulate_planner
    best = None
    for k in range(2, MAX_MERGE + 1):
        s = _checked(merge(profile, config, k), "accumulate_plan")
        t = _judged(s, stats, config, no_delay_s, capacity_scale=None, kind="accumulate")
        tries.append(t)
        log.info("preserver: lag-free merge of %d iterations, ratio %.5f: %s", k, t.ratio,
                 "passes" if t.accepted else f"fails ({t.rejected_on})")
        if t.rejected_on in (UNCHECKED, UNSTABLE, WALK_RATIO):
            break
        if t.accepted:
            best = s
    return best


def preserve(profile: Profile, config: DeftConfig, stats: WalkStats | None,
             planner: Planner | None = None, no_delay_planner: NoDelayPlanner | None = None,
             accumulate_planner: AccumulatePlanner | None = None, budget: ExactBudget | None = None
             ) -> PreserveResult:
    """Run the feedback loop and return the schedule to use.

    * ``config.epsilon == 0``: the no-delay schedule directly (no merged update can pass), even
      with the preserver disabled: epsilon = 0 promises DDP's parameters.
    * ``config.preserver`` false: the planner's schedule at capacity scale 1, untested.
    * ``stats is None`` (mu, sigma unknown): the no-delay schedule, not accepted, reason logged.
    * otherwise tries capacity scales ``capacity_growth ** i`` for ``i < preserver_max_tries`` and
      returns the first schedule that passes; if none does, the no-delay schedule. The tries stop
      early at one that delays and merges nothing and is no faster than the no-delay plan.

    Every try is judged by :func:`judge`: one predicted no faster per iteration than the no-delay plan
    (which keeps torch DDP's parameters), or slower to a target by the walk's own account, is not taken.
    A lag-free merge is preferred to a stale schedule unless the latter is much faster
    (:func:`prefer_lag_free`).

    ``planner``, ``no_delay_planner`` and ``accumulate_planner`` default to
    :func:`deft.solver.plan.plan`, :func:`deft.solver.plan.no_delay_plan` and
    :func:`deft.solver.plan.accumulate_plan`; tests inject their own. The default planner's tries share
    one :class:`~deft.solver.plan.ExactBudget` of CP-SAT work (a decision costs what one plan may, however
    many tries it takes; the later tries' knapsacks fall to the greedy once it is spent): ``budget``, or
    :meth:`~deft.solver.plan.ExactBudget.for_config`'s.
    """
    shared = budget if budget is not None else ExactBudget.for_config(config)
    # the default planner's exact tries are judged on the greedy's packing first (_planned_try, Note);
    # with solver "greedy" that packing is the plan itself
    screen = None if planner is not None or config.solver != "exact" \
        else functools.partial(plan, budget=ExactBudget(units=0.0))
    planner = planner or functools.partial(plan, budget=shared)
    tries: list[Try] = []
    fallback = _NoDelay(profile, config, stats, no_delay_planner or no_delay_plan, tries)
    if config.epsilon == 0.0:
        return fallback.take("epsilon = 0: no delayed update allowed", accepted=True)
    if not config.preserver:
        return _untested(profile, config, stats, planner, tries)
    if stats is None:
        return fallback.take("mu and sigma unknown yet: cannot test delayed updates", accepted=False)
    return _feedback_loop(profile, config, stats, planner, accumulate_planner, tries, fallback, screen)


class _NoDelay:
    """The no-delay schedule: the yardstick every try is timed against and the loop's fallback.

    Planned once, when first needed, and checked to merge no updates (it must keep torch DDP's
    parameters); taking it records it as the last try.
    """

    def __init__(self, profile: Profile, config: DeftConfig, stats: WalkStats | None,
                 planner: NoDelayPlanner, tries: list[Try]) -> None:
        self.profile, self.config, self.stats, self.planner, self.tries = profile, config, stats, planner, tries
        self._schedule: Schedule | None = None

    def schedule(self) -> Schedule:
        if self._schedule is None:
            self._schedule = _checked(self.planner(self.profile, self.config), "no_delay_plan")
        return self._schedule

    def take(self, reason: str, accepted: bool) -> PreserveResult:
        s = self.schedule()
        if any(k != 1 for k in s.batch_sequence):
            raise ContractError("preserver", "no_delay_plan",
                                f"expected a schedule without merged updates, got K = {s.batch_sequence}")
        self.tries.append(Try(capacity_scale=None, k=s.batch_sequence, ratio=1.0, accepted=accepted,
                              applied=applied_sequence(s), window=steady_period(s), kind="no_delay", schedule=s))
        log.info("preserver: no-delay schedule (%s)", reason)
        return _finish(s, self.tries, accepted, self.config, self.stats, reason, s.predicted_iteration_s)


def _untested(profile: Profile, config: DeftConfig, stats: WalkStats | None, planner: Planner,
              tries: list[Try]) -> PreserveResult:
    """The preserver disabled: the planner's schedule at capacity scale 1, used as is. Its ratio and
    stability are recorded when the statistics are known, but nothing is enforced."""
    s = _checked(planner(profile, config, capacity_scale=1.0), "plan")
    ratio = None if stats is None else schedule_ratio(s, stats, config.merge_lr_scaling)
    chk = None if stats is None else stats.stability(s)  # recorded, not enforced: nothing is checked
    tries.append(Try(capacity_scale=1.0, k=s.batch_sequence, ratio=ratio, accepted=True,
                     applied=applied_sequence(s), window=steady_period(s), plan=applied_updates(s),
                     stability=chk, schedule=s))
    log.info("preserver disabled: using the solver's schedule K=%s untested (ratio %s)",
             s.batch_sequence, "unknown" if ratio is None else f"{ratio:.4f}")
    return _finish(s, tries, True, config, stats, "preserver disabled")


def _feedback_loop(profile: Profile, config: DeftConfig, stats: WalkStats, planner: Planner,
                   accumulate_planner: AccumulatePlanner | None, tries: list[Try], fallback: _NoDelay,
                   screen: Planner | None = None) -> PreserveResult:
    """The paper's loop with the lag-free merges beside it: tries growing capacities until one passes
    :func:`judge` (or until a try that delays nothing is no faster than the no-delay plan: larger
    capacities delay nothing either), prefers the best passing merge to a stale schedule
    (:func:`prefer_lag_free`), and falls back to a faster merge, else the no-delay schedule (accepted
    when the tries were only no faster than it)."""
    lo, hi = 1.0 - config.epsilon, 1.0 + config.epsilon
    nd_s = fallback.schedule().predicted_iteration_s
    merged = _best_merge(profile, config, stats, accumulate_planner, tries, nd_s)
    for i in range(config.preserver_max_tries):
        scale = config.capacity_growth ** i
        s, t = _planned_try(profile, config, stats, planner, screen, scale, nd_s)
        tries.append(t)
        log.info("preserver try %d/%d: capacity x%.4g, K=%s, ratio %.5f in [%.4g, %.4g]: %s",
                 i + 1, config.preserver_max_tries, scale, t.k, t.ratio, lo, hi,
                 "accepted" if t.accepted else f"rejected ({t.rejected_on})")
        if not t.accepted:
            if t.rejected_on == NO_FASTER and _delays_nothing(s):
                # Each later try has more capacity, hence no more delay: this one delays and merges
                # nothing already, so every later one could pass only by being faster than the no-delay
                # plan, which this one was not. Stopping here gives the same plans in less planning time
                # (benchmarks/results/planner.md).
                log.info("preserver: try %d delays nothing and is no faster than the no-delay plan; "
                         "larger capacities would delay nothing either: no more tries", i + 1)
                break
            continue
        chosen, reason = s, f"ratio {t.ratio:.5f} within [{lo:.4g}, {hi:.4g}]"
        if merged is not None and prefer_lag_free(merged, s):
            chosen, reason = merged, f"lag-free merge K={merged.batch_sequence} preferred to stale K={t.k}"
        return _finish(chosen, tries, True, config, stats, reason, nd_s)
    if merged is not None and merged.predicted_iteration_s < nd_s:  # a merge gains nothing unless faster
        return _finish(merged, tries, True, config, stats,
                       f"no DeFT schedule passed; lag-free merge K={merged.batch_sequence} did", nd_s)
    if any(t.rejected_on == NO_FASTER for t in tries):
        # The knapsack at a large capacity often ends with K = [1] sending everything in backward,
        # slower than the no-delay plan's lag-free forward stage: the no-delay plan wins on its own terms.
        return fallback.take(f"no faster schedule passed: the tries the walk and the stability check would "
                             f"accept are predicted no faster than the no-delay plan ({nd_s * 1e3:.1f} ms)",
                             accepted=True)
    log.warning("preserver: no schedule passed in %d tries (ratios %s); falling back to the no-delay schedule",
                config.preserver_max_tries, ", ".join(f"{t.ratio:.4f}" for t in tries if t.ratio is not None))
    return fallback.take(f"no schedule within [{lo:.4g}, {hi:.4g}] in {config.preserver_max_tries} tries",
                         accepted=False)


#: A try rejected for these on the greedy's packing is not planned again with CP-SAT (_planned_try).
STALE_REJECTIONS = (UNCHECKED, UNSTABLE)


def _planned_try(profile: Profile, config: DeftConfig, stats: WalkStats, planner: Planner, screen: Planner | None,
                 scale: float, no_delay_s: float) -> tuple[Schedule, Try]:
    """The try at capacity ``scale``: ``planner``'s schedule, judged; where ``screen`` (the greedy's
    packing) gives a schedule rejected as stale (:data:`STALE_REJECTIONS`), that one, judged.

    Note: why screen. Each exact knapsack packs at least the greedy's value, yet at the same capacity
    a stale greedy schedule refused on stability had an exact counterpart refused likewise in every
    decision measured: the refusal does not turn on the last per cent of packing, while CP-SAT spent a
    decision's whole budget on such a try (benchmarks/results/planner_gap.md, "Judged on the greedy's
    packing first": every decision there the same). The try recorded is then the greedy's schedule, whose K may differ
    from the exact one's; a re-check that finds it passing later re-plans with the exact planner. Where
    the greedy's schedule passes, or is refused for a reason the packing moves (no faster, the walk),
    the exact plan is made and judged as before."""
    if screen is not None:
        g = _checked(screen(profile, config, capacity_scale=scale), "plan")
        tried = _judged(g, stats, config, no_delay_s, capacity_scale=scale)
        if tried.rejected_on in STALE_REJECTIONS:
            return g, tried
    s = _checked(planner(profile, config, capacity_scale=scale), "plan")
    return s, _judged(s, stats, config, no_delay_s, capacity_scale=scale)


#: The runtime re-checks out of turn when the optimizer's learning rate exceeds this multiple of the one
#: judged: a stale schedule accepted at ``margin`` x its edge (0.5) keeps ``margin * LR_RECHECK_GROWTH``
#: of it (edges scale as ``1 / lr``), still inside the edge, until the re-check judges the new rate.
LR_RECHECK_GROWTH = 1.25


def lr_outgrown(judged: float, now: float) -> bool:
    """Whether the learning rate ``now`` has grown beyond ``LR_RECHECK_GROWTH`` x the one ``judged``
    (:func:`deft.preserver.stability.planning_lr` of the optimizer's groups, both)."""
    return judged > 0.0 and now > judged * LR_RECHECK_GROWTH


@dataclass(frozen=True)
class RecheckDecision:
    """What :meth:`Recheck.check` concluded: the current schedule's ratio now, and whether to re-plan."""

    iteration: int
    ratio: float
    replan: bool
    reason: str


class Recheck:
    """Re-evaluates the running schedule every ``config.recheck_every`` iterations.

    The walk's inputs drift as training proceeds (the loss falls, the gradient weakens, the noise
    changes), so a schedule accepted at the start may leave the tolerance later, and a delayed
    schedule rejected earlier may pass now. Both are cheap to test without the solver: the ratio
    depends only on a schedule's update pattern, and the rejected tries' schedules are remembered. Re-plan when

    1. the running schedule's ratio left ``[1 - epsilon, 1 + epsilon]``, it became unstable, or the
       walk now predicts it slower to a target than the no-delay plan (:func:`judge`), or
    2. a schedule that was rejected at a smaller capacity (so: a faster schedule), or a rejected
       lag-free merge predicted faster than the running schedule, would pass :func:`judge` now (a try
       rejected as no faster than the no-delay plan stays rejected: the predicted times do not change
       between re-checks), or
    3. the running schedule is the no-delay fallback taken while mu and sigma were unknown, and they
       are known now.

    :meth:`check` runs every ``config.recheck_every`` iterations, or at once with a ``trigger`` (the
    runtime's, when the learning rate outgrew what was judged: :func:`lr_outgrown`).
    With ``epsilon == 0`` or the preserver disabled there is nothing to re-check.
    """

    def __init__(self, config: DeftConfig, result: PreserveResult) -> None:
        self.config = config
        self.reset(result)

    def reset(self, result: PreserveResult) -> None:
        """Start over with the outcome of a new :func:`preserve` call."""
        self.result = result
        chosen = result.schedule.batch_sequence
        # Candidates that would be faster than the running schedule: every DeFT try before the accepted
        # one (each later try had more capacity, hence no more delay), or every DeFT try when none was
        # accepted (the no-delay fallback, or a lag-free merge taken because no DeFT try passed).
        tried = [t for t in result.tries if t.kind == "deft"]
        accepted = [i for i, t in enumerate(tried) if t.accepted]
        if accepted:
            tried = tried[:accepted[-1]]
        # Rejected lag-free merges predicted faster than the running schedule: as the loss falls the
        # noise comes to dominate and a merge keeps more of its progress (the critical batch grows).
        running_s = result.schedule.predicted_iteration_s
        tried += [t for t in result.tries if t.kind == "accumulate" and not t.accepted and t.schedule is not None
                  and 0 < t.schedule.predicted_iteration_s < running_s]
        self._faster = [t for t in tried if (t.k, t.plan) != (chosen, applied_updates(result.schedule))
                        and t.rejected_on != NO_FASTER]

    def due(self, iteration: int) -> bool:
        return iteration > 0 and iteration % self.config.recheck_every == 0

    def check(self, iteration: int, stats: WalkStats | None, trigger: str = "") -> RecheckDecision | None:
        """``None`` when not due (and no ``trigger``), when there is nothing to check, or while the
        statistics are unknown. ``trigger``: why this check runs now, out of turn (said in its reason)."""
        if not (trigger or self.due(iteration)) or not self.config.preserver or self.config.epsilon == 0.0 \
                or stats is None:
            return None
        decision = self._check(iteration, stats)
        if trigger:
            decision = dataclasses.replace(decision, reason=f"{trigger}: {decision.reason}")
        return decision

    def _check(self, iteration: int, stats: WalkStats) -> RecheckDecision:
        eps = self.config.epsilon
        k = self.result.schedule.batch_sequence
        nd_s = self.result.no_delay_s
        ratio, chk, progress, why = judge(self.result.schedule, stats, self.config, nd_s)
        if self.result.stats_were_unknown:
            return self._decide(iteration, ratio, True, "mu and sigma are known now: delayed updates can be tested")
        if why == WALK_RATIO:
            return self._decide(iteration, ratio, True,
                                f"running schedule K={k} has ratio {ratio:.5f}, outside [{1 - eps:.4g}, {1 + eps:.4g}]")
        if why == UNSTABLE:
            assert chk is not None
            return self._decide(iteration, ratio, True, f"running schedule K={k} is unstable now: {chk.reason}")
        if why == SLOWER_TO_TARGET:
            return self._decide(iteration, ratio, True, f"running schedule K={k} is now predicted slower to a "
                                f"target than the no-delay plan (progress kept {progress:.3f})")
        # why == NO_FASTER: the running schedule is the no-delay plan itself (or as fast); nothing to re-plan for
        for cand in self._faster:
            assert cand.schedule is not None  # every try preserve() records carries its schedule
            v = judge(cand.schedule, stats, self.config, nd_s)  # the lag priced as the statistics allow
            if v.rejected_on is None:
                return self._decide(iteration, ratio, True, f"previously rejected K={cand.k} now has ratio "
                                    f"{v.ratio:.5f}: a faster schedule may pass")
        return self._decide(iteration, ratio, False, f"ratio {ratio:.5f} still within tolerance")

    @staticmethod
    def _decide(iteration: int, ratio: float, replan: bool, reason: str) -> RecheckDecision:
        log.info("preserver recheck at iteration %d: %s%s", iteration, reason, " -> re-plan" if replan else "")
        return RecheckDecision(iteration=iteration, ratio=ratio, replan=replan, reason=reason)
