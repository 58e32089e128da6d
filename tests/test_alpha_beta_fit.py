"""deft's one alpha-beta fit (deft.profile.fit_alpha_beta), against answers derived by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import lsq_linear

from deft import ContractError
from deft.profile import fit_alpha_beta


def test_exact_line() -> None:
    f = fit_alpha_beta([0, 1000, 2000, 4000], [1e-3, 3e-3, 5e-3, 9e-3])  # T = 1 ms + 2 us/kB
    assert (f.alpha, f.beta) == (pytest.approx(1e-3), pytest.approx(2e-6))
    assert f.r2 == pytest.approx(1.0) and f.rmse == pytest.approx(0.0, abs=1e-15) and not f.constrained


def test_negative_intercept_gives_the_line_through_the_origin() -> None:
    # Points (1, 0), (2, 2), (3, 4): the free line is T = 2b - 2 (alpha < 0). With alpha = 0 the best
    # slope minimises sum (beta b - T)^2: beta = sum bT / sum b^2 = (0 + 4 + 12) / (1 + 4 + 9) = 16/14.
    f = fit_alpha_beta([1, 2, 3], [0.0, 2.0, 4.0])
    assert f.free_alpha == pytest.approx(-2.0) and f.free_beta == pytest.approx(2.0) and f.constrained
    assert f.alpha == 0.0 and f.beta == pytest.approx(16 / 14)


def test_negative_slope_gives_the_flat_line_at_the_mean() -> None:
    # Times fall with size (noise): the free slope is -1; with beta = 0 the best alpha is the mean, 2.
    f = fit_alpha_beta([1, 2, 3], [3.0, 2.0, 1.0])
    assert f.free_beta == pytest.approx(-1.0) and f.beta == 0.0 and f.alpha == pytest.approx(2.0)


def test_weights_pull_the_line_toward_heavy_samples() -> None:
    # Weights 1, 1, 100 on (0, 0), (1, 2), (2, 2): the weighted normal equations
    # [102, 201; 201, 401] [a; b] = [202; 402], determinant 501, give a = 200/501, b = 402/501.
    f = fit_alpha_beta([0, 1, 2], [0.0, 2.0, 2.0], weights=[1, 1, 100])
    assert f.alpha == pytest.approx(200 / 501) and f.beta == pytest.approx(402 / 501)
    plain = fit_alpha_beta([0, 1, 2], [0.0, 2.0, 2.0])  # unweighted: a = 1/3, b = 1
    assert plain.alpha == pytest.approx(1 / 3) and plain.beta == pytest.approx(1.0)


def test_one_size_is_the_line_through_the_origin() -> None:
    # every non-negative line through (4, mean T) fits; the rule takes alpha = 0, beta = 2 / 4
    f = fit_alpha_beta([4, 4], [1.0, 3.0])
    assert math.isnan(f.free_alpha) and not f.constrained
    assert (f.alpha, f.beta) == (0.0, 0.5)
    # the weighted mean: (1 * 1 + 3 * 3) / 4 = 2.5
    assert fit_alpha_beta([4, 4], [1.0, 3.0], weights=[1.0, 3.0]).beta == pytest.approx(2.5 / 4)
    zero = fit_alpha_beta([0], [2e-3])  # at 0 bytes only a start-up can be seen
    assert (zero.alpha, zero.beta) == (2e-3, 0.0)


def test_constant_times_are_an_exact_flat_line() -> None:
    f = fit_alpha_beta([1000, 2000, 3000], [1.1e-3] * 3)
    assert f.alpha == pytest.approx(1.1e-3) and f.beta == pytest.approx(0.0, abs=1e-18)
    assert f.r2 == 1.0 and f.rmse == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize(("sizes", "times", "weights", "field"), [
    ([], [], None, "samples: expected equally many sizes and times"),
    ([1, 2], [1.0], None, "samples: expected equally many sizes and times"),
    ([1, 2], [1.0, math.nan], None, r"seconds\[1\]: expected a finite number >= 0, got nan"),
    ([1, 2], [1.0, -1.0], None, r"seconds\[1\]: expected a finite number >= 0, got -1.0"),
    ([-1, 2], [1.0, 1.0], None, r"nbytes\[0\]: expected a finite number >= 0, got -1.0"),
    ([1, 2], [1.0, 2.0], [1.0], r"weights: expected one weight per sample \(2\), got 1"),
    ([1, 2], [1.0, 2.0], [1.0, 0.0], r"weights\[1\]: expected a finite weight > 0, got 0.0")])
def test_bad_samples_name_the_field(sizes: list[float], times: list[float], weights: list[float] | None,
                                    field: str) -> None:
    with pytest.raises(ContractError, match=f"links.json: {field}"):
        fit_alpha_beta(sizes, times, weights, source="links.json")


def test_ordinary_least_squares_by_hand() -> None:
    # b = (0, 1, 2), T = (1, 2, 5): mean b = 1, mean T = 8/3, S_bT = 4, S_bb = 2 -> beta = 2, alpha = 2/3.
    # predictions (2/3, 8/3, 14/3), residuals (1/3, -2/3, 1/3): SS_res = 2/3, SS_tot = 26/3 -> r2 = 12/13
    f = fit_alpha_beta([0, 1, 2], [1.0, 2.0, 5.0])
    assert f.alpha == pytest.approx(2 / 3) and f.beta == pytest.approx(2.0)
    assert f.r2 == pytest.approx(12 / 13) and f.rmse == pytest.approx(math.sqrt(2 / 9))
    assert f.rel_rmse == pytest.approx(math.sqrt(((1 / 3) ** 2 + (1 / 3) ** 2 + (1 / 15) ** 2) / 3))


def test_an_integer_weight_is_the_sample_repeated() -> None:
    weighted = fit_alpha_beta([0, 1, 2], [1.0, 2.0, 5.0], weights=[1.0, 1.0, 2.0])
    repeated = fit_alpha_beta([0, 1, 2, 2], [1.0, 2.0, 5.0, 5.0])
    # by hand: sum w = 4, sum wb = 5, sum wb^2 = 9, sum wT = 13, sum wbT = 22, det 11 -> 7/11, 23/11
    assert (weighted.alpha, weighted.beta) == (pytest.approx(7 / 11), pytest.approx(23 / 11))
    assert (repeated.alpha, repeated.beta) == (pytest.approx(7 / 11), pytest.approx(23 / 11))


def test_microbenchmark_scales_are_solved_accurately() -> None:
    # bytes up to 1.6e7 and seconds down to 3e-5 in one design matrix, weights 1/T as the link benchmark uses
    sizes = [2**k for k in range(10, 25)]
    times = [30e-6 + 1e-9 * b for b in sizes]
    f = fit_alpha_beta(sizes, times, weights=[1 / t for t in times])
    assert f.alpha == pytest.approx(30e-6, rel=1e-6) and f.beta == pytest.approx(1e-9, rel=1e-6)
    assert not f.constrained


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**7), st.just(0.0) | st.floats(1e-7, 1.0), st.floats(0.1, 10.0)),
                min_size=2, max_size=12))
def test_fit_is_the_bounded_least_squares_optimum(samples: list[tuple[int, float, float]]) -> None:
    """A second method (scipy's trust-region lsq_linear with bounds) reaches no lower weighted residual."""
    b = np.array([s[0] for s in samples], dtype=float)
    t = np.array([s[1] for s in samples])
    w = np.array([s[2] for s in samples])
    f = fit_alpha_beta(b, t, weights=w)
    assert f.alpha >= 0 and f.beta >= 0

    def cost(alpha: float, beta: float) -> float:
        return float(np.sum(w * (alpha + beta * b - t) ** 2))

    scale = max(float(b.max()), 1.0)
    sw = np.sqrt(w)
    ref = lsq_linear(np.column_stack([sw, sw * b / scale]), sw * t, bounds=(0, np.inf), tol=1e-12).x
    assert cost(f.alpha, f.beta) <= cost(ref[0], ref[1] / scale) + 1e-9 * (1 + float(np.sum(w * t * t)))
