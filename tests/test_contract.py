"""The contract between the parts: round trips and clear errors on damaged files."""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deft import (
    Bucket,
    BucketTimes,
    CommTask,
    ContractError,
    DeftConfig,
    Link,
    LinkConfig,
    Profile,
    Schedule,
    StagePlan,
    Update,
)
from deft.schedule import synchronous_schedule


def make_profile(n: int = 3) -> Profile:
    links = (Link("nccl", "nccl", "eth0", 1e-4, 1e-9), Link("gloo", "gloo", "eth1", 2e-4, 1.65e-9))
    buckets = tuple(Bucket(i, (f"layer{i}.weight",), 1000 * (i + 1), 4000 * (i + 1)) for i in range(n))
    times = tuple(BucketTimes(0.001 * (i + 1), 0.002 * (i + 1), {"nccl": 0.003 * (i + 1)}) for i in range(n))
    return Profile(buckets, times, links, world_size=2, source="timing", versions={"torch": "2.13.0"}, model="m")


def delayed_schedule() -> Schedule:
    """Cycle 2: group {0} applied after position 1, group {1} applied in the next cycle's position 0."""
    return Schedule(
        cycle=2, links=("a", "b"), bucket_numel=(10, 20), bucket_nbytes=(40, 80),
        stages=(
            StagePlan(0, "forward", (CommTask(1, 1, "a"),)),
            StagePlan(0, "backward", (CommTask(0, 0, "b"),)),
            StagePlan(1, "forward", (CommTask(1, 1, "a"),)),
            StagePlan(1, "backward", (CommTask(0, 0, "a"),)),
        ),
        updates=(Update((0,), 1), Update((1,), 2)),
    )


def test_profile_round_trip(tmp_path: Path) -> None:
    prof = make_profile()
    path = tmp_path / "p.json"
    prof.save(path)
    again = Profile.load(path)
    assert again == prof
    assert again.digest() == prof.digest()
    # Bucket 2 has no measured gloo time: the link's fitted model is used.
    assert again.comm_time(2, "gloo") == pytest.approx(2e-4 + 1.65e-9 * 12000)
    assert again.comm_time(2, "nccl") == pytest.approx(0.009)
    assert prof.coverage_rate == pytest.approx(0.018 / (0.006 + 0.012))
    assert prof.ready_s == pytest.approx((0.002, 0.006, 0.012))  # R_i = B_0 + ... + B_i


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("buckets"), "buckets"),
        (lambda d: d.update(schema=99), "schema"),
        (lambda d: d.update(kind="deft.schedule"), "kind"),
        (lambda d: d["buckets"][1].update(forward_s="fast"), "buckets[1].forward_s"),
        (lambda d: d["buckets"][0].update(backward_s=-1.0), "buckets[0].backward_s"),
        (lambda d: d["buckets"][2].update(id=7), "buckets[2].id"),
        (lambda d: d["links"][0].update(backend="mpi"), "links[0].backend"),
        (lambda d: d["buckets"][0]["comm_s"].update(ib=1.0), "times[0].comm_s.ib"),
        (lambda d: d.update(world_size=0), "world_size"),
    ],
)
def test_profile_bad_field_is_named(tmp_path: Path, mutate, field: str) -> None:
    doc = make_profile().to_dict()
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ContractError) as e:
        Profile.load(path)
    assert str(path) in str(e.value)
    assert field in str(e.value)


def test_profile_damaged_files(tmp_path: Path) -> None:
    path = tmp_path / "trunc.json"
    path.write_text(json.dumps(make_profile().to_dict())[:100])
    with pytest.raises(ContractError, match="not valid JSON"):
        Profile.load(path)
    gz = tmp_path / "p.json"
    gz.write_bytes(gzip.compress(b"{}"))
    with pytest.raises(ContractError, match=r"cannot read|not valid JSON"):
        Profile.load(gz)
    with pytest.raises(ContractError, match="no such profile"):
        Profile.load(tmp_path / "missing.json")
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(ContractError, match="expected a JSON object"):
        Profile.load(lst)


