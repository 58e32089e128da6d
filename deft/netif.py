"""One process group bound to one NIC: the single place where ``*_SOCKET_IFNAME`` is set for a group.

gloo reads ``GLOO_SOCKET_IFNAME`` when a group creates its transport device (inside
``dist.new_group``; its ``pg_options`` are ignored for this), so the variable is set right before
the call and restored right after. NCCL creates its communicator lazily, at the group's first
collective, and reads ``NCCL_SOCKET_IFNAME`` then: for an NCCL group the variable is left set.
Known limit (untested: it needs two NICs with GPUs): with two NCCL links on different NICs the variable holds
the last link's NIC when both communicators initialise, so both may use it; one NCCL link plus gloo
links (deft's default on GPUs) is not affected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist


def ifname_variable(backend: str) -> str:
    return "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"


def new_group_on_nic(backend: str, ifname: str | None, timeout_s: float | None = None,
                     ranks: Sequence[int] | None = None) -> dist.ProcessGroup:
    """``dist.new_group`` over ``ranks`` (default: all) whose traffic uses NIC ``ifname`` (None: the default)."""
    var = ifname_variable(backend)
    previous = os.environ.get(var)
    if ifname:
        os.environ[var] = ifname
    members = list(ranks) if ranks is not None else None
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    try:
        if timeout is None:  # torch's own default timeout
            return dist.new_group(backend=backend, ranks=members)
        return dist.new_group(backend=backend, ranks=members, timeout=timeout)
    finally:
        if ifname and backend != "nccl":
            if previous is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = previous
