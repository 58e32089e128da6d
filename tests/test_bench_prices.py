"""bench_prices: a saved deft run's world, contention, drag and every plan's price in one row; bad input named."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests._scripts import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def prices(monkeypatch: pytest.MonkeyPatch) -> Any:
    return load_script(REPO / "benchmarks" / "bench_prices.py", monkeypatch)


def _save(run_dir: Path, contention: float | None) -> None:
    link: dict[str, Any] = {"name": "primary"}
    if contention is not None:
        link["contention"] = contention
        link["drag"] = 0.25
    doc = {"summary": {"ddp": "deft", "hosts": 4, "ranks_per_host": 1, "rate_mbit": 250.0, "iter_s_mean": 1.5,
                       "final_val_loss": 2.4, "schedule": {
                           "predicted_iteration_s": 1.5, "profile": {"links": [link, {"name": "second"}]},
                           "plan_info": {"adapt": [
                               {"predicted_s": 2.0, "measured_s": 1.6, "new_schedule": "b", "new_predicted_s": 1.2,
                                "decision": "try the schedule planned on the corrected profile",
                                "forward_vs_profile": 1.4, "backward_vs_profile": 1.1,
                                "links_vs_profile": {"primary": 0.7, "second": 1.25}}
                           ]}}}}
    run_dir.mkdir()
    (run_dir / "deft.250.s0.r0.json").write_text(json.dumps(doc), encoding="utf-8")
    (run_dir / "deft.250.s0.r0.host1.json").write_text("not read", encoding="utf-8")  # a host's own copy


def test_a_run_is_one_row_with_every_plan_priced(prices: Any, tmp_path: Path) -> None:
    _save(tmp_path / "after", 0.5)
    text = prices.report([("after", [tmp_path / "after"])], "one pass", "cmd")
    row = next(line for line in text.splitlines() if line.startswith("| after |"))
    # the first plan 2000 against its window's 1600 (+25 %), the second against the steady 1500 (-20 %):
    # outside 15 %; the links' contention and drag as the profile measured them (the second link's
    # absent: 0); where the first window's forward, backward and links stood against the profile
    assert row == ("| after | GPT-2 | 250 | 4 ranks (4 hosts x 1 rank per host) | 0.00, 0.50 | 0.00, 0.25 | "
                   "2000 / 1600 (+25.0%); 1200 / 1500 (-20.0%) | +25.0% | forward x 1.40; backward x 1.10; "
                   "primary x 0.70, second x 1.25 | - | - | - | - | - | - | no | 1500 | `after` |")


def test_a_run_recorded_before_the_window_was_set_against_the_profile_says_so(prices: Any, tmp_path: Path) -> None:
    _save(tmp_path / "old", 0.5)
    path = tmp_path / "old" / "deft.250.s0.r0.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    for key in ("forward_vs_profile", "backward_vs_profile", "links_vs_profile"):
        del doc["summary"]["schedule"]["plan_info"]["adapt"][0][key]
    path.write_text(json.dumps(doc), encoding="utf-8")
    row = next(line for line in prices.report([("old", [tmp_path / "old"])], "", "cmd").splitlines()
               if line.startswith("| old |"))
    assert "| +25.0% | - | - | - | - | - | - | - | no |" in row


def test_the_first_windows_calibration_is_beside_what_it_timed(prices: Any, tmp_path: Path) -> None:
    _save(tmp_path / "cal", 0.5)
    path = tmp_path / "cal" / "deft.250.s0.r0.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["summary"]["schedule"]["plan_info"]["adapt"][0].update(compute_factor=0.98, comm_factor=1.246)
    path.write_text(json.dumps(doc), encoding="utf-8")
    row = next(line for line in prices.report([("cal", [tmp_path / "cal"])], "", "cmd").splitlines()
               if line.startswith("| cal |"))
    assert ("| forward x 1.40; backward x 1.10; primary x 0.70, second x 1.25; simulated as measured at "
            "compute x 0.98, links x 1.25 |") in row


def test_each_links_time_on_the_slowest_rank_is_beside_the_least(prices: Any, tmp_path: Path) -> None:
    _save(tmp_path / "skew", 0.5)
    path = tmp_path / "skew" / "deft.250.s0.r0.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["summary"]["schedule"]["plan_info"]["adapt"][0]["links_slowest_vs_profile"] = {"primary": 1.384}
    path.write_text(json.dumps(doc), encoding="utf-8")
    row = next(line for line in prices.report([("skew", [tmp_path / "skew"])], "", "cmd").splitlines()
               if line.startswith("| skew |"))
    # the second link's slowest rank not recorded: its cell as before
    assert "| forward x 1.40; backward x 1.10; primary x 0.70 (slowest rank x 1.38), second x 1.25 |" in row


@pytest.mark.parametrize("found, cell", [
    ({"factor": 0.826, "applied": True, "predicted_before_s": 3.4642},
     "x 0.83 (applied: first plan 3464 ms before it)"),
    ({"factor": 1.084, "applied": False}, "x 1.08 (within the tolerance)"),
])
def test_the_compute_drift_read_is_in_the_row(prices: Any, tmp_path: Path, found: dict[str, Any], cell: str) -> None:
    _save(tmp_path / "drift", 0.5)
    path = tmp_path / "drift" / "deft.250.s0.r0.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["summary"]["schedule"]["plan_info"]["compute_drift"] = found
    path.write_text(json.dumps(doc), encoding="utf-8")
    row = next(line for line in prices.report([("d", [tmp_path / "drift"])], "", "cmd").splitlines()
               if line.startswith("| d |"))
    assert f"| - | {cell} | - | no |" in row


def test_the_ranks_fastest_and_slowest_forward_are_in_the_row(prices: Any, tmp_path: Path) -> None:
    _save(tmp_path / "ranks", 0.5)
    path = tmp_path / "ranks" / "deft.250.s0.r0.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    # four ranks, three iterations: fastest 0.157, 0.12, 0.13 (median 0.13); slowest 0.564, 0.522, 0.548 (0.548)
    doc["summary"]["schedule"]["profile"]["meta"] = {"rank_compute_s": {"forward": [
        [0.157, 0.12, 0.143], [0.162, 0.522, 0.512], [0.347, 0.134, 0.13], [0.564, 0.31, 0.548]]}}
    path.write_text(json.dumps(doc), encoding="utf-8")
    row = next(line for line in prices.report([("r", [tmp_path / "ranks"])], "", "cmd").splitlines()
               if line.startswith("| r |"))
    assert "| - | 130 / 548 | no |" in row
    # a record whose ranks timed different numbers of iterations is named, not misread
    doc["summary"]["schedule"]["profile"]["meta"]["rank_compute_s"]["forward"][3].pop()
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(SystemExit, match=r"ranks.*rank_compute_s\.forward: expected every rank's forwards over the "
                                         r"same profile iterations, got \[3, 3, 3, 2\] per rank"):
        prices.report([("r", [tmp_path / "ranks"])], "", "cmd")


def test_bad_runs_are_named(prices: Any, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="expected LABEL=DIR"):
        prices.parse_groups(["after"])
    with pytest.raises(SystemExit, match="no such directory"):
        prices.parse_groups([f"after={tmp_path / 'none'}"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no deft run recorded there"):
        prices.load(tmp_path / "empty")


def test_writing_the_table_again_keeps_the_reading(prices: Any, tmp_path: Path) -> None:
    _save(tmp_path / "after", None)
    out = tmp_path / "prices.md"
    out.write_text(f"## old table\n\n{prices.READING}\n\nwhat it says\n", encoding="utf-8")
    assert prices.main(["--runs", f"after={tmp_path / 'after'}", "--results", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert "## old table" not in text and "| after |" in text
    assert text.endswith(f"\n{prices.READING}\n\nwhat it says\n")


def test_a_titled_table_says_what_it_compares_and_how_it_was_made(prices: Any, tmp_path: Path) -> None:
    _save(tmp_path / "after", None)
    out = tmp_path / "prices.md"
    assert prices.main(["--runs", f"after={tmp_path / 'after'}", "--results", str(out),
                        "--title", "The link clock against the plans' prices"]) == 0
    text = out.read_text(encoding="utf-8")
    assert text.startswith("## The link clock against the plans' prices (`benchmarks/bench_prices.py`)")
    assert "--title 'The link clock against the plans'\"'\"' prices'" in text  # as a shell reads it back


def test_the_command_reads_back_as_given_with_a_quote_in_a_label(prices: Any, tmp_path: Path) -> None:
    _save(tmp_path / "runs", None)
    out = tmp_path / "prices.md"
    spec = f"the links' contention={tmp_path / 'runs'}"
    assert prices.main(["--runs", spec, "--results", str(out)]) == 0
    command = next(line for line in out.read_text(encoding="utf-8").splitlines() if line.startswith("Command: `"))
    assert shlex.split(command[len("Command: `"):command.rindex("`")])[1:] == ["--runs", spec]


def test_the_warm_up_schedule_gone_back_to_is_simulated_on_the_saved_profile_against_its_time(
        prices: Any, tmp_path: Path) -> None:
    # Two buckets of 10 ms forward and 10 ms backward each, each all-reduced in 50 ms on a link of its own.
    # By hand: forwards to 20 ms, bucket 0's backward to 30 (its send to 80), bucket 1's to 40 (its send
    # to 90): 90 ms an iteration, against the 180 the run measured before going back to it.
    from deft.profile import Bucket, BucketTimes, Link, Profile
    from deft.schedule import synchronous_schedule

    profile = Profile(tuple(Bucket(i, (f"p{i}",), 1000, 4000) for i in range(2)),
                      tuple(BucketTimes(0.01, 0.01, {"primary": 0.05, "second": 0.05}) for _ in range(2)),
                      (Link("primary", "gloo"), Link("second", "gloo")), 2, "synthetic", model="two")
    warm = synchronous_schedule((1000, 1000), (4000, 4000), ("primary", "second"), ("primary", "second"))
    _save(tmp_path / "run", None)
    path = tmp_path / "run" / "deft.250.s0.r0.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    sched = doc["summary"]["schedule"]
    sched.update(profile=profile.to_dict(), schedule=warm.to_dict())
    sched["plan_info"]["adapt"][0].update(
        synchronous_s=0.18, decision="slower than the warm-up's synchronous schedule abc (200 ms against 180 ms)")
    sched["plan_info"]["switches"] = [{"iteration": 9, "source": "adapt", "layout": "warm-up"}]
    assert prices.warmup_priced(doc) == "90 / 180 (2.00x)"
    # a run that ended on a plan: its saved profile is corrected, or in the plan's buckets: not priced
    sched["plan_info"]["switches"] = [{"iteration": 9, "source": "adapt"}]
    assert prices.warmup_priced(doc) == "-"


def _lag_run(run_dir: Path, records: list[dict[str, Any]], factors: tuple[float, float] | None,
             lag_s: float = 0.0) -> None:
    """One bucket on link ``a``: forward 2 s, backward 3 s, all-reduce 1.5 s after the backward (6.5 s an
    iteration); the last rank's lag 0.5 s per send on ``a`` (priced by deft as ``lag_s`` when given).
    Saved corrected by ``factors`` (compute, comm) when given, as the first window's correction saves it."""
    from deft.profile import Bucket, BucketTimes, Link, Profile
    from deft.schedule import synchronous_schedule

    profile = Profile(buckets=(Bucket(0, ("p0",), 250, 1000),), times=(BucketTimes(2.0, 3.0, {"a": 1.5}),),
                      links=(Link("a", "gloo", lag_s=lag_s),), world_size=2, source="synthetic",
                      meta={"rank_lag_s": {"a": {"mean": 0.5, "median": 0.5, "max": 0.5, "sends": 3}}})
    schedule = synchronous_schedule((250,), (1000,), ("a",), ("a",))
    saved = profile if factors is None else profile.scaled(*factors)
    for r in records:
        r.setdefault("schedule", schedule.digest())
    doc = {"summary": {"ddp": "deft", "hosts": 2, "ranks_per_host": 1, "rate_mbit": 50.0, "iter_s_mean": 7.0,
                       "schedule": {"predicted_iteration_s": 6.5, "profile": saved.to_dict(),
                                    "schedule": schedule.to_dict(), "plan_info": {"adapt": records}}}}
    run_dir.mkdir()
    (run_dir / "deft.50.s0.r0.json").write_text(json.dumps(doc), encoding="utf-8")


