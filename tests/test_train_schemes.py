"""The schemes of examples/train_cnn.py beyond plain torch DDP and deft: they run, and they step as documented.

Expected numbers are derived by hand from the data set and the documented schedules:
scikit-learn's digits have 1,797 images; the stratified 20 % test split holds 360, so 1,437 train; a
2-rank ``DistributedSampler`` with ``drop_last`` gives each rank 718, i.e. 22 batches of 32 per epoch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests._scripts import load_script, run_script

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_cnn.py"
TINY = ["--width", "8", "--hidden", "64", "--batch-size", "32", "--lr", "0.05", "--skip-iters", "2", "--no-progress"]


def run(argv: list[str], tmp_path: Path, world: int = 2, **extra_env: str) -> dict[str, Any]:
    """``python examples/train_cnn.py *argv`` in ``world`` ranks as torchrun starts them (tests/_scripts.py)."""
    out = tmp_path / "run.json"
    run_script(EXAMPLE, [*argv, "--json", str(out)], world, extra_env)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_compute_only_is_one_rank_of_a_two_rank_job_without_communication(tmp_path: Path) -> None:
    doc = run(["--compute-only", *TINY, "--epochs", "1", "--max-iters", "4", "--eval-every", "4"], tmp_path, 1)
    s = doc["summary"]
    assert s["ddp"] == "compute" and s["world_size"] == 1 and s["scheme"] == {"shards": 2}
    assert s["iters"] == 4 and s["updates"] == 4
    assert [r["updates"] for r in doc["iters"]] == [1, 2, 3, 4]
    # time since start counts the set-up too, so it is never below the sum of iteration times
    assert all(r["time_s"] >= r["train_s"] for r in doc["iters"])


@pytest.mark.slow
def test_compute_only_epoch_is_a_ranks_shard(tmp_path: Path) -> None:
    """One epoch = 22 batches: 1,437 train images / 2 shards (drop_last) = 718 // 32."""
    doc = run(["--compute-only", *TINY, "--epochs", "1"], tmp_path, 1)
    assert doc["summary"]["iters"] == 22
    assert [e["iter"] for e in doc["evals"]] == [22]


