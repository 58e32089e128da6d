"""The ranks' verdict on guarded sends (deft.runtime.verdicts), on two gloo ranks over loopback.

The sends are futures this test completes, fails or leaves hanging, from a thread of its own where a
gloo thread would: a verdict is opened without waiting for them, reached once they end (or at its
deadline) without the training thread, the same on every rank even where the ranks see their sends end
in different orders, and a lost link's sends are summed again from the local gradients.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist

from deft.runtime.link_queue import serial_gloo_group
from deft.runtime.verdicts import VerdictChain, flat_sum
from tests._dist import next_send_ends_while_python_holds_the_gil, run_ranks, values

if TYPE_CHECKING:
    from deft.runtime.executor import Executor
    from deft.schedule import Schedule

LINKS = ["primary", "second", "third"]


def _chain() -> VerdictChain:
    flags, resends = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    return VerdictChain(flat_sum(flags), resends, LINKS, dist.get_rank(), timeout_s=20.0)


def _later(seconds: float, fn: Callable[[], object]) -> None:
    """``fn()`` on a thread of its own after ``seconds`` (as a gloo thread completes a send)."""
    t = threading.Timer(seconds, fn)
    t.daemon = True
    t.start()


def _local(rank: int) -> torch.Tensor:
    return torch.full((4,), float(rank + 1))


def _what() -> str:
    return "a send"


def _done() -> torch.futures.Future[object]:
    f: torch.futures.Future[object] = torch.futures.Future()
    f.set_result(None)
    return f


def good_worker(rank: int, world: int) -> dict[str, object]:
    chain = _chain()
    fut: torch.futures.Future[object] = torch.futures.Future()
    v = chain.open(["second"], [fut], [_local(rank)], [_what], 10.0, set())
    reached_before = v.done  # the send has not ended: open returned without it
    _later(0.2, lambda: fut.set_result(None))
    chain.wait(v, "send")
    return {"before": reached_before, "lost": sorted(v.lost), "resent": len(v.resent),
            "losses": [loss.link for loss in chain.losses()]}


@pytest.mark.slow
def test_a_verdict_opens_without_waiting_and_keeps_a_link_whose_sends_completed() -> None:
    for r in values(run_ranks(good_worker, 2, timeout=60)):
        assert r == {"before": False, "lost": [], "resent": 0, "losses": []}


def failed_worker(rank: int, world: int, mode: str) -> dict[str, object]:
    """Rank 1's send on ``second`` fails (``mode="error"``) or never ends (``"hang"``); rank 0's completes."""
    chain = _chain()
    fut: torch.futures.Future[object] = torch.futures.Future()
    ok = _done()
    v = chain.open(["second", "third"], [fut, ok], [_local(rank), 10 * _local(rank)], [_what, _what], 3.0, set())
    if rank == 0:
        _later(0.1, lambda: fut.set_result(None))
    elif mode == "error":
        _later(0.1, lambda: fut.set_exception(RuntimeError("injected: the connection was reset")))
    chain.wait(v, "send")
    losses = chain.losses()
    return {"lost": sorted(v.lost), "resent": {str(i): t.tolist() for i, t in v.resent.items()},
            "losses": [(loss.link, loss.resent, bool(loss.why)) for loss in losses]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["error", "hang"])
def test_a_send_that_failed_on_one_rank_is_lost_on_every_rank_and_summed_again(mode: str) -> None:
    res = values(run_ranks(failed_worker, 2, (mode,), timeout=60))
    for rank, r in enumerate(res):
        assert r["lost"] == ["second"], r
        assert r["resent"] == {"0": [3.0] * 4}, r  # send 0 summed again: 1 + 2, both ranks' local gradients
        assert r["losses"] == [["second", 1, rank == 1]], r  # only rank 1 saw it fail


def order_worker(rank: int, world: int) -> dict[str, object]:
    """Two verdicts; their sends end in opposite orders on the two ranks: rank 0's second verdict is
    ready first, rank 1's first. Rank 1's send of the first fails on ``second``, rank 0's of the second
    on ``third``."""
    chain = _chain()
    a: torch.futures.Future[object] = torch.futures.Future()
    b: torch.futures.Future[object] = torch.futures.Future()
    v1 = chain.open(["second"], [a], [_local(rank)], [_what], 10.0, set())
    v2 = chain.open(["third"], [b], [_local(rank)], [_what], 10.0, set())
    fail_a, fail_b = rank == 1, rank == 0

    def end(f: torch.futures.Future[object], fail: bool) -> None:
        f.set_exception(RuntimeError("injected")) if fail else f.set_result(None)

    first, second = ((b, fail_b), (a, fail_a)) if rank == 0 else ((a, fail_a), (b, fail_b))
    _later(0.1, lambda: end(*first))
    _later(0.6, lambda: end(*second))
    chain.wait(v2, "send")
    chain.wait(v1, "send")
    return {"v1": sorted(v1.lost), "v2": sorted(v2.lost)}


@pytest.mark.slow
def test_verdicts_are_reached_in_the_order_opened_whatever_order_their_sends_end() -> None:
    for r in values(run_ranks(order_worker, 2, timeout=60)):
        # the second verdict names the first's loss too: a link lost stays lost
        assert r == {"v1": ["second"], "v2": ["second", "third"]}, r


def alone_worker(rank: int, world: int) -> dict[str, object]:
    """Rank 0 waits for the verdict while rank 1's training thread waits in a barrier that rank 0 joins
    only after: rank 1's flags go out from its send's completion, without its training thread (and
    long before the deadline, past the harness's bound)."""
    chain = _chain()
    fut: torch.futures.Future[object] = torch.futures.Future()
    v = chain.open(["second"], [fut], [_local(rank)], [_what], 1000.0, set())
    _later(0.3, lambda: fut.set_result(None))
    if rank == 0:
        chain.wait(v, "send")
        dist.barrier()
    else:
        dist.barrier()
        chain.wait(v, "send")
    return {"lost": sorted(v.lost)}


@pytest.mark.slow
def test_one_rank_waits_for_a_verdict_while_the_others_training_thread_is_elsewhere() -> None:
    for r in values(run_ranks(alone_worker, 2, timeout=60)):
        assert r["lost"] == [], r


def test_a_plans_profile_is_priced_for_the_verdicts_this_run_waits_for() -> None:
    """Whoever measured the profile (a given one, one taken with another ``link_failover``), the plan is
    priced for this run's guard: the verdict lengthens the step only where the run guards the link."""
    from deft.profile import Bucket, BucketTimes, Link, Profile
    from deft.runtime.failover import guarded_links
    from deft.schedule import synchronous_schedule
    from deft.solver.simulate import simulate_schedule

    taken = Profile(buckets=tuple(Bucket(i, (f"p{i}",), 250, 1000) for i in range(2)),
                    times=tuple(BucketTimes(1.0, 1.0, {"a": 0.5, "b": 2.0}) for _ in range(2)),
                    links=(Link("a", "gloo", None, 0.25, 0.0), Link("b", "gloo", guarded=True)), world_size=2,
                    source="synthetic")
    s = synchronous_schedule((250, 250), (1000, 1000), ("a", "b"), ("b", "a"))
    guarded = guarded_links(taken, lambda name: name == "b")
    unguarded = guarded_links(taken, lambda name: False)
    assert [lk.guarded for lk in guarded.links] == [False, True]
    assert [lk.guarded for lk in unguarded.links] == [False, False]
    # bucket 0 on b ends at 5, the step waits for its verdict on the idle primary (its start-up 0.25)
    assert simulate_schedule(guarded, s).iteration_s == pytest.approx(5.25)
    assert simulate_schedule(unguarded, s).iteration_s == pytest.approx(5.0)


def held_link_worker(rank: int, world: int) -> dict[str, object]:
    """A verdict opened on a real send of a serial link (one gloo thread), then the link's next send while
    the main thread runs pure Python, holding the GIL (a switch interval longer than the loop): the next
    send completes during the loop (a callback on the first send's future would hold the link's only
    thread until the loop ends: tests/test_completions.py keeps that broken variant)."""
    link = serial_gloo_group(None, 60.0, None)
    chain = _chain()
    dist.barrier(group=link)
    first = dist.all_reduce(torch.ones(1 << 16), group=link, async_op=True)
    assert first is not None
    v = chain.open(["second"], [first.get_future()], [_local(rank)], [_what], 30.0, set())
    during = next_send_ends_while_python_holds_the_gil(link)
    chain.wait(v, "send")
    return {"during": during, "lost": sorted(v.lost)}


@pytest.mark.slow
def test_a_verdict_does_not_hold_its_link_while_python_runs() -> None:
    for r in values(run_ranks(held_link_worker, 2, timeout=60)):
        assert r == {"during": True, "lost": []}


def _executor_on_two_links(rank: int, world: int, schedule: Schedule, flags_out: threading.Event) -> Executor:
    """A real executor on two real gloo links, the second guarded, running ``schedule`` on three
    four-element parameters; ``flags_out`` is set when a verdict's flags go out (the test's own sum)."""
    from deft.config import DeftConfig, LinkConfig
    from deft.runtime.buckets import FlatLayout
    from deft.runtime.control import ControlPlane
    from deft.runtime.executor import Executor
    from deft.runtime.failover import LinkFailover
    from deft.runtime.links import make_control_group, make_links

    config = DeftConfig(links=(LinkConfig("primary"), LinkConfig("second")), link_failover=True)
    links = make_links(config, cuda=False, ranks=None)
    failover = LinkFailover(config, ControlPlane(make_control_group(config, None), config.timeout_s), links)
    sum_flags = flat_sum(make_control_group(config, None))

    def counted(flags: torch.Tensor) -> dist.Work:
        flags_out.set()
        return sum_flags(flags)

    failover.verdicts = VerdictChain(counted, make_control_group(config, None), list(links), rank, config.timeout_s)
    params = [torch.zeros(4) for _ in range(3)]
    ex = Executor(params, links, rank, world, config.timeout_s, torch.device("cpu"))
    ex.install(schedule, FlatLayout(range(3), ["p0", "p1", "p2"], params, (4, 4, 4)), 0)
    ex.guard_links(failover)
    return ex


def _grads(rank: int, iteration: int) -> list[torch.Tensor]:
    return [torch.full((4,), float(100 * iteration + 10 * i + rank + 1)) for i in range(3)]


def _lists(grads: list[torch.Tensor | None]) -> list[list[float] | None]:
    return [None if g is None else g.tolist() for g in grads]


def step_verdict_worker(rank: int, world: int) -> dict[str, object]:
    """One iteration of a lag-free plan: in the backward, bucket 2 goes on the primary, bucket 1 on the
    second link, then bucket 0 on the primary, deferred to the next forward. The step needs buckets 1 and
    2, so the verdict on bucket 1's send is due once it is launched: its flags go out before the deferred
    send is launched, not at the step behind it on the primary's NIC."""
    from deft.schedule import CommTask, Schedule, StagePlan, Update

    backward = (CommTask(2, 0, "primary"), CommTask(1, 0, "second"), CommTask(0, 0, "primary"))
    schedule = Schedule(cycle=1, links=("primary", "second"), bucket_numel=(4, 4, 4), bucket_nbytes=(16, 16, 16),
                        stages=(StagePlan(0, "forward"), StagePlan(0, "backward", backward)),
                        updates=(Update((0,), 0, finish_in_forward=True, deferred=(0,)),))
    flags_out = threading.Event()
    ex = _executor_on_two_links(rank, world, schedule, flags_out)
    ex.begin_iteration(0)
    grads = _grads(rank, 0)
    ex.add_grad(2, grads[2])
    ex.add_grad(1, grads[1])
    before_deferred = flags_out.wait(20.0)  # bounded only where the verdict waits for the step
    ex.add_grad(0, grads[0])
    ex.end_backward()
    return {"before_deferred": before_deferred, "at_step": _lists(ex.take_update(0).grads),
            "in_forward": _lists(ex.finish())}


def delayed_verdict_worker(rank: int, world: int) -> dict[str, object]:
    """A delayed plan (each iteration's update applied at the next one's step): iteration 0's buckets go
    in iteration 1's forward (bucket 0 on the second link, 1 and 2 on the primary) and are applied at its
    step. Every send that step needs is launched before its backward, so the verdict opens at the
    backward's first gradient: its flags go out while the rest of that backward is still to come."""
    from deft.schedule import CommTask, Schedule, StagePlan, Update

    forward = (CommTask(0, 1, "second"), CommTask(1, 1, "primary"), CommTask(2, 1, "primary"))
    schedule = Schedule(cycle=2, links=("primary", "second"), bucket_numel=(4, 4, 4), bucket_nbytes=(16, 16, 16),
                        stages=(StagePlan(0, "forward", forward), StagePlan(0, "backward"),
                                StagePlan(1, "forward", forward), StagePlan(1, "backward")),
                        updates=(Update((0,), 1), Update((1,), 2)))
    flags_out = threading.Event()
    ex = _executor_on_two_links(rank, world, schedule, flags_out)
    ex.begin_iteration(0)
    for i, g in enumerate(_grads(rank, 0)):
        ex.add_grad(i, g)
    ex.end_backward()
    assert ex.due(0) == []
    ex.begin_iteration(1)
    later = _grads(rank, 1)
    ex.add_grad(0, later[0])
    in_backward = flags_out.wait(20.0)  # bounded only where the verdict waits for the step
    ex.add_grad(1, later[1])
    ex.add_grad(2, later[2])
    ex.end_backward()
    return {"in_backward": in_backward, "at_step": _lists(ex.take_update(0).grads)}


@pytest.mark.slow
def test_the_steps_verdict_goes_out_before_the_deferred_sends_are_launched() -> None:
    for r in values(run_ranks(step_verdict_worker, 2, timeout=90)):
        assert r == {"before_deferred": True,
                     "at_step": [None, [11.5] * 4, [21.5] * 4],  # averages of (10 i + 1) and (10 i + 2)
                     "in_forward": [[1.5] * 4, None, None]}, r


@pytest.mark.slow
def test_a_delayed_updates_verdict_opens_at_the_first_gradient_of_its_steps_backward() -> None:
    for r in values(run_ranks(delayed_verdict_worker, 2, timeout=90)):
        # iteration 0's averages of (10 i + 1) and (10 i + 2), applied at iteration 1's step
        assert r == {"in_backward": True, "at_step": [[1.5] * 4, [11.5] * 4, [21.5] * 4]}, r
