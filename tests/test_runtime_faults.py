"""Faults end every rank with a clear error, never a hang: a dead peer, a stalled peer, mismatched configs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests._dist import RankResult, run_ranks
from tests.test_runtime_delayed import delayed_schedule


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))  # 83 elements


def _ended(pid: int) -> bool:
    """The process ``pid`` has exited (gone, or a zombie not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _stall(seconds: float, peer_pid: int) -> None:
    """Sleep ``seconds``, or less once the peer has ended: nothing it could still do waits for this rank."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not _ended(peer_pid):
        time.sleep(0.05)


def fault_worker(rank: int, world: int, schedule_path: str, mode: str, timeout_s: float) -> None:
    import deft

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = deft.DistributedDataParallel(model, config={
        "epsilon": 0.1, "warmup_iters": 1, "schedule_path": schedule_path, "timeout_s": timeout_s,
        "links": [{"name": "primary"}, {"name": "second"}]})
    pid_file = Path(schedule_path).parent / "rank0.pid"
    if rank == 0:
        pid_file.write_text(str(os.getpid()))
    for t in range(12):
        out = ddp(torch.randn(4, 6))
        if rank == 1 and t == 4:
            if mode == "die":
                os._exit(3)  # a crash in the middle of an iteration
            _stall(timeout_s + 6, int(pid_file.read_text()))  # a stall longer than the timeout
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()


def first_error_line(results: list[RankResult]) -> str:
    """Rank 0 ended (no hang up to run_ranks' limit) with a CommunicationError naming link, bucket, iteration."""
    r0 = results[0]
    assert not r0.timed_out and r0.exitcode not in (0, None)
    assert r0.error is not None and r0.error.startswith("CommunicationError: rank 0: ")
    first = r0.error.splitlines()[0]
    assert "link 'primary'" in first or "link 'second'" in first
    assert "bucket" in first and "iteration" in first and "peer rank probably died or stalled" in first
    return first


@pytest.mark.slow
@pytest.mark.serial
def test_dead_peer_gives_clear_error(tmp_path: Path) -> None:
    sched = tmp_path / "schedule.json"
    delayed_schedule((30, 30, 23)).save(sched)
    res = run_ranks(fault_worker, 2, (str(sched), "die", 10.0), timeout=60)
    first_error_line(res)
    assert res[1].exitcode == 3


@pytest.mark.slow
@pytest.mark.serial
def test_stalled_peer_times_out_with_clear_error(tmp_path: Path) -> None:
    # the staller sleeps timeout_s + 6 s (less once rank 0 has ended) and then carries on: without the link
    # timeout rank 0's collective would complete late and no error would be raised, so the timeout error
    # itself shows that the timeout fired first (no wall-clock assertion needed)
    sched = tmp_path / "schedule.json"
    delayed_schedule((30, 30, 23)).save(sched)
    res = run_ranks(fault_worker, 2, (str(sched), "stall", 3.0), timeout=60)
    first = first_error_line(res)
    assert "timed out" in first.lower() or "timeout" in first.lower()


def mismatch_worker(rank: int, world: int) -> None:
    import deft

    deft.DistributedDataParallel(_model(), config={"epsilon": 0.01 if rank == 0 else 0.05, "timeout_s": 20})


@pytest.mark.slow
@pytest.mark.serial
def test_mismatched_config_names_the_rank() -> None:
    res = run_ranks(mismatch_worker, 2, (), timeout=60)
    for r in res:
        assert r.exitcode == 1 and r.error is not None
        first = r.error.splitlines()[0]
        assert first.startswith(f"ContractError: rank {r.rank}: config: rank(s) [1] differ from rank 0"), first
        assert "epsilon: rank 0 has 0.01, rank 1 has 0.05" in first, first


def planner_failure_worker(rank: int, world: int, lag: int) -> str:
    """Rank 0's planner raises; every rank must stop with rank 0's error, whether rank 0 planned in the
    step (lag 0) or on its background thread (the default)."""
    import deft
    import deft.runtime.planning as planning
    from deft.errors import DeftError

    if rank == 0:
        def exploding(*args: object, **kwargs: object) -> None:
            raise RuntimeError("the knapsack is on fire")

        planning.make_schedule = exploding  # type: ignore[assignment]  # this spawned process only
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = deft.DistributedDataParallel(model, config={
        "epsilon": 0.1, "warmup_iters": 1, "profile_iters": 1, "plan_lag_iters": lag, "timeout_s": 30,
        "links": [{"name": "primary"}]})
    try:
        for _ in range(10):
            ddp(torch.randn(4, 6)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    except DeftError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("lag", [0, 3])
def test_a_planner_failure_on_rank_0_stops_every_rank_with_its_error(lag: int) -> None:
    from tests._dist import values

    a, b = values(run_ranks(planner_failure_worker, 2, (lag,), timeout=90))
    assert a == b == "rank 0 could not produce a schedule: RuntimeError: the knapsack is on fire"
