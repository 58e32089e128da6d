"""The first iteration's own sends on shaped links (issue 28): where the links are the bound, deft's
default sends them in fp16 from the first gradient, judges them on a sample once they are all out,
keeps them, and computes what torch DDP with torch's fp16 hook computes in its first iteration; the
profile iterations after it go int8, the links being the bound even in 16 bits. On loopback the
links are never the bound, so this branch of
:mod:`deft.runtime.codec_choice` runs only here, on the testbed (two hosts, two 50 Mbit/s links).
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


@pytest.fixture(autouse=True)
def _skip_netns_when_refused(request: pytest.FixtureRequest) -> None:
    skip_netns_when_refused(request)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_links_the_bound_send_the_first_iteration_in_fp16_as_torch_ddps_fp16_hook() -> None:
    with Testbed(hosts=2, links=2, rate_mbit=50) as tb:
        # the profile longer than the run: every iteration is a synchronous one, the maths known
        config = tb.write_config(epsilon=0.01, warmup_iters=1, profile_iters=8, timeout_s=120)
        port = free_port()
        procs = [tb.popen(h, [sys.executable, "-m", "tests._testbed_worker"], env=tb.env_for(h, h, 2, port, config),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in range(2)]
        outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert a["record"] == b["record"]
    first = a["record"]["first"]
    # 8.8 MB of gradient over two 50 Mbit/s links against milliseconds of compute: coded
    assert first["codec"] == "fp16" and "the gradients' all-reduce predicts" in first["reason"], first
    assert first["exposed_s"] > 2 * first["compute_s"]
    assert first["speculative"] == "fp16"  # sent from the first gradient on, the verdict kept them
    # the profile iterations: int8 (the same sample accepts it, and 4.4 MB in 16 bits still outweigh the compute)
    assert a["record"]["codec"] == "int8" and "int8: the links stay the bound in 16 bits" in a["record"]["reason"]
    assert a["vs_fp16"] < 1e-5 and b["vs_fp16"] < 1e-5, (a["vs_fp16"], b["vs_fp16"])


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not can_netns, reason=NETNS_REASON)
def test_links_the_bound_even_in_16_bits_the_plan_sends_int8_and_the_ranks_agree() -> None:
    """Two 50 Mbit/s links, 8.8 MB of gradient, 16 samples a rank: fp16's 4.4 MB still take far longer
    than the compute, so the default's plan prices int8, the preserver accepts it and the plan takes it;
    the ranks decode the same bytes, so their parameters stay equal bit for bit."""
    with Testbed(hosts=2, links=2, rate_mbit=50) as tb:
        config = tb.write_config(epsilon=0.01, warmup_iters=1, profile_iters=2, timeout_s=120)
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
    assert a["schedule_codecs"] in (["int8"], ["", "int8"])
    assert a["t0"] < 10  # most iterations ran the plan
    # before it: the profile iterations in int8 (the first iteration's sample passed it) and the
    # iterations run while rank 0 planned kept it (the whole statistics still pass it)
    assert a["profile_codec"] == "int8"
    before_plan = a["codecs_seen"][1:a["t0"] - 1]
    assert len(before_plan) >= 3 and all(c == ["int8"] for c in before_plan), a["codecs_seen"]
    assert all(math.isfinite(v) for v in a["losses"])
