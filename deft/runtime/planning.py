"""Planning in a live run: rank 0 decides, every rank installs the same schedule.

* :func:`make_schedule` (rank 0): the schedule file if the config names one; else the lag-free plan
  (:func:`deft.solver.lagfree.lagfree_plan`: no delay, updates may finish in the next forward) at
  ``epsilon == 0``; else the preserver's choice (:func:`deft.preserver.feedback.preserve`), or the
  bare planner with the preserver off. A planner that cannot plan the measured profile degrades to
  the no-delay plan, then to torch DDP's synchronous schedule; ``info`` says which and why.
  Planning never ends a run.
* :meth:`Planning.agree` (collective): rank 0's decision travels as JSON bytes on the control group;
  any exception on rank 0 travels instead of the schedule, so every rank stops with the same clear
  error rather than waiting for a broadcast that never comes. Every rank validates the schedule and
  the ranks compare its digest.
* :meth:`Planning.recheck` (collective, every ``recheck_every`` iterations while a preserver plan
  runs, and out of turn when the learning rate outgrew the one judged): rank 0 re-evaluates it
  (:class:`deft.preserver.feedback.Recheck`) and re-plans when asked; the new schedule waits as a
  :class:`Switch` until the next cycle boundary, where the runtime flushes and switches (all ranks at
  the same iteration).
* **Planning in the background** (``config.plan_lag_iters`` > 0): :meth:`Planning.start` runs rank 0's
  decision in a :class:`Background` thread while every rank trains on with the warm-up's synchronous
  schedule. At the end of each following iteration rank 0 broadcasts whether its thread is done (one
  integer on the control group); :meth:`Planning.finish`, the same collective as :meth:`Planning.agree`,
  runs at the first iteration where it is, or after ``plan_lag_iters`` iterations at the latest (rank 0
  then waits for its thread). Every rank follows rank 0's word, so all switch at the same iteration.
  The thread runs at a lower CPU priority (``config.planner_nice``, Linux), so that it takes the CPU
  the training leaves idle rather than the model's.
  Why: planning takes seconds that training would otherwise wait for (benchmarks/results/peers.md),
  while a synchronous iteration on a slow link spends most of its time waiting for the link with the
  GIL released, which the planner's thread can use.
* **Switches** (:class:`Switch`): a re-check's or the adaptation's new schedule, agreed by every rank,
  waits in :class:`Planning` (:meth:`Planning.offer`) until the next cycle boundary, where the runtime
  takes it (:meth:`Planning.take_switch`), flushes and installs it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field

import torch

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError, DeftError
from deft.preserver import feedback
from deft.preserver.feedback import PreserveResult, Recheck, WalkStats
from deft.profile import Profile
from deft.runtime.background import Background
from deft.runtime.buckets import FlatLayout
from deft.runtime.codecs.choice import CodecInputs, choose_codec
from deft.runtime.control import ControlPlane
from deft.runtime.records import as_object
from deft.schedule import Schedule, synchronous_schedule
from deft.solver import codecs, knapsack
from deft.solver.lagfree import SearchBudget, lagfree_plan
from deft.solver.plan import ExactBudget, no_delay_plan, plan
from deft.solver.simulate import serial_codec, simulate_schedule

log = logging.getLogger("deft.runtime")


# -- inputs given at construction -----------------------------------------------------------------
def resolve_profile(profile: Profile | str | os.PathLike[str] | None, cfg: DeftConfig) -> Profile | None:
    """A Profile, a profile file, the config's ``profile_path``, or None (deft measures one)."""
    if isinstance(profile, Profile):
        given = profile
    elif profile is not None:
        given = Profile.load(os.fspath(profile))
    elif cfg.profile_path is not None:
        given = Profile.load(cfg.profile_path)
    else:
        return None
    unknown = [n for n in given.link_names if n not in cfg.link_names]
    if unknown:
        raise ContractError("profile", "links", f"link(s) {unknown} are not in the config's links "
                            f"{list(cfg.link_names)}; name the config's links like the profile's")
    return given


