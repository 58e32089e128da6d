"""Per-bucket times from torch.profiler (Kineto) Chrome-trace JSON: trace in, tidy tables out.

Reading (:func:`read_trace`)
----------------------------
A trace is a JSON object (plain or gzip) with a ``traceEvents`` list. Complete events (``ph == "X"``)
are operators: ``cpu_op`` / ``user_annotation`` on CPU threads, ``cuda_runtime`` launches on CPU
threads, ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` on GPU streams. Times are microseconds.
Links used: a launch and its kernel share ``args.correlation`` (the ``ac2g`` flow); a backward
operator and its forward operator are the two ends of a ``fwdbwd`` flow (fallback: equal
``Sequence number``); a collective's CPU operator and its NCCL kernel share ``External id``.

Collectives (:func:`collectives`)
---------------------------------
A collective is a ``record_param_comms`` operator (``Collective name``, ``In msg nelems``,
``dtype``, ``Process Group Name`` / ``Process Group Ranks``), else a ``c10d::<name>_`` operator that
holds none (CPU gloo traces of torch 2.13 record no ``record_param_comms``; the element count then
comes from ``Input Dims``, so profile with ``record_shapes=True``). Its communication interval:

* NCCL (GPU): the NCCL kernel(s) launched inside the operator (matched by correlation id), i.e. the
  GPU time the all-reduce occupied its stream.
* gloo (CPU): the ``gloo:<name>`` range that gloo's worker thread (``pt_gloo_runloop``) records
  while it executes the collective, from picking the work item off its queue to completion,
  including waiting for the peers. gloo records no id linking it to the launch; work items run in
  launch order (FIFO queue), so each launch is matched to the earliest unmatched ``gloo:<name>``
  range of the same collective that starts after it and, when both are known, has the same
  element count.
* otherwise: the launching operator's own CPU duration (``comm_source == "cpu_op"``).

Buckets (:func:`bucket_steps`, the paper's Fig. 8)
-------------------------------------------------
Per profiler step (``ProfilerStep#N``), the all-reduces launched after the step's first backward
operator (``autograd::engine::evaluate_function: ...``) are the gradient buckets, in launch order:
bucket ``b`` is the ``b``-th to become ready (bucket 0 nearest the output), which is DDP's and
deft's bucket order. With ``t_b`` the launch time of bucket ``b``'s all-reduce:

* ready point ``r_b``: on GPU, the latest end of the compute kernels launched by the backward thread
  before ``t_b`` (the last backward operator before the collective -> its kernels' end); on CPU,
  ``t_b`` itself (the CPU thread *is* the compute stream).
  ``backward_b = r_b - r_{b-1}`` with ``r_{-1}`` = start of the step's backward compute.
* forward: the last backward operator of bucket ``b`` that has a forward counterpart maps (fwdbwd
  flow) to ``F_b``, the first forward operator of bucket ``b`` (forward runs in reverse bucket
  order). The forward boundary ``f_b`` is the start of the first compute kernel launched at or after
  ``F_b`` (CPU: ``F_b``'s start); ``f_{n-1}`` is the start of the step's first linked forward
  operator and ``f_{-1}`` the end of the last one (the loss). ``forward_b = f_{b-1} - f_b``.
* ``comm_b`` = the collective's communication interval (above).

:func:`load` reduces the steps whose bucket sizes agree with the most common layout by the median
per bucket and field (robust to one slow step) and builds a :class:`deft.Profile`. Over several
ranks' traces, forward and backward go at the ranks' pace (:func:`deft.profiler.pace.paced_ranks`),
in the warm-up timer's order on the steps every rank holds (matched by step number: ``ProfilerStep#N``,
or a deft range's iteration): ``T = median_s max_r sum_b (forward[r][s][b] + backward[r][s][b])``,
shared by the buckets' medians over ranks. Where the ranks hold no step in common, ``T`` is the slowest
rank's total of its own per-bucket medians (``meta["reduction"]`` says which). Each link's comm time
is the maximum over ranks of their medians over steps.

deft traces: an all-reduce launched inside a ``deft/comm/{link}/b{bucket}/...`` range (see
:mod:`deft.profiler.nvtx`) takes its bucket and link from the range; then ``deft/fwd`` and
``deft/bwd`` ranges (GPU span if Kineto recorded one, else CPU) give forward and backward times.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import re
import sys
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from deft._json import JsonDict, JsonValue
from deft.errors import TraceError
from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.profiler.nvtx import RangeName, parse_range_name
from deft.profiler.pace import Paced, paced_ranks
from deft.profiler.tables import format_table, median

US = 1e-6  # trace timestamps are microseconds

DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
    "long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "char": 1, "int8": 1,
    "byte": 1, "uint8": 1, "bool": 1, "complexfloat": 8, "complexdouble": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
ALLREDUCE_NAMES = ("allreduce", "allreduce_coalesced")
BACKWARD_PREFIX = "autograd::engine::evaluate_function:"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_STEP_RE = re.compile(r"ProfilerStep#(\d+)")
#: A trace's thread: (pid, tid) as the trace writes them.
Thread = tuple[JsonValue, JsonValue]


# -- events ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    """One complete (``ph == "X"``) trace event; ``ts`` and ``dur`` in microseconds."""

    name: str
    cat: str
    pid: JsonValue  # as the trace writes it: a process id, or a name for GPU devices
    tid: JsonValue  # a thread id, or a stream name
    ts: float
    dur: float
    args: JsonDict = field(default_factory=dict, compare=False, hash=False)

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def thread(self) -> Thread:
        return (self.pid, self.tid)

    @property
    def external_id(self) -> int | None:
        v = self.args.get("External id")
        return v if isinstance(v, int) else None

    @property
    def correlation(self) -> int | None:
        v = self.args.get("correlation")
        return v if isinstance(v, int) else None


@dataclass
class Trace:
    """A parsed trace: complete events sorted by start, flows, and the top-level metadata."""

    path: str
    events: list[Event]
    flows: list[JsonDict]
    meta: JsonDict

    @property
    def distributed(self) -> JsonDict:
        d = self.meta.get("distributedInfo")
        return d if isinstance(d, dict) else {}

    @property
    def rank(self) -> int | None:
        r = self.distributed.get("rank")
        return r if isinstance(r, int) else None

    def ops(self, cat: str | None = None, name: str | None = None) -> list[Event]:
        return [e for e in self.events if (cat is None or e.cat == cat) and (name is None or e.name == name)]


def read_trace(path: str | Path) -> Trace:
    """Read a torch.profiler Chrome trace (``.json`` or ``.json.gz``); :class:`TraceError` on bad input."""
    p = Path(path)
    src = str(p)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise TraceError(src, "no such trace file") from None
    except OSError as e:
        raise TraceError(src, f"cannot read trace file: {e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as e:
            raise TraceError(src, f"truncated or corrupt gzip data ({e}); expected a complete .json.gz trace") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise TraceError(src, "not a text JSON trace (undecodable bytes); expected torch.profiler Chrome-trace JSON") \
            from None
    except json.JSONDecodeError as e:
        raise TraceError(src, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                              "expected torch.profiler Chrome-trace JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        what = "a JSON object" if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
        raise TraceError(src, f"no 'traceEvents' list (got {what}); not a torch.profiler Chrome trace")
    events: list[Event] = []
    flows: list[JsonDict] = []
    for i, ev in enumerate(doc["traceEvents"]):
        if not isinstance(ev, dict):
            raise TraceError(src, f"traceEvents[{i}]: expected an object, got {type(ev).__name__}")
        ph = ev.get("ph")
        if ph == "X":
            ts, dur = ev.get("ts"), ev.get("dur", 0.0)
            if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
                raise TraceError(src, f"traceEvents[{i}] ({ev.get('name')!r}): 'ts'/'dur' must be numbers")
            args = ev.get("args")
            events.append(Event(str(ev.get("name", "")), str(ev.get("cat", "")), ev.get("pid"), ev.get("tid"),
                                float(ts), float(dur), args if isinstance(args, dict) else {}))
        elif ph in ("s", "f") and ev.get("cat") in ("fwdbwd", "ac2g"):
            flows.append(ev)
    events.sort(key=lambda e: (e.ts, -e.dur))
    meta = {k: v for k, v in doc.items() if k != "traceEvents"}
    return Trace(src, events, flows, meta)


# -- tidy tables --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """A ``ProfilerStep#number`` window (microseconds)."""

    number: int
    start_us: float
    end_us: float

    @property
    def dur_ms(self) -> float:
        return (self.end_us - self.start_us) / 1e3


