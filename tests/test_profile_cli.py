"""``deft-profile``: usage errors exit 2 with a clear message; real 2-rank runs give a plannable profile.

The end-to-end runs launch ``examples/train_cnn.py`` under torchrun (2 gloo ranks) with a small CNN
(width 32: three 1 MB-capped buckets) for 10 iterations: 3 warm-up, 3 measured (``--iters 3``), the
rest under the planned schedule. The profile must load, have the run's buckets, be accepted by
``deft plan``, and come with a markdown report (per-bucket table) and a PNG timeline.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from deft.profile import Profile
from deft.profiler.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_cnn.py"
SMALL = ["--ddp", "deft", "--epochs", "1", "--max-iters", "10", "--width", "32", "--hidden", "128",
         "--batch-size", "16", "--no-progress"]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_no_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, ["--out", str(tmp_path / "p.json")])
    assert "no training script given" in err
    assert not (tmp_path / "p-traces").exists()  # bad usage touches nothing


def test_missing_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, ["--out", str(tmp_path / "p.json"), str(tmp_path / "nope.py")])
    assert "nope.py not found" in err


def test_nothing_after_dashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "nothing after '--'" in _error(capsys, ["--out", str(tmp_path / "p.json"), "--"])


def test_bad_iters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, ["--iters", "0", "--out", str(tmp_path / "p.json"), str(SCRIPT)])
    assert "--iters: expected an integer >= 1, got 0" in err


def test_failing_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, ["--backend", "timing", "--out", str(tmp_path / "p.json"), "--",
                          sys.executable, "-c", "import sys; sys.exit(3)"])
    assert "failed with exit code 3" in err


def test_command_not_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, ["--backend", "timing", "--out", str(tmp_path / "p.json"), "--",
                          str(tmp_path / "no-such-program")])
    assert "cannot run" in err and "no-such-program" in err


def test_command_that_writes_no_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, ["--backend", "timing", "--out", str(tmp_path / "p.json"), "--",
                          sys.executable, "-c", "pass"])
    assert "wrote no profile" in err
    err = _error(capsys, ["--backend", "torch", "--out", str(tmp_path / "p.json"), "--",
                          sys.executable, "-c", "pass"])
    assert "no torch.profiler trace" in err


def test_nsys_backend_without_nsys(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nsys anywhere
    err = _error(capsys, ["--backend", "nsys", "--out", str(tmp_path / "p.json"), str(SCRIPT)])
    assert "no 'nsys' on PATH" in err


def test_auto_without_nsys_is_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from deft.profiler.cli import choose_backend

    monkeypatch.setenv("PATH", str(tmp_path))
    assert choose_backend("auto") == "torch"
    assert choose_backend("timing") == "timing"


def profile_end_to_end(backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Profile:
    """Run deft-profile on the small script with 2 ranks; check what every backend must produce."""
    from deft.cli import main as deft_main

    out = tmp_path / "prof.json"
    rc = main(["--nproc-per-node", "2", "--backend", backend, "--iters", "3", "--timeout", "150",
               "--out", str(out), str(SCRIPT), *SMALL])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    prof = Profile.load(out)
    assert prof.world_size == 2 and prof.n >= 2
    assert prof.link_names == ("primary",)
    assert all(t.forward_s > 0 and t.backward_s > 0 and prof.comm_time(b, "primary") > 0
               for b, t in enumerate(prof.times))
    # real parameter names (from the timing profile of the same run, also for the trace backend)
    names = [n for b in prof.buckets for n in b.params]
    assert "classifier.7.weight" in names and len(names) == len(set(names))
    report = (tmp_path / "prof.md").read_text()
    assert "| bucket | params | numel |" in report and "coverage rate CR" in report
    assert report.count("\n| ") >= prof.n + 3
    assert (tmp_path / "prof.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert deft_main(["plan", str(out), "--out", str(tmp_path / "schedule.json")]) == 0
    assert (tmp_path / "schedule.json").exists()
    return prof


@pytest.mark.slow
def test_end_to_end_timing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = profile_end_to_end("timing", tmp_path, capsys)
    assert prof.source == "timing" and prof.meta["profile_iterations"] == 3
    assert list((tmp_path / "prof-traces").iterdir()) == []  # no trace backend, no traces


@pytest.mark.slow
def test_end_to_end_torch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = profile_end_to_end("torch", tmp_path, capsys)
    assert prof.source == "kineto"
    assert sorted(p.name for p in (tmp_path / "prof-traces").iterdir()) == ["rank0.json.gz", "rank1.json.gz"]
    assert prof.meta["ranks"] == [0, 1] and len(prof.meta["steps_used"]) == 3


def test_deft_dispatcher_imports_only_the_chosen_subcommand(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from deft.cli import main as deft_main

    monkeypatch.setitem(sys.modules, "deft.testbed", None)  # as if deft.testbed failed to import
    with pytest.raises(SystemExit):
        deft_main(["--help"])
    assert "testbed" in capsys.readouterr().out  # still listed
    with pytest.raises(SystemExit):
        deft_main(["plan", "--help"])  # other subcommands still work
    assert "--epsilon" in capsys.readouterr().out
    assert deft_main(["testbed", "status"]) == 2
    assert "cannot load deft.testbed" in capsys.readouterr().err
