"""World size 1 as the wrapper's training mode: nothing crosses a link, so deft gets out of the way.

With one rank the gradient a backward leaves in ``p.grad`` is already torch DDP's all-reduced one (the
average over one rank is the gradient itself, bit for bit: ``g / 1`` summed once). There is nothing
to schedule, delay, merge or compress, so this mode installs no gradient hook and runs no warm-up
timer, profile, plan, planner thread or executor: the forward is the module's own, the backward is
autograd's, and the optimizer's step applies ``p.grad`` as it is. It is chosen at world size 1 unless
``config.solo = false`` (to run and profile deft's machinery on one rank) or the config asks for
maths that differ from torch DDP's even on one rank (:func:`solo_reason`).

What it keeps of the public API: ``no_sync()`` accumulates in ``p.grad`` (nothing else to do);
``flush()`` has nothing pending; ``update_log`` records each optimizer step as applying its own
iteration, ``(t, (t,))``, what the scheduled run logs for a synchronous update; ``plan_info`` says
``{"mode": "solo", "reason": ...}``; ``clip_grad_norm_on_update`` clips right before each step; a
checkpoint record (:class:`SoloState`) resumes the iteration counter and is refused by a job of
another world size (:func:`deft.runtime.checkpoint.check_stamp`). An iteration is one optimizer step.

Note:
    ``register_comm_hook`` is refused, naming ``solo = false``. torch DDP does run a hook at world size
    1 (a compression hook rounds the gradient, PowerSGD approximates it, a user's hook may log or count
    buckets), so accepting one and not running it would silently change what the script computes;
    running it needs the buckets this mode exists to avoid. ``solo = false`` runs it on deft's buckets
    exactly as on N ranks. deft's own knobs are different: ``compression`` only saves bytes on a
    wire there is none of, and a given schedule or profile plans communication there is none of;
    they are ignored, the reason logged once and kept in ``plan_info``.

    The optimizers are found and bound as in the other modes (:class:`deft.runtime.optimizer_hooks.
    OptimizerBinding`): the module's optimizers as they step, ``torch.optim.LBFGS`` refused, so a script
    that runs on one rank runs the same on eight. Those hooks cost a call per step, not per gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError, DeftError
from deft.profile import Profile
from deft.runtime.checkpoint import LOCAL_MODE, SOURCE, StateDoc
from deft.runtime.codecs.hooks import CommHook
from deft.runtime.eager import outside_graphs
from deft.runtime.executor import PendingUpdate
from deft.runtime.grad_stats import check_probe_args
from deft.runtime.optimizer_hooks import OptimizerBinding
from deft.runtime.phase import Phase
from deft.runtime.records import PlanInfoView
from deft.runtime.updates import LogEntry
from deft.schedule import Schedule

if TYPE_CHECKING:
    from deft.runtime.mode import Wiring

log = logging.getLogger("deft.runtime")

#: The version of :class:`SoloState`'s record.
SOLO_STATE_VERSION = 1
REASON = "world size 1: no gradient crosses a link, so there is nothing to schedule (config.solo = false runs " \
         "deft's machinery anyway)"


def solo_reason(config: DeftConfig, world: int) -> str | None:
    """Why this run goes solo (:class:`SoloMode`), or None when it runs a scheduled or local-steps mode.

    Local steps averaging the parameters over one rank is the identity, so they go solo too; DiLoCo's
    outer Nesterov step is an optimizer of its own even on one rank, so it keeps its mode."""
    if world != 1 or not config.solo:
        return None
    if config.local_steps and config.local_outer == "diloco":
        return None
    return REASON


def ignored_settings(config: DeftConfig, given_profile: Profile | None) -> list[str]:
    """deft's settings that only shape communication, given and not used on one rank (module Note)."""
    ignored = []
    if config.compression not in ("auto", "none"):
        ignored.append(f"compression = {config.compression!r} (no wire to save bytes on)")
    if config.schedule_path is not None:
        ignored.append(f"schedule_path = {config.schedule_path!r} (no communication to schedule)")
    if given_profile is not None or config.profile_path is not None:
        ignored.append("the given profile (no communication to plan)")
    if config.local_steps:
        ignored.append(f"local_steps = {config.local_steps} (averaging over one rank changes nothing)")
    return ignored


