"""Estimate the walk's ``mu`` and ``sigma`` from what data parallelism computes anyway.

What is estimated
-----------------
The Gaussian walk (:mod:`deft.preserver.gaussian_walk`) needs, at the current parameters, the mean and
per-sample variance of the loss decrease per unit learning rate ``Δ = g · g_B`` (Yin et al. 2017)::

    mu = |g|²                    (squared norm of the true gradient g)
    sigma² = gᵀ Σ g              (Σ: covariance of the per-sample gradients)

so that ``Var Δ = sigma² / B`` for a batch of ``B`` samples.

What data parallelism gives for free
------------------------------------
``R`` ranks (or *parts*) each compute a local gradient ``g_r`` over ``b`` samples; the all-reduce gives
``ḡ = mean_r g_r`` over ``R b`` samples. With ``g_r = g + e_r``, ``E e_r = 0``, ``Cov e_r = Σ / b``,
independent across ranks:

* ``A = mean_r |g_r|²`` has mean ``|g|² + tr Σ / b``; ``G = |ḡ|²`` has mean ``|g|² + tr Σ / (R b)``.
  Hence the unbiased estimators (McCandlish et al. 2018, "An empirical model of large-batch training")::

      tr Σ  ≈ b R (A - G) / (R - 1)
      |g|²  ≈ (R G - A) / (R - 1)          (may come out negative when the noise dominates)

* ``sigma² = gᵀ Σ g`` needs the direction of ``g``, which no single step knows well: when the noise
  is comparable to the signal, the previous averaged gradient ``u`` points mostly along noise, and
  ``uᵀ Σ u`` (or ``ûᵀ Σ û |g|²``) is dominated by ``tr(Σ²) / (R b)``. On a small MLP (tests) that
  overestimated ``sigma²`` 30-fold. Two directions ``u_a``, ``u_b`` whose noises are independent of
  each other and of this step's samples remove that bias: the projections ``p_r = g_r · u_a`` and
  ``q_r = g_r · u_b`` have covariance ``u_aᵀ Σ u_b / b`` across ranks, so::

      C = b * sum_r (p_r - p̄)(q_r - q̄) / (R - 1)      has  E[C] = E[u_a]ᵀ Σ E[u_b]
      D = u_a · u_b                                   has  E[D] = E[u_a] · E[u_b]

  and when both directions average gradients of (nearly) the current point, ``E[u] = g``, so
  ``E[C] / E[D] = gᵀ Σ g / |g|²`` and ``sigma² = mu * E[C] / E[D]``. :class:`NoiseEstimator` takes the
  ratio of the smoothed ``C`` and ``D`` (ratio of means, not mean of ratios: ``D`` may be tiny).
  :class:`DirectionPair` keeps the two directions as interleaved exponential averages of the
  all-reduced gradient (even steps feed ``u_a``, odd steps ``u_b``): independent by construction,
  much less noisy than one step, and identical on every rank.

Cost: per rank three scalars (``|g_r|²``, ``p_r``, ``q_r``) computed before the in-place all-reduce,
an all-gather of those ``3 R`` numbers, ``|ḡ|²`` after the all-reduce; memory for two directions.

Smoothing and counts
--------------------
One step gives ``R - 1`` degrees of freedom for each variance, so :class:`NoiseEstimator` averages
step estimates with an exponential moving average (bias-corrected, like Adam's) and reports how much
data it rests on: the effective number of steps ``n_eff = (sum w)² / sum w²`` and of samples
``n_eff * R * b``, and a standard error from the EMA of squares.

One rank
--------
With ``R = 1`` there is no spread to measure: :func:`step_estimate` returns ``None`` and the estimator
stays "unknown" (the preserver then keeps the no-delay schedule). A single process can instead pass
two half-batch gradients as two parts of ``b / 2`` samples each (gradient accumulation's micro-batches
give them for free).

Use in a training loop
----------------------
Per update (under delayed updates: per update group, whose parts then hold ``k b`` samples each)::

    pair, est = DirectionPair(), NoiseEstimator()
    ...
    local = local_stats(local_grad_pieces, pair.get(), samples_per_rank)   # before the all-reduce
    ...all-reduce (average) the gradients...
    parts = all_gather_stats(local)
    est.update(parts, sum_of_squares(averaged_pieces), pair.dot())        # dot of the SAME directions
    pair.observe(averaged_pieces)                                         # only after update()
    stats = WalkStats.from_estimate(smoothed_loss, est.estimate, lr, world_size * batch_per_rank)

In the optimizer's metric
-------------------------
For Adam/AdamW the walk needs ``mu_P = gᵀ P g`` and ``sigma_P² = gᵀ P Σ P g`` with Adam's
preconditioner ``P = diag(1 / (sqrt(v̂) + eps))`` (:mod:`deft.preserver.gaussian_walk`, "The walk in the
optimizer's geometry"). Everything above holds for any fixed linear map of the gradients: scaling every
rank's local gradient (and so their average) elementwise by ``r = sqrt(P)`` gives ``g_r -> r g_r``,
``g -> r g``, ``Σ -> R Σ R`` (``R = diag r``), hence ``|r g|² = mu_P`` and
``(r g)ᵀ (R Σ R) (r g) = sigma_P²``: the same estimators on scaled gradients, with the directions
(:class:`DirectionPair`) fed the scaled averages too. :func:`walk_geometry` gives ``r`` per parameter
(``None`` for SGD: the Euclidean metric, ``r = 1``) and the walk's ``lr``. The scaled ``tr(R Σ R)`` is
not the raw ``tr Σ`` (the secant curvature's noise correction needs the raw one).

Everything except :class:`DirectionPair`, :func:`local_stats`, :func:`all_gather_stats` and
:func:`walk_geometry` is torch-free.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deft.errors import ContractError
from deft.preserver.curvature import adam_denominator
from deft.preserver.float64 import dot64
from deft.preserver.stability import planning_lr

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import torch.distributed as dist

_SOURCE = "noise statistics"
#: The metrics the walk's statistics are measured in: plain gradients, or Adam-preconditioned ones.
WALK_METRICS = ("euclidean", "adam")


@dataclass(frozen=True)
class WalkGeometry:
    """How the walk sees the optimizer's step (module docstring, "In the optimizer's metric").

    ``metric``: one of :data:`WALK_METRICS`; ``lr``: the walk's learning rate (SGD with momentum ``m``:
    ``lr / (1 - m)``; Adam: ``lr``; ``None`` when the optimizer is unknown or its ``lr`` is not
    positive); ``roots``: per parameter, ``sqrt(P)`` to scale its gradient by (``None``: Euclidean).
    ``why``: a sentence for logs when ``lr`` is ``None`` or the metric fell back to Euclidean.
    """

    metric: str
    lr: float | None
    roots: list[torch.Tensor] | None = None
    why: str = ""


@dataclass(frozen=True)
class LocalStats:
    """One rank's (part's) scalars for one step.

    ``sq_norm = |g_r|²``; ``proj_a = g_r · u_a`` and ``proj_b = g_r · u_b`` on the two directions of
    :class:`DirectionPair` (``None`` until both exist); ``batch`` = samples behind ``g_r``.
    """

    sq_norm: float
    proj_a: float | None
    proj_b: float | None
    batch: int


@dataclass(frozen=True)
class StepEstimate:
    """Single-step estimates (see the module docstring): ``mu``, ``trace`` and ``cross`` are unbiased
    for ``|g|²``, ``tr Σ`` and ``u_aᵀ Σ u_b``; ``dot = u_a · u_b``. ``cross`` and ``dot`` are ``None``
    without directions."""

    mu: float
    trace: float
    cross: float | None
    dot: float | None
    parts: int
    batch: int


@dataclass(frozen=True)
class NoiseEstimate:
    """Smoothed statistics for the walk: ``mu``, ``sigma`` and what they rest on.

    ``mu`` is clamped at 0 (the walk needs ``|g|² >= 0``). ``rho = gᵀΣg / |g|²`` is the ratio of the
    smoothed ``cross`` and ``dot``; it and ``sigma = sqrt(mu * rho)`` are ``None`` until directions
    exist and while the smoothed ``dot <= 0`` (the directions do not yet agree on a gradient).
    ``steps`` and ``samples`` are effective counts of the EMA; the standard errors assume independent
    steps (optimistic for ``rho``: consecutive directions are correlated).
    """

    mu: float
    sigma: float | None
    trace: float
    rho: float | None
    mu_stderr: float
    rho_stderr: float | None
    steps: float
    samples: float
    unknown_steps: int

    @property
    def sigma2(self) -> float | None:
        return None if self.sigma is None else self.sigma * self.sigma

    @property
    def noise_scale(self) -> float:
        """``tr Σ / |g|²``: the batch at which noise and signal are equal (inf when ``mu == 0``)."""
        return math.inf if self.mu <= 0.0 else self.trace / self.mu


def _num(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ContractError(_SOURCE, name, f"expected a finite number, got {value!r}")
    return float(value)


def step_estimate(parts: Sequence[LocalStats], mean_sq_norm: float,
                  directions_dot: float | None = None) -> StepEstimate | None:
    """Estimates from ``R`` parts' :class:`LocalStats`, ``|ḡ|²`` of their average and ``u_a · u_b``.

    Returns ``None`` for a single part (no spread to measure). All parts must have the same batch
    (the all-reduce averages them with equal weights). ``cross`` is given only when every part has
    both projections and ``directions_dot`` is given.
    """
    if len(parts) == 0:
        raise ContractError(_SOURCE, "parts", "expected the statistics of at least one rank, got none")
    for i, p in enumerate(parts):
        if _num(f"parts[{i}].sq_norm", p.sq_norm) < 0:
            raise ContractError(_SOURCE, f"parts[{i}].sq_norm", f"expected >= 0, got {p.sq_norm}")
        if isinstance(p.batch, bool) or not isinstance(p.batch, numbers.Integral) or p.batch < 1:
            raise ContractError(_SOURCE, f"parts[{i}].batch", f"expected a positive integer, got {p.batch!r}")
        if p.batch != parts[0].batch:
            raise ContractError(_SOURCE, f"parts[{i}].batch",
                                f"all parts must average the same number of samples, got {p.batch} and "
                                f"{parts[0].batch}")
        for name in ("proj_a", "proj_b"):
            if getattr(p, name) is not None:
                _num(f"parts[{i}].{name}", getattr(p, name))
    g2 = _num("mean_sq_norm", mean_sq_norm)
    if g2 < 0:
        raise ContractError(_SOURCE, "mean_sq_norm", f"expected >= 0, got {mean_sq_norm}")
    dot = None if directions_dot is None else _num("directions_dot", directions_dot)
    r = len(parts)
    if r == 1:
        return None
    b = int(parts[0].batch)
    a = math.fsum(p.sq_norm for p in parts) / r
    trace = b * r * (a - g2) / (r - 1)
    mu = (r * g2 - a) / (r - 1)
    cross = None
    projections = [(a, b) for a, b in ((p.proj_a, p.proj_b) for p in parts) if a is not None and b is not None]
    if dot is not None and len(projections) == r:
        pa = [float(a) for a, _ in projections]
        pb = [float(b) for _, b in projections]
        ma, mb = math.fsum(pa) / r, math.fsum(pb) / r
        cross = b * math.fsum((x - ma) * (y - mb) for x, y in zip(pa, pb, strict=True)) / (r - 1)
    return StepEstimate(mu=mu, trace=trace, cross=cross, dot=None if cross is None else dot, parts=r, batch=b)


class _Ema:
    """Bias-corrected exponential moving average with effective sample count and standard error."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = 0.0     # sum of weights
        self.w2 = 0.0    # sum of squared weights
        self.x = 0.0     # weighted sum of values
        self.xx = 0.0    # weighted sum of squared values

    def add(self, value: float) -> None:
        d = self.decay
        self.w = d * self.w + 1.0
        self.w2 = d * d * self.w2 + 1.0
        self.x = d * self.x + value
        self.xx = d * self.xx + value * value

    @property
    def seen(self) -> bool:
        return self.w > 0.0

    @property
    def mean(self) -> float:
        return self.x / self.w

    @property
    def n_eff(self) -> float:
        return self.w * self.w / self.w2

    @property
    def stderr(self) -> float:
        """Standard error of the mean of i.i.d. values under these weights (inf from one value)."""
        n = self.n_eff
        if n <= 1.0 + 1e-12:
            return math.inf
        var = max(self.xx / self.w - self.mean ** 2, 0.0) * n / (n - 1.0)
        return math.sqrt(var / n)


