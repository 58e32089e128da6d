"""examples/torchft_peers.py: torchft's own DiLoCo and LocalSGD as the examples' torchft-* schemes.

Each rank is its own torchft replica group (lighthouse in-process on rank 0). Run on the same model,
data and inner optimizer as examples/diloco.py's DiLoCo, torchft's DiLoCo must land on the same
parameters (both are the paper's Algorithm 1 with the outer Nesterov SGD), and torchft's LocalSGD on
the parameters of that DiLoCo with outer lr 1 and no momentum (the ranks' average every H steps).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks
from tests._scripts import load_script

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
H, ITERS = 3, 6  # two synchronisations




@pytest.mark.parametrize(("name", "ddp", "period"), [
    ("torchft-diloco8", "torchft-diloco", 8), ("torchft-localsgd4", "torchft-localsgd", 4),
    ("torchft-localsgd8", "torchft-localsgd", 8)])
def test_bench_peers_torchft_schemes_parse_to_torchfts_algorithm_and_period(
        name: str, ddp: str, period: int, monkeypatch: pytest.MonkeyPatch) -> None:
    peers = load_script(REPO / "benchmarks" / "bench_peers.py", monkeypatch)
    example = load_script(EXAMPLES / "train_cnn.py", monkeypatch)
    args = example.parse_args(list(peers.SCHEMES[name].argv))
    assert args.ddp == ddp
    assert (args.diloco_h if ddp == "torchft-diloco" else args.localsgd_period) == period
    if ddp == "torchft-diloco":  # the hand-written diloco row's outer optimizer, so the two rows compare
        ref = example.parse_args(list(peers.SCHEMES["diloco"].argv))
        assert (args.diloco_h, args.diloco_outer_lr, args.diloco_outer_momentum) == \
            (ref.diloco_h, ref.diloco_outer_lr, ref.diloco_outer_momentum)
    assert peers.SCHEMES[name].links == 1 and not peers.SCHEMES[name].alone


def test_torchft_schemes_refuse_a_bucket_size_and_unknown_names(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    example = load_script(EXAMPLES / "train_cnn.py", monkeypatch)
    with pytest.raises(SystemExit):
        example.parse_args(["--ddp", "torchft-diloco", "--bucket-cap-mb", "4"])
    assert "--bucket-cap-mb does not apply to --ddp torchft-diloco" in capsys.readouterr().err
    peers = load_script(EXAMPLES / "torchft_peers.py", monkeypatch)
    with pytest.raises(ValueError, match="unknown scheme 'torchft-streaming'"):
        peers.start("torchft-streaming", None, None, 4)  # type: ignore[arg-type]


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(model: Any, opt: Any, rank: int) -> list[list[float]]:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(100 + rank)  # every rank its own data: the averaging matters
    for _ in range(ITERS):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def pairs_worker(rank: int, world: int) -> dict[str, Any]:
    """examples/diloco.py's DiLoCo and torchft's, then its LocalSGD, in the same ranks."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(EXAMPLES))
    import torchft_peers
    from diloco import DiLoCo

    out: dict[str, Any] = {}
    for key, outer_lr, momentum in (("hand_diloco", 0.7, 0.9), ("hand_average", 1.0, 0.0)):
        model = _model()
        out[key] = _train(model, DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), h=H,
                                        outer_lr=outer_lr, outer_momentum=momentum), rank)
    for key, scheme in (("torchft_diloco", "torchft-diloco"), ("torchft_localsgd", "torchft-localsgd")):
        model = _model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        peer = torchft_peers.start(scheme, model, inner, H, 0.7, 0.9)
        out[key] = _train(model, inner, rank)
        out[f"{key}_syncs"] = peer.syncs()
        dist.barrier()
        peer.close()
    return out


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


@pytest.mark.slow
def test_torchfts_diloco_and_localsgd_are_the_hand_written_algorithms_on_two_ranks() -> None:
    res = run_ranks(pairs_worker, 2, timeout=150)
    assert all(r.ok for r in res), [r.error for r in res]
    r0, r1 = (r.value for r in res)
    for key in ("torchft_diloco", "torchft_localsgd"):
        assert r0[f"{key}_syncs"] == r1[f"{key}_syncs"] == ITERS // H
        # after a synchronisation every replica holds the same parameters
        assert _max_diff(r0[key], r1[key]) < 1e-6
    assert _max_diff(r0["torchft_diloco"], r0["hand_diloco"]) < 1e-5
    assert _max_diff(r0["torchft_localsgd"], r0["hand_average"]) < 1e-5
    # and the two algorithms differ (the outer momentum acts), so the comparisons above can fail
    assert _max_diff(r0["hand_diloco"], r0["hand_average"]) > 1e-3
