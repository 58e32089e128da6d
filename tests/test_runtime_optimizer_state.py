"""The optimizer's ``state_dict()`` taken alone holds every update applied, as with torch DDP.

Under a plan whose updates finish module by module in the next forward, the optimizer has not yet
stepped the deferred parameters when the user's ``step()`` returns. A checkpoint of the optimizer alone
(``torch.save(opt.state_dict())``, what many loops and trainers do) must still hold torch DDP's momentum:
deft finishes those updates before the optimizer's state is read. Two gloo ranks on CPU, a forced
deferring schedule at epsilon 0, SGD with momentum; the momentum buffers are compared with torch DDP's
after every step, through ``state_dict()`` and read directly from ``optimizer.state`` (the first torch
function on them applies the deferred updates: deft.runtime.param_watch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values

STEPS = 6


def _momenta(opt: torch.optim.Optimizer, via_state_dict: bool) -> list[torch.Tensor]:
    if via_state_dict:
        state = opt.state_dict()["state"]
        return [state[i]["momentum_buffer"].clone() for i in sorted(state)]
    return [opt.state[p]["momentum_buffer"].clone() for g in opt.param_groups for p in g["params"]
            if p in opt.state]


def _loop(wrapped: nn.Module, opt: torch.optim.Optimizer, rank: int, via_state_dict: bool) -> list[list[Any]]:
    loss_fn = nn.CrossEntropyLoss()
    seen = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss_fn(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step >= 2:  # every parameter has a momentum buffer by now
            seen.append(_momenta(opt, via_state_dict))
    return seen


def state_worker(rank: int, world: int, path: str, via_state_dict: bool) -> dict[str, Any]:
    from tests.test_runtime_parity import Net, deferring_run

    _, opt, ddp = deferring_run(path, rank)
    got = _loop(ddp, opt, rank, via_state_dict)
    torch.manual_seed(0)
    ref = Net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    want = _loop(nn.parallel.DistributedDataParallel(ref), ref_opt, rank, via_state_dict=True)
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                for step_got, step_want in zip(got, want, strict=True)
                for a, b in zip(step_got, step_want, strict=True))
    return {"worst": worst}


@pytest.mark.slow
def test_optimizer_state_dict_alone_holds_torch_ddps_momentum(tmp_path: Any) -> None:
    for v in values(run_ranks(state_worker, 2, (str(tmp_path / "s.json"), True), timeout=120)):
        assert v["worst"] < 1e-5, v


@pytest.mark.slow
def test_the_optimizer_read_directly_holds_torch_ddps_momentum_too(tmp_path: Any) -> None:
    for v in values(run_ranks(state_worker, 2, (str(tmp_path / "s.json"), False), timeout=120)):
        assert v["worst"] < 1e-5, v
