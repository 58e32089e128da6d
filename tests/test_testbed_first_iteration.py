"""The first iteration's own sends on shaped links: where the links are the bound even in
16 bits, deft's default sends them in int8 from the first gradient, judges them on a sample once they
are all out and keeps them (the update within int8's rounding of the exact one), or, int8 refused,
sends them again in fp16 and computes what torch DDP with torch's fp16 hook computes in its first
iteration; the profile iterations after it go int8 where the sample passes it. On loopback the
links are never the bound, so this branch of
:mod:`deft.runtime.codecs.first_iteration` runs only here, on the testbed (two hosts, two 50 Mbit/s links).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from deft.testbed import Testbed
from tests._dist import free_port
from tests._netns import NETNS_REASON, can_netns, skip_netns_when_refused

ROOT = Path(__file__).resolve().parents[1]
EPS_FP16_NOT_INT8 = 1e-5


@pytest.fixture(autouse=True)
def _skip_netns_when_refused(request: pytest.FixtureRequest) -> None:
    skip_netns_when_refused(request)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def _reports(epsilon: float, env: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Both ranks' reports (tests/_testbed_worker.py) of a run at 2 x 50 Mbit/s whose profile outlasts it."""
    with Testbed(hosts=2, links=2, rate_mbit=50) as tb:
        # the profile longer than the run: every iteration is a synchronous one, the maths known
        config = tb.write_config(epsilon=epsilon, warmup_iters=1, profile_iters=8, timeout_s=120)
        port = free_port()
        procs = [tb.popen(h, [sys.executable, "-m", "tests._testbed_worker"],
                          env={**tb.env_for(h, h, 2, port, config), **(env or {})},
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in range(2)]
        outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert a["record"] == b["record"]
    return a, b


def _first_iterations(epsilon: float) -> tuple[dict, dict]:
    a, b = _reports(epsilon)
    assert a["first_sums"] == b["first_sums"]  # the ranks decoded the same bytes
    return a, b


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_links_the_bound_even_in_16_bits_send_the_first_iteration_in_int8_within_its_bound() -> None:
    a, b = _first_iterations(epsilon=0.01)
    first = a["record"]["first"]
    # 8.8 MB of gradient over two 50 Mbit/s links against milliseconds of compute: coded, and 4.4 MB in
    # 16 bits still far above the compute, so the sends went in int8 from the first gradient and stood
    assert first["speculative"] == "int8" and first["codec"] == "int8", first
    assert "the gradients' all-reduce predicts" in first["reason"] and "stand" in first["reason"], first
    # the links the bound: the exact all-reduce outlasts the compute (the screen itself priced its 16 bits
    # beyond the compute; by how much depends on the machine's speed when the first iteration ran)
    assert first["exposed_s"] > first["compute_s"]
    # the update: the exact one's within int8's rounding, and not the exact one
    for r in (a, b):
        assert 0 < r["vs_ref_abs"] <= r["int8_bound"], (r["vs_ref_abs"], r["int8_bound"])
    # the profile iterations: int8 too (the same sample accepts it)
    assert a["record"]["codec"] == "int8" and "int8, as the first iteration's sends" in a["record"]["reason"]


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_int8_refused_on_the_sample_sends_the_first_iteration_again_as_torch_ddps_fp16_hook() -> None:
    # an epsilon that fp16's bound (~1e-6 of the noise) passes and int8's (~1e-3 on this model's sample) does not
    a, b = _first_iterations(epsilon=EPS_FP16_NOT_INT8)
    first = a["record"]["first"]
    assert first["speculative"] == "int8" and first["codec"] == "fp16", first
    assert "the sends went in int8, refused" in first["reason"], first
    assert a["record"]["codec"] == "fp16"  # the profile iterations: int8 refused on the same sample
    assert a["vs_ref"] < 1e-5 and b["vs_ref"] < 1e-5, (a["vs_ref"], b["vs_ref"])


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_links_the_bound_even_in_16_bits_the_plan_sends_int8_and_the_ranks_agree() -> None:
    """Two 50 Mbit/s links, 8.8 MB of gradient, 16 samples a rank: fp16's 4.4 MB still take far longer
    than the compute, so the default's plan prices int8, the preserver accepts it and the plan takes it;
    the ranks decode the same bytes, so their parameters stay equal bit for bit."""
    with Testbed(hosts=2, links=2, rate_mbit=50) as tb:
        # any prediction error calibrates (tolerance 1e-6)
        config = tb.write_config(epsilon=0.01, warmup_iters=1, profile_iters=2, timeout_s=120, adapt_window=2,
                                 adapt_tolerance=1e-6)
        port = free_port()
        procs = [tb.popen(h, [sys.executable, "-m", "tests._testbed_worker"],
                          env={**tb.env_for(h, h, 2, port, config), "DEFT_TEST_PLAN": "1"},
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in range(2)]
        outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert a["codecs"] == b["codecs"] and a["sums"] == b["sums"]
    record = a["codecs"]
    assert record["codec"] == "int8" and record["coded"], record
    int8 = next(v for v in record["verdicts"] if v["codec"] == "int8")
    assert int8["accepted"] and int8["delta"] < 0.02, int8
    alternatives = {c["codec"]: c["chosen_s"] for c in record["alternatives"]}
    assert alternatives["int8"] < 0.97 * alternatives["fp16"]
    assert a["codecs_seen"][a["t0"]] in (["int8"], ["", "int8"])  # the plan's (the adaptation may change them)
    assert a["t0"] < 10  # most iterations ran the plan
    # before it: the profile iterations in int8 (the first iteration's sample passed it) and the
    # iterations run while rank 0 planned kept it (the whole statistics still pass it)
    assert a["profile_codec"] == "int8"
    before_plan = a["codecs_seen"][1:a["t0"] - 1]
    assert len(before_plan) >= 3 and all(c == ["int8"] for c in before_plan), a["codecs_seen"]
    assert all(math.isfinite(v) for v in a["losses"])
    # the adaptation makes the codec choice again on each calibration (a live run wires the first plan's
    # exact profile, codec inputs and decision into it: the choice itself, on given calibrations, is
    # tests/test_runtime_adapt.py's); every rank got the same decisions and, through any switch, kept the
    # same parameters (the sums above). Whether the first window calibrates and re-plans, settles or goes
    # back to the warm-up's schedule is the machine's load's to say (deft.runtime.adapt, steps 1 and 4);
    # every one that re-planned made the choice again.
    assert record["again"] is True, record
    assert a["adapt"] == b["adapt"] and a["adapt"], a["adapt"]
    replanned = [r for r in a["adapt"] if "new_schedule" in r]
    assert all(r["codecs"]["codec"] in ("int8", "fp16") and isinstance(r["codecs"]["changed"], bool)
               for r in replanned), replanned


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_an_overflowing_first_step_sent_in_int8_goes_again_exact_as_torch_ddp() -> None:
    """torch's documented AMP loop (GradScaler, unscale_, clip_grad_norm_ with its norm logged) whose first
    step overflows on rank 0: the first iteration's sends went in int8, the gathered sample is infinite,
    so they are sent again exact; GradScaler skips that step on every rank, and the scale, the logged
    norms and the parameters are torch DDP's."""
    a, b = _reports(0.01, {"DEFT_TEST_OVERFLOW": "1"})
    first = a["record"]["first"]
    assert first["speculative"] == "int8" and first["codec"] == "" and "no usable sample" in first["reason"], first
    assert a["record"]["codec"] == ""  # nothing judged on it: the profile iterations exact
    assert a["skipped"] == b["skipped"] == [0]
    for r in (a, b):
        assert r["norms"][0] in ("inf", "nan") and r["norms"] == r["ref_norms"], (r["norms"], r["ref_norms"])
        assert r["scales"][0] == r["scales"][1] < 2.0 ** 10  # backed off once, as torch DDP's
    assert a["vs_torch"] < 1e-5 and b["vs_torch"] < 1e-5, (a["vs_torch"], b["vs_torch"])