def test_profile_missing_comm_without_fit_is_rejected() -> None:
    prof = make_profile()
    bare = (Link("nccl", "nccl"),)
    with pytest.raises(ContractError, match="no fitted alpha/beta"):
        replace(prof, links=bare, times=tuple(BucketTimes(t.forward_s, t.backward_s, {}) for t in prof.times))


def test_schedule_round_trip_and_queries(tmp_path: Path) -> None:
    s = delayed_schedule()
    path = tmp_path / "s.json"
    s.save(path)
    again = Schedule.load(path)
    assert again == s and again.digest() == s.digest()
    assert s.batch_sequence == (1, 1)
    assert s.updates_due(1) == [(0, 0)]
    assert s.updates_due(0) == [(1, 1)]  # group {1} of the previous cycle
    assert s.group_of(3) == 1
    sync = synchronous_schedule((5, 6), (20, 24), ("a", "b"), ("b", "a"))
    assert [t.link for t in sync.stage(0, "backward").comms] == ["b", "a"]


def test_schedule_digest_ignores_meta_only() -> None:
    s = delayed_schedule()
    assert replace(s, meta={"note": 1}).digest() == s.digest()
    assert replace(s, links=("a", "b", "c")).digest() != s.digest()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        # Forward stage of the group's own last iteration: the gradient does not exist yet.
        (lambda s: replace(s, stages=(StagePlan(0, "forward", (CommTask(1, 0, "a"),)), *s.stages[1:])),
         "origin"),
        # Bucket 1 of group 0 sent twice.
        (lambda s: replace(s, stages=(*s.stages[:1],
                                      StagePlan(0, "backward", (CommTask(0, 0, "b"), CommTask(1, 0, "a"))),
                                      *s.stages[2:])),
         "sent twice"),
        # Applied at position 0, before bucket 1 goes out in position 1's forward.
        (lambda s: replace(s, updates=(Update((0,), 0), Update((1,), 2))), "applied before"),
        (lambda s: replace(s, updates=(Update((0, 1), 1),)), "origin"),
        (lambda s: replace(s, stages=s.stages[:3]), "stage plans"),
        (lambda s: replace(s, stages=(StagePlan(0, "forward", (CommTask(1, 1, "z"),)), *s.stages[1:])), "unknown link"),
        (lambda s: replace(s, updates=(Update((0,), 1),)), "partition"),
    ],
)
def test_schedule_invariants_rejected(build, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        build(delayed_schedule())


def test_schedule_updates_keep_group_order_across_the_cycle() -> None:
    """Group 1 of cycle c must not be applied after group 0 of cycle c+1 (position 4 > 0 + cycle)."""
    stages = (
        StagePlan(0, "forward"), StagePlan(0, "backward", (CommTask(0, 0, "a"),)),
        StagePlan(1, "forward"), StagePlan(1, "backward", (CommTask(0, 2, "a"),)),
        StagePlan(2, "forward"), StagePlan(2, "backward"),
    )
    ok = Schedule(cycle=3, links=("a",), bucket_numel=(1,), bucket_nbytes=(4,), stages=stages,
                  updates=(Update((0,), 1), Update((1, 2), 4)))
    assert ok.updates_due(1) == [(1, 1), (0, 0)]  # same step: the previous cycle's group first
    with pytest.raises(ContractError, match=r"updates\[1\].apply_after.*next cycle"):
        replace(ok, updates=(Update((0,), 0), Update((1, 2), 4)))


def test_schedule_duplicate_links_rejected() -> None:
    with pytest.raises(ContractError, match=r"links: link names must be unique"):
        replace(delayed_schedule(), links=("a", "b", "a"))


@pytest.mark.parametrize("comm", [[True, 1, "a"], [1, True, "a"], [1.0, 1, "a"]])
def test_schedule_comm_fields_must_be_integers(tmp_path: Path, comm: list[object]) -> None:
    doc = delayed_schedule().to_dict()
    doc["stages"][2]["comms"][0] = comm
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ContractError, match=r"stages\[2\]\.comms\[0\]"):
        Schedule.load(path)


def test_schedule_bad_file_names_field(tmp_path: Path) -> None:
    doc = delayed_schedule().to_dict()
    doc["stages"][2]["comms"][0] = [1, "one", "a"]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ContractError) as e:
        Schedule.load(path)
    assert str(path) in str(e.value) and "stages[2].comms[0]" in str(e.value)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.integers(1, 4), st.data())
