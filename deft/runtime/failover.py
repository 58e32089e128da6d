"""A link that dies: per-link deadlines, the ranks' agreement that it is gone, and its record.

A collective on a non-primary link is *guarded* (:mod:`deft.runtime.executor`): it runs on a copy of its
bucket, so the bucket's buffer keeps this rank's local gradient until the ranks have agreed the result is
good. Each wait on it is bounded by the link's *deadline* (:meth:`LinkFailover.deadline`), not by
``timeout_s``: ``link_deadline_factor`` times the profiled time of those bytes on that link, never below
``link_deadline_s`` (the deadline alone before a profile exists), never above ``timeout_s``.

Every wait that took a guarded result ends with :meth:`LinkFailover.agree`, one all-reduce (max) over the
control group of a flag per link: the links some rank saw fail or miss its deadline. The ranks wait for
and judge the sends the step needs at the step, and every other guarded send in flight right after the
step (:meth:`deft.runtime.executor.Executor.judge_pending`), where every rank is: what one rank does alone
between iterations (its ``state_dict()``) never needs an agreement. The control group
runs on the primary link's NIC (:func:`deft.runtime.links.make_control_group`), so the agreement does not
depend on the link it judges. All ranks get the same set and take the same branch for every bucket: a
good link's results are used; a lost link's are dropped on every rank (one rank may have seen its
all-reduce complete, another not) and the buckets are all-reduced again on the primary link from the
local gradients the failed collective never touched. From then on the executor sends that link's
traffic on the primary, and the course re-plans on the links left (:meth:`LinkFailover.take_lost`).

Note:
    The primary link carries the control group and the used-parameter maps, so its loss is not
    survivable: its waits keep ``timeout_s`` and end the run with a CommunicationError naming it. A
    lost link's group is never used again; a collective stuck on it ends with gloo's own timeout, on
    memory nobody reads. A chained comm hook (PowerSGD) runs its sends one after another on one chain,
    which a stuck send would block: its buckets are not guarded, and a failure ends the run as before.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.profile import Link, Profile
from deft.runtime.control import ControlPlane

log = logging.getLogger("deft.runtime")


class LinkFailover:
    """The run's lost links, the deadlines of the others and the agreement (module docstring)."""

    def __init__(self, config: DeftConfig, control: ControlPlane, links: list[str]) -> None:
        self.config, self._control = config, control
        self.links = list(links)
        self.primary = links[0]
        self.on = config.link_failover and len(links) > 1
        self.dead: set[str] = set()
        self._models: dict[str, Link] = {}
        self._unplanned: list[JsonDict] = []  # the records of links lost, not yet re-planned without (take_lost)

    # -- deadlines -------------------------------------------------------------------------------------
    def use_profile(self, profile: Profile | None) -> None:
        """The links' fitted times, which the deadlines scale from now on."""
        self._models = {} if profile is None else {lk.name: lk for lk in profile.links}

    def guards(self, link: str) -> bool:
        """Is a collective on ``link`` guarded (run on a copy, its loss survivable)?"""
        return self.on and link != self.primary

    def deadline(self, link: str, nbytes: int) -> float:
        """Seconds one wait for ``nbytes`` on ``link`` may take before the link is judged lost."""
        cfg = self.config
        if not self.guards(link):
            return cfg.timeout_s
        model = self._models.get(link)
        scaled = cfg.link_deadline_factor * model.time(nbytes) if model is not None else 0.0
        return min(cfg.timeout_s, max(cfg.link_deadline_s, scaled))

    # -- agreement -------------------------------------------------------------------------------------
    def agree(self, failed: dict[str, str]) -> set[str]:
        """Collective: the links lost on any rank (``failed``: this rank's, with why), those lost before
        included; the same set on every rank."""
        flags = torch.tensor([1 if (n in failed or n in self.dead) else 0 for n in self.links], dtype=torch.int32)
        self._control.wait(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control.group, async_op=True),
                           "all-reduce of the links' health")
        return {n for n, f in zip(self.links, flags.tolist(), strict=True) if f}

    def lost(self, link: str, t: int, buckets: int, seconds: float, why: str) -> None:
        """Every rank agreed ``link`` is gone at iteration ``t``; ``buckets`` sends were all-reduced again
        on the primary link, ``seconds`` this rank's time from the first failed wait to their end."""
        self.dead.add(link)
        left = [n for n in self.links if n not in self.dead]
        self._unplanned.append({"link": link, "iteration": t, "resent_buckets": buckets, "lost_s": round(seconds, 4),
                             "deadline_s": round(self.deadline(link, 0), 4), "why": why, "links_left": left})
        log.warning("deft: rank %d lost link %r at iteration %d (%s): %d bucket send(s) all-reduced again on %r, "
                    "%.3f s lost; re-planning on %s", self._control.rank, link, t, why or "a peer saw it fail",
                    buckets, self.primary, seconds, left)

    def take_lost(self) -> list[JsonDict]:
        """The records of the links lost since the last call (the course re-plans without them and keeps
        them in ``plan_info["link_failures"]``)."""
        out, self._unplanned = self._unplanned, []
        return out

    def live(self, names: list[str]) -> list[str]:
        return [n for n in names if n not in self.dead]


def without_links(profile: Profile, dead: set[str]) -> Profile:
    """``profile`` on the links that are left (the primary is never among ``dead``)."""
    links = tuple(lk for lk in profile.links if lk.name not in dead)
    times = tuple(dataclasses.replace(t, comm_s={k: v for k, v in t.comm_s.items() if k not in dead})
                  for t in profile.times)
    return dataclasses.replace(profile, links=links, times=times)


class Stopwatch:
    """The first failed wait's start, for the time a loss cost (``perf_counter`` seconds)."""

    def __init__(self) -> None:
        self.start: float | None = None

    def failed_wait(self, began: float) -> None:
        if self.start is None:
            self.start = began

    def seconds(self) -> float:
        return 0.0 if self.start is None else time.perf_counter() - self.start
