"""Local-steps mode (``config.local_steps = H > 0``): post-local SGD or DiLoCo, its averaging scheduled
over the links and overlapped with the next local steps (Streaming DiLoCo's overlap).

The maths (docs/DESIGN.md, section 5, "Local steps"). ``R`` ranks, ``W = local_warmup_iters``,
optimizer steps counted ``s = 0, 1, ...``:

* **Warm-up** (``s < W``): right before step ``s`` every rank's gradient is replaced by the mean over
  the ranks (``g / R`` summed, torch DDP's division-first rule): torch DDP's maths, as torch's
  ``PostLocalSGDState.start_localSGD_iter`` gives.
* **Local steps** (``s >= W``): no gradient communication; every rank steps on its own gradient.
* **Averaging points**: after step ``next_point``, first ``W + H - 1``, then ``s + H`` from the point
  ``s`` (state, not a formula, as H may change). With a fixed H (``local_period = "fixed"``) that is
  after step ``s >= W`` with ``(s - W + 1) % H == 0``, i.e. after every ``H`` local steps (DiLoCo's
  Algorithm 1 with ``W = 0``; torch's ``PeriodicModelAverager(period=H, warmup_steps=W + H - 1)`` for
  post-local SGD: torch's own default ``warmup_steps = W`` averages once more, right after the first
  local step). There every rank takes a flat snapshot ``theta_s`` (one vector per dtype) and launches
  the all-reduce of

      "average": a = theta_s / R                        -> new = sum_r a_r   (the mean of the ranks)
      "diloco":  a = (theta_anchor - theta_s) / R       -> Delta = sum_r a_r (the mean pseudo-gradient)
                 buf <- Delta (first), m * buf + Delta (later)
                 new = theta_anchor <- theta_anchor - lr * (Delta + m * buf)   (torch SGD(nesterov=True))

  ``theta_anchor`` (DiLoCo's global parameters) is the parameters at the end of the warm-up (at
  construction when ``W = 0``, after rank 0's broadcast), the same on every rank.
* **Applying** an averaging: ``theta <- new + (theta - theta_s)``: the average replaces the snapshot
  and the local progress made since the snapshot is kept (Streaming DiLoCo's merge with weight 1 on
  the fresh global value). Without overlap (``local_overlap = false``) it is applied right at its
  averaging point, where ``theta - theta_s = 0`` exactly, so ``theta = new``: post-local SGD / DiLoCo
  exactly. With overlap it is applied after step ``s + D`` (``D = local_overlap_iters``, ``1 <= D <= H``),
  on every rank after the same step (deterministic: the same run twice, or resumed from a checkpoint,
  gives the same bits), waiting there for whatever has not arrived.
* **The period** (``local_period = "adacomm"``; the maths in :mod:`deft.runtime.local_period`): H is
  ``H_max = local_steps`` until the first averaging point, which every rank reaches after step
  ``W + H_max - 1``. The local steps before it time ``c`` (this rank's median gap between consecutive
  ``after_step`` calls, from step ``max(W, 1)`` on: no collective runs inside those gaps); the first
  averaging times ``a`` (launch to the completion of its last bucket: this rank waits for it right
  after launching, once, so ``a`` is the averaging itself, the same buckets on the same links, not a
  proxy). The ranks then agree ``c, a`` (maximum) and ``F_0`` (the mean of the ranks' mean reported
  loss since the warm-up) and choose ``H_0``; at every later point, before launching, they agree
  ``F_l`` (the losses since the last point) and apply AdaComm's rule. Agreement is one all-reduce of
  a ``R x k`` float64 matrix on the primary link, each rank filling its own row (adding zeros is exact,
  so every rank reads the same rows and decides the same H): one small blocking collective per
  averaging point, one latency every H steps, when nothing else is in flight on that link (the last
  averaging was applied, ``D <= H``).

Invariants: every averaging is applied exactly once on every rank, after the same step; at most one
is in flight (``D <= H`` for every H: H_max >= D is validated, AdaComm's H is clipped to >= max(1, D));
the anchor and the outer momentum buffer are equal on every rank; ``flush()`` applies the one in
flight at once.

Scheduling: each dtype's flat vector is cut into equal buckets of at most ``bucket_cap_mb``, their
number a multiple of the number of links; each bucket goes to the link that frees first, counting
the bytes already assigned to each (greedy, in order; ties to the first configured link). Links are
taken as equally fast (this mode runs without a profile). Then that is the 0/1 multi-knapsack's answer
with the next ``D`` local steps' compute as each link's capacity: equal buckets dealt round the
links balance the bytes, so if any assignment hides the averaging in that compute this one does, and
if none does it finishes the averaging first (the least makespan). Every rank assigns and launches
the buckets in the same order on each link's process group, so the collectives match.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError
from deft.runtime.control import wait_work
from deft.runtime.layouts import balanced_links
from deft.runtime.links import CommLink
from deft.runtime.local_period import AdaComm, period_floor

#: The version of :meth:`LocalSteps.state_dict`'s record (inside the mode's record,
#: :class:`deft.runtime.checkpoint.LocalStepsState`): it holds the running period and the next point.
STATE_VERSION = 2
SOURCE = "deft checkpoint (local steps)"


@dataclass
class _Averaging:
    """One averaging in flight: this rank's snapshot, the buffers being all-reduced, the works."""

    index: int                              # 0, 1, ...: which averaging point
    step: int                               # the step after which it was launched
    apply_after: int                        # the step after which every rank applies it
    snapshot: dict[str, torch.Tensor]       # dtype name -> theta_s (flat)
    reduced: dict[str, torch.Tensor]        # dtype name -> the buffer being all-reduced in place
    works: list[tuple[str, dist.Work]]      # (link name, work), one per bucket; emptied once waited


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


