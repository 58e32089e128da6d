"""The real multi-link testbed: N "hosts" x L links on one machine (docs/DESIGN.md section 6).

Each host is a Linux network namespace with one NIC per link, named ``nic0``, ``nic1``, ... in every
host, so the same ``GLOO_SOCKET_IFNAME`` works on every rank. With two hosts each link is one veth
pair joining them directly; with more hosts each link is a bridge in a separate "switch" namespace
and every host's NIC is a veth whose peer is a bridge port. Every NIC's egress is shaped by
``tc tbf`` to ``rate_mbit`` (preceded by ``netem delay`` when ``delay_ms > 0``), so each direction of
each link carries at most ``rate_mbit`` Mbit/s, like a full-duplex Ethernet link.

Addresses live only inside the namespaces: host ``h`` has ``10.<200+link>.0.<h+1>/24`` on ``nic<link>``,
one subnet per link, so traffic to a link's subnet leaves through that link's NIC and no other.

Safety invariants
-----------------
* Every name carries ``prefix`` and a unique tag (the pid and a per-process counter unless given),
  so parallel runs never collide; veth pairs are created directly inside the namespaces, so nothing
  is ever named or left in the root namespace.
* :meth:`Testbed.down` deletes only the namespaces this object created (deleting a namespace destroys
  the veths and bridges in it) and stops only the processes it started; it is idempotent, and the
  context manager calls it even when the body raises. A failed :meth:`Testbed.up` undoes itself.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypedDict

from deft.errors import DeftError

STATE_DIR = Path("/run/deft")
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_counter = itertools.count()


class _TestbedDescription(TypedDict):
    prefix: str
    tag: str
    hosts: int
    links: int
    rate_mbit: float
    delay_ms: float
    namespaces: list[str]
    addresses: dict[str, dict[str, str]]  # namespace -> NIC -> IPv4 address


class TestbedState(_TestbedDescription, total=False):
    """What ``deft testbed up`` records in its state file (:meth:`Testbed.describe`, plus the config it
    wrote), so that ``down`` and ``status`` can find what it built."""

    config: str  # the deft TOML naming the testbed's NICs


class TestbedError(DeftError):
    """A testbed could not be built or removed (not root, iproute2 missing, a command failed)."""

    __test__ = False  # not a pytest test class despite the name


@dataclass(frozen=True)
class _Cmd:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def _run(argv: Sequence[str], *, check: bool = True) -> _Cmd:
    p = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    res = _Cmd(tuple(argv), p.returncode, p.stdout, p.stderr)
    if check and p.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed (exit {p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return res


def check_prerequisites() -> None:
    """Raise :class:`TestbedError` unless we are root and ``ip`` and ``tc`` (iproute2) are on PATH."""
    if os.geteuid() != 0:
        raise TestbedError(
            "the testbed needs root: it creates network namespaces, veth links and tc qdiscs "
            "(run as root, e.g. with sudo)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise TestbedError(f"the testbed needs iproute2; not found on PATH: {', '.join(missing)}")


def list_namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list``), without their ids."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


#: The largest GSO packet assumed when the device does not say (Linux's default ``gso_max_size``).
DEFAULT_GSO_MAX_BYTES = 65536


def own_cores(hosts: int, cores: int) -> bool:
    """Whether each of ``hosts`` pinned among ``cores`` gets cores of its own (else hosts share one in turn)."""
    return hosts <= cores


def host_cpus(h: int, hosts: int, cpus: Sequence[int]) -> list[int]:
    """The cores host ``h`` of ``hosts`` runs on when its processes are pinned (:meth:`Testbed.popen`):
    ``cpus`` (the machine's, in order) cut into ``hosts`` equal runs, host ``h`` the ``h``-th (any left
    over unused); with more hosts than cores, core ``h mod len(cpus)``, hosts sharing a core in turn."""
    if not cpus:
        raise TestbedError("host_cpus: no core to pin to")
    if not 0 <= h < hosts:
        raise TestbedError(f"host_cpus: host {h} is not one of 0..{hosts - 1}")
    if not own_cores(hosts, len(cpus)):
        return [cpus[h % len(cpus)]]
    each = len(cpus) // hosts
    return list(cpus[h * each:(h + 1) * each])


def taskset_argv(h: int, hosts: int, cpus: Sequence[int]) -> list[str]:
    """The ``taskset`` prefix that runs a process on host ``h``'s cores (:func:`host_cpus`)."""
    return ["taskset", "-c", ",".join(map(str, host_cpus(h, hosts, cpus)))]


