"""A NIC that dies with several ranks per host, on the testbed (2 hosts x 2 ranks, torchrun in each host's
namespace, two 250 Mbit/s links that all-reduce hierarchically: inside the host, across its NIC between
the hosts' first ranks, back inside the host).

The second link's NIC taken down in every host mid-run: only the first ranks' step across the hosts
fails; the host's other ranks wait for a broadcast that never comes. Every rank still finds the loss
within the link's deadline, the ranks agree, the lost buckets go again on the primary link and the run
finishes with torch DDP's parameters, every iteration's gradient applied once. The primary link's NIC
taken down: every rank stops with an error naming it. Neither run waits on a hung step: each ends within
one ``timeout_s`` of the NIC going down (the bound a rank left waiting for a dead peer would reach)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from deft.testbed import Testbed, stop_process_group
from tests._dist import free_port
from tests._netns import NETNS_REASON, can_netns, skip_netns_when_refused

ROOT = Path(__file__).resolve().parents[1]
DOWN_AT = 7
STEPS = 14  # tests/_failover_hier_worker.py
TIMEOUT_S = 20.0  # gloo's and deft's timeout in these runs
PRIMARY_TIMEOUT_S = 10.0  # the same where the primary link dies: every rank waits it out
DEADLINE_S = 3.0  # the non-primary link's deadline floor: a wait that long means the link is lost
START_S = 240.0  # torchrun, torch DDP's run and deft's profile on a busy machine, before the NIC goes down

#: every test here runs ranks in the testbed's network namespaces
pytestmark = [pytest.mark.slow, pytest.mark.netns,
              pytest.mark.skipif(not can_netns, reason=NETNS_REASON)]


@pytest.fixture(autouse=True)
def _skip_netns_when_refused(request: pytest.FixtureRequest) -> None:
    skip_netns_when_refused(request)


def _ended(proc: subprocess.Popen[str], by: float) -> str:
    """``proc``'s stderr, once it has ended by the time ``by``; a torchrun still running then is killed and
    the test fails with its stderr (the ranks print every thread's stack shortly before ``by``)."""
    try:
        return proc.communicate(timeout=max(1.0, by - time.time()))[1]
    except subprocess.TimeoutExpired:
        stop_process_group(proc)  # SIGTERM, which torchrun passes on to its ranks
        err = proc.communicate(timeout=10.0)[1]
        raise AssertionError(f"a torchrun was still running at the test's bound:\n{err[-6000:]}") from None


def _run(out: Path, nic: int, bound_s: float, timeout_s: float = TIMEOUT_S
         ) -> tuple[list[dict[str, Any]], list[int], float]:
    """Every rank's report of a 2 x 2 run whose ``nic`` goes down in every host at ``DOWN_AT``, the two
    torchruns' exit statuses, and the seconds from the NIC going down to the last rank's report. Both
    torchruns must have ended ``bound_s`` after the NIC went down; ``timeout_s``: deft's and its groups'."""
    out.chmod(0o755)
    with Testbed(hosts=2, links=2, rate_mbit=250) as tb:
        # planner_nice 0 and the greedy knapsacks: the re-plan on the links left, made in the background, is
        # collected within the run's last iterations on a busy machine (its time is not under test here)
        config = tb.write_config(epsilon=0.0, warmup_iters=1, profile_iters=2, bucket_cap_mb=0.004,
                                 timeout_s=timeout_s, link_deadline_s=DEADLINE_S, planner_nice=0, solver="greedy")
        port = free_port()
        procs = []
        for h in range(2):
            env = tb.env_for(h, rank=2 * h, world=4, port=port, config=config)
            links = {k: env[k] for k in ("GLOO_SOCKET_IFNAME", "DEFT_CONFIG", "OMP_NUM_THREADS")}
            argv = [*tb.torchrun_argv(h, 2, port), "-m", "tests._failover_hier_worker", str(out)]
            env = {**links, "DEFT_TEST_DOWN_AT": str(DOWN_AT), "PYTHONFAULTHANDLER": "1",
                   "DEFT_TEST_DUMP_AFTER_S": str(bound_s - 2.0)}
            procs.append(tb.popen(h, argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
        end = time.monotonic() + START_S
        while not all((out / f"ready{r}").exists() for r in range(4)):
            assert time.monotonic() < end and all(p.poll() is None for p in procs), \
                "the ranks did not reach the iteration where the NIC goes down"
            time.sleep(0.1)
        tb.set_link(nic, up=False)
        down = time.time()
        (out / "go").write_text("down\n", encoding="utf-8")
        errs = [_ended(p, down + bound_s) for p in procs]
    missing = [r for r in range(4) if not (out / f"rank{r}.json").exists()]
    assert not missing, "\n".join(e[-3000:] for e in errs)
    reports = [json.loads((out / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(4)]
    codes = [p.returncode for p in procs]
    # a torchrun that failed after every report was written tells why on its stderr, kept in the test's output
    for h, (code, err) in enumerate(zip(codes, errs, strict=True)):
        if code:
            print(f"torchrun of host {h} exited {code}:\n{err[-6000:]}")
    return reports, codes, max(r["at"] for r in reports) - down


def test_second_nic_down_with_two_ranks_per_host_finishes_with_torch_ddps_parameters(tmp_path: Path) -> None:
    # every rank finished and exited within one timeout_s: none waited out a broadcast that never came, in
    # training or at its exit
    reports, codes, took = _run(tmp_path, nic=1, bound_s=TIMEOUT_S)
    assert codes == [0, 0], reports  # and exited normally, the wrapper closed, the groups destroyed
    assert all((tmp_path / f"closed{r}").exists() for r in range(4))
    assert took < TIMEOUT_S, took
    assert all(r["sums"] == reports[0]["sums"] for r in reports)  # the ranks applied the same updates
    for r in reports:
        assert r["worst"] < 1e-5, r["worst"]
        assert r["merged"] == list(range(STEPS))  # every gradient applied once
        assert [f["link"] for f in r["failures"]] == ["second"], r["failures"]
        rec = r["failures"][0]
        assert DOWN_AT <= rec["iteration"] <= DOWN_AT + 1, rec
        assert rec["links_left"] == ["primary"], rec
        # found within the deadline on every rank: the first ranks in their step across the hosts, the others
        # waiting for their first rank's broadcast
        assert rec["lost_s"] < TIMEOUT_S / 2, rec
        assert ("step 2" if r["rank"] % 2 == 0 else "step 3") in rec["why"], rec
        assert r["links"] == ["primary"]


def test_primary_nic_down_with_two_ranks_per_host_stops_every_rank_with_an_error_naming_it(tmp_path: Path) -> None:
    # every rank stopped within one timeout_s (its wait on the primary link) and a link deadline
    reports, codes, took = _run(tmp_path, nic=0, bound_s=2 * PRIMARY_TIMEOUT_S, timeout_s=PRIMARY_TIMEOUT_S)
    assert 0 not in codes, reports
    assert took < PRIMARY_TIMEOUT_S + DEADLINE_S, took
    for r in reports:
        # every rank's error in full (a str message: pytest shortens a list's repr in the middle)
        assert "'primary'" in r.get("error", ""), "\n".join(str(x.get("error")) for x in reports)
