"""The Gaussian walk with rebound (Yin et al., KDD 2017; DeFT section IV.C.2): expected loss per step.

Model
-----
The training loss ``s_t`` is a walk above the objective ``S*``. One optimizer step with learning rate
``lr`` and batch ``B`` moves it by ``lr * Δ`` where ``Δ`` is the loss decrease per unit learning rate,
to first order ``Δ = g · g_B`` (true gradient ``g``, batch gradient ``g_B``)::

    Δ ~ N(mu, sigma² / B),   mu = |g|²,   sigma² = gᵀ Σ g   (Σ: per-sample gradient covariance)

and a step that would overshoot ``S*`` rebounds above it by the overshoot::

    s_{t+1} = |s_t - lr Δ - S*| + S*

so ``s_{t+1} - S*`` is a folded normal with location ``m = s_t - S* - lr mu`` and scale
``tau = lr sigma / sqrt(B)``, whose mean is (``a = m / tau``)::

    E[s_{t+1}] = S* + m (Φ(a) - Φ(-a)) + tau sqrt(2/π) exp(-a²/2)

The paper prints ``lr Δs_t`` in the first factor; the mean ``lr mu_t`` belongs there (the Monte Carlo
tests check this formula against the walk itself). ``Φ(a) - Φ(-a) = erf(a / sqrt 2)`` is used for
accuracy. As ``sigma -> 0`` the step is deterministic with rebound, ``S* + |m|``.

Invariants
----------
* ``E[s_{t+1}] >= S* + |m|`` (Jensen) and ``E[s_{t+1}] <= S* + |m| + tau sqrt(2/π)``.
* ``E[s_{t+1}]`` never increases with ``B``: the folded-normal mean grows with its scale
  (``d/dtau = 2 φ(a) >= 0``) and ``tau`` falls with ``B``.
* A merged update of ``k`` iterations averages their gradients (like gradient accumulation), so it is
  ONE step of batch ``k B``: ``k`` times less noise, but one step's progress. Its learning rate is
  ``lr * f(k)`` with ``f`` from ``config.merge_lr_scaling`` (:func:`merge_lr_factor`: 1 by default,
  ``k`` for "linear", ``sqrt k`` for "sqrt"); the runtime steps with the same factor.

The walk in the optimizer's geometry
------------------------------------
The formula above is for plain SGD, ``w -= lr g_B``. The walk's one coordinate is the loss; what an
optimizer changes is the loss decrease per unit ``lr``, so ``mu``, ``sigma`` and ``lr`` must be those
of the step the optimizer really takes:

* **SGD with momentum** ``m`` (heavy ball or Nesterov): in steady state one gradient moves ``w`` by
  ``lr / (1 - m)`` in total (``sum_j m^j``), so the walk's ``lr`` is ``lr / (1 - m)``; ``mu = |g|²``,
  ``sigma² = gᵀ Σ g`` (the Euclidean metric).
* **Adam / AdamW**: the step is preconditioned, ``w -= lr P m̂`` with ``P = diag(1 / (sqrt(v̂) + eps))``
  (``v̂``: the bias-corrected ``exp_avg_sq``). In the coordinates ``z = P^(-1/2) w`` it is plain SGD
  with the same ``lr``: the gradient there is ``P^(1/2) g``, a step ``z -= lr P^(1/2) g_B`` is
  ``w -= lr P g_B``. So the walk runs in that metric: the first-order loss decrease per unit ``lr`` is
  ``Δ = gᵀ P g_B``, with::

      mu_P = gᵀ P g = |P^(1/2) g|²,    sigma_P² = gᵀ P Σ P g = (P^(1/2) g)ᵀ (P^(1/2) Σ P^(1/2)) (P^(1/2) g)

  i.e. the same estimators (:mod:`deft.preserver.noise`) applied to the gradients scaled elementwise
  by ``sqrt(P)`` (:func:`deft.preserver.noise.walk_geometry`). The first moment ``m̂`` is an
  exponential average whose weights sum to 1 (bias-corrected), so in steady state ``m̂ = g`` and one
  gradient moves ``z`` by ``lr`` in total: no momentum factor (unlike heavy-ball SGD). ``P`` is taken
  from the optimizer's state before the step (``v̂`` of the previous step: ``beta2`` is close to 1).
  Weight decay is not part of the walk. Why it matters: on the character LM (AdamW) the Euclidean walk
  with the raw ``lr`` sees each step as a tiny loss decrease, so a merge of two looks free while it
  costs validation loss in training; in Adam's metric ``mu_P`` is far larger and the walk rejects that
  merge (the statistics: benchmarks/results/preserver_validation.md, character LM).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from deft.config import MERGE_LR_SCALINGS
from deft.errors import ContractError

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SOURCE = "gaussian walk"


def _check_finite(name: str, value: float, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ContractError(_SOURCE, name, f"expected a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ContractError(_SOURCE, name, f"expected a finite number, got {value!r}")
    if minimum is not None and (v <= minimum if strict else v < minimum):
        raise ContractError(_SOURCE, name, f"expected {'>' if strict else '>='} {minimum}, got {value!r}")
    return v


def _check_loss(s: float, s_star: float, name: str = "s") -> tuple[float, float]:
    s_star = _check_finite("s_star", s_star)
    s = _check_finite(name, s)
    if s < s_star:
        raise ContractError(_SOURCE, name, f"the walk lives above the objective S* = {s_star}, got loss {s}")
    return s, s_star


def _folded_mean(m: float, tau: float) -> float:
    """E|X| for X ~ N(m, tau²), tau >= 0."""
    if tau == 0.0:
        return abs(m)
    a = m / tau  # may be ±inf for a tiny tau: erf and exp then give the deterministic limit
    if math.isinf(a):
        return abs(m)
    return m * math.erf(a / math.sqrt(2.0)) + tau * _SQRT_2_OVER_PI * math.exp(-0.5 * a * a)


def expected_next_loss(s: float, mu: float, sigma: float, lr: float, batch: float,
                       s_star: float = 0.0) -> float:
    """E[s_{t+1}] after one step of batch ``batch`` from loss ``s`` (module docstring formula).

    ``mu`` is the squared norm of the true gradient (>= 0), ``sigma`` the per-sample noise
    ``sqrt(gᵀ Σ g)`` (>= 0), ``lr`` > 0, ``batch`` > 0 (the batch of the update: for data parallelism
    the global batch, ranks x per-rank batch x merged iterations).
    """
    s, s_star = _check_loss(s, s_star)
    mu = _check_finite("mu", mu, minimum=0.0)
    sigma = _check_finite("sigma", sigma, minimum=0.0)
    lr = _check_finite("lr", lr, minimum=0.0, strict=True)
    batch = _check_finite("batch", batch, minimum=0.0, strict=True)
    m = s - s_star - lr * mu
    tau = lr * sigma / math.sqrt(batch)
    return s_star + _folded_mean(m, tau)


def _is_sequence(value: object) -> bool:
    """Lists, tuples and 1-d arrays; not strings."""
    return not isinstance(value, (str, bytes)) and hasattr(value, "__len__") and hasattr(value, "__getitem__")


def _per_step(name: str, value: float | Sequence[float], n: int) -> list[float]:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return [float(value)] * n
    if isinstance(value, (int, float)) or not _is_sequence(value):  # int: a bool, which is no number here
        raise ContractError(_SOURCE, name, f"expected a number or a sequence of {n} numbers, got {value!r}")
    if len(value) != n:
        raise ContractError(_SOURCE, name, f"expected one value per step ({n}), got {len(value)}")
    return list(value)


def expected_trajectory(s0: float, batches: Sequence[float], mu: float | Sequence[float],
                        sigma: float | Sequence[float], lr: float | Sequence[float],
                        s_star: float = 0.0) -> list[float]:
    """Expected losses ``[s0, E_1, ..., E_n]`` over steps of the given batch sizes.

    This iterates expectations, as the paper does: step ``t+1`` starts from ``E[s_t]`` instead of
    averaging the one-step formula over the distribution of ``s_t``. The first step is exact; the
    one-step mean is convex in ``s_t`` (it is ``E|s_t - c - lr Δ|``), so by Jensen the plug-in value
    of the second step is a lower bound of the walk's true mean. The error is of the order of the
    rebound term: negligible while ``s_t - S*`` is many ``tau`` above ``lr mu``, large near ``S*``.
    ``mu``, ``sigma`` and ``lr`` are constants or one value per step.
    """
    if not _is_sequence(batches):
        raise ContractError(_SOURCE, "batches", f"expected a sequence of batch sizes, got {batches!r}")
    if len(batches) == 0:
        raise ContractError(_SOURCE, "batches", "expected at least one step, got an empty sequence")
    mus = _per_step("mu", mu, len(batches))
    sigmas = _per_step("sigma", sigma, len(batches))
    lrs = _per_step("lr", lr, len(batches))
    s, s_star = _check_loss(s0, s_star, "s0")
    out = [s]
    for b, m_, sg, lr_ in zip(batches, mus, sigmas, lrs, strict=True):
        s = expected_next_loss(s, m_, sg, lr_, b, s_star)
        out.append(s)
    return out


def expected_loss_after(s0: float, batches: Sequence[float], mu: float | Sequence[float],
                        sigma: float | Sequence[float], lr: float | Sequence[float], s_star: float = 0.0) -> float:
    """Expected loss after the steps of ``batches`` (the last entry of :func:`expected_trajectory`).

    Iterating the expectation is the paper's approximation (see :func:`expected_trajectory`).
    """
    return expected_trajectory(s0, batches, mu, sigma, lr, s_star)[-1]


def merge_lr_factor(k: int, scaling: str = "none") -> float:
    """The learning-rate factor of a merged update of ``k`` iterations: 1 (``"none"``), ``k``
    (``"linear"``) or ``sqrt k`` (``"sqrt"``); 1 for ``k == 1`` whatever the scaling."""
    if scaling not in MERGE_LR_SCALINGS:
        raise ContractError(_SOURCE, "merge_lr_scaling", f"expected one of {', '.join(MERGE_LR_SCALINGS)}, "
                                                         f"got {scaling!r}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ContractError(_SOURCE, "k", f"expected a positive integer, got {k!r}")
    if scaling == "linear":
        return float(k)
    if scaling == "sqrt":
        return math.sqrt(k)
    return 1.0


def _check_k_sequence(k_sequence: Sequence[int]) -> tuple[int, ...]:
    if not _is_sequence(k_sequence):
        raise ContractError(_SOURCE, "k_sequence",
                            f"expected a sequence of positive integers, got {k_sequence!r}")
    if len(k_sequence) == 0:
        raise ContractError(_SOURCE, "k_sequence", "expected at least one update, got an empty sequence")
    for i, k in enumerate(k_sequence):
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ContractError(_SOURCE, f"k_sequence[{i}]", f"expected a positive integer, got {k!r}")
    return tuple(int(k) for k in k_sequence)


def convergence_ratio(s: float, mu: float, sigma: float, lr: float, batch: float,
                      k_sequence: Sequence[int], s_star: float = 0.0, *, window: int | None = None,
                      merge_lr_scaling: str = "none") -> float:
    """The preserver's test statistic ``E_baseline / E_schedule`` over a cycle of ``N = sum(k)`` iterations.

    Baseline ``O_B``: ``N`` steps of batch ``batch``. Schedule ``O_D``: ``m = len(k)`` steps of batch
    ``k_i * batch`` (a merged update averages its ``k_i`` gradients: one step, with learning rate
    ``lr * merge_lr_factor(k_i, merge_lr_scaling)``, the same ``lr`` by default). Both
    start from loss ``s`` with the same ``mu`` and ``sigma`` (the cycle is short against the drift of
    the statistics). A ratio below 1 means the schedule is expected to end the cycle at a higher loss
    (Table V: 0.1922 / 0.1935 = 0.993). All ``k == 1`` gives exactly 1; when both expectations are
    exactly ``0`` (``S* = 0`` reached deterministically) the ratio is defined as 1.

    ``window`` (default ``sum(k)``) is the number of baseline steps when the schedule's steps are
    only those *applied within* the window, so that ``sum(k) < window`` when delayed updates land
    after it (see :func:`deft.preserver.feedback.applied_sequence`); an empty ``k_sequence`` then
    means no update lands in the window (the schedule's loss stays at ``s``).
    """
    ks = _check_k_sequence(k_sequence) if window is None or len(k_sequence) > 0 else ()
    batch = _check_finite("batch", batch, minimum=0.0, strict=True)
    n = sum(ks) if window is None else window
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral)
                               or window < max(1, sum(ks))):
        raise ContractError(_SOURCE, "window", f"expected an integer >= sum(k_sequence) and >= 1, got {window!r}")
    e_base = expected_loss_after(s, [batch] * n, mu, sigma, lr, s_star)
    lr = _check_finite("lr", lr, minimum=0.0, strict=True)
    lrs = [lr * merge_lr_factor(k, merge_lr_scaling) for k in ks]
    e_sched = expected_loss_after(s, [k * batch for k in ks], mu, sigma, lrs, s_star) if ks else float(s)
    if e_base == e_sched:
        return 1.0
    if e_sched == 0.0:
        return math.inf
    return e_base / e_sched