def steps(trace: Trace) -> list[Step]:
    """The profiler steps, in time order; one pseudo-step ``-1`` over the whole trace if none."""
    out = []
    for e in trace.events:
        m = _STEP_RE.fullmatch(e.name)
        if m and e.cat in ("user_annotation", "cpu_op"):
            out.append(Step(int(m[1]), e.ts, e.end))
    if out:
        return sorted(out, key=lambda s: s.start_us)
    cpu = [e for e in trace.events if e.cat in ("cpu_op", "user_annotation")]
    if not cpu:
        return []
    return [Step(-1, cpu[0].ts, max(e.end for e in cpu))]


@dataclass(frozen=True)
class Collective:
    """One collective launch and its communication interval (``comm_*`` in microseconds)."""

    step: int | None
    name: str
    thread: str
    launch_us: float
    numel: int | None
    dtype: str | None
    nbytes: int | None
    group: str | None
    group_ranks: tuple[int, ...]
    comm_start_us: float
    comm_end_us: float
    comm_source: str          # "gpu_kernel" | "gloo_thread" | "cpu_op"
    backend: str | None       # "nccl" | "gloo" | None (unknown)
    external_id: int | None
    deft: RangeName | None = None

    @property
    def comm_s(self) -> float:
        return (self.comm_end_us - self.comm_start_us) * US

    @property
    def is_allreduce(self) -> bool:
        return self.name in ALLREDUCE_NAMES


def _norm_coll(name: str) -> str:
    return name.lower().replace("_", "").replace("coalesced", "_coalesced")


def _dims_numel(dims: JsonValue) -> int | None:
    """Element count of the first input of ``Input Dims`` (a tensor, or a tensor list)."""
    if not isinstance(dims, list) or not dims:
        return None
    first = dims[0]
    if isinstance(first, list) and first and all(isinstance(x, list) for x in first):
        return sum(math.prod(t) for t in first)  # TensorList: all tensors travel together
    if isinstance(first, list) and all(isinstance(x, int) for x in first):
        return math.prod(first) if first else None
    return None


