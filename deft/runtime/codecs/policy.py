"""The codec policy: the one object the course asks which codec sends which bucket, now.

It answers at the run's named moments, with hook tables the executor runs (the executor decides
nothing about codecs):

* **A comm hook** (the user's ``register_comm_hook`` or the config's ``compression``,
  :mod:`~deft.runtime.codecs.hooks`) sends every bucket; deft then chooses no codec of its own.
* **The first iteration** (:meth:`CodecPolicy.first_iteration_begins` to
  :meth:`CodecPolicy.after_first_iteration`): its own sends are screened, speculated and judged, and the
  profile iterations' codec is decided (:mod:`~deft.runtime.codecs.first_iteration`).
* **The profile iterations** (:meth:`CodecPolicy.profile_schedule`, :meth:`CodecPolicy.measure_profiled`,
  :meth:`CodecPolicy.exact`): every bucket in that codec, the codec timed on the profile's buckets
  (:mod:`~deft.runtime.codecs.timing`), and the plan starts from the exact times.
* **The plan** (:meth:`CodecPolicy.plan_inputs`, :meth:`CodecPolicy.lag_schedule`,
  :meth:`CodecPolicy.planned_profile`): what rank 0's choice needs (:mod:`~deft.runtime.codecs.choice`),
  the codec while rank 0 plans, and the coded profile every rank rebuilds from rank 0's record.
* **The adaptation** (:meth:`CodecPolicy.recoding`): the choice, made again on each calibration.
* **Every install** (:meth:`CodecPolicy.hooks_for`): a schedule's per-bucket codecs as hooks, one hook
  per codec for the whole run, so that int8's generator is checkpointed (:meth:`CodecPolicy.hook_states`);
  PowerSGD's memory follows a layout change (:meth:`CodecPolicy.carry_buckets`,
  :mod:`~deft.runtime.codecs.powersgd_memory`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError
from deft.profile import Profile
from deft.runtime.buckets import FlatLayout
from deft.runtime.checkpoint import StateDoc
from deft.runtime.codecs import choice
from deft.runtime.codecs.choice import CodecInputs, Recoding
from deft.runtime.codecs.first_iteration import CodecDecision, FirstIteration, FirstSendsJudge, TimedBroadcast
from deft.runtime.codecs.hooks import CommHook, codec_hook, plain_iterations
from deft.runtime.codecs.powersgd_memory import carry_buckets
from deft.runtime.codecs.timing import Codec, measure_codec
from deft.runtime.control import ControlPlane
from deft.runtime.executor import DueUpdate, Executor
from deft.runtime.grad_stats import GradStats
from deft.runtime.links import CommLink, make_solo_group
from deft.schedule import Schedule
from deft.solver.codecs import CHOSEN, CodecCost, exact_profile

log = logging.getLogger("deft.runtime")


class CodecPolicy:
    """Which codec sends which bucket, at each of the run's moments (module docstring)."""

    def __init__(self, config: DeftConfig, control: ControlPlane, executor: Executor, params: list[torch.Tensor],
                 primary: CommLink, ranks: list[int] | None, measuring: bool, comm_hook: CommHook | None,
                 init_broadcast: TimedBroadcast | None, preload_solver: Callable[[], None]) -> None:
        self.config, self._control, self._executor, self._params = config, control, executor, params
        self._primary, self._ranks, self._measuring = primary, ranks, measuring
        self._comm_hook = comm_hook
        self._init_broadcast = init_broadcast  # the facade's timed broadcast at construction
        self._preload_solver = preload_solver  # called where the first iteration finds the links the bound
        self._codec_hooks: dict[str, CommHook] = {}  # one hook per codec of the schedules, for the run
        self._first: FirstIteration | None = None  # the first iteration, while it runs
        self.decision: CodecDecision | None = None  # the profile iterations' codec, once decided
        self._solo: dist.ProcessGroup | None = None  # this rank's one-rank group, for timing a codec
        self._profiled: Codec | None = None  # deft's profile codec measured on the profiled layout
        self.inputs: CodecInputs | None = None  # the plan's codec inputs (None: deft chooses no codec)

    # -- hooks -------------------------------------------------------------------------------------
    @property
    def comm_hook(self) -> CommHook | None:
        """The user's or the config's comm hook (None: plain all-reduces, or deft's own codecs)."""
        return self._comm_hook

    @property
    def chained(self) -> bool:
        """Whether the comm hook's sends run one at a time (:attr:`CommHook.chained`)."""
        return self._comm_hook is not None and self._comm_hook.chained

    def register(self, hook: CommHook) -> None:
        """The comm hook sends every bucket from now on (the executor is idle)."""
        self._comm_hook = hook
        ex = self._executor
        if ex.schedule is not None:
            ex.use_hooks(self.hooks_for(ex.schedule))

    def plain_iterations(self) -> int:
        """Iterations the comm hook still sends uncompressed
        (:func:`~deft.runtime.codecs.hooks.plain_iterations`)."""
        return plain_iterations(self._comm_hook)

    def _hook(self, codec: str) -> CommHook:
        if codec not in self._codec_hooks:
            self._codec_hooks[codec] = codec_hook(codec)
        return self._codec_hooks[codec]

    def hooks_for(self, schedule: Schedule) -> tuple[CommHook | None, ...]:
        """Each bucket's hook under ``schedule``: the comm hook on every bucket, else the schedule's
        codec of each (``Schedule.codecs``; none: plain all-reduces)."""
        n = len(schedule.bucket_numel)
        if self._comm_hook is not None:
            return (self._comm_hook,) * n
        if not schedule.compressed:
            return ()
        return tuple(self._hook(c) if c else None for c in (schedule.codec_of(b) for b in range(n)))

    def _every_bucket(self, codec: str) -> tuple[CommHook | None, ...]:
        """Every bucket of the running layout with ``codec`` (``""``: exact)."""
        layout = self._executor.layout
        return (self._hook(codec),) * layout.n_buckets if codec and layout is not None else ()

    def carry_buckets(self, old: FlatLayout, new: FlatLayout) -> None:
        """The layout changes: the comm hook's per-bucket memory follows its elements."""
        carry_buckets(self._comm_hook, old, new, self._params)

    # -- checkpoints -------------------------------------------------------------------------------
    def comm_hook_state(self) -> StateDoc | None:
        return None if self._comm_hook is None else self._comm_hook.state_dict()

    def load_comm_hook_state(self, saved: StateDoc | None, source: str) -> None:
        if saved is None:
            return
        if self._comm_hook is None:
            raise ContractError(source, "deft_state.comm_hook", "the checkpoint holds a comm hook's state but no "
                                "hook is registered: call ddp.register_comm_hook(...) before load_state_dict")
        self._comm_hook.load_state_dict(saved, source)

    def hook_states(self) -> dict[str, StateDoc]:
        """The states of the schedules' codec hooks that keep one (int8's generator), by codec name."""
        states = {name: hook.state_dict() for name, hook in self._codec_hooks.items()}
        return {name: st for name, st in states.items() if st is not None}

    def load_hook_states(self, saved: dict[str, StateDoc], source: str) -> None:
        """Restore :meth:`hook_states` (a resumed run rounds as the uninterrupted one)."""
        for name, st in saved.items():
            self._hook(name).load_state_dict(st, source, f"deft_state.codec_hooks.{name}")

    def restore(self, profile_codec: object | None) -> None:
        """A checkpoint is loaded: its record of the profile iterations' codec (a damaged one is refused)."""
        self._first = None
        self.decision = None if profile_codec is None else CodecDecision.from_dict(profile_codec)

    # -- the first iteration -------------------------------------------------------------------------
    def first_iteration_begins(self, batch: Callable[[], int | None]) -> None:
        """The run's first iteration, profile iterations ahead: gather its statistics and timing, and judge
        its sends (``profile_codec`` other than ``"never"``) where deft chooses codecs."""
        cfg, ex = self.config, self._executor
        if self.decision is not None or not choice.considered(cfg, self._control.world, self._measuring,
                                                              self._comm_hook is not None, ex.layout):
            return
        self._first = FirstIteration()
        assert self._first.stats is not None
        ex.observe(self._first.stats)
        if cfg.profile_codec != "never":  # its sends are judged at the end of its backward
            ex.judge_backward(FirstSendsJudge(self._first, cfg, self._control, batch, self._init_broadcast,
                                              self._preload_solver, self._every_bucket))

    @property
    def first_iteration_running(self) -> bool:
        return self._first is not None

    def forward_begins(self, optimizer: torch.optim.Optimizer | None) -> None:
        if self._first is not None:
            self._first.forward_begins(self._executor, self._params, optimizer)

    def backward_ends(self, now: float) -> None:
        if self._first is not None:
            self._first.backward_ends(now)

    def iteration_ends(self) -> None:
        if self._first is not None:
            self._first.iteration_ends()

    def on_due(self, lasts: list[int], updates: list[DueUpdate], t: int, device: torch.device) -> None:
        if self._first is not None and self._first.stats is not None:
            # a non-finite first gradient leaves no estimate: the profile stays exact
            self._first.stats.on_due(lasts, updates, t, self._control.group, device)

    def after_first_iteration(self, batch: int | None) -> CodecDecision | None:
        """Collective, after the first iteration (where it was gathered): the profile iterations' codec."""
        first, self._first = self._first, None
        if first is None:
            return None
        if first.stats is not None:
            self._executor.unobserve(first.stats)
        self.decision = first.decide(self.config, self._control, batch)
        if self._control.rank == 0:
            log.info("deft: profile iterations %s (%s)", f"in {self.decision.codec}" if self.decision.codec
                     else "exact", self.decision.reason)
        return self.decision

    # -- the profile iterations ----------------------------------------------------------------------
    @property
    def profile_codec(self) -> str:
        """The codec of the profile iterations (``""``: exact, or not decided yet)."""
        return "" if self.decision is None else self.decision.codec

    def profile_schedule(self, schedule: Schedule) -> Schedule:
        """A profile iteration's ``schedule``, every bucket in the profile iterations' codec."""
        return _coded(schedule, self.profile_codec)

    @property
    def _hosts(self) -> tuple[int, int] | None:
        """``(hosts, ranks per host)`` where the links all-reduce hierarchically: a hook's sends, on the flat
        group, are priced by the bytes they put on each NIC (:func:`deft.runtime.codecs.wire.flat_path_factor`)."""
        h = self._primary.hierarchy
        return None if h is None else (h.groups.layout.hosts, h.groups.layout.per_host)

    def _solo_group(self) -> dist.ProcessGroup:
        if self._solo is None:  # dist.new_group is collective over the world
            self._solo = make_solo_group(self._primary.backend, self.config.timeout_s, self._ranks)
        return self._solo

    def measure_profiled(self, layout: FlatLayout) -> Codec | None:
        """Collective: the codec the profile iterations ran on ``layout`` (a comm hook, or deft's profile
        codec), measured; None: they ran exact."""
        coded = self._comm_hook is None and bool(self.profile_codec)
        hook = codec_hook(self.profile_codec) if coded else self._comm_hook
        solo = self._solo_group() if hook is not None else None
        codec = measure_codec(hook, layout, self._params, solo, self._executor.device, self._control, self._hosts)
        # deft's own codec on this layout: the plan's choice prices with it too (None: a comm hook or
        # an exact profile, so that choice times its codecs itself)
        self._profiled = codec if coded else None
        return codec

    def exact(self, profile: Profile) -> Profile:
        """The plan starts from the exact times: a profile measured in deft's codec, converted
        (:func:`deft.solver.codecs.exact_profile`); a comm hook's profile stays the hook's."""
        if self._profiled is None:
            return profile
        return exact_profile(replace(profile, meta={**profile.meta, CHOSEN: self.profile_codec}))

    # -- the plan ------------------------------------------------------------------------------------
    def plan_inputs(self, stats: GradStats | None, batch: int | None, profile: Profile | None) -> CodecInputs | None:
        """Collective where deft chooses codecs: what rank 0's choice needs (None elsewhere)."""
        ex = self._executor
        self.inputs = None
        if choice.considered(self.config, self._control.world, self._measuring, self._comm_hook is not None,
                             ex.layout):
            assert ex.layout is not None
            self.inputs = choice.measure_inputs(ex.layout, self._params, self._solo_group(), ex.device,
                                                self._control, stats, batch, self._profiled, profile, self._hosts)
        return self.inputs

    def measure_int8(self, layout: FlatLayout) -> CodecCost | None:
        """Collective: int8's cost on ``layout``'s buckets, for a codec choice made again where the first
        plan did not weigh it (:meth:`Recoding.int8_wanted`)."""
        return choice.measure_int8(layout, self._params, self._solo_group(), self._executor.device, self._control,
                                   self._hosts)

    def lag_schedule(self, schedule: Schedule) -> Schedule:
        """What runs while rank 0 plans, in :func:`choice.lag_codec`."""
        return _coded(schedule, choice.lag_codec(self.profile_codec, self.inputs, self.config.epsilon))

    def planned_profile(self, profile: Profile, info: JsonDict) -> Profile:
        """The profile rank 0 planned on: its coded buckets (:func:`choice.planned_profile`)."""
        return choice.planned_profile(profile, self.inputs, info)

    def schedule_profile(self, exact: Profile | None, schedule: Schedule | None) -> Profile | None:
        """``exact`` priced as ``schedule`` sends it (:func:`choice.schedule_profile`; None: not priced)."""
        if exact is None or schedule is None:
            return None
        return choice.schedule_profile(exact, self.inputs, schedule)

    def recoding(self, exact: Profile | None, info: JsonDict) -> Recoding | None:
        """The plan's choice, to be made again by the adaptation (None: deft chose no codec)."""
        return Recoding.of(exact, self.inputs, info)


def _coded(schedule: Schedule, codec: str) -> Schedule:
    """``schedule`` with every bucket sent with ``codec`` (``""``: unchanged)."""
    return replace(schedule, codecs=(codec,) * len(schedule.bucket_numel)) if codec else schedule



