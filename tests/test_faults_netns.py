"""A link that slows during a live run, on the testbed (two hosts, two 100 Mbit/s links).

``tc`` reshapes the second link to a fifth of its rate once the adaptation has settled on the first plan
(at iteration ``SLOW`` or, where it settles later, ``SETTLED_FOR`` iterations after its settling window)
and back ``RECOVER - SLOW`` iterations later, triggered from outside while the ranks train
(tests/_faults_slow_worker.py, deft at epsilon 0 after torch DDP in the same ranks). Whatever the
adaptation does, the run must finish with every gradient applied once and torch DDP's parameters. The
adaptation sees the slow link: it re-opens and re-plans within ``BOUND`` iterations on a profile that
prices the second link slower than the primary (deft.runtime.link_timing), and follows it back when it
recovers.

Both links slowed twentyfold as the first plan starts (rank 0 holds until ``tc`` has returned; deft's
default codec choice, a batch whose compute hides the sends on the fast links): the plan loses to the
warm-up's synchronous schedule timed on the fast links and the run goes back to it; back on it, it runs
slower than the time it was chosen on, and that re-opens the adaptation (link_timing.Watch,
``chosen_on``), which calibrates on the links as they are now, on which the links are the bound in 16
bits: int8, not measured for the first plan, is measured by every rank and chosen in the next window.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deft.runtime.link_timing import REOPEN_WINDOWS
from deft.solver.codecs import INT8_MIN_GAIN
from deft.testbed import Testbed
from tests._dist import free_port
from tests._netns import NETNS_REASON, can_netns, skip_netns_when_refused

ROOT = Path(__file__).resolve().parents[1]
RATE_MBIT = 100.0
FACTOR = 5.0
SLOW = 22      # the adaptation has usually settled by then
RECOVER = 38
WINDOW = 3     # iterations measured per window; a window spans one more (its first forward starts the clock)
SETTLED_FOR = 2 * (WINDOW + 1)  # the window after the settling one is the watch's baseline when it switched
LAG = 2        # plan_lag_iters: rank 0 re-plans in the background for at most this many iterations
# the window the change lands in, REOPEN_WINDOWS drifting ones, the planner's lag, a cycle boundary
BOUND = (REOPEN_WINDOWS + 1) * (WINDOW + 1) + LAG + 2
STEPS = RECOVER + BOUND + 16  # room for an adaptation that settles up to 16 iterations later than usual
DEADLINE_S = 300.0
# the slowed-at-install run: the plan, the way back, the re-opened episode, int8 measured and weighed;
# a batch whose compute hides the sends on the fast links, not on the slowed ones
# (the batch's compute is about twice the 16-bit all-reduce on the fast links: at half that, int8 was
# weighed for the first plan in some runs on a busy machine; the steps leave a window or two of room
# after the re-opened one, where the plan it tries first may go back before the choice with int8)
INSTALL_STEPS, INSTALL_BATCH, INSTALL_RATE_MBIT, INSTALL_FACTOR = 56, 1024, 1000.0, 20.0
# the exact run: the way back and the re-opened episode only (asserted within BOUND of the way back, itself
# an adaptation window after the plan), on slowed links where every further iteration is slow
EXACT_STEPS = 30

#: every test here runs ranks in the testbed's network namespaces
pytestmark = [pytest.mark.slow, pytest.mark.netns,
              pytest.mark.skipif(not can_netns, reason=NETNS_REASON)]


@pytest.fixture(autouse=True)
def _skip_netns_when_refused(request: pytest.FixtureRequest) -> None:
    skip_netns_when_refused(request)


def _run(tb: Testbed, work: Path, config: Path, steps: int, poll: Callable[[], None],
         hold: bool = False, batch: int = 16, int8_fails: bool = False) -> list[dict[str, Any]]:
    """Both ranks of tests._faults_slow_worker on ``tb``, ``poll()`` called while they run (``hold``: rank 0
    waits after the first plan is installed until ``work / "hold"`` is removed; ``int8_fails``: measuring
    int8 raises on every rank); both ranks' reports."""
    port = free_port()
    env = {"FAULTS_STEPS": str(steps), "FAULTS_PROGRESS": str(work / "progress"), "FAULTS_BATCH": str(batch),
           **({"FAULTS_HOLD": str(work / "hold")} if hold else {}),
           **({"FAULTS_INT8_FAILS": "1"} if int8_fails else {})}
    logs = [(work / f"out{h}", work / f"err{h}") for h in range(2)]
    with contextlib.ExitStack() as files:
        procs = [tb.popen(h, [sys.executable, "-m", "tests._faults_slow_worker"],
                          env={**tb.env_for(h, h, 2, port, config), **env}, cwd=ROOT,
                          stdout=files.enter_context(out.open("w")), stderr=files.enter_context(err.open("w")))
                 for h, (out, err) in enumerate(logs)]
        deadline = time.monotonic() + DEADLINE_S
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, f"the run did not finish within {DEADLINE_S:.0f} s"
            poll()
            time.sleep(0.02)
    for p, (_, err) in zip(procs, logs, strict=True):
        assert p.returncode == 0, err.read_text(encoding="utf-8")[-3000:]
    return [json.loads(out.read_text(encoding="utf-8").strip().splitlines()[-1]) for out, _ in logs]


