"""Whether this machine can build the network-namespace testbed (tests marked ``netns``)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

NETNS_REASON = "needs root and iproute2 (ip, tc) to build network namespaces"
can_netns = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


@functools.cache
def netns_refused() -> str | None:
    """Why namespaces cannot be made although we are root (an unprivileged container lacks
    CAP_SYS_ADMIN), or None. Probed once, with a name nothing else uses, deleted at once."""
    probe = f"deftprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return f"root, but cannot create network namespaces here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def skip_netns_when_refused(request: pytest.FixtureRequest) -> None:
    """For an autouse fixture: skip a ``netns`` test where namespaces are refused (a property of the
    machine, not a failure)."""
    if can_netns and request.node.get_closest_marker("netns"):
        reason = netns_refused()
        if reason is not None:
            pytest.skip(reason)
