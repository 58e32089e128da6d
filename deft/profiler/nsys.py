"""Per-bucket times from Nsight Systems SQLite exports (``nsys export --type sqlite``): tidy tables.

Schema used (as in the real export ``nsys_2gpu_sendrecv.sqlite``, export schema 3.25)
-------------------------------------------------------------------------------------
* ``CUPTI_ACTIVITY_KIND_KERNEL``: ``start``/``end`` (ns), ``deviceId``, ``streamId``,
  ``correlationId``, ``globalPid``, ``shortName``/``demangledName`` (ids into ``StringIds``).
* ``CUPTI_ACTIVITY_KIND_RUNTIME``: the CUDA API calls (``nameId``, ``globalTid``, ``correlationId``).
  A kernel's launch is the runtime call with the same ``correlationId`` *in the same process*:
  correlation ids restart in every process, so the join key is ``(correlationId, pid)`` with
  ``pid = (globalTid >> 24) & 0xFFFFFF`` (nsys' serialized GlobalId: hw/vm ids, pid, tid).
* ``NVTX_EVENTS``: ``eventType`` 59 (push/pop range), 60 (start/end range), 34 (mark), 75 (domain
  create: ``text`` names ``domainId``); the message is ``text`` or, for registered strings,
  ``StringIds[textId]``.
* ``PROCESSES`` (``globalPid``, ``pid``, ``name``), ``StringIds``, ``META_DATA_EXPORT``.

NCCL activity is every kernel named ``ncclKernel_*`` / ``ncclDevKernel_*`` (the collective is the
next token: ``AllReduce``, ``SendRecv``, ...) plus the NVTX ranges NCCL itself emits (``ncclAllReduce``,
``ncclSend``, ...).

Bucket times (:func:`load`) come from deft's NVTX ranges (:mod:`deft.profiler.nvtx`): per rank
(process) and iteration, a ``deft/fwd`` or ``deft/bwd`` range's time is the GPU span
``[first start, last end]`` of the compute kernels launched inside it (its CPU duration if it launched
none), and a ``deft/comm`` range's time is the span of the NCCL kernels launched inside it (its CPU
duration if none: a gloo link, whose completion nsys cannot see). Over ranks, forward and backward go
at the ranks' pace (:func:`deft.profiler.pace.paced_ranks`), in the warm-up timer's order on the
iterations every rank holds (matched by iteration index): ``T = median_i max_r sum_b (fwd[r][i][b] +
bwd[r][i][b])``, shared by the buckets' medians over ranks; where the ranks hold no iteration in
common, ``T`` is the slowest rank's total of its per-bucket medians over its own iterations
(``meta["reduction"]`` says which; one rank's medians are taken unchanged). A link's comm time is the
maximum over ranks of their medians over iterations (the slowest rank gates a synchronous
all-reduce). Sizes come from ``deft/bucket/...`` marks (:func:`deft.profiler.nvtx.mark_layout`).

An export without deft ranges but with NCCL all-reduces is read as a plain torch DDP run
(:func:`load_ddp`): the paper's four-step walk of Fig. 8, where nsys' join of a kernel to its launching
runtime call on ``(correlationId, pid)`` plays the part of Kineto's External id, and torch's autograd
NVTX ranges (``seq = N`` on a forward operator and on the backward node it created) link the backward
thread to the forward thread.
"""

from __future__ import annotations

import argparse
import bisect
import re
import sqlite3
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from deft.errors import TraceError
from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.profiler.nvtx import RangeName, parse_layout_name, parse_range_name
from deft.profiler.pace import Paced, paced_ranks
from deft.profiler.tables import format_table, median

NS = 1e-9
PUSH_POP, START_END, MARK, DOMAIN_CREATE = 59, 60, 34, 75
_NCCL_KERNEL_RE = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")
_SQLITE_MAGIC = b"SQLite format 3\x00"
_NSYS_MARKERS = ("META_DATA_EXPORT", "ENUM_NSYS_EVENT_TYPE", "TARGET_INFO_SESSION_START_TIME", "ThreadNames")


def _pid(global_id: int | None) -> int | None:
    return None if global_id is None else (global_id >> 24) & 0xFFFFFF


def _tid(global_tid: int | None) -> int | None:
    return None if global_tid is None else global_tid & 0xFFFFFF


# -- opening -----------------------------------------------------------------------------------------
class Export:
    """A read-only connection to one nsys SQLite export, with its table list and string table."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        self.path = str(p)
        try:
            with p.open("rb") as f:
                head = f.read(len(_SQLITE_MAGIC))
        except FileNotFoundError:
            raise TraceError(self.path, "no such nsys export file") from None
        except OSError as e:
            raise TraceError(self.path, f"cannot read nsys export: {e}") from None
        if head != _SQLITE_MAGIC:
            raise TraceError(self.path, "not an SQLite file; expected an `nsys export --type sqlite` file "
                                        "(a .nsys-rep must be exported first)")
        try:
            self.db = sqlite3.connect(f"file:{p.resolve()}?mode=ro", uri=True)
            self.tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as e:
            raise TraceError(self.path, f"corrupt SQLite file ({e})") from None
        if "StringIds" not in self.tables or not any(t in self.tables for t in _NSYS_MARKERS):
            listed = ", ".join(sorted(self.tables)[:12]) or "none"
            raise TraceError(self.path, "an SQLite file but not an nsys export: no StringIds / META_DATA_EXPORT / "
                                        f"ENUM_NSYS_EVENT_TYPE tables (tables: {listed})")
        self.strings: dict[int, str] = dict(self.db.execute("SELECT id, value FROM StringIds"))

    def has(self, table: str) -> bool:
        return table in self.tables

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        """The query's rows as :mod:`sqlite3` returns them: untyped, the export's schema (module docstring)
        decides each column's type."""
        try:
            return self.db.execute(sql).fetchall()
        except sqlite3.DatabaseError as e:
            raise TraceError(self.path, f"unexpected nsys schema ({e}) in query: {sql.split()[0:6]}") from None

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self.db.execute(f'PRAGMA table_info("{table}")')}

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Export:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open(path: str | Path | Export) -> tuple[Export, bool]:
    return (path, False) if isinstance(path, Export) else (Export(path), True)


