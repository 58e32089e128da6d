"""Stability of a schedule's delayed and merged updates along the sharpest Hessian direction.

The Gaussian walk (:mod:`deft.preserver.gaussian_walk`) sees only the batch-size sequence ``K``; it
cannot tell a lag-free merge from a stale update, yet with momentum SGD one iteration of staleness
costs far more accuracy than merging the same gradients (measured: benchmarks/RESULTS.md, update-timing
check). This module explains that with linear stability: it computes the spectral radius of the update
recurrence a schedule implies, for the optimizer actually used, along the Hessian direction of largest
curvature ``lam`` (estimated by :mod:`deft.preserver.curvature`), and rejects schedules that are unstable
there.

The model
---------
Near the current point, along a unit eigenvector of the loss Hessian ``H`` with eigenvalue ``lam``,
the loss is ``½ lam w²`` and the gradient is ``lam w`` (``w``: the parameters' coordinate along that
direction). Gradient noise adds a forcing term but does not change the linear map, so it does not
change stability. The optimizer's step size ``eta`` enters only through ``h = eta * lam``.

How a schedule maps to delays (:func:`applied_updates`)
--------------------------------------------------------
Iteration ``t`` sits at position ``p = t mod N`` of a cycle of ``N`` (:class:`deft.schedule.Schedule`)
and computes its gradient at ``w_t``, the parameters at the start of the iteration. After the
optimizer step of position ``p`` the updates :meth:`~deft.schedule.Schedule.updates_due` lists are
applied, in that order. An update group of positions ``q_1..q_k`` with ``apply_after = A`` (``A >= N``:
applied in the next cycle, at position ``A - N``) is applied after iteration ``t`` with
``t mod N == A mod N``, and its ``k`` gradients were computed ``A - q_i`` iterations earlier: its *lags*
are ``A - q_i``. The smallest, ``A - last``, is its *staleness*: ``0`` for a lag-free update (applied
at the step of its own last iteration), ``1`` for "one iteration late". The update averages the ``k``
gradients, ``g = (lam / k) Σ_i w_{t - (A - q_i)}``, and takes one optimizer step with it (merged
updates keep the optimizer's learning rate, as gradient accumulation does). In a lag-free merge the
earlier lags point at iterations after which no update landed, so ``w_{t-l} = w_t`` there and the
merge is one step of batch ``k B`` every ``k`` iterations.

The optimizer step (one per applied update), as torch implements it
------------------------------------------------------------------
``ω`` is the weight decay, applied to the *current* parameters at the step (not the stale ones):

* SGD (``momentum β``, ``dampening τ``): ``d = g + ω w``; ``b ← β b + (1 - τ) d``;
  ``w ← w - eta (d + β b)`` with Nesterov, ``w ← w - eta b`` without; ``w ← w - eta d`` when ``β = 0``.
* Adam / AdamW, linearised: the second moment ``v̂`` changes slowly (``β₂ = 0.999``) and is frozen, so
  each coordinate moves with the effective step ``P = eta / (√v̂ + eps)``; the first moment's bias
  correction tends to 1. Then ``m ← β₁ m + (1 - β₁) d`` and ``w ← w - P m`` (AdamW first decays
  ``w ← (1 - eta ω) w`` and leaves ``ω`` out of ``d``). This is heavy ball in EMA form with step
  ``P (1 - β₁)`` and momentum ``β₁``. ``P`` differs per coordinate: :class:`OptimizerSpec` carries
  a scalar ``scale`` with ``P = lr * scale``. Either take ``scale`` as a summary of ``1 / (√v̂ + eps)``
  (:func:`deft.preserver.curvature.adam_scale`: the median, or the max to be conservative; an
  approximation, since the sharpest direction mixes coordinates with different steps), or, exactly
  for the linearised Adam, measure ``lam`` as the top eigenvalue of the preconditioned Hessian
  ``D^½ H D^½`` with ``D = 1 / (√v̂ + eps)`` (:func:`deft.preserver.curvature.top_eigenvalue` with
  ``preconditioner=``) and keep ``scale = 1``. Coupled (Adam) weight decay is modelled as ``ω`` seen
  through the same scalar step; it is negligible next to ``lam`` in practice.

Parameter groups and the learning rate judged
---------------------------------------------
One spec stands for every parameter group (:meth:`OptimizerSpec.from_torch`), because the sharpest
direction may lie in any of them. Groups may differ in ``lr`` and ``weight_decay`` (GPT-2 recipes decay
the matrices, not the biases and LayerNorm gains); the spec takes the largest ``lr`` and the smallest
``ω``, which is at least as hard to pass as any one group:

* ``lr``: ``h = step * lam``, so every edge in ``lam`` scales as ``1 / lr``: the largest ``lr`` has the
  lowest edges.
* ``ω``: weight decay pulls on the *current* parameters, undelayed, in both forms above. For torch
  DDP's plan it adds to the curvature (GD: ``eta (lam + ω) < 2``), lowering its edge; for a stale
  update it is a restoring force that damps the oscillation the delayed gradient drives, so it never
  lowers a stale schedule's edge (delayed GD: ``z² - (1 - eta ω) z + h = 0``, complex roots with
  ``|z|² = h`` whatever ``ω``: edge ``h = 1``). So the smallest ``ω`` gives a stale schedule its lowest
  edge and torch DDP its highest: the rejection ``lam > margin * edge`` and the exemption
  ``edge >= ddp_edge`` are both hardest to pass there (checked on a grid by tests/test_stability.py).

The learning rate is the one the plan will run at, not the one at planning time: :func:`planning_lr`
also reads what torch's LR schedulers record in a group (``initial_lr``, the base a warm-up rises to;
OneCycleLR's ``max_lr``). A schedule judged during a warm-up at a quarter of the peak ``lr`` would
otherwise pass with four times too little room. The runtime re-checks when the ``lr`` grows beyond
what was judged anyway (:func:`deft.preserver.feedback.lr_outgrown`), which covers schedules that
raise the ``lr`` above its base (a lambda above 1, CyclicLR).

The companion matrix and the one-cycle transfer matrix
------------------------------------------------------
With ``L`` the largest lag, the state between iterations is ``s_t = (w_t, w_{t-1}, …, w_{t-L}, b_t)``
(``b``: the momentum buffer, or Adam's first moment). Iteration ``t`` maps it linearly: shift the
history, then apply each due update, each a linear map of ``(w, history, b)``. ``M_p`` is that map's
matrix (a companion matrix of the delayed recurrence); over a cycle ``T = M_{N-1} ⋯ M_0``, and the
per-iteration spectral radius is ``ρ = max |eig T| ^ (1 / N)``: the state grows or shrinks like
``ρ^t``. The schedule is stable along the direction iff ``ρ < 1``. An eigenvalue of ``T`` that belongs
to a history slot the dynamics never reads is 0, so the extra slots add no spurious modes.

Closed forms (the tests check the matrices against them and against torch's own optimizers)
-----------------------------------------------------------------------------------------
* GD, no delay: ``w' = (1 - h) w``, ``ρ = |1 - h|``, stable iff ``h < 2``.
* GD, one iteration late: ``w_{t+1} = w_t - h w_{t-1}``, ``z² - z + h = 0``; for ``h > ¼`` the roots are
  complex with ``|z|² = h``: stable iff ``h < 1``. The delay halves plain GD's edge. With a delay of
  ``d`` iterations (``z^d (z - 1) = -h``, crossing the unit circle at ``θ = π / (2d + 1)``) the edge
  is ``h = 2 sin(π / (2 (2d + 1)))``: 2, 1, 0.618, 0.445, …
* Heavy ball, no delay: ``z² - (1 + β - h) z + β = 0``; ``ρ = √β`` while the roots are complex
  (``(1 - √β)² < h < (1 + √β)²``), edge ``h = 2 (1 + β)`` (root ``z = -1``).
* Heavy ball, one iteration late: ``w_{t+1} = (1 + β) w_t - (β + h) w_{t-1}``, so
  ``z² - (1 + β) z + (β + h) = 0``. The product of the roots is ``β + h``; they are complex for
  ``h > (1 - β)² / 4`` with ``|z|² = β + h``: stable iff ``h < 1 - β``. For ``β = 0.9`` that is 0.1
  against 3.8 without delay: the delay does not halve heavy ball's edge, it shrinks it 38-fold. In
  units of the steady-state step ``h / (1 - β)`` the delayed edge is 1, like delayed GD's, while the
  undelayed edge is ``2 (1 + β) / (1 - β) = 38``: momentum lets a well-tuned run live at curvatures far
  beyond what a stale gradient tolerates, because the delayed gradient opposes a velocity that has
  already moved on. (The claim that one iteration of delay "halves" the edge holds for plain GD only.)
* Nesterov (torch's form), no delay: ``z² - (1 + β)(1 - h) z + β (1 - h) = 0``, edge
  ``h = 2 (1 + β) / (1 + 2 β)``.
* Lag-free merges (``K = [k]``): one step every ``k`` iterations, ``ρ = ρ_1^{1/k}`` with the undelayed
  ``ρ_1``: the same edge. Merging at the same learning rate divides the number of steps by ``k``, not
  their size, so it costs progress (which the walk prices) but never stability.
* Adam ≈ heavy ball with ``h = P lam (1 - β₁)``: no-delay edge ``P lam < 2 (1 + β₁) / (1 - β₁)``
  (38 for ``β₁ = 0.9``, the "adaptive edge of stability" of Cohen et al. 2022), one iteration late
  ``P lam < 1``.

The margin (:func:`check_stability`)
------------------------------------
A bound on the radius itself (``ρ <= 1 - δ``) is not a useful margin: without delay heavy ball's
radius is at least ``√β`` (the product of the roots is ``β``; ``ρ = √β`` over most of the stable
range), so such a bound rejects torch DDP itself once ``β >= (1 - δ)²`` and says nothing about
staleness. What a stale schedule changes is its *edge*,
``lam_edge``: the smallest curvature at which ``ρ`` reaches 1 (:func:`stability_edge`). A schedule is
accepted when ``lam <= margin * lam_edge``. ``margin < 1`` absorbs what the estimate does not see:
``lam`` is measured on one mini-batch at one moment, and in early training the sharpness grows
(progressive sharpening, Cohen et al. 2021) until it reaches the edge of the schedule in use. Default
:data:`DEFAULT_MARGIN` = 0.5: the schedule must survive twice the measured curvature, because early
training does sharpen towards torch DDP's edge, which lies far above a stale schedule's (measured on the
digits CNN: benchmarks/results/stability.md).

A schedule whose edge is torch DDP's (every lag-free schedule, merged or not) is never rejected on
these grounds: training tends to sit near DDP's own edge (the "edge of stability"), where a margin
would reject DDP too, and rejecting would only fall back to a schedule no more stable.

Beyond the linear model: on a real, non-quadratic loss an unstable direction need not diverge: the
oscillation along it raises the loss until the sharpness falls back (self-stabilisation). So
``ρ >= 1`` predicts oscillation and lost progress along the sharpest directions, not necessarily NaN.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from deft._json import JsonDict
from deft.errors import ContractError
from deft.schedule import Schedule

if TYPE_CHECKING:  # pragma: no cover
    import torch

_SOURCE = "stability"

#: Accept a schedule when the measured top curvature is at most this fraction of its stability edge.
DEFAULT_MARGIN = 0.5

#: Range of ``h = step * lam`` searched for the edge, and the grid density (points per decade).
_H_MIN, _H_MAX, _PER_DECADE = 1e-9, 1e4, 24


def _num(source: str, name: str, value: object, low: float | None = None, high: float | None = None,
         open_low: bool = False, open_high: bool = False) -> float:
    """``value`` as a finite float within the given bounds, else a ContractError naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ContractError(source, name, f"expected a finite number, got {value!r}")
    x = float(value)
    if low is not None and (x <= low if open_low else x < low):
        raise ContractError(source, name, f"expected {'>' if open_low else '>='} {low}, got {x}")
    if high is not None and (x >= high if open_high else x > high):
        raise ContractError(source, name, f"expected {'<' if open_high else '<='} {high}, got {x}")
    return x