def test_generated_valid_schedules_round_trip(ks: list[int], n: int, data: st.DataObject) -> None:
    """Groups of sizes ks; each bucket sent in a random legal stage between the group's end and its update."""
    cycle = sum(ks)
    comms: dict[tuple[int, str], list[CommTask]] = {(p, s): [] for p in range(cycle) for s in ("forward", "backward")}
    updates, start = [], 0
    prev_apply = -1
    for k in ks:
        last = start + k - 1
        apply_after = max(prev_apply, last + data.draw(st.integers(0, cycle - 1)))
        apply_after = min(apply_after, last + cycle - 1)
        if updates:  # in group order across the cycle too: no later than the next cycle's first update
            apply_after = min(apply_after, updates[0].apply_after + cycle)
        if apply_after < prev_apply:
            apply_after = prev_apply
        for b in range(n):
            # Legal sends: backward of `last` up to backward of `apply_after`.
            lag = data.draw(st.integers(0, apply_after - last))
            stage = "backward" if lag == 0 else data.draw(st.sampled_from(["forward", "backward"]))
            comms[((last + lag) % cycle, stage)].append(CommTask(b, lag, data.draw(st.sampled_from(["a", "b"]))))
        updates.append(Update(tuple(range(start, last + 1)), apply_after))
        prev_apply = apply_after
        start = last + 1
    # no filter needed (and none hides a failure): apply_after is clamped to [last, last + cycle - 1] above
    # (the floor prev_apply <= prev_last + cycle - 1 < last + cycle - 1), so every generated update is
    # legal and a schedule the contract rejected would fail this test with its ContractError
    sched = Schedule(
        cycle=cycle, links=("a", "b"), bucket_numel=tuple(range(1, n + 1)),
        bucket_nbytes=tuple(4 * i for i in range(1, n + 1)),
        stages=tuple(StagePlan(p, s, tuple(comms[(p, s)])) for p in range(cycle) for s in ("forward", "backward")),
        updates=tuple(updates),
    )
    assert Schedule.from_dict(json.loads(json.dumps(sched.to_dict()))) == sched
    assert sched.batch_sequence == tuple(ks)
    assert sum(len(sched.updates_due(p)) for p in range(cycle)) == len(ks)


def test_config_loading(tmp_path: Path) -> None:
    path = tmp_path / "deft.toml"
    path.write_text('epsilon = 0.05\nsolver = "greedy"\n[[links]]\nname = "nccl"\n[[links]]\n'
                    'name = "gloo"\nbackend = "gloo"\nifname = "nic1"\n')
    cfg = DeftConfig.load(path)
    assert cfg.epsilon == 0.05 and cfg.solver == "greedy"
    assert cfg.links == (LinkConfig("nccl"), LinkConfig("gloo", "gloo", "nic1"))
    assert DeftConfig.from_dict(cfg.to_dict()) == cfg
    assert DeftConfig.resolve(None) == DeftConfig()
    assert DeftConfig.resolve(str(path)) == cfg


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("epsilon = 2.0", "epsilon"),
        ("epsilon = 'small'", "epsilon"),
        ("solver = 'magic'", "solver"),
        ("warmup_iters = 1.5", "warmup_iters"),
        ("preserver = 1", "preserver"),
        ("epsilonn = 0.1", "epsilonn"),
        ("[[links]]\nname = 'a'\n[[links]]\nname = 'b'\nbackend = 'nccl'", "links[1].backend"),
        ("[[links]]\nname = 'a'\n[[links]]\nname = 'a'", "links"),
        ("epsilon = ", "<file>"),
    ],
)
def test_config_errors_name_file_and_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "deft.toml"
    path.write_text(text + "\n")
    with pytest.raises(ContractError) as e:
        DeftConfig.load(path)
    assert str(path) in str(e.value) and field in str(e.value)


