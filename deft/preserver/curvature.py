"""The sharpest curvature of the training loss: the top Hessian eigenvalue, from Hessian-vector products.

:mod:`deft.preserver.stability` needs ``lam``, the largest eigenvalue of the Hessian ``H`` of the
training loss (the mean loss over the global batch, whose gradient the all-reduce produces), at the
current parameters. Three estimates, from best to cheapest:

Lanczos (:func:`top_eigenvalue`, ``method="lanczos"``, the default)
    ``H`` is never formed: a Hessian-vector product ``Hv = ∇(∇L · v)`` costs about two backward
    passes (double backward through the graph of ``∇L``, built once with ``create_graph=True``; every
    product reuses it, so dropout masks and batch-norm batch statistics stay those of the one forward).
    :func:`scipy.sparse.linalg.eigsh` runs implicitly restarted Lanczos (ARPACK) on a
    :class:`~scipy.sparse.linalg.LinearOperator` wrapping the product, ``k=1, which="LA"``: the largest
    *algebraic* eigenvalue (the sharpest positive curvature; negative curvature does not make gradient
    steps oscillate). ``tol`` is ARPACK's relative accuracy of the eigenvalue. A product costs a few
    training steps of compute and a solve takes a few tens of them, fewer with a smaller ``ncv``
    (measured on the digits CNN: benchmarks/results/stability.md).

Power iteration (``method="power"``)
    ``v ← Hv / |Hv|`` with the Rayleigh quotient ``ρ = vᵀHv`` as the estimate, stopped when the
    residual ``|Hv - ρ v| <= tol |ρ|`` (then an eigenvalue lies within ``tol |ρ|`` of ``ρ``). Stopping
    when ``ρ`` merely stops changing is fooled when eigenvalues ``+a`` and ``-b`` of similar magnitude
    make ``v`` alternate between them: ``ρ`` then hovers near a meaningless average. Power iteration
    converges to the eigenvalue of largest *magnitude*; if that is negative, a second run on ``H - λ₋ I``
    (whose largest-magnitude eigenvalue is ``λ_max - λ₋ >= 0``) recovers ``λ_max``. The residual
    shrinks like ``|λ₂ / λ₁|^k`` (``λ₂``: the next eigenvalue in magnitude), so it is cheap when the
    top eigenvalue is well separated and slow (or out of ``maxiter``, an error) when it is not, as on
    the digits CNN at initialisation, whose most negative eigenvalue outweighs the top one (measured:
    benchmarks/results/stability.md). Lanczos searches the whole Krylov space the power iterates span,
    so (without restarts, in exact arithmetic) it is never worse per product.

Secant (:class:`SecantCurvature`), without a loss closure
    From consecutive averaged gradients and parameter steps: ``|g_t - g_{t-1}| / |x_t - x_{t-1}|``.
    Lower quality, and biased both ways: for exact gradients of a quadratic ``g_t - g_{t-1} = H Δx``,
    so the ratio is at most ``λ_max`` and equals it only when the step ``Δx`` lies in the top
    eigenspace (which it tends to when the sharpest direction oscillates, i.e. near instability); with
    mini-batch gradients, the two batches' noise adds up to ``|e_t - e_{t-1}|`` to the numerator, an
    upward bias that grows as the step shrinks. :class:`SecantCurvature` reports the median over a
    window, raw (``value``) or with the noise's expectation ``2 tr(Σ) / B`` removed (``debiased``).
    On the digits CNN it came out well below Lanczos, as the steps do not follow the sharpest direction
    there (measured: benchmarks/results/stability.md): a screen when the margin is wide, not a measurement.

Adam
    For Adam/AdamW the stability model (see :mod:`deft.preserver.stability`) needs the curvature seen
    through the per-coordinate step ``D = 1 / (√v̂ + eps)``: pass ``preconditioner=adam_preconditioner(opt)``
    to get the top eigenvalue of ``D^½ H D^½`` (exact for linearised Adam; use it with ``scale=1``), or
    summarise ``D`` by :func:`adam_scale` and use the plain ``lam`` (an approximation).

torch is imported inside the functions, as in :mod:`deft.preserver.noise`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from deft._json import JsonDict
from deft.errors import ContractError
from deft.preserver.float64 import sq_dist64

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from scipy.sparse.linalg import LinearOperator

_SOURCE = "curvature"
METHODS = ("lanczos", "power")
#: A torch optimizer's parameter group, or a parameter's optimizer state: torch types both so (the values
#: are hyper-parameters, tensors and step counts by key).
ParamGroup = dict[str, Any]


@dataclass(frozen=True)
class CurvatureEstimate:
    """The top Hessian eigenvalue ``value`` and what it cost.

    ``residual = |Hv - value v| / |value|`` for the returned unit vector ``v``: a check that ``value``
    is an eigenvalue (small residual), not that it is the *largest* one. ``hvps`` counts every
    Hessian-vector product, the residual's included.
    """

    value: float
    method: str
    hvps: int
    residual: float
    seconds: float

    def to_dict(self) -> JsonDict:
        return {"value": self.value, "method": self.method, "hvps": self.hvps, "residual": self.residual,
                "seconds": self.seconds}


def _params(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    import torch

    ps = list(params)
    if not ps:
        raise ContractError(_SOURCE, "params", "expected at least one parameter tensor")
    for i, p in enumerate(ps):
        if not isinstance(p, torch.Tensor) or not p.requires_grad:
            raise ContractError(_SOURCE, f"params[{i}]", "expected a tensor with requires_grad=True")
    return ps


def _sqrt_preconditioner(preconditioner: Sequence[torch.Tensor] | None, params: Sequence[torch.Tensor]
                         ) -> list[torch.Tensor] | None:
    import torch

    if preconditioner is None:
        return None
    pre = list(preconditioner)
    if len(pre) != len(params):
        raise ContractError(_SOURCE, "preconditioner", f"expected {len(params)} tensors (one per parameter), "
                                                       f"got {len(pre)}")
    out = []
    for i, (d, p) in enumerate(zip(pre, params, strict=True)):
        if tuple(d.shape) != tuple(p.shape):
            raise ContractError(_SOURCE, f"preconditioner[{i}]",
                                f"expected shape {tuple(p.shape)} like params[{i}], got {tuple(d.shape)}")
        if not bool(torch.all(d > 0)) or not bool(torch.all(torch.isfinite(d))):
            raise ContractError(_SOURCE, f"preconditioner[{i}]", "expected finite, positive entries")
        out.append(d.detach().to(p.dtype).sqrt())
    return out


def hessian_operator(loss: torch.Tensor, params: Sequence[torch.Tensor],
                     preconditioner: Sequence[torch.Tensor] | None = None) -> LinearOperator:
    """``v ↦ H v`` (or ``D^½ H D^½ v`` with a diagonal ``preconditioner`` ``D``) as a float64 LinearOperator.

    ``loss`` must still hold its graph (not yet ``backward()``-ed). The gradient graph is built once
    here; ``matvecs`` on the returned operator counts the products taken.
    """
    import torch
    from scipy.sparse.linalg import LinearOperator

    ps = _params(params)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
        raise ContractError(_SOURCE, "loss", "expected a scalar loss tensor that still holds its autograd graph")
    sq = _sqrt_preconditioner(preconditioner, ps)
    # allow_unused: a parameter the loss does not reach (an unused branch) has a zero gradient and a
    # zero row of H, as torch DDP's find_unused_parameters treats it.
    grads = torch.autograd.grad(loss, ps, create_graph=True, allow_unused=True)
    if all(g is None for g in grads):
        raise ContractError(_SOURCE, "loss", "expected a loss that depends on at least one of the parameters")
    sizes = [p.numel() for p in ps]
    n = sum(sizes)

    def matvec(v: np.ndarray) -> np.ndarray:
        flat = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64).reshape(-1))
        pieces = [c.reshape(p.shape).to(device=p.device, dtype=p.dtype)
                  for c, p in zip(torch.split(flat, sizes), ps, strict=True)]
        if sq is not None:
            pieces = [c * s for c, s in zip(pieces, sq, strict=True)]
        dot = sum((g * c).sum() for g, c in zip(grads, pieces, strict=True) if g is not None)
        assert isinstance(dot, torch.Tensor)  # at least one gradient exists (checked above)
        hv = torch.autograd.grad(dot, ps, retain_graph=True, allow_unused=True)
        out = [torch.zeros_like(p) if h is None else h for h, p in zip(hv, ps, strict=True)]
        if sq is not None:
            out = [h * s for h, s in zip(out, sq, strict=True)]
        op.matvecs += 1
        return torch.cat([h.detach().reshape(-1).to(torch.float64).cpu() for h in out]).numpy()

    op = LinearOperator((n, n), matvec=matvec, rmatvec=matvec, dtype=np.float64)
    op.matvecs = 0
    return op


def _power(op: LinearOperator, v0: np.ndarray, tol: float, maxiter: int, shift: float = 0.0
           ) -> tuple[float, np.ndarray]:
    """Power iteration on ``op - shift I``; returns ``(ρ + shift, v)`` with ``ρ`` its largest-magnitude
    eigenvalue, stopped when the residual is at most ``tol |ρ + shift|`` (relative to the eigenvalue of
    ``op`` sought, not the shifted one, which a large shift would make easy to match)."""
    v = v0 / np.linalg.norm(v0)
    for _ in range(maxiter):
        hv = op.matvec(v) - shift * v
        rq = float(v @ hv)
        norm = float(np.linalg.norm(hv))
        if norm == 0.0:  # v in the null space of op - shift I: shift is an eigenvalue
            return shift, v
        if float(np.linalg.norm(hv - rq * v)) <= tol * abs(rq + shift):
            return rq + shift, v
        v = hv / norm
    raise ContractError(_SOURCE, "maxiter", f"power iteration did not reach a relative residual of {tol} in "
                                            f"{maxiter} products (top eigenvalues close in magnitude?): raise "
                                            "maxiter or use method='lanczos'")


def top_eigenvalue_of(op: LinearOperator, method: str = "lanczos", tol: float = 1e-4, maxiter: int = 1000,
                      seed: int = 0, ncv: int | None = None) -> tuple[float, np.ndarray]:
    """(largest algebraic eigenvalue, unit eigenvector) of a symmetric LinearOperator.

    ``ncv``: Lanczos vectors kept between ARPACK restarts (``>= 3``; default ARPACK's, 20 for one
    eigenvalue). Each restart cycle costs about ``ncv`` products, so a smaller ``ncv`` can stop earlier
    when the top eigenvalue is well separated, at the price of more restarts when it is not.
    """
    from scipy.sparse.linalg import ArpackNoConvergence, eigsh

    if method not in METHODS:
        raise ContractError(_SOURCE, "method", f"expected one of {METHODS}, got {method!r}")
    if not (isinstance(tol, float | int) and 0.0 < tol < 1.0):
        raise ContractError(_SOURCE, "tol", f"expected a relative tolerance in (0, 1), got {tol!r}")
    if isinstance(maxiter, bool) or not isinstance(maxiter, int) or maxiter < 1:
        raise ContractError(_SOURCE, "maxiter", f"expected an integer >= 1, got {maxiter!r}")
    if ncv is not None and (isinstance(ncv, bool) or not isinstance(ncv, int) or ncv < 3):
        raise ContractError(_SOURCE, "ncv", f"expected an integer >= 3 (or None), got {ncv!r}")
    n = op.shape[0]
    v0 = np.random.default_rng(seed).standard_normal(n)
    if n < 3:  # ARPACK needs k < n - 1 working room: form the tiny matrix instead
        dense = np.column_stack([op.matvec(col) for col in np.eye(n)])
        vals, vecs = np.linalg.eigh(0.5 * (dense + dense.T))
        return float(vals[-1]), vecs[:, -1]
    if method == "lanczos":
        try:
            vals, vecs = eigsh(op, k=1, which="LA", tol=tol, v0=v0, maxiter=maxiter,
                               ncv=None if ncv is None else min(ncv, n))
        except ArpackNoConvergence as e:
            raise ContractError(_SOURCE, "maxiter", f"Lanczos (ARPACK) did not converge to tol {tol} in {maxiter} "
                                                    "restarts: raise maxiter or tol") from e
        return float(vals[0]), vecs[:, 0] / np.linalg.norm(vecs[:, 0])
    lam, v = _power(op, v0, tol, maxiter)
    if lam < 0.0:  # dominated by negative curvature: λ_max - lam is the dominant eigenvalue of H - lam I
        lam, v = _power(op, v0, tol, maxiter, shift=lam)
    return lam, v


def top_eigenvalue(closure: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], *, method: str = "lanczos",
                   tol: float = 1e-4, maxiter: int = 1000, preconditioner: Sequence[torch.Tensor] | None = None,
                   seed: int = 0, ncv: int | None = None) -> CurvatureEstimate:
    """The top Hessian eigenvalue of ``closure()`` (the loss at the current ``params``); see the module docstring.

    ``closure`` is called once (one forward, with torch's math attention kernel: the fused ones have
    no double backward); every Hessian-vector product reuses its graph. Parameters
    are not changed (batch-norm running statistics are: the forward runs in the mode the model is in).
    ``tol``, ``maxiter``, ``seed``, ``ncv``: see :func:`top_eigenvalue_of`. With ``preconditioner`` (one
    positive tensor per parameter, e.g. :func:`adam_preconditioner`) it is the top eigenvalue of ``D^½ H D^½``.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t0 = time.perf_counter()
    # The fused attention kernels (flash, memory-efficient) have no double backward: the closure's
    # forward runs with the math kernel, so every Hessian-vector product can differentiate through it.
    with sdpa_kernel(SDPBackend.MATH):
        loss = closure()
    op = hessian_operator(loss, params, preconditioner)
    lam, v = top_eigenvalue_of(op, method, tol, maxiter, seed, ncv)
    residual = float(np.linalg.norm(op.matvec(v) - lam * v)) / max(abs(lam), 1e-300)
    return CurvatureEstimate(value=lam, method=method if op.shape[0] >= 3 else "dense", hvps=op.matvecs,
                             residual=residual, seconds=time.perf_counter() - t0)