class NoiseEstimator:
    """Smooths :class:`StepEstimate` s over steps; ``decay`` in ``[0, 1)`` is the EMA factor per step.

    ``decay = 0.95`` rests on about 39 effective steps once warm; parameters move between steps, so a
    longer memory trades bias (stale statistics) for variance.
    """

    def __init__(self, decay: float = 0.95) -> None:
        d = _num("decay", decay)
        if not 0.0 <= d < 1.0:
            raise ContractError(_SOURCE, "decay", f"expected a number in [0, 1), got {decay!r}")
        self._mu = _Ema(d)
        self._trace = _Ema(d)
        self._cross = _Ema(d)
        self._dot = _Ema(d)
        self._samples_per_step = 0
        self.unknown_steps = 0

    def update(self, parts: Sequence[LocalStats], mean_sq_norm: float,
               directions_dot: float | None = None) -> NoiseEstimate | None:
        """Add one step's statistics; returns the current estimate (``None`` while unknown)."""
        return self.add(step_estimate(parts, mean_sq_norm, directions_dot))

    def add(self, step: StepEstimate | None) -> NoiseEstimate | None:
        if step is None:
            self.unknown_steps += 1
        else:
            self._mu.add(step.mu)
            self._trace.add(step.trace)
            if step.cross is not None and step.dot is not None:
                self._cross.add(step.cross)
                self._dot.add(step.dot)
            self._samples_per_step = step.parts * step.batch
        return self.estimate

    @property
    def estimate(self) -> NoiseEstimate | None:
        if not self._mu.seen:
            return None
        mu = max(self._mu.mean, 0.0)
        rho = rho_se = None
        if self._cross.seen and self._dot.mean > 0.0:
            c, d = self._cross.mean, self._dot.mean
            rho = max(c / d, 0.0)
            # Delta method for a ratio of means, ignoring their covariance.
            rho_se = math.hypot(self._cross.stderr / d, c * self._dot.stderr / (d * d))
        return NoiseEstimate(
            mu=mu,
            sigma=None if rho is None else math.sqrt(mu * rho),
            trace=max(self._trace.mean, 0.0),
            rho=rho,
            mu_stderr=self._mu.stderr,
            rho_stderr=rho_se,
            steps=self._mu.n_eff,
            samples=self._mu.n_eff * self._samples_per_step,
            unknown_steps=self.unknown_steps,
        )


