"""A link that dies: per-link deadlines, the ranks' agreement that it is gone, and its record.

A collective on a non-primary link is *guarded* (:mod:`deft.runtime.executor`): it runs on a copy of its
bucket, so the bucket's buffer keeps this rank's local gradient until the ranks have agreed the result is
good. Each wait on it is bounded by the link's *deadline* (:meth:`LinkFailover.deadline`), not by
``timeout_s``: ``link_deadline_factor`` times the profiled time of those bytes on that link, never below
``link_deadline_s`` (the deadline alone before a profile exists), never above ``timeout_s``.

A guarded result is used only once the ranks' *verdict* on its send is reached
(:mod:`deft.runtime.verdicts`, on :attr:`LinkFailover.verdicts`): one sum over the ranks of a flag per link,
the links some rank saw fail or miss the deadline, summed off the training thread as soon as the
verdict's sends end. The executor opens a verdict on the sends the step needs once the last of them is
launched in the backward (at the step in an iteration whose sends a judge may send again: the first), and
on every other guarded send in flight right after the step
(:meth:`deft.runtime.executor.Executor.open_pending`), where every rank is, and waits for one only where
a result is used: what one rank does alone between iterations (its ``state_dict()``) needs no rank but
itself. The verdict group runs on the primary link's NIC (:func:`deft.runtime.links.make_control_group`),
so the verdict does not depend on the link it judges. All ranks get the same set and take the same
branch for every bucket: a good link's results are used; a lost link's are dropped on every rank (one
rank may have seen its all-reduce complete, another not) and the buckets are all-reduced again from the
local gradients the failed collective never touched. Where every rank is next (a step), the loss is
recorded: from then on the executor sends that link's traffic on the primary, and the course re-plans
on the links left (:meth:`LinkFailover.take_lost`).

Before the first plan the same rules hold: the first iteration's sends and the profile iterations'
are guarded sends of the executor; the warm-up timer rotates the buckets over the links left and
waits only for the completion stamps of sends that completed (a lost one never stamps). Its probe of
each link's start-up (:func:`deft.runtime.warmup_timer.probe_alpha`) waits on a non-primary link for
that link's deadline and ends with an agreement too; the profile is built on the links left (a lost
link is dropped with whatever it measured) and the plan is made on them. Each record names the phase
the link was lost in (:func:`loss_phase`, or ``"alpha probe"``).

A checkpoint remembers lost links: ``plan_info["link_failures"]`` is in it, and a run resumed from it
starts without those links (:meth:`LinkFailover.resume`: their traffic goes on the primary link, a
profile is measured and planned without them) and says so in each record (``resumed_at``). It does not
probe them: a link that failed once is not trusted with the gradients again without a new run.

Note:
    The primary link carries the control group and the used-parameter maps, so its loss is not
    survivable: its waits keep ``timeout_s`` and end the run with a CommunicationError naming it. A
    lost link's group is never used again, and never destroyed: gloo has no abort, and its group's
    destructor joins its worker threads, one of which may be stuck in a collective on the dead link
    until gloo's own timeout (``timeout_s``), on memory nobody reads. So the group is kept for the life
    of the process (:func:`keep_forever`) and neither ``ddp.close()`` nor the interpreter's exit waits
    for it. A chained comm hook (PowerSGD) runs its sends one after another on one chain, which a
    stuck send would block: its buckets are not guarded, and a failure ends the run as before.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.profile import Link, Profile
from deft.runtime.calendar import Calendar
from deft.runtime.control import ControlPlane
from deft.runtime.hierarchy import HierarchicalAllReduce, make_hierarchy_groups
from deft.runtime.links import CommLink, make_control_group
from deft.runtime.verdicts import VerdictChain, flat_sum

log = logging.getLogger("deft.runtime")

#: The phase of a loss found by the probe of the links' start-up (:mod:`deft.runtime.warmup_timer`).
ALPHA_PROBE = "alpha probe"


class LinkFailover:
    """The run's lost links, the deadlines of the others and the agreement (module docstring)."""

    def __init__(self, config: DeftConfig, control: ControlPlane, links: Mapping[str, CommLink]) -> None:
        self.config, self._control = config, control
        self.links = list(links)
        # a hierarchical link's steps run on groups of their own (deft.runtime.hierarchy), kept with it
        self._groups = {n: [lk.group, *(lk.hierarchy.groups.held() if lk.hierarchy is not None else [])]
                        for n, lk in links.items()}
        self._hierarchies = {n: lk.hierarchy for n, lk in links.items() if lk.hierarchy is not None}
        self.primary = self.links[0]
        self.on = guarding(config.link_failover, self.links)
        self.verdicts = _verdict_chain(config, control, links) if self.on else None
        self.dead: set[str] = set()
        self._models: dict[str, Link] = {}
        self._unplanned: list[JsonDict] = []  # the records of links lost, not yet re-planned without (take_lost)

    # -- deadlines -------------------------------------------------------------------------------------
    def use_profile(self, profile: Profile | None) -> None:
        """The links' fitted times, which the deadlines scale from now on."""
        self._models = {} if profile is None else {lk.name: lk for lk in profile.links}

    def guards(self, link: str) -> bool:
        """Is a collective on ``link`` guarded (run on a copy, its loss survivable)?"""
        return guarded(self.on, self.primary, link)

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
        """Collective, on the training thread (before the first plan: the probe of the links' start-up):
        the links lost on any rank (``failed``: this rank's, with why), those lost before included; the
        same set on every rank."""
        flags = torch.tensor([1 if (n in failed or n in self.dead) else 0 for n in self.links], dtype=torch.int32)
        self._control.wait(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control.group, async_op=True),
                           "all-reduce of the links' health")
        return {n for n, f in zip(self.links, flags.tolist(), strict=True) if f}

    def lost(self, link: str, t: int, buckets: int, seconds: float, why: str, phase: str | None = None) -> None:
        """Every rank agreed ``link`` is gone at iteration ``t``; ``buckets`` sends were all-reduced again
        on the primary link, ``seconds`` this rank's time from the first failed wait to their end;
        ``phase``: where the run was (None: :meth:`take_lost` names it from the iteration)."""
        self.dead.add(link)
        for group in self._groups[link]:
            keep_forever(group)
        if link in self._hierarchies:  # the host's other ranks' waits for its first rank end now, not at exit
            self._hierarchies[link].release()
        left = [n for n in self.links if n not in self.dead]
        self._unplanned.append({"link": link, "iteration": t, **({} if phase is None else {"phase": phase}),
                                "resent_buckets": buckets, "lost_s": round(seconds, 4),
                                "deadline_s": round(self.deadline(link, 0), 4), "why": why, "links_left": left})
        log.warning("deft: rank %d lost link %r at iteration %d%s (%s): %d bucket send(s) all-reduced again on %r, "
                    "%.3f s lost; re-planning on %s", self._control.rank, link, t, f" ({phase})" if phase else "",
                    why or "a peer saw it fail", buckets, self.primary, seconds, left)

    def take_lost(self, phase_of: Callable[[int], str]) -> list[JsonDict]:
        """The records of the links lost since the last call, each naming its phase (``phase_of`` its
        iteration, where :meth:`lost` was not told); the course re-plans without them and keeps them in
        ``plan_info["link_failures"]``."""
        out, self._unplanned = self._unplanned, []
        for rec in out:
            t = rec["iteration"]
            rec.setdefault("phase", phase_of(t if isinstance(t, int) else -1))
        return out

    def resume(self, records: list[JsonDict], t: int) -> list[str]:
        """A checkpoint's ``plan_info["link_failures"]`` is loaded at iteration ``t``: the links it records
        as lost stay lost (module docstring); each record gets ``t`` in ``resumed_at``. Returns them."""
        names = [str(rec.get("link")) for rec in records]
        gone = [n for n in self.links if n in names and n != self.primary]
        for rec in records:
            rec["resumed_at"] = [*_ints(rec.get("resumed_at")), t]
        self.dead.update(gone)
        if gone:
            log.warning("deft: rank %d resumes at iteration %d without link(s) %s, lost before the checkpoint; "
                        "their traffic goes on %r", self._control.rank, t, gone, self.primary)
        return gone

    def live(self, names: list[str]) -> list[str]:
        return [n for n in names if n not in self.dead]


