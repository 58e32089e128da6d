"""deft under Accelerate (``deft.integrations.accelerate.Accelerator``) against Accelerate's torch DDP.

One pair of gloo ranks runs every case of :mod:`tests._accelerate_lm` (the no_trainer causal-LM loop:
a tiny GPT-2, AdamW, a prepared scheduler, gradient accumulation 2, an engaging clip), first under plain
``accelerate.Accelerator`` and then under deft's, from the same weights and data: at epsilon 0 the
parameters, clipped norms and losses are torch DDP's in fp32, bf16 autocast, fp16 with a GradScaler that
skips an injected inf, a forced deferring schedule (also with Accelerate's ``dynamo_backend``, which
compiles the wrapper), across ``save_state``/``load_state``, and with two optimizers (torch's Muon and
AdamW, each prepared with its scheduler).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
import torch

from tests import _accelerate_lm as lm
from tests._dist import run_ranks, values


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("accelerate")
    return values(run_ranks(lm.cases, 2, (str(tmp),), timeout=300))


def flat(run: dict[str, Any]) -> torch.Tensor:
    return torch.cat([torch.tensor(p) for p in run["params"]])


def applied(run: dict[str, Any]) -> list[int]:
    """The iterations deft's updates merged, each as often as it was applied."""
    return sorted(i for _, its in run["update_log"] for i in its)


PAIRS = [("fp32_torch", "fp32_deft"), ("bf16_torch", "bf16_deft"), ("fp16_torch", "fp16_deft"),
         ("noclip_torch", "deferring_deft"), ("fp32_torch", "deferring_clipped_deft"),
         ("compiled_torch", "compiled_deferring_deft"), ("muon_torch", "muon_deft"),
         ("muon_noclip_torch", "muon_deferring_deft")]


@pytest.mark.slow
@pytest.mark.parametrize(("ref", "ours"), PAIRS)
def test_deft_accelerator_gives_torch_ddps_parameters(runs: list[dict[str, Any]], ref: str, ours: str) -> None:
    for rank in runs:
        torch.testing.assert_close(flat(rank[ours]), flat(rank[ref]), atol=1e-5, rtol=0)
        assert rank[ours]["norms"] == pytest.approx(rank[ref]["norms"], abs=1e-5, nan_ok=True)
        assert rank[ours]["skipped"] == rank[ref]["skipped"]
        assert rank[ours]["unwrapped_is_model"]  # unwrap_model gives the user's model back
    assert torch.equal(flat(runs[0][ours]), flat(runs[1][ours]))


@pytest.mark.slow
def test_every_gradient_is_applied_once(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        for name in ("fp32_deft", "bf16_deft", "deferring_deft", "deferring_clipped_deft", "fp32_deft_resumed",
                     "compiled_deferring_deft", "muon_deft", "muon_deferring_deft"):
            assert rank[name]["iterations"] == lm.STEPS
            assert applied(rank[name]) == list(range(lm.STEPS)), name
        # GradScaler skipped the step whose gradient was inf (micro-batch 5: the third optimizer step)
        assert rank["fp16_deft"]["skipped"] == 1
        assert applied(rank["fp16_deft"]) == [0, 1, 3, 4, 5, 6, 7]
        assert rank["fp16_deft"]["scale"] == rank["fp16_torch"]["scale"]


@pytest.mark.slow
def test_clipping_engages(runs: list[dict[str, Any]]) -> None:
    norms = runs[0]["fp32_torch"]["norms"]
    assert len(norms) == lm.STEPS and min(norms) > lm.MAX_NORM


@pytest.mark.slow
def test_the_forced_schedule_leaves_updates_finishing_in_the_next_forward(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        assert any(rank["deferring_deft"]["finishing"]) and any(rank["compiled_deferring_deft"]["finishing"])
        assert any(rank["muon_deferring_deft"]["finishing"])  # two optimizers keep the overlap
        assert rank["deferring_deft"]["plan"].endswith(".json")  # the schedule file's plan ran


@pytest.mark.slow
def test_save_state_then_load_state_resumes_where_it_stopped(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        first, resumed, whole = rank["fp32_deft_first"], rank["fp32_deft_resumed"], rank["fp32_deft"]
        assert first["steps"] == lm.STEPS // 2 and resumed["steps"] == lm.STEPS
        assert first["losses"] + resumed["losses"] == pytest.approx(whole["losses"], abs=1e-6)
        # the resumed wrapper carries the saved record on: one update log over both halves
        assert resumed["update_log"] == whole["update_log"]
        assert first["norms"] + resumed["norms"] == pytest.approx(whole["norms"], abs=1e-6)
        torch.testing.assert_close(flat(resumed), flat(whole), atol=1e-5, rtol=0)
        torch.testing.assert_close(flat(resumed), flat(rank["fp32_torch"]), atol=1e-5, rtol=0)
        assert resumed["unwrapped_is_model"]


@pytest.mark.slow
def test_save_state_between_micro_batches_resumes_as_torch_ddp(runs: list[dict[str, Any]]) -> None:
    """``save_state`` after the first micro-batch of a step, into the folder of a save at the step before,
    on a schedule whose updates finish in the next forward: it holds what torch DDP's holds (the
    micro-batch's gradient is in neither) and deft's records, and the run resumed from it equals torch
    DDP's resumed run, its update log carried on from the record."""
    for rank in runs:
        world = len(runs)
        assert rank["mid_deft_saved"] == sorted(rank["mid_torch_saved"] + [f"deft_state_{r}.pt" for r in range(world)])
        ours, ref = rank["mid_deft_resumed"], rank["mid_torch_resumed"]
        assert ours["steps"] == ref["steps"] == lm.STEPS
        assert ours["losses"] == pytest.approx(ref["losses"], abs=1e-6)
        torch.testing.assert_close(flat(ours), flat(ref), atol=1e-5, rtol=0)
        assert applied(ours) == list(range(lm.STEPS))  # steps 1-3 from the record, step 4's second micro-batch on


@pytest.mark.slow
def test_default_epsilon_trains(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        run = rank["default_deft"]
        assert applied(run) == list(range(lm.STEPS))
        losses = run["losses"]
        assert sum(losses[-4:]) < sum(losses[:4])


@pytest.mark.slow
def test_join_uneven_inputs_is_refused(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        assert rank["fp32_deft"]["join"] is not None
        assert "does not support uneven inputs" in rank["fp32_deft"]["join"]


def test_without_accelerate_the_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # what an absent package looks like to import
    monkeypatch.delitem(sys.modules, "deft.integrations.accelerate", raising=False)
    with pytest.raises(ImportError, match=r"pip install deft\[accelerate\]"):
        importlib.import_module("deft.integrations.accelerate")


def test_adopt_turns_an_accelerator_into_defts_before_prepare() -> None:
    import accelerate

    from deft.errors import DeftError
    from deft.integrations.accelerate import Accelerator

    lm._reset()
    try:
        plain = accelerate.Accelerator(cpu=True)
        adopted = Accelerator.adopt(plain, deft_config={"epsilon": 0.0})
        assert adopted is plain and isinstance(plain, Accelerator)
        assert adopted.deft_config.epsilon == 0.0
        other = accelerate.Accelerator(cpu=True)
        other.prepare(torch.nn.Linear(2, 2))  # one process: Accelerate builds no DDP, nor does deft
        with pytest.raises(DeftError, match="before prepare"):
            Accelerator.adopt(other)
    finally:
        lm._reset()