# -- tidy tables -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kernel:
    """One GPU kernel and (when the export has it) the runtime call that launched it; times in ns."""

    pid: int | None
    device: int
    stream: int
    start_ns: int
    end_ns: int
    name: str
    correlation: int | None
    launch_tid: int | None
    launch_api: str | None
    launch_ns: int | None

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def nccl_op(self) -> str | None:
        m = _NCCL_KERNEL_RE.match(self.name)
        return m[1] if m else None


def kernels(path: str | Path | Export) -> list[Kernel]:
    """All kernels, each joined to its launching runtime call on ``(correlationId, pid)``."""
    ex, own = _open(path)
    try:
        if not ex.has("CUPTI_ACTIVITY_KIND_KERNEL"):
            raise TraceError(ex.path, "export holds no CUDA kernels (no CUPTI_ACTIVITY_KIND_KERNEL table; "
                                      "capture with `nsys profile --trace=cuda,nvtx`)")
        launch: dict[tuple[int | None, int], tuple[int | None, str, int]] = {}
        if ex.has("CUPTI_ACTIVITY_KIND_RUNTIME"):
            for start, gtid, corr, name_id in ex.rows(
                    "SELECT start, globalTid, correlationId, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME "
                    "WHERE correlationId IS NOT NULL"):
                launch[(_pid(gtid), corr)] = (_tid(gtid), ex.strings.get(name_id, "?"), start)
        out = []
        for start, end, dev, stream, corr, gpid, short in ex.rows(
                "SELECT start, end, deviceId, streamId, correlationId, globalPid, shortName "
                "FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY start"):
            pid = _pid(gpid)
            tid, api, lts = launch.get((pid, corr), (None, None, None))
            out.append(Kernel(pid, dev, stream, start, end, ex.strings.get(short, f"<string {short}>"), corr,
                              tid, api, lts))
        return out
    finally:
        if own:
            ex.close()


@dataclass(frozen=True)
class NvtxRange:
    """One NVTX range or mark (``end_ns is None`` for marks); ``deft`` is its parsed deft name."""

    pid: int | None
    tid: int | None
    kind: str          # "push_pop" | "start_end" | "mark"
    start_ns: int
    end_ns: int | None
    text: str
    domain: str | None
    deft: RangeName | None

    @property
    def dur_ns(self) -> int:
        return (self.end_ns - self.start_ns) if self.end_ns is not None else 0


def nvtx_ranges(path: str | Path | Export) -> list[NvtxRange]:
    """NVTX push/pop (59) and start/end (60) ranges and marks (34), text resolved through StringIds."""
    ex, own = _open(path)
    try:
        if not ex.has("NVTX_EVENTS"):
            return []
        cols = ex.columns("NVTX_EVENTS")
        text_id = "textId" if "textId" in cols else "NULL"
        domain_id = "domainId" if "domainId" in cols else "NULL"
        rows = ex.rows(f"SELECT start, end, eventType, text, {text_id}, globalTid, {domain_id} FROM NVTX_EVENTS "
                       f"WHERE eventType IN ({PUSH_POP}, {START_END}, {MARK}, {DOMAIN_CREATE}) ORDER BY start")
        domains = {d: t for _, _, et, t, _, _, d in rows if et == DOMAIN_CREATE and t}
        kinds = {PUSH_POP: "push_pop", START_END: "start_end", MARK: "mark"}
        out = []
        for start, end, et, text, tid_, gtid, dom in rows:
            if et == DOMAIN_CREATE:
                continue
            msg = text if text is not None else ex.strings.get(tid_, "") if tid_ is not None else ""
            out.append(NvtxRange(_pid(gtid), _tid(gtid), kinds[et], start, end if et != MARK else None, msg,
                                 domains.get(dom) if dom else None, parse_range_name(msg)))
        return out
    finally:
        if own:
            ex.close()


@dataclass(frozen=True)
class NcclActivity:
    """One piece of NCCL activity: a kernel on a GPU stream, or an NVTX range NCCL emitted on a thread."""

    source: str        # "kernel" | "nvtx"
    pid: int | None
    where: str         # "dev{d}/stream{s}" or "tid{t}"
    op: str            # AllReduce, SendRecv, Broadcast, ... / ncclAllReduce, ncclSend, ...
    start_ns: int
    end_ns: int
    name: str

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


