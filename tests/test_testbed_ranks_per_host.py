"""Several ranks per host on the testbed (2 hosts x 2 ranks, torchrun's multi-node launch in each host's
namespace): traffic between the ranks of one host goes over the host's loopback, never its shaped NIC;
deft's links all-reduce hierarchically (inside the host, then across), so each host's NIC carries the size
once where gloo's flat ring carries it 1.5 times; and deft at epsilon 0 computes what torch DDP computes,
every gradient applied once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from deft.testbed import Testbed
from tests._dist import free_port
from tests._netns import NETNS_REASON, can_netns, skip_netns_when_refused

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6  # tests/_ranks_per_host_worker.py


@pytest.fixture(autouse=True)
def _skip_netns_when_refused(request: pytest.FixtureRequest) -> None:
    skip_netns_when_refused(request)


def _reports(out_dir: Path) -> list[dict]:
    """Every rank's report of a 2 x 2 run at 1 Gbit/s (fast links: the test is about who sends what)."""
    with Testbed(hosts=2, links=2, rate_mbit=1000) as tb:
        config = tb.write_config(epsilon=0.0, warmup_iters=1, profile_iters=2, bucket_cap_mb=0.001, timeout_s=120,
                                 plan_lag_iters=0)  # planned in the iteration ending the profile: t0 is known
        port = free_port()
        procs = []
        for h in range(2):
            env = tb.env_for(h, rank=2 * h, world=4, port=port, config=config)
            links = {k: env[k] for k in ("GLOO_SOCKET_IFNAME", "DEFT_CONFIG", "OMP_NUM_THREADS")}
            argv = [*tb.torchrun_argv(h, 2, port), "-m", "tests._ranks_per_host_worker", str(out_dir)]
            procs.append(tb.popen(h, argv, env=links, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
        outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(4)]


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_two_hosts_of_two_ranks_keep_local_traffic_off_the_nics_and_deft_equals_torch_ddp(tmp_path: Path) -> None:
    reports = _reports(tmp_path)
    # torchrun put ranks 2h and 2h + 1 on host h
    assert [(r["rank"], r["host"], r["local_rank"], r["world"]) for r in reports] == [
        (0, 0, 0, 4), (1, 0, 1, 4), (2, 1, 0, 4), (3, 1, 1, 4)]
    for r in reports:
        # gloo's ring 0 -> 1 -> 2 -> 3 -> 0 sends 2 (N - 1) / N = 1.5 times the size from every rank: each
        # host's NIC carries its one hop to the other host (plus TCP/IP headers), the loopback the hop
        # between its own two ranks. A hop between ranks of one host through the NIC would double the first.
        assert 1.45 < r["sent"]["nic0"] < 1.7, r["sent"]
        assert r["sent"]["lo"] > 1.45, r["sent"]
        # deft's primary link: reduce inside the host, all-reduce between the hosts' first ranks, broadcast
        # inside: the NIC carries 2 (H - 1) / H = 1 times the size (plus headers), below the flat ring's 1.5
        assert 0.95 < r["deft_sent"]["nic0"] < 1.2, r["deft_sent"]
        assert r["deft_sum"] == 4.0, r
        assert any("2 hosts x 2 ranks" in n for n in r["hierarchical"]), r  # and training's links too
        assert r["worst"] <= 1e-5, r
        assert r["t0"] is not None and r["t0"] < STEPS, r  # planned, and the plan ran
        assert r["merged"] == list(range(STEPS)), r  # every iteration's gradient applied once
