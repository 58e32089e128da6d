"""benchmarks/report_drag.py: the first plans by layout, their links against the profile and a drag priced
on them offline, from saved bench_peers records (made here, no testbed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._scripts import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def drag(monkeypatch: pytest.MonkeyPatch) -> Any:
    return load_script(REPO / "benchmarks" / "report_drag.py", monkeypatch)


def _run(path: Path, measured_s: float, per_host: int, links: dict[str, float], digest: str | None = None) -> None:
    """A saved run whose first plan is the synchronous schedule of two buckets on one gloo link: each
    bucket's forward 0.5 s, backward 1 s, all-reduce 1 s. Bucket 0's send runs beside bucket 1's backward,
    bucket 1's after it: the next forward starts at 4 s without a drag; with a drag of 1 the first send
    does half its work beside the backward and ends at 3.5 s, the second at 4.5 s."""
    from deft.profile import Bucket, BucketTimes, Link, Profile
    from deft.schedule import synchronous_schedule

    profile = Profile(buckets=(Bucket(0, ("p0",), 250, 1000), Bucket(1, ("p1",), 250, 1000)),
                      times=(BucketTimes(0.5, 1.0, {"a": 1.0}), BucketTimes(0.5, 1.0, {"a": 1.0})),
                      links=(Link("a", "gloo"),), world_size=2 * per_host, source="synthetic")
    schedule = synchronous_schedule((250, 250), (1000, 1000), ("a",), ("a", "a"))
    record = {"schedule": digest or schedule.digest(), "predicted_s": 4.0, "measured_s": measured_s,
              "links_vs_profile": links}
    doc = {"summary": {"ddp": "deft", "hosts": 2, "ranks_per_host": per_host, "rate_mbit": 50.0,
                       "schedule": {"predicted_iteration_s": 4.0, "profile": profile.to_dict(),
                                    "schedule": schedule.to_dict(), "plan_info": {"adapt": [record]}}}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc), encoding="utf-8")


def test_first_plans_are_priced_with_each_drag_by_layout(drag: Any, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _run(runs / "a" / "deft.50.s0.r0.json", 5.0, 2, {"a": 1.2})   # -20 % as priced, -10 % with a drag of 1
    _run(runs / "a" / "by" / "x" / "deft.50.s0.r0.json", 5.0, 2, {"a": 1.2})  # a copy: skipped
    _run(runs / "b" / "deft.50.s0.r0.json", 4.0, 1, {"a": 1.0})   # as priced, +12.5 % with a drag of 1
    _run(runs / "c" / "deft.50.s0.r0.json", 4.0, 1, {"a": 1.0}, digest="a re-plan")  # not the first plan
    plans = drag.first_plans([runs], (1.0,))
    # priced at its window's links (x 1.2): the sends 2.0-3.2 and 3.2-4.4 s, 4.4 against 5 measured
    assert sorted((p.layout, p.links, tuple(round(e, 4) for e in p.errors), round(p.at_window, 4))
                  for p in plans) == [("2 x 1", 1.0, (0.0, 0.125), 0.0), ("2 x 2", 1.2, (-0.2, -0.1), -0.12)]
    text = drag.report(plans, (1.0,), "cmd")
    assert "| CNN | 2 x 2 | 1 | 1.20 (1.20-1.20) | -20.0% | 0 | 1 | 1 of 1 |" in text
    assert "| CNN | 2 x 1 | 1 | 1.00 (1.00-1.00) | +0.0% | 1 | 1 | 1 of 1 |" in text


def test_no_run_with_a_first_plan_is_an_error(drag: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path / "runs" / "deft.50.s0.r0.json", 4.0, 1, {}, digest="a re-plan")
    monkeypatch.setattr("sys.argv", ["report_drag.py", str(tmp_path / "runs"), "--no-write"])
    assert drag.main() == 1
    assert "no run with a recoverable first plan" in capsys.readouterr().err


def test_a_file_that_is_not_a_run_record_is_named_and_left_out(drag: Any, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    _run(runs / "deft.50.s0.r0.json", 5.0, 2, {"a": 1.2})
    (runs / "deft.50.s1.r0.json").write_text("{not json", encoding="utf-8")
    (runs / "deft.50.s2.r0.json").write_text('{"iters": []}', encoding="utf-8")
    plans = drag.first_plans([runs], (1.0,))
    assert [p.layout for p in plans] == ["2 x 2"]
    err = capsys.readouterr().err
    assert "deft.50.s1.r0.json: skipped, not a readable JSON record" in err
    assert "deft.50.s2.r0.json: skipped, no 'summary' object" in err