def _dtype_bytes(dtype: str | None) -> int | None:
    return DTYPE_BYTES.get(dtype.lower()) if isinstance(dtype, str) else None


def _ranks(v: JsonValue) -> tuple[int, ...]:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            return ()
    if isinstance(v, list) and all(isinstance(x, int) for x in v):
        return tuple(v)
    return ()


class _Index:
    """Lookups over one trace: threads, launches and kernels, and flows (built once)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.by_thread: dict[Thread, list[Event]] = defaultdict(list)
        for e in trace.events:
            if e.cat not in GPU_CATS:
                self.by_thread[e.thread].append(e)
        self.gpu_by_corr: dict[int, Event] = {}
        self.gpu_by_ext: dict[int, list[Event]] = defaultdict(list)
        for e in trace.events:
            if e.cat in GPU_CATS:
                if e.correlation is not None:
                    self.gpu_by_corr[e.correlation] = e
                if e.external_id is not None:
                    self.gpu_by_ext[e.external_id].append(e)
        self.has_gpu = bool(self.gpu_by_corr)
        # per thread: compute launches (CPU ts) with their kernel, sorted; prefix max of kernel end
        # and suffix min of kernel start, to answer "kernels launched before/after CPU time t".
        self.launches: dict[Thread, tuple[list[float], list[float], list[float]]] = {}
        per: dict[Thread, list[tuple[float, Event]]] = defaultdict(list)
        for e in trace.events:
            if e.cat in ("cuda_runtime", "cuda_driver") and e.correlation in self.gpu_by_corr:
                k = self.gpu_by_corr[e.correlation]
                if not _is_comm_kernel(k.name):
                    per[e.thread].append((e.ts, k))
        for th, lst in per.items():
            lst.sort(key=lambda x: x[0])
            ts = [t for t, _ in lst]
            pmax, m = [], -math.inf
            for _, k in lst:
                m = max(m, k.end)
                pmax.append(m)
            smin, m = [0.0] * len(lst), math.inf
            for i in range(len(lst) - 1, -1, -1):
                m = min(m, lst[i][1].ts)
                smin[i] = m
            self.launches[th] = (ts, pmax, smin)
        self.fwd_of = self._link_forward(trace)

    def kernel_end_before(self, thread: Thread, t: float) -> float | None:
        """Latest end of the compute kernels that ``thread`` launched before CPU time ``t``."""
        entry = self.launches.get(thread)
        if entry is None:
            return None
        ts, pmax, _ = entry
        i = bisect.bisect_left(ts, t)
        return pmax[i - 1] if i > 0 else None

    def kernel_start_after(self, thread: Thread, t: float) -> float | None:
        """Earliest start of the compute kernels that ``thread`` launched at or after CPU time ``t``."""
        entry = self.launches.get(thread)
        if entry is None:
            return None
        ts, _, smin = entry
        i = bisect.bisect_left(ts, t)
        return smin[i] if i < len(ts) else None

    def _link_forward(self, trace: Trace) -> dict[Event, Event]:
        """Backward operator -> forward operator, from ``fwdbwd`` flows, else ``Sequence number``."""
        at: dict[tuple[JsonValue, JsonValue, JsonValue], list[Event]] = defaultdict(list)
        for e in trace.events:
            if e.cat == "cpu_op":
                at[(e.pid, e.tid, e.ts)].append(e)

        def pick(key: tuple[JsonValue, JsonValue, JsonValue]) -> Event | None:
            cands = at.get(key, [])
            seq = [c for c in cands if "Sequence number" in c.args]
            return seq[0] if seq else cands[0] if cands else None

        ends: dict[JsonValue, dict[str, Event]] = defaultdict(dict)
        for f in trace.flows:
            ph = f.get("ph")
            if f.get("cat") != "fwdbwd" or not isinstance(ph, str):  # read_trace keeps flows with ph "s" or "f"
                continue
            ev = pick((f.get("pid"), f.get("tid"), f.get("ts")))
            if ev is not None:
                ends[f.get("id")][ph] = ev
        out = {d["f"]: d["s"] for d in ends.values() if "s" in d and "f" in d}
        if out:
            return out
        # fallback: the outermost earlier non-backward operator with the same sequence number
        fwd_by_seq: dict[int, Event] = {}
        for e in trace.events:
            s = e.args.get("Sequence number")
            if e.cat == "cpu_op" and isinstance(s, int) and not _is_backward_name(e.name) \
                    and s not in fwd_by_seq:
                fwd_by_seq[s] = e
        for e in trace.events:
            s = e.args.get("Sequence number")
            if e.cat == "cpu_op" and isinstance(s, int) and _is_backward_name(e.name) and s in fwd_by_seq:
                fwd = fwd_by_seq[s]
                if fwd.ts < e.ts:
                    out[e] = fwd
        return out


def _is_backward_name(name: str) -> bool:
    return name.startswith(BACKWARD_PREFIX) or "Backward" in name


def _is_comm_kernel(name: str) -> bool:
    return name.lower().startswith("nccl")


def _contains(outer: Event, t: float) -> bool:
    return outer.ts <= t <= outer.end


def _step_of(stps: Sequence[Step], t: float) -> int | None:
    for s in stps:
        if s.start_us <= t <= s.end_us:
            return s.number
    return None


def _deft_ranges(trace: Trace) -> dict[Thread, list[tuple[Event, RangeName]]]:
    out: dict[Thread, list[tuple[Event, RangeName]]] = defaultdict(list)
    for e in trace.events:
        if e.cat in ("user_annotation", "cpu_op"):
            rn = parse_range_name(e.name)
            if rn is not None:
                out[e.thread].append((e, rn))
    return out


def collectives(trace: Trace, *, _index: _Index | None = None) -> list[Collective]:
    """Every collective launch in the trace (except ``wait``), with its communication interval."""
    idx = _index or _Index(trace)
    stps = steps(trace)
    gloo = _GlooRanges(trace)
    deft = _deft_ranges(trace)
    backend_hint = str(trace.distributed.get("backend", "") or "").lower() or None

    out = []
    for launch in _launches(trace):
        e, cname, numel, dtype = launch.op, launch.name, launch.numel, launch.dtype
        kernels = _comm_kernels(idx, e)
        backend: str | None
        if kernels:
            start, end, source, backend = min(k.ts for k in kernels), max(k.end for k in kernels), "gpu_kernel", "nccl"
        elif (g := gloo.match(launch)) is not None:
            start, end, source, backend = g.ts, g.end, "gloo_thread", "gloo"
            if numel is None:
                numel = _dims_numel(g.args.get("Input Dims"))
            if dtype is None:
                types = g.args.get("Input type")
                dtype = types[0] if isinstance(types, list) and types and isinstance(types[0], str) else None
        else:
            start, end, source, backend = e.ts, e.end, "cpu_op", backend_hint
        size = _dtype_bytes(dtype)
        rn = next((r for rng, r in deft.get(e.thread, []) if r.kind == "comm" and _contains(rng, e.ts)), None)
        out.append(Collective(
            step=_step_of(stps, e.ts), name=cname, thread=f"{e.pid}/{e.tid}", launch_us=e.ts, numel=numel,
            dtype=dtype, nbytes=numel * size if numel is not None and size is not None else None,
            group=launch.group, group_ranks=launch.ranks, comm_start_us=start, comm_end_us=end, comm_source=source,
            backend=backend, external_id=e.external_id, deft=rn,
        ))
    return out


class _Launch(NamedTuple):
    """A collective's launching CPU operator and what it records of the collective."""

    op: Event
    name: str  # normalised (:func:`_norm_coll`)
    numel: int | None
    dtype: str | None
    group: str | None
    ranks: tuple[int, ...]