def pinning_hint(hosts: int, cpus: Sequence[int]) -> str | None:
    """Each host's ``taskset`` prefix, as :meth:`Testbed.popen` pins (``"host 0: taskset -c 0; host 1:
    ..."``); None where the hosts outnumber ``cpus``, since then no host can have a core of its own."""
    if not own_cores(hosts, len(cpus)):
        return None
    return "; ".join(f"host {h}: {' '.join(taskset_argv(h, hosts, cpus))}" for h in range(hosts))


def tbf_params(rate_mbit: float, gso_bytes: int = DEFAULT_GSO_MAX_BYTES) -> tuple[int, int]:
    """``(burst, limit)`` in bytes of the testbed's ``tc tbf`` at ``rate_mbit`` Mbit/s.

    ``burst`` is the larger of 1 ms of traffic and two of the device's largest GSO packets
    (``gso_bytes``). TCP hands a veth packets of up to ``gso_bytes`` and tbf splits every packet longer
    than its burst into MTU-sized frames in software (``tbf_segment``), each of which then crosses the
    veth and the receiver's stack on its own: with a burst of 1 ms of traffic (31 KB at 250 Mbit/s) a
    large all-reduce costs each rank many times the kernel CPU at the same wall time (measured:
    benchmarks/results/testbed.md). On a machine of few cores that CPU is taken from the model's
    compute exactly when communication overlaps it, an artefact a real NIC (which segments in
    hardware) does not have. The rate still holds over any window longer than a few milliseconds:
    a full bucket lets 2 x 64 KiB through at once, 4 ms of traffic at 250 Mbit/s.

    ``limit`` allows 200 ms of queue (at least 2 MiB), so TCP is throttled by the bucket, not by tail
    drops and their retransmission timeouts, which would make measured times depend on loss recovery.
    """
    if not rate_mbit > 0:
        raise TestbedError(f"rate_mbit: expected > 0, got {rate_mbit!r}")
    if not (isinstance(gso_bytes, int) and gso_bytes > 0):
        raise TestbedError(f"gso_bytes: expected a positive integer, got {gso_bytes!r}")
    rate_bps = rate_mbit * 1e6 / 8
    burst = max(16 * 1024, int(rate_bps * 1e-3), 2 * gso_bytes)
    limit = max(2 * 1024 * 1024, int(rate_bps * 0.2))
    return burst, limit


def gso_max_bytes(ns: str, dev: str) -> int:
    """The largest GSO packet ``dev`` in namespace ``ns`` may be handed (``gso_max_size``, and BIG TCP's
    ``gso_ipv4_max_size`` where the kernel has it), from ``ip -d -j link show``; the Linux default
    when iproute2 does not report it."""
    res = _run(["ip", "-n", ns, "-d", "-j", "link", "show", "dev", dev], check=False)
    try:
        info = json.loads(res.stdout)[0] if res.returncode == 0 else {}
    except (json.JSONDecodeError, IndexError):
        info = {}
    sizes = [v for k in ("gso_max_size", "gso_ipv4_max_size") if isinstance(v := info.get(k), int) and v > 0]
    return max(sizes, default=DEFAULT_GSO_MAX_BYTES)


