"""Top Hessian eigenvalue from Hessian-vector products, against known spectra and dense Hessians.

Quadratics ``½ xᵀAx`` with ``A = Q diag(λ) Qᵀ`` (``Q`` a seeded random orthogonal basis) have the
chosen ``λ`` as their exact spectrum; for a small MLP the second method is the dense Hessian from
``torch.autograd.functional.hessian`` and ``numpy.linalg.eigvalsh``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.func import functional_call

from deft.errors import ContractError
from deft.preserver.curvature import (
    SecantCurvature,
    adam_preconditioner,
    adam_scale,
    hessian_operator,
    secant_curvature,
    top_eigenvalue,
)


def quadratic(eigenvalues: list[float], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, x): A with the given spectrum in a random orthogonal basis, x a float64 parameter."""
    n = len(eigenvalues)
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    a = torch.from_numpy(q @ np.diag(eigenvalues) @ q.T)
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    return a, x


def quad_closure(a: torch.Tensor, x: torch.Tensor):
    return lambda: 0.5 * x @ a @ x


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_quadratic_known_spectrum(method: str) -> None:
    a, x = quadratic([10.0, 3.0, 1.0, 0.1])
    est = top_eigenvalue(quad_closure(a, x), [x], method=method, tol=1e-6)
    assert est.value == pytest.approx(10.0, rel=1e-3)
    assert est.method == method and est.hvps >= 2 and est.residual < 1e-2


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_largest_algebraic_not_largest_magnitude(method: str) -> None:
    # -20 dominates in magnitude; the sharpest *positive* curvature is 10.
    spectrum = [10.0, 3.0, 1.0, 0.1, -20.0, *np.linspace(-0.5, 0.5, 45)]
    a, x = quadratic(spectrum, seed=3)
    est = top_eigenvalue(quad_closure(a, x), [x], method=method, tol=1e-8, maxiter=5000)
    assert est.value == pytest.approx(10.0, rel=1e-3)


def test_power_stops_on_the_residual_not_on_a_stalled_quotient() -> None:
    # A dominant -100 makes the second run work on H + 100 I, whose Rayleigh quotient starts near 100 and
    # barely moves: stopping on its relative change returned ~0.04 here (the digits CNN's failure).
    spectrum = [1.0, -100.0, *np.linspace(-0.5, 0.6, 30)]
    a, x = quadratic(spectrum, seed=6)
    est = top_eigenvalue(quad_closure(a, x), [x], method="power", tol=1e-4, maxiter=20000)
    assert est.value == pytest.approx(1.0, rel=1e-3)
    assert est.hvps > 100  # slow: the shifted ratio is (0.6 + 100) / (1 + 100)
    with pytest.raises(ContractError) as e:
        top_eigenvalue(quad_closure(a, x), [x], method="power", tol=1e-4, maxiter=50)
    assert e.value.field == "maxiter"


@pytest.mark.parametrize("ncv", [3, 8, None])
def test_lanczos_ncv(ncv: int | None) -> None:
    a, x = quadratic([10.0, 3.0, 1.0, 0.1, *np.linspace(-1.0, 2.0, 60)], seed=7)
    assert top_eigenvalue(quad_closure(a, x), [x], tol=1e-8, ncv=ncv).value == pytest.approx(10.0, rel=1e-6)


def test_lanczos_separates_close_eigenvalues() -> None:
    spectrum = [10.0, 9.9, *np.random.default_rng(1).uniform(-1.0, 5.0, 198)]
    a, x = quadratic(spectrum, seed=2)
    est = top_eigenvalue(quad_closure(a, x), [x], tol=1e-8)
    assert est.value == pytest.approx(10.0, rel=1e-6)


def test_preconditioned_curvature() -> None:
    a, x = quadratic([10.0, 3.0, 1.0, 0.1, 0.5, 2.0])
    d = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.1, 1.5], dtype=torch.float64)
    s = torch.diag(d.sqrt())
    expected = np.linalg.eigvalsh((s @ a @ s).numpy())[-1]
    est = top_eigenvalue(quad_closure(a, x), [x], preconditioner=[d], tol=1e-10)
    assert est.value == pytest.approx(expected, rel=1e-8)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(z)))