def _progress(progress: Path) -> tuple[int, int]:
    """(the iterations rank 0 has finished, the iteration whose window last settled its adaptation or -1)."""
    done, settled = progress.read_text(encoding="utf-8").split()  # written whole (rank 0 replaces the file)
    return int(done), int(settled)


def _faults_landed(reports: list[dict[str, Any]], events: list[tuple[str, int]]) -> tuple[int, int]:
    """The iterations rank 0 had finished when the link slowed and recovered, once both faults landed with
    room after each for the adaptation to follow it (the link slows only once the adaptation settled)."""
    decisions = [(r["iteration"], r.get("decision"), r["settled"]) for r in reports[0]["plan_info"].get("adapt", [])]
    assert [what for what, _ in events] == ["slow", "recover"], (events, decisions)
    assert SLOW <= events[0][1] < events[1][1] and events[1][1] + BOUND <= STEPS, (events, decisions)
    return events[0][1], events[1][1]


def _live_slowdown(work: Path) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
    """Both ranks' reports, and (what, the iteration rank 0 had finished when ``tc`` returned)."""
    progress = work / "progress"
    progress.write_text("0 -1", encoding="utf-8")
    events: list[tuple[str, int]] = []
    with Testbed(hosts=2, links=2, rate_mbit=RATE_MBIT, prefix="faultt") as tb:
        # planner_nice 0 and the greedy knapsacks: rank 0's planning thread keeps pace on a busy machine
        # (its time is not under test here)
        config = tb.write_config(epsilon=0.0, bucket_cap_mb=0.5, adapt_window=WINDOW, timeout_s=120, planner_nice=0,
                                 solver="greedy", plan_lag_iters=LAG)

        def poll() -> None:
            done, settled = _progress(progress)
            if not events and done >= SLOW and 0 <= settled <= done - SETTLED_FOR:
                tb.reshape(1, RATE_MBIT / FACTOR)
                events.append(("slow", _progress(progress)[0]))
            elif len(events) == 1 and done >= events[0][1] + RECOVER - SLOW:
                tb.reshape(1, RATE_MBIT)
                events.append(("recover", _progress(progress)[0]))

        reports = _run(tb, work, config, STEPS, poll)
    return reports, events


