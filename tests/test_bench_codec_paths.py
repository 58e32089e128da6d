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


def test_bad_layouts_and_sizes_are_named(bench: Any) -> None:
    assert bench.parse_layouts("2x1, 2x2,4x1") == [(2, 1), (2, 2), (4, 1)]
    for bad in ("2-2", "1x4", "2x", "x2", "2x0"):
        with pytest.raises(SystemExit, match=f"--layouts: '{bad}' is not HxM"):
            bench.parse_layouts(f"2x2,{bad}")
    assert bench.parse_sizes("65536,262144") == [65536, 262144]
    for bad in ("65536", "65536,65536", "1e6,2", "0,5"):
        with pytest.raises(SystemExit, match=r"--sizes: .* two or more different positive"):
            bench.parse_sizes(bad)


def test_writing_the_tables_again_keeps_the_reading(bench: Any, tmp_path: Path) -> None:
    out = tmp_path / "codec_paths.md"
    out.write_text(f"## old tables\n\n{bench.READING}\n\nwhat they say\n", encoding="utf-8")
    bench.write_fragment("## new tables\n", out, bench.READING)
    assert out.read_text(encoding="utf-8") == f"## new tables\n\n{bench.READING}\n\nwhat they say\n"