def mlp_problem() -> tuple[MLP, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = MLP().double()
    z = torch.randn(40, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (40,))
    return model, z, y


def dense_top_eigenvalue(model: MLP, z: torch.Tensor, y: torch.Tensor) -> float:
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(flat, [math.prod(s) for s in shapes])
        params = {n: t.reshape(s) for n, t, s in zip(names, pieces, shapes, strict=True)}
        return torch.nn.functional.cross_entropy(functional_call(model, params, (z,)), y)

    h = torch.autograd.functional.hessian(loss_of, flat0)
    return float(np.linalg.eigvalsh(h.numpy())[-1])


# Lanczos to 1e-6 takes seconds: the fast lane keeps the power method's case
@pytest.mark.parametrize(("method", "rel"), [pytest.param("lanczos", 1e-6, marks=pytest.mark.slow), ("power", 1e-3)])
def test_mlp_against_dense_hessian(method: str, rel: float) -> None:
    model, z, y = mlp_problem()
    expected = dense_top_eigenvalue(model, z, y)
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        return torch.nn.functional.cross_entropy(model(z), y)

    est = top_eigenvalue(closure, list(model.parameters()), method=method, tol=1e-9, maxiter=20000)
    assert est.value == pytest.approx(expected, rel=rel)
    assert len(calls) == 1  # one forward; every product reuses its graph
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))


def test_operator_matches_dense_hessian_columns() -> None:
    a, x = quadratic([4.0, 2.0, -1.0])
    op = hessian_operator(0.5 * x @ a @ x, [x])
    dense = np.column_stack([op.matvec(e) for e in np.eye(3)])
    assert np.allclose(dense, a.numpy(), atol=1e-12)
    assert op.matvecs == 3


def test_tiny_problem_is_solved_densely() -> None:
    a, x = quadratic([5.0, -7.0])
    est = top_eigenvalue(quad_closure(a, x), [x])
    assert est.value == pytest.approx(5.0, rel=1e-12) and est.method == "dense"


# -- secant ---------------------------------------------------------------------------------------
def test_secant_is_bounded_by_the_top_eigenvalue_for_exact_gradients() -> None:
    a, _ = quadratic([10.0, 3.0, 1.0, 0.1])
    rng = np.random.default_rng(5)
    lo, hi = 0.1, 10.0
    for _ in range(50):
        x0, x1 = (torch.from_numpy(rng.standard_normal(4)) for _ in range(2))
        r = secant_curvature([a @ x0], [a @ x1], [x0], [x1])
        assert lo * (1 - 1e-12) <= r <= hi * (1 + 1e-12)


def test_secant_recovers_the_top_eigenvalue_when_it_dominates_the_steps() -> None:
    # GD with lr 2.1 / 10: the top direction grows by |1 - 2.1| = 1.1 per step, every other one shrinks,
    # so the steps align with the top eigenvector (what an unstable, oscillating direction does).
    a, x = quadratic([10.0, 3.0, 1.0, 0.1])
    x = x.detach()
    sec = SecantCurvature(window=8)
    for _ in range(100):
        g = a @ x
        sec.observe([x], [g])
        x = x - 0.21 * g
    assert sec.value == pytest.approx(10.0, rel=1e-4)
    assert len(sec.ratios) == 8


def test_secant_skips_iterations_without_a_move() -> None:
    sec = SecantCurvature()
    x = torch.tensor([1.0, 2.0])
    assert sec.observe([x], [x * 3]) is None
    assert sec.observe([x], [x * 5]) is None  # same point: no ratio
    assert sec.value is None
    y = x + torch.tensor([1.0, 0.0])
    assert sec.observe([y], [y * 3]) == pytest.approx(math.sqrt(((y * 3 - x * 3) ** 2).sum().item()) / 1.0)


def test_secant_starts_over_when_the_used_tensors_change() -> None:
    # An unused branch comes and goes: the tensors with a gradient differ between calls. Pairing them
    # would compare different parameters (or fail on the count); the secant starts over instead.
    sec = SecantCurvature()
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    assert sec.observe([a, b], [a, b], key=(0, 1)) is None
    assert sec.observe([a + 1], [a * 2], key=(0,)) is None  # another set: no ratio, no error
    assert sec.value is None
    # the same set again, by hand: x (2, 3) -> (3, 4), g (2, 4) -> (5, 7): sqrt(9 + 9) / sqrt(1 + 1) = 3
    assert sec.observe([a + 2], [a * 2 + 3], key=(0,)) == pytest.approx(math.sqrt(9 + 9) / math.sqrt(1 + 1))


def test_hessian_of_a_loss_that_skips_a_parameter() -> None:
    # loss = 3 w0² (w1 unused): H = diag(6, 0), as torch DDP's unused parameters get a zero gradient.
    w0, w1 = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64)), torch.nn.Parameter(torch.zeros(2))
    op = hessian_operator(3 * (w0 ** 2).sum(), [w0, w1])
    assert op.matvec(np.array([1.0, 1.0, 1.0])) == pytest.approx([6.0, 0.0, 0.0])
    with pytest.raises(ContractError, match="depends on at least one"):
        hessian_operator((torch.ones(1, requires_grad=True) * 2).sum(), [w0, w1])


