"""One rank of tests/test_faults_netns.py, started inside a testbed host's namespace (``python -m
tests._faults_slow_worker``; the testbed's environment names the rank, the rendezvous and the deft config).

It trains torch DDP (the default group, on ``nic0``) for ``FAULTS_STEPS`` steps, then deft from the same
seed on the same batches, and prints one JSON line: deft's ``plan_info``, the iterations each applied
update merged, the largest parameter difference to torch DDP, and after every deft iteration how much
slower per byte the running profile prices the second link than the primary (``ddp.profile``: corrected
by the adaptation). Rank 0 writes its deft iteration count to ``FAULTS_PROGRESS`` after every step, and
the iteration whose window last settled the adaptation (-1 while it is deciding), so the test can change
a link's rate from outside at a given iteration once the adaptation has settled. With ``FAULTS_HOLD``
set, rank 0 also writes ``planned`` to that file once the first plan is installed and waits until the test removes it
(the other rank waits in the next collective): the test changes the links right after the plan starts.
``FAULTS_BATCH``: the samples per rank and iteration (16: the links are the bound at 100 Mbit/s).
``FAULTS_INT8_FAILS``: measuring int8's cost for a codec choice raises ``DeftError`` on every rank (a
measurement that fails everywhere alike, as ``measure_codec`` reports one).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from deft.profile import Profile

LR = 0.05


def make_model() -> nn.Module:
    """0.6 M parameters (2.4 MB of float32 gradient): over 100 Mbit/s links the all-reduce, not the
    forward and backward of a 16-sample batch, is the bound."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 512), nn.Tanh(), nn.Linear(512, 10))


def batch(t: int, rank: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(size, 64, generator=g), torch.randn(size, 10, generator=g)


def per_byte_ratio(profile: Profile | None) -> float | None:
    """The second link's seconds per byte over the primary's, as the running profile prices them."""
    if profile is None:
        return None
    return profile.link("second").beta_s_per_byte / profile.link("primary").beta_s_per_byte


def settled_at(plan_info: object) -> int:
    """The iteration of the window that last settled the adaptation; -1 while it is deciding (or not begun)."""
    records = plan_info.get("adapt", []) if isinstance(plan_info, dict) else []
    return int(records[-1]["iteration"]) if records and records[-1]["settled"] else -1


def _int8_fails(*args: object, **kwargs: object) -> None:
    from deft.errors import DeftError

    raise DeftError("injected by the test: int8 could not be measured")


def main() -> None:
    import deft
    from deft.runtime.codecs import choice

    if os.environ.get("FAULTS_INT8_FAILS"):
        choice.measure_int8 = _int8_fails  # type: ignore[assignment]

    steps = int(os.environ["FAULTS_STEPS"])
    size = int(os.environ.get("FAULTS_BATCH", "16"))
    progress = Path(os.environ["FAULTS_PROGRESS"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    ref = make_model()
    tddp = nn.parallel.DistributedDataParallel(ref)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for t in range(steps):
        x, y = batch(t, rank, size)
        nn.functional.mse_loss(tddp(x), y).backward()
        opt.step()
        opt.zero_grad()

    ours = make_model()
    opt = torch.optim.SGD(ours.parameters(), lr=LR, momentum=0.9)
    ddp = deft.DistributedDataParallel(ours, optimizer=opt)  # the config: $DEFT_CONFIG
    ratios: list[float | None] = []
    hold = Path(os.environ["FAULTS_HOLD"]) if os.environ.get("FAULTS_HOLD") else None
    for t in range(steps):
        x, y = batch(t, rank, size)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        ratios.append(per_byte_ratio(ddp.profile))
        if rank == 0 and ddp.profile is not None and not (progress.parent / "profile.json").exists():
            ddp.profile.save(str(progress.parent / "profile.json"))  # what the first plan was made from
        if rank == 0:
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(f"{t + 1} {settled_at(ddp.plan_info)}", encoding="utf-8")
            tmp.replace(progress)
        if rank == 0 and hold is not None and "t0" in ddp.plan_info:
            hold.write_text("planned", encoding="utf-8")
            deadline = time.monotonic() + 120.0  # a test that died does not leave this rank spinning
            while hold.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            hold = None
    ddp.flush()
    worst = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    print(json.dumps({"rank": rank, "plan_info": json.loads(json.dumps(dict(ddp.plan_info), default=str)),
                      "merged": sorted(i for _, its in ddp.update_log for i in its),
                      "vs_torch": worst, "ratios": ratios}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
