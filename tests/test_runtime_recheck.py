"""The preserver's re-check during training: a failed check re-plans, and all ranks
switch to the new schedule at a cycle boundary without losing or repeating a gradient.

Set-up: two gloo ranks, the closed-form model of tests/test_runtime_delayed.py (loss
``sum_j (w_j * c_j).sum()``, gradient ``c_j`` known per rank and iteration; here ``c`` = a steady
part + noise, so the gradient has a direction to estimate), a given comm-heavy profile
(all-reduce 3x the compute of each bucket, so the planner merges iterations), ``epsilon = 1``.
No loss is reported during warm-up, so at planning time the preserver cannot test delayed updates
and takes the no-delay schedule (``stats_were_unknown``). From then on the loss is reported; the
runtime keeps estimating mu and sigma from the all-reduced buffers, and at iteration
``recheck_every`` rank 0's :class:`deft.preserver.feedback.Recheck` finds them known and asks for a
re-plan; :func:`deft.preserver.feedback.preserve` then accepts a schedule with merged updates. The
ranks flush and switch at the next cycle boundary. Checked: the decision and the switch are recorded
in ``plan_info``; the schedule really changed (digest, batch sequence with ``k > 1``, merged groups
in ``update_log``); every iteration is applied exactly once and the final parameters equal the closed
form of SGD with momentum replayed over ``update_log``; both ranks end identical.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import run_ranks, values
from tests.test_runtime_delayed import LR, MOMENTUM, SHAPES, Linear, closed_form

ITERS = 17
WARMUP = 2
RECHECK_EVERY = 6


def coefficients(rank: int, t: int) -> dict[str, torch.Tensor]:
    """``c = base + noise``: a steady true gradient (``base``, the same every iteration) plus per-rank,
    per-iteration integer noise, so the estimator's directions agree and sigma becomes known."""
    base = torch.Generator().manual_seed(12345)
    g = torch.Generator().manual_seed(7919 * t + 31 * rank)
    return {n: (torch.randint(2, 6, shape, generator=base) + torch.randint(-3, 4, shape, generator=g)).to(dtype)
            for n, (shape, dtype) in SHAPES.items()}




def comm_heavy_profile() -> Any:
    from deft.profile import Bucket, BucketTimes, Link, Profile

    order = ["w3", "w2", "w1"]  # ready order: the last parameter first
    buckets = []
    for i, n in enumerate(order):
        (shape, dtype) = SHAPES[n]
        numel = int(torch.Size(shape).numel())
        size = torch.empty((), dtype=dtype).element_size()
        buckets.append(Bucket(id=i, params=(n,), numel=numel, nbytes=numel * size))
    times = tuple(BucketTimes(forward_s=1e-3, backward_s=1e-3, comm_s={"primary": 6e-3}) for _ in order)
    link = Link(name="primary", backend="gloo", alpha_s=6e-3, beta_s_per_byte=1e-9)
    return Profile(buckets=tuple(buckets), times=times, links=(link,), world_size=2, source="timing")


def _force_second_replan(at: int) -> None:
    """Rank 0: at iteration ``at`` the check demands a re-plan, and the re-plan yields the no-delay
    schedule (as if the running one had left the tolerance): a switch *away from* a delayed
    schedule, with a merged update still pending at the cycle boundary."""
    import dataclasses

    from deft.preserver import feedback

    check, preserve = feedback.Recheck.check, feedback.preserve

    def forced_check(self: Any, iteration: int, stats: Any) -> Any:
        d = check(self, iteration, stats)
        if iteration == at and d is not None:
            return feedback.RecheckDecision(iteration, d.ratio, True, "forced by the test")
        return d

    calls = []

    def no_delay_preserve(profile: Any, config: Any, stats: Any, **kw: Any) -> Any:
        if stats is not None:  # re-plans only (the first plan had no statistics)
            calls.append(stats)
            if len(calls) >= 2:
                return preserve(profile, dataclasses.replace(config, epsilon=0.0), stats, **kw)
        return preserve(profile, config, stats, **kw)

    feedback.Recheck.check = forced_check  # type: ignore[method-assign]
    feedback.preserve = no_delay_preserve