@pytest.mark.parametrize(("argv", "message"), [
    (["--compute-only", "--ddp", "torch"], "--compute-only runs no data-parallel scheme; drop --ddp torch"),
    (["--ddp", "localsgd", "--localsgd-period", "1"], "--localsgd-period: expected an integer >= 2, got 1"),
    (["--ddp", "powersgd", "--powersgd-start", "1"], "--powersgd-start: expected an integer >= 2, got 1"),
    (["--ddp", "accum2", "--accumulate", "0"], "--accumulate: expected an integer >= 1, got 0"),
    (["--ddp", "bf16"], "--ddp: invalid choice: 'bf16'"),
    (["--ddp", "torch", "--compression", "fp16"], "--compression is deft's knob; --ddp torch has its own"),
    (["--ddp", "deft", "--compression", "bf16"], "--compression: invalid choice: 'bf16'"),
    (["--ddp", "diloco", "--diloco-h", "0"], "--diloco-h: expected an integer >= 1, got 0"),
    (["--ddp", "diloco", "--diloco-outer-momentum", "1"], "--diloco-outer-momentum: expected 0 <= momentum < 1"),
    (["--ddp", "diloco", "--diloco-outer-lr", "0"], "--diloco-outer-lr: expected > 0, got 0.0"),
    (["--ddp", "torch", "--bucket-cap-mb", "0"], "--bucket-cap-mb: expected > 0, got 0.0"),
    (["--ddp", "deft", "--bucket-cap-mb", "4"], "--bucket-cap-mb does not apply to --ddp deft"),
    (["--ddp", "powersgd", "--bucket-cap-mb", "4"], "--bucket-cap-mb does not apply to --ddp powersgd"),
    (["--ddp", "torch", "--local-steps", "4"], "--local-steps is deft's local-steps mode; --ddp torch has its own"),
    (["--ddp", "deft", "--local-steps", "0"], "--local-steps: expected an integer >= 1, got 0"),
    (["--ddp", "deft", "--local-outer", "diloco"], "--local-outer, --local-warmup, --local-overlap-iters, "
     "--local-period and --no-local-overlap need --local-steps"),
    (["--ddp", "deft", "--local-period", "adacomm"], "--local-outer, --local-warmup, --local-overlap-iters, "
     "--local-period and --no-local-overlap need --local-steps"),
    (["--ddp", "deft", "--local-steps", "4", "--local-period", "adaptive"], "--local-period: invalid choice"),
    (["--ddp", "deft", "--local-steps", "2", "--local-overlap-iters", "3"],
     "--local-overlap-iters: expected at most --local-steps (2), got 3"),
])
def test_bad_scheme_arguments_name_the_flag(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The script's own argument parser (what ``python examples/train_cnn.py ...`` runs first), in process."""
    script = load_script(EXAMPLE, monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        script.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err




@pytest.mark.parametrize(("name", "outer"), [("deft-adacomm", "average"), ("deft-diloco-ada", "diloco")])
def test_bench_peers_adacomm_schemes_parse_to_local_steps_with_the_adacomm_period(
        name: str, outer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    scheme = load_script(REPO / "benchmarks" / "bench_peers.py", monkeypatch).SCHEMES[name]
    args = load_script(EXAMPLE, monkeypatch).parse_args(list(scheme.argv))
    assert (args.ddp, args.local_steps, args.local_period, args.local_outer) == ("deft", 16, "adacomm", outer)
    assert scheme.links == 2 and "AdaComm" in scheme.label and "H <= 16" in scheme.label
    assert ("DiLoCo" in scheme.label) == (outer == "diloco")


def test_cosine_lr_schedule_decays_to_zero_and_needs_a_torch_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    # train_cnn.py --lr-schedule cosine: lr_0 (1 + cos(pi t / T)) / 2 after t of T optimizer steps
    import torch

    example = load_script(EXAMPLE, monkeypatch)
    assert example.lr_schedule("constant", None, 4) is None
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.02)
    schedule = example.lr_schedule("cosine", sgd, 4)
    lrs = []
    for _ in range(4):
        sgd.step()
        schedule.step()
        lrs.append(sgd.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.02 * (1 + math.cos(math.pi * t / 4)) / 2 for t in (1, 2, 3, 4)], abs=1e-12)
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(SystemExit, match="--lr-schedule cosine needs a torch optimizer"):
        example.lr_schedule("cosine", object(), 4)
    # bench_peers hands the schedule to every CNN run
    peers = load_script(REPO / "benchmarks" / "bench_peers.py", monkeypatch)
    import argparse

    args = argparse.Namespace(epochs=2, lr_schedule="cosine", eval_every=11, skip_iters=12, batch_size=32, lr=0.02)
    argv = peers.WORKLOADS["cnn"].argv(args, 3)
    assert argv[argv.index("--lr-schedule") + 1] == "cosine"
    # ... and its report names the schedule the runs recorded (older records: constant), never a mix
    assert peers.run_lr_schedule([{"summary": {"lr_schedule": "cosine"}}] * 2) == "cosine"
    assert peers.run_lr_schedule([{"summary": {}}]) == "constant"
    with pytest.raises(SystemExit, match="mix learning-rate schedules"):
        peers.run_lr_schedule([{"summary": {"lr_schedule": "cosine"}}, {"summary": {}}])


ITERS = 12


def torchrun(tmp_path: Path, *extra: str, **extra_env: str) -> dict[str, Any]:
    return run([*TINY, "--max-iters", str(ITERS), "--eval-every", "6", *extra], tmp_path, **extra_env)


@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "updates"), [
    # accum2: a step at every 2nd iteration only
    ("accum2", [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]),
    # localsgd: a (local) step every iteration; parameters are averaged every 4th step on top
    ("localsgd", list(range(1, ITERS + 1))),
    # powersgd: a step every iteration; compression from iteration 2 on (10 % of 12, at least 2)
    ("powersgd", list(range(1, ITERS + 1))),
])
def test_torch_scheme_trains_and_steps_as_documented(tmp_path: Path, scheme: str, updates: list[int]) -> None:
    doc = torchrun(tmp_path, "--ddp", scheme)
    s = doc["summary"]
    assert s["ddp"] == scheme and s["world_size"] == 2 and s["iters"] == ITERS
    assert [r["updates"] for r in doc["iters"]] == updates
    assert s["updates_per_iter"] == pytest.approx(updates[-1] / ITERS)
    assert all(math.isfinite(r["loss"]) for r in doc["iters"])
    first, last = doc["iters"][0]["loss"], sum(r["loss"] for r in doc["iters"][-3:]) / 3
    assert last < first  # it learns
    if scheme == "powersgd":
        assert s["scheme"]["start_powerSGD_iter"] == 2 and s["scheme"]["matrix_approximation_rank"] == 4
    if scheme == "localsgd":
        assert s["scheme"]["period"] == 4 and s["scheme"]["warmup_steps"] == 1  # round(1.2) = 1


