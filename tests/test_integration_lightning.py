"""``Trainer(strategy="deft")`` against Lightning's own ``strategy="ddp"`` (2 gloo ranks on CPU).

One rank-spawn runs every case (tests/_lightning_workers.py): a small classifier, AdamW,
``accumulate_grad_batches=2``, validation every 3 batches (between the micro-batches of a step, and
after it) through the strategy's wrapper, 8 optimizer steps. At epsilon 0 deft's parameters and
validation losses must equal torch DDP's: with norm clipping that engages in 32-true and bf16-mixed;
and on a forced schedule whose updates finish in the next forward, with ``ModelCheckpoint`` saving at
every validation and a run resumed from the end of the second epoch equal to the uninterrupted one,
and with ``torch.compile(module)`` given to ``fit``.
The obvious integration (a ``DDPStrategy`` that only builds deft's wrapper) ends ``fit`` with the
last update still finishing; reading the parameters applies it, so they too are torch DDP's. At the
default epsilon every gradient is applied once and the loss falls. Manual optimization (one optimizer,
a backward per training_step, stepped every call or every second with clipping and a scheduler) equals
``strategy="ddp"``; a GAN's two optimizers are refused at setup, a second ``manual_backward`` in one
training_step before it runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks, values

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests import _lightning_workers

    out: list[dict[str, Any]] = values(run_ranks(_lightning_workers.parity_worker, 2,
                                                 (str(tmp_path_factory.mktemp("lightning")),), timeout=240))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_deft_strategy_matches_ddp_with_accumulation_and_clipping(ranks: list[dict[str, Any]],
                                                                  precision: str) -> None:
    from tests._lightning_workers import CLIP

    for v in ranks:
        case = v[precision]
        assert case["worst"] < 1e-5, case["worst"]
        assert min(case["norms"]) > CLIP  # the clip engaged at every step
        assert case["val"] == pytest.approx(case["ref_val"], abs=1e-5)
        assert case["losses"] == pytest.approx(case["ref_losses"], abs=1e-5)
        assert case["applied"] == list(range(STEPS))  # one deft iteration per optimizer step, each applied once


@pytest.mark.slow
def test_a_compiled_module_on_updates_finishing_in_the_forward_matches_ddp(ranks: list[dict[str, Any]]) -> None:
    """``trainer.fit(torch.compile(module))``: Lightning compiles the module's forward and steps, deft's
    pre-hooks apply the deferred updates inside them; torch DDP's run is compiled alike."""
    for v in ranks:
        case = v["compiled"]
        assert case["worst"] < 1e-5, case["worst"]
        assert case["applied"] == list(range(STEPS))
        assert case["vs_eager"] < 1e-5  # compiled, torch DDP's maths is its eager maths (aot_eager)


@pytest.mark.slow
def test_updates_finishing_in_the_forward_checkpoints_and_resume(ranks: list[dict[str, Any]]) -> None:
    for v in ranks:
        case = v["deferring"]
        assert case["worst"] < 1e-5, case["worst"]
        assert case["val"] == pytest.approx(case["ref_val"], abs=1e-5)
        assert case["applied"] == list(range(STEPS))
        # Lightning's loop between the step and the next forward (zero_grad, logging, the checkpoint's
        # state_dict) uses no parameter: the updates keep finishing in the forward
        assert case["used_before_forward"] is None, case["used_before_forward"]
        # saved at every validation, the one between a step's micro-batches included
        assert v["resumed"]["saved"] == ["epoch=0-step=1.ckpt", "epoch=0-step=3.ckpt", "epoch=1-step=4.ckpt",
                                         "epoch=1-step=6.ckpt", "epoch=2-step=7.ckpt"]
        assert v["resumed"]["with_record"] == v["resumed"]["saved"]
        assert v["resumed"]["worst"] < 1e-5, v["resumed"]["worst"]
        assert v["resumed"]["applied"] == list(range(STEPS))  # the record came back with the checkpoint


@pytest.mark.slow
def test_the_naive_integration_reads_torch_ddps_parameters_after_fit(ranks: list[dict[str, Any]]) -> None:
    """A ``DDPStrategy`` that only builds deft's wrapper leaves ``fit`` with the last update still
    finishing and never flushes; reading the parameters is a use (deft.runtime.param_watch), which
    applies it first: they are torch DDP's."""
    for v in ranks:
        assert v["naive"]["worst"] < 1e-5, v["naive"]


@pytest.mark.slow
def test_default_epsilon_applies_each_gradient_once_and_the_loss_falls(ranks: list[dict[str, Any]]) -> None:
    for v in ranks:
        case = v["default"]
        assert case["applied"] == list(range(case["steps"]))
        assert case["finite"]
        losses = case["losses"]
        assert sum(losses[-6:]) / 6 < 0.8 * sum(losses[:6]) / 6, losses


