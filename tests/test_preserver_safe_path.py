"""The preserver's safe path: what it does when it cannot check a schedule's stability, how it reads
an optimizer with several parameter groups, and which learning rate it judges.

* Without a curvature (or an optimizer rule) a schedule with stale updates is refused, lag-free
  merges at the optimizer's learning rate are not, and the reason names the opt-ins.
* AdamW with GPT-2's two groups (weight decay 0.1 and 0.0) gets a stability check: the spec takes the
  largest lr and the smallest weight decay, the hardest pair (checked on a grid of edges here).
* The learning rate judged is the peak a torch LR scheduler records, not a warm-up's fraction of it;
  a rate that outgrows the one judged makes the re-check run out of turn.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deft.config import DeftConfig
from deft.preserver.feedback import (
    LR_RECHECK_GROWTH,
    Recheck,
    lr_outgrown,
    needs_stability_check,
    preserve,
)
from deft.preserver.noise import walk_geometry
from deft.preserver.stability import OptimizerSpec, check_stability, delayed_plan, planning_lr, stability_edge
from deft.runtime.grad_stats import stability_inputs
from tests.test_feedback import STATS, FakePlanner, profile, schedule_with

UNKNOWN = dataclasses.replace(STATS, unchecked="stability not checked: optimizer: RMSprop")


def _stale(schedule: object) -> bool:
    return any(u.apply_after != u.last for u in schedule.updates)  # type: ignore[attr-defined]


# -- the unknown case --------------------------------------------------------------------------------
def test_unknown_curvature_refuses_a_stale_schedule_and_names_the_opt_in() -> None:
    fp = FakePlanner([(1, 2, 1)], delayed=True)
    res = preserve(profile(), DeftConfig(epsilon=0.2, preserver_max_tries=2), UNKNOWN, planner=fp.plan,
                   no_delay_planner=fp.no_delay)
    deft_tries = [t for t in res.tries if t.kind == "deft"]
    assert [t.rejected_on for t in deft_tries] == ["stability unchecked"] * 2
    assert not _stale(res.schedule) and res.schedule.batch_sequence != (1, 2, 1)
    reason = res.schedule.meta["preserver"]["reason"]
    assert "stability check could not run" in reason and "RMSprop" in reason
    assert "stale_unchecked = true" in reason and "ddp.calibrate" in reason
    # Opted in: the walk alone judges it, as it did before the rule (ratio within 0.2).
    res = preserve(profile(), DeftConfig(epsilon=0.2, preserver_max_tries=2, stale_unchecked=True), UNKNOWN,
                   planner=FakePlanner([(1, 2, 1)], delayed=True).plan, no_delay_planner=fp.no_delay)
    assert res.accepted and res.schedule.batch_sequence == (1, 2, 1) and _stale(res.schedule)


def test_unknown_curvature_keeps_lag_free_merges_at_the_optimizers_lr() -> None:
    fp = FakePlanner([(2, 2)])
    res = preserve(profile(), DeftConfig(epsilon=0.2, preserver_max_tries=1), UNKNOWN, planner=fp.plan,
                   no_delay_planner=fp.no_delay)
    assert res.accepted and res.schedule.batch_sequence == (2, 2)
    assert "could not run" not in res.schedule.meta["preserver"]["reason"]
    # A scaled lr steps sqrt(2) times further: a fraction of torch DDP's edge, so it needs the check.
    res = preserve(profile(), DeftConfig(epsilon=0.2, preserver_max_tries=1, merge_lr_scaling="sqrt"), UNKNOWN,
                   planner=FakePlanner([(2, 2)]).plan, no_delay_planner=fp.no_delay)
    assert all(k == 1 for k in res.schedule.batch_sequence)
    assert {t.rejected_on for t in res.tries if t.kind in ("deft", "accumulate")} == {"stability unchecked"}


def test_which_schedules_need_the_check() -> None:
    assert not needs_stability_check(schedule_with((1,)))
    assert not needs_stability_check(schedule_with((2, 1)))
    assert needs_stability_check(schedule_with((1, 1), delayed=True))
    assert needs_stability_check(schedule_with((2, 1)), "linear")
    assert not needs_stability_check(schedule_with((1, 1)), "linear")


def test_a_stale_schedule_with_a_curvature_is_checked_not_refused() -> None:
    spec = OptimizerSpec.sgd(0.02, momentum=0.9)  # one iteration late: edge (1 - 0.9) / 0.02 = 5
    calm = dataclasses.replace(STATS, curvature=1.0, optimizer=spec)
    res = preserve(profile(), DeftConfig(epsilon=0.2, preserver_max_tries=1), calm,
                   planner=FakePlanner([(1, 2, 1)], delayed=True).plan, no_delay_planner=FakePlanner([(1,)]).no_delay)
    assert res.accepted and _stale(res.schedule)


# -- parameter groups --------------------------------------------------------------------------------
def _gpt2_adamw(lr: float = 1e-3) -> tuple[torch.optim.AdamW, list[torch.nn.Parameter]]:
    w, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    return opt, [w, b]


def test_two_groups_with_different_weight_decay_get_a_check() -> None:
    opt, (w, b) = _gpt2_adamw()
    spec = OptimizerSpec.from_torch(opt)
    assert spec == OptimizerSpec.adam(1e-3, 0.9, 1.0, 0.0, True)  # the smallest decay
    (w.sum() + b.square().sum()).backward()
    opt.step()  # Adam's second moment, for its step scale
    lam, spec, how = stability_inputs(opt, secant=5.0, calibrated=None)
    assert how == "secant" and lam == 5.0 and spec is not None and spec.weight_decay == 0.0
    sgd = torch.optim.SGD([{"params": [w], "weight_decay": 1e-4, "lr": 0.05}, {"params": [b], "weight_decay": 0.0}],
                          lr=0.1, momentum=0.9)
    assert OptimizerSpec.from_torch(sgd) == OptimizerSpec.sgd(0.1, momentum=0.9, weight_decay=0.0)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("lr", [1e-3, 0.05, 0.3])
def test_the_smallest_weight_decay_is_the_hardest_group(kind: str, lr: float) -> None:
    """For a stale schedule the smallest decay gives the lowest edge, and torch DDP's highest: both the
    rejection and the exemption of the check are hardest to pass with it."""
    def spec(wd: float) -> OptimizerSpec:
        if kind == "sgd":
            return OptimizerSpec.sgd(lr, 0.9, weight_decay=wd)
        return OptimizerSpec.adam(lr, 0.9, 1.0, wd, kind == "adamw")

    decays = (0.0, 0.01, 0.1, 1.0)
    ddp = [stability_edge(delayed_plan(0), spec(wd)) for wd in decays]
    assert ddp == sorted(ddp, reverse=True)
    for plan in (delayed_plan(1), delayed_plan(2), delayed_plan(1, 2)):
        edges = [stability_edge(plan, spec(wd)) for wd in decays]
        assert all(e >= edges[0] * (1 - 1e-9) for e in edges), (plan, edges)
    # and a larger lr is harder still: the edges scale as 1 / lr
    assert stability_edge(delayed_plan(1), spec(0.0)) == pytest.approx(
        2 * stability_edge(delayed_plan(1), dataclasses.replace(spec(0.0), lr=2 * lr)))


# -- the learning rate judged ----------------------------------------------------------------------
def test_the_lr_judged_is_a_warm_ups_peak() -> None:
    opt, (w, b) = _gpt2_adamw(lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 4))  # warm-up to 1e-3
    assert opt.param_groups[0]["lr"] == pytest.approx(2.5e-4)
    assert planning_lr(opt.param_groups) == pytest.approx(1e-3)
    assert OptimizerSpec.from_torch(opt).lr == pytest.approx(1e-3)
    (w.sum() + b.sum()).backward()
    opt.step()
    sched.step()
    assert walk_geometry(opt, with_roots=False).lr == pytest.approx(1e-3)
    one_cycle = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    torch.optim.lr_scheduler.OneCycleLR(one_cycle, max_lr=0.4, total_steps=100, cycle_momentum=False)
    assert planning_lr(one_cycle.param_groups) == pytest.approx(0.4)
    assert walk_geometry(one_cycle).lr == pytest.approx(0.4 / (1 - 0.9))
    assert planning_lr([{"lr": 0.0}]) == 0.0


def test_an_lr_four_times_the_judged_one_triggers_a_recheck_that_replans() -> None:
    assert lr_outgrown(1e-3, 4e-3) and not lr_outgrown(1e-3, 1e-3 * LR_RECHECK_GROWTH)
    assert not lr_outgrown(0.0, 1.0)
    # A stale schedule accepted at lr 0.005: edge (1 - 0.9) / 0.005 = 20, curvature 4 within half of it.
    spec = OptimizerSpec.sgd(0.005, momentum=0.9)
    calm = dataclasses.replace(STATS, curvature=4.0, optimizer=spec)
    config = DeftConfig(epsilon=0.2, preserver_max_tries=1, recheck_every=100)
    res = preserve(profile(), config, calm, planner=FakePlanner([(1, 2, 1)], delayed=True).plan,
                   no_delay_planner=FakePlanner([(1,)]).no_delay)
    assert res.accepted and _stale(res.schedule)
    assert check_stability(res.schedule, 4.0, spec).stable
    rc = Recheck(config, res)
    grown = dataclasses.replace(calm, lr=4 * calm.lr, optimizer=dataclasses.replace(spec, lr=4 * spec.lr))
    assert rc.check(7, grown) is None  # not due, no trigger
    d = rc.check(7, grown, trigger="learning rate 0.02 above 1.25 x the 0.005 judged")
    assert d is not None and d.replan
    assert d.reason.startswith("learning rate 0.02") and "unstable" in d.reason