def check_schedule_file(cfg: DeftConfig, params: list[torch.Tensor]) -> None:
    """``config.schedule_path`` must be a valid schedule over this model's trainable elements (``params``:
    those deft reduces) and the config's links (rank 0 loads it again when planning; every rank that has
    the file checks here)."""
    path = str(cfg.schedule_path)
    sched = Schedule.load(path)
    total = sum(p.numel() for p in params)
    if sum(sched.bucket_numel) != total:
        raise ContractError(path, "bucket_numel",
                            f"the schedule's buckets hold {sum(sched.bucket_numel)} elements but the model has "
                            f"{total} trainable elements (was it planned for another model?); plan one for this "
                            "model or remove schedule_path from the config")
    unknown = [n for n in sched.links if n not in cfg.link_names]
    if unknown:
        raise ContractError(path, "links", f"link(s) {unknown} are not in the config's links "
                            f"{list(cfg.link_names)}; name the config's links like the schedule's")


# -- rank 0's decision ----------------------------------------------------------------------------
@dataclass
class Decision:
    """What rank 0 decided: the schedule, how (``info``), and the preserver's outcome if it ran."""

    schedule: Schedule
    info: JsonDict
    preserved: PreserveResult | None = None


def preserver_info(source: str, res: PreserveResult, stats: WalkStats | None) -> JsonDict:
    """The record of a preserver decision (the first plan's or a re-check's re-plan)."""
    return {"source": source, "accepted": bool(res.accepted), "tries": len(res.tries), "reason": res.reason,
            "stats": None if stats is None else stats.to_dict(), "try_log": [t.to_dict() for t in res.tries]}


def _load_solver() -> dict[str, object]:
    knapsack.load_cp_sat()
    return {}


def make_schedule(cfg: DeftConfig, profile: Profile | None, stats: WalkStats | None,
                  schedule_path: str | os.PathLike[str] | None, codec: CodecInputs | None = None,
                  lag_iters: int = 0) -> Decision:
    """Rank 0 only: the schedule to run, degrading to simpler plans when planning fails. Planned on the
    profile with deft's coded buckets (:func:`choose_codec`; a re-plan gets that profile, already coded);
    ``lag_iters`` > 0: while training goes on for that many iterations (:func:`window_budget`)."""
    if schedule_path is not None:
        return Decision(Schedule.load(os.fspath(schedule_path)), {"source": str(schedule_path)})
    assert profile is not None
    profile, chosen = choose_codec(cfg, profile, codec)
    decision = torch_way_without_gain(profile, _planned(cfg, profile, stats, window_budget(cfg, profile, lag_iters)))
    decision.schedule = codecs.mark(decision.schedule, profile, cfg)
    if chosen is not None:
        decision.info["codecs"] = chosen
    return decision


#: Under a serial codec deft's plan must predict at least this much less per iteration than torch's way.
TORCH_WAY_GAIN = 0.03


def torch_way_without_gain(profile: Profile, decision: Decision) -> Decision:
    """Under a codec whose sends run one at a time (PowerSGD, a user's hook: ``serial_codec``), the
    synchronous schedule of the profiled buckets on the primary link (torch DDP's way with the same
    hook and buckets) unless ``decision``'s plan predicts at least :data:`TORCH_WAY_GAIN` less per
    iteration. Why: such a plan can only reorder the serial sends and move some into the next
    forward, while each extra bucket or stage pays the hook's collectives and per-call compute, which
    the profile prices only on average, so plans predicted a little faster ran slower
    (benchmarks/results/slow_links.md)."""
    if not serial_codec(profile):
        return decision
    sync = synchronous_schedule(tuple(b.numel for b in profile.buckets), tuple(b.nbytes for b in profile.buckets),
                                (profile.link_names[0],))
    sync_s = float(simulate_schedule(profile, sync).iteration_s)
    planned_s = decision.schedule.predicted_iteration_s
    if 0.0 < planned_s < sync_s * (1.0 - TORCH_WAY_GAIN):
        return decision
    sync = dataclasses.replace(sync, predicted_iteration_s=sync_s, profile_digest=profile.digest(),
                               meta={"planner": "synchronous", "reason": "serial codec: the plan predicts no gain"})
    info: JsonDict = {**decision.info, "source": f"synchronous ({profile.codec}: torch DDP's way)",
                      "planned_source": decision.info.get("source"), "planned_predicted_s": planned_s,
                      "synchronous_predicted_s": sync_s}
    return Decision(sync, info)


