"""One rank of tests/test_runtime_failover.py's exit test (``python -m tests._failover_exit_worker``; the
environment names the rank and the rendezvous). deft trains on ``primary`` and ``second``; from iteration
4 on, rank 0's all-reduces on ``second`` never go out (its end of the link is gone), so rank 1's real one
waits for a peer that never comes until the ranks agree the link is lost. Rank 1 then prints one JSON line
(``plan_info["link_failures"]``), closes the wrapper, destroys the process groups and exits with status
0 (``os._exit``, past the interpreter's teardown); rank 0 waits for the file ``DEFT_TEST_GO`` first (its
sockets stay open, as behind a dead NIC), then exits the same way."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

STEPS = 8


def main() -> None:
    import deft
    from tests.test_runtime_failover import Fault, Injector, Net, _batch, _config, _sgd

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    opt = _sgd(model)
    # gloo's own timeout far above the test's bound: a wait for the stuck collective would show
    ddp = deft.DistributedDataParallel(model, config=_config(["primary", "second"], timeout_s=600.0))
    injector = Injector([Fault("second", 4, ranks=(0,))])
    loss_fn = nn.CrossEntropyLoss()
    for step in range(STEPS):
        injector.arm(step)
        x, y = _batch(rank, step)
        loss_fn(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    ddp.flush()
    injector.remove()
    print(json.dumps({"rank": rank, "failures": ddp.plan_info.get("link_failures", [])}), flush=True)
    if rank == 0:
        go = os.environ["DEFT_TEST_GO"]
        while not os.path.exists(go):
            time.sleep(0.05)
    ddp.close()
    dist.destroy_process_group()
    # close and destroy returned (what the test bounds); torch 2.13's gloo can abort the interpreter's own
    # teardown after them (tests/_dist.py), which a CI run showed here once
    os._exit(0)


if __name__ == "__main__":
    main()
