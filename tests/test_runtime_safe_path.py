"""The preserver's safe path in a live run: a tiny GPT-2 on two gloo ranks with GPT-2's two-group AdamW
(weight decay 0.1 on matrices, 0.0 on biases and LayerNorm) and a learning-rate warm-up, at the
default epsilon, on a given comm-heavy profile (all-reduce 3x the compute of each bucket, so the
planner proposes stale schedules).

The stability check's curvature is withheld (the worker replaces the runtime's curvature source, as
when no estimate exists), so the preserver cannot check stale schedules: it refuses them, plans
without any, and its record says why and how to opt in. The plan is judged at the warm-up's peak
learning rate, not the quarter of it the optimizer has at planning time. After the plan the learning
rate jumps to 4x the peak judged (a schedule above its base): the runtime re-checks out of turn and
the re-check (forced to re-plan here) again installs no stale update. Checked through ``plan_info``
and ``update_log`` (an update applied after a later iteration than its own last is stale).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import run_ranks, values

PEAK_LR = 1e-3
WARMUP = 6  # deft's warm-up iterations: the plan is made at the end of iteration WARMUP - 1
JUMP = 9  # from this iteration on, the learning rate is 4 x PEAK_LR
ITERS = 14


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def comm_heavy_profile(model: torch.nn.Module) -> Any:
    from deft.profile import Bucket, BucketTimes, Link, Profile

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]  # ready order, roughly
    buckets = tuple(Bucket(id=i, params=(n,), numel=p.numel(), nbytes=4 * p.numel()) for i, (n, p) in enumerate(named))
    times = tuple(BucketTimes(forward_s=1e-3, backward_s=1e-3, comm_s={"primary": 3e-3}) for _ in named)
    link = Link(name="primary", backend="gloo", alpha_s=1e-3, beta_s_per_byte=1e-9)
    return Profile(buckets=buckets, times=times, links=(link,), world_size=2, source="timing")


def _withhold_curvature_and_force_replans() -> None:
    from deft.preserver import feedback
    from deft.runtime import grad_stats

    def no_curvature(*args: Any, **kwargs: Any) -> tuple[None, None, str]:
        return None, None, "withheld by the test"

    grad_stats.stability_inputs = no_curvature  # type: ignore[assignment]
    check = feedback.Recheck.check

    def forced(self: Any, iteration: int, stats: Any, trigger: str = "") -> Any:
        d = check(self, iteration, stats, trigger)
        return d if d is None or not trigger else feedback.RecheckDecision(iteration, d.ratio, True, d.reason)

    feedback.Recheck.check = forced  # type: ignore[method-assign]


def safe_path_worker(rank: int, world: int) -> dict[str, Any]:
    import deft

    _withhold_curvature_and_force_replans()
    model = tiny_gpt2()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95))
    # a quarter of the peak until the jump (the plan is made in the warm-up), then 4x the peak
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.25 if t < JUMP else 4.0)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, profile=comm_heavy_profile(model), config={
        "warmup_iters": WARMUP, "timeout_s": 60, "adapt": False, "plan_lag_iters": 0, "solver": "greedy",
        "recheck_every": 1000, "links": [{"name": "primary"}]})
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(ITERS):
        ids = torch.randint(0, 128, (4, 16), generator=gen)
        loss = ddp(ids, labels=ids).loss
        loss.backward()
        ddp.observe_loss(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    ddp.flush()
    info = ddp.plan_info
    return {"log": [[t, list(its)] for t, its in ddp.update_log], "stats": info.get("stats"),
            "reason": info.get("reason"), "stats_reason": info.get("stats_reason"),
            "try_log": info.get("try_log", []), "rechecks": info.get("rechecks", []),
            "switches": info.get("switches", []), "running": ddp.schedule.meta.get("preserver", {}).get("reason")}


@pytest.mark.slow
def test_unchecked_stale_schedules_are_refused_in_a_gpt2_run() -> None:
    a, b = values(run_ranks(safe_path_worker, 2, timeout=240))
    assert a["log"] == b["log"]
    # The plan was judged at the warm-up's peak, not the optimizer's lr of the time (a quarter of it).
    assert a["stats"]["lr"] == pytest.approx(PEAK_LR) and a["stats"]["optimizer"] is None
    assert "withheld by the test" in a["stats"]["unchecked"]
    # Stale schedules were proposed and refused, and the record names the opt-ins.
    assert "stability unchecked" in [t["rejected_on"] for t in a["try_log"]]
    assert "stale_unchecked = true" in a["reason"] and "withheld by the test" in a["reason"]
    # The learning rate outgrew the one judged: a re-check out of turn, its re-plan refused them again.
    triggered = [r for r in a["rechecks"] if r.get("trigger")]
    assert triggered and triggered[0]["iteration"] in (JUMP, JUMP + 1), a["rechecks"]
    assert "learning rate" in triggered[0]["trigger"] and triggered[0]["replan"] is True
    assert "stale_unchecked = true" in a["running"]
    # Every iteration applied once, each update right after its own last iteration: nothing stale.
    assert sorted(t for _, its in a["log"] for t in its) == list(range(ITERS))
    assert all(t == max(its) for t, its in a["log"]), a["log"]