def _verdict_chain(config: DeftConfig, control: ControlPlane, links: Mapping[str, CommLink]) -> VerdictChain:
    """Collective (every rank builds the failover at the same point, the course's construction): the
    verdicts' groups on the primary link's NIC; with several ranks per host (the primary link's host
    layout) the flags summed inside the host, across the hosts' first ranks and back."""
    ranks = dist.get_process_group_ranks(control.group)
    resends = make_control_group(config, ranks)
    primary = next(iter(links.values()))
    layout = primary.hierarchy.groups.layout if primary.hierarchy is not None else None
    sum_flags = (flat_sum(make_control_group(config, ranks)) if layout is None else
                 HierarchicalAllReduce(make_hierarchy_groups(layout, "gloo", config.links[0].ifname, config.timeout_s)))
    return VerdictChain(sum_flags, resends, list(links), control.rank, config.timeout_s)


def loss_phase(calendar: Calendar, planned: bool, t: int) -> str:
    """Where a run was when it lost a link in iteration ``t``: the first iteration, a warm-up or profile
    iteration, waiting for the first plan, or training on a plan."""
    if planned:
        return "training"
    if t == 0:
        return "first iteration"
    if t < calendar.warm_end:
        return "warm-up"
    return "profile iteration" if calendar.profiling(t) else "waiting for the first plan"