def nccl_activity(path: str | Path | Export) -> list[NcclActivity]:
    """NCCL kernels (``ncclKernel_*``, ``ncclDevKernel_*``) and NCCL's own NVTX ranges, by start time."""
    ex, own = _open(path)
    try:
        out = [NcclActivity("kernel", k.pid, f"dev{k.device}/stream{k.stream}", k.nccl_op or "?", k.start_ns,
                            k.end_ns, k.name) for k in kernels(ex) if k.nccl_op is not None]
        for r in nvtx_ranges(ex):
            if r.text.startswith("nccl") and r.end_ns is not None:
                out.append(NcclActivity("nvtx", r.pid, f"tid{r.tid}", r.text.split(",")[0], r.start_ns, r.end_ns,
                                        r.text))
        return sorted(out, key=lambda a: a.start_ns)
    finally:
        if own:
            ex.close()


class ExportSummary(TypedDict):
    """What :func:`summary` reports of an export (times in ms)."""

    file: str
    nsys_version: str | None
    export_schema: str | None
    gpu_processes: dict[int, str]  # pid -> process name
    devices: list[int]
    kernels: int
    kernels_launch_joined: int
    kernel_time_ms: float
    nccl_kernels: dict[str, int]  # NCCL kernels per collective
    nccl_kernel_time_ms: float
    nvtx_ranges: int
    nvtx_marks: int
    nvtx_top: dict[str, int]  # the most common range names
    deft_ranges: int
    span_ms: float


def summary(path: str | Path | Export) -> ExportSummary:
    """What the export holds: processes, kernels (NCCL by collective), NVTX ranges, deft ranges."""
    ex, own = _open(path)
    try:
        ks = kernels(ex) if ex.has("CUPTI_ACTIVITY_KIND_KERNEL") else []
        rs = nvtx_ranges(ex)
        procs = dict(ex.rows("SELECT pid, name FROM PROCESSES")) if ex.has("PROCESSES") else {}
        gpu_pids = sorted({k.pid for k in ks if k.pid is not None})
        meta = dict(ex.rows("SELECT name, value FROM META_DATA_EXPORT")) if ex.has("META_DATA_EXPORT") else {}
        nccl = [k for k in ks if k.nccl_op is not None]
        top = Counter(r.text.split(",")[0] for r in rs if r.end_ns is not None).most_common(8)
        return {
            "file": ex.path,
            "nsys_version": meta.get("EXPORT_PRODUCT_VERSION"),
            "export_schema": meta.get("EXPORT_SCHEMA_VERSION"),
            "gpu_processes": {pid: procs.get(pid, "?") for pid in gpu_pids},
            "devices": sorted({k.device for k in ks}),
            "kernels": len(ks),
            "kernels_launch_joined": sum(1 for k in ks if k.launch_api is not None),
            "kernel_time_ms": sum(k.dur_ns for k in ks) * 1e-6,
            "nccl_kernels": dict(Counter(op for k in nccl if (op := k.nccl_op) is not None)),
            "nccl_kernel_time_ms": sum(k.dur_ns for k in nccl) * 1e-6,
            "nvtx_ranges": sum(1 for r in rs if r.end_ns is not None),
            "nvtx_marks": sum(1 for r in rs if r.end_ns is None),
            "nvtx_top": dict(top),
            "deft_ranges": sum(1 for r in rs if r.deft is not None),
            "span_ms": (max(k.end_ns for k in ks) - min(k.start_ns for k in ks)) * 1e-6 if ks else 0.0,
        }
    finally:
        if own:
            ex.close()


# -- per-bucket times ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BucketRange:
    """One deft range of one rank, with the time it is charged (seconds) and where that came from."""

    pid: int | None
    kind: str
    bucket: int
    iteration: int
    link: str | None
    seconds: float
    source: str        # "gpu_kernels" | "nccl_kernels" | "nvtx_cpu"


def bucket_ranges(path: str | Path | Export) -> list[BucketRange]:
    """Every deft range with its charged time (see the module docstring)."""
    ex, own = _open(path)
    try:
        ks = kernels(ex)
        by_thread: dict[tuple[int | None, int | None], list[tuple[int, Kernel]]] = defaultdict(list)
        for k in ks:
            if k.launch_ns is not None:
                by_thread[(k.pid, k.launch_tid)].append((k.launch_ns, k))
        for lst in by_thread.values():
            lst.sort(key=lambda x: x[0])
        out = []
        for r in nvtx_ranges(ex):
            if r.deft is None or r.end_ns is None:
                continue
            lst = by_thread.get((r.pid, r.tid), [])
            lo = bisect.bisect_left(lst, r.start_ns, key=lambda x: x[0])
            hi = bisect.bisect_right(lst, r.end_ns, key=lambda x: x[0])
            inside = [k for _, k in lst[lo:hi]]
            want_nccl = r.deft.kind == "comm"
            sel = [k for k in inside if (k.nccl_op is not None) == want_nccl]
            if sel:
                secs = (max(k.end_ns for k in sel) - min(k.start_ns for k in sel)) * NS
                src = "nccl_kernels" if want_nccl else "gpu_kernels"
            else:
                secs, src = r.dur_ns * NS, "nvtx_cpu"
            out.append(BucketRange(r.pid, r.deft.kind, r.deft.bucket, r.deft.iteration, r.deft.link, secs, src))
        return out
    finally:
        if own:
            ex.close()