class Testbed:
    """``hosts`` network namespaces joined by ``links`` shaped links; a context manager.

    >>> with Testbed(hosts=2, links=2, rate_mbit=250) as tb:          # doctest: +SKIP
    ...     p = tb.popen(0, ["python", "train.py"], tb.env_for(0, rank=0, world=2, port=29500))
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, hosts: int = 2, links: int = 2, rate_mbit: float = 250.0, delay_ms: float = 0.0,
                 prefix: str = "deft", tag: str | None = None, burst_bytes: int | None = None) -> None:
        if not isinstance(hosts, int) or not 2 <= hosts <= 250:
            raise TestbedError(f"hosts: expected an integer in [2, 250], got {hosts!r}")
        if not isinstance(links, int) or not 1 <= links <= 55:
            raise TestbedError(f"links: expected an integer in [1, 55] (subnets 10.200-254.0.0/24), got {links!r}")
        if not rate_mbit > 0:
            raise TestbedError(f"rate_mbit: expected > 0, got {rate_mbit!r}")
        if not delay_ms >= 0:
            raise TestbedError(f"delay_ms: expected >= 0, got {delay_ms!r}")
        if burst_bytes is not None and not (isinstance(burst_bytes, int) and burst_bytes >= 2048):
            raise TestbedError(f"burst_bytes: expected an integer >= 2048 (above one frame) or None, "
                               f"got {burst_bytes!r}")
        if not _PREFIX_RE.match(prefix):
            raise TestbedError(f"prefix: expected 1-12 lowercase letters/digits starting with a letter, got {prefix!r}")
        if tag is None:
            n = next(_counter)
            tag = f"{os.getpid()}" if n == 0 else f"{os.getpid()}x{n}"
        if not re.match(r"^[a-z0-9]{1,16}$", tag):
            raise TestbedError(f"tag: expected 1-16 lowercase letters/digits, got {tag!r}")
        self.hosts = hosts
        self.links = links
        self.rate_mbit = float(rate_mbit)
        self.delay_ms = float(delay_ms)
        #: tbf burst in bytes; None: :func:`tbf_params`'s (set only to reproduce an older testbed)
        self.burst_bytes = burst_bytes
        self.prefix = prefix
        self.tag = tag
        self.base = f"{prefix}-{tag}"
        self._made: list[str] = []  # namespaces this object created, in creation order
        self._procs: list[subprocess.Popen[Any]] = []
        self._tmpdir: str | None = None
        self._is_up = False

    # -- names and addresses -------------------------------------------------------------------
    def host_ns(self, h: int) -> str:
        """The network namespace of host ``h``."""
        self._check_host(h)
        return f"{self.base}-h{h}"

    @property
    def switch_ns(self) -> str | None:
        """The namespace holding one bridge per link (only with more than two hosts)."""
        return f"{self.base}-sw" if self.hosts > 2 else None

    @property
    def namespaces(self) -> list[str]:
        names = [self.host_ns(h) for h in range(self.hosts)]
        return [*names, self.switch_ns] if self.switch_ns else names

    def ifname(self, link: int) -> str:
        """The NIC of ``link`` (the same name in every host)."""
        self._check_link(link)
        return f"nic{link}"

    def addr(self, h: int, link: int) -> str:
        """Host ``h``'s IPv4 address on ``link`` (no prefix length)."""
        self._check_host(h)
        self._check_link(link)
        return f"10.{200 + link}.0.{h + 1}"

    def _check_host(self, h: int) -> None:
        if not 0 <= h < self.hosts:
            raise TestbedError(f"host {h} out of range: the testbed has hosts 0..{self.hosts - 1}")

    def _check_link(self, link: int) -> None:
        if not 0 <= link < self.links:
            raise TestbedError(f"link {link} out of range: the testbed has links 0..{self.links - 1}")

    # -- build and remove ----------------------------------------------------------------------
    def up(self) -> Testbed:
        """Create the namespaces, links, addresses and shaping. Idempotent; undoes itself on failure."""
        if self._is_up:
            return self
        check_prerequisites()
        existing = set(list_namespaces())
        clash = [ns for ns in self.namespaces if ns in existing]
        if clash:
            raise TestbedError(
                f"namespace {clash[0]} already exists (another testbed with tag {self.tag!r}?); "
                f"remove it with `deft testbed down --prefix {self.prefix}` or `ip netns del {clash[0]}`"
            )
        try:
            for ns in self.namespaces:
                _run(["ip", "netns", "add", ns])
                self._made.append(ns)
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.switch_ns is None:
                a, b = self.host_ns(0), self.host_ns(1)
                for link in range(self.links):
                    nic = self.ifname(link)
                    _run(["ip", "link", "add", nic, "netns", a, "type", "veth", "peer", "name", nic, "netns", b])
            else:
                sw = self.switch_ns
                for link in range(self.links):
                    br = f"br{link}"
                    _run(["ip", "-n", sw, "link", "add", br, "type", "bridge"])
                    _run(["ip", "-n", sw, "link", "set", br, "up"])
                    for h in range(self.hosts):
                        port = f"h{h}l{link}"
                        _run(["ip", "link", "add", self.ifname(link), "netns", self.host_ns(h), "type", "veth",
                              "peer", "name", port, "netns", sw])
                        _run(["ip", "-n", sw, "link", "set", port, "master", br])
                        _run(["ip", "-n", sw, "link", "set", port, "up"])
                        # the switch port shapes traffic towards the host, as a real switch port would
                        self._shape(sw, port)
            for h in range(self.hosts):
                ns = self.host_ns(h)
                for link in range(self.links):
                    nic = self.ifname(link)
                    _run(["ip", "-n", ns, "addr", "add", f"{self.addr(h, link)}/24", "dev", nic])
                    _run(["ip", "-n", ns, "link", "set", nic, "up"])
                    self._shape(ns, nic)
        except BaseException:
            self.down()
            raise
        self._is_up = True
        return self

    def _shape(self, ns: str, dev: str, rate_mbit: float | None = None, *, replace: bool = False) -> None:
        """tbf at ``rate_mbit`` (the testbed's rate unless given) on the egress of ``dev``; netem delay in
        front of it if asked. ``replace``: swap the root qdisc of a shaped NIC (no netem delay then).

        The tbf parameters are :func:`tbf_params`'s, with the device's largest GSO packet read from it.
        """
        rate = self.rate_mbit if rate_mbit is None else float(rate_mbit)
        burst, limit = tbf_params(rate, gso_max_bytes(ns, dev))
        if self.burst_bytes is not None:
            burst = self.burst_bytes
        tbf = ["tbf", "rate", f"{rate:g}mbit", "burst", str(burst), "limit", str(limit)]
        if replace:
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", *tbf])
        elif self.delay_ms > 0:
            res = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                        "delay", f"{self.delay_ms:g}ms", "limit", "100000"], check=False)
            if res.returncode != 0:
                hint = " (the sch_netem kernel module is missing; use delay_ms=0)" \
                    if "unknown" in res.stderr.lower() else ""
                raise TestbedError(f"cannot add netem delay on {ns}/{dev}{hint}: {res.stderr.strip()}")
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
        else:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])

    def reshape(self, link: int, rate_mbit: float) -> None:
        """Shape ``link`` to ``rate_mbit`` on every host (and switch port) instead of the testbed's rate.

        Replaces the root qdisc, so it is refused on a testbed with a netem delay (the delay would go).
        """
        self._check_link(link)
        if not rate_mbit > 0:
            raise TestbedError(f"rate_mbit: expected > 0, got {rate_mbit!r}")
        if self.delay_ms > 0:
            raise TestbedError("reshape: not supported with delay_ms > 0 (it replaces the netem qdisc)")
        if not self._is_up:
            raise TestbedError("reshape: the testbed is not up")
        for h in range(self.hosts):
            self._shape(self.host_ns(h), self.ifname(link), rate_mbit, replace=True)
            if self.switch_ns is not None:
                self._shape(self.switch_ns, f"h{h}l{link}", rate_mbit, replace=True)

    def set_link(self, link: int, up: bool, hosts: list[int] | None = None) -> None:
        """Take ``link``'s NIC down (or back up) in ``hosts`` (default: every host), as
        ``ip link set nic<link> down`` would on a machine: its traffic stops, its address stays."""
        self._check_link(link)
        if not self._is_up:
            raise TestbedError("set_link: the testbed is not up")
        for h in range(self.hosts) if hosts is None else hosts:
            self._check_host(h)
            _run(["ip", "-n", self.host_ns(h), "link", "set", self.ifname(link), "up" if up else "down"])

    def down(self) -> None:
        """Stop the processes started here, delete the namespaces made here. Idempotent, never partial.

        Every step is attempted even if an earlier one fails; the first failure is raised at the end.
        """
        errors: list[str] = []
        for p in self._procs:
            with contextlib.suppress(Exception):
                stop_process_group(p)
        self._procs.clear()
        present = set(list_namespaces()) if self._made and shutil.which("ip") else set()
        for ns in reversed(self._made):
            if ns not in present:
                continue
            res = _run(["ip", "netns", "del", ns], check=False)
            if res.returncode != 0 and "No such file" not in res.stderr:
                errors.append(f"ip netns del {ns}: {res.stderr.strip()}")
        self._made.clear()
        self._is_up = False
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if errors:
            raise TestbedError("testbed teardown incomplete: " + "; ".join(errors))

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.down()

    # -- running ranks -------------------------------------------------------------------------
    def link_names(self) -> list[str]:
        """deft link names: ``primary`` for link 0, ``second`` for link 1, ``link<i>`` beyond."""
        return ["primary", "second", *[f"link{i}" for i in range(2, self.links)]][: self.links]

    def config_toml(self, links: int | None = None, **settings: float | int | bool | str) -> str:
        """A deft config (TOML) whose links are this testbed's NICs, plus any scalar ``settings``.

        Link 0 (``primary``) keeps ``backend = "auto"`` (NCCL on CUDA, gloo on CPU); the others are gloo.
        """
        n = self.links if links is None else links
        if not 1 <= n <= self.links:
            raise TestbedError(f"links: expected 1..{self.links}, got {n}")
        lines = [f"{k} = {_toml_scalar(v)}" for k, v in settings.items()]
        for i, name in enumerate(self.link_names()[:n]):
            lines += ["", "[[links]]", f'name = "{name}"']
            if i > 0:
                lines.append('backend = "gloo"')
            lines.append(f'ifname = "{self.ifname(i)}"')
        return "\n".join(lines) + "\n"

    def write_config(self, path: str | Path | None = None, links: int | None = None,
                     **settings: float | int | bool | str) -> Path:
        """Write :meth:`config_toml` to ``path`` (default: a file in a directory removed by ``down``)."""
        if path is None:
            if self._tmpdir is None:
                self._tmpdir = tempfile.mkdtemp(prefix=f"{self.base}-")
            path = Path(self._tmpdir) / f"deft-{links or self.links}links.toml"
        p = Path(path)
        p.write_text(self.config_toml(links, **settings), encoding="utf-8")
        return p

    def env_for(self, h: int, rank: int, world: int, port: int, config: str | Path | None = None,
                local_rank: int = 0, local_world: int = 1) -> dict[str, str]:
        """Environment for one rank on host ``h``, as torchrun would set it, plus link selection.

        The default process group rendezvouses at host 0's link-0 address and binds to ``nic0``
        (``GLOO_SOCKET_IFNAME``); ``DEFT_CONFIG`` names a deft config whose links are ``nic0``
        (primary) and ``nic1``... (gloo): the runtime sets ``GLOO_SOCKET_IFNAME`` to each link's NIC
        before creating that link's group. ``local_rank`` of ``local_world`` ranks on the host: torchrun's
        ``--nproc-per-node``. Ranks of one host reach each other at the host's own addresses, which the
        kernel routes over the namespace's loopback: their traffic never crosses a shaped NIC. Only
        these variables are returned; :meth:`popen` adds them to the current environment.
        """
        self._check_host(h)
        if not 0 <= rank < world:
            raise TestbedError(f"rank {rank} out of range for world size {world}")
        if not 0 <= local_rank < local_world:
            raise TestbedError(f"local rank {local_rank} out of range for {local_world} ranks per host")
        cfg = Path(config) if config is not None else self.write_config()
        return {
            "MASTER_ADDR": self.addr(0, 0),
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world),
            "GROUP_RANK": str(h),
            "GLOO_SOCKET_IFNAME": self.ifname(0),
            "DEFT_CONFIG": str(cfg),
            "OMP_NUM_THREADS": "1",
        }

    def torchrun_argv(self, h: int, nproc_per_node: int, port: int) -> list[str]:
        """torchrun's multi-node launch on host ``h``: ``--nnodes`` the testbed's hosts, ``--node-rank h``,
        ``nproc_per_node`` ranks, the rendezvous at host 0's link-0 address; append the script and its
        arguments. torchrun sets each rank's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``; the links' variables
        (``GLOO_SOCKET_IFNAME``, ``DEFT_CONFIG``) come from :meth:`env_for` as for a rank started alone."""
        self._check_host(h)
        if not (isinstance(nproc_per_node, int) and nproc_per_node >= 1):
            raise TestbedError(f"nproc_per_node: expected an integer >= 1, got {nproc_per_node!r}")
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.hosts),
                "--nproc-per-node", str(nproc_per_node), "--node-rank", str(h),
                "--master-addr", self.addr(0, 0), "--master-port", str(port)]

    def popen(self, h: int, argv: Sequence[str], env: Mapping[str, str] | None = None, pin: bool = False,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``h``'s namespace (``ip netns exec``) with ``env`` added to ours;
        ``pin``: on host ``h``'s cores only (:func:`host_cpus`, ``taskset``), as a real host's processes run
        on that host's cores and no other host's.

        The process leads its own process group (``start_new_session``) so :meth:`down` can stop it and
        its children by id.
        """
        if pin and shutil.which("taskset") is None:
            raise TestbedError("popen(pin=True) runs the host's processes under taskset (util-linux), which is "
                               "not on PATH: install util-linux, or start them unpinned")
        if not self._is_up:
            raise TestbedError("the testbed is not up: call up() or use it as a context manager")
        full_env = {**os.environ, **(env or {})}
        taskset = taskset_argv(h, self.hosts, sorted(os.sched_getaffinity(0))) if pin else []
        p = subprocess.Popen(["ip", "netns", "exec", self.host_ns(h), *taskset, *argv], env=full_env,
                             start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    def run(self, h: int, argv: Sequence[str], timeout: float = 30.0) -> str:
        """Run a short command in host ``h`` and return its stdout (raises on failure)."""
        if not self._is_up:
            raise TestbedError("the testbed is not up: call up() or use it as a context manager")
        try:
            p = subprocess.run(["ip", "netns", "exec", self.host_ns(h), *argv], capture_output=True, text=True,
                               timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise TestbedError(f"`{' '.join(argv)}` in {self.host_ns(h)} timed out after {timeout} s") from None
        if p.returncode != 0:
            raise TestbedError(f"`{' '.join(argv)}` in {self.host_ns(h)} failed: {p.stderr.strip()}")
        return p.stdout

    # -- description ---------------------------------------------------------------------------
    def describe(self) -> TestbedState:
        return {
            "prefix": self.prefix, "tag": self.tag, "hosts": self.hosts, "links": self.links,
            "rate_mbit": self.rate_mbit, "delay_ms": self.delay_ms, "namespaces": self.namespaces,
            "addresses": {self.host_ns(h): {self.ifname(k): self.addr(h, k) for k in range(self.links)}
                          for h in range(self.hosts)},
        }

    @classmethod
    def adopt(cls, state: TestbedState) -> Testbed:
        """Rebuild the object for a testbed that ``deft testbed up`` made, so it can be taken down."""
        tb = cls(hosts=int(state["hosts"]), links=int(state["links"]), rate_mbit=float(state["rate_mbit"]),
                 delay_ms=float(state["delay_ms"]), prefix=str(state["prefix"]), tag=str(state["tag"]))
        tb._made = [ns for ns in state["namespaces"] if ns in tb.namespaces]
        tb._is_up = True
        return tb


def _toml_scalar(v: float | int | bool | str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)


def stop_process_group(p: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """SIGTERM the process group of ``p`` (started with ``start_new_session``; a torchrun passes the signal
    on to its ranks, which it started in process groups of their own), SIGKILL after ``grace_s``."""
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=grace_s)


# -- `deft testbed up|down|status` -------------------------------------------------------------
def _state_path(prefix: str) -> Path:
    return STATE_DIR / f"testbed-{prefix}.json"


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("up", "down", "status"),
                        help="up: build and leave running; down: remove what `up` built; status: show it")
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (network namespaces), default 2")
    parser.add_argument("--links", type=int, default=2, help="links (NICs per host), default 2")
    parser.add_argument("--rate-mbit", type=float, default=250.0, help="tbf rate of every NIC, default 250")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="netem delay per NIC, default 0")
    parser.add_argument("--prefix", default="deft", help="name prefix of everything made, default 'deft'")


def run(name: str, args: argparse.Namespace) -> int:
    path = _state_path(args.prefix)
    if args.action == "up":
        if path.exists():
            raise TestbedError(f"a testbed with prefix {args.prefix!r} is already up ({path}); "
                               f"run `deft testbed down --prefix {args.prefix}` first")
        tb = Testbed(hosts=args.hosts, links=args.links, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms,
                     prefix=args.prefix, tag="cli").up()
        state = tb.describe()
        try:
            STATE_DIR.mkdir(parents=True, exist_ok=True)
            state["config"] = str(tb.write_config(STATE_DIR / f"testbed-{args.prefix}.toml"))
            path.write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
        except BaseException:
            tb.down()
            raise
        _print_state(state)
        cpus = sorted(os.sched_getaffinity(0))
        pins = pinning_hint(tb.hosts, cpus)
        # a real host's processes never run on another host's cores (benchmarks/results/prices_pinned.md)
        taskset = " ".join(taskset_argv(0, tb.hosts, cpus)) + " " if pins else ""
        print(f"run rank r of {tb.hosts} on host r with: ip netns exec {tb.host_ns(0)} {taskset}env RANK=0 "
              f"WORLD_SIZE={tb.hosts} MASTER_ADDR={tb.addr(0, 0)} MASTER_PORT=29500 "
              f"GLOO_SOCKET_IFNAME={tb.ifname(0)} DEFT_CONFIG={state['config']} python train.py ...")
        print(f"each host's processes on its own cores, as on real hosts: {pins}" if pins else
              f"{tb.hosts} hosts on {len(cpus)} cores: hosts share cores, so timings measure the CPU as much as "
              "the links")
        print(f"remove with: deft testbed down --prefix {args.prefix}")
        return 0
    if args.action == "down":
        if not path.exists():
            print(f"no testbed with prefix {args.prefix!r} is up (no {path}); nothing to do")
            return 0
        state = _read_state(path)
        check_prerequisites()
        Testbed.adopt(state).down()
        if state.get("config"):
            Path(state["config"]).unlink(missing_ok=True)
        path.unlink()
        print(f"removed {', '.join(state['namespaces'])}")
        return 0
    # status
    if not path.exists():
        print(f"no testbed with prefix {args.prefix!r} is up (no {path})")
        return 0
    state = _read_state(path)
    _print_state(state)
    present = set(list_namespaces()) if shutil.which("ip") else set()
    missing = [ns for ns in state["namespaces"] if ns not in present]
    for ns in state["namespaces"]:
        if ns in present:
            qd = _run(["tc", "-n", ns, "qdisc", "show"], check=False).stdout.strip().splitlines()
            for line in qd:
                if "noqueue" not in line:
                    print(f"  {ns}: {line.strip()}")
    if missing:
        print(f"warning: namespaces missing: {', '.join(missing)}")
        return 1
    return 0


def _read_state(path: Path) -> TestbedState:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TestbedError(f"{path}: cannot read testbed state: {e}") from None
    for key in ("prefix", "tag", "hosts", "links", "rate_mbit", "delay_ms", "namespaces"):
        if key not in state:
            raise TestbedError(f"{path}: {key}: missing from testbed state")
    return state


def _print_state(state: TestbedState) -> None:
    print(f"testbed {state['prefix']}-{state['tag']}: {state['hosts']} hosts x {state['links']} links at "
          f"{state['rate_mbit']:g} Mbit/s" + (f", {state['delay_ms']:g} ms delay" if state["delay_ms"] else ""))
    for ns, addrs in state.get("addresses", {}).items():
        print(f"  {ns}: " + ", ".join(f"{k}={v}" for k, v in addrs.items()))
    if state.get("config"):
        print(f"  deft config (links on these NICs): {state['config']}")
