"""bench_codec_paths: the link's fit on its own all-reduce, and each codec's price and ratio from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._scripts import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    return load_script(REPO / "benchmarks" / "bench_codec_paths.py", monkeypatch)


def _row(n: int, fp32: float, int8: float, int8_wire: int, int8_alone: float) -> dict[str, Any]:
    return {"n": n, "fp32": fp32, "int8": int8, "int8_alone": int8_alone, "fp16": fp32 / 2, "fp16_alone": 0.0,
            "wire": {"fp32": 4 * n, "int8": int8_wire, "fp16": 2 * n}}


def test_the_fit_is_the_all_reduces_line_and_prices_add_the_codecs_compute(bench: Any) -> None:
    # all-reduces of 4 n bytes taking 2 ms + 1 us a byte: 1000 elements 6 ms, 3000 elements 14 ms
    rows = [_row(1000, 0.006, 0.010, 2000, 0.001), _row(3000, 0.014, 0.020, 4000, 0.002)]
    alpha, beta = bench.fit(rows)
    assert alpha == pytest.approx(0.002) and beta == pytest.approx(1e-6)
    text = "\n".join(bench.table("2x2", {"rows": rows, "hosts": [2, 2], "world": 4}))
    assert "hierarchical (2 hosts x 2)" in text and "alpha 2.00 ms" in text
    # int8 of 3000 elements: priced 2 ms + 4000 us + 2 ms of compute = 8 ms, measured 20 ms: 2.5x
    assert "| 3000 | int8 | 4000 | 20.0 | 2.0 | 8.0 | 2.50 |" in text
    # fp16 of 1000 elements: priced 2 ms + 2000 us = 4 ms, measured 3 ms
    assert "| 1000 | fp16 | 2000 | 3.0 | 0.0 | 4.0 | 0.75 |" in text
