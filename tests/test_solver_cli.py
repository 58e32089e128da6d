"""``deft simulate`` and ``deft plan`` end to end through the dispatcher, on the VGG-19 reference profile."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from deft.cli import main
from deft.config import DeftConfig
from deft.preserver.feedback import WalkStats, preserve
from deft.profile import Profile
from deft.schedule import CommTask, Schedule, StagePlan, Update
from deft.solver.cli import format_stages
from deft.solver.compare import simulate
from deft.solver.partition import profile_for_schedule
from deft.solver.simulate import simulate_schedule

VGG19 = Path(__file__).resolve().parents[1] / "examples" / "profiles" / "vgg19.json"


def table_rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        names = ("ddp", "wfbp", "mgwfbp", "bytescheduler", "usbyte", "deft", "deft+preserver")
        if parts and parts[0] in names and len(parts) >= 5:
            rows[parts[0]] = parts[1:]
    return rows


@pytest.mark.slow
def test_simulate_prints_table_and_draws_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "out" / "vgg19_timeline.png"
    assert main(["simulate", str(VGG19), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert set(rows) == {"ddp", "bytescheduler", "usbyte", "mgwfbp", "deft", "deft+preserver"}
    assert rows["ddp"][1] == "1.00x"
    deft_ms = float(rows["deft"][0])
    assert deft_ms == pytest.approx(130.285, rel=0.02)  # the compute bound: forward + backward
    assert float(rows["deft"][1].rstrip("x")) > 2.0
    assert "compute bound 130.3 ms" in out
    assert "simulated steady state" in out and "not measured" in out  # never passed off as a measurement
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_simulate_selected_schemes_and_workers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(VGG19), "--schemes", "wfbp,ddp", "--workers", "64"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert list(rows) == ["wfbp", "ddp"]
    assert "64 workers" in out
    assert main(["simulate", str(VGG19), "--schemes", "ddp"]) == 0
    at16 = float(table_rows(capsys.readouterr().out)["ddp"][0])
    assert float(rows["ddp"][0]) > at16  # ring all-reduce: more workers, longer all-reduces


def test_plan_writes_a_loadable_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "schedule.json"
    assert main(["plan", str(VGG19), "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    sched = Schedule.load(out_file)
    assert f"cycle {sched.cycle} iterations" in out
    assert f"K = {list(sched.batch_sequence)}" in out
    assert re.search(r"position 0 forward", out) and re.search(r"position 0 backward", out)
    rows = table_rows(out)
    assert float(rows["deft"][0]) == pytest.approx(sched.predicted_iteration_s * 1e3, rel=1e-3)
    assert float(rows["deft"][0]) < float(rows["usbyte"][0])


def test_plan_epsilon_zero_is_synchronous(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "s.json"
    assert main(["plan", str(VGG19), "--out", str(out_file), "--epsilon", "0"]) == 0
    sched = Schedule.load(out_file)
    assert sched.cycle == 1 and sched.batch_sequence == (1,)
    assert "K = [1]" in capsys.readouterr().out


def test_bad_profile_file_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text("{ not json")
    assert main(["simulate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "broken.json" in err and "not valid JSON" in err

    damaged = tmp_path / "damaged.json"
    doc = json.loads(VGG19.read_text())
    doc["buckets"][2]["backward_s"] = "fast"
    damaged.write_text(json.dumps(doc))
    assert main(["plan", str(damaged), "--out", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err
    assert "damaged.json" in err and "buckets[2].backward_s" in err
    assert not (tmp_path / "s.json").exists()

    assert main(["simulate", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(VGG19), "--schemes", "ddp,horovod"]) == 2
    assert "horovod" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(VGG19), "--epsilon", "2"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["simulate", str(VGG19), "--workers", "0"])
    cfg = tmp_path / "deft.toml"
    cfg.write_text("epsilon = 'lots'\n")
    assert main(["simulate", str(VGG19), "--config", str(cfg), "--schemes", "ddp"]) == 2
    assert "deft.toml" in capsys.readouterr().err


def test_format_stages_names_positions_within_the_cycle() -> None:
    """An update applied in the next cycle is named by its position there, never by ``apply_after``."""
    sched = Schedule(
        cycle=2, links=("a",), bucket_numel=(1, 1), bucket_nbytes=(4, 4),
        stages=(StagePlan(0, "forward", (CommTask(1, 1, "a"),)), StagePlan(0, "backward", (CommTask(0, 0, "a"),)),
                StagePlan(1, "forward", (CommTask(1, 1, "a"),)), StagePlan(1, "backward", (CommTask(0, 0, "a"),))),
        updates=(Update((0,), 1), Update((1,), 2)),
    )
    text = format_stages(sched)
    assert "update 0: merges positions [0] (k=1), applied after position 1\n" in text + "\n"
    assert "update 1: merges positions [1] (k=1), applied after position 0 of the next cycle" in text
    assert "position 0 forward  1(1)@a" in text


@pytest.mark.slow
def test_simulate_reports_the_plan_and_the_default_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    """The headline deft row is the planner's first plan with the preserver off; what a user
    runs by default goes through the preserver, whose choice depends on the walk statistics. Both rows
    are printed, each with its conditions stated."""
    profile, config = Profile.load(VGG19), DeftConfig()
    ddp_ms = simulate(profile, "ddp", config).iteration_s * 1e3

    def expected(stats: WalkStats | None) -> tuple[float, float]:
        chosen = preserve(profile, config, stats).schedule
        r = simulate_schedule(profile_for_schedule(profile, chosen, config), chosen)
        return r.iteration_s * 1e3, r.updates_per_iteration

    # Without statistics (what a run has before it measures mu and sigma): the no-delay schedule.
    assert main(["simulate", str(VGG19), "--schemes", "ddp,deft"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert float(rows["deft"][0]) == pytest.approx(130.285, rel=0.02)  # preserver off: the compute bound
    ms, upd = expected(None)
    assert float(rows["deft+preserver"][0]) == pytest.approx(ms, rel=1e-3) and upd == 1.0
    assert float(rows["deft+preserver"][3]) == 1.0
    assert float(rows["deft+preserver"][0]) < ddp_ms  # two links still beat DDP's one
    assert "preserver off" in out and "statistics unknown" in out

    stats = "loss=2.0,mu=0.3,sigma=400,lr=0.05,batch=512"
    assert main(["simulate", str(VGG19), "--schemes", "ddp,deft", "--stats", stats]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    ms, upd = expected(WalkStats(loss=2.0, mu=0.3, sigma=400.0, lr=0.05, batch=512))
    assert float(rows["deft+preserver"][0]) == pytest.approx(ms, rel=1e-3)
    assert float(rows["deft+preserver"][3]) == pytest.approx(upd, abs=0.005)
    # The statistics change the choice: noise-dominated (tau = lr sigma / sqrt(512) = 0.88 against lr mu
    # = 0.015 and a loss of 2), a larger batch rebounds less, so merged updates keep their progress and
    # pass at epsilon 0.01 (fewer updates than iterations), where no statistics gave 1.00.
    assert float(rows["deft+preserver"][3]) < 0.9
    assert "loss 2, mu 0.3, sigma 400, lr 0.05, batch 512" in out
    # Where the gradient dominates (sigma 20), a merge keeps about half the progress per iteration and is
    # not fast enough to buy it back: the walk finds it slower to a target, the preserver keeps 1.00.
    assert main(["simulate", str(VGG19), "--schemes", "ddp,deft", "--stats",
                 "loss=2.0,mu=0.3,sigma=20,lr=0.05,batch=512"]) == 0
    assert float(table_rows(capsys.readouterr().out)["deft+preserver"][3]) == 1.0

    assert main(["simulate", str(VGG19), "--stats", "loss=2,mu=0.3"]) == 2
    assert "--stats" in capsys.readouterr().err
