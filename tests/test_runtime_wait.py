"""wait_work on a torch Future (a comm hook's result, a chained send): woken by the future's completion,
bounded by the timeout, failures named. No process group is needed: the futures are completed by hand."""

from __future__ import annotations

import threading

import pytest
import torch

from deft.errors import CommunicationError
from deft.runtime.control import future_done_event, wait_work


def test_a_future_completed_on_another_thread_gives_its_value() -> None:
    fut: torch.futures.Future = torch.futures.Future()
    value = torch.arange(4.0)
    threading.Timer(0.05, fut.set_result, args=(value,)).start()
    got = wait_work(fut, "primary", "the hook's send of bucket 3", rank=0, timeout_s=30.0)
    assert torch.equal(got, torch.arange(4.0))


def test_a_done_future_gives_its_value_and_a_set_event() -> None:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result([torch.ones(2)])
    assert future_done_event(fut).is_set()
    got = wait_work(fut, "primary", "x", rank=0, timeout_s=1.0)
    assert isinstance(got, list) and torch.equal(got[0], torch.ones(2))


def test_a_future_that_never_completes_times_out_with_the_link_named() -> None:
    fut: torch.futures.Future = torch.futures.Future()
    with pytest.raises(CommunicationError) as err:
        wait_work(fut, "second", "the hook's send of bucket 1", rank=1, timeout_s=0.05)
    msg = str(err.value)
    assert "rank 1" in msg and "'second'" in msg and "bucket 1" in msg and "not done after 0.05 s" in msg


def test_a_failed_future_is_a_communication_error() -> None:
    fut: torch.futures.Future = torch.futures.Future()
    threading.Timer(0.02, fut.set_exception, args=(RuntimeError("codec exploded"),)).start()
    with pytest.raises(CommunicationError, match="codec exploded"):
        wait_work(fut, "primary", "the hook's send of bucket 0", rank=0, timeout_s=30.0)


class _Work:
    """A Work that records how it was waited for (an NCCL Work given a timeout blocks the host until
    its kernel ends; without one it only orders the current stream)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[dict[str, object]] = []
        self.fail = fail

    def wait(self, **kwargs: object) -> bool:
        self.calls.append(kwargs)
        if self.fail:
            raise RuntimeError("NCCL communicator was aborted")
        return True


def test_a_stream_ordered_work_is_waited_for_without_a_timeout() -> None:
    work = _Work()
    assert wait_work(work, "primary", "x", rank=0, timeout_s=7.0, stream_ordered=True) is None  # type: ignore[arg-type]
    assert work.calls == [{}]


def test_a_work_on_the_host_is_waited_for_with_the_timeout() -> None:
    from datetime import timedelta

    work = _Work()
    wait_work(work, "second", "x", rank=0, timeout_s=7.0)  # type: ignore[arg-type]
    assert work.calls == [{"timeout": timedelta(seconds=7.0)}]


def test_a_failed_stream_ordered_work_is_a_communication_error() -> None:
    with pytest.raises(CommunicationError, match=r"rank 2: the send on link 'primary'.*aborted"):
        wait_work(_Work(fail=True), "primary", "the send", rank=2, timeout_s=7.0,  # type: ignore[arg-type]
                  stream_ordered=True)
