"""The background decision's slot (deft.runtime.background.JobSlot) on each branch it can take.

Two gloo ranks share one slot; rank 0 holds a job whose end the test controls. Branches:

* before the due iteration, a job still running is not collected (every rank answers False alike);
  once rank 0's thread is done it is collected at the next boundary, before the due iteration;
* at the due iteration, a decision that takes longer than ``timeout_s`` is waited for by every rank
  together, in rounds, instead of failing the other ranks as if rank 0 were dead;
* at the due iteration, a rank 0 that really died makes the other rank fail within its round, with a
  CommunicationError that says which collective and that a peer probably died.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from tests._dist import run_ranks, values


def _slot(timeout_s: float) -> Any:
    import torch.distributed as dist

    from deft.runtime.background import JobSlot
    from deft.runtime.control import ControlPlane

    return JobSlot(ControlPlane(dist.group.WORLD, timeout_s))


def early_worker(rank: int, world: int) -> list[bool]:
    """Rank 0's job blocks until released: not ready before due while it runs, ready once done."""
    from deft.runtime.background import Background

    slot = _slot(30.0)
    release = threading.Event()
    job = Background(lambda: {"waited": release.wait(60)}, "test-job") if rank == 0 else None
    slot.hold("plan", job, due=100)
    answers = [slot.ready(1), slot.ready(2)]  # running: not ready on any rank
    if rank == 0:
        release.set()
        assert job is not None
        job.result()
    answers.append(slot.ready(3))  # done: collected before the due iteration
    taken = slot.take()
    answers.append(slot.holds("plan"))
    return [*answers, taken is job]


@pytest.mark.slow
@pytest.mark.serial
def test_a_running_decision_is_collected_once_done_before_its_due_iteration() -> None:
    for v in values(run_ranks(early_worker, 2, timeout=60)):
        assert v == [False, False, True, False, True]


def slow_worker(rank: int, world: int) -> dict[str, object]:
    """Rank 0's decision takes 3 s; every rank's timeout is 1 s."""
    from deft.runtime.background import Background

    slot = _slot(1.0)
    job = Background(lambda: (time.sleep(3.0), {"plan": "slow"})[1], "test-job") if rank == 0 else None
    slot.hold("plan", job, due=5)
    ready = slot.ready(5)
    taken = slot.take()
    doc = None if taken is None else dict(taken.result()[0])
    # then the decision travels, as Planning.finish broadcasts it: no rank may have timed out meanwhile
    sent = slot.control.broadcast_ints([7 if rank == 0 else 0], "schedule length")
    return {"ready": ready, "doc": doc, "done": None if taken is None else taken.done(), "sent": sent}


@pytest.mark.slow
@pytest.mark.serial
def test_a_decision_slower_than_the_timeout_is_waited_for_not_taken_for_a_dead_rank() -> None:
    r0, r1 = values(run_ranks(slow_worker, 2, timeout=60))
    assert r0 == {"ready": True, "doc": {"plan": "slow"}, "done": True, "sent": [7]}
    assert r1 == {"ready": True, "doc": None, "done": None, "sent": [7]}


def dead_worker(rank: int, world: int) -> str:
    """Rank 0 dies at the due iteration, before the collective."""
    import torch.distributed as dist

    slot = _slot(2.0)
    slot.hold("adapt", None, due=1)
    # both ranks are past setting up the process group (rank 0 hosts its store: dying while rank 1 still
    # connected failed rank 1 in init_process_group instead, once in a CI run)
    dist.barrier()
    if rank == 0:
        os._exit(3)
    try:
        slot.ready(1)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.slow
@pytest.mark.serial
def test_a_dead_rank_0_at_the_due_iteration_fails_the_others_clearly() -> None:
    r1 = run_ranks(dead_worker, 2, timeout=60)[1]
    assert r1.value is not None and r1.value.startswith("CommunicationError"), r1
    assert "background planning state" in r1.value and "peer rank probably died" in r1.value, r1.value