def _launches(trace: Trace) -> list[_Launch]:
    """The collective launches in start order: every ``record_param_comms`` operator but ``wait``, and
    every ``c10d::<name>_`` operator that holds none (CPU gloo traces record no ``record_param_comms``;
    the element count then comes from its ``Input Dims``)."""
    rpc = [e for e in trace.events if e.name == "record_param_comms" and e.cat == "cpu_op"]
    rpc_by_thread: dict[Thread, list[Event]] = defaultdict(list)
    for e in rpc:
        rpc_by_thread[e.thread].append(e)
    launches: list[_Launch] = []
    for e in rpc:
        cname = e.args.get("Collective name")
        if not isinstance(cname, str) or cname in ("wait", ""):
            continue
        nel = e.args.get("In msg nelems")
        dt = e.args.get("dtype")
        grp = e.args.get("Process Group Name")
        launches.append(_Launch(e, _norm_coll(cname), nel if isinstance(nel, int) else None,
                                dt if isinstance(dt, str) else None, str(grp) if grp is not None else None,
                                _ranks(e.args.get("Process Group Ranks"))))
    for e in trace.events:
        if e.cat != "cpu_op" or not e.name.startswith("c10d::") or not e.name.endswith("_"):
            continue
        if any(_contains(e, r.ts) for r in rpc_by_thread.get(e.thread, [])):
            continue  # the nested record_param_comms describes it (with richer metadata)
        cname = _norm_coll(e.name[len("c10d::"):-1])
        launches.append(_Launch(e, cname, _dims_numel(e.args.get("Input Dims")), None, None, ()))
    launches.sort(key=lambda x: x.op.ts)
    return launches


class _GlooRanges:
    """The ranges gloo's worker thread records per collective name, in start order.

    gloo records no id linking a range to its launch, but runs its work items in launch order (a FIFO
    queue): :meth:`match` gives a launch the earliest unmatched range of its collective that starts
    after it and, when both counts are known, has its element count; each range is matched once.
    """

    def __init__(self, trace: Trace) -> None:
        self.by_name: dict[str, list[Event]] = defaultdict(list)
        for e in trace.events:
            if e.name.startswith("gloo:") and e.cat in ("user_annotation", "cpu_op"):
                self.by_name[_norm_coll(e.name[len("gloo:"):])].append(e)
        self.used: set[tuple[str, int]] = set()

    def match(self, launch: _Launch) -> Event | None:
        cname = launch.name
        for i, g in enumerate(self.by_name.get(cname, [])):
            if (cname, i) in self.used or g.ts < launch.op.ts:
                continue
            gn = _dims_numel(g.args.get("Input Dims"))
            if launch.numel is not None and gn is not None and gn != launch.numel:
                continue
            self.used.add((cname, i))
            return g
        return None


