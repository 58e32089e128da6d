"""torch DDP's uneven-inputs support is refused with a clear message before any training.

``ddp.join()`` (torch DDP's context manager) and ``torch.distributed.algorithms.Join([ddp])`` (what
Accelerate's ``join_uneven_inputs`` builds) both raise ``DeftError`` naming uneven inputs and the fix,
as they are entered, and leave the parameters untouched. One gloo rank on CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values


def join_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.algorithms import Join

    import deft
    from deft.errors import DeftError

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    ddp = deft.DistributedDataParallel(model)
    messages = []
    for enter in (lambda: ddp.join(), lambda: Join([ddp])):
        try:
            with enter():
                messages.append("entered")
        except DeftError as e:
            messages.append(str(e))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return {"messages": messages, "unchanged": unchanged}


@pytest.mark.slow
def test_join_is_refused_naming_uneven_inputs() -> None:
    (out,) = values(run_ranks(join_worker, 1, timeout=120))
    assert len(out["messages"]) == 2, out
    for msg in out["messages"]:
        assert "uneven inputs" in msg and "drop_last=True" in msg, msg
    assert out["unchanged"]
