"""The Preserver (DeFT section IV.C): keep convergence close to plain data parallelism.

* :mod:`~deft.preserver.gaussian_walk`: expected loss after steps of given batch sizes (Yin et al.'s
  Gaussian walk with rebound) and the convergence ratio of a batch-size sequence.
* :mod:`~deft.preserver.noise`: estimate the walk's ``mu`` and ``sigma`` from per-rank gradient statistics.
* :mod:`~deft.preserver.feedback`: the accept / grow-capacity / re-plan loop and the periodic re-check.

Torch-free except :class:`~deft.preserver.noise.DirectionPair`, :func:`~deft.preserver.noise.local_stats` and
:func:`~deft.preserver.noise.all_gather_stats` (they import torch when called).
"""

from __future__ import annotations

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

__all__ = [
    "DirectionPair", "LocalStats", "NoiseEstimate", "NoiseEstimator", "PreserveResult", "Recheck", "RecheckDecision",
    "StepEstimate", "Try", "WalkStats", "convergence_ratio", "expected_loss_after", "expected_next_loss",
    "expected_trajectory", "passes", "preserve", "schedule_ratio", "step_estimate",
]
