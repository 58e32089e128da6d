"""DeFT next to the baselines: plan DeFT, simulate every scheme on the same profile.

The front end of ``deft simulate`` and ``deft plan`` and of ``benchmarks/bench_simulate.py``. It joins
the planner (:mod:`deft.solver.plan`) and the simulator (:mod:`deft.solver.simulate`), which know
nothing of each other beyond the :class:`~deft.schedule.Schedule` they exchange.

``deft`` here is the planner's first schedule (capacity scale 1), as the preserver would start from it
or as a run with the preserver disabled uses it. What a run with the default preserver uses depends on
the loss statistics measured in training; the command line composes that with
:func:`deft.preserver.feedback.preserve` (the preserver sits above the solver).
"""

from __future__ import annotations

from dataclasses import replace

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError
from deft.profile import Profile
from deft.schedule import Schedule
from deft.solver import plan as planner
from deft.solver.lagfree import lagfree_plan
from deft.solver.partition import profile_for_schedule
from deft.solver.simulate import BASELINES, SimResult, scale_workers, simulate_baseline, simulate_schedule

__all__ = ["SCHEMES", "plan_deft", "simulate"]

SCHEMES = (*BASELINES, "deft")


def plan_deft(profile: Profile, config: DeftConfig) -> tuple[Schedule, Profile]:
    """DeFT's schedule for ``profile`` and the partitioned profile it refers to.

    ``epsilon == 0`` forbids delayed updates: the no-delay plan (cycle 1, links only; the lag-free plan,
    whose updates may finish in the next forward, when ``config.forward_updates``, as a run does). Otherwise the
    planner's first plan: the preserver's convergence test needs loss statistics from training, so
    offline (here and in ``deft plan``) this is the plan it would start from, and the one a run with
    the preserver disabled uses.
    """
    if config.epsilon == 0:
        schedule = (lagfree_plan if config.forward_updates else planner.no_delay_plan)(profile, config)
        return schedule, profile_for_schedule(profile, schedule, config)
    result = planner.plan_trace(profile, config)
    return result.schedule, result.profile


def simulate(profile: Profile, scheme: str, config: DeftConfig | str | JsonDict | None = None, *,
             workers: int | None = None, iterations: int = 24) -> SimResult:
    """Steady-state iteration of ``scheme`` on ``profile`` (the model: :mod:`deft.solver.simulate`).

    Baselines use the primary (first) link only, as their papers do; ``deft`` plans with
    :func:`plan_deft` and uses every link of the profile (the result's ``meta`` carries the schedule and
    the partitioned profile). ``workers`` rescales the profile with the ring all-reduce model first.
    """
    cfg = DeftConfig.resolve(config)
    if scheme not in SCHEMES:
        raise ContractError("<scheme>", "scheme", f"expected one of {', '.join(SCHEMES)}, got {scheme!r}")
    if workers is not None:
        profile = scale_workers(profile, workers)
    if scheme != "deft":
        return simulate_baseline(profile, scheme, cfg, iterations=iterations)
    schedule, planned = plan_deft(profile, cfg)
    res = simulate_schedule(planned, schedule, iterations=iterations, scheme="deft")
    return replace(res, meta={**res.meta, "schedule": schedule, "profile": planned})
