"""examples/train_lm.py: a HuggingFace GPT-2 (or Llama) on the standard library's source text.

Run in 2 gloo ranks as torchrun starts them (tests/_scripts.py, a tiny config), once with torch DDP and
once with deft at epsilon 0, for each ``--arch`` and with ``--optimizer muon`` (torch's Muon and AdamW,
two optimizers): the trained parameters (``--save-model``), every
iteration's training loss and every validation loss must agree to 1e-5 (deft at epsilon 0 is torch DDP's
maths, tied embeddings, AdamW, the warm-up/cosine schedule, the clip and the Llama's rotary buffers
included); a bad flag fails at once naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._scripts import load_script, run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_lm.py"
TINY = ["--n-embd", "32", "--n-layer", "2", "--n-head", "2", "--seq", "32", "--iters", "8", "--eval-every", "4",
        "--data-bytes", "200000"]


def _run(tmp: Path, ddp: list[str], arch: str = "gpt2", optimizer: str = "adamw") -> dict[str, object]:
    out = tmp / f"{ddp[1]}.json"
    run_script(SCRIPT, [*ddp, *TINY, "--arch", arch, "--optimizer", optimizer, "--json", str(out),
                        "--save-model", str(tmp / f"{ddp[1]}.pt")], timeout=120)
    doc: dict[str, object] = json.loads(out.read_text())
    return doc


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "optimizer"), [("gpt2", "adamw"), ("llama", "adamw"), ("gpt2", "muon")])
def test_deft_at_epsilon_zero_trains_the_lm_as_torch_ddp_does(tmp_path: Path, arch: str, optimizer: str) -> None:
    ref = _run(tmp_path, ["--ddp", "torch"], arch, optimizer)
    ours = _run(tmp_path, ["--ddp", "deft", "--epsilon", "0"], arch, optimizer)
    assert ours["summary"]["arch"] == arch  # type: ignore[index]
    assert ours["summary"]["optimizer"] == optimizer  # type: ignore[index]
    ref_losses = [r["loss"] for r in ref["iters"]]  # type: ignore[attr-defined, index]
    our_losses = [r["loss"] for r in ours["iters"]]  # type: ignore[attr-defined, index]
    assert len(our_losses) == 8
    for a, b in zip(our_losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (our_losses, ref_losses)
    for a, b in zip(ours["evals"], ref["evals"], strict=True):  # type: ignore[call-overload]
        assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * b["val_loss"], (a, b)
    assert ours["summary"]["updates"] == 8  # type: ignore[index]
    a = torch.load(tmp_path / "deft.pt", weights_only=True)
    b = torch.load(tmp_path / "torch.pt", weights_only=True)
    assert a.keys() == b.keys()
    for name in b:  # the tied lm_head and wte included
        rel = ((a[name].float() - b[name].float()).abs().max() / b[name].float().abs().max().clamp_min(1e-12)).item()
        assert rel < 1e-5, f"{name}: relative difference {rel}"


@pytest.mark.slow
def test_a_bad_flag_is_refused_naming_it() -> None:
    p = subprocess.run([sys.executable, str(SCRIPT), "--n-embd", "30", "--n-head", "4"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "--n-embd 30 must be a multiple of --n-head 4" in p.stderr, p.stderr


@pytest.mark.slow
def test_the_llama_reads_buffers_at_its_forwards_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``--arch llama`` adds to the parity test above: buffers (the rotary frequencies, left out of the
    state dict) that torch DDP broadcasts before every forward and the forward reads before any layer."""
    lm = load_script(SCRIPT, monkeypatch)
    args = lm.parse_args(["--arch", "llama", *TINY])
    model = lm.make_model(args)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert "model.rotary_emb.inv_freq" in dict(model.named_buffers())
    assert "model.rotary_emb.inv_freq" not in model.state_dict()  # hence this test beside the parity one
    assert model.lm_head.weight is model.model.embed_tokens.weight
    order: list[str] = []
    model.model.rotary_emb.register_forward_pre_hook(lambda m, a: order.append("rotary"))
    model.model.layers[0].register_forward_pre_hook(lambda m, a: order.append("layer 0"))
    x = torch.zeros(1, args.seq, dtype=torch.long)
    lm.lm_loss(model, x, x, False)
    assert order == ["rotary", "layer 0"]