def _slowed_at_install(work: Path, exact: bool = False, int8_fails: bool = False
                       ) -> tuple[list[dict[str, Any]], int]:
    """Both links slowed right after the first plan is installed: both ranks' reports, and the iteration
    rank 0 had finished when ``tc`` returned. Default: deft's default codec choice, links at
    ``INSTALL_RATE_MBIT`` that the compute of ``INSTALL_BATCH`` samples hides, slowed ``INSTALL_FACTOR``-fold;
    ``exact``: epsilon 0 on the small batch's 100 Mbit/s links, slowed ``FACTOR``-fold, for
    ``EXACT_STEPS`` iterations."""
    progress, hold = work / "progress", work / "hold"
    progress.write_text("0 -1", encoding="utf-8")
    slowed: list[int] = []
    rate, factor = (RATE_MBIT, FACTOR) if exact else (INSTALL_RATE_MBIT, INSTALL_FACTOR)
    with Testbed(hosts=2, links=2, rate_mbit=rate, prefix="faulti") as tb:
        # deft's default codec choice: on the fast links the compute hides the sends, and int8 is not measured
        config = tb.write_config(bucket_cap_mb=0.5, adapt_window=WINDOW, timeout_s=120, planner_nice=0,
                                 solver="greedy", plan_lag_iters=LAG, **({"epsilon": 0.0} if exact else {}))

        def poll() -> None:
            if not slowed and hold.exists():
                for link in range(2):
                    tb.reshape(link, rate / factor)
                slowed.append(_progress(progress)[0])
                hold.unlink()

        reports = _run(tb, work, config, EXACT_STEPS if exact else INSTALL_STEPS, poll, hold=True,
                       batch=16 if exact else INSTALL_BATCH,
                       int8_fails=int8_fails)
    assert slowed, "the first plan was never installed"
    return reports, slowed[0]