# -- Adam -----------------------------------------------------------------------------------------
def test_adam_preconditioner_after_one_step() -> None:
    # After one step with gradient g: v = (1-β₂) g², bias-corrected v̂ = g², so D = 1 / (|g| + eps).
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    g = torch.tensor([0.5, -2.0, 4.0, 1.0], dtype=torch.float64)
    opt = torch.optim.Adam([p], lr=0.1, eps=1e-3)
    with pytest.raises(ContractError, match="no second moment"):
        adam_preconditioner(opt)
    p.grad = g
    opt.step()
    (d,) = adam_preconditioner(opt)
    assert torch.allclose(d, 1.0 / (g.abs() + 1e-3), rtol=1e-12)
    assert adam_scale(opt, "max") == pytest.approx(1.0 / (0.5 + 1e-3), rel=1e-12)
    # torch's median of an even count is the lower middle value: 1 / (2 + eps)
    assert adam_scale(opt, "median") == pytest.approx(1.0 / (2.0 + 1e-3), rel=1e-12)


# -- bad input ------------------------------------------------------------------------------------
def test_bad_input_names_the_field() -> None:
    a, x = quadratic([1.0, 2.0, 3.0])
    with pytest.raises(ContractError) as e:
        top_eigenvalue(lambda: (0.5 * x @ a @ x).detach(), [x])
    assert e.value.field == "loss"
    with pytest.raises(ContractError) as e:
        top_eigenvalue(quad_closure(a, x), [x], method="arnoldi")
    assert e.value.field == "method"
    with pytest.raises(ContractError) as e:
        top_eigenvalue(quad_closure(a, x), [x], preconditioner=[torch.ones(2, dtype=torch.float64)])
    assert e.value.field == "preconditioner[0]"
    with pytest.raises(ContractError) as e:
        top_eigenvalue(quad_closure(a, x), [x.detach()])
    assert e.value.field == "params[0]"
    with pytest.raises(ContractError) as e:
        adam_scale(torch.optim.SGD([x], lr=0.1))
    assert e.value.field == "type"
    with pytest.raises(ContractError) as e:
        top_eigenvalue(quad_closure(a, x), [x], ncv=2)
    assert e.value.field == "ncv"
    with pytest.raises(ContractError) as e:
        SecantCurvature(window=0)
    assert e.value.field == "window"


def test_debiased_secant_removes_the_batch_noise() -> None:
    # H = 3 I; the step moves x by 1 along e1 and the two batches' noises differ by 2 along e2, so
    # |Δg|² = 3² + 2² = 13 and |Δx|² = 1 (by hand): raw ratio sqrt(13), debiased by 4: exactly 3.
    sec = SecantCurvature()
    x0, x1 = torch.zeros(2, dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)
    sec.observe([x0], [3.0 * x0 + torch.tensor([0.0, 1.0], dtype=torch.float64)])
    sec.observe([x1], [3.0 * x1 + torch.tensor([0.0, -1.0], dtype=torch.float64)])
    assert sec.value == pytest.approx(math.sqrt(13.0))
    assert sec.debiased(4.0) == pytest.approx(3.0)
    assert sec.debiased(20.0) == 0.0  # more noise than difference: clipped at no curvature
    # The stability check's screen: the debiased value, unless the correction removed it all; then the
    # raw ratio (sqrt 13), never a curvature of 0 that would pass every stale schedule.
    assert sec.screen(4.0) == (pytest.approx(3.0), False)
    assert sec.screen(20.0) == (pytest.approx(math.sqrt(13.0)), True)
    assert SecantCurvature().screen(1.0) == (None, False)
    with pytest.raises(ContractError, match="noise_sq"):
        sec.debiased(-1.0)


def test_attention_closure_runs_with_the_math_kernel() -> None:
    # torch's fused CPU attention kernel has no double backward; top_eigenvalue must still work, and
    # agree with the dense Hessian (torch.autograd.functional.hessian with the math kernel: a second method).
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    w0 = torch.randn(8, 8, dtype=torch.float64) * 0.3

    def loss_of(w: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x @ w, x, x, is_causal=True).pow(2).mean()

    w = torch.nn.Parameter(w0.clone())
    est = top_eigenvalue(lambda: loss_of(w), [w], tol=1e-8)
    with sdpa_kernel(SDPBackend.MATH):
        dense = torch.autograd.functional.hessian(loss_of, w0).reshape(64, 64)
    assert est.value == pytest.approx(float(torch.linalg.eigvalsh(dense)[-1]), rel=1e-6)