@dataclass(frozen=True)
class WindowBudget:
    """What one decision the ranks train through may spend (None: unbounded, the config's): the
    knapsacks' CP-SAT work and the lag-free search's simulations. Spent as the decision plans: one per
    decision."""

    exact: ExactBudget | None = None
    search: SearchBudget | None = None

    def no_delay_planner(self, cfg: DeftConfig) -> feedback.NoDelayPlanner:
        """The plan without delayed updates that the decision starts from, on this budget."""
        if not cfg.forward_updates:
            return no_delay_plan
        return lagfree_plan if self.search is None else functools.partial(lagfree_plan, budget=self.search)


def window_budget(cfg: DeftConfig, profile: Profile, lag_iters: int) -> WindowBudget:
    """The budget of a decision the ranks train through for ``lag_iters`` iterations
    (:meth:`ExactBudget.for_window`, :meth:`SearchBudget.for_window`; none for ``lag_iters`` 0). The
    window is priced at the no-delay plan's predicted iteration, no longer than the synchronous
    iterations that run meanwhile, so the planning ends within the window rather than the ranks
    waiting for it at its end."""
    if lag_iters <= 0:
        return WindowBudget()
    window_s = lag_iters * no_delay_plan(profile, cfg).predicted_iteration_s
    return WindowBudget(ExactBudget.for_window(cfg, window_s) if cfg.solver == "exact" else None,
                        SearchBudget.for_window(window_s))


def _planned(cfg: DeftConfig, profile: Profile, stats: WalkStats | None, budget: WindowBudget) -> Decision:
    """:func:`make_schedule`'s plan of ``profile``, with its fallbacks, on ``budget``."""
    try:
        base = budget.no_delay_planner(cfg)
        if cfg.epsilon == 0:
            name = "lagfree_plan" if cfg.forward_updates else "no_delay_plan"
            return Decision(base(profile, cfg), {"source": f"{name} (epsilon = 0)"})
        if cfg.preserver:
            res = feedback.preserve(profile, cfg, stats, no_delay_planner=base, budget=budget.exact)
            return Decision(res.schedule, preserver_info("preserver", res, stats), res)
        return Decision(plan(profile, cfg, budget=budget.exact), {"source": "plan"})
    except DeftError as e:
        first = f"{type(e).__name__}: {e}"
    log.warning("deft: planning failed (%s); falling back", first)
    try:
        return Decision(no_delay_plan(profile, cfg), {"source": "no_delay_plan (fallback)", "fallback": first})
    except DeftError as e:
        second = f"{type(e).__name__}: {e}"
    log.warning("deft: no-delay planning failed too (%s); running torch DDP's synchronous schedule", second)
    sched = synchronous_schedule(tuple(b.numel for b in profile.buckets), tuple(b.nbytes for b in profile.buckets),
                                 (profile.link_names[0],))
    return Decision(sched, {"source": "synchronous (fallback)", "fallback": [first, second]})


# -- the collective side --------------------------------------------------------------------------
@dataclass(frozen=True)
class Switch:
    """A schedule every rank agreed on, waiting for a cycle boundary to replace the running one."""

    schedule: Schedule
    info: JsonDict  # its record: source ("preserver (re-plan)", "adapt"), reason, ...
    warm_layout: bool = False  # the warm-up's synchronous schedule, on the layout it was measured on
    layout: FlatLayout | None = None  # the layout it runs on (None: the plan's order of its buckets)