def _comm_kernels(idx: _Index, op: Event) -> list[Event]:
    """NCCL kernels launched inside ``op`` (by correlation), else carrying its External id."""
    found = []
    for e in idx.by_thread.get(op.thread, []):
        if e.ts > op.end:
            break
        if e.ts >= op.ts and e.cat in ("cuda_runtime", "cuda_driver") and e.correlation in idx.gpu_by_corr:
            k = idx.gpu_by_corr[e.correlation]
            if _is_comm_kernel(k.name):
                found.append(k)
    if not found and op.external_id is not None:
        found = [k for k in idx.gpu_by_ext.get(op.external_id, []) if _is_comm_kernel(k.name)]
    return found


@dataclass(frozen=True)
class BucketStep:
    """One bucket in one profiler step: its size and forward, backward and communication seconds."""

    step: int
    bucket: int
    link: str
    numel: int | None
    nbytes: int | None
    forward_s: float
    backward_s: float
    comm_s: float
    ready_us: float
    comm_start_us: float
    comm_end_us: float
    comm_source: str


def bucket_steps(trace: Trace) -> list[BucketStep]:
    """Per step and bucket: forward, backward and all-reduce times (method in the module docstring)."""
    return _analyse(trace)[1]


def _analyse(trace: Trace) -> tuple[list[Collective], list[BucketStep]]:
    idx = _Index(trace)
    colls = collectives(trace, _index=idx)
    if not any(c.is_allreduce for c in colls):
        names = sorted({c.name for c in colls})
        held = f" (it holds only: {', '.join(names)})" if names else ""
        raise TraceError(trace.path, "no all-reduce collectives (record_param_comms / c10d::allreduce_ / "
                                     f"nccl:all_reduce / gloo:all_reduce){held}; profile a distributed "
                                     "data-parallel run")
    if any(c.deft is not None for c in colls if c.is_allreduce):
        return colls, _deft_bucket_steps(trace, idx, colls)
    rows: list[BucketStep] = []
    for st in steps(trace):
        rows += _ddp_step(trace, idx, st, [c for c in colls if c.is_allreduce and c.step == st.number])
    if not rows:
        raise TraceError(trace.path, "no all-reduce launched during a backward pass "
                                     f"('{BACKWARD_PREFIX} ...' operators) inside a profiler step")
    return colls, rows


def _gpu_or_cpu(gpu_us: float | None, cpu_us: float) -> float:
    """The kernel time when the thread launched kernels (CUDA), else the CPU time (CPU-only trace)."""
    return cpu_us if gpu_us is None else gpu_us


def _ddp_step(trace: Trace, idx: _Index, st: Step, colls: list[Collective]) -> list[BucketStep]:
    bwd = [e for e in trace.events if e.cat == "cpu_op" and e.name.startswith(BACKWARD_PREFIX)
           and st.start_us <= e.ts <= st.end_us]
    if not bwd or not colls:
        return []
    bthread = Counter(e.thread for e in bwd).most_common(1)[0][0]
    bwd = [e for e in bwd if e.thread == bthread]
    bwd_start_cpu = bwd[0].ts
    bucket_colls = [c for c in colls if c.launch_us >= bwd_start_cpu and c.thread == f"{bthread[0]}/{bthread[1]}"]
    if not bucket_colls:
        return []
    # A bucket's gradient is ready when the last kernel launched before its all-reduce ends.
    start = _gpu_or_cpu(idx.kernel_start_after(bthread, bwd_start_cpu), bwd_start_cpu)
    readies = [_gpu_or_cpu(idx.kernel_end_before(bthread, c.launch_us), c.launch_us) for c in bucket_colls]

    # forward boundaries via the backward -> forward links of this step's backward operators
    linked = [(b, idx.fwd_of[b]) for b in trace.events if b in idx.fwd_of
              and b.thread == bthread and bwd_start_cpu <= b.ts <= st.end_us]
    fwd_ops = [f for _, f in linked]
    fwd_bounds: list[float] | None = None
    if fwd_ops:
        fthread = Counter(f.thread for f in fwd_ops).most_common(1)[0][0]
        first = min(fwd_ops, key=lambda f: f.ts)
        last_end = max(f.end for f in fwd_ops)

        def fbound(t: float) -> float:
            return _gpu_or_cpu(idx.kernel_start_after(fthread, t), t)

        fwd_end = _gpu_or_cpu(idx.kernel_end_before(fthread, last_end), last_end)
        bounds = []
        lo = bwd_start_cpu
        for b, c in enumerate(bucket_colls):
            seg = [f for bo, f in linked if lo <= bo.ts < c.launch_us]
            lo = c.launch_us
            if b == len(bucket_colls) - 1:
                bounds.append(fbound(first.ts))
            elif seg:
                bounds.append(fbound(seg[-1].ts))
            else:
                bounds.append(bounds[-1] if bounds else fwd_end)
        fwd_bounds = [fwd_end, *bounds]

    rows = []
    prev = start
    for b, c in enumerate(bucket_colls):
        fwd = max(0.0, fwd_bounds[b] - fwd_bounds[b + 1]) * US if fwd_bounds else 0.0
        rows.append(BucketStep(
            step=st.number, bucket=b, link="primary", numel=c.numel, nbytes=c.nbytes, forward_s=fwd,
            backward_s=max(0.0, readies[b] - prev) * US, comm_s=c.comm_s, ready_us=readies[b],
            comm_start_us=c.comm_start_us, comm_end_us=c.comm_end_us, comm_source=c.comm_source,
        ))
        prev = max(prev, readies[b])
    return rows


