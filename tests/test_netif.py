"""deft.netif: the one helper that binds a process group to a NIC."""

from __future__ import annotations

from typing import Any

import pytest
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