@dataclass
class SoloState:
    """One rank's state in solo mode: the iteration counter (the update log follows from it).

    ``mode`` keeps :func:`deft.runtime.checkpoint.check_mode`'s marker of ``config.local_steps`` (a run
    with local steps on one rank goes solo), so the facade's stamp check reads this record as it reads
    the other modes' and a job of another world size is refused with its world-size message."""

    rank: int
    world: int
    t: int                      # optimizer steps taken: the index of the next iteration
    local_steps: bool           # config.local_steps > 0 when it was saved

    def to_dict(self) -> StateDoc:
        return {"version": SOLO_STATE_VERSION, "solo": True, "mode": LOCAL_MODE if self.local_steps else "solo",
                "rank": self.rank, "world": self.world, "t": self.t}

    @classmethod
    def from_dict(cls, state: object) -> SoloState:
        """Read and check a saved record; every problem names the field."""
        if not isinstance(state, dict):
            raise ContractError(SOURCE, "deft_state", f"expected a dict, got {type(state).__name__}")
        if state.get("solo") is not True:
            raise ContractError(SOURCE, "deft_state.solo",
                                "the checkpoint was saved by deft's scheduling machinery (config.solo = false or "
                                "more than one rank) and this one-rank wrapper runs solo: build it with "
                                "solo = false to resume it, or load only ddp.module's and the optimizer's state "
                                "dicts")
        if state.get("version") != SOLO_STATE_VERSION:
            raise ContractError(SOURCE, "deft_state.version",
                                f"expected solo state version {SOLO_STATE_VERSION}, got {state.get('version')!r}")
        missing = [k for k in ("rank", "world", "t") if k not in state]
        if missing:
            raise ContractError(SOURCE, "deft_state", f"missing field(s) {missing}")
        return cls(rank=int(state["rank"]), world=int(state["world"]), t=int(state["t"]),
                   local_steps=state.get("mode") == LOCAL_MODE)


class SoloMode:
    """The facade's events at world size 1 (module docstring); hooks at the optimizer's step only."""

    def __init__(self, wiring: Wiring, given_profile: Profile | None, optimizer: torch.optim.Optimizer | None,
                 reason: str) -> None:
        self.module, self.rank, self.world = wiring.module, wiring.rank, wiring.world
        self._params, self._local_steps = wiring.params, bool(wiring.config.local_steps)
        self._optim = OptimizerBinding(wiring.params, self._before_step, self._after_step, optimizer)
        self._t = 0
        self._clip: tuple[float, float] | None = None
        self._last_norm: float | None = None
        ignored = ignored_settings(wiring.config, given_profile)
        self._info: JsonDict = {"mode": "solo", "reason": reason, **({"ignored": list(ignored)} if ignored else {})}
        if ignored:
            log.warning("deft: world size 1 runs solo; ignored: %s", "; ".join(ignored))

    # -- the step's hooks ------------------------------------------------------------------------------
    def _before_step(self) -> None:
        if self._clip is not None:
            with_grad = [p for p in self._params if p.grad is not None]
            self._last_norm = float(torch.nn.utils.clip_grad_norm_(with_grad, *self._clip))

    def _after_step(self) -> None:
        self._t += 1

    # -- the facade's events ---------------------------------------------------------------------------
    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._step_ends()
        return self.module(*args, **kwargs)  # p.grad after backward is already torch DDP's

    @outside_graphs
    def _step_ends(self) -> None:
        self._optim.close_open_step()  # several optimizers, one of which did not step: the step ends here

    def observe_loss(self, loss: float) -> None:
        """Nothing reads it: no schedule for the preserver to judge."""

    def calibrate(self, closure: Callable[[], torch.Tensor], tol: float, ncv: int | None,
                  maxiter: int) -> JsonDict | None:
        """Nothing to calibrate: no stale schedule for the preserver to check."""
        check_probe_args(closure, tol, ncv, maxiter)
        return None

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future[torch.Tensor]]) -> None:
        raise DeftError("register_comm_hook: at world size 1 deft runs solo (no buckets, no communication), so the "
                        "hook would never run, while torch DDP runs it on every bucket even on one rank; set "
                        "config solo = false to run it on deft's buckets, or register it only when the world "
                        "size is above 1")

    def flush(self) -> None:
        """Nothing pending: every step applied its own gradient."""

    def clip_on_update(self, clip: tuple[float, float] | None) -> None:
        self._clip = clip

    def close(self) -> None:
        self._optim.remove()

    # -- views -----------------------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        return self._t

    @property
    def phase(self) -> Phase:
        return Phase.IDLE  # nothing of an iteration runs through deft before its step

    @property
    def schedule(self) -> Schedule:
        raise DeftError("schedule: at world size 1 deft runs solo and schedules nothing (no gradient crosses a "
                        "link); plan_info says so")

    @property
    def pending_updates(self) -> list[PendingUpdate]:
        return []

    @property
    def update_log(self) -> list[LogEntry]:
        return [(t, (t,)) for t in range(self._t)]

    @property
    def plan_info(self) -> PlanInfoView:
        return PlanInfoView({k: list(v) if isinstance(v, list) else v for k, v in self._info.items()})

    @property
    def profile(self) -> Profile | None:
        return None

    @property
    def last_grad_norm(self) -> float | None:
        return self._last_norm

    @property
    def comm_hook(self) -> CommHook | None:
        return None

    # -- checkpoint ------------------------------------------------------------------------------------
    def takes_record(self) -> bool:
        return True  # no gradient of an iteration is held between its backward and its step

    def state(self) -> StateDoc:
        return SoloState(rank=self.rank, world=self.world, t=self._t, local_steps=self._local_steps).to_dict()

    def load_state(self, state: object) -> None:
        st = SoloState.from_dict(state)
        if st.world != self.world:
            raise ContractError(SOURCE, "deft_state.world", f"the checkpoint was saved by a job of {st.world} "
                                f"ranks and this one has {self.world}")
        self._t = st.t
