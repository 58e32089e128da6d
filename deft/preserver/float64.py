"""Float64 sums over gradient-sized tensors without a float64 copy of each tensor.

The preserver's statistics (:func:`deft.preserver.noise.local_stats`, :meth:`DirectionPair.dot
<deft.preserver.noise.DirectionPair.dot>`, :func:`deft.preserver.curvature.secant_sums`) accumulate
in float64. Written as ``x.to(torch.float64)`` they allocate a fresh float64 tensor per operand; on
the CPU an allocation that large is a new mapping whose pages fault in on first touch, which makes the
conversion many times slower than the same copy into a buffer already touched. The statistics run on
every warm-up and profile iteration (under PowerSGD also on each of its plain iterations), so that cost
was a large part of those iterations (measured: benchmarks/results/peers.md, "Where deft + PowerSGD's
start-up goes").

Here the operands are converted a chunk at a time (:data:`CHUNK` elements) into float64 scratch
buffers kept per device and reused, so memory stays bounded (two ``CHUNK``-element float64 buffers
per device) and the pages stay resident. The values are those of the plain float64 expressions: each
element is converted exactly (float32/float16/bfloat16 -> float64 is exact), the difference
``b - a`` of two float64 conversions is formed in float64, products and squares in float64; only the
order of the final float64 additions differs (per chunk, then the chunks' sums), a relative change
of the order of float64's rounding (1e-16), not of the statistics' maths. A tensor of at most
``CHUNK`` elements is summed in one call.

Invariant: the scratch buffers are module state shared by every caller on a device, so two threads
must not sum on the same device at once (deft calls these from the training thread only:
``deft.runtime.grad_stats``); a result is a fresh 0-d tensor, never a view of the scratch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Elements per chunk (8 MB of float64 per scratch buffer).
CHUNK = 1 << 20

_scratch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    key = str(device)
    bufs = _scratch.get(key)
    if bufs is None or bufs[0].numel() < CHUNK:
        bufs = (torch.empty(CHUNK, dtype=torch.float64, device=device),
                torch.empty(CHUNK, dtype=torch.float64, device=device))
        _scratch[key] = bufs
    return bufs


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def dot64(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_i x_i y_i`` in float64 as a 0-d float64 tensor on ``x``'s device (``y`` None: ``|x|²``).
    ``y`` may live on another device (it is converted onto ``x``'s)."""
    import torch

    fx = _flat(x)
    fy = None if y is None else _flat(y)
    if fy is not None and fy.numel() != fx.numel():
        raise ValueError(f"dot64: {fx.numel()} against {fy.numel()} elements")
    n = fx.numel()
    if n <= CHUNK:
        x64 = fx.to(torch.float64)
        y64 = x64 if fy is None else fy.to(device=fx.device, dtype=torch.float64)
        return torch.dot(x64, y64)
    bx, by = _buffers(fx.device)
    total = torch.zeros((), dtype=torch.float64, device=fx.device)
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        cx = bx[:hi - lo]
        cx.copy_(fx[lo:hi])
        if fy is None:
            total += torch.dot(cx, cx)
        else:
            cy = by[:hi - lo]
            cy.copy_(fy[lo:hi])
            total += torch.dot(cx, cy)
    return total


def sq_dist64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_i (b_i - a_i)²`` with both converted to float64 first, as a 0-d float64 tensor."""
    import torch

    fa, fb = _flat(a), _flat(b)
    if fa.numel() != fb.numel():
        raise ValueError(f"sq_dist64: {fa.numel()} against {fb.numel()} elements")
    n = fa.numel()
    if n <= CHUNK:
        return torch.sum((fb.to(torch.float64) - fa.to(torch.float64)) ** 2)
    ba, bb = _buffers(fa.device)
    total = torch.zeros((), dtype=torch.float64, device=fa.device)
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        ca, cb = ba[:hi - lo], bb[:hi - lo]
        ca.copy_(fa[lo:hi])
        cb.copy_(fb[lo:hi])
        total += torch.sum(cb.sub_(ca).pow_(2))
    return total