def test_the_first_windows_sends_are_set_against_the_plan_simulated(prices: Any, tmp_path: Path) -> None:
    # the plan ends its one send 6.5 s after the forward began (forward 2 s, backward 3 s, the send 1.5 s);
    # the window's ended at 7 s: 500 ms late. No timeline recorded, or a plan not recoverable: "-".
    _lag_run(tmp_path / "timed", [{"predicted_s": 6.5, "measured_s": 7.7,
                                   "sends_timed": {"a": {"0": [5000.0, 5000.0, 7000.0]}}}], None)
    (doc,) = prices.load(tmp_path / "timed")
    assert prices.sends_against_plan(doc) == "+500 (+500 to +500), 1 send"
    _lag_run(tmp_path / "untimed", [{"predicted_s": 6.5, "measured_s": 7.7}], None)
    (doc,) = prices.load(tmp_path / "untimed")
    assert prices.sends_against_plan(doc) == "-"
    _lag_run(tmp_path / "other", [{"schedule": "another", "predicted_s": 6.5, "measured_s": 7.7,
                                   "sends_timed": {"a": {"0": [5000.0, 5000.0, 7000.0]}}}], None)
    (doc,) = prices.load(tmp_path / "other")
    assert prices.sends_against_plan(doc) == "-"


def test_the_first_plan_priced_with_the_last_ranks_lag_by_hand(prices: Any, tmp_path: Path) -> None:
    # the send, handed to an idle link after the backward, waits the lag: 0.5 + 1.5 after it, 7 s
    _lag_run(tmp_path / "plain", [{"predicted_s": 6.5, "measured_s": 7.7}], None)
    (doc,) = prices.load(tmp_path / "plain")
    assert prices.lag_priced(doc) == "7000 / 7700 (-9.1%)"
    assert "| 500 | 7000 / 7700 (-9.1%) |" in prices.row("plain", tmp_path / "plain", doc)  # the lag beside it
    # saved corrected once by the first window (compute x 2, comm x 0.5): undone, the same price
    _lag_run(tmp_path / "corrected", [{"predicted_s": 6.5, "measured_s": 7.7, "compute_factor": 2.0,
                                          "comm_factor": 0.5}], (2.0, 0.5))
    (doc,) = prices.load(tmp_path / "corrected")
    assert prices.lag_priced(doc) == "7000 / 7700 (-9.1%)"
    # calibrated but settled with the profile left as it was (the record says so; an older record's
    # decision does): the saved profile is the plan's own, not undone
    for name, extra in (("kept", {"profile_corrected": False}),
                        ("kept_old", {"decision": "measured slower than predicted, calibrated with the links x "
                                                  "1.53 while the window timed them at x 1.13: settled"})):
        _lag_run(tmp_path / name, [{"predicted_s": 6.5, "measured_s": 7.7, "compute_factor": 2.0,
                                    "comm_factor": 0.5, **extra}], None)
        (doc,) = prices.load(tmp_path / name)
        assert prices.lag_priced(doc) == "7000 / 7700 (-9.1%)", name
    # corrected again by a later window, or the saved schedule not the first plan: not recoverable
    _lag_run(tmp_path / "twice", [{"predicted_s": 6.5, "measured_s": 7.7, "compute_factor": 2.0,
                                      "comm_factor": 0.5}, {"predicted_s": 7.0, "measured_s": 7.1}], (2.0, 0.5))
    (doc,) = prices.load(tmp_path / "twice")
    assert prices.lag_priced(doc) == "-"
    # settled as priced, then a re-opened window corrected the profile the run saved: not the plan's
    _lag_run(tmp_path / "later", [{"predicted_s": 6.5, "measured_s": 6.6, "profile_corrected": False},
                                  {"predicted_s": 6.5, "measured_s": 7.7, "compute_factor": 2.0, "comm_factor": 0.5,
                                   "profile_corrected": True}], (2.0, 0.5))
    (doc,) = prices.load(tmp_path / "later")
    assert prices.lag_priced(doc) == "-"
    _lag_run(tmp_path / "replanned", [{"schedule": "another", "predicted_s": 6.5, "measured_s": 7.7}], None)
    (doc,) = prices.load(tmp_path / "replanned")
    assert prices.lag_priced(doc) == "-"
    # a run whose deft priced the lag itself (its links' lag_s): its price, not the lag twice, and
    # the same plan without it (6.5 s)
    _lag_run(tmp_path / "waited", [{"predicted_s": 7.0, "measured_s": 7.7}], None, lag_s=0.5)
    (doc,) = prices.load(tmp_path / "waited")
    assert prices.lag_priced(doc) == "7000 / 7700 (-9.1%); without it 6500"