def _work(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory the ranks (in the hosts' namespaces) can write their files to."""
    work = tmp_path_factory.mktemp(name)
    work.chmod(0o755)
    return work


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
    return _live_slowdown(_work(tmp_path_factory, "slowed"))


def test_a_link_slowed_mid_run_loses_no_gradient_and_keeps_torch_ddps_parameters(
        slowed_run: tuple[list[dict[str, Any]], list[tuple[str, int]]]) -> None:
    reports, events = slowed_run
    _faults_landed(reports, events)
    for r in reports:
        assert r["merged"] == list(range(STEPS))  # every iteration's gradient applied, once
        assert r["vs_torch"] < 1e-5, r["vs_torch"]
    for key in ("source", "t0", "adapt", "switches"):  # the ranks agreed (rank 0's planning times aside)
        assert reports[0]["plan_info"].get(key) == reports[1]["plan_info"].get(key), key


def test_the_adaptation_replans_on_a_slowed_link_within_a_bounded_number_of_iterations(
        slowed_run: tuple[list[dict[str, Any]], list[tuple[str, int]]]) -> None:
    reports, events = slowed_run
    slowed_at, recovered_at = _faults_landed(reports, events)
    info = reports[0]["plan_info"]
    timeline = (info.get("replans"), info.get("switches"), info.get("adapt"))
    assert info.get("replans") == reports[1]["plan_info"].get("replans")  # every rank offered the same
    # re-opened by the slow link, re-planned within BOUND iterations, with the second link's own factor
    slowed = [r for r in info.get("replans", []) if slowed_at < r["iteration"] <= slowed_at + BOUND]
    assert slowed and slowed[0]["episode"] >= 1 and "'second'" in slowed[0]["reason"], timeline
    assert slowed[0]["link_factors"]["second"] > 2.0, timeline
    decided = [r for r in info["adapt"] if r["iteration"] == slowed[0]["iteration"]]
    assert decided and decided[0]["profile_corrected"] is True, timeline  # the re-plan's profile runs
    switched = [s for s in info.get("switches", []) if s.get("source") == "adapt" and s["iteration"] > slowed_at]
    assert switched and switched[0]["iteration"] <= slowed_at + BOUND, timeline
    # the re-plan's profile prices the second link (per byte) at least 2.5x slower against the primary
    # than the profile before the fault did: the slow link's measured rate, within a factor of 2 of 1/5
    # (read where that re-plan corrected it: a later window of the same episode may calibrate it again on
    # a plan that moved most bytes off the slow link, whose few sends then cross it partly in the tbf
    # burst and read faster than its rate)
    ratios = reports[0]["ratios"]
    before, after = ratios[slowed_at - 1], ratios[slowed[0]["iteration"] - 1]
    assert before is not None and after is not None
    assert after >= 2.5 * before, (before, after, timeline)
    # and back: the link recovers and the adaptation re-opens (a later episode) once it is free to: at
    # the recovery, or where the slow episode still decided then, at its last decision (settled by going
    # back to a schedule measured on the slow link, the watch compares with that measurement:
    # link_timing.Watch); the plan follows within BOUND iterations
    slow_ends = max(r["iteration"] for r in info["adapt"] if r.get("episode") == slowed[0]["episode"])
    free_at = max(recovered_at, slow_ends)
    assert free_at + BOUND <= STEPS, (free_at, timeline)
    back = [r for r in info.get("replans", [])
            if r["episode"] > slowed[0]["episode"] and free_at < r["iteration"] <= free_at + BOUND]
    assert back, (free_at, timeline)
    assert any(s.get("source") == "adapt" and free_at < s["iteration"] <= free_at + BOUND
               for s in info.get("switches", [])), (free_at, timeline)
    # the re-plan that followed it back prices the second link near its price before the fault, far from
    # the slowed one (FACTOR): within 2x, not within the 1.5x it once was. The plan it re-plans from sends
    # few bytes on that link, whose time per byte then reads off its rate either way (a CI run read it
    # 1.58x the primary, unloaded; benchmarks/results/faults.md, "Where deft loses")
    back_ratio = ratios[back[0]["iteration"] - 1]  # the profile that decision corrected, read after its step
    assert back_ratio is not None and back_ratio <= 2.0 * before, (before, back_ratio, timeline)


def _timeline(info: dict[str, Any]) -> str:
    """rank 0's adaptation and switches, one line each: a failure message pytest prints whole."""
    verdicts = info.get("codecs", {}).get("verdicts", [])
    lines = [f"codec verdicts before the plan: {[v['codec'] for v in verdicts]}"]
    for r in info.get("adapt", []):
        codecs = r.get("codecs", {})
        lines.append(f"adapt {r['iteration']}: {r.get('decision')}; reopened: {r.get('reopened')}; "
                     f"comm_factor {r.get('comm_factor')}; codecs: {codecs.get('codec')} {codecs.get('int8', '')}")
    lines += [f"switch {s['iteration']}: {s.get('from')} -> {s.get('to')} ({s.get('source')}, {s.get('layout')})"
              for s in info.get("switches", [])]
    return "\n".join(lines)


def _agreed(reports: list[dict[str, Any]], steps: int = INSTALL_STEPS) -> tuple[dict[str, Any], str]:
    """rank 0's ``plan_info`` and its timeline, once every iteration's gradient is found applied exactly
    once on each rank (``steps`` of them) and the ranks' records agree."""
    for r in reports:
        assert r["merged"] == list(range(steps))  # every iteration's gradient applied, once
    for key in ("t0", "adapt", "switches", "replans"):
        assert reports[0]["plan_info"].get(key) == reports[1]["plan_info"].get(key), key
    info = reports[0]["plan_info"]
    return info, _timeline(info)


@pytest.fixture(scope="module")
def slowed_at_install(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], int]:
    return _slowed_at_install(_work(tmp_path_factory, "slowed_at_install"))


def test_at_epsilon_0_links_slowed_as_the_plan_starts_reopen_with_torch_ddps_parameters(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    reports, slowed_at = _slowed_at_install(_work(tmp_path_factory, "slowed_at_install_exact"), exact=True)
    info, timeline = _agreed(reports, EXACT_STEPS)
    for r in reports:
        assert r["vs_torch"] < 1e-5, r["vs_torch"]  # through the way back and the re-opened episode
    assert slowed_at == info["t0"], timeline
    back = [s for s in info["switches"] if s.get("layout") == "warm-up"]
    assert back and back[0]["source"] == "adapt", timeline
    reopened = [r for r in info["adapt"] if "the warm-up's schedule measures" in r.get("reopened", "")]
    assert reopened and reopened[0]["iteration"] <= back[0]["iteration"] + BOUND, timeline
    assert reopened[0]["schedule"] == back[0]["to"] and reopened[0]["comm_factor"] > 2.0, timeline


def test_an_int8_measurement_that_fails_leaves_the_choice_to_16_bits(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # The scenario below, but measuring int8 raises DeftError on every rank (injected in the worker): the
    # adaptation records it unmeasured and goes on; no later choice weighs int8, every gradient is applied once.
    reports, _ = _slowed_at_install(_work(tmp_path_factory, "slowed_at_install_int8_fails"), int8_fails=True)
    info, timeline = _agreed(reports)
    asked = [r for r in info["adapt"] if "int8_measured" in r]
    assert asked and asked[0]["int8_measured"] is False, timeline
    later = [r["codecs"]["codec"] for r in info["adapt"] if r["iteration"] > asked[0]["iteration"] and "codecs" in r]
    assert "int8" not in later, timeline


def test_links_slowed_as_the_plan_starts_reopen_the_adaptation_and_bring_int8_in(
        slowed_at_install: tuple[list[dict[str, Any]], int]) -> None:
    reports, slowed_at = slowed_at_install
    info, timeline = _agreed(reports)
    assert slowed_at == info["t0"], timeline  # the links slowed before the plan's first iteration ended
    assert all(v["codec"] != "int8" for v in info["codecs"]["verdicts"]), timeline  # not weighed on the fast links
    # The plan's first window, on the slowed links, loses to the warm-up's time on the fast ones: back to it.
    back = [s for s in info["switches"] if s.get("layout") == "warm-up"]
    assert back and back[0]["source"] == "adapt", timeline
    # Back on it, it measures slower than it was chosen on: the adaptation re-opens within BOUND
    # iterations and calibrates on the links as they are now (priced slower than profiled) ...
    reopened = [r for r in info["adapt"] if "the warm-up's schedule measures" in r.get("reopened", "")]
    assert reopened and reopened[0]["iteration"] <= back[0]["iteration"] + BOUND, timeline
    first = reopened[0]
    assert first["schedule"] == back[0]["to"] and first["comm_factor"] > 2.0, timeline
    # ... on which the links are the bound in 16 bits: int8, which the first plan did not weigh, is
    # measured by every rank, and the next window chooses the codecs again with it
    assert "measured next" in first["codecs"]["int8"] and first["int8_measured"] is True, timeline
    # (or the one after it, where the plan tried meanwhile measured slower and the run went back first)
    chosen = [r for r in info["adapt"] if r["iteration"] > first["iteration"] and "codecs" in r]
    assert chosen and chosen[0]["iteration"] <= first["iteration"] + 2 * (WINDOW + 1 + LAG), timeline
    assert "chosen again" in chosen[0]["decision"], timeline
    # weighed on its measured cost against 16 bits, by the rule: int8 where it predicts INT8_MIN_GAIN more
    # (on this busy 2-core host its cast's measured cost decides which side of the rule a run falls on)
    # (or not weighed, the record saying why: 16 bits already within INT8_MIN_GAIN of a floor)
    codecs = chosen[0]["codecs"]
    weighed = codecs.get("weighed", {})
    assert "int8" in weighed or codecs.get("int8", "").startswith("not weighed:"), (codecs, timeline)
    gains = "int8" in weighed and weighed["int8"] < (1.0 - INT8_MIN_GAIN) * min(
        v for c, v in weighed.items() if c != "int8")
    assert (codecs["codec"] == "int8") == gains, (codecs, timeline)
    assert any(s["iteration"] >= chosen[0]["iteration"] for s in info["switches"]), timeline  # and runs it
    # and int8, brought in, runs: at that choice or at a later one of the run
    assert any(r["codecs"].get("codec") == "int8" for r in chosen), timeline
