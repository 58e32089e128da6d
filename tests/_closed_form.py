"""Closed-form replay of SGD with momentum over deft's ``update_log``, for losses linear in the parameters.

With ``loss = sum_n (w_n * c_n(rank, t)).sum()`` the gradient of parameter ``n`` at iteration ``t`` on
rank ``r`` is ``c_n(r, t)``, whatever the parameters are. An update merging iterations ``its`` must
therefore apply exactly ``sum_{r, t in its, used} c_n(r, t) / (world * len(its))``; a parameter that no
rank used in any merged iteration keeps ``grad = None`` and SGD skips it (torch DDP's
``find_unused_parameters`` behaviour).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch


def sgd_replay(update_log: Sequence[Sequence[object]], world: int, shapes: Mapping[str, tuple[int, ...]],
               coeffs: Callable[[int, int], Mapping[str, torch.Tensor]], lr: float, momentum: float,
               used: Callable[[str, int, int], bool] = lambda n, r, t: True,
               lr_factor: Callable[[int], float] = lambda k: 1.0) -> dict[str, torch.Tensor]:
    """Parameters (float64, starting at zero) after replaying every logged update in order; an update
    merging ``k`` iterations steps with ``lr * lr_factor(k)`` (deft's ``merge_lr_scaling``)."""
    w = {n: torch.zeros(shape, dtype=torch.float64) for n, shape in shapes.items()}
    buf: dict[str, torch.Tensor] = {}
    for _, its in update_log:
        assert isinstance(its, Sequence)
        for n in shapes:
            users = [(r, t) for r in range(world) for t in its if used(n, r, t)]
            if not users:
                continue
            g = sum(coeffs(r, t)[n].double() for r, t in users) / (world * len(its))
            buf[n] = g if n not in buf else momentum * buf[n] + g
            w[n] -= lr * lr_factor(len(its)) * buf[n]
    return w