@pytest.mark.slow
@pytest.mark.parametrize(("compression", "codec", "wire_ok", "settings"), [
    ("fp16", "fp16", lambda wire, nbytes: wire == 0.5 * nbytes, {}),  # 2 of 4 bytes per element
    # PowerSGD rank 4 on the TINY CNN: its profile says what went on the wire; far below half of it. Same
    # settings as the torch powersgd scheme: compression from iteration 2 (10 % of 12, at least 2).
    ("powersgd", "powersgd (rank 4)", lambda wire, nbytes: wire < 0.25 * nbytes,
     {"start_powerSGD_iter": 2, "matrix_approximation_rank": 4}),
])
def test_deft_with_compression_trains_on_a_compressed_profile(tmp_path: Path, compression: str, codec: str,
                                                             wire_ok: Any, settings: dict[str, int]) -> None:
    # epsilon 0: the lag-free plan, one update per iteration (benchmarks run deft's default config)
    doc = torchrun(tmp_path, "--ddp", "deft", "--compression", compression, "--epsilon", "0")
    s = doc["summary"]
    assert s["ddp"] == "deft" and s["iters"] == ITERS and s["compression"] == compression
    assert [r["updates"] for r in doc["iters"]] == list(range(1, ITERS + 1))
    assert all(math.isfinite(r["loss"]) for r in doc["iters"])
    first, last = doc["iters"][0]["loss"], sum(r["loss"] for r in doc["iters"][-3:]) / 3
    assert last < first  # it learns
    prof = s["schedule"]["profile"]
    assert prof["schema"] == 2 and prof["codec"] == codec
    wire = sum(b["wire_nbytes"] for b in prof["buckets"])
    nbytes = sum(b["nbytes"] for b in prof["buckets"])
    assert wire_ok(wire, nbytes), (wire, nbytes)
    assert {k: s.get(k) for k in settings} == settings
    assert all(b["codec_s"] > 0 for b in prof["buckets"])


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "scheme", "extra_env"), [
    # DiLoCo with H = 4: a local step every iteration, outer steps after iterations 4, 8 and 12
    (["--ddp", "diloco", "--diloco-h", "4"],
     {"H": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True, "bucket_cap_mb": None,
      "outer_steps": 3}, {}),
    # the same with the pseudo-gradients all-reduced in buckets of 0.05 MiB (the TINY CNN has 0.3 MiB)
    (["--ddp", "diloco", "--diloco-h", "4", "--bucket-cap-mb", "0.05"],
     {"H": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True, "bucket_cap_mb": 0.05,
      "outer_steps": 3}, {}),
    # post-local SGD at period 8: warm-up round(1.2) = 1 iteration of global all-reduce
    (["--ddp", "localsgd", "--localsgd-period", "8"],
     {"hook": "post_localSGD_hook", "period": 8, "warmup_steps": 1}, {}),
    # deft's local-steps mode, DiLoCo's outer step, H 4: no warm-up (as the diloco scheme), overlap 1 step
    (["--ddp", "deft", "--local-steps", "4", "--local-outer", "diloco"],
     {"epsilon": 0.01, "links": [{"name": "primary", "backend": "auto", "ifname": None}], "local_steps": 4,
      "local_outer": "diloco", "local_warmup_iters": 0, "local_overlap": True, "local_overlap_iters": 1,
      "local_period": "fixed", "local_outer_lr": 0.7, "local_outer_momentum": 0.9}, {}),
    # the same mode with the AdaComm period (H <= 4), post-local SGD: warm-up round(1.2) = 1 iteration
    (["--ddp", "deft", "--local-steps", "4", "--local-period", "adacomm"],
     {"epsilon": 0.01, "links": [{"name": "primary", "backend": "auto", "ifname": None}], "local_steps": 4,
      "local_outer": "average", "local_warmup_iters": 1, "local_overlap": True, "local_overlap_iters": 1,
      "local_period": "adacomm"}, {}),
    # torch DDP on two gloo devices (bench_peers' torch-2nic; loopback twice stands in for two NICs)
    (["--ddp", "torch", "--bucket-cap-mb", "0.05"], {"bucket_cap_mb": 0.05}, {"GLOO_SOCKET_IFNAME": "lo,lo"}),
])
def test_bench_peers_slow_link_schemes_run_and_learn(tmp_path: Path, argv: list[str], scheme: dict[str, Any],
                                                   extra_env: dict[str, str]) -> None:
    doc = torchrun(tmp_path, *argv, **extra_env)
    s = doc["summary"]
    assert s["ddp"] == argv[1] and s["world_size"] == 2 and s["iters"] == ITERS
    assert s["scheme"] == scheme
    if scheme.get("local_period") == "adacomm":  # H_0 chosen at the first averaging point, after step 1 + 4 - 1
        ada = s["schedule"]["plan_info"]["local_steps"]["adacomm"]
        assert 1 <= ada["H0"] <= 4 and ada["history"][0]["step"] == 4 and ada["F0"] is not None
    assert [r["updates"] for r in doc["iters"]] == list(range(1, ITERS + 1))  # a (local) step every iteration
    assert all(math.isfinite(r["loss"]) for r in doc["iters"])
    first, last = doc["iters"][0]["loss"], sum(r["loss"] for r in doc["iters"][-3:]) / 3
    assert last < first  # it learns
