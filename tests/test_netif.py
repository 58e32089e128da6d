"""deft.netif: the one helper that binds a process group to a NIC."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from deft import netif


def test_gloo_sees_the_nic_during_creation_and_the_variable_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.setattr(dist, "new_group", lambda **kw: seen.append((kw, netif.os.environ.get("GLOO_SOCKET_IFNAME"))))
    netif.new_group_on_nic("gloo", "nic1", 5.0, [0, 1])
    (kw, during), = seen
    assert during == "nic1" and kw["backend"] == "gloo" and kw["ranks"] == [0, 1]
    assert kw["timeout"].total_seconds() == 5.0
    assert netif.os.environ["GLOO_SOCKET_IFNAME"] == "eth9"  # restored


def test_gloo_variable_removed_when_it_was_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(dist, "new_group", lambda **kw: None)
    netif.new_group_on_nic("gloo", "nic0")
    assert "GLOO_SOCKET_IFNAME" not in netif.os.environ


def test_nccl_keeps_the_variable_for_its_lazy_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(dist, "new_group", lambda **kw: None)
    netif.new_group_on_nic("nccl", "ib0")
    assert netif.os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")


def test_without_a_nic_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    seen = []
    monkeypatch.setattr(dist, "new_group", lambda **kw: seen.append(netif.os.environ.get("GLOO_SOCKET_IFNAME")))
    netif.new_group_on_nic("gloo", None)
    assert seen == [None]


@pytest.fixture
def one_rank_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as the only rank of a gloo default group (a file store: no port needed)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the default group's own device: loopback
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_gloo")
def test_a_real_gloo_group_on_loopback_works_and_the_variable_is_restored() -> None:
    group = netif.new_group_on_nic("gloo", "lo", timeout_s=30.0)
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert dist.get_backend(group) == "gloo"
    t = torch.tensor([3.0, 4.0])
    dist.all_reduce(t, group=group)
    assert t.tolist() == [3.0, 4.0]  # one rank: the sum is the tensor itself


@pytest.mark.usefixtures("one_rank_gloo")
def test_gloo_really_reads_the_variable_and_it_is_restored_after_the_failure(monkeypatch: pytest.MonkeyPatch
                                                                            ) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with pytest.raises(RuntimeError, match="deft-no-such-nic0"):
        netif.new_group_on_nic("gloo", "deft-no-such-nic0")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_gloo_variable_restored_when_new_group_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**kw: Any) -> None:
        raise RuntimeError("peer unreachable")

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.setattr(dist, "new_group", refuse)
    with pytest.raises(RuntimeError, match="peer unreachable"):
        netif.new_group_on_nic("gloo", "nic1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"


def test_default_timeout_and_all_ranks_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(dist, "new_group", lambda **kw: seen.append(kw))
    netif.new_group_on_nic("gloo", None)
    assert seen == [{"backend": "gloo", "ranks": None}]