# -- torch helpers (torch is imported only inside them) ----------------------------------------------
class DirectionPair:
    """Two directions with independent noise: interleaved EMAs of the all-reduced gradient.

    Call :meth:`observe` with the averaged gradient pieces after every step's all-reduce; even
    observations feed ``u_a``, odd ones ``u_b`` (each EMA with ``decay`` per observation it gets).
    Every rank holds identical copies, since it only sees all-reduced gradients. Memory: two float32
    copies of the gradient. Before both exist :meth:`get` returns ``None``.
    """

    def __init__(self, decay: float = 0.9) -> None:
        d = _num("decay", decay)
        if not 0.0 <= d < 1.0:
            raise ContractError(_SOURCE, "decay", f"expected a number in [0, 1), got {decay!r}")
        self.decay = d
        self._dirs: list[list[torch.Tensor] | None] = [None, None]
        self._count = 0

    def observe(self, averaged: Sequence[torch.Tensor]) -> None:
        import torch

        slot = self._count % 2
        self._count += 1
        cur = self._dirs[slot]
        if cur is None:
            self._dirs[slot] = [g.detach().reshape(-1).to(torch.float32).clone() for g in averaged]
            return
        if len(cur) != len(averaged):
            raise ContractError(_SOURCE, "averaged", f"expected {len(cur)} gradient pieces, got {len(averaged)}")
        for u, g in zip(cur, averaged, strict=True):
            u.mul_(self.decay).add_(g.detach().reshape(-1).to(u.dtype), alpha=1.0 - self.decay)

    def get(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        a, b = self._dirs
        return None if a is None or b is None else (a, b)

    def dot(self) -> float | None:
        """``u_a · u_b`` (float64 accumulation), ``None`` before both directions exist."""
        pair = self.get()
        if pair is None:
            return None
        return math.fsum(float(dot64(x, y)) for x, y in zip(*pair, strict=True))


def local_stats(grads: Sequence[torch.Tensor],
                directions: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None,
                batch: int) -> LocalStats:
    """This rank's :class:`LocalStats` from its flat local gradient pieces (e.g. one per bucket).

    ``directions`` is ``(u_a, u_b)`` with pieces of the same sizes (:meth:`DirectionPair.get`) or
    ``None``. Call it before the all-reduce overwrites the local gradients. Sums are accumulated in
    float64 (:func:`deft.preserver.float64.dot64`).
    """
    sq = 0.0
    proj = [0.0, 0.0]
    if directions is not None:
        for j, d in enumerate(directions):
            if len(d) != len(grads):
                raise ContractError(_SOURCE, f"directions[{j}]",
                                    f"expected {len(grads)} pieces like grads, got {len(d)}")
    for i, g in enumerate(grads):
        sq += float(dot64(g))
        if directions is not None:
            for j, d in enumerate(directions):
                u = d[i]
                if u.numel() != g.numel():
                    raise ContractError(_SOURCE, f"directions[{j}][{i}]",
                                        f"expected {g.numel()} elements like grads[{i}], got {u.numel()}")
                proj[j] += float(dot64(g, u))
    if directions is None:
        return LocalStats(sq_norm=sq, proj_a=None, proj_b=None, batch=batch)
    return LocalStats(sq_norm=sq, proj_a=proj[0], proj_b=proj[1], batch=batch)


def all_gather_stats(local: LocalStats, group: dist.ProcessGroup | None = None) -> list[LocalStats]:
    """Every rank's :class:`LocalStats` (four float64 scalars per rank through one all-gather).

    A rank without directions sends NaN projections; then nobody gets projections this step.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    pa = math.nan if local.proj_a is None else local.proj_a
    pb = math.nan if local.proj_b is None else local.proj_b
    mine = torch.tensor([local.sq_norm, pa, pb, float(local.batch)], dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    rows = [t.cpu().tolist() for t in out]
    missing = any(math.isnan(r[1]) or math.isnan(r[2]) for r in rows)
    return [LocalStats(sq_norm=r[0], proj_a=None if missing else r[1], proj_b=None if missing else r[2],
                       batch=round(r[3])) for r in rows]


def walk_geometry(optimizer: torch.optim.Optimizer | None, params: Sequence[torch.Tensor] | None = None, *,
                  with_roots: bool = True) -> WalkGeometry:
    """The walk's metric and learning rate for ``optimizer``: the ``lr`` is
    :func:`deft.preserver.stability.planning_lr` (the largest over the groups, a scheduler's base or
    peak included: the rate the plan will run at, not a warm-up's current fraction of it).

    * SGD (any other optimizer is treated alike): Euclidean; ``lr / (1 - momentum)`` with momentum in
      ``(0, 1)`` (heavy ball and Nesterov: in steady state one gradient moves the parameters that far).
    * Adam/AdamW: ``roots[i] = sqrt(1 / (sqrt(v̂_i) + eps))`` for ``params`` (default: ``param_groups``
      order) from the optimizer's ``exp_avg_sq`` and ``step`` (bias-corrected), float32 on the
      parameter's device; ``lr`` unchanged (the bias-corrected first moment's weights sum to 1). A
      parameter never stepped (no second moment: it never had a gradient) gets 0, i.e. no
      contribution. Before the first step (no second moment at all) the metric is Euclidean and
      ``why`` says so; callers that accumulate statistics restart them when the metric changes.

    ``with_roots=False`` gives the metric and ``lr`` without building ``roots`` (a copy of the model).
    """
    import torch

    if optimizer is None:
        return WalkGeometry("euclidean", None, None, "optimizer unknown")
    group = optimizer.param_groups[0]
    lr = planning_lr(optimizer.param_groups)
    if not lr > 0.0:
        return WalkGeometry("euclidean", None, None, f"learning rate {lr} is not positive")
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        order = [p for g in optimizer.param_groups for p in g["params"]] if params is None else list(params)
        where = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        roots: list[torch.Tensor] = []
        seen = False
        if not with_roots:
            seen = any(("max_exp_avg_sq" if g.get("amsgrad") else "exp_avg_sq") in optimizer.state.get(p, {})
                       for g in optimizer.param_groups for p in g["params"])
            order = []
        for p in order:
            g = where.get(id(p))
            d = None if g is None else adam_denominator(g, optimizer.state.get(p, {}), torch.float32)
            if d is None:
                roots.append(torch.zeros_like(p, dtype=torch.float32))
                continue
            seen = True
            roots.append(d.sqrt())
        if not seen:
            return WalkGeometry("euclidean", lr, None, "Adam has no second moment before its first step")
        return WalkGeometry("adam", lr, roots if with_roots else None)
    momentum = float(group.get("momentum", 0.0) or 0.0)
    if isinstance(optimizer, torch.optim.SGD) and 0.0 < momentum < 1.0:
        lr = lr / (1.0 - momentum)
    return WalkGeometry("euclidean", lr)
