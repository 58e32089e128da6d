"""torch DDP's ignore list (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``), 2 gloo
ranks against torch DDP.

Parameters and buffers named there are left alone by torch DDP: no gradient reduced (each rank steps its
own), no broadcast at construction or before a forward. deft reads the same list from the module: the
head's bias trains on each rank's own gradient and a buffer each rank counts in its own way stays its
own, on deft's plan at epsilon 0, equal to torch DDP's run; the ranks' biases differ (they would agree
were the bias reduced).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values

IGNORED = ["head.bias", "seen"]
STEPS = 12


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = nn.Linear(32, 3)
        self.register_buffer("seen", torch.zeros(1))  # this rank's own count of samples
        self.register_buffer("steps", torch.zeros(1))  # follows rank 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += x.shape[0]
            self.steps += 1
        return self.head(self.body(x))


def train(kind: str, rank: int) -> dict[str, Any]:
    import deft

    model = Net()
    cls = nn.parallel.DistributedDataParallel if kind == "torch" else deft.DistributedDataParallel
    cls._set_params_and_buffers_to_ignore_for_model(model, IGNORED)
    wrapped = (cls(model) if kind == "torch" else
               cls(model, config={"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "bucket_cap_mb": 0.001,
                                  "timeout_s": 30, "solver_time_limit_s": 0.1}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for t in range(STEPS):
        g = torch.Generator().manual_seed(100 * t + rank)
        x = torch.randn(4 + 2 * rank, 8, generator=g)  # ranks see different batch sizes: "seen" differs
        y = torch.randint(0, 3, (x.shape[0],), generator=g)
        nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    if kind == "deft":
        wrapped.flush()  # type: ignore[operator]
    return {"params": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()},
            "buffers": {n: b.flatten().tolist() for n, b in model.named_buffers()},
            "ignore": sorted(getattr(wrapped, "parameters_to_ignore", ()))}


def ignored_worker(rank: int, world: int) -> dict[str, Any]:
    return {"torch": train("torch", rank), "deft": train("deft", rank)}


@pytest.mark.slow
def test_the_ignore_list_leaves_those_parameters_and_buffers_to_each_rank() -> None:
    out = values(run_ranks(ignored_worker, 2, timeout=120))
    for v in out:
        ref, ours = v["torch"], v["deft"]
        for n, p in ref["params"].items():
            assert ours["params"][n] == pytest.approx(p, abs=1e-6), n
        assert ours["buffers"] == ref["buffers"]
        assert ours["ignore"] == ref["ignore"] == sorted(IGNORED)  # torch DDP's attribute
    assert out[0]["deft"]["params"]["head.bias"] != out[1]["deft"]["params"]["head.bias"]  # each rank's own
    assert out[0]["deft"]["params"]["head.weight"] == out[1]["deft"]["params"]["head.weight"]
    assert [v["deft"]["buffers"]["seen"] for v in out] == [[4.0 * STEPS], [6.0 * STEPS]]