def adam_denominator(group: ParamGroup, state: ParamGroup,
                     dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Adam's per-coordinate step ``1 / (√v̂ + eps)`` for one parameter, from its torch Adam/AdamW
    ``group`` and ``state``: ``v̂ = v / (1 - beta2^step)``, the bias-corrected second moment, with
    ``v`` the state's ``exp_avg_sq`` (``max_exp_avg_sq`` when the group has ``amsgrad``: AMSGrad's
    denominator), converted to ``dtype`` first (None: its own). ``None`` for a parameter never stepped
    (no second moment). The one place this formula is written (:func:`adam_preconditioner`,
    :func:`deft.preserver.noise.walk_geometry`)."""
    key = "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"
    if key not in state:
        return None
    v = state[key].detach()
    if dtype is not None:
        v = v.to(dtype)
    v_hat = v / (1.0 - group["betas"][1] ** float(state["step"]))
    return 1.0 / (v_hat.sqrt() + group["eps"])


def _adam_denominators(optimizer: torch.optim.Optimizer) -> tuple[dict[int, torch.Tensor], float]:
    """(``id(p) -> 1 / (√v̂ + eps)`` for every parameter with a second moment, the largest group lr)
    from a torch Adam/AdamW's state. A parameter that was never stepped (an unused branch) has none."""
    import torch

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ContractError("optimizer", "type", f"expected torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
    out: dict[int, torch.Tensor] = {}
    for gi, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            raise ContractError("optimizer", f"param_groups[{gi}].amsgrad", "AMSGrad's max_exp_avg_sq is not modelled")
        for p in group["params"]:
            d = adam_denominator(group, optimizer.state.get(p, {}))
            if d is not None:
                out[id(p)] = d.to(torch.float64)
    if not out:
        raise ContractError("optimizer", "state", "no second moment yet: take at least one optimizer step "
                                                  "before reading Adam's effective step")
    lr = max(float(g["lr"]) for g in optimizer.param_groups)
    return out, lr


def adam_preconditioner(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor] | None = None
                        ) -> list[torch.Tensor]:
    """``D = 1 / (√v̂ + eps)`` per parameter of a torch Adam/AdamW: for ``params`` in their order (what
    :func:`hessian_operator` pairs it with), else in ``param_groups`` order. A parameter without a
    second moment (never stepped) is an error naming its index: its effective step is unknown."""
    d, _ = _adam_denominators(optimizer)
    order = [p for g in optimizer.param_groups for p in g["params"]] if params is None else list(params)
    missing = [i for i, p in enumerate(order) if id(p) not in d]
    if missing:
        raise ContractError("optimizer", "state", f"parameters {missing[:8]} have no second moment (never stepped by "
                                                  "this optimizer): their effective step is unknown")
    return [d[id(p)] for p in order]