#: The keys of a torch param group that hold a learning rate the run uses or will reach: ``lr`` now,
#: ``initial_lr`` (every torch LR scheduler's base: the peak of a warm-up, which scales it by at most 1)
#: and ``max_lr`` (OneCycleLR's peak).
LR_KEYS = ("lr", "initial_lr", "max_lr")


def planning_lr(param_groups: Sequence[Mapping[str, object]]) -> float:
    """The learning rate a plan is judged at: the largest value of :data:`LR_KEYS` over the groups.

    Read from ``param_groups`` only (what torch's schedulers write there), so it needs neither the
    scheduler object nor torch; 0.0 when no group has a positive one."""
    best = 0.0
    for g in param_groups:
        for key in LR_KEYS:
            v = g.get(key)
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v)):
                best = max(best, float(v))
    return best


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer's linear update rule along one direction (see the module docstring).

    * ``kind``: ``"sgd"`` or ``"adam"`` (Adam and AdamW; ``decoupled_weight_decay`` tells them apart);
    * ``lr``: the optimizer's learning rate ``eta``;
    * ``momentum``: SGD's ``β`` or Adam's ``β₁``; ``dampening`` and ``nesterov``: SGD's;
    * ``weight_decay``: ``ω``; ``decoupled_weight_decay``: AdamW's ``w ← (1 - eta ω) w``;
    * ``scale``: Adam's per-coordinate factor ``1 / (√v̂ + eps)`` summarised as one number (1 when
      ``lam`` is the preconditioned curvature); must be 1 for SGD.

    The update moves ``w`` by ``step * (…)`` with ``step = lr * scale``.
    """

    kind: str
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    scale: float = 1.0

    def __post_init__(self) -> None:
        src = "optimizer spec"
        if self.kind not in ("sgd", "adam"):
            raise ContractError(src, "kind", f"expected 'sgd' or 'adam', got {self.kind!r}")
        _num(src, "lr", self.lr, 0.0, open_low=True)
        _num(src, "momentum", self.momentum, 0.0, 1.0, open_high=True)
        _num(src, "dampening", self.dampening, 0.0, 1.0)
        _num(src, "weight_decay", self.weight_decay, 0.0)
        _num(src, "scale", self.scale, 0.0, open_low=True)
        if self.kind == "sgd":
            if self.nesterov and (self.momentum == 0.0 or self.dampening != 0.0):
                raise ContractError(src, "nesterov", "Nesterov momentum needs momentum > 0 and dampening 0 "
                                                     f"(got momentum {self.momentum}, dampening {self.dampening})")
            if self.decoupled_weight_decay:
                raise ContractError(src, "decoupled_weight_decay", "only Adam (AdamW) decouples weight decay")
            if self.scale != 1.0:
                raise ContractError(src, "scale", f"SGD has no per-coordinate step: expected 1, got {self.scale}")
        else:
            if self.nesterov:
                raise ContractError(src, "nesterov", "Adam with Nesterov momentum (NAdam) is not modelled")
            if self.dampening != 0.0:
                raise ContractError(src, "dampening", "Adam has no dampening")

    @property
    def step(self) -> float:
        """The step multiplying the update direction: ``lr * scale``."""
        return self.lr * self.scale

    @classmethod
    def sgd(cls, lr: float, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
            weight_decay: float = 0.0) -> OptimizerSpec:
        return cls("sgd", lr, momentum, dampening, nesterov, weight_decay)

    @classmethod
    def adam(cls, lr: float, beta1: float = 0.9, scale: float = 1.0, weight_decay: float = 0.0,
             decoupled_weight_decay: bool = False) -> OptimizerSpec:
        return cls("adam", lr, beta1, weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
                   scale=scale)

    @classmethod
    def from_torch(cls, optimizer: torch.optim.Optimizer, scale: float = 1.0) -> OptimizerSpec:
        """From a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` (read from ``param_groups``; torch not imported).

        Groups must agree on everything but ``lr`` and ``weight_decay``; the spec takes the largest
        :func:`planning_lr` and the smallest ``weight_decay``, the hardest combination to pass (module
        docstring, "Parameter groups and the learning rate judged"). ``scale`` is Adam's (see the class
        docstring).
        """
        name = type(optimizer).__name__
        groups = getattr(optimizer, "param_groups", None)
        if name not in ("SGD", "Adam", "AdamW") or not groups:
            raise ContractError("optimizer", "type", f"expected torch.optim.SGD, Adam or AdamW, got {name}; "
                                                     "build an OptimizerSpec by hand for other optimizers")
        keys = ("momentum", "dampening", "nesterov") if name == "SGD" else \
            ("betas", "decoupled_weight_decay", "amsgrad")
        first = groups[0]
        for i, g in enumerate(groups[1:], start=1):
            for key in keys:
                if g.get(key) != first.get(key):
                    raise ContractError("optimizer", f"param_groups[{i}].{key}",
                                        f"differs from param_groups[0] ({g.get(key)!r} vs {first.get(key)!r}); "
                                        "build an OptimizerSpec by hand")
        for key, why in (("maximize", "ascends the loss: the recurrence here is for descent"),
                         ("amsgrad", "AMSGrad's max of second moments is not modelled")):
            if first.get(key):
                raise ContractError("optimizer", f"param_groups[0].{key}", f"{why}; build an OptimizerSpec by hand")
        lr = planning_lr(groups)
        decay = min(float(g.get("weight_decay", 0.0) or 0.0) for g in groups)
        if name == "SGD":
            return cls.sgd(lr, first["momentum"], first["dampening"], bool(first["nesterov"]), decay)
        decoupled = name == "AdamW" or bool(first.get("decoupled_weight_decay", False))
        return cls.adam(lr, float(first["betas"][0]), scale, decay, decoupled)

    def to_dict(self) -> JsonDict:
        return {"kind": self.kind, "lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "nesterov": self.nesterov, "weight_decay": self.weight_decay,
                "decoupled_weight_decay": self.decoupled_weight_decay, "scale": self.scale}


@dataclass(frozen=True)
class AppliedUpdate:
    """An update applied after an iteration's optimizer step: it averages gradients ``lags`` iterations old.

    ``lags[i] = apply_after - positions[i]`` (in the group's position order, so decreasing);
    ``group`` is the index in ``Schedule.updates`` (-1 for hand-made plans).
    """

    lags: tuple[int, ...]
    group: int = -1

    def __post_init__(self) -> None:
        if not self.lags or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.lags):
            raise ContractError(_SOURCE, "lags", f"expected a non-empty tuple of integers >= 0, got {self.lags!r}")

    @property
    def k(self) -> int:
        return len(self.lags)

    @property
    def staleness(self) -> int:
        """Iterations between the last gradient it holds and its application (0: lag-free)."""
        return min(self.lags)


#: Per cycle position, the updates applied after that position's optimizer step, in order.
Plan = tuple[tuple[AppliedUpdate, ...], ...]


def applied_updates(schedule: Schedule) -> Plan:
    """The delay structure of ``schedule``: for each position, the updates applied after its step.

    Pure function of ``schedule.updates`` (the communication stages only decide *whether* an
    ``apply_after`` is feasible, which :meth:`Schedule.validate` has checked). See the module docstring.
    """
    plan = []
    for p in range(schedule.cycle):
        due = []
        for g, _back in schedule.updates_due(p):
            u = schedule.updates[g]
            due.append(AppliedUpdate(lags=tuple(u.apply_after - q for q in u.positions), group=g))
        plan.append(tuple(due))
    return tuple(plan)


def delayed_plan(delay: int, k: int = 1) -> Plan:
    """The plan of a steady pipeline: every ``k`` iterations one update averaging those ``k`` gradients,
    applied ``delay`` iterations after the last of them (``k = 1, delay = 0``: torch DDP)."""
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ContractError(_SOURCE, "delay", f"expected an integer >= 0, got {delay!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ContractError(_SOURCE, "k", f"expected an integer >= 1, got {k!r}")
    upd = AppliedUpdate(lags=tuple(delay + k - 1 - i for i in range(k)))
    return (*(() for _ in range(k - 1)), (upd,))


def _as_plan(plan_or_schedule: Schedule | Sequence[Sequence[AppliedUpdate]]) -> Plan:
    if isinstance(plan_or_schedule, Schedule):
        return applied_updates(plan_or_schedule)
    plan = tuple(tuple(due) for due in plan_or_schedule)
    if not plan:
        raise ContractError(_SOURCE, "plan", "expected at least one cycle position")
    if not any(plan):
        raise ContractError(_SOURCE, "plan", "no update is ever applied: the parameters never move")
    for p, due in enumerate(plan):
        for j, u in enumerate(due):
            if not isinstance(u, AppliedUpdate):
                raise ContractError(_SOURCE, f"plan[{p}][{j}]", f"expected an AppliedUpdate, got {type(u).__name__}")
    return plan


def _update_matrix(n: int, lags: tuple[int, ...], lam: float, spec: OptimizerSpec) -> np.ndarray:
    """One optimizer step on the extended state ``(w, w_t, w_{t-1}, …, w_{t-L}, b)`` (size ``n``).

    Index 0 is the current parameters ``w``, index ``1 + j`` the point of the gradient ``j`` iterations
    back (``j = 0``: this iteration's), index ``n - 1`` the momentum buffer / first moment ``b``.
    Rows are linear forms in the old state; rows of unchanged entries are the identity's.
    """
    w, b = 0, n - 1
    e = np.eye(n)
    d = np.zeros(n)  # the gradient the optimizer sees: lam * mean of the lagged points (+ coupled decay)
    for j in lags:
        d[1 + j] += lam / len(lags)
    beta = spec.momentum
    m = e.copy()
    if spec.kind == "sgd":
        d[w] += spec.weight_decay
        if beta == 0.0:
            direction, new_b = d, np.zeros(n)  # no buffer: its slot stays 0 (eigenvalue 0)
        else:
            new_b = beta * e[b] + (1.0 - spec.dampening) * d
            direction = d + beta * new_b if spec.nesterov else new_b
        m[w] = e[w] - spec.step * direction
    else:
        if not spec.decoupled_weight_decay:
            d[w] += spec.weight_decay
        new_b = beta * e[b] + (1.0 - beta) * d
        decay = 1.0 - spec.lr * spec.weight_decay if spec.decoupled_weight_decay else 1.0
        m[w] = decay * e[w] - spec.step * new_b
    m[b] = new_b
    return m


def transfer_matrix(plan: Schedule | Sequence[Sequence[AppliedUpdate]], lam: float, spec: OptimizerSpec
                    ) -> np.ndarray:
    """``T = M_{N-1} ⋯ M_0`` on the state ``(w_t, w_{t-1}, …, w_{t-L}, b)`` at a cycle boundary."""
    plan = _as_plan(plan)
    lam = _num(_SOURCE, "lam", lam)
    max_lag = max((j for due in plan for u in due for j in u.lags), default=0)
    hist = max_lag + 1  # gradient points w_t .. w_{t-L} after this iteration's push
    n_state = 1 + max_lag + 1  # between iterations: w, w_{t-1} .. w_{t-L}, b
    n_ext = 1 + hist + 1
    # push: the extended state's w_t slot is w; older slots shift by one; the oldest falls out at drop
    push = np.zeros((n_ext, n_state))
    push[0, 0] = 1.0
    push[1, 0] = 1.0
    for j in range(1, hist):
        push[1 + j, j] = 1.0
    push[n_ext - 1, n_state - 1] = 1.0
    drop = np.zeros((n_state, n_ext))
    drop[0, 0] = 1.0
    for j in range(1, hist):  # w_{t-1} .. w_{t-L} of the next iteration = w_t .. w_{t-L+1} of this one
        drop[j, j] = 1.0
    drop[n_state - 1, n_ext - 1] = 1.0
    t = np.eye(n_state)
    for due in plan:
        step = np.eye(n_ext)
        for u in due:
            step = _update_matrix(n_ext, u.lags, lam, spec) @ step
        t = drop @ step @ push @ t
    return t


def cycle_radius(plan: Schedule | Sequence[Sequence[AppliedUpdate]], lam: float, spec: OptimizerSpec) -> float:
    """Per-iteration spectral radius ``max |eig T| ^ (1 / N)`` (``N``: the cycle length)."""
    p = _as_plan(plan)
    rho = float(np.max(np.abs(np.linalg.eigvals(transfer_matrix(p, lam, spec)))))
    return rho ** (1.0 / len(p))


def schedule_radius(schedule: Schedule, lam: float, optimizer_spec: OptimizerSpec) -> float:
    """Per-iteration spectral radius of ``schedule``'s update recurrence at curvature ``lam``: stable iff < 1."""
    if not isinstance(schedule, Schedule):
        raise ContractError(_SOURCE, "schedule", f"expected a deft Schedule, got {type(schedule).__name__}")
    return cycle_radius(schedule, lam, optimizer_spec)


def stability_edge(plan: Schedule | Sequence[Sequence[AppliedUpdate]], spec: OptimizerSpec) -> float:
    """The smallest curvature ``lam > 0`` at which the radius reaches 1 (``inf`` if none up to
    ``1e4 / step``); found on a geometric grid of ``h = step * lam`` then refined by Brent's method."""
    from scipy.optimize import brentq  # scipy only when an edge is asked for

    p = _as_plan(plan)
    hs = np.geomspace(_H_MIN, _H_MAX, round(math.log10(_H_MAX / _H_MIN) * _PER_DECADE) + 1)

    def excess(h: float) -> float:
        return cycle_radius(p, h / spec.step, spec) - 1.0

    prev = None
    for h in hs:
        if excess(h) >= 0.0:
            if prev is None:
                return float(h / spec.step)
            return float(brentq(excess, prev, h, xtol=1e-12 * h, rtol=1e-10) / spec.step)
        prev = h
    return math.inf


@dataclass(frozen=True)
class StabilityCheck:
    """Outcome of :func:`check_stability`.

    ``edge``: the schedule's stability edge; ``ddp_edge``: torch DDP's (no delay) for the same optimizer;
    ``radius``: the per-iteration radius at ``lam``. ``stable`` iff ``lam <= margin * edge``, or the
    schedule is as stable as torch DDP (``edge >= ddp_edge``).
    """

    lam: float
    radius: float
    edge: float
    ddp_edge: float
    margin: float
    stable: bool

    @property
    def as_stable_as_ddp(self) -> bool:
        return self.edge >= self.ddp_edge * (1.0 - 1e-9)

    @property
    def reason(self) -> str:
        if self.as_stable_as_ddp:
            return f"stability edge {self.edge:.4g} is torch DDP's ({self.ddp_edge:.4g}): never rejected on stability"
        verdict = "within" if self.stable else "beyond"
        return (f"top curvature {self.lam:.4g} {verdict} {self.margin:g} x the stability edge {self.edge:.4g} "
                f"(torch DDP's: {self.ddp_edge:.4g}; radius {self.radius:.4f} per iteration)")

    def to_dict(self) -> JsonDict:
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {"lam": self.lam, "radius": self.radius, "edge": finite(self.edge), "ddp_edge": finite(self.ddp_edge),
                "margin": self.margin, "stable": self.stable}


def check_stability(schedule: Schedule | Sequence[Sequence[AppliedUpdate]], lam: float, spec: OptimizerSpec,
                    margin: float = DEFAULT_MARGIN) -> StabilityCheck:
    """Radius at ``lam``, the edges, and the decision (see the module docstring, "The margin").

    Stable when ``lam <= margin * edge``; also when ``lam <= 0`` (no positive curvature: steps along a
    negative-curvature direction grow, but that is descent away from a saddle), and when the schedule's
    edge is torch DDP's own (every lag-free schedule, merged or not): such a schedule is never rejected
    on stability grounds, since near the edge of stability DDP itself would be, and rejecting would
    only fall back to a schedule no more stable.
    """
    lam = _num(_SOURCE, "lam", lam)
    margin = _num(_SOURCE, "margin", margin, 0.0, 1.0, open_low=True)
    edge = stability_edge(schedule, spec)
    ddp_edge = stability_edge(delayed_plan(0), spec)
    radius = cycle_radius(schedule, lam, spec)
    stable = lam <= 0.0 or lam <= margin * edge or edge >= ddp_edge * (1.0 - 1e-9)
    return StabilityCheck(lam=lam, radius=radius, edge=edge, ddp_edge=ddp_edge, margin=margin, stable=stable)


def is_stable(schedule: Schedule | Sequence[Sequence[AppliedUpdate]], lam: float, spec: OptimizerSpec,
              margin: float = DEFAULT_MARGIN) -> bool:
    """The decision of :func:`check_stability`."""
    return check_stability(schedule, lam, spec, margin).stable
