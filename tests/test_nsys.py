"""Nsight Systems SQLite exports -> kernels, NVTX ranges, NCCL activity, and a deft Profile."""

from __future__ import annotations

import sqlite3
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from deft import Profile, TraceError
from deft.profiler import nsys
from deft.profiler.nvtx import RangeName, format_range_name, layout_name
from tests._fixtures import fixture_path

# The schema of the tables deft reads, copied from the real export's sqlite_master (nsys 2026.2,
# export schema 3.25.0), comments dropped.
SCHEMA = [
    "CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE PROCESSES (globalPid INTEGER, pid INTEGER, name TEXT)",
    "CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT)",
    "CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER "
    "NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL, "
    "callchainId INTEGER)",
    "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT "
    "NULL, contextId INTEGER NOT NULL, greenContextId INTEGER, streamId INTEGER NOT NULL, correlationId INTEGER, "
    "globalPid INTEGER, demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, mangledName INTEGER, launchType "
    "INTEGER, cacheConfig INTEGER, registersPerThread INTEGER NOT NULL, gridX INTEGER NOT NULL, gridY INTEGER NOT "
    "NULL, gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL, blockY INTEGER NOT NULL, blockZ INTEGER NOT NULL, "
    "staticSharedMemory INTEGER NOT NULL, dynamicSharedMemory INTEGER NOT NULL, localMemoryPerThread INTEGER NOT "
    "NULL, localMemoryTotal INTEGER NOT NULL, gridId INTEGER NOT NULL, sharedMemoryExecuted INTEGER, graphNodeId "
    "INTEGER, sharedMemoryLimitConfig INTEGER, qmdBulkReleaseDone INTEGER, qmdPreexitDone INTEGER, qmdLastCtaDone "
    "INTEGER, graphId INTEGER, clusterX INTEGER, clusterY INTEGER, clusterZ INTEGER, clusterSchedulingPolicy "
    "INTEGER, maxPotentialClusterSize INTEGER, maxActiveClusters INTEGER, sharedMemoryRequestedPercentage INTEGER, "
    "tensorSizeMinusOneElements TEXT NOT NULL)",
    "CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER, "
    "category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER, domainId "
    "INTEGER, uint64Value INTEGER, int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER, "
    "floatValue REAL, jsonTextId INTEGER, jsonText TEXT, binaryData TEXT)",
]


@pytest.fixture(scope="module")
def sendrecv() -> Path:
    return fixture_path("nsys_2gpu_sendrecv.sqlite")


@pytest.fixture(scope="module")
def sql(sendrecv: Path) -> Iterator[sqlite3.Connection]:
    """The fixture opened read-only: expected counts come from SQL on the tables, not from the parser."""
    db = sqlite3.connect(f"file:{sendrecv}?mode=ro", uri=True)
    try:
        yield db
    finally:
        db.close()


def one(db: sqlite3.Connection, query: str) -> int:
    return int(db.execute(query).fetchone()[0])


PID = "((globalPid >> 24) & 16777215)"  # nsys' GlobalId: pid in bits 24..47
KERNEL_NAME = "(SELECT value FROM StringIds WHERE id = k.shortName)"
NVTX_TEXT = "COALESCE(n.text, (SELECT value FROM StringIds WHERE id = n.textId))"