def load(path: str | Path, world_size: int | None = None) -> Profile:
    """A :class:`deft.Profile` (source ``"nsys"``) from deft's NVTX ranges in an nsys export.

    ``world_size`` defaults to the number of processes that recorded deft ranges (an export of one
    node sees only that node's ranks: pass the real world size for multi-node runs).
    """
    ex = Export(path)
    try:
        ranges = bucket_ranges(ex)
        if not ranges:
            if not any(c.op == "AllReduce" for c in comm_ops(ex)):
                raise _no_deft_ranges(ex)
            return load_ddp(ex, world_size)
        layout = {}
        for r in nvtx_ranges(ex):
            parsed = parse_layout_name(r.text)
            if parsed is not None:
                layout[parsed[0]] = (parsed[1], parsed[2])
        nccl_links = {r.link for r in ranges if r.kind == "comm" and r.source == "nccl_kernels"}
    finally:
        ex.close()
    pids = sorted({r.pid for r in ranges}, key=lambda p: -1 if p is None else p)
    n = max(r.bucket for r in ranges) + 1
    links = sorted({r.link for r in ranges if r.kind == "comm" and r.link}, key=lambda x: (x != "primary", x))
    if not links:
        raise TraceError(str(path), "has deft forward/backward ranges but no deft/comm ranges: no communication "
                                    "time per bucket")
    times, paced = _bucket_times(ranges, pids, n, links, str(path))
    sizes_known = all(b in layout for b in range(n))
    buckets = tuple(Bucket(id=b, params=(f"<unknown: bucket {b} of the nsys export>",),
                           numel=layout.get(b, (0, 0))[0], nbytes=layout.get(b, (0, 0))[1]) for b in range(n))
    return Profile(
        buckets=buckets, times=tuple(times),
        links=tuple(Link(name=lk, backend="nccl" if lk in nccl_links else "gloo") for lk in links),
        world_size=world_size or max(1, len(pids)), source="nsys", model=Path(path).name,
        meta={"export": str(path), "ranks_pids": pids, "reduction": _reduction(paced), "params_known": False,
              "sizes_known": sizes_known,
              "note": "NVTX ranges carry no parameter names; sizes come from deft/bucket marks"
                      + ("" if sizes_known else " (absent for some buckets: numel/nbytes 0 there)")},
    )


def _no_deft_ranges(ex: Export) -> TraceError:
    """The error for an export without deft ranges, saying what it holds instead (its :func:`summary`)."""
    s = summary(ex)
    nccl = ", ".join(f"{op} x{n}" for op, n in s["nccl_kernels"].items()) or "none"
    top = ", ".join(f"{t!r} x{n}" for t, n in list(s["nvtx_top"].items())[:5]) or "none"
    return TraceError(ex.path, "holds no deft bucket ranges ('deft/fwd|bwd|comm/...' NVTX ranges from a deft "
                               "run) and no NCCL all-reduce of a torch DDP run; "
                               f"it holds {s['kernels']} kernels on devices {s['devices']}, NCCL "
                               f"kernels: {nccl}; {s['nvtx_ranges']} NVTX ranges, most common: {top}")


def _reduction(paced: Paced) -> str:
    """The profile's ``meta["reduction"]`` (:func:`load`, :func:`load_ddp`)."""
    return f"{paced.describe('iteration')}; communication: median over iterations per rank, max over ranks"


def _bucket_times(ranges: list[BucketRange], pids: list[int | None], n: int, links: list[str],
                  source: str) -> tuple[list[BucketTimes], Paced]:
    """Each bucket's forward, backward and per-link comm time, and how the compute was reduced.
    Forward and backward: at the ranks' pace (:func:`deft.profiler.pace.paced_ranks`) of the ranks that
    recorded compute ranges, from the time charged per rank, iteration and bucket (:func:`_compute_steps`;
    a bucket without a range there counts 0) and, where the ranks hold no iteration in common, its median
    over the rank's iterations. Comm: per rank the median over iterations, then the maximum over ranks,
    since the slowest rank gates a synchronous all-reduce. Every bucket must have a comm range on every
    link."""

    def per_rank(pid: int | None, kind: str, b: int, link: str | None = None) -> float | None:
        per_it: dict[int, float] = defaultdict(float)
        for r in ranges:
            if r.pid == pid and r.kind == kind and r.bucket == b and (link is None or r.link == link):
                per_it[r.iteration] += r.seconds
        return median(list(per_it.values())) if per_it else None

    def comm_max(b: int, link: str) -> float | None:
        vals = [v for v in (per_rank(p, "comm", b, link) for p in pids) if v is not None]
        return max(vals) if vals else None

    computing = [p for p in pids if any(r.pid == p and r.kind in ("fwd", "bwd") for r in ranges)]
    paced = Paced([0.0] * n, [0.0] * n, [], 0)
    if computing:
        paced = paced_ranks([_compute_steps(ranges, p, "fwd", n) for p in computing],
                            [_compute_steps(ranges, p, "bwd", n) for p in computing],
                            [[per_rank(p, "fwd", b) or 0.0 for b in range(n)] for p in computing],
                            [[per_rank(p, "bwd", b) or 0.0 for b in range(n)] for p in computing])
    fwd, bwd = paced.forward_s, paced.backward_s
    times, missing = [], []
    for b in range(n):
        comm = {lk: v for lk in links if (v := comm_max(b, lk)) is not None}
        if set(comm) != set(links):
            missing.append(b)
        times.append(BucketTimes(forward_s=fwd[b], backward_s=bwd[b], comm_s=comm))
    if missing:
        raise TraceError(source, f"buckets {missing} have no deft/comm range on every link ({', '.join(links)})")
    return times, paced


