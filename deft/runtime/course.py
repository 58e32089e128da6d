"""The run's course between iterations: when deft profiles, plans, re-checks, adapts and switches, and
which schedule runs next.

:class:`Course` owns the run's calendar, the warm-up timer, the preserver's live inputs, planning (and
its one background slot), the adaptation and the run's records. The facade calls it at the phase
machine's events (:meth:`Course.before_forward`, :meth:`Course.forward_begins`, :meth:`Course.after_step`)
and it installs what every rank agreed on through the one ``install`` function the facade gives it.

The life of a run (docs/DESIGN.md, "Runtime"): warm-up iterations on torch DDP's schedule; after the
first, rank 0's gradient-ready order becomes the layout; profile iterations (the timer rotates the
buckets over the links); after the step of ``plan_at - 1`` the profile is reduced over the ranks and
rank 0 plans (now, or in the background while training goes on); every rank installs the agreed plan;
then re-checks (preserver), adaptation windows, and switches at cycle boundaries.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypedDict

import torch
from torch import nn

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import DeftError
from deft.preserver.feedback import LR_RECHECK_GROWTH, WalkStats, lr_outgrown
from deft.preserver.stability import planning_lr
from deft.profile import Profile
from deft.runtime.adapt import Adaptation, SynchronousClock, synchronous_candidate
from deft.runtime.background import JobSlot
from deft.runtime.buckets import FlatLayout
from deft.runtime.calendar import Calendar, place, stats_after_plan
from deft.runtime.checkpoint import RuntimeState
from deft.runtime.codecs.choice import CodecInputs
from deft.runtime.codecs.first_iteration import TimedBroadcast
from deft.runtime.codecs.hooks import CommHook
from deft.runtime.codecs.policy import CodecPolicy
from deft.runtime.compute_drift import MIN_LAG_SAMPLES, ComputeClock, drift, wants_another
from deft.runtime.control import Collective, ControlPlane
from deft.runtime.eager import ForwardHooks
from deft.runtime.executor import DueUpdate, Executor, Pending
from deft.runtime.failover import LinkFailover, guarded_links, loss_phase, without_links
from deft.runtime.grad_stats import GradStats, walk_stats
from deft.runtime.layouts import balanced_links, plan_order, ready_order, warmup_layout
from deft.runtime.links import CommLink, sends_at_once
from deft.runtime.optimizer_hooks import OptimizerBinding
from deft.runtime.planning import Planning, Switch
from deft.runtime.records import RunRecord, SwitchRecord, as_object
from deft.runtime.step_clock import StepClock
from deft.runtime.tracing import profile_iters_from_env
from deft.runtime.updates import LogEntry
from deft.runtime.warmup_timer import WarmupTimer
from deft.schedule import Schedule, synchronous_schedule
from deft.solver.partition import profile_for_schedule
from deft.solver.simulate import simulate_schedule

log = logging.getLogger("deft.runtime")

#: The adaptation measures the schedule that ran while rank 0 planned, as the candidate it may go back
#: to, where at least this many of its iterations were timed (the last, which may wait for the plan, is
#: not); else the profile iterations' (:class:`deft.runtime.adapt.SynchronousClock`).
LAG_SAMPLES = 3


@dataclass
class LagRun:
    """The synchronous schedule that runs while rank 0 plans in the background (with the codec the
    preserver accepts so far: :meth:`CodecPolicy.lag_schedule`), from iteration ``first``, and its
    clock: what it costs beside the planner, which is what the adaptation weighs the plan against."""

    schedule: Schedule
    layout: FlatLayout
    first: int
    clock: SynchronousClock = field(default_factory=SynchronousClock)


class CourseState(TypedDict):
    """The course's fields of a checkpoint (:class:`deft.runtime.checkpoint.RuntimeState`)."""

    planned: bool
    plan_at: int
    order_known: bool
    plan_info: JsonDict


#: ``install(schedule, layout, t0)``: every rank runs ``schedule`` on ``layout`` from iteration ``t0``.
Install = Callable[[Schedule, FlatLayout, int], None]