# -- the real export --------------------------------------------------------------------------------------
def test_fixture_summary(sendrecv: Path, sql: sqlite3.Connection) -> None:
    s = nsys.summary(sendrecv)
    assert s["kernels"] == one(sql, "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL") == 4010
    assert s["devices"] == [d for (d,) in sql.execute(
        "SELECT DISTINCT deviceId FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY deviceId")] == [0, 1]
    assert set(s["gpu_processes"]) == {p for (p,) in sql.execute(
        f"SELECT DISTINCT {PID} FROM CUPTI_ACTIVITY_KIND_KERNEL")} == {144, 145}
    sendrecv_kernels = one(sql, f"SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                                f"WHERE {KERNEL_NAME} LIKE 'ncclDevKernel_SendRecv%'")
    all_nccl = one(sql, f"SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k WHERE {KERNEL_NAME} LIKE 'nccl%'")
    assert s["nccl_kernels"] == {"SendRecv": sendrecv_kernels} and sendrecv_kernels == all_nccl == 66
    # the export has push/pop ranges only (eventType 59), all closed
    assert s["nvtx_ranges"] == one(sql, "SELECT COUNT(*) FROM NVTX_EVENTS WHERE eventType IN (59, 60) "
                                        "AND end IS NOT NULL") == 19118
    assert s["deft_ranges"] == one(sql, f"SELECT COUNT(*) FROM NVTX_EVENTS n WHERE {NVTX_TEXT} LIKE 'deft/%'") == 0
    assert s["nsys_version"] == sql.execute(
        "SELECT value FROM META_DATA_EXPORT WHERE name = 'EXPORT_PRODUCT_VERSION'").fetchone()[0] == "2026.2.1.210"


@pytest.mark.slow
def test_fixture_kernels_join_their_launch_in_the_same_process(sendrecv: Path, sql: sqlite3.Connection) -> None:
    ks = nsys.kernels(sendrecv)
    assert len(ks) == one(sql, "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL")
    joined = [k for k in ks if k.launch_api is not None]
    launched = one(sql, "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k WHERE EXISTS (SELECT 1 FROM "
                        "CUPTI_ACTIVITY_KIND_RUNTIME r WHERE r.correlationId = k.correlationId AND "
                        "((r.globalTid >> 24) & 16777215) = ((k.globalPid >> 24) & 16777215))")
    # the others were launched before the exported window: their correlation id (increasing per process)
    # is below that of their process's first recorded runtime call
    before_window = one(sql, "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k WHERE k.correlationId < "
                             "(SELECT MIN(correlationId) FROM CUPTI_ACTIVITY_KIND_RUNTIME r WHERE r.correlationId > 0 "
                             "AND ((r.globalTid >> 24) & 16777215) = ((k.globalPid >> 24) & 16777215))")
    assert len(joined) == launched == 3986 and len(ks) - launched == before_window == 24
    for k in joined:
        assert "Launch" in k.launch_api, k.launch_api
        assert k.launch_ns <= k.start_ns  # a kernel runs after its launch, never before
        assert k.launch_tid is not None
    nccl = [k for k in ks if k.nccl_op is not None]
    assert len(nccl) == 66 and all(k.name.startswith("ncclDevKernel_SendRecv") for k in nccl)
    by_process = sorted(sql.execute(f"SELECT {PID}, deviceId, COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                                    f"WHERE {KERNEL_NAME} LIKE 'nccl%' GROUP BY 1, 2"))
    assert by_process == [(144, 0, 33), (145, 1, 33)]
    assert sorted({(k.pid, k.device) for k in nccl}) == [(p, d) for p, d, _ in by_process]


def test_fixture_nvtx_and_nccl_activity(sendrecv: Path, sql: sqlite3.Connection) -> None:
    rs = nsys.nvtx_ranges(sendrecv)
    assert len(rs) == one(sql, "SELECT COUNT(*) FROM NVTX_EVENTS WHERE eventType IN (34, 59, 60)") == 19118
    assert all(r.text for r in rs)
    # NCCL's own ranges use registered strings (textId -> StringIds)
    n_send = one(sql, f"SELECT COUNT(*) FROM NVTX_EVENTS n WHERE eventType IN (59, 60) AND {NVTX_TEXT} = 'ncclSend'")
    assert sum(1 for r in rs if r.text == "ncclSend") == n_send == 132
    assert all(r.end_ns >= r.start_ns for r in rs)
    act = nsys.nccl_activity(sendrecv)
    assert sum(1 for a in act if a.source == "kernel") == 66
    ops = {t for (t,) in sql.execute(f"SELECT DISTINCT {NVTX_TEXT} FROM NVTX_EVENTS n WHERE {NVTX_TEXT} LIKE 'nccl%'")}
    assert {a.op for a in act if a.source == "nvtx"} == {t.split(",")[0] for t in ops}
    assert {"ncclSend", "ncclRecv", "ncclGroupStart"} <= {t.split(",")[0] for t in ops}


def test_fixture_load_says_what_is_missing(sendrecv: Path) -> None:
    with pytest.raises(TraceError) as ei:
        nsys.load(sendrecv)
    msg = str(ei.value)
    # the counts are the ones test_fixture_summary derives by SQL
    assert str(sendrecv) in msg and "holds no deft bucket ranges" in msg
    assert "4010 kernels" in msg and "SendRecv x66" in msg and "19118 NVTX ranges" in msg


def test_cli_on_fixture(sendrecv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert nsys.main([str(sendrecv), "--limit", "3"]) == 2
    cap = capsys.readouterr()
    assert "nccl_kernels: {'SendRecv': 66}" in cap.out and "no deft bucket ranges" in cap.err


# -- synthetic exports --------------------------------------------------------------------------------------
class Builder:
    """Writes an nsys-schema SQLite file row by row (times given in microseconds, stored in ns)."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path)
        for stmt in SCHEMA:
            self.db.execute(stmt)
        self.db.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_PRODUCT_VERSION', 'synthetic')")
        self.ids: dict[str, int] = {}

    def string(self, s: str) -> int:
        if s not in self.ids:
            self.ids[s] = len(self.ids) + 1
            self.db.execute("INSERT INTO StringIds VALUES (?, ?)", (self.ids[s], s))
        return self.ids[s]

    @staticmethod
    def gpid(pid: int) -> int:
        return (1 << 48) | (pid << 24)

    def process(self, pid: int) -> None:
        self.db.execute("INSERT INTO PROCESSES VALUES (?, ?, 'python3')", (self.gpid(pid), pid))

    def launch(self, pid: int, t_us: float, corr: int, api: str = "cudaLaunchKernel_v7000") -> None:
        self.db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, ?, 0, NULL)",
                        (int(t_us * 1e3), int(t_us * 1e3) + 3000, self.gpid(pid) | pid, corr, self.string(api)))

    def kernel(self, pid: int, stream: int, start_us: float, end_us: float, corr: int, name: str) -> None:
        sid = self.string(name)
        self.db.execute(
            "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, correlationId, "
            "globalPid, demangledName, shortName, registersPerThread, gridX, gridY, gridZ, blockX, blockY, blockZ, "
            "staticSharedMemory, dynamicSharedMemory, localMemoryPerThread, localMemoryTotal, gridId, "
            "tensorSizeMinusOneElements) "
            "VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, 32, 1, 1, 1, 128, 1, 1, 0, 0, 0, 0, 0, '[]')",
            (int(start_us * 1e3), int(end_us * 1e3), pid - 100, stream, corr, self.gpid(pid), sid, sid))

    def nvtx(self, pid: int, start_us: float, end_us: float | None, text: str, event_type: int = 59,
             registered: bool = False) -> None:
        self.db.execute(
            "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId, domainId) "
            "VALUES (?, ?, ?, ?, ?, ?, 0)",
            (int(start_us * 1e3), None if end_us is None else int(end_us * 1e3), event_type,
             None if registered else text, self.gpid(pid) | pid, self.string(text) if registered else None))

    def close(self) -> None:
        self.db.commit()
        self.db.close()


COMPUTE = "void at::native::vectorized_elementwise_kernel<4>"
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096>)"
COMM0 = {100: 300.0, 101: 330.0}   # primary all-reduce of bucket 0 on each rank (us), +5 us per iteration
COMM1 = {100: 400.0, 101: 380.0}   # bucket 1: rank 100 grows +5 us per iteration, rank 101 constant


def build_deft_export(path: Path, iterations: int = 3, *, kernels_table: bool = True) -> Path:
    """Two ranks, two buckets, two links ("primary": NCCL kernels; "second": gloo, CPU ranges only).

    Correlation ids restart in every process (as in real exports), so a join that ignores the
    process would attribute rank 101's kernels to rank 100's launches.
    """
    b = Builder(path)
    if not kernels_table:
        b.db.execute("DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL")
    for pid in (100, 101):
        b.process(pid)
        b.nvtx(pid, 1.0, None, layout_name(0, 2049000, 8196000), event_type=34)
        b.nvtx(pid, 1.0, None, layout_name(1, 7875584, 31502336), event_type=34)
        b.nvtx(pid, 2.0, 3.0, "aten::mm, op_id = 7")  # not ours
        for it in range(iterations):
            t, d, corr = 10_000.0 * (it + 1), 10.0 * it, 1000 * it

            def k(launch: float, start: float, end: float, name: str = COMPUTE, stream: int = 7,
                  api: str = "cudaLaunchKernel_v7000", *, _t: float = t, _pid: int = pid) -> None:
                nonlocal corr
                corr += 1
                b.launch(_pid, _t + launch, corr, api)
                if kernels_table:
                    b.kernel(_pid, stream, _t + start, _t + end, corr, name)

            fmt = format_range_name
            b.nvtx(pid, t + 0, t + 100, fmt("fwd", 1, it))
            k(10, 50, 250)
            k(60, 250, 400 + d)                                   # fwd b1 GPU span: 350 + 10*it
            b.nvtx(pid, t + 100, t + 150, fmt("fwd", 0, it))
            k(110, 400 + d, 500 + d)                              # fwd b0: 100
            b.nvtx(pid, t + 200, t + 260, fmt("bwd", 0, it))
            k(210, 520 + d, 720 + d)                              # bwd b0: 200
            c0 = COMM0[pid] + 5 * it
            b.nvtx(pid, t + 260, t + 270, fmt("comm", 0, it, "primary", it))
            k(262, 720 + d, 720 + d + c0, ALLREDUCE, 20, "cuLaunchKernelEx")
            b.nvtx(pid, t + 270, t + (290 if pid == 100 else 300), fmt("comm", 0, it, "second", it))
            b.nvtx(pid, t + 300, t + 380, fmt("bwd", 1, it), registered=True)
            k(310, 730 + d, 1030 + d)                             # bwd b1: 300
            c1 = COMM1[pid] + (5 * it if pid == 100 else 0)
            b.nvtx(pid, t + 380, t + 390, fmt("comm", 1, it, "primary", it), event_type=60)
            k(382, 1030 + d, 1030 + d + c1, ALLREDUCE, 20, "cuLaunchKernelEx")
            b.nvtx(pid, t + 390, t + 400, fmt("comm", 1, it, "second", it))
            k(500, 1500, 1600)                                    # outside every deft range
    b.close()
    return path


def test_synthetic_tables(tmp_path: Path) -> None:
    p = build_deft_export(tmp_path / "deft.sqlite")
    ks = nsys.kernels(p)
    assert len(ks) == 2 * 3 * 8 and all(k.launch_api is not None and k.launch_ns <= k.start_ns for k in ks)
    assert sum(1 for k in ks if k.nccl_op == "AllReduce") == 12
    rs = nsys.nvtx_ranges(p)
    assert RangeName("bwd", 1, 2) in {r.deft for r in rs}            # registered string resolved
    assert any(r.kind == "start_end" and r.deft == RangeName("comm", 1, 0, "primary", 0) for r in rs)
    assert sum(1 for r in rs if r.kind == "mark") == 4
    brs = nsys.bucket_ranges(p)
    assert {(r.kind, r.link, r.source) for r in brs} == {
        ("fwd", None, "gpu_kernels"), ("bwd", None, "gpu_kernels"), ("comm", "primary", "nccl_kernels"),
        ("comm", "second", "nvtx_cpu")}
    assert nsys.summary(p)["deft_ranges"] == 2 * 3 * 8


def test_synthetic_profile(tmp_path: Path) -> None:
    prof = nsys.load(build_deft_export(tmp_path / "deft.sqlite"))
    assert prof.source == "nsys" and prof.world_size == 2 and prof.n == 2
    assert [(k.name, k.backend) for k in prof.links] == [("primary", "nccl"), ("second", "gloo")]
    assert [(b.numel, b.nbytes) for b in prof.buckets] == [(2049000, 8196000), (7875584, 31502336)]
    us = 1e-6
    t0, t1 = prof.times
    assert t0.forward_s == pytest.approx(100 * us) and t1.forward_s == pytest.approx(360 * us)  # median of 350..370
    assert t0.backward_s == pytest.approx(200 * us) and t1.backward_s == pytest.approx(300 * us)
    # medians over iterations per rank, then the slower rank
    assert t0.comm_s["primary"] == pytest.approx(335 * us)   # rank 101: 330,335,340 > rank 100: 300,305,310
    assert t1.comm_s["primary"] == pytest.approx(405 * us)   # rank 100: 400,405,410 > rank 101: 380
    assert t0.comm_s["second"] == pytest.approx(30 * us) and t1.comm_s["second"] == pytest.approx(10 * us)
    assert prof.meta["sizes_known"] is True
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof


def build_compute_export(path: Path, per_rank: dict[int, tuple[list[float], list[float], list[float]]],
                         iterations: int = 3, *, slow: dict[tuple[int, int], tuple[float, float]] | None = None,
                         first: dict[int, int] | None = None) -> Path:
    """Ranks (pids) with two buckets each, one NCCL link: ``per_rank[pid] = (fwd, bwd, comm)`` gives
    each bucket's forward, backward and all-reduce kernel time (us), the same in every iteration but
    where ``slow[(pid, iteration)] = (s0, s1)`` adds ``s0`` and ``s1`` us to buckets 0's and 1's
    backward. A rank's iterations are numbered from ``first[pid]`` (default 0). Each deft range
    launches one kernel of that length; the kernels run one after another."""
    b = Builder(path)
    for pid, (fwd, bwd, comm) in per_rank.items():
        b.process(pid)
        for it in range((first or {}).get(pid, 0), (first or {}).get(pid, 0) + iterations):
            o, corr = 10_000.0 * (it + 1), 100 * it
            gpu = o + 100  # the GPU timeline of this iteration, after every launch
            s0, s1 = (slow or {}).get((pid, it), (0.0, 0.0))
            for cpu, (kind, bucket, us) in enumerate([("fwd", 1, fwd[1]), ("fwd", 0, fwd[0]),
                                                      ("bwd", 0, bwd[0] + s0), ("comm", 0, comm[0]),
                                                      ("bwd", 1, bwd[1] + s1), ("comm", 1, comm[1])]):
                link = "primary" if kind == "comm" else None
                start = o + 10 * cpu
                b.nvtx(pid, start, start + 10, format_range_name(kind, bucket, it, link, it if link else None))
                corr += 1
                b.launch(pid, start + 1, corr)
                b.kernel(pid, 20 if link else 7, gpu, gpu + us, corr, ALLREDUCE if link else COMPUTE)
                gpu += us + 5
    b.close()
    return path


def test_ranks_stalled_in_different_buckets_are_charged_the_slower_ranks_compute(tmp_path: Path) -> None:
    # Two buckets, forward 100 + 100 us and backward 200 + 200 us on both ranks; rank 100 loses 300 us
    # in bucket 0's backward, rank 101 loses 200 us in bucket 1's. Rank 100 computes 900 us an
    # iteration, rank 101 800; the per-bucket maxima over ranks would charge 100 + 100 + 500 + 400 =
    # 1100, more than either rank spends.
    us = 1e-6
    ranks = {100: ([100.0, 100.0], [500.0, 200.0], [30.0, 40.0]), 101: ([100.0, 100.0], [200.0, 400.0], [50.0, 20.0])}
    prof = nsys.load(build_compute_export(tmp_path / "two.sqlite", ranks))
    assert prof.meta["ranks_pids"] == [100, 101] and "pace" in prof.meta["reduction"]
    fwd = [t.forward_s for t in prof.times]
    bwd = [t.backward_s for t in prof.times]
    assert sum(fwd) + sum(bwd) == pytest.approx(900 * us)
    # the buckets share it as their medians over ranks (of two: the mean): 100, 100, 350, 300 of 850 us
    assert fwd == pytest.approx([100 * 900 / 850 * us, 100 * 900 / 850 * us])
    assert bwd == pytest.approx([350 * 900 / 850 * us, 300 * 900 / 850 * us])
    # communication: the slower rank per bucket
    assert [t.comm_s["primary"] for t in prof.times] == pytest.approx([50 * us, 40 * us])
    # one rank's medians over iterations are taken unchanged (exactly: the pace of one rank is its total)
    alone = build_compute_export(tmp_path / "one.sqlite", {100: ranks[100]})
    one = nsys.load(alone)
    charged = nsys.bucket_ranges(alone)
    for bk, t in enumerate(one.times):
        for kind, got in (("fwd", t.forward_s), ("bwd", t.backward_s)):
            assert got == statistics.median(r.seconds for r in charged if r.kind == kind and r.bucket == bk)
    assert [(t.forward_s, t.backward_s) for t in one.times] == [pytest.approx((100 * us, 500 * us)),
                                                               pytest.approx((100 * us, 200 * us))]


def test_ranks_slow_in_different_iterations_are_paced_per_iteration(tmp_path: Path) -> None:
    # Two buckets, forward 100 + 100 us and backward 200 + 200 us on both ranks in iterations 0, 1, 2;
    # rank 100 loses 400 us in bucket 0's backward in iteration 1, rank 101 400 us in bucket 1's in
    # iteration 2. Per iteration the ranks compute (us) 600, 1000, 600 and 600, 600, 1000; the slower
    # rank per iteration: 600, 1000, 1000, median 1000 (each rank's medians first would give 600). The
    # buckets share it as their medians over ranks: 100, 100, 200, 200 of 600.
    us = 1e-6
    ranks = {100: ([100.0, 100.0], [200.0, 200.0], [30.0, 40.0]), 101: ([100.0, 100.0], [200.0, 200.0], [50.0, 20.0])}
    prof = nsys.load(build_compute_export(tmp_path / "two.sqlite", ranks,
                                          slow={(100, 1): (400.0, 0.0), (101, 2): (0.0, 400.0)}))
    assert [t.forward_s for t in prof.times] == pytest.approx([1000 / 6 * us, 1000 / 6 * us])
    assert [t.backward_s for t in prof.times] == pytest.approx([2000 / 6 * us, 2000 / 6 * us])
    assert [t.comm_s["primary"] for t in prof.times] == pytest.approx([50 * us, 40 * us])
    assert "3 iterations every rank holds" in prof.meta["reduction"]


def test_ranks_without_a_common_iteration_are_paced_by_their_medians(tmp_path: Path) -> None:
    # As above, but rank 101's export holds iterations 3, 4, 5 (slow in 5): no iteration to match, so
    # each rank's medians over its own iterations go first: 100, 100, 200, 200 us on both ranks, the
    # slower rank's total 600 us, the buckets' medians unscaled.
    us = 1e-6
    ranks = {100: ([100.0, 100.0], [200.0, 200.0], [30.0, 40.0]), 101: ([100.0, 100.0], [200.0, 200.0], [50.0, 20.0])}
    prof = nsys.load(build_compute_export(tmp_path / "apart.sqlite", ranks, first={101: 3},
                                          slow={(100, 1): (400.0, 0.0), (101, 5): (0.0, 400.0)}))
    assert [t.forward_s for t in prof.times] == pytest.approx([100 * us, 100 * us])
    assert [t.backward_s for t in prof.times] == pytest.approx([200 * us, 200 * us])
    assert [t.comm_s["primary"] for t in prof.times] == pytest.approx([50 * us, 40 * us])
    assert "no iteration in common" in prof.meta["reduction"] and "paced_medians" in prof.meta["reduction"]


def test_not_sqlite(tmp_path: Path) -> None:
    p = tmp_path / "report.sqlite"
    p.write_text("this is a text file\n")
    with pytest.raises(TraceError, match=r"report\.sqlite: not an SQLite file"):
        nsys.load(p)


def test_sqlite_but_not_nsys(tmp_path: Path) -> None:
    p = tmp_path / "other.sqlite"
    db = sqlite3.connect(p)
    db.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    db.commit()
    db.close()
    with pytest.raises(TraceError, match=r"other\.sqlite: an SQLite file but not an nsys export.*users"):
        nsys.kernels(p)


def test_export_without_kernels(tmp_path: Path) -> None:
    p = build_deft_export(tmp_path / "nokern.sqlite", kernels_table=False)
    with pytest.raises(TraceError, match=r"nokern\.sqlite: export holds no CUDA kernels"):
        nsys.load(p)
    assert len(nsys.nvtx_ranges(p)) > 0  # the NVTX table alone is still readable


def test_missing_export(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such nsys export"):
        nsys.load(tmp_path / "absent.sqlite")