def _compute_steps(ranges: list[BucketRange], pid: int | None, kind: str, n: int) -> dict[int, list[float]]:
    """Rank ``pid``'s ``kind`` ("fwd" or "bwd") seconds per iteration and bucket: per iteration in which
    the rank recorded a forward or backward range, each of the ``n`` buckets' charged time summed over
    its ranges of that kind (0 where it has none)."""
    its = {r.iteration for r in ranges if r.pid == pid and r.kind in ("fwd", "bwd")}
    out = {i: [0.0] * n for i in sorted(its)}
    for r in ranges:
        if r.pid == pid and r.kind == kind:
            out[r.iteration][r.bucket] += r.seconds
    return out


# -- a plain torch DDP export: the paper's four-step walk (Fig. 8) -------------------------------------------
#: torch's autograd NVTX range text (``torch.autograd.profiler.emit_nvtx``): ``name[, seq = N][, op_id = M]
#: [, sizes = [[...], ...]][, input_op_ids = ...]``.
_OP_TEXT_RE = re.compile(r"(?P<name>[^,]+)(?:, seq = (?P<seq>\d+))?(?:, op_id = (?P<op>\d+))?")
_SIZES_RE = re.compile(r", sizes = \[\[([0-9, ]*)\]")
#: NCCL kernel names carry the element type: ``ncclDevKernel_AllReduce_Sum_f32_RING_LL``.
_NCCL_DTYPE_RE = re.compile(r"_(bf16|f16|f32|f64|f8e4m3|f8e5m2|i8|u8|i32|u32|i64|u64)(?:_|\(|$)")
NCCL_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "f8e4m3": 1, "f8e5m2": 1, "i8": 1, "u8": 1,
                    "i32": 4, "u32": 4, "i64": 8, "u64": 8}
#: The CPU operators that launch a collective: torch's c10d op, its comms record, NCCL's own API ranges.
_COMM_OPERATOR_PREFIXES = ("c10d::", "record_param_comms", "nccl:", "nccl")


@dataclass(frozen=True)
class OpRange:
    """One NVTX range in torch's autograd-NVTX format; ``seq`` links a forward operator to the backward
    node it created (the backward node's range carries the same ``seq``)."""

    pid: int | None
    tid: int | None
    name: str
    seq: int | None
    op_id: int | None
    start_ns: int
    end_ns: int
    sizes: tuple[int, ...] | None  # the first input's shape, when shapes were recorded


def op_ranges(path: str | Path | Export) -> list[OpRange]:
    """Every closed NVTX range parsed as an operator (deft's own ranges excluded), by start time."""
    out = []
    for r in nvtx_ranges(path):
        if r.end_ns is None or r.deft is not None or not r.text:
            continue
        m = _OP_TEXT_RE.match(r.text)
        if m is None:
            continue
        sz = _SIZES_RE.search(r.text)
        sizes = tuple(int(x) for x in sz[1].split(",") if x.strip()) if sz else None
        out.append(OpRange(r.pid, r.tid, m["name"].strip(), int(m["seq"]) if m["seq"] else None,
                           int(m["op"]) if m["op"] else None, r.start_ns, r.end_ns, sizes))
    return out


@dataclass(frozen=True)
class CommOp:
    """One collective as the GPU ran it: its NCCL kernel(s), joined to the CPU thread that launched them.

    The join is nsys' form of Kineto's External id: a kernel and its launching runtime call share
    ``(correlationId, pid)``; kernels launched inside one communication operator range (``c10d::...``,
    ``record_param_comms``, ``nccl:...``, NCCL's ``ncclAllReduce``) are one collective."""

    pid: int | None
    tid: int | None
    op: str              # AllReduce, SendRecv, ...
    launch_ns: int       # the first kernel's launch (the runtime call)
    start_ns: int        # GPU span of its kernels
    end_ns: int
    operator: str | None  # the outermost communication operator range around the launch
    numel: int | None     # from that operator's recorded sizes, when shapes were recorded
    dtype_bytes: int | None  # from the NCCL kernel's name

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