class Course:
    """Between iterations: the decisions of the run and their records (module docstring)."""

    def __init__(self, config: DeftConfig, control: ControlPlane, module: nn.Module, names: list[str],
                 params: list[torch.Tensor], links: dict[str, CommLink], executor: Executor,
                 optim: OptimizerBinding, update_log: list[LogEntry], given_profile: Profile | None,
                 ranks: list[int] | None, install: Install, hooks: ForwardHooks, comm_hook: CommHook | None = None,
                 init_broadcast: TimedBroadcast | None = None) -> None:
        self.config, self._control, self._module = config, control, module
        self._hooks = hooks  # the wrapper's forward hooks, which the warm-up timer listens to
        self._names, self._params, self._links, self._executor = names, params, links, executor
        self._optim, self._log, self._install = optim, update_log, install
        self._primary = next(iter(links.values()))
        self.planning = Planning(config, control, given_profile, config.schedule_path)
        # which codec sends which bucket; init_broadcast: the facade's timed broadcast at construction
        self.codecs = CodecPolicy(config, control, executor, params, self._primary, ranks, self.planning.measuring,
                                  comm_hook, init_broadcast, self.planning.preload_solver)
        self.jobs = JobSlot(control)  # the plan's, then the adaptation's background decision
        self.adaptation = Adaptation(config, control, self.planning, self.jobs,
                                     {n: lk.backend for n, lk in links.items()}, self.codecs.measure_int8)
        executor.observe(self.adaptation.links)  # each link's time in the running schedule (records while adapting)
        self.record = RunRecord()
        self.failover = LinkFailover(config, control, links)  # a non-primary link that dies
        executor.guard_links(self.failover)
        self.profile_iters = profile_iters_from_env(config.profile_iters)
        self.calendar = self.place()
        self.planned = False
        self.profile: Profile | None = None  # the profile the schedule was planned from
        self.ready_order: list[int] | None = None  # rank 0's observed order, once agreed
        self.order_seen: dict[int, None] = {}  # parameters in the order their gradients arrived
        self._timer: WarmupTimer | None = None
        self._warm_layout: FlatLayout | None = None  # the layout the profile iterations ran (set at the plan)
        self._lag_run: LagRun | None = None  # what runs while rank 0 plans in the background, and its clock
        self._compute = ComputeClock()  # each iteration's compute until the plan: the drift it is priced with
        self._steps = StepClock()  # the loop's own time per iteration until the plan: the profile's step_s
        # The preserver's live inputs.
        self.losses: collections.deque[float] = collections.deque(maxlen=64)
        self.batch: int | None = None
        self.stats: GradStats | None = None
        self.calibrated: JsonDict | None = None  # rank 0's Lanczos probe (ddp.calibrate), on every rank
        self._stats_reason = ""
        self._plan_inputs: tuple[WalkStats | None, int, CodecInputs | None] | None = None  # the first plan's
        self._judged_lr: float | None = None  # the learning rate the running plan was judged at (_lr_trigger)

    def use_curvature(self, doc: JsonDict) -> None:
        """``ddp.calibrate``'s measured curvature (every rank): the next plan and re-check use it."""
        self.calibrated = doc

    # -- the calendar --------------------------------------------------------------------------------
    def place(self) -> Calendar:
        """Where warm-up ends and planning happens, with the comm hook registered now."""
        measuring = self.planning.measuring
        plain = self.codecs.plain_iterations() if measuring else 0
        return place(plain, self.config.warmup_iters, self.profile_iters, measuring)

    def register_hook(self, t: int, hook: CommHook) -> None:
        """A comm hook is registered before iteration ``t``: refused once profiling has begun without it
        (a profile mixing both would be wrong); before, the calendar moves with it."""
        cal = self.calendar
        if self.planning.measuring and cal.warm_end < t <= cal.plan_at and not self.planned:
            raise DeftError(f"register_comm_hook: profiling began at iteration {cal.warm_end} without a hook; "
                            "register the hook before training starts (or before iteration "
                            f"{cal.warm_end}), as with torch DDP")
        self.codecs.register(hook)
        if t <= self.calendar.warm_end and not self.planned:
            self.calendar = self.place()

    # -- iteration events ------------------------------------------------------------------------------
    def before_forward(self, t: int, cuda: bool) -> None:
        """Iteration ``t`` begins, before the executor's forward stage: the adaptation's clock, and in a
        profile iteration the timer's schedule (it rotates the buckets over the links)."""
        cal, ex = self.calendar, self._executor
        now = time.perf_counter()
        self.adaptation.forward_begins(t, now, cal.warm_end if self.planning.measuring else 1, cal.plan_at)
        if not self.planned:
            self._compute.forward(t, now)
        if self._lag_run is not None and not self.planned:
            self._lag_run.clock.forward(t, now, self._lag_run.first, t)  # every lag iteration so far
        if t == 0 and not self.planned and cal.warm_end < cal.plan_at:
            self.codecs.first_iteration_begins(lambda: self.batch)
        if cal.profiling(t) and not self.planned and self._timer is None:
            if self.ready_order is not None and ex.idle:
                # The warm-up's layout (a checkpoint may have been taken on another: the plan's)
                sched, lay = self._warmup(self.ready_order)
                if ex.layout is None or (ex.layout.order, ex.layout.bucket_numel) != (lay.order, lay.bucket_numel):
                    self._install(sched, lay, t)
            assert ex.layout is not None
            live = {n: lk for n, lk in self._links.items() if n in self._live()}
            # the last profile iteration's backward runs alone and its sends after it, the others' beside
            # each other: the links' contention and drag (on CUDA neither: the compute is the device's)
            shared = self.config.contention or self.config.drag
            held = self.profile_iters - 1 if self.profile_iters >= 2 and shared and not cuda else None
            self._timer = WarmupTimer(self._module, self._params, ex.layout, live, cuda, self._wait_work, self._hooks,
                                      self.failover, held, self.config.contention, self.config.drag,
                                      self.config.rank_wait)
            ex.observe(self._timer)
        if self._timer is not None and ex.idle and ex.layout is not None:
            coded = self.codecs.profile_schedule(self._timer.schedule())
            ex.install(coded, ex.layout, t, self.codecs.hooks_for(coded), hold=self._timer.holds_next())

    def forward_begins(self) -> None:
        """The executor's forward stage is launched; the model's forward begins."""
        if self.stats is not None:
            self.stats.begin_iteration(self._executor, self._params, self._optim.single, self.stats_wanted())
        self.codecs.forward_begins(self._optim.single)
        if self._timer is not None:  # after deft's own set-up: the forward is the model's alone
            self._timer.begin_iteration()

    def backward_ends(self, now: float) -> None:
        """The autograd pass of this iteration ended (the collectives of its backward may run on)."""
        self.adaptation.backward_ends(now)
        self.codecs.backward_ends(now)
        if not self.planned:
            self._compute.backward_ends(now)

    def loop_resumes(self, t: int) -> None:
        """A deft hook of iteration ``t`` returns to the training loop (:mod:`deft.runtime.step_clock`)."""
        if not self.planned:
            self._steps.resume(t, time.perf_counter())

    def loop_pauses(self) -> None:
        """A deft hook, or a training forward, begins: the loop's own work since it resumed counts."""
        if not self.planned:
            self._steps.pause(time.perf_counter())

    def forward_ends(self, output: object) -> None:
        if self._timer is not None:
            self._timer.end_forward(output)
        self.adaptation.forward_ends(output)

    def note_batch(self, batch: int | None) -> None:
        if batch is None:
            return
        self.batch = batch
        if self.stats is not None:
            self.stats.batch = batch

    def gradient_seen(self, index: int) -> None:
        if self.ready_order is None:
            self.order_seen.setdefault(index)

    def measuring(self) -> bool:
        """Do this step's updates feed the preserver's statistics (then they are applied whole)?"""
        return (self.stats is not None and self.stats_wanted()) or self.codecs.first_iteration_running

    def on_due(self, lasts: list[int], updates: list[DueUpdate], t: int, device: torch.device) -> None:
        if self.stats is not None and not self.stats.on_due(lasts, updates, t, self._control.group, device):
            self.record.nonfinite_steps.append(t)
        self.codecs.on_due(lasts, updates, t, device)

    def stats_wanted(self) -> bool:
        """Gather statistics now? Before planning, in the calendar's window (a plan in flight was made
        from the statistics so far); after it, in the window before each re-check."""
        if not self.planned:
            return not self.jobs.holds("plan") and self.calendar.stats_before_plan(self._executor.t)
        return stats_after_plan(self._executor.t, self.config.recheck_every)

    def _wait_work(self, work: Collective, link: str, b: int) -> None:
        what = "profiling all-reduce" + (f" of bucket {b}" if b >= 0 else "")
        self._executor.wait(Pending(work, link, f"{what} in iteration {self._executor.t}"))

    def iteration_ends(self) -> None:
        """The step of the iteration is over (before the iteration counter moves on)."""
        if self._timer is not None:
            self._timer.end_iteration()
        self.codecs.iteration_ends()

    def after_step(self, t: int, flush: Callable[[], None]) -> None:
        """Collective: iteration ``t - 1`` ended. The ready order after the first; then planning (or
        collecting a background plan), re-checks, adaptation and a switch at a cycle boundary."""
        if self.failover.on:
            self._executor.open_pending()  # before anything reads a deferred parameter (Executor.open_pending)
        if self.ready_order is None:
            self.ready_order = self._control.broadcast_ints(ready_order(list(self.order_seen), len(self._params)),
                                                            "gradient ready order")
            self.install_warmup(self.ready_order, t)
        decision = self.codecs.after_first_iteration(self.batch)
        if decision is not None:
            self.record.profile_codec = decision.to_dict()
        self._links_lost(t)
        if not self.planned:
            if self.stats is None:
                self.stats = GradStats.start(self.config, self._control.world)
                if self.stats is not None:
                    self.stats.batch = self.batch
                    self._executor.observe(self.stats)
            if not self.jobs.holds("plan") and t >= self.calendar.plan_at:
                return self._plan(t)
            if self.jobs.holds("plan") and self.jobs.ready(t) and not self._drift_wants_another(t):
                return self._finish_plan(t)
        elif self.planning.recheck_on and not self.planning.switch_waiting:
            trigger = self._lr_trigger()
            if trigger or t % self.config.recheck_every == 0:
                stats, stats_reason = self._walk_stats()
                self.record.rechecks.append(self.planning.recheck(t, stats, stats_reason, self.schedule, self.profile,
                                                                  trigger))
                if stats is not None:  # the adaptation re-plans on the statistics of the last decision
                    self.adaptation.walk = stats
        if self.jobs.holds("replan") and self.jobs.ready(t):
            self._finish_replan(t)
        if self.adaptation.on:
            outcome = self.adaptation.after_step(t, self.schedule, self.profile)
            if outcome is not None:
                self.record.adapt.append(outcome.record)
                if outcome.replan is not None:
                    self.record.replans.append(outcome.replan)
                self.profile = outcome.profile or self.profile
        self._maybe_switch(t, flush)

    def _lr_trigger(self) -> str:
        """Why a re-check runs out of turn: the optimizer's learning rate outgrew the one the running
        plan was judged at (:func:`deft.preserver.feedback.lr_outgrown`); empty otherwise. Each rank
        reads its own optimizer: the rates are the same on every rank (their parameters stay equal only
        so), hence so is the decision to run this collective."""
        opt = self._optim.single
        if opt is None:
            return ""
        now = planning_lr(opt.param_groups)
        if self._judged_lr is None:
            self._judged_lr = now
        if not lr_outgrown(self._judged_lr, now):
            return ""
        judged, self._judged_lr = self._judged_lr, now
        return f"learning rate {now:.4g} above {LR_RECHECK_GROWTH:g} x the {judged:.4g} judged"

    @property
    def schedule(self) -> Schedule:
        assert self._executor.schedule is not None
        return self._executor.schedule

    # -- layouts -----------------------------------------------------------------------------------------
    def install_warmup(self, order: list[int], t0: int) -> None:
        """torch DDP's behaviour during warm-up (:func:`deft.runtime.layouts.warmup_layout`); the first
        iteration's ``order`` is a guess (the gradients' ready order is not known yet)."""
        self._install(*self._warmup(order), t0)

    def _warmup(self, order: list[int]) -> tuple[Schedule, FlatLayout]:
        """torch DDP's synchronous schedule on the warm-up's buckets in ``order``, over every link by
        bytes, the large buckets cut so that the links share the bytes evenly (the first iteration, the
        profile iterations, those run while rank 0 plans). A chained hook's sends run one at a time, as
        torch DDP's on one link, on whole buckets."""
        chained = self.codecs.chained
        links = (self._primary.name,) if chained else self._live()
        layout = warmup_layout(order, self._names, self._params, self.config.bucket_cap_mb, chained,
                               self.config.first_bucket_cap_mb, split_over=len(links))
        return synchronous_schedule(layout.bucket_numel, layout.bucket_nbytes(), links,
                                    balanced_links(layout.bucket_nbytes(), links)), layout

    def _plan_layout(self, schedule: Schedule, what: str) -> FlatLayout:
        order = plan_order(self.profile, self.planning.given_profile is not None, self._names, self.ready_order)
        return FlatLayout(order, self._names, self._params, schedule.bucket_numel, what)

    def _synchronous(self, layout: FlatLayout) -> Schedule:
        """torch DDP's timing on ``layout``, its buckets over the links the profile measured (the primary
        alone when the profile was given): what runs while rank 0 plans, and what adaptation may go back to."""
        return synchronous_candidate(layout, self._live() if self.planning.measuring else (self._primary.name,))

    def _live(self) -> tuple[str, ...]:
        """The links not lost (:mod:`deft.runtime.failover`), primary first."""
        return tuple(self.failover.live(list(self._links)))

    # -- the first plan ------------------------------------------------------------------------------------
    def _walk_stats(self) -> tuple[WalkStats | None, str]:
        return walk_stats(self.config, self._control, self.losses, self.stats, self._optim.single,
                          self.batch, self.calibrated)

    def _plan(self, t: int) -> None:
        """Collective: measure (or take) a profile, rank 0 plans, every rank installs the same schedule
        (now, or when rank 0's background decision is collected: :meth:`_finish_plan`)."""
        started = time.perf_counter()
        self.profile = self._measured_profile() if self.planning.measuring else self.planning.given_profile
        self._links_lost(t)  # one lost in the probe: the plan is made without it
        if self.profile is not None and self.failover.dead:
            self.profile = without_links(self.profile, self.failover.dead)
        if self.profile is not None:  # the plan is priced for the verdicts this run waits for
            self.profile = sends_at_once(guarded_links(self.profile, self.failover.guards), self._links)
        stats, self._stats_reason = self._walk_stats()
        opt = self._optim.single
        self._judged_lr = None if opt is None else planning_lr(opt.param_groups)
        codec = self.codecs.plan_inputs(self.stats, self.batch, self.profile)
        self._plan_inputs = (stats, self._control.world, codec)
        cfg = self.config
        if stats is None and self._control.rank == 0 and cfg.epsilon > 0 and cfg.preserver \
                and self.planning.schedule_path is None:
            log.warning("deft: the preserver cannot test delayed updates (%s); it keeps the no-delay schedule",
                        self._stats_reason)
        self.adaptation.walk = stats
        layout = self._warm_layout = self._executor.layout
        if cfg.plan_lag_iters > 0 and layout is not None and self.planning.schedule_path is None:
            # Rank 0 plans in a thread; every rank trains on with torch DDP's synchronous schedule and
            # switches when it is done (deft.runtime.planning).
            self.jobs.hold("plan", self.planning.start(self.profile, stats, self._control.world, codec),
                           t + cfg.plan_lag_iters)
            lag, lag_layout = self._lag(layout)
            self._lag_run = LagRun(self.codecs.lag_schedule(lag), lag_layout, t)
            self._install(self._lag_run.schedule, lag_layout, t)
            self.adaptation.clock.exclude(time.perf_counter() - started)
            return
        schedule, info = self.planning.agree(self.profile, stats, self._control.world, codec)
        self._install_plan(t, schedule, info, None, started)

    def _lag(self, layout: FlatLayout) -> tuple[Schedule, FlatLayout]:
        """What runs while rank 0 plans: torch DDP's synchronous schedule. With a measured profile, the
        warm-up's (:meth:`_warmup`: the profile's layout, its links by bytes); a given profile keeps its
        own layout and the primary link, and a chained hook (whose sends run one at a time on whole
        buckets) the profile's layout and links (:meth:`_synchronous`)."""
        if not self.planning.measuring or self.ready_order is None or self.codecs.chained:
            return self._synchronous(layout), layout
        return self._warmup(self.ready_order)

    def _measured_profile(self) -> Profile:
        """Collective: the profile iterations' timings (and the comm hook's codec) as a Profile."""
        timer, ex = self._timer, self._executor
        assert timer is not None and ex.layout is not None
        # The profile iterations ran a comm hook or deft's profile codec on every bucket.
        codec = self.codecs.measure_profiled(ex.layout)
        backends = {n: lk.backend for n, lk in self._links.items()}
        # the profile iterations timed whole: the last one's step ends in this planning
        steps = self._steps.row(range(self.calendar.warm_end, self.calendar.plan_at - 1))
        profile = timer.profile(self._control, self._control.world, backends, type(self._module).__name__, codec,
                                ex.t, steps)
        ex.unobserve(timer)
        self.close()
        out = os.environ.get("DEFT_PROFILE_OUT")
        if out and self._control.rank == 0:
            profile.save(out)
        return self.codecs.exact(profile)

    def _finish_plan(self, t: int) -> None:
        """Collective: collect the plan :meth:`_plan` began in the background and install it."""
        started = time.perf_counter()
        schedule, info, timing = self.planning.finish(self.jobs.take())
        if self._uses_lost(schedule):  # planned before a link was lost, and not started again (lag 0)
            schedule, info = self.planning.agree(self.profile, None, self._control.world)
        schedule = self._priced_with_drift(t, schedule, info)
        self._install_plan(t, schedule, info, {"lag_iters": self.config.plan_lag_iters,
                                               **{k: round(v, 4) for k, v in timing.items()}}, started)

    def _drift_rows(self, t: int) -> tuple[list[float], list[float]] | None:
        """Collective: the slowest rank's compute of each profile and lag iteration before ``t`` (None:
        no drift is read in this run, or no profile iteration to read it against)."""
        lag, cal = self._lag_run, self.calendar
        if lag is None or self.profile is None or not self.planning.measuring or not self.config.compute_drift:
            return None
        # every lag iteration counts: a wait for the plan comes after the step, outside the compute timed
        profiled, lagged = range(cal.warm_end, cal.plan_at), range(lag.first, t)
        if not profiled:
            return None
        row = self._control.max_rows([self._compute.row([*profiled, *lagged])], "compute per iteration")[0]
        return row[:len(profiled)], row[len(profiled):]

    def _drift_wants_another(self, t: int) -> bool:
        """Collective: hold a plan done after a single lag iteration that ran faster than the profile's
        for the second reading (:func:`deft.runtime.compute_drift.wants_another`), never past the plan's
        due iteration."""
        lag = self._lag_run
        if lag is None or not 0 < t - lag.first < MIN_LAG_SAMPLES or t >= self.jobs.due:
            return False
        rows = self._drift_rows(t)
        return rows is not None and wants_another(*rows, self.config.adapt_tolerance)

    def _priced_with_drift(self, t: int, schedule: Schedule, info: JsonDict) -> Schedule:
        """Collective: the compute of the iterations that ran while rank 0 planned against the profile's
        (:mod:`deft.runtime.compute_drift`); where it drifted beyond the tolerance and the profile
        iterations' spread, the running profile's compute is scaled by it and the plan priced on that
        (recorded in ``info["compute_drift"]``; a plan whose buckets the profile cannot be cut into keeps
        its price, and the record says why)."""
        lag = self._lag_run
        if lag is None or t - lag.first < MIN_LAG_SAMPLES:
            return schedule
        rows = self._drift_rows(t)
        found = None if rows is None else drift(*rows, self.config.adapt_tolerance)
        if found is None:
            return schedule
        doc = info["compute_drift"] = found.to_dict()
        if not found.applied or self.profile is None:
            return schedule
        before, self.profile = self.profile, self.profile.scaled(compute=found.factor)
        try:
            was, now = (simulate_schedule(profile_for_schedule(self.codecs.planned_profile(p, info), schedule,
                                                               self.config), schedule).iteration_s
                        for p in (before, self.profile))
        except DeftError as e:
            doc["unpriced"] = str(e)
            return schedule
        if was <= 0:  # a profile of zero times: nothing to scale the price by
            doc["unpriced"] = "the plan simulates to no time on the profile"
            return schedule
        doc["predicted_before_s"] = schedule.predicted_iteration_s
        return replace(schedule, predicted_iteration_s=schedule.predicted_iteration_s * now / was)

    def _install_plan(self, t: int, schedule: Schedule, info: JsonDict, background: JsonDict | None,
                      started: float) -> None:
        """Every rank: run the agreed plan from iteration ``t`` on; the time since ``started`` was deft's
        own work, not the schedule's."""
        if not self.planning.recheck_on and self.stats is not None:
            self._executor.unobserve(self.stats)
            self.stats = None
        warm = self._warm_layout  # the profile iterations' layout, which the adaptation's candidate ran on
        self.failover.use_profile(self.profile)
        exact = self.profile  # measured, every bucket exact: the adaptation chooses the codecs again on it
        if self.profile is not None:  # the profile rank 0 planned on: its coded buckets
            self.profile = self.codecs.planned_profile(self.profile, info)
        self._install(schedule, self._plan_layout(schedule, str(self.planning.schedule_path or "schedule")), t)
        self.planned = True
        # Adapt deft's own plans (not a schedule file) when there is a profile to correct.
        on = self.config.adapt and self.profile is not None and self.planning.schedule_path is None
        recoding = self.codecs.recoding(exact, info)
        chosen = info.get("codecs")
        if isinstance(chosen, dict):  # deft chose the codecs: is the choice made again?
            info["codecs"] = {**chosen, "again": on and recoding is not None}
        self.record.planned(info, t, self._stats_reason, background)
        lag, self._lag_run = self._lag_run, None
        if lag is not None and (lag.clock.counted() < LAG_SAMPLES or self._uses_lost(lag.schedule)):
            lag = None
        if lag is not None:  # measured while rank 0 planned: the candidate to go back to
            candidate = lag.schedule if on else None
            self.adaptation.start(on, lag.layout, candidate, recoding, lag.clock,
                                  self.codecs.schedule_profile(exact, candidate))
        else:  # the profile iterations' schedule, in their codec (the time measured is theirs)
            candidate = self.codecs.profile_schedule(self._synchronous(warm)) if on and warm is not None else None
            self.adaptation.start(on, warm, candidate, recoding,
                                  candidate_profile=self.codecs.schedule_profile(exact, candidate))
        self.adaptation.clock.exclude(time.perf_counter() - started)  # planning is deft's, not the schedule's
        log.info("deft: rank %d runs schedule %s from iteration %d (cycle %d, K=%s)", self._control.rank,
                 schedule.digest(), t, schedule.cycle, schedule.batch_sequence)

    # -- switches ------------------------------------------------------------------------------------------
    def _maybe_switch(self, t: int, flush: Callable[[], None]) -> None:
        """At a cycle boundary (iteration ``t`` is position 0): apply every pending update (``flush``)
        and run the agreed new schedule from ``t`` on."""
        if not self.planning.switch_waiting or self._executor.position(t) != 0:
            return
        switch = self.planning.take_switch()
        assert switch is not None
        if self._uses_lost(switch.schedule):  # decided before a link was lost (every rank drops it)
            return
        applied = len(self._log)
        flush()
        warm = self.adaptation.warm_layout
        use_warm = switch.warm_layout and warm is not None
        layout = warm if use_warm and warm is not None else self._plan_layout(switch.schedule, "re-planned schedule")
        layout = switch.layout or layout
        old = self.schedule.digest()
        self._install(switch.schedule, layout, t)
        self.adaptation.reset_window()
        if switch.info.get("source") != "adapt":
            self.adaptation.forget_measured()
        self.record.switched(SwitchRecord(t, old, switch.schedule, len(self._log) - applied, switch.info))
        log.info("deft: rank %d switches to re-planned schedule %s at iteration %d (K=%s)", self._control.rank,
                 switch.schedule.digest(), t, switch.schedule.batch_sequence)

    # -- a link lost (deft.runtime.failover) -------------------------------------------------------------
    def _links_lost(self, t: int) -> None:
        """Collective (every rank agreed on the same losses in the iteration that ended): adaptation stops
        (its measurements and candidates used the lost links) and a decision in flight about them is
        dropped. Planned: torch DDP's synchronous schedule over the links left runs from the next cycle
        boundary on, while rank 0 plans on the profile without the lost links in the background
        (:meth:`_finish_replan`); before the first plan, the plan is made on the links left."""
        records = self.failover.take_lost(lambda i: loss_phase(self.calendar, self.planned, i))
        if not records:
            return
        if self.profile is not None:
            self.profile = without_links(self.profile, self.failover.dead)
        self.adaptation.stop()
        self.planning.forget_switch()
        job = self.jobs.kind
        if job is not None:
            self.jobs.take()  # rank 0's thread finishes on its own; its result is about the lost links
        lag = max(1, self.config.plan_lag_iters)
        replan: JsonDict = {"iteration": t, "source": "the first plan, on the links left"}
        if job == "plan" and self._plan_inputs is not None:  # the first plan, started again without them
            self.jobs.hold("plan", self.planning.start(self.profile, *self._plan_inputs), t + lag)
        if self.planned:
            layout = self._executor.layout
            assert layout is not None
            sync = synchronous_candidate(layout, self._live())
            self.planning.offer(Switch(sync, {"source": "link lost: synchronous"}, layout=layout))
            replan = {"iteration": t, "source": "synchronous", "links": list(sync.links)}
            if self.profile is not None and self.planning.schedule_path is None:
                self.jobs.hold("replan", self.planning.start(self.profile, None, self._control.world), t + lag)
        for rec in records:
            self.record.link_failures.append({**rec, "replan": replan})

    def _finish_replan(self, t: int) -> None:
        """Collective: rank 0's plan without the lost links, every rank switching to it at the next cycle
        boundary (ahead of the synchronous schedule if that still waits)."""
        started = time.perf_counter()
        schedule, info, timing = self.planning.finish(self.jobs.take())
        if self._uses_lost(schedule):
            return  # another link was lost while rank 0 planned: _links_lost started again
        self.planning.forget_switch()
        self.planning.offer(Switch(schedule, {**info, "source": f"link lost: {info.get('source')}"}))
        plan = {"iteration": t, "source": info.get("source"), "schedule": schedule.digest(),
                "links": list(schedule.links), "plan_s": round(timing["plan_s"], 4),
                "waited_s": round(timing["waited_s"] + time.perf_counter() - started, 4)}
        if self.record.link_failures:
            self.record.link_failures[-1]["replan"] = {**as_object(self.record.link_failures[-1], "replan"),
                                                      "plan": plan}
        log.warning("deft: rank %d re-planned on %s after losing %s (%s, rank 0 planned %.3f s in the "
                    "background): schedule %s from the next cycle", self._control.rank, list(schedule.links),
                    sorted(self.failover.dead), info.get("source"), timing["plan_s"], schedule.digest())

    def _uses_lost(self, schedule: Schedule) -> bool:
        return any(n in self.failover.dead for n in schedule.links)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state(self) -> CourseState:
        """The course's part of :class:`deft.runtime.checkpoint.RuntimeState`."""
        return CourseState(planned=self.planned, plan_at=self.calendar.plan_at,
                           order_known=self.ready_order is not None, plan_info=self.record.view())

    def restore(self, st: RuntimeState) -> None:
        """A checkpoint is loaded: a decision in flight or a switch agreed belongs to the run it replaces
        (its thread is waited for: it reads this run's profile; its result dropped)."""
        self.jobs.discard()
        self.planning.forget_switch()
        self._lag_run = None  # timed in the run the checkpoint replaces
        self.planned = st.planned
        self.ready_order = st.order if st.order_known else None
        self.calendar = Calendar(self.calendar.warm_end, st.plan_at, self.calendar.stats_window)
        if not self.planned and st.t > self.calendar.warm_end:
            self.calendar = self.calendar.restart(st.t, self.profile_iters, self.planning.measuring)
            if self._control.rank == 0:
                log.warning("deft: the checkpoint was taken at iteration %d, before planning finished; deft "
                            "profiles again from here and plans at iteration %d (torch DDP's schedule until the "
                            "plan is in)", st.t, self.calendar.plan_at)
        self.record = RunRecord.from_view(st.plan_info)
        self.failover.resume(self.record.link_failures, st.t)  # lost links stay lost (deft.runtime.failover)
        self.codecs.restore(self.record.profile_codec)  # a damaged record is refused here, naming it

    def close(self) -> None:
        if self._timer is not None:
            self._timer.close()
            self._timer = None