@pytest.mark.slow
@pytest.mark.parametrize("case", ["manual", "manual_deferring"])
def test_manual_optimization_matches_ddp(ranks: list[dict[str, Any]], case: str) -> None:
    """``automatic_optimization = False``: Lightning runs forward, ``manual_backward`` and ``step`` inside
    the wrapper's forward and calls torch DDP's reducer around the backward; under deft, on torch DDP's
    schedule and on one whose updates finish in the next forward, the run is ``strategy="ddp"``'s."""
    for v in ranks:
        c = v[case]
        assert c["worst"] < 1e-5, c["worst"]
        assert c["losses"] == pytest.approx(c["ref_losses"], abs=1e-5)
        assert c["applied"] == list(range(STEPS))


@pytest.mark.slow
def test_manual_accumulation_with_clipping_and_a_scheduler_matches_ddp(ranks: list[dict[str, Any]]) -> None:
    from tests._lightning_workers import BATCHES_PER_EPOCH

    for v in ranks:
        c = v["manual_accumulate"]
        assert c["worst"] < 1e-5, c["worst"]
        assert c["batches"] == 2 * STEPS
        # every micro-batch is one of deft's iterations; Lightning zeroes the gradients before each validation
        # (on_validation_model_zero_grad), after the third batch of each epoch: that micro-batch is dropped,
        # under torch DDP as here
        dropped = {b for b in range(c["batches"]) if b % BATCHES_PER_EPOCH == BATCHES_PER_EPOCH // 2 - 1}
        assert c["applied"] == [b for b in range(c["batches"]) if b not in dropped], c["applied"]


@pytest.mark.slow
def test_backbone_finetuning_matches_ddp(ranks: list[dict[str, Any]]) -> None:
    """``BackboneFinetuning``: the backbone frozen when the module is wrapped and unfrozen into a param group
    of its own at the second epoch. Neither wrapper averages its gradient (the ranks' backbones part),
    and each rank's optimizer steps it once per step: deft's own steps of updates it left finishing
    must not step it again."""
    for v in ranks:
        case = v["backbone_finetuning"]
        assert case["worst"] < 1e-5, case["worst"]
        assert case["applied"] == list(range(STEPS))
    assert ranks[0]["backbone_finetuning"]["params"][0] != ranks[1]["backbone_finetuning"]["params"][0]


@pytest.mark.slow
def test_a_comm_hook_on_the_cpu_is_left_out_as_strategy_ddp_leaves_it(ranks: list[dict[str, Any]]) -> None:
    """``ddp_comm_hook=fp16_compress_hook`` on the CPU: Lightning's ``DDPStrategy`` registers comm hooks on
    CUDA only, so its run is the plain one; deft's equals it and says the hook is not registered."""
    for v in ranks:
        case = v["comm_hook_on_cpu"]
        assert case["vs_exact"] == 0.0, "strategy='ddp' now registers the hook on the CPU: follow it"
        assert case["worst"] < 1e-5, case["worst"]
    assert len(ranks[0]["comm_hook_on_cpu"]["warned"]) == 1 and ranks[1]["comm_hook_on_cpu"]["warned"] == []


@pytest.mark.slow
def test_a_gan_with_two_optimizers_is_refused_at_setup(ranks: list[dict[str, Any]]) -> None:
    for v in ranks:
        assert "takes one optimizer" in v["gan"] and "strategy='ddp'" in v["gan"], v["gan"]


@pytest.mark.slow
def test_a_second_manual_backward_in_one_training_step_is_refused(ranks: list[dict[str, Any]]) -> None:
    for v in ranks:
        assert "one manual_backward() per training_step" in v["twice"], v["twice"]


@pytest.mark.slow  # imports Lightning: seconds
def test_the_name_is_registered_in_both_lightning_packages() -> None:
    import lightning.pytorch as pl
    import pytorch_lightning

    from deft.integrations.lightning import DeftStrategy, PytorchLightningDeftStrategy

    assert isinstance(pl.Trainer(strategy="deft", accelerator="cpu", devices=1, logger=False).strategy,
                      DeftStrategy)
    assert PytorchLightningDeftStrategy is not None
    assert isinstance(pytorch_lightning.Trainer(strategy="deft", accelerator="cpu", devices=1,
                                                logger=False).strategy, PytorchLightningDeftStrategy)
    given = DeftStrategy(deft_config={"epsilon": 0.0})
    assert pl.Trainer(strategy=given, accelerator="cpu", devices=1, logger=False).strategy is given
    assert given.deft_config == {"epsilon": 0.0}


@pytest.mark.slow
def test_model_averaging_is_refused() -> None:
    from deft.errors import DeftError
    from deft.integrations.lightning import DeftStrategy

    with pytest.raises(DeftError, match="local_steps"):
        DeftStrategy(model_averaging_period=4)


@pytest.mark.slow
def test_without_lightning_the_import_names_the_extra() -> None:
    code = ("import sys; sys.modules['lightning'] = None; sys.modules['pytorch_lightning'] = None\n"
            "try:\n    import deft.integrations.lightning\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert "pip install deft[lightning]" in out.stdout, out.stdout + out.stderr
