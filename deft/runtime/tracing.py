"""What the runtime shows a trace tool: per-bucket ranges and, on request, its own torch.profiler trace.

Ranges (names in :mod:`deft.profiler.nvtx`) are emitted only while a sink records (NVTX on, or a torch
profiler running); otherwise every entry point returns after one flag test.

* ``deft/comm/...``: around each collective launch, on the launching thread (the executor, and the
  warm-up timer for its timed launches).
* ``deft/bwd/b{b}/it{t}``: bucket ``b``'s backward compute, from the backward start (the gradient of
  the forward's output arriving) or from the end of the previous bucket's launches, to the moment
  ``b``'s gradient is complete. The warm-up timer measures the same intervals, so a trace and the
  timing profile of the same iterations agree on them (tests/test_profiler_agreement.py).
* ``deft/fwd/b{b}/it{t}`` (:class:`ForwardRanges`): forward hooks on the parameter-owning modules;
  a bucket's range runs from the start of a module whose parameters lie mostly in that bucket until
  a module of another bucket starts, or the forward ends. Parameter-free modules and glue are thus
  charged to the bucket before them (the timer spreads them in proportion instead). The hooks are
  installed only when tracing was requested at construction (``DEFT_NVTX=1`` / an NVTX tool, or
  ``DEFT_TRACE_DIR``), so an untraced run has no forward hooks at all.

:class:`TraceRecorder` records the profile iterations with ``torch.profiler`` (``DEFT_TRACE_DIR``):
CPU activity, CUDA too when the model is on a GPU, ``record_shapes=True`` (the Kineto parser reads
gloo all-reduce sizes from the recorded input shapes), and exports ``rank{r}.json.gz``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deft.errors import DeftError
from deft.profiler import nvtx
from deft.runtime.buckets import FlatLayout

TRACE_DIR_ENV = "DEFT_TRACE_DIR"
PROFILE_ITERS_ENV = "DEFT_PROFILE_ITERS"


def recording() -> bool:
    """True when a range would be recorded by some sink right now."""
    return nvtx.nvtx_enabled() or nvtx.torch_profiler_active()


def profile_iters_from_env(default: int) -> int:
    """``DEFT_PROFILE_ITERS`` (set by ``deft-profile --iters``) overrides ``config.profile_iters``."""
    raw = os.environ.get(PROFILE_ITERS_ENV, "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise DeftError(f"environment variable {PROFILE_ITERS_ENV}={raw!r}: expected an integer >= 1")
    return n


def dominant_buckets(module: nn.Module, params: list[torch.Tensor], layout: FlatLayout) -> dict[int, int]:
    """``id(module) -> bucket`` holding most of the module's own trainable elements."""
    index = {id(p): i for i, p in enumerate(params)}
    starts = [0]
    for n in layout.bucket_numel:
        starts.append(starts[-1] + n)
    out: dict[int, int] = {}
    for m in module.modules():
        count: dict[int, int] = {}
        for p in m.parameters(recurse=False):
            i = index.get(id(p))
            if i is None:
                continue
            slot = layout.slots[i]
            for b in layout.param_buckets[i]:
                lo, hi = starts[b], starts[b + 1]
                overlap = max(0, min(hi, slot.flat_offset + slot.numel) - max(lo, slot.flat_offset))
                count[b] = count.get(b, 0) + max(overlap, 1 if slot.numel == 0 else 0)
        if count:
            out[id(m)] = max(count, key=lambda b: (count[b], -b))
    return out


class ForwardRanges:
    """Per-bucket forward ranges from module pre-hooks (see the module docstring)."""

    def __init__(self, module: nn.Module, params: list[torch.Tensor]) -> None:
        self._module, self._params = module, params
        self._dominant: dict[int, int] = {}
        self._tok: nvtx.Range | None = None
        self._cur = -1
        self._iteration = 0
        self._on = False
        owners = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
        self._handles = [m.register_forward_pre_hook(self._pre) for m in owners]

    def set_layout(self, layout: FlatLayout) -> None:
        self._dominant = dominant_buckets(self._module, self._params, layout)

    def begin(self, iteration: int) -> None:
        self._on, self._iteration, self._cur = recording(), iteration, -1

    def end(self) -> None:
        nvtx.pop_range(self._tok)
        self._tok, self._cur, self._on = None, -1, False

    def close(self) -> None:
        self.end()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, m: nn.Module, args: Any) -> None:
        if not self._on:
            return
        b = self._dominant.get(id(m))
        if b is None or b == self._cur:
            return
        nvtx.pop_range(self._tok)
        self._tok = nvtx.push_range("fwd", b, self._iteration)
        self._cur = b


class TraceRecorder:
    """torch.profiler over iterations ``[first, first + count)``; rank ``r`` exports ``rank{r}.json.gz``."""

    def __init__(self, directory: str | os.PathLike[str], rank: int, cuda: bool, first: int, count: int) -> None:
        self.directory = Path(directory)
        self.rank, self.cuda = rank, cuda
        self.first, self.stop_at = first, first + count
        self._prof: Any = None
        self.path: Path | None = None

    @property
    def running(self) -> bool:
        return self._prof is not None

    def maybe_start(self, t: int) -> bool:
        """At the forward start of iteration ``t``: start recording if ``t`` opens the window."""
        if self._prof is not None or self.path is not None or t != self.first:
            return False
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=acts, record_shapes=True)
        self._prof.start()
        return True

    def after_step(self, t_next: int) -> Path | None:
        """After the optimizer step that ends iteration ``t_next - 1``; the trace's path when it was written."""
        if self._prof is None:
            return None
        self._prof.step()  # ProfilerStep#N marks, for viewers
        if t_next < self.stop_at:
            return None
        prof, self._prof = self._prof, None
        prof.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"rank{self.rank}.json.gz"
        prof.export_chrome_trace(str(path))
        self.path = path
        return path
