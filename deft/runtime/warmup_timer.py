"""Warm-up timing: per-bucket forward, backward and per-link all-reduce times -> a ``Profile``.

The runtime's own measurement when no profile is given (the profiler package parses richer ones
from Kineto / Nsight traces). It lives in the runtime because it drives the live run: it hooks the
module and launches collectives on the runtime's links. It runs during the *profile iterations* that follow the
warm-up, while the runtime behaves like torch DDP with synchronous buckets:

* **forward**: forward pre/post hooks on every module that owns trainable parameters measure its
  *exclusive* time (time inside nested owners is charged to them); a module's time is split over the
  buckets holding its parameters in proportion to element counts. The rest of the forward (modules
  without parameters, Python glue) is spread in proportion to the attributed time, so the bucket
  times sum to the measured forward.
* **backward**: the backward starts when the gradient of the module output arrives (a tensor hook on
  the outputs); bucket ``b``'s backward time is the time from the previous bucket-ready event (or
  backward start) to ``b``'s ready event, minus the time deft itself spent communicating in between.
* **communication**: in profile iterations each bucket's all-reduce is waited for right away (which
  brings the ranks in step), then a scratch copy of the bucket is all-reduced and timed once on every
  link. Timing the real collective would include the ranks' compute skew (it completes only when the
  slowest rank reaches the bucket). Timed collectives are serial, so profile iterations are slower
  than training; that is the price of clean numbers.

Every quantity is the median over the profile iterations, then the *maximum over ranks*: in
synchronous data parallelism a collective completes only when the slowest rank joins, and the next
iteration waits for the slowest rank's computation, so the slowest rank sets the pace (and every rank
ends up with the same profile). Each link's ``T(bytes) = alpha + beta * bytes`` is fitted by least
squares over the buckets (non-negative), for the planner's re-partitioned buckets.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.profiler import nvtx
from deft.runtime.buckets import FlatLayout
from deft.runtime.control import ControlPlane
from deft.runtime.links import CommLink
from deft.runtime.tensors import tensors_in


class WarmupTimer:
    """Collects one set of timings per profile iteration; :meth:`profile` reduces them."""

    def __init__(self, module: nn.Module, params: Sequence[torch.Tensor], layout: FlatLayout,
                 links: dict[str, CommLink], cuda: bool) -> None:
        self.layout = layout
        self.links = links
        self.cuda = cuda
        self.n = layout.n_buckets
        self.samples: list[dict[str, Any]] = []
        self._cur: dict[str, Any] | None = None
        self._stack: list[list[Any]] = []
        self._mark = 0.0
        self._handles: list[Any] = []
        index = {id(p): i for i, p in enumerate(params)}
        # Per owning module: bucket shares of its parameters' elements.
        self._shares: dict[int, list[tuple[int, float]]] = {}
        for m in module.modules():
            own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
            if not own:
                continue
            per_bucket: dict[int, int] = {}
            for i in own:
                slot = layout.slots[i]
                for b in layout.param_buckets[i]:
                    lo = sum(layout.bucket_numel[:b])
                    hi = lo + layout.bucket_numel[b]
                    overlap = max(0, min(hi, slot.flat_offset + slot.numel) - max(lo, slot.flat_offset))
                    per_bucket[b] = per_bucket.get(b, 0) + max(overlap, 1 if slot.numel == 0 else 0)
            total = sum(per_bucket.values()) or 1
            self._shares[id(m)] = [(b, c / total) for b, c in per_bucket.items()]
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    # -- forward -------------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        self._cur = {"fwd": [0.0] * self.n, "bwd": [0.0] * self.n,
                     "comm": {name: [0.0] * self.n for name in self.links},
                     "fwd_total": 0.0, "fwd_start": self._now(), "bwd_start": None}
        self._stack.clear()

    def _pre(self, m: nn.Module, args: Any) -> None:
        if self._cur is None:
            return
        now = self._now()
        if self._stack:
            top = self._stack[-1]
            top[2] += now - top[1]
        self._stack.append([id(m), now, 0.0])

    def _post(self, m: nn.Module, args: Any, out: Any) -> None:
        if self._cur is None or not self._stack:
            return
        now = self._now()
        mid, start, acc = self._stack.pop()
        acc += now - start
        for b, share in self._shares.get(mid, []):
            self._cur["fwd"][b] += acc * share
        if self._stack:
            self._stack[-1][1] = now

    def end_forward(self, output: Any) -> None:
        if self._cur is None:
            return
        cur = self._cur
        now = self._now()
        cur["fwd_total"] += now - cur["fwd_start"]
        cur["bwd_mark"] = now  # fallback backward start if no output tensor gets a gradient hook

        def start(_grad: torch.Tensor) -> None:
            if cur["bwd_start"] is None:
                cur["bwd_start"] = self._mark = self._now()

        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(start)

    # -- backward and communication ------------------------------------------------------------
    def bucket_ready(self, b: int) -> None:
        cur = self._cur
        if cur is None:
            return
        now = self._now()
        if cur["bwd_start"] is None:
            cur["bwd_start"] = self._mark = cur.get("bwd_mark", now)
        cur["bwd"][b] += max(now - self._mark, 0.0)
        self._mark = now

    def launched(self, b: int, link: str, views: list[torch.Tensor], works: list[Any], t_start: float,
                 wait: Any, iteration: int = 0, group: int = 0) -> None:
        """Bucket ``b`` was launched on ``link``: wait for it, then time one all-reduce per link.

        The real collective cannot be timed itself: it completes only when the slowest rank reaches
        this bucket, so its duration includes the ranks' compute skew. Once it has completed the ranks
        are in step, and a scratch copy all-reduced on each link measures the link alone.

        The timed launches carry the ``deft/comm/{link}/b{b}/g{group}/it{iteration}`` range (the
        runtime leaves the real launch unlabelled in profile iterations), so a trace of the same
        iterations holds exactly one labelled all-reduce per bucket and link: the measured one.
        """
        cur = self._cur
        if cur is None:
            return
        for w in works:
            wait(w, link, b)
        for name, lk in self.links.items():
            scratch = [v.clone() for v in views]
            t0 = self._now()
            tok = nvtx.push_range("comm", b, iteration, name, group)
            scratch_works = [dist.all_reduce(s, group=lk.group, async_op=True) for s in scratch]
            nvtx.pop_range(tok)
            for w in scratch_works:
                wait(w, name, b)
            lk.stats.calls += len(scratch)
            lk.stats.bytes += sum(s.numel() * s.element_size() for s in scratch)
            cur["comm"][name][b] += self._now() - t0
        self._mark = self._now()  # communication time is not backward time

    def end_iteration(self) -> None:
        if self._cur is not None:
            # Forward time outside parameter-owning modules is spread like the attributed time.
            cur = self._cur
            attributed = sum(cur["fwd"])
            rest = max(cur["fwd_total"] - attributed, 0.0)
            weights = cur["fwd"] if attributed > 0 else [float(n) for n in self.layout.bucket_numel]
            wsum = sum(weights) or 1.0
            cur["fwd"] = [f + rest * w / wsum for f, w in zip(cur["fwd"], weights, strict=True)]
            self.samples.append(cur)
        self._cur = None

    # -- reduction -----------------------------------------------------------------------------
    def profile(self, control: ControlPlane, world: int, link_backends: dict[str, str], model: str,
                names: Sequence[str]) -> Profile:
        """Median over iterations, max over ranks (collective on the control group)."""
        if not self.samples:
            raise RuntimeError("internal: no profile iteration was timed")
        link_names = list(self.links)
        rows = [[statistics.median(s["fwd"][b] for s in self.samples) for b in range(self.n)],
                [statistics.median(s["bwd"][b] for s in self.samples) for b in range(self.n)]]
        rows += [[statistics.median(s["comm"][k][b] for s in self.samples) for b in range(self.n)]
                 for k in link_names]
        t = control.max_rows(rows, "timing profile")
        fwd, bwd = t[0], t[1]
        comm = {k: t[2 + j] for j, k in enumerate(link_names)}
        nbytes = self.layout.bucket_nbytes()
        buckets = tuple(Bucket(id=b, params=tuple(names[i] for i in self.layout.bucket_params[b]),
                               numel=self.layout.bucket_numel[b], nbytes=nbytes[b]) for b in range(self.n))
        times = tuple(BucketTimes(forward_s=fwd[b], backward_s=bwd[b], comm_s={k: comm[k][b] for k in link_names})
                      for b in range(self.n))
        links = []
        for k in link_names:
            alpha, beta = fit_alpha_beta(nbytes, comm[k])
            lk = self.links[k]
            links.append(Link(name=k, backend=link_backends[k], ifname=lk.ifname, alpha_s=alpha, beta_s_per_byte=beta))
        return Profile(buckets=buckets, times=times, links=tuple(links), world_size=world, source="timing",
                       versions={"torch": torch.__version__}, model=model,
                       meta={"profile_iterations": len(self.samples), "reduction": "median over iterations, "
                             "max over ranks"})


def fit_alpha_beta(nbytes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``seconds = alpha + beta * nbytes`` with ``alpha, beta >= 0``."""
    n = len(nbytes)
    xs = [float(x) for x in nbytes]
    mx, my = sum(xs) / n, sum(seconds) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var > 0:
        beta = sum((x - mx) * (y - my) for x, y in zip(xs, seconds, strict=True)) / var
        alpha = my - beta * mx
        if beta < 0:  # noise: all sizes cost the same
            beta, alpha = 0.0, my
        elif alpha < 0:  # through the origin instead
            alpha, beta = 0.0, sum(x * y for x, y in zip(xs, seconds, strict=True)) / sum(x * x for x in xs)
    else:
        alpha, beta = 0.0, (my / mx if mx > 0 else 0.0)
    if alpha == 0 and beta == 0:
        beta = 1e-12  # a link must have a model; measured times were all zero
    return alpha, beta