def _deft_bucket_steps(trace: Trace, idx: _Index, colls: list[Collective]) -> list[BucketStep]:
    """deft runs: bucket, link and iteration from the range names (see :mod:`deft.profiler.nvtx`)."""
    gpu_span: dict[str, Event] = {}
    for e in trace.events:
        if e.cat == "gpu_user_annotation" and e.name.startswith("deft/"):
            gpu_span[e.name] = e
    fwd: dict[tuple[int, int], float] = {}
    bwd: dict[tuple[int, int], float] = {}
    for th in _deft_ranges(trace).values():
        for ev, rn in th:
            span = gpu_span.get(ev.name, ev)
            if rn.kind == "fwd":
                fwd[(rn.iteration, rn.bucket)] = fwd.get((rn.iteration, rn.bucket), 0.0) + span.dur * US
            elif rn.kind == "bwd":
                bwd[(rn.iteration, rn.bucket)] = bwd.get((rn.iteration, rn.bucket), 0.0) + span.dur * US
    rows = []
    for c in colls:
        if c.deft is None or not c.is_allreduce:
            continue
        it, b = c.deft.iteration, c.deft.bucket
        rows.append(BucketStep(
            step=it, bucket=b, link=c.deft.link or "primary", numel=c.numel, nbytes=c.nbytes,
            forward_s=fwd.get((it, b), 0.0), backward_s=bwd.get((it, b), 0.0), comm_s=c.comm_s,
            ready_us=c.launch_us, comm_start_us=c.comm_start_us, comm_end_us=c.comm_end_us,
            comm_source=c.comm_source,
        ))
    return sorted(rows, key=lambda r: (r.step, r.bucket, r.link))


# -- the profile ---------------------------------------------------------------------------------------
def _trace_files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")))
    if not files:
        raise TraceError(str(path), "directory holds no .json or .json.gz traces")
    return files


#: One rank's compute per step: step number -> (forward seconds per bucket, backward seconds per bucket).
_StepCompute = dict[int, tuple[list[float], list[float]]]


def load(path: str | Path, rank: int | None = None) -> Profile:
    """A :class:`deft.Profile` (source ``"kineto"``) from one trace, or a directory of per-rank traces.

    ``rank`` selects the trace of that rank (checked against ``distributedInfo.rank``). For a directory
    and ``rank=None`` every rank's trace is read and reduced over ranks (:func:`_over_ranks`: compute at
    the ranks' pace per step where their steps match, comm the maximum over ranks of their medians).
    """
    p = Path(path)
    traces = [read_trace(f) for f in _trace_files(p)]
    if rank is not None:
        chosen = [t for t in traces if t.rank == rank or (t.rank is None and not p.is_dir())]
        if not chosen:
            have = sorted({t.rank for t in traces if t.rank is not None})
            raise TraceError(str(p), f"no trace of rank {rank} (distributedInfo.rank found: {have or 'none'})")
        traces = chosen
    per_rank = [_profile_rows(t) for t in traces]
    ref_layout = per_rank[0][1]
    for t, (_, layout, _, _) in zip(traces, per_rank, strict=True):
        if layout != ref_layout:
            raise TraceError(t.path, f"bucket layout {layout} differs from {traces[0].path}'s {ref_layout}")
    links = sorted({lk for rows, _, _, _ in per_rank for b in rows.values() for lk in b.comm_s},
                   key=lambda x: (x != "primary", x))
    times, paced = _over_ranks([rows for rows, _, _, _ in per_rank], [c for _, _, _, c in per_rank],
                               len(ref_layout), links)
    info = per_rank[0][2]
    buckets = tuple(
        Bucket(id=b, params=(f"<unknown: bucket {b} of the trace, {numel} elements>",), numel=numel, nbytes=nbytes)
        for b, (numel, nbytes) in enumerate(ref_layout)
    )
    link_objs = tuple(Link(name=lk, backend=info.backends.get(lk, "gloo")) for lk in links)
    # Links carry no alpha/beta: every bucket has a measured time; links.fit supplies the model.
    missing = [b for b, t in enumerate(times) for lk in links if lk not in t.comm_s]
    if missing:
        raise TraceError(traces[0].path, f"buckets {sorted(set(missing))} have no all-reduce on every link "
                                         f"({', '.join(links)}) in the analysed steps")
    return Profile(
        buckets=buckets, times=tuple(times), links=link_objs, world_size=info.world_size, source="kineto",
        versions=info.versions, model=info.model,
        meta={
            "trace": [t.path for t in traces], "ranks": [t.rank for t in traces],
            "steps_used": info.steps_used, "steps_skipped": info.steps_skipped,
            "reduction": f"{paced.describe('step')}; communication: median over steps per rank, max over ranks",
            "params_known": False, "deft_ranges": info.deft_ranges,
            "note": "a Kineto trace holds no parameter names; bucket params are placeholders. nbytes = "
                    "numel x dtype size of the all-reduce"
                    + (" (dtype not recorded: float32 assumed)." if info.dtype_assumed else "."),
        },
    )


