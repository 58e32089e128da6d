"""One rank of a torchrun job that checkpoints every ``EVERY`` iterations and, in its first attempt,
loses rank 1 to SIGKILL between checkpoints while an update is still queued (run by
tests/test_runtime_elastic.py as ``torchrun --max-restarts 1 tests/_elastic_worker.py OUT SCHEDULE``).

Every rank saves its own ``ddp.state_dict()`` and ``optimizer.state_dict()`` (deft's record holds the
rank's queued local gradients) with ``torch.save`` to a temporary file renamed into place, so a kill
never leaves half a checkpoint. A restarted rank loads the last complete checkpoint and trains on to
``TOTAL``. :func:`reference` is the same loop under torch DDP, uninterrupted (for ``run_ranks``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tests.test_runtime_parity import Net, _batch, deferring_run

TOTAL, EVERY, KILL_AFTER = 12, 3, 7  # the kill falls after iteration 7: checkpoint 6 is the last


def main() -> None:
    out, schedule = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, opt, wrapped = deferring_run(schedule, rank)
    ckpt = out / f"ckpt{rank}.pt"
    start = 0
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        wrapped.load_state_dict(saved["ddp"])
        opt.load_state_dict(saved["opt"])
        start = int(saved["next"])
    loss_fn = nn.CrossEntropyLoss()
    for t in range(start, TOTAL):
        x, y = _batch(rank, t)
        loss_fn(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
        if (t + 1) % EVERY == 0:
            tmp = out / f"ckpt{rank}.tmp"
            torch.save({"ddp": wrapped.state_dict(), "opt": opt.state_dict(), "next": t + 1}, tmp)
            os.replace(tmp, ckpt)
        if attempt == 0 and t == KILL_AFTER and rank == 1:
            queued = bool(wrapped.pending_updates)  # type: ignore[arg-type]
            (out / "killed.json").write_text(json.dumps({"queued": queued}))
            os.kill(os.getpid(), signal.SIGKILL)
    wrapped.flush()  # type: ignore[operator]
    log = [[t, list(its)] for t, its in wrapped.update_log]  # type: ignore[attr-defined]
    (out / f"deft{rank}.json").write_text(json.dumps({
        "attempt": attempt, "start": start, "params": [p.detach().tolist() for p in model.parameters()],
        "log": log}))
    sys.stdout.flush()
    os._exit(0)  # torch 2.13's gloo can abort at teardown (tests/_dist.py)


def reference(rank: int, world: int) -> list[object]:
    """The same loop under torch DDP, uninterrupted: the final parameters."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wrapped = nn.parallel.DistributedDataParallel(model)
    loss_fn = nn.CrossEntropyLoss()
    for t in range(TOTAL):
        x, y = _batch(rank, t)
        loss_fn(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().tolist() for p in model.parameters()]


if __name__ == "__main__":
    main()
