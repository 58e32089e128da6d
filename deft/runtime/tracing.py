"""What the runtime shows a trace tool: per-bucket ranges and, on request, its own torch.profiler trace.

Ranges (names in :mod:`deft.profiler.nvtx`) are emitted only while a sink records (NVTX on, or a torch
profiler running); otherwise every entry point returns after one flag test.

* ``deft/comm/...``: around each collective launch, on the launching thread (the executor, and the
  warm-up timer for its timed launches).
* ``deft/bwd/b{b}/it{t}``: bucket ``b``'s backward compute, from the backward start (the gradient of
  the forward's output arriving) or from the end of the previous bucket's launches, to the moment
  ``b``'s gradient is complete. The warm-up timer measures the same intervals, so a trace and the
  timing profile of the same iterations agree on them (tests/test_profiler_agreement.py).
* ``deft/fwd/b{b}/it{t}`` (:class:`ForwardRanges`): the starts of the parameter-owning modules (the
  wrapper's forward hooks, :class:`deft.runtime.eager.ForwardHooks`); a bucket's range runs from the
  start of a module whose parameters lie mostly in that bucket until a module of another bucket
  starts, or the forward ends. Parameter-free modules and glue are thus charged to the bucket before
  them (the timer spreads them in proportion instead). The ranges listen only when tracing was
  requested at construction (``DEFT_NVTX=1`` / an NVTX tool, a model on CUDA unless ``DEFT_NVTX=0``
  (:func:`nvtx_wanted`), or ``DEFT_TRACE_DIR``).

:class:`TraceRecorder` records the profile iterations (``DEFT_TRACE_ITERS=FIRST:COUNT``: any other window,
of the running plan say) with ``torch.profiler`` (``DEFT_TRACE_DIR``):
CPU activity, CUDA too when the model is on a GPU, ``record_shapes=True`` (the Kineto parser reads
gloo all-reduce sizes from the recorded input shapes), and exports ``rank{r}.json.gz``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from deft.errors import DeftError
from deft.profiler import nvtx
from deft.runtime.buckets import FlatLayout
from deft.runtime.control import Collective
from deft.runtime.eager import ForwardHooks
from deft.runtime.executor import Executor
from deft.runtime.tensors import tensors_in

log = logging.getLogger("deft.runtime")

TRACE_DIR_ENV = "DEFT_TRACE_DIR"
PROFILE_ITERS_ENV = "DEFT_PROFILE_ITERS"
TRACE_ITERS_ENV = "DEFT_TRACE_ITERS"


def nvtx_wanted(device: torch.device | str, env: Mapping[str, str] | None = None) -> bool:
    """Whether deft's NVTX ranges are on for a model on ``device``.

    ``DEFT_NVTX`` decides when set (``1`` / ``0``). Otherwise they are on for a CUDA device, so that
    ``nsys profile`` (through ``deft-profile --backend nsys`` or by hand) sees deft's per-bucket ranges
    with no set-up; with no tool attached an NVTX call returns at once inside the NVTX library, and the
    Python around it costs a few microseconds per bucket range (``nvtx.measure_overhead``). On other
    devices they are on only when an NVTX tool is injected and CUDA is there (:func:`nvtx.configure`'s
    rule)."""
    env = os.environ if env is None else env
    asked = nvtx.env_setting(env)
    if asked is not None:
        return asked
    if torch.device(device).type == "cuda":
        return True
    return bool(env.get("NVTX_INJECTION64_PATH")) and torch.cuda.is_available()


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


def trace_window_from_env(first: int, count: int) -> tuple[int, int]:
    """``DEFT_TRACE_ITERS=FIRST:COUNT`` records iterations ``[FIRST, FIRST + COUNT)`` instead of the
    profile iterations ``(first, count)``: a window of the running plan, say."""
    raw = os.environ.get(TRACE_ITERS_ENV, "").strip()
    if not raw:
        return first, count
    head, sep, tail = raw.partition(":")
    try:
        window = (int(head), int(tail)) if sep else (-1, 0)
    except ValueError:
        window = (-1, 0)
    if window[0] < 0 or window[1] < 1:
        raise DeftError(f"environment variable {TRACE_ITERS_ENV}={raw!r}: expected FIRST:COUNT, an iteration >= 0 "
                        "and a count >= 1 (e.g. 14:4)")
    return window


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

    def __init__(self, module: nn.Module, params: list[torch.Tensor], hooks: ForwardHooks) -> None:
        self._module, self._params = module, params
        self._dominant: dict[int, int] = {}
        self._tok: nvtx.Range | None = None
        self._cur = -1
        self._iteration = 0
        self._on = False
        self._handles = [hooks.listen(pre=self._pre)]  # _dominant names the parameter-owning modules

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

    def _pre(self, m: nn.Module) -> None:
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
        self._prof: torch.profiler.profile | None = None
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


class BackwardRanges:
    """The ``deft/bwd/b{b}/it{t}`` ranges of the module docstring, as an executor observer.

    A range opens when the backward starts (the gradient of the forward's output arrives, or the
    first parameter gradient when no output was watched) on the lowest bucket not yet complete, and
    closes when that bucket is ready; the next one opens with the next gradient."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._tok: nvtx.Range | None = None
        self._reopen = False
        self._armed = False  # between the forward's start and the end of its backward
        self._t = 0

    def begin(self, t: int) -> None:
        """Iteration ``t``'s forward begins."""
        self._t, self._armed = t, True

    def watch(self, output: object) -> None:
        """Open the first range when the gradient of the forward's output arrives (only while a tool
        records: a tensor hook per output otherwise costs for nothing)."""
        if recording():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._starts)

    def _starts(self, grad: torch.Tensor) -> None:
        if self._tok is None and self._armed and not self._executor.backward_done:
            self._open()

    def first_gradient(self) -> None:
        """The first parameter gradient of the backward (no output was watched, or it had none)."""
        if self._tok is None and recording():
            self._open()

    def after_gradient(self) -> None:
        """A gradient was added: the bucket after a completed one begins."""
        if self._reopen:
            self._reopen = False
            self._open()

    def _open(self) -> None:
        b = self._executor.next_unready()
        if b is not None:
            self._tok = nvtx.push_range("bwd", b, self._t)

    def close(self) -> None:
        """The backward ended (or the step came first)."""
        if self._tok is not None:
            nvtx.pop_range(self._tok)
            self._tok = None
        self._reopen = self._armed = False

    # -- ExecutorObserver --------------------------------------------------------------------------
    def bucket_ready(self, b: int) -> None:
        if self._tok is not None:
            nvtx.pop_range(self._tok)
            self._tok = None
            self._reopen = True

    def hook_started(self, b: int, t: float) -> None:
        pass

    def launched(self, b: int, link: str, works: list[Collective], t_start: float) -> None:
        pass


