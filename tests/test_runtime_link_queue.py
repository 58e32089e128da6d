"""One send in flight per gloo link (deft.runtime.link_queue): launched in order, each after the one before
it has completed, failures passed on without holding the queue; on two gloo ranks, a link's sends no
longer overlap (gloo alone runs two at once) and their sums are right."""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from deft.runtime.link_queue import LinkQueue, QueuedWork
from deft.runtime.links import CommLink
from deft.schedule import synchronous_schedule
from tests._dist import run_ranks, values

CPU = torch.device("cpu")


class HeldWork(dist.Work):
    """A collective this test completes (or fails) by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.future: torch.futures.Future[object] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[object]:
        return self.future


def _queue_of_three() -> tuple[LinkQueue, list[HeldWork], list[str], list[QueuedWork]]:
    q, works, launched = LinkQueue(), [HeldWork() for _ in range(3)], []

    def launcher(i: int) -> object:
        def launch() -> dist.Work:
            launched.append(f"send {i}")
            return works[i]
        return launch
    handles = [q.submit(launcher(i), CPU) for i in range(3)]  # type: ignore[arg-type]
    return q, works, launched, handles


def test_each_send_launches_after_the_one_before_it_completes() -> None:
    _, works, launched, handles = _queue_of_three()
    assert launched == ["send 0"]  # the link was idle: at once
    works[0].future.set_result([torch.ones(2)])
    assert launched == ["send 0", "send 1"]
    assert handles[0].is_completed() and not handles[1].is_completed()
    works[1].future.set_result([torch.zeros(2)])
    works[2].future.set_result([torch.full((2,), 2.0)])
    assert launched == ["send 0", "send 1", "send 2"]
    assert [h.get_future().value()[0].tolist() for h in handles] == [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]
    assert all(h.wait(timedelta(seconds=1)) for h in handles)


def test_a_failed_send_fails_the_sends_behind_it_unlaunched() -> None:
    _, works, launched, handles = _queue_of_three()
    works[0].future.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        handles[0].wait()
    # a failed transport is given nothing more: the sends queued behind fail, naming the first failure
    assert launched == ["send 0"]
    for h in handles[1:]:
        with pytest.raises(RuntimeError, match="not launched: an earlier all-reduce on this link failed "
                                               r"\(RuntimeError: Connection closed by peer\)"):
            h.wait()


def test_a_launch_that_raises_fails_its_handle_and_the_sends_behind_it() -> None:
    q, launched = LinkQueue(), []

    def broken() -> dist.Work:
        launched.append("broken")
        raise RuntimeError("the group was destroyed")
    first = q.submit(broken, CPU)
    second = q.submit(lambda: launched.append("second") or HeldWork(), CPU)  # type: ignore[func-returns-value]
    with pytest.raises(RuntimeError, match="the group was destroyed"):
        first.wait()
    with pytest.raises(RuntimeError, match="not launched"):
        second.wait()
    assert launched == ["broken"]


def test_a_wait_past_its_timeout_raises() -> None:
    _, _, _, handles = _queue_of_three()
    with pytest.raises(TimeoutError, match=r"queued all-reduce not done after 0\.05 s"):
        handles[0].wait(timedelta(seconds=0.05))


def test_sends_from_two_threads_keep_the_order_they_were_queued_in() -> None:
    q, order, lock = LinkQueue(), [], threading.Lock()
    works = {}

    def launcher(name: str) -> object:
        def launch() -> dist.Work:
            with lock:
                order.append(name)
            works[name] = HeldWork()
            works[name].future.set_result([torch.ones(1)])  # completes at once: the next may go
            return works[name]
        return launch
    threads = [threading.Thread(target=lambda t=t: [q.submit(launcher(f"{t}{i}"), CPU)  # type: ignore[arg-type]
                                                    for i in range(50)]) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(order) == sorted(f"{t}{i}" for t in "ab" for i in range(50))
    assert [x for x in order if x[0] == "a"] == [f"a{i}" for i in range(50)]


# -- two gloo ranks ------------------------------------------------------------------------------------
def _spans(rank: int, world: int, queued: bool) -> dict[str, object]:
    """Three 4 MB all-reduces on one link, rank 1 joining 0.3 s late; each send's launch on the wire
    (the group's own call) and completion, per rank."""
    group = dist.new_group(backend="gloo")
    link = CommLink("second", "gloo", None, group, queue=LinkQueue() if queued else None)
    stamps: list[list[float]] = []
    real = link.launch

    def stamped(t: torch.Tensor) -> dist.Work:
        row = [time.perf_counter()]
        stamps.append(row)
        work = real(t)
        work.get_future().then(lambda _: row.append(time.perf_counter()))
        return work
    link.launch = stamped  # type: ignore[method-assign]
    if rank == 1:
        time.sleep(0.3)
    tensors = [torch.full((1 << 20,), float(rank + i)) for i in range(3)]
    works = [link.all_reduce(t) for t in tensors]
    for w in works:
        w.wait(timedelta(seconds=30))
    deadline = time.monotonic() + 5
    while any(len(s) < 2 for s in stamps) and time.monotonic() < deadline:
        time.sleep(0.01)
    overlaps = sum(1 for a, b in itertools.pairwise(stamps) if b[0] < a[1])
    return {"overlaps": overlaps, "sums": [t[0].item() for t in tensors], "calls": link.stats.calls}


@pytest.mark.slow
def test_a_queued_link_runs_its_sends_one_after_another() -> None:
    res = values(run_ranks(_spans, world=2, args=(True,), timeout=90))
    assert [r["overlaps"] for r in res] == [0, 0]
    assert all(r["sums"] == [1.0, 3.0, 5.0] and r["calls"] == 3 for r in res)


@pytest.mark.slow
def test_gloo_alone_launches_a_links_sends_before_the_first_ends() -> None:
    # the variant without the queue: the check above fails there
    res = values(run_ranks(_spans, world=2, args=(False,), timeout=90))
    assert all(r["overlaps"] >= 1 for r in res)
    assert all(r["sums"] == [1.0, 3.0, 5.0] for r in res)


def _coded_overlaps(rank: int, world: int, schedule_path: str, queued: bool) -> dict[str, int]:
    """deft on a schedule that sends every bucket through the fp16 hook on link "second", rank 1's
    backward 50 ms late: how many of rank 0's fp16 all-reduces on that link's group were launched before
    the one before them had completed."""
    from torch import nn

    import deft
    import deft.runtime.links as links_module

    if not queued:  # the broken variant: gloo's own two at a time
        links_module.LinkQueue = lambda: None  # type: ignore[assignment,misc,unused-ignore]
    stamps: dict[int, list[list[float]]] = {}
    real = dist.all_reduce

    def stamped(tensor: torch.Tensor, *args: object, group: object = None, **kwargs: object) -> object:
        row = [time.perf_counter()]
        work = real(tensor, *args, group=group, **kwargs)  # type: ignore[arg-type]
        if tensor.dtype == torch.float16 and work is not None:
            stamps.setdefault(id(group), []).append(row)
            work.get_future().then(lambda _: row.append(time.perf_counter()))
        return work
    dist.all_reduce = stamped  # type: ignore[assignment]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
    if rank == 1:
        model[0].register_full_backward_hook(lambda *_: time.sleep(0.05))
    ddp = deft.DistributedDataParallel(model, config={
        "epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "timeout_s": 30, "schedule_path": schedule_path,
        "links": [{"name": "primary"}, {"name": "second"}], "bucket_cap_mb": 0.01, "link_queue": True,
        "compression": "fp16"})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(8):
        nn.functional.mse_loss(ddp(torch.randn(8, 32, generator=g)), torch.zeros(8, 4)).backward()
        opt.step()
        opt.zero_grad()
    ddp.flush()
    time.sleep(0.2)
    rows = max(stamps.values(), key=len)  # the second link's group: every coded send
    return {"sends": len(rows), "overlaps": sum(1 for a, b in itertools.pairwise(rows) if b[0] < a[-1])}


def _coded_schedule(tmp_path: Path) -> str:
    numel = (1028, 65792, 8448)  # the model's buckets at bucket_cap_mb 0.01, output side first
    sched = synchronous_schedule(numel, tuple(4 * n for n in numel), ("primary", "second"),
                                 ("second", "second", "second"))
    path = tmp_path / "coded.json"
    sched.__class__(**{**sched.__dict__, "codecs": ("fp16", "fp16", "fp16")}).save(path)
    return str(path)


@pytest.mark.slow
def test_a_coded_links_hooked_sends_run_one_after_another(tmp_path: Path) -> None:
    res = values(run_ranks(_coded_overlaps, world=2, args=(_coded_schedule(tmp_path), True), timeout=120))
    assert res[0]["sends"] >= 12 and res[0]["overlaps"] == 0


@pytest.mark.slow
def test_a_coded_links_hooked_sends_overlap_without_the_queue(tmp_path: Path) -> None:
    res = values(run_ranks(_coded_overlaps, world=2, args=(_coded_schedule(tmp_path), False), timeout=120))
    assert res[0]["overlaps"] >= 1


def test_a_queue_beside_a_codec_that_numbers_its_calls_is_refused() -> None:
    from deft.config import DeftConfig
    from deft.errors import ContractError

    for compression in ("int8", "auto"):  # "auto" may choose int8
        with pytest.raises(ContractError, match=r"link_queue: expected compression \"none\", \"fp16\" or "
                                                r"\"bf16\" with link_queue = true"):
            DeftConfig.from_dict({"link_queue": True, "compression": compression})
    assert DeftConfig.from_dict({"link_queue": True, "compression": "none"}).link_queue
    assert not DeftConfig().link_queue  # off unless asked for


def test_a_schedule_file_with_int8_beside_a_queue_is_refused_by_name(tmp_path: Path) -> None:
    from torch import nn

    from deft.config import DeftConfig
    from deft.errors import ContractError
    from deft.runtime.planning import check_schedule_file

    path = tmp_path / "int8.json"
    model = nn.Linear(32, 256)  # 8448 elements: one bucket
    sched = synchronous_schedule((8448,), (4 * 8448,), ("primary", "second"), ("second",))
    sched.__class__(**{**sched.__dict__, "codecs": ("int8",)}).save(path)
    links = [{"name": "primary"}, {"name": "second"}]
    queued = DeftConfig.from_dict({"links": links, "link_queue": True, "compression": "none",
                                   "schedule_path": str(path)})
    with pytest.raises(ContractError, match=r"int8\.json: codecs: int8 on a bucket, with link_queue = true"):
        check_schedule_file(queued, model)
    check_schedule_file(DeftConfig.from_dict({"links": links, "schedule_path": str(path)}), model)  # no queue