def recheck_worker(rank: int, world: int, force_at: int | None = None) -> dict[str, Any]:
    import deft

    if force_at is not None:
        _force_second_replan(force_at)
        # This test needs a schedule with updates pending at its cycle boundary (stale ones): keep the
        # preserver from preferring a lag-free merge, whose groups all end inside their cycle.
        from deft.preserver import feedback

        feedback.MAX_MERGE = 1

    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, profile=comm_heavy_profile(), config={
        "epsilon": 1.0, "warmup_iters": WARMUP, "recheck_every": RECHECK_EVERY, "timeout_s": 30, "adapt": False,
        # planned inside iteration WARMUP - 1 (not in the background): the iteration numbers below count on it
        "plan_lag_iters": 0, "links": [{"name": "primary"}]})
    digests = []
    for t in range(ITERS):
        loss = ddp(coefficients(rank, t))
        loss.backward()
        if t >= WARMUP:
            ddp.observe_loss(2.0)  # a fixed positive loss: the walk's inputs are then mu, sigma, lr, B
        opt.step()
        opt.zero_grad()
        digests.append(ddp.schedule.digest())
    ddp.flush()
    log = [[t, list(its)] for t, its in ddp.update_log]
    expect = closed_form(log, world, coefficients)
    for n, p in model.named_parameters():
        # bf16 parameters round every update to 8 significant bits: relative tolerance 2^-7
        atol, rtol = (1e-5, 0.0) if p.dtype == torch.float32 else (2e-2, 2.0 ** -7)
        torch.testing.assert_close(p.detach().double(), expect[n], rtol=rtol, atol=atol)
    info = ddp.plan_info
    return {"log": log, "digests": digests, "source": info.get("source"), "accepted": info.get("accepted"),
            "rechecks": info.get("rechecks", []), "switches": info.get("switches", []),
            "params": {n: p.double().tolist() for n, p in model.named_parameters()}}


@pytest.mark.slow
def test_recheck_replans_and_switches() -> None:
    out = values(run_ranks(recheck_worker, 2, timeout=120))
    a, b = out
    assert a["log"] == b["log"] and a["params"] == b["params"] and a["digests"] == b["digests"]
    assert a["source"] == "preserver" and a["accepted"] is False  # planned while mu, sigma were unknown

    first = a["rechecks"][0]
    assert first["iteration"] == RECHECK_EVERY and first.get("replan") is True, a["rechecks"]
    assert "known now" in first["reason"]
    assert [r["iteration"] for r in a["rechecks"]] == list(range(RECHECK_EVERY, ITERS + 1, RECHECK_EVERY))
    assert b["rechecks"] == a["rechecks"]  # rank 0's decision, broadcast

    sw = a["switches"][0]
    assert sw["iteration"] == RECHECK_EVERY  # the no-delay schedule's cycle is 1: every iteration is a boundary
    assert sw["from"] != sw["to"] and max(sw["batch_sequence"]) > 1
    # digests[t] is read after iteration t's step; the check and the switch run at the end of
    # iteration RECHECK_EVERY - 1, so iteration RECHECK_EVERY is the first under the new schedule
    assert a["digests"][RECHECK_EVERY - 2] == sw["from"] and a["digests"][RECHECK_EVERY - 1] == sw["to"]

    # Every iteration applied exactly once; merged updates only after the switch.
    merged = [tuple(its) for _, its in a["log"]]
    assert sorted(t for its in merged for t in its) == list(range(ITERS))
    assert all(len(its) == 1 for its in merged if its[0] < RECHECK_EVERY)
    assert any(len(its) > 1 for its in merged if its[0] >= RECHECK_EVERY)


@pytest.mark.slow
def test_switch_away_from_a_delayed_schedule_flushes_pending_updates() -> None:
    """Second re-plan forced at iteration 12, inside the delayed schedule's cycle (cycle 4 from t0 = 6):
    the switch waits for the boundary at 14, where the group {12, 13} is still pending."""
    a, b = values(run_ranks(recheck_worker, 2, args=(2 * RECHECK_EVERY,), timeout=120))
    assert a["log"] == b["log"] and a["params"] == b["params"]
    first, second = a["switches"]
    assert max(first["batch_sequence"]) > 1 and second["batch_sequence"] == [1]
    assert second["from"] == first["to"] and second["to"] != first["to"]
    assert second["iteration"] > 2 * RECHECK_EVERY and (second["iteration"] - first["iteration"]) % first["cycle"] == 0
    assert second["flushed_updates"] >= 1
    merged = [tuple(its) for _, its in a["log"]]
    assert sorted(t for its in merged for t in its) == list(range(ITERS))  # each iteration exactly once
    assert all(len(its) == 1 for its in merged if its[0] >= second["iteration"])