@pytest.mark.parametrize("content", [None, b"epsilon = 0.1 \xff\n"])
def test_config_unreadable_file_names_it(tmp_path: Path, content: bytes | None) -> None:
    """A directory or a non-UTF-8 file given as config: a ContractError naming it, not an OSError."""
    path = tmp_path / "deft.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ContractError, match=rf"{re.escape(str(path))}: <file>: cannot read config file"):
        DeftConfig.load(path)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda p: replace(p, times=(replace(p.times[0], backward_s=float("nan")), *p.times[1:])), "times[0]"),
        (lambda p: replace(p, times=(*p.times[:2], replace(p.times[2], forward_s=float("inf")))), "times[2]"),
        (lambda p: replace(p, times=(replace(p.times[0], comm_s={"nccl": float("nan")}), *p.times[1:])),
         "times[0].comm_s.nccl"),
        (lambda p: replace(p, links=(replace(p.links[0], beta_s_per_byte=float("nan")), p.links[1])), "links[0]"),
        # validate() names the dataclass field: BucketTimes live in ``times`` (JSON keeps them per bucket)
        (lambda p: replace(p, times=(replace(p.times[0], codec_s=float("nan")), *p.times[1:])), "times[0].codec_s"),
        (lambda p: replace(p, times=(*p.times[:1], replace(p.times[1], codec_s=0.5), p.times[2])), "times[1].codec_s"),
    ],
)
def test_profile_built_in_code_rejects_non_finite_times(build, field: str) -> None:
    """Profiles built by the trace parsers skip JSON's checks: validate() must catch NaN/inf itself."""
    with pytest.raises(ContractError, match=re.escape(f"<profile>: {field}:")):
        build(make_profile())


def test_config_resolve_rejects_other_types() -> None:
    with pytest.raises(ContractError, match=r"config: expected a DeftConfig, a TOML path, a dict or None, got int"):
        DeftConfig.resolve(5)  # type: ignore[arg-type]


def test_config_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "env.toml"
    path.write_text("epsilon = 0.2\n")
    monkeypatch.setenv("DEFT_CONFIG", str(path))
    assert DeftConfig.resolve(None).epsilon == 0.2
    assert DeftConfig.resolve({"epsilon": 0.0}).epsilon == 0.0  # an explicit config wins
    monkeypatch.setenv("DEFT_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ContractError, match=r"missing\.toml"):
        DeftConfig.resolve(None)


def lagfree_schedule(deferred: tuple[int, ...] = (0,), finishing: bool = True) -> Schedule:
    """Cycle 1, three buckets on one link: 0 and 1 sent in backward, 2 in the next forward."""
    return Schedule(cycle=1, links=("a",), bucket_numel=(1, 1, 1), bucket_nbytes=(4, 4, 4),
                    stages=(StagePlan(0, "forward", (CommTask(2, 1, "a"),)),
                            StagePlan(0, "backward", (CommTask(0, 0, "a"), CommTask(1, 0, "a")))),
                    updates=(Update((0,), 0, finish_in_forward=finishing, deferred=deferred),))


def test_schedule_deferred_round_trip(tmp_path: Path) -> None:
    s = lagfree_schedule((0, 1))
    s.save(tmp_path / "s.json")
    assert Schedule.load(tmp_path / "s.json").updates[0].deferred == (0, 1)
    # absent when empty, so the digests of schedules without it are unchanged
    assert "deferred" not in lagfree_schedule(()).to_dict()["updates"][0]
    assert lagfree_schedule(()).digest() != s.digest()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: lagfree_schedule((0,), finishing=False), r"updates\[0\]\.deferred: only an update finishing"),
        (lambda: lagfree_schedule((2,)), r"deferred bucket 2 must be sent in the backward stage"),
        (lambda: lagfree_schedule((3,)), r"expected increasing distinct bucket ids in 0\.\.2, got \[3\]"),
        (lambda: lagfree_schedule((1, 0)), r"increasing distinct"),
        (lambda: lagfree_schedule((0, 0)), r"increasing distinct"),
    ],
)
def test_schedule_deferred_rejected(build, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        build()


def test_schedule_deferred_file_must_hold_integers(tmp_path: Path) -> None:
    doc = lagfree_schedule().to_dict()
    doc["updates"][0]["deferred"] = [True]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ContractError, match=r"updates\[0\]\.deferred"):
        Schedule.load(path)
