"""The hierarchical all-reduce for several ranks per host: the host layout read from torchrun's variables
(irregular layouts stay flat, saying why), the collective's result (the sum over every rank, the same bits
on every rank), and deft at epsilon 0 equal to torch DDP when its links all-reduce hierarchically."""

from __future__ import annotations

import logging
import math
import os
import threading

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from deft.config import DeftConfig
from deft.errors import ContractError
from deft.runtime.codecs import int8
from deft.runtime.codecs.hooks import CommHook
from deft.runtime.codecs.wire import flat_path_factor, int8_nbytes, wire_nbytes
from deft.runtime.hierarchy import HostLayout, InOrder, env_row, layout_of
from tests._dist import run_ranks


def _rows(per_host: int, world: int) -> list[tuple[int, int, int]]:
    return [(per_host, r % per_host, r // per_host) for r in range(world)]


def test_layout_of_torchrun_ranks_is_host_major() -> None:
    layout, why = layout_of(_rows(2, 4))
    assert (layout, why) == (HostLayout(hosts=2, per_host=2), "")
    assert layout is not None and layout.hierarchical
    assert layout.host_ranks(1) == [2, 3] and layout.leaders == [0, 2]
    assert layout_of(_rows(4, 8))[0] == HostLayout(hosts=2, per_host=4)


def test_one_rank_per_host_or_one_host_is_not_hierarchical() -> None:
    one_each, _ = layout_of(_rows(1, 4))
    one_host, _ = layout_of(_rows(4, 4))
    assert one_each == HostLayout(hosts=4, per_host=1) and not one_each.hierarchical
    assert one_host == HostLayout(hosts=1, per_host=4) and not one_host.hierarchical


@pytest.mark.parametrize("rows, reason", [
    ([(2, 0, 0), (2, 1, 0), (-1, -1, -1), (2, 1, 1)], "lack torchrun's"),
    ([(2, 0, 0), (2, 1, 0), (1, 0, 1)], "different sizes"),
    ([(2, 0, 0), (2, 1, 0), (2, 0, 1)], "do not split"),
    ([(2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)], "not laid out host-major"),
])
def test_irregular_layouts_stay_flat_and_say_why(rows: list[tuple[int, int, int]], reason: str) -> None:
    layout, why = layout_of(rows)
    assert layout is None
    assert reason in why


def test_env_row_reads_torchruns_variables() -> None:
    assert env_row({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "GROUP_RANK": "3"}) == (2, 1, 3)
    assert env_row({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == (-1, -1, -1)
    assert env_row({"LOCAL_WORLD_SIZE": "two", "LOCAL_RANK": "1", "GROUP_RANK": "0"}) == (-1, -1, -1)


def test_in_order_runs_launches_in_ticket_order_whatever_the_readiness_order() -> None:
    ran: list[int] = []
    seq = InOrder()
    for ticket in (2, 0, 3, 1):
        seq.ready(ticket, lambda t=ticket: ran.append(t))
    seq.ready(5, lambda: ran.append(5))
    seq.ready(4, None)  # a skipped ticket lets the next run
    assert ran == [0, 1, 2, 3, 5]


def test_in_order_keeps_the_order_when_a_launch_makes_the_next_ready_on_its_thread() -> None:
    ran: list[int] = []
    seq = InOrder()

    def first() -> None:
        ran.append(0)
        seq.ready(1, lambda: ran.append(1))
    seq.ready(2, lambda: ran.append(2))
    threading.Thread(target=seq.ready, args=(0, first)).start()
    deadline = threading.Event()
    while len(ran) < 3 and not deadline.wait(0.01):
        pass
    assert ran == [0, 1, 2]


def test_hierarchical_setting_takes_auto_true_or_false_only() -> None:
    assert DeftConfig().hierarchical == "auto"
    assert DeftConfig.from_dict({"hierarchical": False}).hierarchical is False
    for bad in ("yes", 1):
        with pytest.raises(ContractError, match="hierarchical"):
            DeftConfig.from_dict({"hierarchical": bad})


# -- four ranks as two "hosts" of two on one machine --------------------------------------------------------
STEPS = 4


def _as_two_hosts(rank: int) -> None:
    """torchrun's variables for rank ``rank`` of 2 hosts x 2 ranks, set before deft builds its links."""
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2), GROUP_RANK=str(rank // 2))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 5))


def _train(wrapped: nn.Module, model: nn.Module, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for t in range(STEPS):
        g = torch.Generator().manual_seed(100 * t + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
        nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()


def _sums(links: dict, rank: int) -> dict[str, object]:
    """Several all-reduces in flight at once on each link, odd sizes, fp32 and fp16: integer-valued
    (exact sums, so any order of summation gives the flat sum's bits) and random (the same bits on
    every rank). Returns what every rank holds."""
    out: dict[str, object] = {}
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.float16):
        exact = [torch.randint(-50, 50, (n,), generator=g).to(dtype) for n in (1, 7, 1001)]
        noisy = [torch.randn(n, generator=g).to(dtype) for n in (3, 999, 2, 4097, 17, 65, 5, 1025)]
        flat = [t.clone() for t in exact]
        works = [links["primary"].all_reduce(t) for t in exact + noisy]
        works += [torch.distributed.all_reduce(t, async_op=True) for t in flat]
        for w in works:
            w.wait()
        key = str(dtype).removeprefix("torch.")
        out[f"exact_{key}"] = [t.tolist() for t in exact]
        out[f"flat_{key}"] = [t.tolist() for t in flat]
        out[f"noisy_{key}"] = [t.view(torch.int16 if dtype == torch.float16 else torch.int32).tolist() for t in noisy]
    return out


def hierarchy_worker(rank: int, world: int, queued: bool) -> dict[str, object]:
    import deft
    from deft.runtime.links import make_links

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deft.runtime").addHandler(handler)
    logging.getLogger("deft.runtime").setLevel(logging.INFO)
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK="0", GROUP_RANK=str(rank))  # every rank says local rank 0
    make_links(DeftConfig(), False, None)
    irregular = list(records)
    _as_two_hosts(rank)
    cfg = DeftConfig.from_dict({"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "bucket_cap_mb": 0.001,
                                "hierarchical": True, "links": [{"name": "primary"}, {"name": "second"}],
                                "link_queue": queued})
    sums = _sums(make_links(cfg, False, None), rank)
    ref = _model()
    _train(nn.parallel.DistributedDataParallel(ref), ref, rank)
    ours = _model()
    ddp = deft.DistributedDataParallel(ours, config=cfg)
    _train(ddp, ours, rank)
    ddp.flush()
    worst = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    return {"sums": sums, "worst": worst, "log": records, "irregular": irregular,
            "merged": sorted(i for _, its in ddp.update_log for i in its)}


@pytest.mark.slow
@pytest.mark.parametrize("queued", [False, True], ids=["gloo-threads", "link-queue"])
def test_hierarchical_all_reduce_sums_every_rank_and_deft_equals_torch_ddp(queued: bool) -> None:
    # link-queue: the leaders' group and the flat one serial (one gloo thread), the same sums and parameters
    results = run_ranks(hierarchy_worker, world=4, args=(queued,), timeout=240)
    assert all(r.ok for r in results), [r.error for r in results]
    values = [r.value for r in results]
    for v in values:
        assert [line for line in v["irregular"] if "flat" in line] == [
            "deft: links all-reduce flat: rank 1 is local rank 0 of host 1, not 1 of 0: ranks are not laid out "
            "host-major"], v["irregular"]
        assert any("hierarchically: 2 hosts x 2 ranks" in line for line in v["log"]), v["log"]
        assert v["worst"] <= 1e-5, v["worst"]
        assert v["merged"] == list(range(STEPS))
        for key in ("float32", "float16"):
            assert v["sums"][f"exact_{key}"] == v["sums"][f"flat_{key}"]  # exact sums: the flat ring's bits
    for key in ("exact_float32", "exact_float16", "noisy_float32", "noisy_float16"):
        assert all(v["sums"][key] == values[0]["sums"][key] for v in values), key  # the same bits everywhere
    # the sum over all four ranks, odd sizes included
    expected = torch.zeros(1001)
    for rank in range(4):
        g = torch.Generator().manual_seed(rank)
        draws = [torch.randint(-50, 50, (n,), generator=g) for n in (1, 7, 1001)]  # _sums' first draws
        expected += draws[2].float()
    assert values[0]["sums"]["exact_float32"][2] == expected.tolist()


def release_worker(rank: int, world: int) -> dict[str, object]:
    """Three all-reduces of different sizes on 2 hosts x 2 ranks, whose step across the hosts fails for the
    first (a cut link) on both first ranks: where each waits after a second, and which complete once every
    rank released the link."""
    from datetime import timedelta

    import torch.distributed as dist

    from deft.runtime.hierarchy import HierarchicalAllReduce, HierarchicalWork, make_hierarchy_groups

    real, calls = dist.all_reduce, []

    def cut_once(tensor: torch.Tensor, **kw: object) -> object:
        calls.append(tensor.numel())
        if len(calls) > 1:
            return real(tensor, **kw)  # type: ignore[arg-type]
        failed: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        failed.set_exception(RuntimeError("link cut"))  # type: ignore[arg-type]
        return HierarchicalWork(failed)

    dist.all_reduce = cut_once  # type: ignore[assignment]  # step 2 of the hierarchy, in this process only
    hier = HierarchicalAllReduce(make_hierarchy_groups(HostLayout(2, 2), "gloo", None, 60.0))
    works = [hier(torch.ones(n)) for n in (5, 7, 3)]
    try:
        works[0].wait(timeout=timedelta(seconds=1))
        before = "done"
    except Exception as e:
        before = str(e)
    dist.barrier()  # every rank judged the link lost
    hier.release()
    after = []
    for w in works:
        try:
            after.append(w.wait(timeout=timedelta(seconds=20)))
        except Exception as e:
            after.append(str(e))
    dist.barrier()  # the first ranks' processes live until the others have their broadcasts, as in training
    return {"before": before, "after": after}


@pytest.mark.slow
def test_a_lost_link_releases_the_broadcasts_the_hosts_other_ranks_wait_for() -> None:
    results = run_ranks(release_worker, world=4, timeout=120)
    assert all(r.ok for r in results), [r.error for r in results]
    for rank in (0, 2):  # first ranks: the cut step fails, the later calls owe their broadcast, unsent
        v = results[rank].value
        assert "link cut" in v["before"], v
        assert v["after"][0] == "link cut" and all("step 3 not sent" in a for a in v["after"][1:]), v
    for rank in (1, 3):  # the others: waiting for their first rank, then released, every call in order
        v = results[rank].value
        assert f"in step 3 (waiting for rank {rank - 1}, the host's first rank" in v["before"], v
        assert v["after"] == [True, True, True], v


def _nic_bytes(hosts: int, per_host: int, sends: list[tuple[int, int, float]]) -> float:
    """The most bytes any host's NIC sends, for point-to-point ``sends`` (source rank, destination rank,
    bytes) among ranks laid out host-major: only a send between two hosts crosses a NIC."""
    out = [0.0] * hosts
    for src, dst, size in sends:
        if src // per_host != dst // per_host:
            out[src // per_host] += size
    return max(out)


@pytest.mark.parametrize("hosts, per_host", [(2, 2), (4, 2), (2, 4), (3, 2)])
def test_a_hooks_flat_sends_are_priced_by_what_they_put_on_each_nic(hosts: int, per_host: int) -> None:
    n, x = hosts * per_host, 1.0
    leaders = [h * per_host for h in range(hosts)]
    # the hierarchical all-reduce: a ring among the hosts' first ranks, 2 (H - 1) / H of X from each
    hier = _nic_bytes(hosts, per_host, [(leaders[i], leaders[(i + 1) % hosts], 2 * (hosts - 1) / hosts * x)
                                        for i in range(hosts)])
    # a ring over every rank in rank order (torch's 16-bit hooks): 2 (N - 1) / N of X from each rank
    ring = _nic_bytes(hosts, per_host, [(r, (r + 1) % n, 2 * (n - 1) / n * x) for r in range(n)])
    # int8's scatter path: an all-to-all and an exchange of N chunks of X / N
    a2a = _nic_bytes(hosts, per_host, [(r, d, 2 * x / n) for r in range(n) for d in range(n) if d != r])
    assert flat_path_factor(hosts, per_host, all_to_all=False) == pytest.approx(ring / hier)
    assert flat_path_factor(hosts, per_host, all_to_all=True) == pytest.approx(a2a / hier)
    assert flat_path_factor(hosts, 1, all_to_all=True) == flat_path_factor(1, per_host, all_to_all=False) == 1.0


def test_a_16_bit_hooks_wire_bytes_grow_where_the_links_are_hierarchical() -> None:
    fp16 = CommHook(None, default_hooks.fp16_compress_hook, "fp16")
    assert wire_nbytes(fp16, [(10, 100)], 4) == 2000
    assert wire_nbytes(fp16, [(10, 100)], 4, hosts=(2, 1)) == 2000  # one rank per host: flat
    assert wire_nbytes(fp16, [(10, 100)], 4, hosts=(2, 2)) == 3000  # the ring crosses each NIC 1.5 times as much


def test_int8s_wire_bytes_are_those_of_its_path_at_the_hierarchys_world_size() -> None:
    # 2 x 2: four ranks whatever the process group says (none here); a bucket large enough for int8's
    # scatter path crosses each NIC M = 2 times as much as the hierarchical all-reduce priced at its size
    eight = CommHook(None, int8.int8_compress_hook, "int8")
    numel = 1 << 20
    assert int8.uses_scatter(numel, 4, True)
    assert wire_nbytes(eight, [(numel,)], 4, hosts=(2, 2)) == math.ceil(2 * int8_nbytes(numel, 4, True))
    assert wire_nbytes(eight, [(numel,)], 4, hosts=(4, 1)) == int8_nbytes(numel, 4, True)  # flat: the bytes alone
