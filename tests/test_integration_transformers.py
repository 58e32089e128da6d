"""deft under the HuggingFace ``Trainer`` (``deft.integrations.transformers.Trainer``) against
``transformers.Trainer`` (torch DDP through Accelerate).

One pair of gloo ranks runs every case of :mod:`tests._accelerate_hf_trainer`: gradient accumulation 2,
an engaging ``max_grad_norm``, a loss and gradient norm logged each step. At epsilon 0 the parameters
and the logged losses and norms are torch DDP's, uninterrupted and across a checkpoint resumed with
``trainer.train(resume_from_checkpoint=...)``; at the default epsilon training runs and the loss falls.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
import torch

from tests import _accelerate_hf_trainer as hf
from tests._dist import run_ranks, values


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hf_trainer")
    return values(run_ranks(hf.cases, 2, (str(tmp),), timeout=300))


def flat(run: dict[str, Any]) -> torch.Tensor:
    return torch.cat([torch.tensor(p) for p in run["params"]])


def applied(run: dict[str, Any]) -> list[int]:
    return sorted(i for _, its in run["update_log"] for i in its)


@pytest.mark.slow
@pytest.mark.parametrize("ours", ["deft", "deft_resumed"])
def test_deft_trainer_gives_torch_ddps_parameters_and_logs(runs: list[dict[str, Any]], ours: str) -> None:
    for rank in runs:
        assert rank[ours]["wrapper"] == "deft.runtime.ddp.DistributedDataParallel"
        assert rank["torch"]["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel"
        torch.testing.assert_close(flat(rank[ours]), flat(rank["torch"]), atol=1e-5, rtol=0)
        assert rank[ours]["steps"] == hf.STEPS
        assert rank[ours]["losses"] == pytest.approx(rank["torch"]["losses"], abs=1e-6)
        assert rank[ours]["grad_norms"] == pytest.approx(rank["torch"]["grad_norms"], abs=1e-5)
    assert torch.equal(flat(runs[0][ours]), flat(runs[1][ours]))


@pytest.mark.slow
def test_clipping_engages(runs: list[dict[str, Any]]) -> None:
    norms = runs[0]["torch"]["grad_norms"]
    assert len(norms) == hf.STEPS and min(norms) > hf.MAX_NORM


@pytest.mark.slow
def test_every_gradient_is_applied_once(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        assert applied(rank["deft"]) == list(range(hf.STEPS))
        # a Trainer checkpoint holds no deft record: the resumed run's wrapper counts from 0 again, and
        # the two halves together apply each of the 8 steps once
        assert rank["deft_first"]["steps"] == hf.STEPS // 2
        assert applied(rank["deft_first"]) == list(range(hf.STEPS // 2))
        assert applied(rank["deft_resumed"]) == list(range(hf.STEPS // 2))


@pytest.mark.slow
def test_default_epsilon_trains(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        run = rank["default"]
        assert applied(run) == list(range(hf.STEPS))
        assert sum(run["losses"][-4:]) < sum(run["losses"][:4])


def test_without_transformers_the_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an absent package looks like to import
    monkeypatch.delitem(sys.modules, "deft.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=r"pip install deft\[transformers\]"):
        importlib.import_module("deft.integrations.transformers")
