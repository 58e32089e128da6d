"""The network-namespace testbed: build, reach every link, shaping holds, teardown leaves nothing."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deft import testbed as testbed_mod
from deft.config import DeftConfig
from deft.errors import DeftError
from deft.testbed import Testbed, TestbedError, host_cpus, list_namespaces, pinning_hint, taskset_argv
from tests._netns import NETNS_REASON, can_netns, skip_netns_when_refused


@pytest.fixture(autouse=True)
def _skip_netns_when_refused(request: pytest.FixtureRequest) -> None:
    skip_netns_when_refused(request)


# A receiver that acknowledges with one byte once it has all the bytes: the sender's clock then
# covers the whole transfer through the shaped link, not just filling its socket buffer.
SERVER = textwrap.dedent("""
    import socket, sys
    addr, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); got = 0
    while got < nbytes:
        chunk = c.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    c.sendall(b"k" if got == nbytes else b"x"); c.close()
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    addr, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for _ in range(100):
        try:
            c = socket.create_connection((addr, port), timeout=10); break
        except OSError:
            time.sleep(0.05)
    t0 = time.perf_counter(); c.sendall(b"\\0" * nbytes); ack = c.recv(1)
    print(f"{ack.decode()} {time.perf_counter() - t0:.6f}")
""")


def transfer(tb: Testbed, src: int, dst: int, link: int, nbytes: int, port: int) -> float:
    """Seconds to send ``nbytes`` from host ``src`` to host ``dst`` over ``link`` (TCP, acknowledged)."""
    server = tb.popen(dst, [sys.executable, "-c", SERVER, tb.addr(dst, link), str(port), str(nbytes)],
                      stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "ready"
    out = tb.run(src, [sys.executable, "-c", CLIENT, tb.addr(dst, link), str(port), str(nbytes)], timeout=60)
    server.wait(timeout=10)
    ack, seconds = out.split()
    assert ack == "k", f"receiver got a wrong byte count on link {link}"
    return float(seconds)


def leftovers(tb: Testbed) -> list[str]:
    present = set(list_namespaces())
    return [ns for ns in tb.namespaces if ns in present]


@pytest.mark.parametrize(("kwargs", "problem"), [
    ({"hosts": 1}, "hosts"), ({"links": 0}, "links"), ({"links": 56}, "links"), ({"rate_mbit": 0}, "rate_mbit"),
    ({"delay_ms": -1}, "delay_ms"), ({"prefix": "Bad Prefix"}, "prefix"), ({"tag": "a/b"}, "tag"),
    ({"burst_bytes": 100}, "burst_bytes"),
])
def test_bad_arguments_name_the_field(kwargs: dict[str, object], problem: str) -> None:
    with pytest.raises(DeftError, match=problem):
        Testbed(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("rate_mbit", "gso", "burst", "limit"), [
    # 250 Mbit/s = 31.25 MB/s: 1 ms is 31 250 B, below two 64 KiB GSO packets; 200 ms of queue 6.25 MB
    (250, 65536, 131072, 6_250_000),
    (1000, 65536, 131072, 25_000_000),        # 1 ms = 125 000 B, still below 131 072
    (10_000, 65536, 1_250_000, 250_000_000),  # 10 Gbit/s: 1 ms = 1.25 MB wins
    (1, 65536, 131072, 2 * 1024 * 1024),      # the 2 MiB queue floor
    (1, 4096, 16384, 2 * 1024 * 1024),        # 1 ms = 125 B, 2 GSO = 8 KiB: the 16 KiB burst floor
    (250, 196608, 393216, 6_250_000),         # BIG TCP: twice the device's larger GSO packet
])
def test_tbf_burst_holds_two_gso_packets(rate_mbit: float, gso: int, burst: int, limit: int) -> None:
    assert testbed_mod.tbf_params(rate_mbit, gso) == (burst, limit)


def test_tbf_params_reject_bad_input() -> None:
    with pytest.raises(TestbedError, match="rate_mbit"):
        testbed_mod.tbf_params(0)
    with pytest.raises(TestbedError, match="gso_bytes"):
        testbed_mod.tbf_params(250, 0)


def test_not_root_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testbed_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="needs root"):
        Testbed().up()


def test_missing_iproute2_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testbed_mod.os, "geteuid", lambda: 0)
    monkeypatch.setattr(testbed_mod.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(TestbedError, match=r"iproute2.*tc"):
        Testbed().up()


def test_pinning_without_taskset_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    tb = Testbed(hosts=2, links=1, rate_mbit=100)  # not up: the check comes before anything is started
    monkeypatch.setattr(testbed_mod.shutil, "which", lambda tool: None if tool == "taskset" else f"/usr/bin/{tool}")
    with pytest.raises(TestbedError, match=r"taskset \(util-linux\).*not on PATH"):
        tb.popen(0, [sys.executable, "-c", "pass"], pin=True)


def test_names_addresses_env_and_config_need_no_root() -> None:
    a, b = Testbed(), Testbed()
    assert a.base != b.base and str(os.getpid()) in a.base  # unique per object and per process
    assert a.host_ns(1).startswith("deft-") and a.ifname(1) == "nic1"
    assert a.addr(0, 0) == "10.200.0.1" and a.addr(1, 1) == "10.201.0.2"
    with pytest.raises(TestbedError, match="host 2 out of range"):
        a.addr(2, 0)
    env = a.env_for(1, rank=1, world=2, port=29511)
    assert env["MASTER_ADDR"] == "10.200.0.1" and env["GLOO_SOCKET_IFNAME"] == "nic0"
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["MASTER_PORT"] == "29511"
    cfg = DeftConfig.load(env["DEFT_CONFIG"])
    assert [(lk.name, lk.backend, lk.ifname) for lk in cfg.links] == [
        ("primary", "auto", "nic0"), ("second", "gloo", "nic1")]
    one = DeftConfig.load(a.write_config(links=1, epsilon=0.0, preserver=False))
    assert one.link_names == ("primary",) and one.epsilon == 0.0 and one.preserver is False
    a.down()  # never up: removes only its temporary config directory
    assert not Path(env["DEFT_CONFIG"]).exists()


@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_two_hosts_reach_each_link_shaped_and_teardown_is_clean() -> None:
    rate_mbit, nbytes = 50.0, 2_000_000
    tb = Testbed(hosts=2, links=2, rate_mbit=rate_mbit)
    with tb:
        assert tb.up() is tb  # idempotent
        assert leftovers(tb) == tb.namespaces
        for link in range(2):
            qdisc = tb.run(0, ["tc", "qdisc", "show", "dev", tb.ifname(link)])
            assert "tbf" in qdisc and "50Mbit" in qdisc
            # each link is its own subnet: the route to the peer leaves through that link's NIC
            route = tb.run(0, ["ip", "route", "get", tb.addr(1, link)])
            assert f"dev {tb.ifname(link)}" in route
        expected = nbytes * 8 / (rate_mbit * 1e6)  # 0.32 s of payload; headers add ~3 %
        # tbf lets its burst through at once (up to ~0.5 MB where the kernel has BIG TCP): only the rest
        # waits on the rate
        burst = json.loads(tb.run(0, ["tc", "-j", "qdisc", "show", "dev", tb.ifname(0)]))[0]["options"]["burst"]
        shaped = (nbytes - burst) * 8 / (rate_mbit * 1e6)
        for link in range(2):
            seconds = transfer(tb, 0, 1, link, nbytes, port=29400 + link)
            assert 0.9 * shaped < seconds < 1.8 * expected, (link, seconds, shaped, expected)
        # the reverse direction is shaped too (each end shapes its own egress)
        seconds = transfer(tb, 1, 0, 1, nbytes, port=29402)
        assert 0.9 * shaped < seconds < 1.8 * expected
        # tbf passes TCP's GSO packets whole: its burst (what tc reports) holds the device's largest GSO
        # packet with its per-frame headers (~4 %); a smaller burst makes tbf split every packet into
        # 1500-byte frames in software, ~15x the CPU per byte (benchmarks/results/testbed.md)
        for link in range(2):
            dev = tb.ifname(link)
            qd = json.loads(tb.run(0, ["tc", "-j", "qdisc", "show", "dev", dev]))[0]
            gso = json.loads(tb.run(0, ["ip", "-d", "-j", "link", "show", "dev", dev]))[0]["gso_max_size"]
            assert qd["kind"] == "tbf" and qd["options"]["burst"] > 1.1 * gso, (qd, gso)
    assert leftovers(tb) == []
    tb.down()  # idempotent after teardown


def test_each_host_gets_its_share_of_the_cores_or_one_in_turn() -> None:
    assert [host_cpus(h, 2, [0, 1]) for h in range(2)] == [[0], [1]]
    assert [host_cpus(h, 2, [0, 1, 2, 3, 4]) for h in range(2)] == [[0, 1], [2, 3]]  # core 4 left unused
    assert [host_cpus(h, 8, [0, 1]) for h in range(8)] == [[0], [1]] * 4
    with pytest.raises(TestbedError, match=r"host 2 is not one of 0\.\.1"):
        host_cpus(2, 2, [0, 1])
    with pytest.raises(TestbedError, match="no core"):
        host_cpus(0, 2, [])


def test_the_pinning_hint_gives_each_host_its_cores_or_none_where_hosts_outnumber_them() -> None:
    assert pinning_hint(2, [0, 1]) == "host 0: taskset -c 0; host 1: taskset -c 1"
    assert pinning_hint(2, [0, 1, 2, 3]) == "host 0: taskset -c 0,1; host 1: taskset -c 2,3"
    assert pinning_hint(4, [0, 1]) is None
    assert taskset_argv(1, 2, [4, 5, 6, 7]) == ["taskset", "-c", "6,7"]  # the machine's cores, not 0..n-1


@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for each of the two hosts")
def test_cli_up_says_how_to_run_each_host_on_its_own_core(capsys: pytest.CaptureFixture[str]) -> None:
    prefix = f"p{os.getpid() % 100000}"
    parser = argparse.ArgumentParser()
    testbed_mod.add_arguments("testbed", parser)

    def cli(*argv: str) -> int:
        return testbed_mod.run("testbed", parser.parse_args([*argv, "--prefix", prefix]))

    try:
        assert cli("up") == 0
        out = capsys.readouterr().out
    finally:
        assert cli("down") == 0
    cpus = sorted(os.sched_getaffinity(0))
    assert f"ip netns exec {prefix}-cli-h0 taskset -c {cpus[0]}" in out
    assert f"each host's processes on its own cores, as on real hosts: host 0: taskset -c {cpus[0]}" in out
    assert f"host 1: taskset -c {cpus[len(cpus) // 2]}" in out  # host 1's share starts half way through the cores


@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_a_pinned_process_runs_on_its_hosts_cores_only() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    with Testbed(hosts=2, links=1, rate_mbit=100) as tb:
        outs = []
        for h in range(2):
            p = tb.popen(h, [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], pin=True,
                         stdout=subprocess.PIPE, text=True)
            out, _ = p.communicate(timeout=60)
            outs.append(json.loads(out))
        free = tb.popen(0, [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                        stdout=subprocess.PIPE, text=True)
        unpinned = json.loads(free.communicate(timeout=60)[0])
    assert outs == [host_cpus(h, 2, cpus) for h in range(2)]
    assert unpinned == cpus


@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_teardown_on_error_and_of_started_processes() -> None:
    tb = Testbed(hosts=2, links=1, rate_mbit=100)
    with pytest.raises(RuntimeError, match="boom"), tb:
        p = tb.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
        raise RuntimeError("boom")
    assert leftovers(tb) == []
    assert p.poll() is not None  # the process it started was stopped


def test_reshape_refuses_what_it_cannot_do() -> None:
    tb = Testbed(hosts=2, links=2, rate_mbit=100)
    with pytest.raises(TestbedError, match="not up"):
        tb.reshape(1, 50)
    with pytest.raises(TestbedError, match="link 2 out of range"):
        tb.reshape(2, 50)
    with pytest.raises(TestbedError, match="rate_mbit"):
        tb.reshape(1, 0)
    with pytest.raises(TestbedError, match="delay_ms"):
        Testbed(hosts=2, links=2, rate_mbit=100, delay_ms=5).reshape(1, 50)


@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_reshape_one_link_leaves_the_other() -> None:
    with Testbed(hosts=2, links=2, rate_mbit=200) as tb:
        tb.reshape(1, 50)
        for h in range(2):
            rates = {link: json.loads(tb.run(h, ["tc", "-j", "qdisc", "show", "dev", tb.ifname(link)]))[0]
                     for link in range(2)}
            # tc reports the rate in bytes per second: 200 and 50 Mbit/s
            assert rates[0]["options"]["rate"] == 25_000_000 and rates[1]["options"]["rate"] == 6_250_000
            # the same GSO-sized burst as at construction: it holds the device's GSO packet with headers
            gso = json.loads(tb.run(h, ["ip", "-d", "-j", "link", "show", "dev", tb.ifname(1)]))[0]["gso_max_size"]
            assert rates[1]["options"]["burst"] > 1.1 * gso
        # tbf lets its burst (a bucket full of tokens) through at once: only the rest waits on the rate
        nbytes, burst = 2_000_000, rates[1]["options"]["burst"]
        shaped = (nbytes - burst) * 8 / 50e6  # ~0.3 s of payload at the new rate
        seconds = transfer(tb, 0, 1, 1, nbytes, port=29420)
        assert 0.9 * shaped < seconds < 1.8 * nbytes * 8 / 50e6, (seconds, shaped, burst)


@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_a_link_taken_down_stops_its_traffic_and_comes_back() -> None:
    with Testbed(hosts=2, links=2, rate_mbit=200) as tb:
        tb.set_link(1, up=False)
        for h in range(2):
            state = {link: json.loads(tb.run(h, ["ip", "-j", "link", "show", "dev", tb.ifname(link)]))[0]["operstate"]
                     for link in range(2)}
            assert state == {0: "UP", 1: "DOWN"}
        connect = f"import socket; socket.create_connection(({tb.addr(1, 1)!r}, 29431), timeout=2)"
        with pytest.raises(TestbedError, match=r"unreachable|timed out"):  # nothing crosses the link that is down
            tb.run(0, [sys.executable, "-c", connect])
        tb.set_link(1, up=True)
        transfer(tb, 0, 1, 1, 100_000, port=29430)  # and everything again once it is back
        with pytest.raises(TestbedError, match="host 2 out of range"):
            tb.set_link(1, up=False, hosts=[2])
    with pytest.raises(TestbedError, match="not up"):
        tb.set_link(0, up=False)


@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_three_hosts_through_a_bridge_per_link() -> None:
    with Testbed(hosts=3, links=2, rate_mbit=200) as tb:
        assert tb.switch_ns is not None and tb.switch_ns in list_namespaces()
        for link in range(2):  # host 0 reaches host 2 through the bridge: every byte arrives (checked in transfer)
            transfer(tb, 0, 2, link, 100_000, port=29410 + link)
    assert leftovers(tb) == []


@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_cli_up_status_down(capsys: pytest.CaptureFixture[str]) -> None:
    prefix = f"t{os.getpid() % 100000}"
    parser = argparse.ArgumentParser()
    testbed_mod.add_arguments("testbed", parser)

    def cli(*argv: str) -> int:
        return testbed_mod.run("testbed", parser.parse_args([*argv, "--prefix", prefix, "--links", "2"]))

    try:
        assert cli("up") == 0
        names = [f"{prefix}-cli-h0", f"{prefix}-cli-h1"]
        assert set(names) <= set(list_namespaces())
        with pytest.raises(TestbedError, match="already up"):
            cli("up")
        assert cli("status") == 0
        out = capsys.readouterr().out
        assert "250Mbit" in out
        config = Path(f"/run/deft/testbed-{prefix}.toml")
        assert str(config) in out and DeftConfig.load(config).link_names == ("primary", "second")
    finally:
        assert cli("down") == 0
    assert not set(names) & set(list_namespaces())
    assert not config.exists()
    assert cli("down") == 0  # nothing left: a no-op
    assert "nothing to do" in capsys.readouterr().out


@pytest.fixture(scope="module")
def netem_missing() -> bool:
    """Whether this kernel lacks sch_netem, probed with tc in a scratch namespace (not through deft)."""
    probe = f"deftnetem{os.getpid()}"
    subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=True)
    try:
        subprocess.run(["ip", "-n", probe, "link", "set", "lo", "up"], capture_output=True, check=True)
        res = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                             capture_output=True, text=True, check=False)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return res.returncode != 0 and "unknown" in res.stderr.lower()


@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_delay_builds_a_netem_qdisc(netem_missing: bool) -> None:
    if netem_missing:
        pytest.skip("this kernel has no sch_netem module: a delayed link cannot be built here")
    tb = Testbed(hosts=2, links=1, rate_mbit=100, delay_ms=5)
    tb.up()
    try:
        assert "netem" in tb.run(0, ["tc", "qdisc", "show", "dev", "nic0"])
    finally:
        tb.down()
    assert leftovers(tb) == []


@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_delay_without_netem_fails_clearly_and_cleans_up(netem_missing: bool) -> None:
    if not netem_missing:
        pytest.skip("this kernel has sch_netem: the missing-module error cannot be provoked here")
    tb = Testbed(hosts=2, links=1, rate_mbit=100, delay_ms=5)
    with pytest.raises(TestbedError, match=r"sch_netem kernel module is missing; use delay_ms=0"):
        tb.up()
    assert leftovers(tb) == []
