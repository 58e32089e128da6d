"""examples/train_lm.py --trainer accelerate: the lm trained through Accelerate's no_trainer loop.

The trainer's loop must train exactly what the script's own loop trains (same windows on every rank,
same schedule, same clipping, same dropout masks), so that bench_peers' ratios under the trainer and in
the own loop compare the wrappers and nothing else: torch DDP through Accelerate gives the own loop's
losses, validation losses and parameters, and deft's Accelerator at epsilon 0 gives torch DDP's.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._scripts import load_script, run_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_lm.py"
ITERS = 6
TINY = ["--n-embd", "32", "--n-layer", "1", "--n-head", "2", "--seq", "16", "--iters", str(ITERS), "--eval-every",
        "3", "--skip-iters", "1", "--data-bytes", "20000", "--val-windows", "4"]




def test_accelerates_sharded_loader_gives_every_rank_the_own_loops_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    lm = load_script(SCRIPT, monkeypatch)
    data = torch.arange(5000) % 256
    args = argparse.Namespace(iters=5, batch_size=3, seq=8, seed=4)
    world = 2
    ds = lm.LoopWindows(data, args, world)
    assert len(ds) == args.iters * world * args.batch_size
    for rank in range(world):
        shard = BatchSamplerShard(BatchSampler(SequentialSampler(ds), args.batch_size, drop_last=False),
                                  num_processes=world, process_index=rank)
        batches = list(shard)
        assert len(batches) == args.iters
        for it, idx in enumerate(batches):
            x, y = lm.windows(data, args.batch_size, args.seq, lm.loop_generator(args.seed, rank, it))
            assert torch.equal(torch.stack([ds[j][0] for j in idx]), x)
            assert torch.equal(torch.stack([ds[j][1] for j in idx]), y)


@pytest.mark.parametrize(("argv", "message"), [
    (["--ddp", "fp16", "--trainer", "accelerate"], "--trainer accelerate runs --ddp torch or --ddp deft"),
    (["--ddp", "torchft-diloco", "--trainer", "accelerate"], "--trainer accelerate runs --ddp torch or --ddp deft"),
    (["--ddp", "torch", "--trainer", "accelerate", "--bucket-cap-mb", "4"],
     "--bucket-cap-mb does not apply to --trainer accelerate"),
    (["--trainer", "lightning"], "--trainer: invalid choice"),
])
def test_trainer_flags_that_cannot_apply_are_refused(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    lm = load_script(SCRIPT, monkeypatch)
    with pytest.raises(SystemExit):
        lm.parse_args(argv)
    assert message in capsys.readouterr().err


def test_deft_scheme_gets_defts_accelerator_with_the_schemes_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import deft.integrations

    made: list[dict[str, Any]] = []

    class Recording:
        def __init__(self, **kwargs: Any) -> None:
            made.append(kwargs)

    fake = types.ModuleType("deft.integrations.accelerate")
    fake.Accelerator = Recording  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deft.integrations.accelerate", fake)
    monkeypatch.setattr(deft.integrations, "accelerate", fake, raising=False)
    monkeypatch.delenv("DEFT_CONFIG", raising=False)
    lm = load_script(SCRIPT, monkeypatch)
    acc = lm.make_accelerator(lm.parse_args(["--ddp", "deft", "--trainer", "accelerate", "--epsilon", "0", "--bf16"]))
    assert isinstance(acc, Recording)
    assert made[0]["deft_config"].epsilon == 0.0 and made[0]["cpu"] is True and made[0]["mixed_precision"] == "bf16"
    del fake.Accelerator  # type: ignore[attr-defined]
    with pytest.raises(SystemExit, match=r"needs deft\.integrations\.accelerate\.Accelerator"):
        lm.make_accelerator(lm.parse_args(["--ddp", "deft", "--trainer", "accelerate"]))


def _run(tmp: Path, name: str, *argv: str) -> dict[str, Any]:
    out, model = tmp / f"{name}.json", tmp / f"{name}.pt"
    # 2 ranks as torchrun starts them (tests/_scripts.py)
    run_script(SCRIPT, [*argv, *TINY, "--json", str(out), "--save-model", str(model)], timeout=150)
    doc: dict[str, Any] = json.loads(out.read_text())
    doc["params"] = torch.load(model, weights_only=True)
    return doc


@pytest.fixture(scope="module")
def own_torch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("own"), "own", "--ddp", "torch")


def _same_run(a: dict[str, Any], b: dict[str, Any], tol: float) -> None:
    la, lb = [r["loss"] for r in a["iters"]], [r["loss"] for r in b["iters"]]
    assert len(la) == len(lb) == ITERS
    assert la == pytest.approx(lb, rel=tol), (la, lb)
    assert [e["val_loss"] for e in a["evals"]] == pytest.approx([e["val_loss"] for e in b["evals"]], rel=tol)
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name], rtol=0, atol=tol)


@pytest.mark.slow
def test_torch_ddp_through_accelerate_trains_what_the_own_loop_trains(tmp_path: Path,
                                                                      own_torch: dict[str, Any]) -> None:
    acc = _run(tmp_path, "acc", "--ddp", "torch", "--trainer", "accelerate")
    s = acc["summary"]
    assert s["trainer"] == "accelerate" and s["updates"] == ITERS
    assert s["scheme"]["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    _same_run(acc, own_torch, 1e-6)


@pytest.mark.slow
def test_deft_through_accelerate_at_epsilon_zero_trains_what_torch_ddp_trains(tmp_path: Path,
                                                                               own_torch: dict[str, Any]) -> None:
    import deft.integrations.accelerate as deft_accelerate

    if not hasattr(deft_accelerate, "Accelerator"):
        pytest.skip("deft.integrations.accelerate has no Accelerator in this checkout")
    acc = _run(tmp_path, "deft_acc", "--ddp", "deft", "--trainer", "accelerate", "--epsilon", "0")
    assert acc["summary"]["trainer"] == "accelerate" and acc["summary"]["updates"] == ITERS
    _same_run(acc, own_torch, 1e-5)
