"""benchmarks/report_drift.py: the first plans priced on the compute's drift, with and without it, by the
drift's sign, from saved bench_peers records (made here, no testbed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._scripts import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def drift(monkeypatch: pytest.MonkeyPatch) -> Any:
    return load_script(REPO / "benchmarks" / "report_drift.py", monkeypatch)


def _run(path: Path, factor: float, applied: bool, before: float, predicted: float, measured: float,
         lm: bool) -> None:
    summary: dict[str, Any] = {"rate_mbit": 250.0 if lm else 50.0, "world_size": 2, "schedule": {"plan_info": {
        "compute_drift": {"factor": factor, "applied": applied,
                          **({"predicted_before_s": before} if applied else {})},
        "adapt": [{"predicted_s": predicted, "measured_s": measured}]}}}
    if lm:
        summary["final_val_loss"] = 2.5
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": summary}), encoding="utf-8")


def test_first_plans_are_read_by_the_drifts_sign_with_and_without_it(drift: Any, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _run(runs / "lm" / "deft.250.s2.r0.json", 1.25, True, 0.50, 0.625, 0.50, lm=True)     # +25 % with, 0 without
    _run(runs / "lm" / "by" / "x" / "deft.250.s2.r0.json", 1.25, True, 0.50, 0.625, 0.50, lm=True)  # a copy
    _run(runs / "cnn" / "deft.50.s0.r0.json", 0.8, True, 0.60, 0.48, 0.50, lm=False)      # -4 % with, +20 % without
    _run(runs / "cnn" / "deft.50.s1.r0.json", 1.3, False, 0.0, 0.40, 0.50, lm=False)      # not applied: left out
    plans = drift.first_plans([runs])
    assert sorted((p.model, round(p.g, 2), round(p.with_g, 3), round(p.without_g, 3)) for p in plans) == [
        ("CNN", 0.8, -0.04, 0.2), ("GPT-2", 1.25, 0.25, 0.0)]
    text = drift.report(plans, "cmd")
    assert "| sped up (g < 1) | CNN | 1 | 1 | 0 |" in text
    assert "| slowed (g > 1) | GPT-2 | 1 | 0 | 1 |" in text