@dataclass
class Planning:
    """Planning state of one run: given inputs, rank 0's re-check, the switch waiting for a boundary."""

    config: DeftConfig
    control: ControlPlane
    given_profile: Profile | None
    schedule_path: str | os.PathLike[str] | None
    recheck_on: bool = False
    _switch: Switch | None = field(default=None, repr=False)
    _recheck: Recheck | None = field(default=None, repr=False)  # rank 0 only
    _preloading: bool = field(default=False, repr=False)  # preload_solver began

    def preload_solver(self) -> None:
        """Rank 0 plans with CP-SAT: load its import on a low-priority thread now, not on the first plan's
        path. Called where the links look like the bound (the first iteration's screen), so the import
        runs while the iterations wait for the links; where the compute is the bound it would only slow
        them (benchmarks/results/slow_links.md), and the plan loads it itself. Once."""
        if self._preloading or self.control.rank != 0 or self.schedule_path is not None \
                or self.config.solver != "exact" or self.config.epsilon <= 0:
            return
        self._preloading = True
        Background(_load_solver, "deft-load-solver", self.config.planner_nice)

    @property
    def measuring(self) -> bool:
        """deft measures its own profile during warm-up (none given, no schedule file)."""
        return self.given_profile is None and self.schedule_path is None

    def agree(self, profile: Profile | None, stats: WalkStats | None, world: int,
              codec: CodecInputs | None = None) -> tuple[Schedule, JsonDict]:
        """Collective: rank 0 decides; every rank gets, validates and digest-checks the same schedule."""
        doc: JsonDict = {}
        if self.control.rank == 0:
            doc, self._recheck = self._decide(profile, stats, world, codec, 0)
        return self._receive(doc)

    def start(self, profile: Profile | None, stats: WalkStats | None, world: int,
              codec: CodecInputs | None = None) -> Background | None:
        """Not collective: rank 0 starts deciding in the background (its job is returned; None on the
        other ranks); :meth:`finish` collects it."""
        def decide() -> dict[str, object]:  # the Recheck travels with the document: set only when collected
            doc, recheck = self._decide(profile, stats, world, codec, self.config.plan_lag_iters)
            return {"doc": doc, "recheck": recheck}

        return Background(decide, "deft-planner", self.config.planner_nice) if self.control.rank == 0 else None

    def finish(self, job: Background | None) -> tuple[Schedule, JsonDict, dict[str, float]]:
        """Collective: :meth:`agree` for the decision :meth:`start` began (``job``: rank 0's); also rank
        0's planning seconds and how long the caller waited for them (``{"plan_s", "waited_s"}``,
        zeros on other ranks)."""
        timing = {"plan_s": 0.0, "waited_s": 0.0}
        doc: JsonDict = {}
        if job is not None:
            out, waited = job.result()
            timing = {"plan_s": job.seconds, "waited_s": waited}
            # {"error": ...} when the thread itself failed; else the decision and its re-check state
            if "error" in out:
                doc, self._recheck = {"error": str(out["error"])}, None
            else:
                decided, recheck = out["doc"], out["recheck"]
                assert isinstance(decided, dict) and (recheck is None or isinstance(recheck, Recheck))
                doc, self._recheck = decided, recheck
        schedule, info = self._receive(doc)
        return schedule, info, timing

    def _decide(self, profile: Profile | None, stats: WalkStats | None, world: int,
                codec: CodecInputs | None, lag_iters: int) -> tuple[JsonDict, Recheck | None]:
        """Rank 0's decision as the JSON document :meth:`_receive` broadcasts, and the re-check state
        for it (``lag_iters``: iterations trained through meanwhile, 0 in the iteration). Reads its
        arguments and the config only (it may run on a background thread)."""
        cfg = self.config
        doc: JsonDict
        recheck: Recheck | None = None
        try:
            decision = make_schedule(cfg, profile, stats, self.schedule_path, codec, lag_iters)
            info = dict(decision.info)
            # Re-checks need live statistics, a profile to re-plan from, and the preserver's own plan.
            wanted = (info.get("source") == "preserver" and cfg.preserver and cfg.epsilon > 0 and world >= 2
                      and profile is not None and self.schedule_path is None and decision.preserved is not None)
            if wanted:
                assert decision.preserved is not None
                recheck = Recheck(cfg, decision.preserved)
            info["recheck"] = wanted
            doc = {"schedule": decision.schedule.to_dict(), "info": info}
        except Exception as e:  # tell the other ranks instead of leaving them waiting
            log.exception("deft: rank 0 could not produce a schedule")
            doc = {"error": f"{type(e).__name__}: {e}"}
        return doc, recheck

    def _receive(self, doc: JsonDict) -> tuple[Schedule, JsonDict]:
        """Collective: rank 0's ``doc`` to every rank, validated and digest-checked."""
        doc = self.control.broadcast_json(doc, "schedule")
        if "error" in doc:
            raise DeftError(f"rank 0 could not produce a schedule: {doc['error']}")
        schedule = Schedule.from_dict(as_object(doc, "schedule"), "schedule broadcast by rank 0")
        self.control.check_agreement("schedule", schedule.digest())
        info = as_object(doc, "info")
        self.recheck_on = bool(info.get("recheck", False))
        return schedule, info

    # -- switches at a cycle boundary ------------------------------------------------------------
    @property
    def switch_waiting(self) -> bool:
        return self._switch is not None

    def offer(self, switch: Switch) -> bool:
        """A new schedule every rank agreed on waits for the next boundary; False when another is
        waiting already (the earlier one goes first)."""
        if self._switch is not None:
            return False
        self._switch = switch
        return True

    def take_switch(self) -> Switch | None:
        """The waiting switch, to install now (every rank calls it at the same boundary)."""
        switch, self._switch = self._switch, None
        return switch

    def forget_switch(self) -> None:
        """A checkpoint was loaded: a switch agreed by the run it replaces is void."""
        self._switch = None

    def recheck(self, t: int, stats: WalkStats | None, stats_reason: str, running: Schedule,
                profile: Profile | None, trigger: str = "") -> JsonDict:
        """Collective: the re-check at iteration ``t``; returns the record for ``plan_info["rechecks"]``.

        A new schedule (different from the running one) waits as a :class:`Switch` (:meth:`offer`).
        ``trigger``: why it runs out of turn (every rank passes the same; :meth:`Recheck.check`).
        """
        cfg = self.config
        doc: JsonDict = {}
        if self.control.rank == 0:
            try:
                rc = self._recheck
                decision = None if rc is None else rc.check(t, stats, trigger) if trigger else rc.check(t, stats)
                if decision is not None:
                    doc["check"] = {"ratio": decision.ratio, "replan": decision.replan, "reason": decision.reason}
                    if decision.replan:
                        assert profile is not None and self._recheck is not None
                        # Every rank waits for this re-plan: it gets no more than a background
                        # decision (window_budget).
                        budget = window_budget(cfg, profile, cfg.plan_lag_iters)
                        res = feedback.preserve(profile, cfg, stats, no_delay_planner=budget.no_delay_planner(cfg),
                                                budget=budget.exact)
                        self._recheck.reset(res)
                        doc["schedule"] = codecs.mark(res.schedule, profile, cfg).to_dict()
                        doc["info"] = preserver_info("preserver (re-plan)", res, stats)
            except Exception as e:  # re-planning never ends a run: keep the running schedule
                doc = {"error": f"{type(e).__name__}: {e}"}
        doc = self.control.broadcast_json(doc, "re-check decision")
        record: JsonDict = {"iteration": t, "schedule": running.digest(), **({"trigger": trigger} if trigger else {})}
        if "error" in doc:
            log.warning("deft: preserver re-check at iteration %d failed (%s); keeping the schedule", t, doc["error"])
            record["error"] = doc["error"]
        elif "check" not in doc:
            record["skipped"] = f"no check: {stats_reason}" if stats is None else "nothing to check"
        else:
            record.update(as_object(doc, "check"))
        if "schedule" in doc:
            schedule = Schedule.from_dict(as_object(doc, "schedule"), "schedule re-planned and broadcast by rank 0")
            self.control.check_agreement("schedule", schedule.digest())
            record["new_schedule"] = schedule.digest()
            if schedule.digest() == running.digest():
                record["unchanged"] = True
            else:
                self.offer(Switch(schedule, as_object(doc, "info")))
        return record

