"""Baselines against their papers' rules, hand-computed cases and brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deft.solver.baselines import (
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    ddp_buckets,
    mgwfbp_merge,
    mgwfbp_time,
    partition_sizes,
    usbyte_iteration,
    usbyte_plan,
)

MB = 1_000_000


# ------------------------------------------------------------------------------------------------- DDP
def vgg19_parameter_bytes() -> list[int]:
    """torchvision vgg19's parameters in reverse registration order (DDP's backward-ready order)."""
    convs = [(3, 64), (64, 64), (64, 128), (128, 128), (128, 256)] + [(256, 256)] * 3 + [(256, 512)] \
        + [(512, 512)] * 7
    params: list[int] = []
    for cin, cout in convs:
        params += [cin * cout * 9, cout]  # weight, bias
    for fin, fout in ((25088, 4096), (4096, 4096), (4096, 1000)):
        params += [fin * fout, fout]
    return [4 * p for p in reversed(params)]


def test_ddp_buckets_of_vgg19_are_the_papers_six_buckets() -> None:
    sizes = vgg19_parameter_bytes()
    buckets = ddp_buckets(sizes)
    numel = [sum(sizes[i] for i in b) // 4 for b in buckets]
    # fc8 | fc7 | fc6 | conv5_4..5_2 | conv5_1, conv4_4, conv4_3 | the rest (Table II's six buckets)
    assert numel == [4097000, 16781312, 102764544, 7079424, 7079424, 5865536]


def test_ddp_buckets_close_at_their_caps() -> None:
    sizes = [300_000, 900_000, 10 * MB, 10 * MB, 10 * MB, 3 * MB, 1]
    buckets = ddp_buckets(sizes)
    assert buckets == [[0, 1], [2, 3, 4], [5, 6]]
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    caps = [DDP_FIRST_BUCKET_BYTES] + [DDP_BUCKET_BYTES] * (len(buckets) - 1)
    for b, cap in zip(buckets[:-1], caps, strict=False):
        assert sum(sizes[i] for i in b) >= cap > sum(sizes[i] for i in b[:-1])
    assert ddp_buckets(sizes, 25 * 2**20, first_cap_bytes=None) == [[0, 1, 2, 3, 4], [5, 6]]


def test_ddp_buckets_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="cap_bytes"):
        ddp_buckets([1, 2], 0)
    with pytest.raises(ValueError, match=r"nbytes\[1\]"):
        ddp_buckets([1, -2])


# ------------------------------------------------------------------------------------------------- MG-WFBP
def all_contiguous_groupings(n: int) -> list[list[list[int]]]:
    out = []
    for cuts in itertools.product((False, True), repeat=n - 1):
        groups, cur = [], [0]
        for i, cut in enumerate(cuts, start=1):
            if cut:
                groups.append(cur)
                cur = [i]
            else:
                cur.append(i)
        groups.append(cur)
        out.append(groups)
    return out


def test_mgwfbp_time_hand_computed() -> None:
    # Layers 0 (input) .. 2 (output); backward runs 2, 1, 0 and ends at 1, 3, 6.
    back, size = [3.0, 2.0, 1.0], [10.0, 20.0, 30.0]
    a, b = 0.5, 0.1
    # Separate: layer 2 [1, 4.5], layer 1 [4.5, 7], layer 0 [7, 8.5].
    assert mgwfbp_time(back, size, a, b, [[0], [1], [2]]) == pytest.approx(8.5)
    # Layers 1+2 together once layer 1 is ready at 3: [3, 8.5]; layer 0 [8.5, 10].
    assert mgwfbp_time(back, size, a, b, [[0], [1, 2]]) == pytest.approx(10.0)
    # All at once after layer 0 at 6: 6 + 0.5 + 6 = 12.5.
    assert mgwfbp_time(back, size, a, b, [[0, 1, 2]]) == pytest.approx(12.5)
    with pytest.raises(ValueError, match="contiguous"):
        mgwfbp_time(back, size, a, b, [[0, 2], [1]])
    with pytest.raises(ValueError, match="partition"):
        mgwfbp_time(back, size, a, b, [[0], [1]])


def test_mgwfbp_merges_when_startup_dominates() -> None:
    back = [1e-4] * 5
    size = [1000.0] * 5
    # Start-up (1 s) dwarfs both the backward gaps and the transfer: everything goes in one message.
    for method in ("paper", "optimal"):
        assert mgwfbp_merge(back, size, 1.0, 1e-9, method=method) == [[0, 1, 2, 3, 4]]
    # No start-up cost and long backward gaps: every layer goes alone as soon as it is ready.
    assert mgwfbp_merge([1.0] * 4, [1.0] * 4, 0.0, 0.01, method="optimal") == [[0], [1], [2], [3]]


@settings(max_examples=150, deadline=None)
@given(
    st.integers(min_value=1, max_value=7).flatmap(lambda n: st.tuples(
        st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n),
        st.lists(st.floats(0.0, 50.0), min_size=n, max_size=n),
    )),
    st.floats(0.0, 3.0),
    st.floats(0.0, 0.2),
)
def test_mgwfbp_optimal_equals_brute_force_and_beats_paper(layers: tuple[list[float], list[float]],
                                                           alpha: float, beta: float) -> None:
    back, size = layers
    n = len(back)
    brute = min(mgwfbp_time(back, size, alpha, beta, g) for g in all_contiguous_groupings(n))
    opt = mgwfbp_merge(back, size, alpha, beta, method="optimal")
    paper = mgwfbp_merge(back, size, alpha, beta, method="paper")
    for groups in (opt, paper):
        assert sorted(i for g in groups for i in g) == list(range(n))
    t_opt = mgwfbp_time(back, size, alpha, beta, opt)
    assert t_opt == pytest.approx(brute, rel=1e-9, abs=1e-9)
    assert mgwfbp_time(back, size, alpha, beta, paper) >= t_opt - 1e-9


def test_mgwfbp_paper_is_not_always_optimal() -> None:
    """Algorithm 1 decides layer by layer; some instances show a gap (the DP exists for a reason)."""

    rng = random.Random(7)
    gaps = 0
    for _ in range(400):
        n = rng.randint(2, 6)
        back = [rng.uniform(0, 3) for _ in range(n)]
        size = [rng.uniform(0, 40) for _ in range(n)]
        a, b = rng.uniform(0, 3), rng.uniform(0, 0.2)
        t_paper = mgwfbp_time(back, size, a, b, mgwfbp_merge(back, size, a, b, "paper"))
        t_opt = mgwfbp_time(back, size, a, b, mgwfbp_merge(back, size, a, b, "optimal"))
        gaps += t_paper > t_opt + 1e-9
    assert gaps > 0


def test_mgwfbp_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="method"):
        mgwfbp_merge([1.0], [1.0], 0.1, 0.1, method="best")
    with pytest.raises(ValueError, match="layers"):
        mgwfbp_merge([1.0, 2.0], [1.0], 0.1, 0.1)
    with pytest.raises(ValueError, match="alpha"):
        mgwfbp_merge([1.0], [1.0], -0.1, 0.1)


# ------------------------------------------------------------------------------------------------- ByteScheduler
def test_partition_sizes() -> None:
    assert partition_sizes(10, 4) == [4, 4, 2]
    assert partition_sizes(8, 4) == [4, 4]
    assert partition_sizes(3, 4) == [3]
    with pytest.raises(ValueError):
        partition_sizes(3, 0)


# ------------------------------------------------------------------------------------------------- US-Byte
def test_usbyte_hand_computed_sequential() -> None:
    # Two layers (0 input, 1 output), one basic block each: backward of 1 then 0, forward 0 then 1.
    back, fwd, size = [4.0, 1.0], [1.0, 1.0], [10, 10]
    a, b = 1.0, 0.1  # one block costs 2
    plan = usbyte_iteration(back, fwd, size, a, b, sp=10, priority=[0, 1])
    # Layer 1 ready at 1; sent in phase 1 [1, 3] (gap 4 >= T(10) = 2: Case 3). Layer 0 ready at 5,
    # phase 2 [5, 7]; forward of layer 0 at 7-8, of layer 1 at 8-9: t_iter = 9.
    assert [(op.layer, op.nbytes, op.phase, op.start_s) for op in plan.ops] == [(1, 10, 1, 1.0), (0, 10, 2, 5.0)]
    assert plan.iteration_s == pytest.approx(9.0)


def test_usbyte_unequal_blocks_case2() -> None:
    # Layer 1 (output) has 5 blocks, ready at 1; layer 0's backward lasts 3.5: Case 2 sends
    # ceil((3.5 - 1) / 1) = 3 blocks in one all-reduce [1, 5], the other 2 go in phase 2.
    back, fwd, size = [3.5, 1.0], [0.5, 0.5], [10, 50]
    plan = usbyte_iteration(back, fwd, size, 1.0, 0.1, sp=10, priority=[0, 1])
    assert [(op.layer, op.nbytes, op.phase) for op in plan.ops] == [(1, 30, 1), (0, 10, 2), (1, 20, 2)]
    # phase 2 from 5: layer 0 [5, 7], layer 1 [7, 10]; forwards: 0 at 7-7.5, 1 at 10-10.5.
    assert plan.iteration_s == pytest.approx(10.5)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=1, max_value=5).flatmap(lambda n: st.tuples(
        st.lists(st.floats(0.01, 5.0), min_size=n, max_size=n),
        st.lists(st.floats(0.01, 5.0), min_size=n, max_size=n),
        st.lists(st.integers(1, 60), min_size=n, max_size=n),
    )),
    st.floats(0.0, 2.0),
    st.floats(0.001, 0.2),
    st.integers(1, 25),
)
def test_usbyte_plan_invariants(layers: tuple[list[float], list[float], list[int]], alpha: float, beta: float,
                                sp: int) -> None:
    back, fwd, size = layers
    n = len(back)
    plan = usbyte_plan(back, fwd, size, alpha, beta, sp)
    ends = [sum(back[i:]) for i in range(n)]  # backward end of layer i
    sent = [0] * n
    link_free = -math.inf
    for op in plan.ops:
        assert op.start_s >= ends[op.layer] - 1e-9  # never before its gradient exists
        assert op.start_s >= link_free - 1e-9  # one all-reduce at a time
        link_free = op.start_s + alpha + beta * op.nbytes
        sent[op.layer] += op.nbytes
    assert sent == size  # every byte exactly once
    assert sorted(plan.priorities) == list(range(n))  # Algorithm 2 keeps a permutation
    sequential = usbyte_iteration(back, fwd, size, alpha, beta, sp, list(range(n))).iteration_s
    best = min(usbyte_iteration(back, fwd, size, alpha, beta, sp, list(p)).iteration_s
               for p in itertools.permutations(range(n)))
    assert best - 1e-9 <= plan.iteration_s <= sequential + 1e-9
    assert plan.iteration_s >= sum(back) + sum(fwd) - 1e-9