def mark_layout(layout: FlatLayout | None) -> None:
    """Each bucket's size as a trace mark (for parsers that see no sizes), when a tool records."""
    if layout is None or not recording():
        return
    for b, (numel, nbytes) in enumerate(zip(layout.bucket_numel, layout.bucket_nbytes(), strict=True)):
        nvtx.mark_layout(b, numel, nbytes)


class Tracing:
    """Everything the runtime shows a trace tool, behind the phase machine's events: the torch.profiler
    recorder (``DEFT_TRACE_DIR``), the forward ranges (only when a tool was asked for at construction)
    and the backward ranges (an executor observer)."""

    def __init__(self, module: nn.Module, params: list[torch.Tensor], executor: Executor, rank: int, cuda: bool,
                 first: int, count: int, hooks: ForwardHooks) -> None:
        trace_dir = os.environ.get(TRACE_DIR_ENV) or None
        if not nvtx.nvtx_enabled() and nvtx_wanted("cuda" if cuda else "cpu"):
            nvtx.configure(True)  # on by default on CUDA; never switched off here (a user may have forced it on)
        self._tracer = None if trace_dir is None else TraceRecorder(trace_dir, rank, cuda,
                                                                    *trace_window_from_env(first, count))
        self._fwd = ForwardRanges(module, params, hooks) if trace_dir or nvtx.nvtx_enabled() else None
        self._bwd = BackwardRanges(executor)
        self._rank = rank
        executor.observe(self._bwd)

    def set_layout(self, layout: FlatLayout) -> None:
        if self._fwd is not None:
            self._fwd.set_layout(layout)
        mark_layout(layout)

    def begin(self, t: int, layout: FlatLayout | None) -> None:
        """Iteration ``t``'s forward is about to begin (before the executor's forward stage)."""
        if self._tracer is not None and self._tracer.maybe_start(t):
            mark_layout(layout)
        self._bwd.begin(t)

    def forward_begins(self, t: int) -> None:
        """The model's forward begins (after deft's own set-up)."""
        if self._fwd is not None:
            self._fwd.begin(t)

    def forward_ends(self, output: object) -> None:
        if self._fwd is not None:
            self._fwd.end()
        self._bwd.watch(output)

    def first_gradient(self) -> None:
        if self._fwd is not None:
            self._fwd.end()
        self._bwd.first_gradient()

    def after_gradient(self) -> None:
        self._bwd.after_gradient()

    def backward_ends(self) -> None:
        self._bwd.close()

    def after_step(self, t_next: int) -> None:
        """The torch.profiler trace of the profile iterations is written once they are over."""
        path = None if self._tracer is None else self._tracer.after_step(t_next)
        if path is not None:
            log.info("deft: rank %d wrote its torch.profiler trace to %s", self._rank, path)
            self._tracer = None
            if self._fwd is not None and not nvtx.nvtx_enabled():
                self._fwd.close()
                self._fwd = None

    def close(self) -> None:
        if self._fwd is not None:
            self._fwd.close()