def _over_ranks(per_rank: Sequence[Mapping[int, _BucketMedians]], compute: Sequence[_StepCompute], n: int,
                links: Sequence[str]) -> tuple[list[BucketTimes], Paced]:
    """Each of the ``n`` buckets' times from every rank's medians over steps (``per_rank[r][b]``) and
    its per-step compute (``compute[r][s]``, :func:`_step_compute`), and how the compute was reduced.

    Forward and backward go at the ranks' pace (:func:`deft.profiler.pace.paced_ranks`): with
    ``f[r][s][b]``, ``g[r][s][b]`` rank ``r``'s times in step ``s``, the total is
    ``T = median_s max_r sum_b (f[r][s][b] + g[r][s][b])`` over the steps every rank holds (in each
    step the slowest rank's, as the warm-up timer reduces), and bucket ``b`` gets
    ``median_r f_rb * T / S`` and ``median_r g_rb * T / S``, ``f_rb`` and ``g_rb`` the rank's medians over
    those steps and ``S`` the sum of the buckets' medians over ranks (the per-bucket maximum over ranks
    would add up stalls that different ranks had in different buckets). Where the ranks hold no step in
    common, ``T`` is the slowest rank's total of its medians over its own steps. One rank's medians are
    taken unchanged. A link's comm time is the maximum over the ranks that sent the bucket on it: a
    synchronous all-reduce completes only when the slowest rank arrives.
    """
    paced = paced_ranks([{s: f for s, (f, _) in c.items()} for c in compute],
                        [{s: g for s, (_, g) in c.items()} for c in compute],
                        [[rows[b].forward_s for b in range(n)] for rows in per_rank],
                        [[rows[b].backward_s for b in range(n)] for rows in per_rank])
    fwd, bwd = paced.forward_s, paced.backward_s
    times = []
    for b in range(n):
        comm = {}
        for lk in links:
            vals = [rows[b].comm_s[lk] for rows in per_rank if lk in rows[b].comm_s]
            if vals:
                comm[lk] = max(vals)
        times.append(BucketTimes(forward_s=fwd[b], backward_s=bwd[b], comm_s=comm))
    return times, paced


@dataclass(frozen=True)
class _BucketMedians:
    """One bucket's times on one rank: medians over the usable steps (seconds)."""

    forward_s: float
    backward_s: float
    comm_s: dict[str, float]  # per link


@dataclass(frozen=True)
class _RunInfo:
    """What one rank's trace says about the run, beside the bucket times."""

    backends: dict[str, str]  # link -> "nccl" | "gloo", where known
    world_size: int
    versions: dict[str, str]
    steps_used: list[int]
    steps_skipped: list[int]
    model: str
    dtype_assumed: bool  # some all-reduce recorded no dtype: float32 assumed for its bytes
    deft_ranges: bool


def _profile_rows(trace: Trace) -> tuple[dict[int, _BucketMedians], list[tuple[int, int]], _RunInfo, _StepCompute]:
    """Per bucket: median forward, backward and per-link comm seconds over the usable steps; the
    bucket layout ``(numel, nbytes)``; the run's facts (:func:`_usable_steps` says which steps); and
    the compute of each usable step that timed every bucket (:func:`_step_compute`)."""
    all_colls, rows = _analyse(trace)
    deft_ranges = any(c.deft is not None for c in all_colls if c.is_allreduce)
    common, used, skipped = _usable_steps(trace, rows, deft_ranges)
    layout: list[tuple[int, int]] = []
    for nu, nb in common:
        if nu is None:
            raise TraceError(trace.path, "all-reduce element counts are not recorded (no 'In msg nelems' and no "
                                         "'Input Dims'); profile with torch.profiler(record_shapes=True)")
        layout.append((int(nu), int(nb) if nb is not None else 4 * int(nu)))
    dtype_assumed = any(nb is None for _, nb in common)
    out: dict[int, _BucketMedians] = {}
    sel = [r for r in rows if r.step in used]
    for b in range(len(layout)):
        rs = [r for r in sel if r.bucket == b]
        # one sample per (step, bucket) for compute: a bucket sent on two links in one step counts once
        compute = {r.step: r for r in rs}.values()
        comm = {lk: median([r.comm_s for r in rs if r.link == lk]) for lk in sorted({r.link for r in rs})}
        out[b] = _BucketMedians(forward_s=median([r.forward_s for r in compute]),
                                backward_s=median([r.backward_s for r in compute]), comm_s=comm)
    colls = [c for c in all_colls if c.is_allreduce]
    backends: dict[str, str] = {}
    for c in colls:
        lk = c.deft.link if c.deft is not None and c.deft.link else "primary"
        if c.backend in ("nccl", "gloo"):
            backends.setdefault(lk, c.backend)
    dist = trace.distributed
    hint = str(dist.get("backend", "")).lower()
    if "primary" not in backends and hint in ("nccl", "gloo"):
        backends["primary"] = hint
    group_sizes = [len(c.group_ranks) for c in colls if c.group_ranks]
    world = max(group_sizes) if group_sizes else _int(dist.get("world_size", 1) or 1)
    versions = {"trace_schema": str(trace.meta.get("schemaVersion", ""))}
    if dist.get("nccl_version"):
        versions["nccl"] = str(dist["nccl_version"])
    info = _RunInfo(backends=backends, world_size=world, versions=versions, steps_used=used, steps_skipped=skipped,
                    model=Path(trace.path).name, dtype_assumed=dtype_assumed, deft_ranges=deft_ranges)
    return dict(out), layout, info, _step_compute(sel, len(layout))


