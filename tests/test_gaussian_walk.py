"""The Gaussian walk with rebound: formula vs simulation, limits, monotonicity, the preserver ratio."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deft.errors import ContractError
from deft.preserver.gaussian_walk import (
    convergence_ratio,
    expected_loss_after,
    expected_next_loss,
    expected_trajectory,
)


def simulate_walk(s: float, mu: float, sigma: float, lr: float, batches: list[float], s_star: float,
                  n: int, rng: np.random.Generator) -> np.ndarray:
    """n independent walks with rebound: s <- |s - lr Δ - S*| + S*, Δ ~ N(mu, sigma²/B)."""
    x = np.full(n, s, dtype=np.float64)
    for b in batches:
        delta = rng.normal(mu, sigma / math.sqrt(b), size=n)
        x = np.abs(x - lr * delta - s_star) + s_star
    return x


# (s, mu, sigma, lr, batch, s_star): far from S* (a >> 1), near it (a ~ 0), overshooting (m < 0),
# a positive objective, and a small batch with large noise.
REGIMES = [
    (2.0, 1.0, 3.0, 0.1, 32, 0.0),
    (0.05, 1.0, 20.0, 0.05, 64, 0.0),
    (0.02, 3.0, 5.0, 0.1, 128, 0.0),
    (1.3, 0.5, 10.0, 0.2, 16, 1.0),
    (0.5, 0.2, 50.0, 0.01, 1, 0.1),
]


@pytest.mark.parametrize("s,mu,sigma,lr,batch,s_star", REGIMES)
def test_one_step_matches_monte_carlo(s, mu, sigma, lr, batch, s_star):
    rng = np.random.default_rng(1234)
    n = 400_000
    x = simulate_walk(s, mu, sigma, lr, [batch], s_star, n, rng)
    se = x.std(ddof=1) / math.sqrt(n)
    # 5 standard errors: a false failure has probability ~6e-7 per regime.
    assert abs(expected_next_loss(s, mu, sigma, lr, batch, s_star) - x.mean()) < 5 * se + 1e-12


def test_two_steps_plug_in_is_lower_bound_of_walk():
    # Iterating expectations is exact for one step and, by Jensen (convexity in s), a lower bound at
    # the second; near S* the bound is strict and visible.
    s, mu, sigma, lr, batch = 0.05, 1.0, 20.0, 0.05, 64
    x = simulate_walk(s, mu, sigma, lr, [batch, batch], 0.0, 400_000, np.random.default_rng(11))
    se = x.std(ddof=1) / math.sqrt(x.size)
    plug_in = expected_loss_after(s, [batch, batch], mu, sigma, lr)
    assert plug_in < x.mean() - 5 * se


def test_far_from_objective_iteration_matches_walk_over_many_steps():
    s, mu, sigma, lr, batches = 3.0, 2.0, 4.0, 0.05, [32, 64, 32, 32, 128, 32]
    x = simulate_walk(s, mu, sigma, lr, batches, 0.0, 200_000, np.random.default_rng(3))
    se = x.std(ddof=1) / math.sqrt(x.size)
    assert abs(expected_loss_after(s, batches, mu, sigma, lr) - x.mean()) < 5 * se


@pytest.mark.parametrize("s,mu,lr,s_star", [(1.0, 2.0, 0.1, 0.0), (0.1, 2.0, 0.1, 0.0), (1.5, 3.0, 0.5, 1.0),
                                            (0.2, 2.0, 0.1, 0.0)])
def test_sigma_to_zero_is_deterministic_rebound(s, mu, lr, s_star):
    det = s_star + abs(s - s_star - lr * mu)
    assert expected_next_loss(s, mu, 0.0, lr, 256, s_star) == pytest.approx(det, abs=1e-15)
    # Tiny but non-zero noise converges to the same limit without overflow or NaN.
    for sigma in (1e-6, 1e-150, 5e-324):
        v = expected_next_loss(s, mu, sigma, lr, 256, s_star)
        assert math.isfinite(v)
        # At m == 0 only the rebound term tau sqrt(2/pi) is left.
        assert abs(v - det) <= 1e-9 * det + lr * sigma / 16 * math.sqrt(2 / math.pi) + 1e-300


def test_exactly_at_objective_with_no_noise_stays():
    assert expected_next_loss(0.0, 0.0, 0.0, 0.1, 32) == 0.0
    assert convergence_ratio(0.0, 0.0, 0.0, 0.1, 32, [2, 1]) == 1.0


pos = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(s=st.floats(min_value=0.0, max_value=100.0), mu=st.floats(min_value=0.0, max_value=100.0),
       sigma=st.floats(min_value=0.0, max_value=1e3), lr=pos,
       b1=st.integers(min_value=1, max_value=4096), factor=st.integers(min_value=1, max_value=64))
def test_larger_batch_never_raises_expected_loss(s, mu, sigma, lr, b1, factor):
    small = expected_next_loss(s, mu, sigma, lr, b1)
    large = expected_next_loss(s, mu, sigma, lr, b1 * factor)
    assert large <= small + 1e-12 * max(1.0, small)
    # Jensen bounds: the folded mean lies between |m| and |m| + tau sqrt(2/pi).
    m = s - lr * mu
    tau = lr * sigma / math.sqrt(b1)
    slack = 1e-9 * max(1.0, small)
    assert abs(m) - slack <= small <= abs(m) + tau * math.sqrt(2 / math.pi) + slack


@settings(max_examples=100, deadline=None)
@given(s=st.floats(min_value=0.0, max_value=10.0), mu=st.floats(min_value=0.0, max_value=10.0),
       sigma=st.floats(min_value=0.0, max_value=100.0), n=st.integers(min_value=1, max_value=12))
def test_all_ones_ratio_is_exactly_one(s, mu, sigma, n):
    assert convergence_ratio(s, mu, sigma, 0.01, 256, [1] * n) == 1.0


def test_ratio_table_v_like_setting():
    """Table V's setting: ResNet-101, A = 1000, S* = 0, lr = 0.01, B = 256, s_A = 0.2103, K = (1, 2, 1).

    Assumptions (inputs, not results): mu = 0.45, so that lr*mu = 0.0045 is the mean per-iteration
    decrease of the table's own baseline column ((0.2103 - 0.1922) / 4); sigma = mu * sqrt(1000), a
    per-sample noise whose "critical batch" sigma²/mu² = 1000 is of the order measured for ImageNet
    CNNs (McCandlish et al. 2018). Then a = m sqrt(B) / (lr sigma) is about 14: the rebound is
    negligible, the walk is almost deterministic, and the ratio is close to
    (s - 4 lr mu) / (s - 3 lr mu): one merged step makes one step's progress, not two.
    """
    s, lr, batch, mu = 0.2103, 0.01, 256, 0.45
    sigma = mu * math.sqrt(1000)
    ratio = convergence_ratio(s, mu, sigma, lr, batch, [1, 2, 1])
    deterministic = (s - 4 * lr * mu) / (s - 3 * lr * mu)
    assert ratio == pytest.approx(deterministic, abs=1e-9)
    assert 0.97 < ratio < 1.0
    # With this mu the model predicts ~0.977, below the paper's 0.993: the table's O_D column drops
    # 0.0091 in its merged step, about two steps' progress, which averaged gradients cannot do. A
    # gradient half as strong (lr*mu = 0.0014) reproduces a ratio within epsilon = 0.01 of 1.
    assert 0.99 < convergence_ratio(s, 0.14, 0.14 * math.sqrt(1000), lr, batch, [1, 2, 1]) < 1.0


def test_ratio_above_one_near_objective():
    # Near S* the noise dominates: merged updates (larger batch) rebound less, as in Yin et al.
    r = convergence_ratio(0.01, 0.1, 50.0, 0.01, 256, [1, 2, 1])
    assert r > 1.05
    # Merging more is better still in that regime.
    assert convergence_ratio(0.01, 0.1, 50.0, 0.01, 256, [4]) > r


def test_more_merging_lowers_ratio_far_from_objective():
    args = (0.5, 1.0, 5.0, 0.01, 256)
    r = [convergence_ratio(*args, k) for k in ([1, 1, 1, 1], [1, 2, 1], [2, 2], [4])]
    assert r[0] == 1.0
    assert r[0] > r[1] > r[2] > r[3]


def test_per_step_sequences():
    traj = expected_trajectory(1.0, [32, 64], [1.0, 2.0], [0.0, 0.0], 0.1)
    assert traj == pytest.approx([1.0, 0.9, 0.7])
    assert expected_loss_after(1.0, [32, 64], [1.0, 2.0], 0.0, 0.1) == pytest.approx(0.7)


@pytest.mark.parametrize("call,field", [
    (lambda: expected_next_loss(1.0, 1.0, 1.0, 0.1, -4), "batch"),
    (lambda: expected_next_loss(1.0, 1.0, 1.0, 0.1, 0), "batch"),
    (lambda: expected_next_loss(1.0, 1.0, 1.0, 0.0, 32), "lr"),
    (lambda: expected_next_loss(1.0, 1.0, 1.0, -0.1, 32), "lr"),
    (lambda: expected_next_loss(1.0, 1.0, -1.0, 0.1, 32), "sigma"),
    (lambda: expected_next_loss(1.0, -1.0, 1.0, 0.1, 32), "mu"),
    (lambda: expected_next_loss(float("nan"), 1.0, 1.0, 0.1, 32), "s"),
    (lambda: expected_next_loss(0.5, 1.0, 1.0, 0.1, 32, s_star=1.0), "s"),
    (lambda: expected_loss_after(1.0, [], 1.0, 1.0, 0.1), "batches"),
    (lambda: expected_loss_after(1.0, [32, 32], [1.0], 1.0, 0.1), "mu"),
    (lambda: convergence_ratio(1.0, 1.0, 1.0, 0.1, 32, []), "k_sequence"),
    (lambda: convergence_ratio(1.0, 1.0, 1.0, 0.1, 32, [1, 0]), "k_sequence[1]"),
    (lambda: convergence_ratio(1.0, 1.0, 1.0, 0.1, -32, [1, 1]), "batch"),
])
def test_bad_input_raises_value_error_naming_field(call, field):
    with pytest.raises(ValueError) as e:
        call()
    assert isinstance(e.value, ContractError)
    assert e.value.field == field
    assert "expected" in str(e.value) or "walk lives above" in str(e.value)
