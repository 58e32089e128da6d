"""Links: one process group per configured link, each optionally bound to its own NIC.

* CUDA: the first link is NCCL (``NCCL_SOCKET_IFNAME`` selects its NIC), the others gloo. A gloo
  all-reduce of a CUDA tensor is staged through pinned host memory by torch itself
  (``AsyncAllreduceCUDAHostWork`` in torch/csrc/distributed/c10d/ProcessGroupGlooCuda.cpp): at launch
  a side stream waits for the caller's stream and starts the device-to-host copy into a pinned
  buffer; gloo's worker thread synchronizes that stream, all-reduces on the host and copies back on
  the side stream, recording an event; ``Work.wait()`` makes the caller's stream wait for that event.
  That is exactly the sequence this link needs (async D2H on a side stream, event sync, all-reduce,
  H2D, stream ordering), tested by torch on GPUs, so deft passes CUDA tensors to the gloo group and
  does not re-implement it. The executor waits on a work only where the result is needed, so the
  caller's stream is ordered after the copy back exactly there.
* CPU: every link is gloo. A link with ``ifname`` gets ``GLOO_SOCKET_IFNAME`` set right before its
  ``dist.new_group`` (gloo reads the variable when it creates the group's transport device; pg_options
  are ignored for gloo) and the previous value is restored afterwards.

Every link is a *new* group created with ``timeout=config.timeout_s`` so that a dead or stalled peer
fails a collective within the configured time. ``dist.new_group`` is collective: every rank of the
default group must build the links in the same order (the config digest check runs first).

Counters (``calls``, ``bytes``) per link let tests and reports prove that each link carried traffic.

With ``link_queue = true`` a gloo link of CPU tensors runs its collectives one at a time, in launch
order (:mod:`deft.runtime.link_queue`: its group has one gloo worker thread): gloo would run two at once,
and the first would end late for its deadline. On a hierarchical link the leaders' group (the step across
hosts, on the NIC) and the flat group (its comm hooks) are serial; the groups inside a host, on the
loopback, keep gloo's two threads.

With several ranks per host (``hierarchical``, :mod:`deft.runtime.hierarchy`) a gloo link's
all-reduce is hierarchical: inside each host, then across hosts on the link's NIC. ``CommLink.group``
stays the flat group of every rank, which comm hooks (the int8 codec), the first collective and the
failover probes use directly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deft.config import DeftConfig, LinkConfig
from deft.netif import new_group_on_nic
from deft.profile import Profile
from deft.runtime.hierarchy import HierarchicalAllReduce, HostLayout, gather_layout, make_hierarchy_groups
from deft.runtime.link_queue import serial_gloo_group

log = logging.getLogger("deft.runtime")


@dataclass
class LinkStats:
    calls: int = 0
    bytes: int = 0


@dataclass
class CommLink:
    """A named process group and its traffic counters; ``hierarchy``: the link's hierarchical all-reduce
    where ranks share hosts (None: flat, on ``group``); ``serial``: its group runs one collective at a time
    (``link_queue``)."""

    name: str
    backend: str
    ifname: str | None
    group: dist.ProcessGroup
    stats: LinkStats = field(default_factory=LinkStats)
    hierarchy: HierarchicalAllReduce | None = None
    serial: bool = False

    def all_reduce(self, tensor: torch.Tensor) -> dist.Work:
        """Launch an asynchronous sum all-reduce of ``tensor`` in place, counted; returns the Work."""
        self.stats.calls += 1
        self.stats.bytes += tensor.numel() * tensor.element_size()
        return self.launch(tensor)

    def launch(self, tensor: torch.Tensor) -> dist.Work:
        """The all-reduce training sends, uncounted (the warm-up's probes): hierarchical or flat."""
        if self.hierarchy is not None:
            return self.hierarchy(tensor)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        assert work is not None
        return work


def default_backend(cuda: bool, backend: str | None = None) -> str:
    """The backend the default process group runs for the model's tensors (``backend``: its
    ``dist.get_backend()`` string, read from the default group when None).

    torch DDP all-reduces on the default group, so deft's primary link follows it: a job that called
    ``init_process_group("gloo")`` with two ranks on one GPU (NCCL refuses that) keeps gloo. A device
    string such as ``"cpu:gloo,cuda:nccl"`` names a backend per device type.
    """
    name = str(backend if backend is not None else dist.get_backend())
    device = "cuda" if cuda else "cpu"
    if ":" in name:
        per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        name = per_device.get(device, "")
    if name == "gloo" or (name == "nccl" and cuda):
        return name
    return "nccl" if cuda else "gloo"  # another backend (ucc, mpi): deft runs links on nccl and gloo only


def link_backend(cfg: LinkConfig, index: int, cuda: bool, primary_auto: str | None = None) -> str:
    """``auto`` means the default process group's backend for the model's device on the first link
    (``primary_auto``, see :func:`default_backend`; NCCL on CUDA when None), gloo on the others."""
    if cfg.backend != "auto":
        if cfg.backend == "nccl" and not cuda:
            return "gloo"  # NCCL cannot run on CPU tensors; on a CPU run the link degrades to gloo
        return cfg.backend
    if index > 0:
        return "gloo"
    if primary_auto is not None:
        return primary_auto
    return "nccl" if cuda else "gloo"


def _new_group(backend: str, ifname: str | None, timeout_s: float, ranks: Sequence[int] | None) -> dist.ProcessGroup:
    return new_group_on_nic(backend, ifname, timeout_s, ranks)


def make_control_group(config: DeftConfig, ranks: Sequence[int] | None) -> dist.ProcessGroup:
    """A CPU gloo group for deft's own small messages (digests, schedule JSON, profile reduction), on the
    primary link's NIC (none named: the default one): the ranks agree over it that another link is lost
    (:mod:`deft.runtime.failover`), so it must not ride on that link."""
    return _new_group("gloo", config.links[0].ifname, config.timeout_s, ranks)


def make_links(config: DeftConfig, cuda: bool, ranks: Sequence[int] | None,
               group_backend: str | None = None) -> dict[str, CommLink]:
    """The configured links; ``group_backend``: the backend string of the process group torch DDP would
    all-reduce on (``dist.get_backend(process_group)``; None: the default group's), which an ``auto``
    primary link follows."""
    links: dict[str, CommLink] = {}
    primary_auto = default_backend(cuda, group_backend)
    for i, lk in enumerate(config.links):
        backend = link_backend(lk, i, cuda, primary_auto)
        if cuda and backend == "gloo":
            verdict = gloo_cuda_fix()
            if verdict.fixed is not True:
                log.warning("deft: link %r runs gloo on CUDA tensors: %s", lk.name, verdict.reason)
        serial = config.link_queue and queues(backend, cuda)
        if config.link_queue and not serial:
            log.warning("deft: link_queue: link %r (%s on %s tensors) keeps its backend's own threads: only a "
                        "gloo link of CPU tensors runs one collective at a time", lk.name, backend,
                        "CUDA" if cuda else "CPU")
        group = (serial_gloo_group(lk.ifname, config.timeout_s, ranks) if serial
                 else _new_group(backend, lk.ifname, config.timeout_s, ranks))
        links[lk.name] = CommLink(lk.name, backend, lk.ifname, group, serial=serial)
    layout = host_layout(config, cuda, ranks, next(iter(links.values())))
    if layout is not None:
        for link in links.values():
            if link.backend == "gloo":
                groups = make_hierarchy_groups(layout, "gloo", link.ifname, config.timeout_s, serial=config.link_queue)
                link.hierarchy = HierarchicalAllReduce(groups)
    return links


def sends_at_once(profile: Profile, links: Mapping[str, CommLink]) -> Profile:
    """``profile`` with each link's ``sends_at_once`` as this run's group runs its collectives: one where
    ``link_queue`` made it serial, else its backend's own (0), whoever measured it: the plan is priced for
    what a verdict on the primary's NIC finds on the wire (:mod:`deft.solver.simulate`)."""
    new = tuple(dataclasses.replace(lk, sends_at_once=1 if lk.name in links and links[lk.name].serial else 0)
                for lk in profile.links)
    return profile if new == profile.links else dataclasses.replace(profile, links=new)


def queues(backend: str, cuda: bool) -> bool:
    """Whether ``link_queue`` makes a link of ``backend`` serial (:mod:`deft.runtime.link_queue`): gloo on
    CPU tensors only (NCCL has its own streams; gloo on CUDA tensors stages through its own copies)."""
    return backend == "gloo" and not cuda


def host_layout(config: DeftConfig, cuda: bool, ranks: Sequence[int] | None, primary: CommLink) -> HostLayout | None:
    """The layout the links all-reduce hierarchically on, or None (flat), the same on every rank.

    ``hierarchical = "auto"``: on where the ranks (torchrun's variables, gathered over the primary link's
    group) share hosts and span several; ``true``: the same, with a warning when it cannot be; ``false``:
    flat. Flat on CUDA (the primary link is NCCL, which has its own topology; chaining a gloo link's CUDA
    collectives is not done) and for a ``process_group`` of part of the world (the layout is the world's)."""
    mode = config.hierarchical
    if mode is False:
        return None
    warn = log.warning if mode is True else log.info
    if cuda or (ranks is not None and list(ranks) != list(range(dist.get_world_size()))):
        warn("deft: links all-reduce flat: the hierarchical all-reduce runs on CPU tensors over every rank of "
             "the default group")
        return None
    if primary.backend != "gloo":
        warn("deft: links all-reduce flat: the primary link is %s, not gloo", primary.backend)
        return None
    layout, why = gather_layout(primary.group, os.environ, config.timeout_s)
    if layout is None:
        warn("deft: links all-reduce flat: %s", why)
        return None
    if not layout.hierarchical:
        warn("deft: links all-reduce flat: %d host(s) of %d rank(s) have no traffic both inside and across hosts",
             layout.hosts, layout.per_host)
        return None
    log.info("deft: gloo links all-reduce hierarchically: %d hosts x %d ranks", layout.hosts, layout.per_host)
    return layout


def make_buffer_group(config: DeftConfig, primary: CommLink, cuda: bool,
                      ranks: Sequence[int] | None) -> dist.ProcessGroup | None:
    """On CUDA with an NCCL primary link: deft's own NCCL group for the per-forward broadcast of the
    buffers, waited for on the stream as torch DDP's is (through the CPU control group it would copy
    them to the host and wait there, every forward). Not the primary link's group: its stream may still
    carry the gradients of a delayed update. None elsewhere: the control group carries the buffers."""
    if not (cuda and primary.backend == "nccl"):
        return None
    return _new_group("nccl", primary.ifname, config.timeout_s, ranks)


def make_solo_group(backend: str, timeout_s: float, ranks: Sequence[int] | None) -> dist.ProcessGroup:
    """This rank's one-rank group on ``backend`` (a comm hook run on it moves nothing: its codec is
    timed alone). Collective over the world: ``dist.new_group`` is, so every rank creates every rank's
    group, in the order of ``ranks`` (``None``: the whole world), and keeps its own."""
    members = list(ranks) if ranks is not None else list(range(dist.get_world_size()))
    groups = [_new_group(backend, None, timeout_s, [r]) for r in members]
    return groups[members.index(dist.get_rank())]


# -- gloo with CUDA tensors: pytorch/pytorch#155714 --------------------------------------------------------
GLOO_CUDA_FIX = "pytorch/pytorch#170812 (fixes #155714: gloo + CUDA futures lose their streams)"


@dataclass(frozen=True)
class GlooCudaVerdict:
    """Whether a torch carries the fix for silent corruption of gloo all-reduces of CUDA tensors read
    through their futures (``fixed``: ``True``, ``False``, or ``None`` when the version cannot tell)."""

    torch_version: str
    fixed: bool | None
    reason: str


def gloo_cuda_fix(version: str | None = None, hip: str | None = None) -> GlooCudaVerdict:
    """The verdict for ``version`` (default: the torch in use) from its release number.

    The bug (pytorch/pytorch#155714): a gloo work's future on CUDA tensors did not keep the streams its
    copy back to the device ran on, so ``fut.wait()`` on another stream than the launching one (the DDP
    reducer's pattern, and a comm hook's future) could read the tensor before the copy had landed. PR
    170812 ("ProcessGroupGloo: fix CUDA tensor stream handling with futures") fixed it on main; AMD's
    fork cherry-picked the landed commit into its release/2.10 (and later 2.9, 2.8), so it was on main
    before that backport. torch 2.11's branch was cut before the backport too (its "release only
    changes" PR), so 2.11 may or may not carry it; 2.12's branch was cut later and every release from
    2.12 on does; upstream 2.10 and older do not (ROCm builds of AMD's fork of 2.8-2.10 may: ``hip``
    set gives ``None`` there). Pre-releases of 2.12 may predate the
    landing. The runtime test that settles it on a GPU is ``tests/test_cuda.py``'s exact pattern.
    """
    if version is None:
        version = str(torch.__version__)
        hip = torch.version.hip
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?(\S*)", version)
    if m is None:
        return GlooCudaVerdict(version, None, f"cannot read the torch version {version!r}")
    major, minor, rest = int(m[1]), int(m[2]), m[4]
    prerelease = bool(re.match(r"(a|b|rc|\.dev)", rest))
    if (major, minor) >= (2, 13) or ((major, minor) == (2, 12) and not prerelease):
        return GlooCudaVerdict(version, True, f"torch {major}.{minor} was branched after {GLOO_CUDA_FIX} "
                                              "landed on main (before AMD's backport to its 2.10)")
    if (major, minor) in ((2, 11), (2, 12)):
        return GlooCudaVerdict(version, None, f"torch {version}: branched near the landing of {GLOO_CUDA_FIX}; "
                                              "the version cannot tell whether it is in")
    if hip:
        return GlooCudaVerdict(version, None, f"torch {version} (ROCm {hip}): AMD's fork backported "
                                              f"{GLOO_CUDA_FIX} to its 2.8-2.10 releases; the version cannot "
                                              "tell whether this build has it")
    return GlooCudaVerdict(version, False, f"torch {version} predates {GLOO_CUDA_FIX}: a gloo link on CUDA "
                                           "tensors may read a bucket before its copy back lands")
