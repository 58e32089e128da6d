"""bench_replay at more hosts: the ranks' layout run_ranks starts, deft's speedup by world size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from deft.testbed import Testbed
from tests._scripts import load_script

REPO = Path(__file__).resolve().parents[1]
# prints the environment a rank got, as one JSON line
SHOW_ENV = ("import json, os; print(json.dumps({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
            "'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'BENCH_SLOT', 'MASTER_ADDR', 'MASTER_PORT')}))")


class LocalTestbed(Testbed):
    """A testbed never brought up: its ranks run here, outside any namespace (the layout is what is tested)."""

    def popen(self, h: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(list(argv), env={**os.environ, **(env or {})}, **kwargs)


@pytest.fixture
def links(monkeypatch: pytest.MonkeyPatch) -> Any:
    return load_script(REPO / "benchmarks" / "bench_links.py", monkeypatch)


@pytest.fixture
def replay(monkeypatch: pytest.MonkeyPatch) -> Any:
    return load_script(REPO / "benchmarks" / "bench_replay.py", monkeypatch)


def _envs(links: Any, tmp_path: Path, per_host: int, alone: bool = False) -> list[dict[str, str]]:
    tb = LocalTestbed(hosts=2, links=2)
    outs = links.run_ranks(tb, [sys.executable, "-c", SHOW_ENV], timeout_s=60, label="env",
                           config=tmp_path / "deft.toml", echo=lambda rank, line: False, alone=alone,
                           per_host=per_host)
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def test_two_ranks_per_host_get_torchruns_layout(links: Any, tmp_path: Path) -> None:
    envs = _envs(links, tmp_path, per_host=2)
    # rank h * 2 + l on host h, as torchrun --nnodes 2 --nproc-per-node 2 numbers them
    assert [(e["RANK"], e["GROUP_RANK"], e["LOCAL_RANK"], e["BENCH_SLOT"]) for e in envs] == [
        ("0", "0", "0", "0"), ("1", "0", "1", "1"), ("2", "1", "0", "2"), ("3", "1", "1", "3")]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs} == {("4", "2")}


def test_ranks_alone_on_one_host_each_get_a_port_of_their_own(links: Any, tmp_path: Path) -> None:
    envs = _envs(links, tmp_path, per_host=2, alone=True)
    assert {(e["RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs} == {("0", "1", "1")}
    # two single-rank jobs on one host's address would collide on one port
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 4
    assert [e["BENCH_SLOT"] for e in envs] == ["0", "1", "2", "3"]


def test_one_rank_per_host_is_the_host(links: Any, tmp_path: Path) -> None:
    envs = _envs(links, tmp_path, per_host=1)
    assert [(e["RANK"], e["GROUP_RANK"], e["WORLD_SIZE"]) for e in envs] == [("0", "0", "2"), ("1", "1", "2")]


def test_no_ranks_per_host_is_refused(links: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="per_host: expected at least 1 rank per host, got 0"):
        _envs(links, tmp_path, per_host=0)


def test_speedup_by_world_size_against_two_hosts(replay: Any) -> None:
    s = replay.Speedup
    rows = replay.by_world_size([
        s("vgg19", (4, 1), "deft-eps0", 0.200, 0.190, 0.500, 0.480),
        s("vgg19", (2, 1), "deft-eps0", 0.200, 0.200, 0.400, 0.400),
        s("vgg19", (2, 2), "deft-eps0", 0.250, 0.200, 0.500, 0.500),
    ])
    table = [r for r in rows if r.startswith("| vgg19 |")]
    # ordered by world size; 2 hosts 2.00x, 4 hosts 2.50x (1.25 of it), 2 x 2 2.00x measured, 2.50x simulated
    assert table == [
        "| vgg19 | deft, epsilon 0, two links | 2 | 2 hosts | 400 / 400 | 200 / 200 | 2.00x (2.00x) | 1.00 |",
        "| vgg19 | deft, epsilon 0, two links | 4 | 2 hosts x 2 ranks | 500 / 500 | 250 / 200 | 2.00x (2.50x) | 1.00 |",
        "| vgg19 | deft, epsilon 0, two links | 4 | 4 hosts | 500 / 480 | 200 / 190 | 2.50x (2.53x) | 1.25 |",
    ]


def test_speedup_without_a_two_host_run_has_no_ratio(replay: Any) -> None:
    rows = replay.by_world_size([replay.Speedup("gpt2", (8, 1), "deft", 0.5, 0.5, 1.0, 1.0)])
    assert rows[-2].endswith("| 2.00x (2.00x) | - |")


def test_side_by_side_puts_each_codes_run_in_its_column(replay: Any) -> None:
    rows = replay.side_by_side([
        ("vgg19", (2, 1), "ddp", "before", 0.290, 0.288, None),
        ("vgg19", (2, 1), "deft-eps0", "before", 0.181, 0.161, 1.6),
        ("vgg19", (2, 1), "deft-eps0", "after", 0.158, 0.161, 1.875),
    ])
    table = [r for r in rows if r.startswith("| vgg19 |")]
    assert rows[4] == "| profile | layout | scheme | before | after |"
    assert table == [
        "| vgg19 | 2 hosts | torch DDP (one bucket per profile bucket) | 290 / 288 (+0.7%) | - |",
        "| vgg19 | 2 hosts | deft, epsilon 0, two links | 181 / 161 (+12.4%, 1.60x) | 158 / 161 (-1.9%, 1.88x) |",
    ]


def test_the_comm_log_times_an_iterations_collectives_against_their_price(replay: Any) -> None:
    from deft.profile import Bucket, BucketTimes, Link, Profile

    prof = Profile(buckets=(Bucket(0, ("w",), 250, 1000),), times=(BucketTimes(0.01, 0.02, {"a": 0.05}),),
                   links=(Link("a", "gloo", None, 0.001, 1e-5),), world_size=2, source="synthetic")
    rec = {"name": "m", "profile": prof.to_dict(), "runs": {"deft-eps0": {
        "starts": [10.0, 10.5, 11.0],
        "comms": [["a", 1000, 10.6, 10.75], ["a", 2000, 10.4, 10.45], ["a", 1000, 10.55, 10.6]]}}}
    rows = replay.comm_log(rec, "deft-eps0", 1)
    # iteration 1 runs from 10.5 to 11.0: the two launched in it, in launch order; priced 1 + 10 ms alone
    assert [r for r in rows if r.startswith("| a |")] == ["| a | 1000 | 50.0 | 100.0 | 50.0 | 11.0 |",
                                                         "| a | 1000 | 100.0 | 250.0 | 150.0 | 11.0 |"]
    with pytest.raises(ValueError, match="m/deft-eps0: no collectives recorded for iteration 2"):
        replay.comm_log(rec, "deft-eps0", 2)
