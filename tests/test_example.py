"""The CNN example trains for real with 2 ranks (started as torchrun starts them) and writes the records
benchmarks read."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._scripts import run_script

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_cnn.py"
# a narrow model and 30 iterations keep the 2-rank run well under 40 s on a shared CPU (and let
# BatchNorm's running statistics, which evaluation uses, settle)
ITERS = 30
SMALL = ["--width", "8", "--hidden", "64", "--max-iters", str(ITERS), "--eval-every", "15", "--batch-size", "32",
         "--lr", "0.05", "--skip-iters", "2", "--no-progress"]


def run_example(tmp_path: Path, *extra: str) -> dict[str, Any]:
    """2 ranks as torchrun starts them (tests/_scripts.py)."""
    out = tmp_path / "run.json"
    printed = run_script(EXAMPLE, [*SMALL, "--json", str(out), *extra], timeout=120)
    assert f"[train_cnn] done: {ITERS} iters" in printed[0]
    return json.loads(out.read_text())


def check_records(doc: dict[str, Any]) -> None:
    s, iters, evals = doc["summary"], doc["iters"], doc["evals"]
    assert s["world_size"] == 2 and s["iters"] == ITERS and len(iters) == ITERS
    assert [e["iter"] for e in evals] == [15, 30]
    assert all(math.isfinite(r["loss"]) and r["iter_s"] > 0 for r in iters)
    assert [r["train_s"] for r in iters] == sorted(r["train_s"] for r in iters)
    assert [r["updates"] for r in iters] == sorted(r["updates"] for r in iters)
    # real learning on real data: 10 classes, chance is 0.1
    assert evals[-1]["test_acc"] > 0.6, evals
    assert s["final_test_acc"] == evals[-1]["test_acc"]


@pytest.fixture(scope="module")
def torch_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_example(tmp_path_factory.mktemp("torch"), "--ddp", "torch")


@pytest.mark.slow
def test_torch_ddp_run_trains_and_records(torch_doc: dict[str, Any]) -> None:
    check_records(torch_doc)
    assert torch_doc["summary"]["updates"] == ITERS and torch_doc["summary"]["updates_per_iter"] == 1.0
    first, last = torch_doc["iters"][0]["loss"], sum(r["loss"] for r in torch_doc["iters"][-3:]) / 3
    assert last < first


@pytest.mark.slow
def test_deft_epsilon_zero_run_is_torch_ddps_run(tmp_path: Path, torch_doc: dict[str, Any]) -> None:
    """Same seed, same data: deft with epsilon = 0 only reorders communication, so every iteration's
    loss is torch DDP's (to float tolerance) and every iteration is applied as an update."""
    doc = run_example(tmp_path, "--ddp", "deft", "--epsilon", "0")
    check_records(doc)
    assert doc["summary"]["epsilon"] == 0.0
    assert doc["summary"]["updates"] == ITERS
    for a, b in zip(torch_doc["iters"], doc["iters"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), (a, b)
    assert doc["summary"]["final_test_acc"] == pytest.approx(torch_doc["summary"]["final_test_acc"], abs=0.01)


@pytest.mark.parametrize(("argv", "message"), [
    (["--epochs", "0"], "--epochs: expected an integer >= 1, got 0"),
    (["--batch-size", "-1"], "--batch-size: expected an integer >= 1, got -1"),
    (["--eval-every", "-1"], "--eval-every: expected an integer >= 0, got -1"),
    (["--lr", "0"], "--lr: expected > 0"),
    (["--config", "/nonexistent/deft.toml"], "--config: no such file /nonexistent/deft.toml"),
])
def test_bad_arguments_name_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The script's own argument parser (what ``python examples/train_cnn.py ...`` runs first), in process."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        train_cnn = importlib.import_module("train_cnn")
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    with pytest.raises(SystemExit) as exit_:
        train_cnn.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err
