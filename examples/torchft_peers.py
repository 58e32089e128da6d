"""torchft's own DiLoCo and LocalSGD (``torchft.local_sgd``) for the examples' ``--ddp torchft-diloco`` and
``--ddp torchft-localsgd`` schemes: the peers of ``examples/diloco.py`` and of deft's local-steps mode as
torchft ships them, fault-tolerance machinery included.

Every rank of the job is one torchft *replica group of one rank*, the way torchft runs DiLoCo across
machines (each machine its own group, the groups meeting in a quorum):

* the lighthouse runs in-process on rank 0 (``torchft.coordination.LighthouseServer(bind="[::]:0",
  min_replicas=<world>)``); its port is broadcast over the job's default process group and the others
  reach it at ``$MASTER_ADDR`` (host 0's address on the testbed's first link);
* every rank serves its group's store (a ``TCPStore`` on its own address on that link) and a
  ``torchft.Manager`` (``rank=0, world_size=1``) advertising that address, so the quorum's gloo group
  (``torchft.process_group.ProcessGroupGloo``) meets over the same link as torch DDP does
  (``GLOO_SOCKET_IFNAME``);
* ``init_sync=False``: every rank builds the model from the same seed (torchft's documented case for
  it), so nothing is sent before the first sync;
* DiLoCo: ``torchft.local_sgd.DiLoCo(manager, [model], inner, outer, sync_every=H)`` with the outer
  optimizer ``SGD(lr, momentum, nesterov=True)`` (the paper's, as examples/diloco.py) and a synchronous
  quorum (``use_async_quorum=False``, which torchft's DiLoCo requires); LocalSGD:
  ``torchft.local_sgd.LocalSGD(manager, model, inner, sync_every=H)`` (parameters averaged every H
  steps, no warm-up phase: torchft's LocalSGD has none) with torchft's default asynchronous quorum.

The job's default process group only carries this start-up and the training loop's barriers; the
synchronisations go through torchft's Manager. Buffers (BatchNorm statistics) are not synchronised:
torchft averages parameters only.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn

#: The examples' ``--ddp`` names of these schemes.
SCHEMES = ("torchft-diloco", "torchft-localsgd")

#: How long a rank waits for a quorum or a collective: long enough for the other rank's evaluation and,
#: at the testbed's slowest rate, a whole model's all-reduce.
TIMEOUT = timedelta(seconds=600)


def own_address(peer: str) -> str:
    """The address this host uses to reach ``peer`` (its address on the link the route to ``peer`` takes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # a UDP connect sends nothing; it only picks the route and the source address
        return str(s.getsockname()[0])


def lighthouse_address(world: int) -> tuple[str, Any]:
    """Start the lighthouse on rank 0 and tell every rank where it is: (its URL, the server or None)."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=world) if dist.get_rank() == 0 else None
    port = [urlparse(server.address()).port if server is not None else None]
    dist.broadcast_object_list(port, src=0)
    return f"http://{os.environ['MASTER_ADDR']}:{port[0]}", server


@dataclass
class TorchftPeer:
    """A running torchft scheme: its Manager, the algorithm (entered: its optimizer hooks are live), the
    lighthouse (rank 0) and the group's store. :meth:`close` stops them in the right order."""

    manager: Any
    algorithm: Any
    info: dict[str, Any]
    lighthouse: Any = None
    store: Any = None

    def syncs(self) -> int:
        """Synchronisations committed so far (the Manager's step)."""
        return int(self.manager.current_step())

    def close(self) -> None:
        """Leave the algorithm's context (its hooks removed), shut the Manager and the lighthouse down."""
        self.algorithm.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def start(scheme: str, model: nn.Module, inner: torch.optim.Optimizer, sync_every: int, outer_lr: float = 0.7,
          outer_momentum: float = 0.9) -> TorchftPeer:
    """Join this rank to torchft as its own replica group and wrap ``inner`` in DiLoCo or LocalSGD.

    Needs the job's default process group (for the lighthouse's address) and ``$MASTER_ADDR``.
    ``sync_every``: inner steps between synchronisations (H); ``outer_lr``/``outer_momentum``: DiLoCo's
    outer Nesterov SGD.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"torchft_peers.start: unknown scheme {scheme!r}; expected one of {SCHEMES}")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at info
    from torchft import Manager
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.process_group import ProcessGroupGloo

    world, rank = dist.get_world_size(), dist.get_rank()
    lighthouse, server = lighthouse_address(world)
    here = own_address(os.environ["MASTER_ADDR"])
    store = dist.TCPStore(here, 0, is_master=True, wait_for_workers=False)
    diloco = scheme == "torchft-diloco"
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=world,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        use_async_quorum=not diloco, timeout=TIMEOUT, quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT,
        rank=0, world_size=1, store_addr=here, store_port=store.port, lighthouse_addr=lighthouse,
        replica_id=f"replica{rank}", hostname=here, init_sync=False)
    info: dict[str, Any] = {"library": "torchft", "sync_every": sync_every, "replica_groups": world,
                            "lighthouse": "in-process on rank 0", "quorum": "sync" if diloco else "async"}
    algorithm: Any
    if diloco:
        outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum,
                                nesterov=outer_momentum > 0)
        algorithm = DiLoCo(manager, [model], inner, outer, sync_every=sync_every)
        info.update(outer_lr=outer_lr, outer_momentum=outer_momentum, outer_nesterov=outer_momentum > 0)
    else:
        algorithm = LocalSGD(manager, model, inner, sync_every=sync_every)
    algorithm.__enter__()
    return TorchftPeer(manager, algorithm, info, lighthouse=server, store=store)
