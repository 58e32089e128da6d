"""bench_peers --trainer accelerate: which schemes run, and deft's ratio to torch DDP under the trainer beside
its ratio in train_lm.py's own loop (numbers derived by hand from synthetic rows)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def _peers(monkeypatch: pytest.MonkeyPatch) -> Any:
    import importlib.util

    path = REPO / "benchmarks" / "bench_peers.py"
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location("_trainer_bench_peers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _row(peers: Any, name: str, iter_ms: float, to_target: float | None) -> Any:
    return peers.Row(name=name, runs=1, iter_s=iter_ms / 1e3, iter_spread=(iter_ms / 1e3, iter_ms / 1e3),
                     to_target={2.5: (to_target, 0 if to_target is None else 1, None)}, final_acc=2.4,
                     final_mean=2.4, final_by_seed={0: 2.4}, best_acc=2.4, updates_per_iter=1.0, time_s=100.0,
                     plan="", load=None)


def test_trainer_runs_each_wrapper_in_the_own_loop_and_through_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    peers = _peers(monkeypatch)
    assert peers.default_schemes("lm", "accelerate") == ["torch", "deft", "torch+accelerate", "deft+accelerate"]
    assert "deft+accelerate" in peers.default_schemes("lm", None)
    assert not any("+" in n for n in peers.default_schemes("cnn", None))  # train_cnn.py has no trainer path
    for name, ddp in (("torch+accelerate", "torch"), ("deft+accelerate", "deft")):
        argv = list(peers.SCHEMES[name].argv)
        assert argv[argv.index("--ddp") + 1] == ddp and argv[argv.index("--trainer") + 1] == "accelerate"
    assert peers.SCHEMES["deft+accelerate"].links == peers.SCHEMES["deft"].links == 2


def test_trainer_table_puts_the_two_ratios_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    peers = _peers(monkeypatch)
    wl = peers.WORKLOADS["lm"]
    rows = [_row(peers, "torch", 1600, 150.0), _row(peers, "deft", 800, 100.0),
            _row(peers, "torch+accelerate", 1700, 160.0), _row(peers, "deft+accelerate", 1000, None)]
    lines = peers.trainer_table(rows, wl, (2.5,))
    table = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| figure")]
    # own loop 1600 / 800 = 2.00x; through Accelerate 1700 / 1000 = 1.70x; 1.70 / 2.00 = 0.85
    assert table[0] == "| iteration (ms) | 1600 | 800 | 2.00x | 1700 | 1000 | 1.70x | 0.85 |"
    # deft through the trainer never reached the target: no ratio, said plainly
    assert table[1] == "| time to 2.500 | 150.0 | 100.0 | 1.50x | 160.0 | never | - | - |"
    # without the four rows there is no table
    assert peers.trainer_table(rows[:3], wl, (2.5,)) == []
