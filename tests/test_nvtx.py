"""deft's range naming scheme and its emission to NVTX and torch.profiler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deft.profiler import kineto, nvtx
from deft.profiler.nvtx import RangeName, format_range_name, parse_layout_name, parse_range_name

links = st.text(alphabet=st.characters(whitelist_categories=("Ll", "Lu", "Nd"), whitelist_characters="_-.:"),
                min_size=1, max_size=12)
nat = st.integers(min_value=0, max_value=10**9)


@given(kind=st.sampled_from(["fwd", "bwd"]), bucket=nat, it=nat)
def test_compute_names_round_trip(kind: str, bucket: int, it: int) -> None:
    r = RangeName(kind, bucket, it)
    assert str(r) == f"deft/{kind}/b{bucket}/it{it}"
    assert parse_range_name(str(r)) == r


@given(link=links, bucket=nat, group=nat, it=nat)
def test_comm_names_round_trip(link: str, bucket: int, group: int, it: int) -> None:
    r = RangeName("comm", bucket, it, link=link, group=group)
    assert str(r) == f"deft/comm/{link}/b{bucket}/g{group}/it{it}"
    assert parse_range_name(str(r)) == r
    assert format_range_name("comm", bucket, it, link, group) == str(r)


@pytest.mark.parametrize("name", [
    "aten::mm", "", "deft", "deft/fwd/b1", "deft/fwd/b1/it", "deft/fwd/b-1/it2", "deft/fwd/bx/it2",
    "deft/fwd/b1/it2/extra", "deft/comm/b1/g0/it2", "deft/comm/a/b/b1/g0/it2", "deft/comm/primary/b1/it2",
    "deft/upd/b1/it2", " deft/fwd/b1/it2", "deft/fwd/b1/it2 ", "DEFT/fwd/b1/it2", "deft/comm/pri mary/b1/g0/it2",
])
def test_other_names_do_not_parse(name: str) -> None:
    assert parse_range_name(name) is None


def test_layout_marks_round_trip() -> None:
    assert parse_layout_name(nvtx.layout_name(3, 1000, 4000)) == (3, 1000, 4000)
    assert parse_layout_name("deft/bucket/b3/numel10") is None
    assert parse_range_name(nvtx.layout_name(3, 1000, 4000)) is None  # not a timed range


@pytest.mark.parametrize("kwargs", [
    {"kind": "upd", "bucket": 0, "iteration": 0},
    {"kind": "fwd", "bucket": -1, "iteration": 0},
    {"kind": "fwd", "bucket": 0, "iteration": True},
    {"kind": "fwd", "bucket": 0, "iteration": 0, "link": "primary"},
    {"kind": "comm", "bucket": 0, "iteration": 0, "link": "a/b", "group": 0},
    {"kind": "comm", "bucket": 0, "iteration": 0, "link": "primary"},
])
def test_invalid_range_names_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RangeName(**kwargs)


def test_disabled_path_is_a_shared_no_op() -> None:
    before = nvtx.nvtx_enabled()
    try:
        nvtx.configure(False)
        assert not nvtx.torch_profiler_active()
        assert nvtx.range("fwd", 0, 0) is nvtx.range("bwd", 1, 1)  # the same null context, nothing built
        assert nvtx.push_range("comm", 0, 0, "primary", 0) is None
        nvtx.pop_range(None)
        with nvtx.comm("primary", 0, 0, 0):
            pass
    finally:
        nvtx.configure(before)


def test_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    before = nvtx.nvtx_enabled()
    try:
        monkeypatch.setenv("DEFT_NVTX", "1")
        assert nvtx.configure() is True
        tok = nvtx.push_range("bwd", 2, 5)
        assert tok is not None and tok.nvtx_pushed and tok.name == "deft/bwd/b2/it5"
        nvtx.pop_range(tok)
        assert not tok.nvtx_pushed
        monkeypatch.setenv("DEFT_NVTX", "0")
        assert nvtx.configure() is False
        monkeypatch.delenv("DEFT_NVTX")
        monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
        assert nvtx.configure() is False  # auto: no tool injected
    finally:
        nvtx.configure(before)


def test_ranges_reach_torch_profiler_and_its_trace(tmp_path) -> None:
    before = nvtx.nvtx_enabled()
    nvtx.configure(False)  # record_function emission must not depend on NVTX
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            assert nvtx.torch_profiler_active()
            with nvtx.forward(1, 7):
                torch.ones(4).sum()
            tok = nvtx.push_range("comm", 1, 7, "second", 6)
            torch.ones(4).mul(2)
            nvtx.pop_range(tok)
            nvtx.mark_layout(1, 5088, 20352)
        assert not nvtx.torch_profiler_active()
        prof.export_chrome_trace(str(tmp_path / "t.json"))
    finally:
        nvtx.configure(before)
    names = {e.name for e in prof.events()}
    assert {"deft/fwd/b1/it7", "deft/comm/second/b1/g6/it7", "deft/bucket/b1/numel5088/nbytes20352"} <= names
    trace = kineto.read_trace(tmp_path / "t.json")
    parsed = {parse_range_name(e.name) for e in trace.events} - {None}
    assert parsed == {RangeName("fwd", 1, 7), RangeName("comm", 1, 7, link="second", group=6)}
    fwd = next(e for e in trace.events if e.name == "deft/fwd/b1/it7")
    inner = [e for e in trace.events if e.name == "aten::sum" and fwd.ts <= e.ts <= fwd.end]
    assert inner, "the range must enclose the work done inside it"


def test_overhead_measurement_reports_every_case_and_restores_the_configuration() -> None:
    # the figures themselves are a benchmark (benchmarks/results/profiler_runtime.md), not a test
    before = nvtx.nvtx_enabled()
    try:
        for state in (False, True):
            nvtx.configure(state)
            cost = nvtx.measure_overhead(number=100)
            assert nvtx.nvtx_enabled() is state
            assert set(cost) == {"off_with_ns", "off_push_pop_ns", "nvtx_on_with_ns", "nvtx_on_push_pop_ns",
                                 "empty_call_ns"}
            assert all(v > 0 for v in cost.values()), cost
    finally:
        nvtx.configure(before)
