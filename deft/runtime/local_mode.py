"""Local steps as the wrapper's training mode (``config.local_steps > 0``; :mod:`deft.runtime.mode`).

No gradient capture and no schedule: the forward is the module's own, every rank steps on its own
gradient, and :class:`deft.runtime.local_steps.LocalSteps` acts at the optimizer step's two hooks
(the warm-up's gradient mean before it; an averaging applied or launched after it). The checkpoint
record is :class:`deft.runtime.checkpoint.LocalStepsState`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from deft._json import JsonDict
from deft.errors import DeftError
from deft.profile import Profile
from deft.runtime.checkpoint import LocalStepsState, StateDoc, check_mode
from deft.runtime.codecs.hooks import CommHook
from deft.runtime.eager import outside_graphs
from deft.runtime.executor import PendingUpdate
from deft.runtime.grad_stats import check_probe_args
from deft.runtime.local_steps import LocalSteps
from deft.runtime.optimizer_hooks import OptimizerBinding
from deft.runtime.phase import Phase
from deft.runtime.records import PlanInfoView
from deft.runtime.updates import LogEntry
from deft.schedule import Schedule

if TYPE_CHECKING:
    from deft.runtime.mode import Wiring


class LocalStepsMode:
    """The facade's events in local-steps mode; an iteration is one optimizer step."""

    def __init__(self, wiring: Wiring, optimizer: torch.optim.Optimizer | None) -> None:
        self.module, self.rank, self.world = wiring.module, wiring.rank, wiring.world
        self.engine = LocalSteps(wiring.config, wiring.params, wiring.links, self.rank, self.world)
        self._optim = OptimizerBinding(wiring.params, self._before_step, self._after_step, optimizer)
        self._t = 0  # optimizer steps taken: the index of the next iteration

    # -- the step's hooks ------------------------------------------------------------------------------
    def _before_step(self) -> None:
        self.engine.before_step()  # the warm-up's gradient mean; then nothing

    def _after_step(self) -> None:
        self.engine.after_step()  # an averaging applied or launched at its step
        self._t += 1

    # -- the facade's events ---------------------------------------------------------------------------
    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._step_ends()
        return self.module(*args, **kwargs)  # gradients stay local; the step's hooks do the rest

    @outside_graphs
    def _step_ends(self) -> None:
        self._optim.close_open_step()  # several optimizers, one of which did not step: the step ends here

    def observe_loss(self, loss: float) -> None:
        self.engine.observe_loss(loss)

    def calibrate(self, closure: Callable[[], torch.Tensor], tol: float, ncv: int | None,
                  maxiter: int) -> JsonDict | None:
        """Nothing to calibrate: no stale schedule for the preserver to check."""
        check_probe_args(closure, tol, ncv, maxiter)
        return None

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future[torch.Tensor]]) -> None:
        raise DeftError("register_comm_hook: local-steps mode (config.local_steps > 0) communicates no "
                        "gradients after its warm-up and averages parameters exactly; there is no bucket to hook")

    def flush(self) -> None:
        self.engine.flush()  # the averaging in flight, applied now

    def clip_on_update(self, clip: tuple[float, float] | None) -> None:
        """No update of deft's to clip: the optimizer steps on this rank's own gradient."""

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
        raise DeftError("schedule: local-steps mode (config.local_steps > 0) runs no gradient schedule; "
                        "plan_info['local_steps'] describes its averaging")

    @property
    def pending_updates(self) -> list[PendingUpdate]:
        return []

    @property
    def update_log(self) -> list[LogEntry]:
        return []

    @property
    def plan_info(self) -> PlanInfoView:
        return PlanInfoView({"local_steps": self.engine.info()})

    @property
    def profile(self) -> Profile | None:
        return None

    @property
    def last_grad_norm(self) -> float | None:
        return None

    @property
    def comm_hook(self) -> CommHook | None:
        return None

    # -- checkpoint ------------------------------------------------------------------------------------
    def takes_record(self) -> bool:
        return True  # no gradient of an iteration is held between its backward and its step

    def state(self) -> StateDoc:
        return LocalStepsState(rank=self.rank, world=self.world, t=self._t,
                               local_steps=self.engine.state_dict()).to_dict()

    def load_state(self, state: object) -> None:
        check_mode(state, local_steps=True)
        st = LocalStepsState.from_dict(state)
        st.check_owner(self.rank, self.world)
        self.engine.load_state_dict(st.local_steps)
        self._t = st.t