class LocalSteps:
    """The local-steps mode's state and decisions (module docstring); the mode
    (:class:`deft.runtime.local_mode.LocalStepsMode`) calls :meth:`before_step`, :meth:`after_step`,
    :meth:`observe_loss`, :meth:`flush` and the checkpoint methods."""

    def __init__(self, config: DeftConfig, params: list[torch.Tensor], links: dict[str, CommLink], rank: int,
                 world: int) -> None:
        self.h_max, self.outer, self.warmup = config.local_steps, config.local_outer, config.local_warmup_iters
        self.h = self.h_max  # the running period
        self.next_point = self.warmup + self.h - 1  # the step after which the next averaging is launched
        self.lr, self.momentum = config.local_outer_lr, config.local_outer_momentum
        self.delay = config.local_overlap_iters if config.local_overlap else 0
        self.timeout_s, self.rank, self.world, self.links = config.timeout_s, rank, world, links
        self.cap_bytes = max(1, int(config.bucket_cap_mb * 2**20))
        # parameters grouped by dtype, in the module's order: one flat vector per dtype
        self.groups: dict[str, list[torch.Tensor]] = {}
        for p in params:
            self.groups.setdefault(str(p.dtype).removeprefix("torch."), []).append(p)
        self.steps = 0  # optimizer steps taken
        self.averagings = 0  # averagings launched
        self.applied = 0  # averagings applied
        self.waited = 0  # buckets not yet arrived when their averaging was applied (reported, not a decision)
        self.anchor: dict[str, torch.Tensor] | None = None
        self.momentum_buf: dict[str, torch.Tensor] | None = None
        self.pending: _Averaging | None = None
        if self.outer == "diloco" and self.warmup == 0:
            self.anchor = self._snapshot()
        # local_period "adacomm" (module docstring, "The period")
        self.period_mode = config.local_period
        self._device = next(iter(self.groups.values()))[0].device
        self._cuda = self._device.type == "cuda"
        self.adacomm = AdaComm(self.h_max, period_floor(self.delay)) if self.period_mode == "adacomm" else None
        self.gaps: list[float] = []  # seconds between consecutive after_step calls, until H_0 is chosen
        self._clock: float | None = None  # perf_counter at the end of the last after_step in this process
        self.loss_sum, self.loss_count = 0.0, 0  # this rank's reported losses since the last averaging point

    # -- the events -------------------------------------------------------------------------------------
    @torch.no_grad()
    def before_step(self) -> None:
        """Right before the optimizer's step: in the warm-up, the gradients' mean over the ranks."""
        if self.steps >= self.warmup:
            return
        primary = next(iter(self.links.values()))
        for params in self.groups.values():
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            flat = _flat(grads)
            flat.div_(self.world)  # torch DDP's rule: divide first, then sum
            wait_work(primary.all_reduce(flat), primary.name, f"local steps' warm-up gradients (step {self.steps})",
                      self.rank, self.timeout_s)
            off = 0
            for p in params:
                g = flat[off:off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                off += p.numel()

    def observe_loss(self, loss: float) -> None:
        """A loss the user reported (``ddp.observe_loss``): summed until the next averaging point."""
        self.loss_sum += loss
        self.loss_count += 1

    @torch.no_grad()
    def after_step(self) -> None:
        """Right after the optimizer's step: apply the averaging due now, launch the next at its point."""
        now = self._now()
        s = self.steps
        self.steps += 1
        if self._timing() and self._clock is not None and s >= self.warmup:
            self.gaps.append(now - self._clock)  # step s's compute: no collective since the last after_step
        if self.pending is not None and self.pending.apply_after == s:
            self._apply()
        if s + 1 == self.warmup:
            self.loss_sum, self.loss_count = 0.0, 0  # F_0 is the loss of the local steps, not the warm-up's
            if self.outer == "diloco" and self.anchor is None:
                self.anchor = self._snapshot()  # the end of the warm-up: the ranks' (equal) parameters
        if s == self.next_point:
            self._point(s)
        self._clock = self._now()

    def _now(self) -> float:
        """perf_counter; while timing on CUDA, after the device has run what was queued (the host is ahead)."""
        if self._cuda and self._timing():
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def _timing(self) -> bool:
        return self.adacomm is not None and self.adacomm.h0 is None

    def _point(self, s: int) -> None:
        """An averaging point: launch the averaging; choose the period until the next point."""
        if self.adacomm is None:
            self._launch(s)
        elif self.adacomm.h0 is None:
            self.h = self._launch_choosing_h0(s, self.adacomm)
        else:
            # before launching: the link carries nothing then (the last averaging was applied, D <= H)
            rows = self._agree(self._loss_row())
            self.h = self.adacomm.adapt(s, self._mean_loss(rows, 0))
            self._launch(s)
        self.loss_sum, self.loss_count = 0.0, 0
        self.next_point = s + self.h
        if self.delay == 0:
            self._apply()

    def _launch_choosing_h0(self, s: int, adacomm: AdaComm) -> int:
        """The first averaging point: launch and time the averaging (``a``), then agree ``c, a, F_0``."""
        t0 = self._now()
        self._launch(s)
        assert self.pending is not None
        self._wait_quietly(self.pending)  # a: launch to the last bucket's completion, once
        allreduce_s = self._now() - t0
        compute_s = statistics.median(self.gaps) if self.gaps else 0.0  # one slow step (an evaluation) aside
        self.gaps = []
        rows = self._agree([compute_s, allreduce_s, *self._loss_row()])
        return adacomm.start(s, max(r[0] for r in rows), max(r[1] for r in rows), self.delay, self._mean_loss(rows, 2))

    def _loss_row(self) -> list[float]:
        """(this rank's mean loss since the last point, 1) or (nan, 0) when it reported none."""
        return [self.loss_sum / self.loss_count, 1.0] if self.loss_count else [math.nan, 0.0]

    @staticmethod
    def _mean_loss(rows: list[list[float]], col: int) -> float | None:
        """The mean over the ranks of their mean losses (column ``col``; ``col + 1`` says whether the rank
        reported any); None unless every rank did. Summed in rank order: the same float on every rank."""
        if not all(r[col + 1] for r in rows):
            return None
        return sum(r[col] for r in rows) / len(rows)

    def _agree(self, row: list[float]) -> list[list[float]]:
        """Every rank's ``row``, the same on every rank: a sum all-reduce of an R x k float64 matrix on the
        primary link in which each rank fills its own row (x + 0 = x exactly, nan and inf included).
        Blocking; one latency of ``8 R k`` bytes per averaging point."""
        primary = next(iter(self.links.values()))
        rows = torch.zeros(self.world, len(row), dtype=torch.float64, device=self._device)
        rows[self.rank] = torch.tensor(row, dtype=torch.float64)
        wait_work(primary.all_reduce(rows), primary.name, "local steps' period (measurements and losses)", self.rank,
                  self.timeout_s)
        return [[float(v) for v in r] for r in rows.cpu().tolist()]

    @torch.no_grad()
    def flush(self) -> None:
        """Apply the averaging in flight now (every rank launched it: no new collective)."""
        if self.pending is not None:
            self._apply()

    # -- launching and applying -----------------------------------------------------------------------
    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {name: _flat(params) for name, params in self.groups.items()}

    def assign(self, sizes: list[int]) -> list[str]:
        """The link of each bucket (bytes, in launch order): the one that frees first by bytes (ties: the
        first configured link; the warm-up's rule, :func:`deft.runtime.layouts.balanced_links`)."""
        return list(balanced_links(sizes, tuple(self.links)))

    def buckets(self) -> list[tuple[str, int, int]]:
        """(dtype name, start, end) element ranges, every dtype's in turn: as many buckets as ``bucket_cap_mb``
        needs, rounded up to a multiple of the number of links, of equal size (so one bucket is never
        alone on one link while the others idle)."""
        out = []
        n_links = len(self.links)
        for name, params in self.groups.items():
            numel, size = sum(p.numel() for p in params), params[0].element_size()
            cap = max(1, self.cap_bytes // size)
            n = min(numel, n_links * -(-numel // (n_links * cap)))
            step = -(-numel // n)
            out += [(name, lo, min(numel, lo + step)) for lo in range(0, numel, step)]
        return out

    def _launch(self, s: int) -> None:
        assert self.pending is None, "internal: an averaging launched while another is in flight"
        snap = self._snapshot()
        if self.outer == "diloco":
            assert self.anchor is not None
            reduced = {name: (self.anchor[name] - snap[name]).div_(self.world) for name in snap}
        else:
            reduced = {name: snap[name].div(self.world) for name in snap}
        cuts = self.buckets()
        sizes = [(hi - lo) * self.groups[name][0].element_size() for name, lo, hi in cuts]
        works = [(link, self.links[link].all_reduce(reduced[name][lo:hi]))
                 for (name, lo, hi), link in zip(cuts, self.assign(sizes), strict=True)]
        self.pending = _Averaging(self.averagings, s, s + self.delay, snap, reduced, works)
        self.averagings += 1

    def _wait_quietly(self, avg: _Averaging) -> None:
        """Wait for every bucket without counting the waits (``waited`` counts those at the apply point)."""
        for link, work in avg.works:
            wait_work(work, link, f"local steps' averaging {avg.index}", self.rank, self.timeout_s)

    def _wait(self, avg: _Averaging) -> None:
        for link, work in avg.works:
            if not work.is_completed():
                self.waited += 1
            wait_work(work, link, f"local steps' averaging {avg.index}", self.rank, self.timeout_s)
        avg.works = []

    def _apply(self) -> None:
        avg, self.pending = self.pending, None
        assert avg is not None
        self._wait(avg)
        if self.outer == "diloco":
            assert self.anchor is not None
            first = self.momentum_buf is None
            new_anchor, new_buf = {}, {}
            for name, delta in avg.reduced.items():
                # examples/diloco.outer_step, term for term (torch SGD(nesterov=True, dampening=0))
                b = delta.clone() if first else self.momentum * self._buf(name) + delta
                update = delta + self.momentum * b if self.momentum != 0 else delta
                new_anchor[name] = self.anchor[name] - self.lr * update
                new_buf[name] = b
            self.anchor, self.momentum_buf = new_anchor, new_buf
            new = self.anchor
        else:
            new = avg.reduced
        for name, params in self.groups.items():
            value = new[name] + (_flat(params) - avg.snapshot[name])  # the local progress since the snapshot
            off = 0
            for p in params:
                p.detach().copy_(value[off:off + p.numel()].view_as(p))
                off += p.numel()
        self.applied += 1

    def _buf(self, name: str) -> torch.Tensor:
        assert self.momentum_buf is not None
        return self.momentum_buf[name]

    # -- reports and checkpoints ----------------------------------------------------------------------
    def info(self) -> JsonDict:
        """``plan_info["local_steps"]``."""
        cuts = self.buckets()
        nb = len(cuts)
        links = self.assign([(hi - lo) * self.groups[name][0].element_size() for name, lo, hi in cuts])
        return {"H": self.h, "H_max": self.h_max, "period": self.period_mode, "next_point": self.next_point,
                "adacomm": None if self.adacomm is None else self.adacomm.to_json(),
                "outer": self.outer, "warmup_iters": self.warmup, "overlap_iters": self.delay,
                "outer_lr": self.lr if self.outer == "diloco" else None,
                "outer_momentum": self.momentum if self.outer == "diloco" else None,
                "steps": self.steps, "averagings": self.averagings, "applied": self.applied,
                "buckets": nb, "buckets_per_link": {k: links.count(k) for k in self.links},
                "waited_buckets": self.waited,
                "in_flight": None if self.pending is None else {"index": self.pending.index,
                                                                "launched_after": self.pending.step,
                                                                "apply_after": self.pending.apply_after}}

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain types; an averaging in flight is waited for (every rank launched it) and
        saved as its snapshot and its arrived result, so a resumed run applies it after the same step."""
        pending = None
        if self.pending is not None:
            self._wait(self.pending)
            p = self.pending
            pending = {"index": p.index, "step": p.step, "apply_after": p.apply_after,
                       "snapshot": {k: v.clone() for k, v in p.snapshot.items()},
                       "reduced": {k: v.clone() for k, v in p.reduced.items()}}
        return {"version": STATE_VERSION, "H": self.h_max, "local_period": self.period_mode, "outer": self.outer,
                "steps": self.steps, "period": self._period_state(),
                "averagings": self.averagings, "applied": self.applied, "waited": self.waited,
                "anchor": None if self.anchor is None else {k: v.clone() for k, v in self.anchor.items()},
                "momentum_buf": None if self.momentum_buf is None else
                {k: v.clone() for k, v in self.momentum_buf.items()},
                "pending": pending}

    def load_state_dict(self, state: object) -> None:
        if not isinstance(state, dict):
            raise ContractError(SOURCE, "deft_state.local_steps", f"expected a dict, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ContractError(SOURCE, "deft_state.local_steps.version",
                                f"expected version {STATE_VERSION}, got {state.get('version')!r}: the record was "
                                "written by another version of deft's local-steps mode")
        for key, mine in (("H", self.h_max), ("local_period", self.period_mode), ("outer", self.outer)):
            if state.get(key) != mine:
                raise ContractError(SOURCE, f"deft_state.local_steps.{key}",
                                    f"the checkpoint was saved with {key} = {state.get(key)!r}, this run has {mine!r}")
        pending = state.get("pending")
        if pending is not None and int(pending["apply_after"]) - int(pending["step"]) != self.delay:
            raise ContractError(SOURCE, "deft_state.local_steps.pending",
                                f"an averaging in flight due {int(pending['apply_after']) - int(pending['step'])} "
                                f"steps after its launch, this run applies after {self.delay} "
                                "(local_overlap / local_overlap_iters differ)")
        self._check_vectors(state.get("anchor"), "anchor")
        self._check_vectors(state.get("momentum_buf"), "momentum_buf")
        self.steps, self.averagings = int(state["steps"]), int(state["averagings"])
        self.applied, self.waited = int(state["applied"]), int(state["waited"])
        self.anchor = self._copy(state.get("anchor"))
        self.momentum_buf = self._copy(state.get("momentum_buf"))
        self._load_period(state.get("period"))
        self.pending = None
        if pending is not None:
            self._check_vectors(pending["snapshot"], "pending.snapshot")
            self._check_vectors(pending["reduced"], "pending.reduced")
            snapshot, reduced = self._copy(pending["snapshot"]), self._copy(pending["reduced"])
            assert snapshot is not None and reduced is not None
            self.pending = _Averaging(int(pending["index"]), int(pending["step"]), int(pending["apply_after"]),
                                      snapshot, reduced, [])

    def _period_state(self) -> dict[str, Any]:
        return {"H": self.h, "next_point": self.next_point, "gaps": list(self.gaps), "loss_sum": self.loss_sum,
                "loss_count": self.loss_count, "adacomm": None if self.adacomm is None else self.adacomm.to_json()}

    def _load_period(self, doc: object) -> None:
        """The running period, the next point, the measurements and the losses since the last point. A
        resumed process times no gap across the restart (``_clock`` is unset)."""
        try:
            if not isinstance(doc, dict):
                raise TypeError(f"expected a dict, got {type(doc).__name__}")
            h, next_point, gaps = int(doc["H"]), int(doc["next_point"]), [float(g) for g in doc["gaps"]]
            loss_sum, loss_count = float(doc["loss_sum"]), int(doc["loss_count"])
            ada = doc["adacomm"]
            adacomm = None if ada is None else AdaComm.from_json(ada)
        except (KeyError, TypeError, ValueError) as e:
            raise ContractError(SOURCE, "deft_state.local_steps.period",
                                f"a damaged running period's record ({type(e).__name__}: {e})") from None
        floor = period_floor(self.delay)
        if (adacomm is None) != (self.adacomm is None) or not self.h_max >= h >= floor \
                or (adacomm is not None and adacomm.h_min != floor):
            raise ContractError(SOURCE, "deft_state.local_steps.period",
                                f"period H = {h} (adacomm record: {adacomm is not None}) does not fit this run's "
                                f"local_period {self.period_mode!r}, H_max {self.h_max}, overlap {self.delay}")
        self.h, self.next_point, self.gaps, self.loss_sum, self.loss_count = h, next_point, gaps, loss_sum, loss_count
        self.adacomm, self._clock = adacomm, None

    def _check_vectors(self, doc: object, field: str) -> None:
        if doc is None:
            return
        want = {name: sum(p.numel() for p in ps) for name, ps in self.groups.items()}
        got = {k: v.numel() for k, v in doc.items()} if isinstance(doc, dict) else None
        if got != want:
            raise ContractError(SOURCE, f"deft_state.local_steps.{field}",
                                f"expected flat vectors of {want} elements per dtype (this model), got {got}")

    def _copy(self, doc: object) -> dict[str, torch.Tensor] | None:
        if not isinstance(doc, dict):
            return None
        device = next(iter(self.groups.values()))[0].device
        return {k: v.detach().to(device).clone() for k, v in doc.items()}