def comm_ops(path: str | Path | Export) -> list[CommOp]:
    """Every collective of the export, by launch time (step 1 of the walk: the communication operators)."""
    ex, own = _open(path)
    try:
        if not ex.has("CUPTI_ACTIVITY_KIND_KERNEL"):
            return []
        comm_ranges: dict[tuple[int | None, int | None], list[OpRange]] = defaultdict(list)
        for o in op_ranges(ex):
            if o.name.startswith(_COMM_OPERATOR_PREFIXES):
                comm_ranges[(o.pid, o.tid)].append(o)
        groups: dict[tuple[object, ...], list[Kernel]] = defaultdict(list)
        outer: dict[tuple[object, ...], OpRange | None] = {}
        for k in kernels(ex):
            if k.nccl_op is None:
                continue
            around = [o for o in comm_ranges.get((k.pid, k.launch_tid), ())
                      if k.launch_ns is not None and o.start_ns <= k.launch_ns <= o.end_ns]
            top = min(around, key=lambda o: o.start_ns) if around else None
            key: tuple[object, ...] = ((k.pid, k.launch_tid, top.start_ns, top.name) if top is not None
                                       else (k.pid, "corr", k.correlation, k.start_ns))
            groups[key].append(k)
            outer[key] = top
        out = []
        for key, ks in groups.items():
            top = outer[key]
            numel = None
            if top is not None:
                shaped = [o.sizes for o in comm_ranges[(top.pid, top.tid)]
                          if o.sizes and top.start_ns <= o.start_ns <= top.end_ns]
                if shaped:
                    numel = 1
                    for d in shaped[0]:
                        numel *= d
            dt = _NCCL_DTYPE_RE.search(ks[0].name)
            launches = [k.launch_ns for k in ks if k.launch_ns is not None]
            out.append(CommOp(ks[0].pid, ks[0].launch_tid, ks[0].nccl_op or "?",
                              min(launches) if launches else min(k.start_ns for k in ks),
                              min(k.start_ns for k in ks), max(k.end_ns for k in ks),
                              top.name if top is not None else None, numel,
                              NCCL_DTYPE_BYTES.get(dt[1]) if dt else None))
        return sorted(out, key=lambda c: c.launch_ns)
    finally:
        if own:
            ex.close()


@dataclass(frozen=True)
class DdpBucketStep:
    """One bucket of one iteration of one rank of a plain torch DDP export (seconds)."""

    pid: int | None
    iteration: int
    bucket: int
    numel: int | None
    nbytes: int | None
    forward_s: float | None  # None: the export has no autograd NVTX ranges to walk to the forward
    backward_s: float
    comm_s: float


def ddp_bucket_steps(path: str | Path | Export) -> list[DdpBucketStep]:
    """The paper's four-step walk (Fig. 8) over a plain torch DDP export; see :func:`load_ddp`."""
    ex, own = _open(path)
    try:
        comms = [c for c in comm_ops(ex) if c.op == "AllReduce" and c.launch_ns is not None]
        ks = [k for k in kernels(ex) if k.launch_ns is not None]
        ops = [o for o in op_ranges(ex) if o.seq is not None]
    finally:
        if own:
            ex.close()
    out: list[DdpBucketStep] = []
    for pid in sorted({c.pid for c in comms}, key=lambda p: -1 if p is None else p):
        out.extend(_ddp_rank(pid, [c for c in comms if c.pid == pid], [k for k in ks if k.pid == pid],
                             [o for o in ops if o.pid == pid]))
    return out


def _ddp_rank(pid: int | None, comms: list[CommOp], ks: list[Kernel], ops: list[OpRange]) -> list[DdpBucketStep]:
    """One rank's iterations. The backward thread is the one that launches the all-reduces (DDP's reducer
    runs in the autograd engine's device thread); every other thread of the process is the forward side.
    A new iteration begins at an all-reduce launched after a kernel launch of the forward side (the
    forward and the optimizer step run between two backwards; nothing of the forward side is launched
    while the backward runs)."""
    bwd_tid = Counter(c.tid for c in comms).most_common(1)[0][0]
    compute = sorted((k for k in ks if k.nccl_op is None), key=lambda k: k.launch_ns or 0)
    bwd_k = [k for k in compute if k.launch_tid == bwd_tid]
    fwd_k = [k for k in compute if k.launch_tid != bwd_tid]
    fwd_launch = [k.launch_ns or 0 for k in fwd_k]
    iters = _split_iterations(comms, fwd_launch)
    fwd_by_seq: dict[int, OpRange] = {}
    for o in ops:
        if o.tid != bwd_tid and o.seq is not None:
            fwd_by_seq[o.seq] = o  # the last-starting forward operator with this seq created the node
    bwd_ops = [o for o in ops if o.tid == bwd_tid]
    fwd_ops = [o for o in ops if o.tid != bwd_tid]
    out = []
    last_comm = None
    for it, cs in enumerate(iters):
        # where this iteration's backward begins: after the forward side's last launch before it
        i = bisect.bisect_left(fwd_launch, cs[0].launch_ns)
        fwd_end_launch = fwd_launch[i - 1] if i > 0 else None
        lo = max(x for x in (fwd_end_launch, last_comm, -1) if x is not None)
        last_comm = cs[-1].launch_ns
        mine = [k for k in bwd_k if lo < (k.launch_ns or 0) <= cs[-1].launch_ns]
        if not mine:
            continue
        ready = _ready_points(cs, mine)
        starts = _forward_starts(cs, lo, bwd_ops, fwd_by_seq, fwd_k)
        window = (_prev(iters, it) if it > 0 else None, fwd_end_launch)  # this iteration's forward side
        f_end = max((k.end_ns for k in fwd_k if _within(k.launch_ns or 0, window)), default=None)
        first = [o for o in fwd_ops if _within(o.start_ns, window)]
        if first and starts:  # the first bucket to run forward (the last one) starts with the forward
            starts[-1] = _first_kernel_start(fwd_k, min(first, key=lambda o: o.start_ns))
        fwd_known = f_end is not None and all(s is not None for s in starts)
        for b, c in enumerate(cs):
            fwd = None
            if fwd_known:
                # f_{n-1} < ... < f_0 < f_{-1} = f_end: bucket b's forward is [f_b, f_{b-1}]
                hi = starts[b - 1] if b > 0 else f_end
                fwd = max(0, (hi or 0) - (starts[b] or 0)) * NS
            out.append(DdpBucketStep(pid, it, b, c.numel,
                                     c.numel * c.dtype_bytes if c.numel is not None and c.dtype_bytes else None,
                                     fwd, (ready[b] - (ready[b - 1] if b else min(k.start_ns for k in mine))) * NS,
                                     c.dur_ns * NS))
    return out


