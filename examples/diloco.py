"""DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105), Algorithm 1, for the examples' ``--ddp diloco`` scheme.

torchft implements it too (``torchft.local_sgd.DiLoCo``, run by ``examples/torchft_peers.py`` for the
``--ddp torchft-diloco`` scheme) under a ``torchft.Manager``, with its lighthouse, a quorum round per sync
and a fault-tolerant process group; this module is the paper's algorithm on the default process group and
nothing else, the peer without torchft's machinery.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def outer_step(snapshot: Sequence[torch.Tensor], delta: Sequence[torch.Tensor],
               momentum_buf: Sequence[torch.Tensor] | None, lr: float, momentum: float
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One outer step of DiLoCo, pure: new tensors, nothing changed in place, no communication.

    ``snapshot``: the global parameters theta^(t-1) every rank started the round from; ``delta``: the
    pseudo-gradient averaged over the ranks, Delta = mean_i (theta^(t-1) - theta_i^(t)); ``momentum_buf``:
    the outer optimizer's buffers b (None before the first outer step). SGD with Nesterov momentum, with
    ``torch.optim.SGD(nesterov=True, dampening=0)``'s conventions (the paper's outer optimizer):

        b <- Delta                      (first outer step)
        b <- momentum * b + Delta       (later ones)
        theta^(t) = theta^(t-1) - lr * (Delta + momentum * b)

    ``momentum`` = 0 is plain SGD: theta^(t) = theta^(t-1) - lr * Delta; with lr = 1 that is the average of
    the ranks' parameters, post-local SGD's model averaging. Returns (theta^(t), b).
    """
    if len(snapshot) != len(delta) or (momentum_buf is not None and len(momentum_buf) != len(delta)):
        raise ValueError("outer_step: snapshot, delta and momentum_buf must have one tensor per parameter")
    new_params, new_bufs = [], []
    for i, (s, d) in enumerate(zip(snapshot, delta, strict=True)):
        b = d.clone() if momentum_buf is None else momentum * momentum_buf[i] + d
        update = d + momentum * b if momentum != 0 else d
        new_params.append(s - lr * update)
        new_bufs.append(b)
    return new_params, new_bufs


class DiLoCo:
    """DiLoCo around an inner optimizer: H local steps, then an outer step on the averaged pseudo-gradient.

    Every rank runs the inner optimizer (``inner``, over ``model``'s parameters) for ``h`` steps with no
    communication. Then, with theta^(t-1) the snapshot every rank holds (the global parameters after the
    previous outer step) and theta_i^(t) rank i's local parameters:

        Delta_i = theta^(t-1) - theta_i^(t)                 (the pseudo-gradient)
        Delta   = (1/N) sum_i Delta_i                       (all-reduce, the only communication)
        theta^(t) = OuterOpt(theta^(t-1), Delta)            (:func:`outer_step`: SGD, Nesterov momentum,
                                                             paper: lr 0.7, momentum 0.9)
        theta_i  <- theta^(t) on every rank; snapshot <- theta^(t)

    The inner optimizer's state (momentum) is kept across rounds, as in the paper's Algorithm 1. The
    pseudo-gradients go in one flat all-reduce (SUM, then / N) on ``process_group`` (default: the default
    group), or in buckets of ``bucket_cap_mb`` MiB if given. Buffers (BatchNorm statistics) are not
    trained by the optimizers: at each outer step every rank takes rank 0's, as torch DDP's
    ``broadcast_buffers`` does (here only at the outer steps, so the inner steps stay communication-free).
    At construction every rank takes rank 0's parameters and buffers (as torch DDP does).

    Use it as the training loop's optimizer: ``step()`` runs the inner step and, every ``h``-th call,
    the outer step; ``zero_grad()`` is the inner optimizer's.
    """

    def __init__(self, model: nn.Module, inner: torch.optim.Optimizer, h: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, process_group: Any = None, bucket_cap_mb: float | None = None
                 ) -> None:
        if h < 1:
            raise ValueError(f"DiLoCo: h (inner steps per outer step) must be >= 1, got {h}")
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"DiLoCo: expected outer_lr > 0 and 0 <= outer_momentum < 1, got {outer_lr}, "
                             f"{outer_momentum}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"DiLoCo: bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.model, self.inner, self.h = model, inner, h
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.group, self.bucket_cap_mb = process_group, bucket_cap_mb
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = list(model.buffers())
        self.world = dist.get_world_size(process_group)
        self._broadcast([*self.params, *self.buffers])  # rank 0's model everywhere, as torch DDP starts
        self.snapshot = [p.detach().clone() for p in self.params]
        self.momentum_buf: list[torch.Tensor] | None = None
        self.local_steps = 0
        self.outer_steps = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # what LR schedulers and loops that read groups see
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.inner.step()
        self.local_steps += 1
        if self.local_steps % self.h == 0:
            self.sync()

    def _buckets(self, tensors: list[torch.Tensor]) -> Iterable[list[int]]:
        if self.bucket_cap_mb is None:
            yield list(range(len(tensors)))
            return
        cap, bucket, size = self.bucket_cap_mb * 2**20, [], 0
        for i, t in enumerate(tensors):
            if bucket and size + t.numel() * t.element_size() > cap:
                yield bucket
                bucket, size = [], 0
            bucket.append(i)
            size += t.numel() * t.element_size()
        if bucket:
            yield bucket

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step: average the pseudo-gradients, step the snapshot, load it into the model."""
        delta = [s - p.detach() for s, p in zip(self.snapshot, self.params, strict=True)]
        for idx in self._buckets(delta):
            flat = torch.cat([delta[i].reshape(-1) for i in idx])
            dist.all_reduce(flat, group=self.group)
            flat /= self.world
            off = 0
            for i in idx:
                n = delta[i].numel()
                delta[i] = flat[off:off + n].view_as(delta[i])
                off += n
        self.snapshot, self.momentum_buf = outer_step(self.snapshot, delta, self.momentum_buf, self.outer_lr,
                                                      self.outer_momentum)
        for p, s in zip(self.params, self.snapshot, strict=True):
            p.copy_(s)
        self._broadcast(self.buffers)
        self.outer_steps += 1

    @torch.no_grad()
    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values of ``tensors`` on every rank: one flat broadcast per dtype."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            dist.broadcast(flat, src=src, group=self.group)
            off = 0
            for t in same:
                t.detach().copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