def keep_forever(group: dist.ProcessGroup) -> None:
    """Never destroy ``group`` (module docstring, Note): its reference count is raised once more than any
    holder will drop, so neither the wrapper's end nor the interpreter's finalization runs its destructor,
    which would wait for a collective stuck on a dead link."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _ints(value: object) -> list[int]:
    return [int(v) for v in value if isinstance(v, int)] if isinstance(value, list) else []


def without_links(profile: Profile, dead: set[str]) -> Profile:
    """``profile`` on the links that are left (the primary is never among ``dead``)."""
    links = tuple(lk for lk in profile.links if lk.name not in dead)
    times = tuple(dataclasses.replace(t, comm_s={k: v for k, v in t.comm_s.items() if k not in dead})
                  for t in profile.times)
    return dataclasses.replace(profile, links=links, times=times)


def guarding(link_failover: bool, links: Sequence[str]) -> bool:
    """Whether a run with these links guards any: ``link_failover`` on and a link besides the primary."""
    return link_failover and len(links) > 1


def guarded(on: bool, primary: str, link: str) -> bool:
    """Whether ``link`` is guarded in a run that guards (``on``): every link but the primary."""
    return on and link != primary


def guarded_links(profile: Profile, guards: Callable[[str], bool]) -> Profile:
    """``profile`` with each link's ``guarded`` as this run guards it (``guards``: :meth:`LinkFailover.guards`),
    whoever measured it: a given profile, or one taken with another ``link_failover``, is priced for the
    verdicts this run will wait for (:mod:`deft.solver.simulate`)."""
    links = tuple(dataclasses.replace(lk, guarded=guards(lk.name)) for lk in profile.links)
    return profile if links == profile.links else dataclasses.replace(profile, links=links)


class Stopwatch:
    """The first failed wait's start, for the time a loss cost (``perf_counter`` seconds)."""

    def __init__(self) -> None:
        self.start: float | None = None

    def failed_wait(self, began: float) -> None:
        if self.start is None:
            self.start = began

    def seconds(self) -> float:
        return 0.0 if self.start is None else time.perf_counter() - self.start