def _split_iterations(comms: list[CommOp], fwd_launch: list[int]) -> list[list[CommOp]]:
    """The all-reduces grouped by iteration: a new one begins at an all-reduce launched after a launch
    of the forward side (``fwd_launch``, sorted) that came after the previous all-reduce."""
    iters: list[list[CommOp]] = []
    for c in comms:
        prev = iters[-1][-1].launch_ns if iters else None
        if prev is None or bisect.bisect_left(fwd_launch, c.launch_ns) > bisect.bisect_right(fwd_launch, prev):
            iters.append([c])
        else:
            iters[-1].append(c)
    return iters


def _ready_points(cs: list[CommOp], mine: list[Kernel]) -> list[int]:
    """Steps 1-2 of the walk: the all-reduce's launch -> the backward thread's last kernel before it -> its
    end on the compute stream is the bucket's ready point ``r_b`` (never before ``r_{b-1}``; ``mine``: the
    iteration's backward kernels, not empty)."""
    r_prev = min(k.start_ns for k in mine)
    ready = []
    for c in cs:
        before = [k.end_ns for k in mine if (k.launch_ns or 0) <= c.launch_ns]
        r = max(before) if before else r_prev
        ready.append(max(r, r_prev))
        r_prev = ready[-1]
    return ready


def _forward_starts(cs: list[CommOp], lo: int, bwd_ops: list[OpRange], fwd_by_seq: dict[int, OpRange],
                    fwd_k: list[Kernel]) -> list[int | None]:
    """Steps 3-4 of the walk: the last backward operator of bucket ``b`` (by seq) -> its forward operator,
    the first forward operator of bucket ``b`` -> the first kernel it launched is where ``b``'s forward
    begins (``None`` where no operator or kernel is found)."""
    starts: list[int | None] = []
    prev_launch = lo
    for c in cs:
        cand = [o for o in bwd_ops if prev_launch < o.start_ns <= c.launch_ns and o.seq in fwd_by_seq]
        prev_launch = c.launch_ns
        f_op = fwd_by_seq[max(cand, key=lambda o: o.start_ns).seq or 0] if cand else None
        starts.append(None if f_op is None else _first_kernel_start(fwd_k, f_op))
    return starts


def _prev(iters: list[list[CommOp]], it: int) -> int | None:
    """The last all-reduce launch of the iteration before ``it`` (None for the first)."""
    return iters[it - 1][-1].launch_ns if it > 0 else None


def _within(t: int, window: tuple[int | None, int | None]) -> bool:
    """``lo < t <= hi``; a missing ``lo`` is open, a missing ``hi`` matches nothing."""
    lo, hi = window
    return hi is not None and t <= hi and (lo is None or t > lo)


def _first_kernel_start(fwd_k: list[Kernel], op: OpRange) -> int | None:
    """The GPU start of the first kernel ``op``'s thread launched at or after ``op`` began."""
    after = [k.start_ns for k in fwd_k if k.launch_tid == op.tid and (k.launch_ns or 0) >= op.start_ns]
    return min(after) if after else None


