"""deft.preserver.float64: float64 sums in chunks equal the closed forms, and the statistics built on
them (local_stats, DirectionPair.dot, secant_sums) keep their float64 accumulation."""

from __future__ import annotations

import pytest
import torch

from deft.preserver import float64
from deft.preserver.curvature import secant_sums
from deft.preserver.noise import DirectionPair, local_stats

N = 3000  # three chunks of 1024, the last one partial, under the small CHUNK below


@pytest.fixture(params=[1024, 1 << 20], ids=["chunked", "one-chunk"])
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(float64, "CHUNK", request.param)
    return int(request.param)


def test_sum_of_squares_of_0_to_n_minus_1(chunk: int) -> None:
    x = torch.arange(N, dtype=torch.float32).reshape(30, 100)
    # sum_{i<n} i^2 = (n-1) n (2n-1) / 6 = 2999 * 3000 * 5999 / 6
    assert float(float64.dot64(x)) == 8_995_500_500.0


def test_products_are_taken_in_float64(chunk: int) -> None:
    # (1 + 2^-20)^2 = 1 + 2^-19 + 2^-40: float32 would drop the 2^-40; 2048 of them sum to
    # 2^11 + 2^-8 + 2^-29 exactly in float64.
    x = torch.full((2048,), 1 + 2.0**-20, dtype=torch.float32)
    assert float(float64.dot64(x)) == 2.0**11 + 2.0**-8 + 2.0**-29
    ones = torch.ones(2048, dtype=torch.bfloat16)
    assert float(float64.dot64(x, ones)) == 2048 * (1 + 2.0**-20)


def test_squared_distance_in_float64(chunk: int) -> None:
    a = torch.arange(N, dtype=torch.float32)
    b = a + 0.5
    assert float(float64.sq_dist64(a, b)) == N * 0.25
    assert float(float64.sq_dist64(b, b)) == 0.0


def test_statistics_on_chunked_sums(chunk: int) -> None:
    g = torch.arange(N, dtype=torch.float32)
    u = torch.ones(N)
    st = local_stats([g], ([u], [2 * u]), batch=4)
    # |g|^2 as above; g.u = sum i = 2999 * 3000 / 2; g.(2u) twice that
    assert (st.sq_norm, st.proj_a, st.proj_b) == (8_995_500_500.0, 4_498_500.0, 8_997_000.0)
    pair = DirectionPair(decay=0.5)
    pair.observe([g])
    pair.observe([u])
    assert pair.dot() == 4_498_500.0
    dg, dx = secant_sums([g], [g + 1], [u], [u - 2])
    assert (dg, dx) == (N * 1.0, N * 4.0)


def test_mismatched_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="3 against 4 elements"):
        float64.dot64(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="3 against 4 elements"):
        float64.sq_dist64(torch.ones(3), torch.ones(4))