def adam_scale(optimizer: torch.optim.Optimizer, reduce: str = "median") -> float:
    """One number for Adam's ``1 / (√v̂ + eps)`` over all coordinates: ``"median"`` or ``"max"``.

    ``OptimizerSpec.from_torch(opt, scale=adam_scale(opt))`` then uses the step ``lr * scale`` for every
    direction. The median describes a typical coordinate; the max is conservative (the coordinates with
    tiny second moments take the largest steps, and if the sharpest direction lies among them the
    median underestimates the step). Exact instead: the preconditioned curvature (module docstring).
    """
    import torch

    if reduce not in ("median", "max"):
        raise ContractError(_SOURCE, "reduce", f"expected 'median' or 'max', got {reduce!r}")
    flat = torch.cat([d.reshape(-1) for d in _adam_denominators(optimizer)[0].values()])
    return float(flat.median() if reduce == "median" else flat.max())


def secant_curvature(grad_prev: Sequence[torch.Tensor], grad: Sequence[torch.Tensor],
                     params_prev: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> float | None:
    """``|g - g_prev| / |x - x_prev|`` (float64 sums); ``None`` when the parameters did not move."""
    dg, dx = secant_sums(grad_prev, grad, params_prev, params)
    return None if dx == 0.0 else math.sqrt(dg / dx)


def secant_sums(grad_prev: Sequence[torch.Tensor], grad: Sequence[torch.Tensor],
                params_prev: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> tuple[float, float]:
    """``(|g - g_prev|², |x - x_prev|²)`` in float64 (:func:`deft.preserver.float64.sq_dist64`)."""
    lens = {len(grad_prev), len(grad), len(params_prev), len(params)}
    if len(lens) != 1:
        raise ContractError(_SOURCE, "secant", f"expected as many gradient as parameter tensors, got {sorted(lens)}")
    dg = dx = 0.0
    for a, b, c, d in zip(grad_prev, grad, params_prev, params, strict=True):
        if a.shape != b.shape or c.shape != d.shape or a.numel() != c.numel():
            raise ContractError(_SOURCE, "secant", f"mismatched tensor shapes {tuple(a.shape)}, {tuple(b.shape)}, "
                                                   f"{tuple(c.shape)}, {tuple(d.shape)}")
        dg += float(sq_dist64(a, b))
        dx += float(sq_dist64(c, d))
    return dg, dx


#: How a report names the screen's raw ratio (:meth:`SecantCurvature.screen`, second value ``True``).
RAW_SCREEN = "raw: the noise correction removed it all"


class SecantCurvature:
    """Median of :func:`secant_curvature` over the last ``window`` parameter moves (a lower-quality ``lam``).

    Call :meth:`observe` once per iteration with the parameters at which the gradient was computed
    and that (averaged) gradient; iterations after which no update landed (the parameters did not
    move) give no ratio. Memory: one copy of the parameters and one of the gradient, on their device
    (for a model that barely fits, that is two model-sized buffers more).
    """

    def __init__(self, window: int = 16) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ContractError(_SOURCE, "window", f"expected an integer >= 1, got {window!r}")
        self.ratios: deque[float] = deque(maxlen=window)
        self.sums: deque[tuple[float, float]] = deque(maxlen=window)  # (|Δg|², |Δx|²) per ratio
        self._prev: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._prev_key: tuple[int, ...] | None = None

    def observe(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                key: tuple[int, ...] | None = None) -> float | None:
        """Record this iteration; returns the new ratio, or ``None`` (first call, or no move).

        ``key`` names which tensors these are (e.g. the indices of the parameters that had a gradient):
        when it differs from the previous call's, the two points are not comparable (an unused branch
        came or went) and this call starts over instead of pairing different tensors."""
        ratio = None
        if self._prev is not None and key != self._prev_key:
            self._prev = None
        self._prev_key = key
        if self._prev is not None:
            dg, dx = secant_sums(self._prev[1], grads, self._prev[0], params)
            if dx > 0.0:
                ratio = math.sqrt(dg / dx)
                self.ratios.append(ratio)
                self.sums.append((dg, dx))
        if self._prev is None:
            self._prev = ([p.detach().clone() for p in params], [g.detach().clone() for g in grads])
        elif ratio is not None:  # the copies are overwritten in place (no new model-sized allocation)
            for kept, now in zip((*self._prev[0], *self._prev[1]), (*params, *grads), strict=True):
                kept.copy_(now.detach())
        # unmoved: keep the older pair (same point, its gradient)
        return ratio

    @property
    def value(self) -> float | None:
        """Median of the window's ratios, ``None`` before the first."""
        return statistics.median(self.ratios) if self.ratios else None

    def debiased(self, noise_sq: float) -> float | None:
        """Median of ``sqrt(max(0, |Δg|² - noise_sq) / |Δx|²)``: the ratios with the mini-batch noise removed.

        Two gradients of independent batches of ``B`` samples carry noises ``e, e'`` with
        ``E|e - e'|² = 2 tr(Σ) / B`` (``Σ``: per-sample gradient covariance, :class:`NoiseEstimate.trace
        <deft.preserver.noise.NoiseEstimate>`); pass that as ``noise_sq``. On a linear loss (no curvature)
        the raw ratio is pure noise; this removes its expectation. ``None`` before the first ratio.
        """
        noise_sq = float(noise_sq)
        if not math.isfinite(noise_sq) or noise_sq < 0.0:
            raise ContractError(_SOURCE, "noise_sq", f"expected a finite number >= 0, got {noise_sq!r}")
        if not self.sums:
            return None
        return statistics.median(math.sqrt(max(0.0, dg - noise_sq) / dx) for dg, dx in self.sums)

    def screen(self, noise_sq: float) -> tuple[float | None, bool]:
        """The curvature the stability check screens schedules with, and whether it is the raw ratio.

        :meth:`debiased`, unless it is 0 while the raw ratio is not: then the noise estimate swallowed
        the whole gradient difference (a few warm-up iterations, a noisy ``tr Σ``), and 0 would make
        every stale schedule look stable: the check then takes the raw ratio (second value ``True``),
        whose noise bias errs on the safe side (it rejects more): a schedule stale by two iterations,
        which a curvature of 0 would pass, trains far below torch DDP (measured: benchmarks/results/secant.md,
        benchmarks/results/preserver_validation_seed1.md)."""
        debiased = self.debiased(noise_sq)
        raw = self.value
        if debiased == 0.0 and raw is not None and raw > 0.0:
            return raw, True
        return debiased, False
