"""The paper's own profiler path (Fig. 8) on Nsight Systems exports of a plain torch DDP run.

A synthetic export with the real nsys schema (``tests.test_nsys.SCHEMA``) stands for a DDP run with
torch's autograd NVTX ranges: two ranks, a forward (main) thread and the autograd engine's backward
thread, whose DDP reducer launches one NCCL all-reduce per bucket. Expected times are worked out by
hand from the kernels written below. The real fixture (a 2-GPU all-to-all, not DDP) checks the join of
communication operators to their NCCL kernels and the error for an export with no all-reduce.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from deft import TraceError
from deft.profiler import nsys
from tests._fixtures import fixture_path
from tests.test_nsys import ALLREDUCE, COMPUTE, Builder

US = 1e-6
SEQ = {"s2": 500, "s1": 501, "s0": 502, "loss": 503}  # forward order: bucket 1's addmm first
COMM0 = {100: lambda it: 100 + 10 * it, 101: lambda it: 150}
COMM1 = {100: lambda it: 200, 101: lambda it: 180 + 5 * it}


class ThreadBuilder(Builder):
    """:class:`tests.test_nsys.Builder` with a thread id per row (DDP launches from two threads)."""

    def launch_on(self, pid: int, tid: int, t_us: float, corr: int) -> None:
        self.db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, ?, 0, NULL)",
                        (int(t_us * 1e3), int(t_us * 1e3) + 2000, self.gpid(pid) | tid, corr,
                         self.string("cudaLaunchKernel_v7000")))

    def range_on(self, pid: int, tid: int, start_us: float, end_us: float, text: str) -> None:
        self.db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, domainId) "
                        "VALUES (?, ?, 59, ?, ?, 0)", (int(start_us * 1e3), int(end_us * 1e3), text,
                                                      self.gpid(pid) | tid))


def build_ddp_export(path: Path, iterations: int = 4, *, autograd_nvtx: bool = True,
                     stall: dict[int, tuple[float, float]] | None = None,
                     stall_at: dict[tuple[int, int], tuple[float, float]] | None = None) -> Path:
    """Per rank and iteration (times in us from the iteration's origin ``o``; GPU times the same clock):

    forward thread: addmm (seq s2, bucket 1's first op) kernel 50-150, relu 150-180, addmm (s0, bucket
    0's first op) 180-260, loss 260-280. Backward thread: MseLossBackward 300-320, AddmmBackward (s0)
    320-400, bucket 0's copy 400-410, all-reduce 0 launched at o+142; ReluBackward 420-440,
    AddmmBackward (s2) 440-560, copy 560-570, all-reduce 1 launched at o+200; the reducer's final copy
    700-710. Hence forward 1 = 180 - 50 = 130, forward 0 = 280 - 180 = 100, backward 0 = 410 - 300 =
    110, backward 1 = 570 - 410 = 160. Iteration 0 has DDP's first-iteration buckets (other sizes) and
    is left out. ``stall[pid] = (s0, s1)`` lengthens that rank's AddmmBackward kernels (s0: bucket 0's,
    s1: bucket 1's) by ``s0`` and ``s1`` us and delays every later backward-thread kernel by as much, so
    its backward 0 is ``110 + s0`` and backward 1 ``160 + s1``; ``stall_at[(pid, iteration)]`` adds such
    stalls in that iteration only.
    """
    b = ThreadBuilder(path)
    for pid in (100, 101):
        b.process(pid)
        main, bwd = pid, pid + 1000
        corr = 0
        for it in range(iterations):
            base, extra = (stall or {}).get(pid, (0.0, 0.0)), (stall_at or {}).get((pid, it), (0.0, 0.0))
            s0, s1 = base[0] + extra[0], base[1] + extra[1]
            o = 10_000.0 * (it + 1)
            seq = {k: v + 10 * it for k, v in SEQ.items()}

            def k(tid: int, launch: float, start: float, end: float, name: str = COMPUTE, stream: int = 7,
                  *, _o: float = o, _pid: int = pid) -> None:
                nonlocal corr
                corr += 1
                b.launch_on(_pid, tid, _o + launch, corr)
                b.kernel(_pid, stream, _o + start, _o + end, corr, name)

            def op(tid: int, start: float, end: float, text: str, *, _o: float = o, _pid: int = pid) -> None:
                if autograd_nvtx or text.startswith("ncclAllReduce"):
                    b.range_on(_pid, tid, _o + start, _o + end, text)

            k(main, 0, 0, 20)                                            # the previous step's optimizer
            op(main, 10, 20, f"aten::addmm, seq = {seq['s2']}, op_id = 1")
            k(main, 12, 50, 150)
            op(main, 30, 40, f"aten::relu, seq = {seq['s1']}, op_id = 2")
            k(main, 32, 150, 180)
            op(main, 50, 60, f"aten::addmm, seq = {seq['s0']}, op_id = 3")
            k(main, 52, 180, 260)
            op(main, 70, 80, f"aten::mse_loss, seq = {seq['loss']}, op_id = 4")
            k(main, 72, 260, 280)
            sizes = ((2000,), (1000,)) if it == 0 else ((1000,), (2000,))
            op(bwd, 100, 110, f"MseLossBackward0, seq = {seq['loss']}, op_id = 5")
            k(bwd, 102, 300, 320)
            op(bwd, 120, 130, f"AddmmBackward0, seq = {seq['s0']}, op_id = 6")
            k(bwd, 122, 320, 400 + s0)
            op(bwd, 135, 150, "torch::autograd::AccumulateGrad, op_id = 7")
            k(bwd, 137, 400 + s0, 410 + s0)
            c0 = COMM0[pid](it)
            op(bwd, 140, 149, f"c10d::allreduce_, op_id = 8, sizes = [[{sizes[0][0]}], [], [], []]")
            op(bwd, 141, 148, "nccl:all_reduce, op_id = 9")
            op(bwd, 141.5, 147, "ncclAllReduce")
            k(bwd, 142, 410 + s0, 410 + s0 + c0, ALLREDUCE, 20)
            op(bwd, 160, 170, f"ReluBackward0, seq = {seq['s1']}, op_id = 10")
            k(bwd, 162, 420 + s0, 440 + s0)
            op(bwd, 175, 185, f"AddmmBackward0, seq = {seq['s2']}, op_id = 11")
            k(bwd, 177, 440 + s0, 560 + s0 + s1)
            k(bwd, 190, 560 + s0 + s1, 570 + s0 + s1)
            c1 = COMM1[pid](it)
            op(bwd, 195, 205, f"c10d::allreduce_, op_id = 12, sizes = [[{sizes[1][0]}], [], [], []]")
            op(bwd, 196, 204, "nccl:all_reduce, op_id = 13")
            start1 = max(570.0 + s0 + s1, 410 + s0 + c0)
            k(bwd, 200, start1, start1 + c1, ALLREDUCE, 20)
            k(bwd, 210, 700 + s0 + s1, 710 + s0 + s1)                    # DDP's finalize copy
    b.close()
    return path


def test_walk_per_iteration(tmp_path: Path) -> None:
    steps = nsys.ddp_bucket_steps(build_ddp_export(tmp_path / "ddp.sqlite"))
    assert {(s.pid, s.iteration) for s in steps} == {(p, i) for p in (100, 101) for i in range(4)}
    later = [s for s in steps if s.iteration > 0]
    assert {(s.bucket, s.numel, s.nbytes) for s in later} == {(0, 1000, 4000), (1, 2000, 8000)}
    for s in later:
        assert s.forward_s == pytest.approx({0: 100, 1: 130}[s.bucket] * US)
        assert s.backward_s == pytest.approx({0: 110, 1: 160}[s.bucket] * US)
        want = (COMM0 if s.bucket == 0 else COMM1)[s.pid or 0](s.iteration)
        assert s.comm_s == pytest.approx(want * US)


def test_load_ddp_profile(tmp_path: Path) -> None:
    p = build_ddp_export(tmp_path / "ddp.sqlite")
    prof = nsys.load(p)  # no deft ranges: load takes the DDP walk
    assert prof == nsys.load_ddp(p)
    assert prof.source == "nsys" and prof.world_size == 2 and prof.link_names == ("primary",)
    assert prof.links[0].backend == "nccl"
    assert [(bk.numel, bk.nbytes) for bk in prof.buckets] == [(1000, 4000), (2000, 8000)]
    assert prof.meta["iterations"] == [1, 2, 3] and prof.meta["dropped_iterations"] == 2
    t0, t1 = prof.times
    assert (t0.forward_s, t0.backward_s) == pytest.approx((100 * US, 110 * US))
    assert (t1.forward_s, t1.backward_s) == pytest.approx((130 * US, 160 * US))
    # comm: median over iterations 1..3 per rank, then the slower rank
    assert t0.comm_s["primary"] == pytest.approx(max(120, 150) * US)
    assert t1.comm_s["primary"] == pytest.approx(max(200, 190) * US)


def test_ranks_stalled_in_different_buckets_are_charged_the_slower_ranks_compute(tmp_path: Path) -> None:
    # Forward 100 (bucket 0) and 130 (bucket 1), backward 110 and 160 on both ranks (us); rank 100 loses
    # 90 in bucket 0's backward (200, 160), rank 101 loses 60 in bucket 1's (110, 220). Rank 100
    # computes 100 + 130 + 200 + 160 = 590 an iteration, rank 101 100 + 130 + 110 + 220 = 560; the
    # per-bucket maxima over ranks would charge 100 + 130 + 200 + 220 = 650.
    p = build_ddp_export(tmp_path / "stalled.sqlite", stall={100: (90.0, 0.0), 101: (0.0, 60.0)})
    steps = [s for s in nsys.ddp_bucket_steps(p) if s.iteration > 0]
    for s in steps:  # the walk sees each rank's stall where it was put
        assert s.backward_s == pytest.approx({(100, 0): 200, (100, 1): 160, (101, 0): 110, (101, 1): 220}[
            (s.pid, s.bucket)] * US)
    prof = nsys.load_ddp(p)
    t0, t1 = prof.times
    assert t0.forward_s + t1.forward_s + t0.backward_s + t1.backward_s == pytest.approx(590 * US)
    # the buckets share it as their medians over ranks (of two: the mean): 100, 130, 155, 190 of 575
    assert (t0.forward_s, t1.forward_s) == pytest.approx((100 * 590 / 575 * US, 130 * 590 / 575 * US))
    assert (t0.backward_s, t1.backward_s) == pytest.approx((155 * 590 / 575 * US, 190 * 590 / 575 * US))
    # comm (kernel lengths unchanged by the stall): the slower rank's median, as without it
    assert t0.comm_s["primary"] == pytest.approx(150 * US) and t1.comm_s["primary"] == pytest.approx(200 * US)
    assert "pace" in prof.meta["reduction"]


def test_ranks_slow_in_different_iterations_are_paced_per_iteration(tmp_path: Path) -> None:
    # Forward 100 and 130, backward 110 and 160 (us) on both ranks; rank 100 loses 200 in bucket 0's
    # backward in iteration 1, rank 101 200 in bucket 1's in iteration 2 (iteration 0 is left out: DDP's
    # first buckets). Per kept iteration 1, 2, 3 the ranks compute 700, 500, 500 and 500, 700, 500; the
    # slower rank per iteration: 700, 700, 500, median 700 (each rank's medians first would give 500).
    # The buckets share it as their medians: 100, 130, 110, 160 of 500.
    p = build_ddp_export(tmp_path / "apart.sqlite", stall_at={(100, 1): (200.0, 0.0), (101, 2): (0.0, 200.0)})
    got = {(s.pid, s.iteration, s.bucket): s.backward_s for s in nsys.ddp_bucket_steps(p) if s.iteration > 0}
    assert (got[(100, 1, 0)], got[(101, 2, 1)], got[(100, 2, 0)]) == pytest.approx((310 * US, 360 * US, 110 * US))
    prof = nsys.load_ddp(p)
    t0, t1 = prof.times
    assert (t0.forward_s, t1.forward_s) == pytest.approx((100 * 1.4 * US, 130 * 1.4 * US))
    assert (t0.backward_s, t1.backward_s) == pytest.approx((110 * 1.4 * US, 160 * 1.4 * US))
    assert "3 iterations every rank holds" in prof.meta["reduction"]


def test_comm_ops_join_their_operator(tmp_path: Path) -> None:
    ops = nsys.comm_ops(build_ddp_export(tmp_path / "ddp.sqlite"))
    assert len(ops) == 2 * 4 * 2
    assert {(c.op, c.operator, c.tid, c.dtype_bytes) for c in ops} == {
        ("AllReduce", "c10d::allreduce_", 1100, 4), ("AllReduce", "c10d::allreduce_", 1101, 4)}


def test_without_autograd_nvtx_the_forward_is_refused(tmp_path: Path) -> None:
    p = build_ddp_export(tmp_path / "plain.sqlite", autograd_nvtx=False)
    steps = nsys.ddp_bucket_steps(p)
    assert steps and all(s.forward_s is None for s in steps)
    assert {round(s.backward_s / US) for s in steps if s.iteration > 0} == {110, 160}
    with pytest.raises(TraceError, match=r"plain\.sqlite: .*emit_nvtx"):
        nsys.load(p)


def test_cli_prints_the_ddp_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = build_ddp_export(tmp_path / "ddp.sqlite")
    out = tmp_path / "prof.json"
    assert nsys.main([str(p), "--out", str(out)]) == 0
    assert out.exists() and "nccl_kernels: {'AllReduce': 16}" in capsys.readouterr().out


# -- the real export ------------------------------------------------------------------------------------
def test_fixture_comm_ops_are_its_c10d_operators() -> None:
    path = fixture_path("nsys_2gpu_sendrecv.sqlite")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        nccl = int(db.execute("SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
                              "ON s.id = k.shortName WHERE s.value LIKE 'nccl%'").fetchone()[0])
        launched = int(db.execute(
            "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.shortName "
            "WHERE s.value LIKE 'nccl%' AND EXISTS (SELECT 1 FROM CUPTI_ACTIVITY_KIND_RUNTIME r WHERE "
            "r.correlationId = k.correlationId AND ((r.globalTid >> 24) & 16777215) = "
            "((k.globalPid >> 24) & 16777215))").fetchone()[0])
    finally:
        db.close()
    ops = nsys.comm_ops(path)
    assert len(ops) == nccl == 66 and {c.op for c in ops} == {"SendRecv"}
    joined = [c for c in ops if c.tid is not None]
    assert len(joined) == launched and launched > 0
    assert {c.operator for c in joined} == {"c10d::alltoall_base_"}  # the outermost operator of each launch
    assert all(c.launch_ns <= c.start_ns for c in joined)


def test_fixture_is_not_a_ddp_run() -> None:
    path = fixture_path("nsys_2gpu_sendrecv.sqlite")
    assert nsys.ddp_bucket_steps(path) == []
    with pytest.raises(TraceError, match="no NCCL all-reduce of a torch DDP run"):
        nsys.load(path)
