"""The training mode: what runs an iteration behind the facade, chosen once at construction.

``deft.DistributedDataParallel`` (:mod:`deft.runtime.ddp`) sets up what every mode needs (the control
plane, the links, rank 0's parameters on every rank) and hands it over as a :class:`Wiring`; then it
forwards its public calls to one :class:`TrainingMode` and never asks which one runs:

* :class:`deft.runtime.scheduled.ScheduledRun`: the DeFT schedule (``config.local_steps = 0``): the
  gradient capture, the per-iteration phase machine and the course of the run (warm-up, profile, plan,
  adaptation);
* :class:`deft.runtime.local_mode.LocalStepsMode`: local steps (``config.local_steps > 0``): no
  gradient capture, the averaging at the optimizer step's two hooks (:mod:`deft.runtime.local_steps`);
* :class:`deft.runtime.solo_mode.SoloMode`: world size 1 (``config.solo``, the default): nothing
  crosses a link, so no gradient capture and nothing scheduled; the module runs as it is.

Note:
    A mode is a step-hook object in the manner of torchft's ``LocalSGD``/``DiLoCo``: it binds the
    optimizer's step hooks itself and keeps its own iteration counter and checkpoint record
    (:mod:`deft.runtime.checkpoint`). A refusal that belongs to one mode (``register_comm_hook`` in
    local-steps mode) is raised by that mode, with the facade's method name in the message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.profile import Profile
from deft.runtime.buffer_sync import BufferSync
from deft.runtime.checkpoint import StateDoc
from deft.runtime.codecs.first_iteration import TimedBroadcast
from deft.runtime.codecs.hooks import CommHook
from deft.runtime.control import ControlPlane
from deft.runtime.executor import PendingUpdate
from deft.runtime.links import CommLink
from deft.runtime.local_mode import LocalStepsMode
from deft.runtime.phase import Phase
from deft.runtime.records import PlanInfoView
from deft.runtime.scheduled import ScheduledRun
from deft.runtime.solo_mode import SoloMode, solo_reason
from deft.runtime.updates import LogEntry
from deft.schedule import Schedule


class SyncSwitch:
    """torch DDP's ``no_sync()`` state, shared by the facade (the buffers' broadcast) and the mode (whether
    a backward only accumulates).

    As in torch DDP, a training forward decides for its backward: a forward under ``no_sync()`` makes a
    micro-batch whose backward only accumulates, wherever the backward runs, and a forward outside
    makes a backward that communicates (torch's reducer is prepared in the forward).
    :meth:`triggered` is Accelerate's ``trigger_sync_in_backward``: backwards inside communicate whatever
    their forward said. A backward with no forward through the wrapper follows the state of the moment.
    """

    def __init__(self) -> None:
        self.off = False
        self._at_forward: bool | None = None  # the state at this iteration's last training forward
        self._triggered = False

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        previous, self.off = self.off, True
        try:
            yield
        finally:
            self.off = previous

    def require_sync(self, sync: bool) -> None:
        """torch DDP's ``require_backward_grad_sync`` set by hand: what :meth:`suspended` sets, kept."""
        self.off = not sync

    @contextlib.contextmanager
    def triggered(self) -> Iterator[None]:
        previous, self._triggered = self._triggered, True
        try:
            yield
        finally:
            self._triggered = previous

    def forward_begins(self) -> None:
        """A training forward through the wrapper: its backward follows the state of now."""
        self._at_forward = self.off

    def iteration_ends(self) -> None:
        self._at_forward = None

    def backward_accumulates(self) -> bool:
        """Whether the backward running now only accumulates (a micro-batch)."""
        if self._triggered:
            return False
        return self.off if self._at_forward is None else self._at_forward


@dataclass(frozen=True)
class Wiring:
    """What the facade set up before a mode starts (collectives done: the ranks agree on all of it)."""

    config: DeftConfig
    module: nn.Module
    names: list[str]                  # the trainable parameters' names, in the module's order
    params: list[torch.Tensor]
    device: torch.device
    compiled: str | None              # why the module runs compiled (deft.runtime.compat.for_compiled), or None
    control: ControlPlane
    links: dict[str, CommLink]        # the primary link first
    ranks: list[int] | None           # the process group's ranks (None: the default group)
    init_broadcast: TimedBroadcast | None  # the timed broadcast of rank 0's state at construction
    sync: SyncSwitch
    buffers: BufferSync | None = None  # the buffers' broadcast beside the forward (None: waited for at once)

    @property
    def rank(self) -> int:
        return self.control.rank

    @property
    def world(self) -> int:
        return self.control.world


class TrainingMode(Protocol):
    """The events and views the facade forwards (its methods of the same names document them)."""

    @property
    def iteration(self) -> int: ...
    @property
    def phase(self) -> Phase: ...
    @property
    def schedule(self) -> Schedule: ...
    @property
    def pending_updates(self) -> list[PendingUpdate]: ...
    @property
    def update_log(self) -> list[LogEntry]: ...
    @property
    def plan_info(self) -> PlanInfoView: ...
    @property
    def profile(self) -> Profile | None: ...
    @property
    def last_grad_norm(self) -> float | None: ...
    @property
    def comm_hook(self) -> CommHook | None: ...

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...
    def observe_loss(self, loss: float) -> None: ...
    def calibrate(self, closure: Callable[[], torch.Tensor], tol: float, ncv: int | None,
                  maxiter: int) -> JsonDict | None: ...
    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future[torch.Tensor]]) -> None: ...
    def flush(self) -> None: ...
    def clip_on_update(self, clip: tuple[float, float] | None) -> None: ...
    def takes_record(self) -> bool: ...
    def state(self) -> StateDoc: ...
    def load_state(self, state: object) -> None: ...
    def close(self) -> None: ...


def start_mode(wiring: Wiring, given_profile: Profile | None,
               optimizer: torch.optim.Optimizer | None) -> TrainingMode:
    """The mode ``wiring.config`` and the world size ask for, its hooks installed (the only place that asks)."""
    solo = solo_reason(wiring.config, wiring.world)
    if solo is not None:
        return SoloMode(wiring, given_profile, optimizer, solo)
    if wiring.config.local_steps:
        return LocalStepsMode(wiring, optimizer)
    return ScheduledRun(wiring, given_profile, optimizer)