def load_ddp(path: str | Path | Export, world_size: int | None = None) -> Profile:
    """A :class:`deft.Profile` (source ``"nsys"``, one NCCL link ``primary``) from a plain torch DDP export.

    The paper's walk (Fig. 8), per rank and iteration, with nsys' tables (module docstring of
    :mod:`deft.profiler.nsys`; capture with ``--trace=cuda,nvtx`` and torch's autograd NVTX ranges,
    ``torch.autograd.profiler.emit_nvtx()``, which give the forward-backward links):

    1. the communication operators: every NCCL all-reduce kernel joined to its launch on
       ``(correlationId, pid)``; bucket ``b`` is the ``b``-th all-reduce of an iteration's backward;
    2. the last kernel the backward thread launched before that launch: its end on the compute stream
       is bucket ``b``'s ready point ``r_b`` (``backward_b = r_b - r_{b-1}``, ``r_{-1}`` the backward's
       first kernel start);
    3. the last backward operator before the launch carries the ``seq`` of the forward operator that
       created it: the first forward operator of bucket ``b``;
    4. the first kernel that forward operator launched starts bucket ``b``'s forward on the compute
       stream; bucket ``b``'s forward ends where bucket ``b - 1``'s starts (bucket 0's at the end of
       the forward), and the last bucket's starts with the forward's first operator.

    ``comm_b`` is the all-reduce kernel's GPU span. Iterations whose bucket count (and sizes, when
    shapes were recorded) differ from the most common one are left out (DDP rebuilds its buckets after
    the first iteration). Over ranks, as in :func:`load`: forward and backward go at the ranks' pace per
    iteration on the iterations (by index) that every rank kept, else at the slowest rank's total of its
    medians over iterations; comm is the maximum over ranks of their medians over iterations.
    """
    ex, own = _open(path)
    try:
        steps = ddp_bucket_steps(ex)
        name = Path(ex.path).name
        source = ex.path
    finally:
        if own:
            ex.close()
    if not steps:
        raise TraceError(source, "has NCCL all-reduce kernels but no backward compute kernels launched by their "
                                 "thread: not a torch DDP training run")
    per_iter, kept = _common_shape_iterations(steps)
    if any(s.forward_s is None for v in kept.values() for s in v):
        raise TraceError(source, "a torch DDP export without torch's autograd NVTX ranges ('aten::..., seq = N' "
                                 "and the backward nodes' 'seq = N'): the forward of a bucket cannot be found. "
                                 "Capture with torch.autograd.profiler.emit_nvtx() around the training loop "
                                 "and `nsys profile --trace=cuda,nvtx`")
    pids = sorted({p for p, _ in kept}, key=lambda p: -1 if p is None else p)
    times, paced = _reduced_times(kept, pids)
    first = next(iter(kept.values()))
    sizes_known = all(s.numel is not None and s.nbytes is not None for s in first)
    buckets = tuple(Bucket(id=b, params=(f"<unknown: bucket {b} of the nsys export>",), numel=s.numel or 0,
                           nbytes=s.nbytes or 0) for b, s in enumerate(first))
    return Profile(
        buckets=buckets, times=times, links=(Link(name="primary", backend="nccl"),),
        world_size=world_size or max(1, len(pids)), source="nsys", model=name,
        meta={"export": source, "ranks_pids": pids, "walk": "torch DDP (paper Fig. 8)",
              "iterations": sorted({i for _, i in kept}), "dropped_iterations": len(per_iter) - len(kept),
              "reduction": _reduction(paced), "params_known": False,
              "sizes_known": sizes_known,
              "note": "bucket b is the b-th all-reduce of the backward; sizes from the c10d operators' recorded "
                      "shapes and the NCCL kernels' dtype" + ("" if sizes_known else
                                                                " (not recorded: numel/nbytes 0)")},
    )


_StepsByIteration = dict[tuple[int | None, int], list[DdpBucketStep]]


def _common_shape_iterations(steps: list[DdpBucketStep]) -> tuple[_StepsByIteration, _StepsByIteration]:
    """Every (rank, iteration)'s buckets, and those whose bucket sizes are the most common ones (DDP
    rebuilds its buckets after the first iteration)."""
    per_iter: _StepsByIteration = defaultdict(list)
    for s in steps:
        per_iter[(s.pid, s.iteration)].append(s)
    shape = Counter(tuple(s.numel for s in v) for v in per_iter.values()).most_common(1)[0][0]
    kept = {key: v for key, v in per_iter.items() if tuple(s.numel for s in v) == shape}
    return per_iter, kept


def _reduced_times(kept: _StepsByIteration, pids: list[int | None]) -> tuple[tuple[BucketTimes, ...], Paced]:
    """Each bucket's times, and how the compute was reduced: forward and backward at the ranks' pace
    (:func:`deft.profiler.pace.paced_ranks`: per iteration on the iterations every rank kept, else from
    each rank's medians over its iterations), comm the maximum over ranks of their medians over
    iterations. Every rank in ``pids`` has kept iterations, each with every bucket."""

    def per_rank(p: int | None, b: int, get: str) -> float:
        return median([getattr(v[b], get) for (q, _), v in kept.items() if q == p])

    def steps(p: int | None, get: str) -> dict[int, list[float]]:
        return {i: [getattr(s, get) for s in v] for (q, i), v in kept.items() if q == p}

    n = len(next(iter(kept.values())))
    paced = paced_ranks([steps(p, "forward_s") for p in pids], [steps(p, "backward_s") for p in pids],
                        [[per_rank(p, b, "forward_s") for b in range(n)] for p in pids],
                        [[per_rank(p, b, "backward_s") for b in range(n)] for p in pids])
    fwd, bwd = paced.forward_s, paced.backward_s
    return tuple(BucketTimes(forward_s=fwd[b], backward_s=bwd[b],
                             comm_s={"primary": max(per_rank(p, b, "comm_s") for p in pids)})
                 for b in range(n)), paced


# -- command line -----------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deft.profiler.nsys EXPORT.sqlite``: summary, NCCL activity, NVTX ranges, the profile."""
    ap = argparse.ArgumentParser(prog="python -m deft.profiler.nsys", description=main.__doc__)
    ap.add_argument("export")
    ap.add_argument("--limit", type=int, default=15, help="rows per table")
    ap.add_argument("--out", help="write the profile JSON here (needs deft ranges)")
    args = ap.parse_args(argv)
    try:
        with Export(args.export) as ex:
            for k, v in summary(ex).items():
                print(f"{k}: {v}")
            print("\n# NCCL activity")
            print(format_table(nccl_activity(ex)[: args.limit], ["source", "pid", "where", "op", "start_ns", "dur_ns"]))
            print("\n# NVTX ranges")
            print(format_table(nvtx_ranges(ex)[: args.limit], ["pid", "tid", "kind", "start_ns", "dur_ns", "text"]))
        prof = load(args.export)
    except TraceError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    for b, t in zip(prof.buckets, prof.times, strict=True):
        print(b.id, b.numel, t.forward_s, t.backward_s, t.comm_s)
    if args.out:
        prof.save(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
