"""Per-bucket trace ranges: one naming scheme, emitted as NVTX ranges and as torch.profiler ranges.

Naming scheme (defined here once; :mod:`deft.profiler.nsys` and :mod:`deft.profiler.kineto` parse it)
------------------------------------------------------------------------------------------------------
* ``deft/fwd/b{bucket}/it{iteration}``: the forward compute of ``bucket`` in iteration ``iteration``.
* ``deft/bwd/b{bucket}/it{iteration}``: the backward compute of ``bucket`` (ends when the bucket's
  gradient is ready).
* ``deft/comm/{link}/b{bucket}/g{group}/it{iteration}``: the all-reduce of ``bucket`` on ``link``,
  launched during iteration ``iteration``, carrying the gradient of the update group whose last
  iteration is ``group`` (``group = iteration - origin`` in :class:`deft.schedule.CommTask` terms;
  ``group == iteration`` for plain WFBP). On a CPU timeline the range covers the *launch* of the
  (asynchronous) collective; its completion is read from the collective's own events.

``bucket``, ``iteration`` and ``group`` are integers ``>= 0``; ``link`` is a non-empty name without
``/`` or whitespace. ``parse_range_name(str(r)) == r`` for every valid :class:`RangeName` ``r``, and
any other string parses to ``None``.

Emission
--------
A range is emitted to NVTX (package ``nvtx``, domain ``deft``) when NVTX is *on*, and as a
``torch.profiler.record_function`` range when a torch profiler is recording, so Kineto traces carry
the same names. NVTX is on when ``DEFT_NVTX=1``, off when ``DEFT_NVTX=0``, and otherwise (auto) on
only when an NVTX tool is injected (``NVTX_INJECTION64_PATH`` set, as Nsight Systems does) and CUDA is
available; the runtime also switches it on for a model on CUDA unless ``DEFT_NVTX=0``
(:func:`deft.runtime.tracing.nvtx_wanted`). When neither sink is active, :func:`range` returns a shared null context and
:func:`push_range` returns ``None`` without building the name: a few hundred nanoseconds of
Python per call, no allocation (numbers in ``benchmarks/results/profiler_fixtures.md``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover - torch is optional here (the solver side runs without it)
    from torch.autograd.profiler import record_function

PREFIX = "deft"
KINDS = ("fwd", "bwd", "comm")
NVTX_DOMAIN = "deft"
ENV = "DEFT_NVTX"

_COLORS = {"fwd": 0xFF2E86C1, "bwd": 0xFF28B463, "comm": 0xFFE67E22}
_LINK_RE = re.compile(r"[^/\s]+")
_NAME_RE = re.compile(
    r"deft/(?:(?P<kind>fwd|bwd)/b(?P<b1>\d+)/it(?P<i1>\d+)"
    r"|comm/(?P<link>[^/\s]+)/b(?P<b2>\d+)/g(?P<g>\d+)/it(?P<i2>\d+))"
)


@dataclass(frozen=True)
class RangeName:
    """A parsed deft range name; ``link`` and ``group`` are set exactly when ``kind == "comm"``."""

    kind: str
    bucket: int
    iteration: int
    link: str | None = None
    group: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"range kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for label, v in (("bucket", self.bucket), ("iteration", self.iteration)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"range {label} must be an integer >= 0, got {v!r}")
        if self.kind == "comm":
            if not isinstance(self.link, str) or not _LINK_RE.fullmatch(self.link):
                raise ValueError(f"comm range link must be a non-empty name without '/' or spaces, got {self.link!r}")
            if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 0:
                raise ValueError(f"comm range group must be an integer >= 0, got {self.group!r}")
        elif self.link is not None or self.group is not None:
            raise ValueError(f"{self.kind} ranges carry no link or group")

    def __str__(self) -> str:
        return format_range_name(self.kind, self.bucket, self.iteration, self.link, self.group)


def format_range_name(kind: str, bucket: int, iteration: int, link: str | None = None,
                      group: int | None = None) -> str:
    """The range name for the given fields (no validation: the hot path; see :class:`RangeName`)."""
    if kind == "comm":
        return f"{PREFIX}/comm/{link}/b{bucket}/g{group}/it{iteration}"
    return f"{PREFIX}/{kind}/b{bucket}/it{iteration}"


def parse_range_name(name: str) -> RangeName | None:
    """Parse a deft range name; ``None`` for anything else (other tools' ranges, typos)."""
    if not isinstance(name, str) or not name.startswith(PREFIX + "/"):
        return None
    m = _NAME_RE.fullmatch(name)
    if m is None:
        return None
    if m["kind"] is not None:
        return RangeName(m["kind"], int(m["b1"]), int(m["i1"]))
    return RangeName("comm", int(m["b2"]), int(m["i2"]), link=m["link"], group=int(m["g"]))


_LAYOUT_RE = re.compile(r"deft/bucket/b(\d+)/numel(\d+)/nbytes(\d+)")


def layout_name(bucket: int, numel: int, nbytes: int) -> str:
    """``deft/bucket/b{bucket}/numel{numel}/nbytes{nbytes}``: a bucket's size, marked once per run.

    Range names carry no sizes, so the runtime marks each bucket's size once (:func:`mark_layout`);
    trace parsers that have no other source of sizes (Nsight Systems) read them from these marks.
    """
    return f"{PREFIX}/bucket/b{bucket}/numel{numel}/nbytes{nbytes}"


def parse_layout_name(name: str) -> tuple[int, int, int] | None:
    """``(bucket, numel, nbytes)`` from a :func:`layout_name`, else ``None``."""
    m = _LAYOUT_RE.fullmatch(name) if isinstance(name, str) else None
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


# -- sinks -------------------------------------------------------------------------------------------
class _NvtxDomain(Protocol):
    """What deft uses of an ``nvtx`` package domain (the package ships no type information)."""

    def get_event_attributes(self, message: str, color: int) -> object: ...
    def push_range(self, attributes: object) -> None: ...
    def pop_range(self) -> None: ...
    def mark(self, attributes: object) -> None: ...


class _State:
    """Which sinks are on; ``nvtx_domain`` is the ``nvtx`` package domain when NVTX is on."""

    nvtx_on: bool = False
    nvtx_domain: _NvtxDomain | None = None


_state = _State()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # the solver side may run without torch; then there is no CUDA either
        return False
    return bool(torch.cuda.is_available())


def env_setting(env: Mapping[str, str]) -> bool | None:
    """What ``DEFT_NVTX`` in ``env`` asks for: ``True`` (1/true/on/yes), ``False`` (0/false/off/no), or
    ``None`` (unset or anything else: the caller decides)."""
    value = env.get(ENV, "").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    return None


def configure(nvtx: bool | None = None) -> bool:
    """Switch NVTX emission on or off (``None``: decide from ``DEFT_NVTX`` and the environment).

    Returns whether NVTX is now on. Forcing it on without CUDA is allowed (it measures the cost of
    the enabled path); without an injected tool the ``nvtx`` package then drops the ranges itself.
    """
    if nvtx is None:
        nvtx = env_setting(os.environ)
        if nvtx is None:
            nvtx = bool(os.environ.get("NVTX_INJECTION64_PATH")) and _cuda_available()
    domain = None
    if nvtx:
        import nvtx as _nvtx

        domain = _nvtx.get_domain(NVTX_DOMAIN)
    _state.nvtx_on = bool(nvtx)
    _state.nvtx_domain = domain
    return _state.nvtx_on


def nvtx_enabled() -> bool:
    return _state.nvtx_on


_profiler_module: ModuleType | None = None


def torch_profiler_active() -> bool:
    """True while a torch (autograd or Kineto) profiler is recording in this process.

    Reads ``torch.autograd.profiler._is_profiler_enabled`` (set by both ``torch.profiler.profile``
    and the legacy autograd profiler) without importing torch: if torch is not loaded, nothing
    can be profiling.
    """
    global _profiler_module
    prof = _profiler_module
    if prof is None:
        prof = _profiler_module = sys.modules.get("torch.autograd.profiler")
        if prof is None:
            return False
    return prof._is_profiler_enabled is True


class Range:
    """An open range: remembers which sinks it was pushed to so that popping it is exact."""

    __slots__ = ("name", "nvtx_pushed", "record")

    def __init__(self, name: str) -> None:
        self.name = name
        self.nvtx_pushed = False
        self.record: record_function | None = None

    def push(self, color: int) -> Range:
        if _state.nvtx_on:
            dom = _state.nvtx_domain
            assert dom is not None  # configure() sets the domain whenever NVTX is on
            dom.push_range(dom.get_event_attributes(message=self.name, color=color))
            self.nvtx_pushed = True
        if torch_profiler_active():
            from torch.autograd.profiler import record_function

            self.record = record_function(self.name)
            self.record.__enter__()
        return self

    def pop(self) -> None:
        if self.record is not None:
            self.record.__exit__(None, None, None)
            self.record = None
        if self.nvtx_pushed:
            dom = _state.nvtx_domain
            assert dom is not None  # pushed while NVTX was on
            dom.pop_range()
            self.nvtx_pushed = False

    def __enter__(self) -> Range:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pop()


_NULL: contextlib.nullcontext[None] = contextlib.nullcontext()


def push_range(kind: str, bucket: int, iteration: int, link: str | None = None,
               group: int | None = None) -> Range | None:
    """Open a range (see the naming scheme); returns the token for :func:`pop_range`, or ``None``.

    ``None`` means no sink is active and nothing was done (the name is not even formatted).
    """
    if not _state.nvtx_on and not torch_profiler_active():
        return None
    return Range(format_range_name(kind, bucket, iteration, link, group)).push(_COLORS.get(kind, 0xFF808080))


def pop_range(token: Range | None) -> None:
    """Close a range opened by :func:`push_range` (``None``: nothing to close)."""
    if token is not None:
        token.pop()


def range(kind: str, bucket: int, iteration: int, link: str | None = None,
          group: int | None = None) -> contextlib.AbstractContextManager[Range | None]:
    """Context manager form of :func:`push_range` / :func:`pop_range`."""
    if not _state.nvtx_on and not torch_profiler_active():
        return _NULL
    return Range(format_range_name(kind, bucket, iteration, link, group)).push(_COLORS.get(kind, 0xFF808080))


def mark_layout(bucket: int, numel: int, nbytes: int) -> None:
    """Record a bucket's size (see :func:`layout_name`) as an NVTX mark and a zero-length torch range."""
    if not _state.nvtx_on and not torch_profiler_active():
        return
    name = layout_name(bucket, numel, nbytes)
    if _state.nvtx_on:
        dom = _state.nvtx_domain
        assert dom is not None  # configure() sets the domain whenever NVTX is on
        dom.mark(dom.get_event_attributes(message=name, color=0xFF808080))
    if torch_profiler_active():
        from torch.autograd.profiler import record_function

        with record_function(name):
            pass


def forward(bucket: int, iteration: int) -> contextlib.AbstractContextManager[Range | None]:
    return range("fwd", bucket, iteration)


def backward(bucket: int, iteration: int) -> contextlib.AbstractContextManager[Range | None]:
    return range("bwd", bucket, iteration)


def comm(link: str, bucket: int, group: int, iteration: int) -> contextlib.AbstractContextManager[Range | None]:
    return range("comm", bucket, iteration, link=link, group=group)


def measure_overhead(number: int = 200_000) -> dict[str, float]:
    """Nanoseconds per ``with range(...)`` call with every sink off, and with NVTX forced on.

    Restores the previous configuration. Used by the benchmark fragment; cheap enough for a test.
    """
    import timeit

    def per_call(fn: Callable[[], None]) -> float:
        best = min(timeit.repeat(fn, number=number, repeat=5))
        return best / number * 1e9

    def body() -> None:
        with range("bwd", 3, 17):
            pass

    def push_pop() -> None:
        pop_range(push_range("comm", 3, 17, "primary", 17))

    before = _state.nvtx_on
    try:
        configure(False)
        off = per_call(body)
        off_pp = per_call(push_pop)
        configure(True)
        on = per_call(body)
        on_pp = per_call(push_pop)
    finally:
        configure(before)
    baseline = per_call(lambda: None)
    return {"off_with_ns": off, "off_push_pop_ns": off_pp, "nvtx_on_with_ns": on,
            "nvtx_on_push_pop_ns": on_pp, "empty_call_ns": baseline}


configure()