def _step_compute(rows: Sequence[BucketStep], n: int) -> _StepCompute:
    """Per step of ``rows`` in which each of the ``n`` buckets has a row: every bucket's forward and
    backward seconds (a bucket sent on two links in one step counts once)."""
    by_step: dict[int, dict[int, BucketStep]] = defaultdict(dict)
    for r in rows:
        by_step[r.step][r.bucket] = r
    return {s: ([bs[b].forward_s for b in range(n)], [bs[b].backward_s for b in range(n)])
            for s, bs in sorted(by_step.items()) if all(b in bs for b in range(n))}


Layout = tuple[tuple[int | None, int | None], ...]  # (numel, nbytes) per bucket, as the all-reduces recorded


def _usable_steps(trace: Trace, rows: list[BucketStep], deft_ranges: bool) -> tuple[Layout, list[int], list[int]]:
    """The bucket layout and the steps whose bucket times are used, and those skipped.

    DDP traces: the steps whose bucket sizes match the most common layout (DDP may rebuild its
    buckets after the first iteration). deft traces: every iteration; a bucket's size is its most
    common all-reduce size, and its comm time on a link is the median over the iterations in which
    it was sent on that link.
    """
    if deft_ranges:
        sizes: dict[int, Counter[tuple[int | None, int | None]]] = defaultdict(Counter)
        for r in rows:
            sizes[r.bucket][(r.numel, r.nbytes)] += 1
        absent = [b for b in range(max(sizes) + 1) if b not in sizes]
        if absent:
            raise TraceError(trace.path, f"deft ranges name buckets up to {max(sizes)} but buckets {absent} are never "
                                         "all-reduced in the trace")
        return tuple(sizes[b].most_common(1)[0][0] for b in range(len(sizes))), sorted({r.step for r in rows}), []
    by_step: dict[int, list[BucketStep]] = defaultdict(list)
    for r in rows:
        by_step[r.step].append(r)
    layouts = {s: tuple((r.numel, r.nbytes) for r in sorted(rs, key=lambda r: r.bucket)) for s, rs in by_step.items()}
    common = Counter(layouts.values()).most_common(1)[0][0]
    used = sorted(s for s, lay in layouts.items() if lay == common)
    return common, used, sorted(s for s in layouts if s not in used)


def _int(v: JsonValue) -> int:
    """``int(v)`` of a JSON number or numeric string (a trace's ``world_size``); a TypeError otherwise."""
    if isinstance(v, (int, float, str)):
        return int(v)
    raise TypeError(f"expected a number, got {v!r}")


# -- command line ---------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deft.profiler.kineto TRACE``: print collectives, per-step bucket times, the profile."""
    ap = argparse.ArgumentParser(prog="python -m deft.profiler.kineto", description=main.__doc__)
    ap.add_argument("trace")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--out", help="write the profile JSON here")
    args = ap.parse_args(argv)
    try:
        tr = read_trace(args.trace) if not Path(args.trace).is_dir() else None
        if tr is not None:
            print(f"# steps\n{format_table(steps(tr))}\n")
            colls = [c for c in collectives(tr) if c.is_allreduce]
            print("# all-reduce collectives")
            print(format_table(_collective_rows(colls)) + "\n")
            print("# per step and bucket (seconds)")
            print(format_table(bucket_steps(tr), ["step", "bucket", "link", "numel", "forward_s", "backward_s",
                                                  "comm_s", "comm_source"]) + "\n")
        prof = load(args.trace, rank=args.rank)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("# profile (median over steps)")
    print(format_table(_profile_table(prof)))
    print(f"world_size={prof.world_size} links={[(k.name, k.backend) for k in prof.links]} "
          f"CR={prof.coverage_rate:.3f}")
    if args.out:
        prof.save(args.out)
    return 0


def _collective_rows(colls: Iterable[Collective]) -> list[dict[str, object]]:
    return [{"step": c.step, "name": c.name, "numel": c.numel, "dtype": c.dtype, "group": c.group,
             "ranks": c.group_ranks, "comm_ms": c.comm_s * 1e3, "source": c.comm_source, "backend": c.backend}
            for c in colls]


def _profile_table(prof: Profile) -> list[dict[str, object]]:
    return [{"bucket": b.id, "numel": b.numel, "nbytes": b.nbytes, "forward_ms": t.forward_s * 1e3,
             "backward_ms": t.backward_s * 1e3, **{f"comm_{k}_ms": v * 1e3 for k, v in t.comm_s.items()}}
            for b, t in zip(prof.buckets, prof.times, strict=True)]


if __name__ == "__main__":
    sys.exit(main())
