"""The Preserver (DeFT section IV.C): keep convergence close to plain data parallelism.

* :mod:`~deft.preserver.gaussian_walk`: expected loss after steps of given batch sizes (Yin et al.'s
  Gaussian walk with rebound) and the convergence ratio of a batch-size sequence.
* :mod:`~deft.preserver.noise`: estimate the walk's ``mu`` and ``sigma`` from per-rank gradient statistics.
* :mod:`~deft.preserver.feedback`: the accept / grow-capacity / re-plan loop and the periodic re-check.
* :mod:`~deft.preserver.curvature`: the top Hessian eigenvalue of the training loss (Lanczos or power
  iteration on Hessian-vector products; a secant estimate without a loss closure).
* :mod:`~deft.preserver.stability`: the spectral radius of a schedule's delayed/merged update recurrence
  along that direction, for SGD (momentum, Nesterov) and Adam/AdamW, and the accept/reject rule.

Torch-free except :class:`~deft.preserver.noise.DirectionPair`, :func:`~deft.preserver.noise.local_stats` and
:func:`~deft.preserver.noise.all_gather_stats` and the estimators of :mod:`~deft.preserver.curvature`
(they import torch when called).
"""

from __future__ import annotations

from deft.preserver.curvature import CurvatureEstimate, SecantCurvature, top_eigenvalue
from deft.preserver.feedback import (
    PreserveResult,
    Recheck,
    RecheckDecision,
    Try,
    WalkStats,
    passes,
    preserve,
    schedule_ratio,
)
from deft.preserver.gaussian_walk import (
    convergence_ratio,
    expected_loss_after,
    expected_next_loss,
    expected_trajectory,
)
from deft.preserver.noise import (
    DirectionPair,
    LocalStats,
    NoiseEstimate,
    NoiseEstimator,
    StepEstimate,
    step_estimate,
)
from deft.preserver.stability import (
    AppliedUpdate,
    OptimizerSpec,
    StabilityCheck,
    applied_updates,
    check_stability,
    is_stable,
    schedule_radius,
    stability_edge,
)

__all__ = [
    "AppliedUpdate", "CurvatureEstimate", "DirectionPair", "LocalStats", "NoiseEstimate", "NoiseEstimator",
    "OptimizerSpec", "PreserveResult", "Recheck", "RecheckDecision", "SecantCurvature", "StabilityCheck",
    "StepEstimate", "Try", "WalkStats", "applied_updates", "check_stability", "convergence_ratio",
    "expected_loss_after", "expected_next_loss", "expected_trajectory", "is_stable", "passes", "preserve",
    "schedule_radius", "schedule_ratio", "stability_edge", "step_estimate", "top_eigenvalue",
]
