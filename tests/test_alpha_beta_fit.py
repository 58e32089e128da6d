"""deft's one alpha-beta fit (deft.profile.fit_alpha_beta), against answers derived by hand."""

from __future__ import annotations

import math

import pytest

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


def test_one_size_is_undetermined_but_feasible() -> None:
    f = fit_alpha_beta([1000, 1000], [1e-3, 1e-3])
    assert math.isnan(f.free_alpha) and f.alpha >= 0 and f.beta >= 0
    assert f.alpha + f.beta * 1000 == pytest.approx(1e-3)


@pytest.mark.parametrize(("sizes", "times", "weights", "field"), [
    ([], [], None, "samples"), ([1, 2], [1.0], None, "samples"), ([1, 2], [1.0, math.nan], None, "samples"),
    ([1, 2], [1.0, -1.0], None, "samples"), ([1, 2], [1.0, 2.0], [1.0, 0.0], "weights")])
def test_bad_samples_name_the_field(sizes: list[float], times: list[float], weights: list[float] | None,
                                    field: str) -> None:
    with pytest.raises(ContractError, match=f"links.json: {field}"):
        fit_alpha_beta(sizes, times, weights, source="links.json")
