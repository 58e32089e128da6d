"""The second link's NIC taken down in every host mid-run, on the testbed (two hosts, two 250 Mbit/s
links): deft at epsilon 0 detects it within the link's deadline, agrees over the primary link, sends the
lost buckets again there, re-plans on the primary and finishes with torch DDP's parameters, every
iteration's gradient applied once; the same with ``link_queue`` (each link's group on one gloo thread,
the sends behind the failed one queued in gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deft.testbed import Testbed
from tests._dist import free_port
from tests._netns import NETNS_REASON, can_netns, skip_netns_when_refused

ROOT = Path(__file__).resolve().parents[1]
DOWN_AT = 10
STEPS = 24  # tests/_failover_worker.py


@pytest.fixture(autouse=True)
def _skip_netns_when_refused(request: pytest.FixtureRequest) -> None:
    skip_netns_when_refused(request)


def _wait_ready(procs: list[subprocess.Popen[str]], timeout_s: float) -> None:
    """Until every rank printed ``ready`` (it waits at the iteration the NIC goes down)."""
    end = time.monotonic() + timeout_s
    for p in procs:
        assert p.stdout is not None
        while time.monotonic() < end:
            line = p.stdout.readline()
            if line.strip() == "ready":
                break
            assert line, "a rank ended before the NIC went down"
        else:
            raise AssertionError("the ranks did not reach the iteration where the NIC goes down")


def _run_once(tmp_path: Path, queued: bool) -> list[dict]:
    with Testbed(hosts=2, links=2, rate_mbit=250) as tb:
        config = tb.write_config(epsilon=0.0, warmup_iters=1, profile_iters=2, timeout_s=60, link_deadline_s=3,
                                 link_queue=queued)
        go = tmp_path / "go"
        go.unlink(missing_ok=True)
        port = free_port()
        env = {"DEFT_TEST_DOWN_AT": str(DOWN_AT), "DEFT_TEST_GO": str(go)}
        procs = [tb.popen(h, [sys.executable, "-m", "tests._failover_worker"],
                          env={**tb.env_for(h, h, 2, port, config), **env}, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in range(2)]
        _wait_ready(procs, 120)
        tb.set_link(1, up=False)
        go.write_text("down\n")
        outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
@pytest.mark.parametrize("queued", [False, True], ids=["gloo-threads", "link-queue"])
def test_second_nic_down_mid_run_finishes_with_torch_ddps_parameters(tmp_path: Path, queued: bool) -> None:
    a, b = _run_once(tmp_path, queued)
    assert a["sums"] == b["sums"]  # the ranks applied the same updates
    for r in (a, b):
        assert r["worst"] < 1e-5, r["worst"]
        assert r["merged"] == list(range(STEPS))  # every gradient applied once
        assert [f["link"] for f in r["failures"]] == ["second"], r["failures"]
        rec = r["failures"][0]
        assert DOWN_AT <= rec["iteration"] <= DOWN_AT + 1, rec
        assert rec["links_left"] == ["primary"] and rec["replan"]["links"] == ["primary"], rec
        assert rec["replan"]["plan"]["source"] == "lagfree_plan (epsilon = 0)", rec  # made in the background
        assert r["links"] == ["primary"]
