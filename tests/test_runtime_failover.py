"""A link that dies, forced on loopback: the ranks agree it is gone, send its buckets again on the
primary link from the local gradients the failed collective did not touch, re-plan on the links left
and go on, in training or before the first plan (a profile iteration, the probe of the links'
start-up). At epsilon 0 the parameters equal an uninterrupted torch DDP run's, every iteration's
gradient applied once. A checkpoint remembers the lost link: the run resumed from it never sends on it.
A rank whose collective is stuck on the lost link exits without waiting for it. The primary link lost
ends the run with a CommunicationError naming it.

The faults are injected at the link's collective (:class:`Fault`, wrapping ``CommLink.all_reduce`` in the
rank's process, and for the probe ``torch.distributed.all_reduce`` on the link's group): from a chosen
iteration on, a link's all-reduces never complete (a NIC gone between sends), on every rank or one rank
only (the other's real collective then waits for a peer that never comes: a link lost during a send), or
one rank's completes while deft is told it failed (one rank sees a success, the other a failure). Each
run is bounded: a hang fails the test through ``run_ranks``' timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._dist import free_port, run_ranks, values

STEPS = 22  # a loss at 12 is found by 13; the plan without it is collected by 13 + plan_lag_iters
DEADLINE_S = 3.0  # the links' deadline floor in these runs: a wait on a link that long means it is lost


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@dataclass
class Fault:
    """From iteration ``at`` on, ``link``'s all-reduces on ``ranks`` never complete (``mode="hang"``); or the
    first one completes for real while deft is told it failed, the others run as usual (``mode="lie"``).
    ``probe``: the fault hits deft's own one-element all-reduces on the link's group (the probe of its
    start-up after the profile iterations), not its sends."""

    link: str
    at: int
    mode: str = "hang"
    ranks: tuple[int, ...] = (0, 1)
    probe: bool = False


class Injector:
    """Wraps ``CommLink.all_reduce`` and ``torch.distributed.all_reduce`` in this process; :meth:`arm` at each
    iteration's start. A link's group is known by the sends it carried; its one-element all-reduces outside
    a send's launch are the probe."""

    def __init__(self, faults: list[Fault]) -> None:
        from deft.runtime.links import CommLink

        self.faults, self.t, self.lied = faults, -1, False
        self.groups: dict[object, str] = {}  # a link's process group -> the link's name
        self.sending = False  # launching a send (its own dist.all_reduce is a send, not a probe)
        self.original, self.plain = CommLink.all_reduce, dist.all_reduce
        injector = self

        def all_reduce(link: CommLink, tensor: torch.Tensor) -> object:
            return injector.call(link, tensor)

        def direct(tensor: torch.Tensor, *args: object, group: object = None, **kwargs: object) -> object:
            return injector.direct(tensor, group, args, kwargs)

        CommLink.all_reduce = all_reduce  # type: ignore[method-assign,assignment]
        dist.all_reduce = direct  # type: ignore[assignment]

    def arm(self, t: int) -> None:
        self.t = t

    def _fault(self, link: str, probe: bool) -> Fault | None:
        rank = dist.get_rank()
        return next((f for f in self.faults if f.link == link and self.t >= f.at and rank in f.ranks
                     and f.probe == probe), None)

    def _send(self, link: object, tensor: torch.Tensor) -> object:
        return self.sent(lambda: self.original(link, tensor))  # type: ignore[arg-type]

    def sent(self, launch: Callable[[], object]) -> object:
        self.sending = True
        try:
            return launch()
        finally:
            self.sending = False

    def call(self, link: object, tensor: torch.Tensor) -> object:
        self.groups[link.group] = link.name  # type: ignore[attr-defined]
        fault = self._fault(link.name, probe=False)  # type: ignore[attr-defined]
        if fault is None or (fault.mode == "lie" and self.lied):
            return self._send(link, tensor)
        never: torch.futures.Future[object] = torch.futures.Future()
        if fault.mode == "lie":
            self.lied = True
            self._send(link, tensor).wait()  # type: ignore[attr-defined]  # the peer's completes too
            never.set_exception(RuntimeError("injected: the connection was reset"))
        return never

    def direct(self, tensor: torch.Tensor, group: object, args: tuple[object, ...],
               kwargs: dict[str, object]) -> object:
        name = self.groups.get(group)
        if self.sending or name is None or self._fault(name, probe=True) is None:
            return self.plain(tensor, *args, group=group, **kwargs)  # type: ignore[arg-type]
        return torch.futures.Future()  # never completes

    def remove(self) -> None:
        from deft.runtime.links import CommLink

        CommLink.all_reduce = self.original  # type: ignore[method-assign]
        dist.all_reduce = self.plain


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _train(wrapped: nn.Module, model: nn.Module, rank: int, injector: Injector | None = None,
           alone: bool = False, opt: torch.optim.Optimizer | None = None, steps: range = range(STEPS)) -> None:
    """``steps`` (all ``STEPS`` iterations by default); ``alone``: rank 0 evaluates and reads the module's
    state_dict after each step, by itself (deft applies the deferred parameters first, with no collective
    the other rank would miss)."""
    opt = opt if opt is not None else _sgd(model)
    loss_fn = nn.CrossEntropyLoss()
    for step in steps:
        if injector is not None:
            injector.arm(step)
        x, y = _batch(rank, step)
        loss_fn(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
        if alone and rank == 0:
            with torch.no_grad():
                wrapped(x)
            model.state_dict()


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _reference(rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ref = Net()
    _train(nn.parallel.DistributedDataParallel(ref), ref, rank)
    return [p.detach().clone() for p in ref.parameters()]


def _slow_replan() -> None:
    """Rank 0's plan after losing ``second`` but not ``third`` takes 8 s (in this process)."""
    import deft.runtime.planning as planning

    plain = planning.make_schedule

    def slow(cfg: object, profile: object, *args: object, **kwargs: object) -> object:
        names = getattr(profile, "link_names", ())
        if "second" not in names and "third" in names:
            time.sleep(8.0)
        return plain(cfg, profile, *args, **kwargs)  # type: ignore[arg-type]

    planning.make_schedule = slow  # type: ignore[assignment]


@contextlib.contextmanager
def _slow_first_plan(on: bool) -> Iterator[None]:
    """Rank 0's plans on a profile with the ``second`` link take 4 s more (in this process, while on)."""
    import deft.runtime.planning as planning

    plain = planning.make_schedule

    def slow(cfg: object, profile: object, *args: object, **kwargs: object) -> object:
        if "second" in getattr(profile, "link_names", ()):
            time.sleep(4.0)
        return plain(cfg, profile, *args, **kwargs)  # type: ignore[arg-type]

    if on:
        planning.make_schedule = slow  # type: ignore[assignment]
    try:
        yield
    finally:
        planning.make_schedule = plain  # type: ignore[assignment]


def _config(links: list[str], **config: object) -> dict[str, object]:
    return {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "bucket_cap_mb": 0.001, "timeout_s": 60.0,
            "link_deadline_s": DEADLINE_S, "links": [{"name": n} for n in links], **config}


def _deft_run(rank: int, links: list[str], faults: list[Fault], alone: bool = False,
              **config: object) -> tuple[nn.Module, nn.Module]:
    import deft

    torch.manual_seed(0)
    ours = Net()
    ddp = deft.DistributedDataParallel(ours, config=_config(links, **config))
    injector = Injector(faults)
    try:
        _train(ddp, ours, rank, injector, alone)
        ddp.flush()
    finally:
        injector.remove()
    return ddp, ours


RESUME_AT = 2  # the checkpoint: after the step of profile iteration 1, in which ``second`` is lost


def _resumed(rank: int, ref: list[torch.Tensor]) -> dict[str, object]:
    """``second`` lost during a send of profile iteration 1; each rank's state_dicts after its step loaded
    into a fresh wrapper, whose ``second`` works, that trains on to ``STEPS`` (profiling and planning
    again: the checkpoint was taken before the first plan)."""
    import deft

    torch.manual_seed(0)
    first = Net()
    opt = _sgd(first)
    ddp = deft.DistributedDataParallel(first, config=_config(["primary", "second"]))
    injector = Injector([Fault("second", 1, ranks=(0,))])
    try:
        _train(ddp, first, rank, injector, opt=opt, steps=range(RESUME_AT))
    finally:
        injector.remove()
    state = {"ddp": ddp.state_dict(), "opt": opt.state_dict()}
    ddp.close()
    torch.manual_seed(1)
    ours = Net()
    opt = _sgd(ours)
    ddp = deft.DistributedDataParallel(ours, config=_config(["primary", "second"]))
    ddp.load_state_dict(state["ddp"])
    opt.load_state_dict(state["opt"])
    _train(ddp, ours, rank, opt=opt, steps=range(RESUME_AT, STEPS))
    ddp.flush()
    return {"worst": _worst(ours, ref), "merged": sorted(t for _, its in ddp.update_log for t in its),
            "failures": ddp.plan_info.get("link_failures", []), "second": ddp.link_stats["second"]["calls"],
            "links": list(ddp.schedule.links)}


def _worst(ours: nn.Module, ref: list[torch.Tensor]) -> float:
    """The largest difference to ``ref``'s parameters, relative to each parameter's largest element."""
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
               for a, b in zip(ours.parameters(), ref, strict=True))


#: name -> (links, faults, config): the branches of a lost link.
CASES: dict[str, tuple[list[str], list[Fault], dict[str, object]]] = {
    # the NIC goes between two iterations: nothing completes on it any more, on any rank
    "between sends": (["primary", "second"], [Fault("second", 12)], {"alone": True}),
    # one rank's all-reduce completes, the other is told it failed: both must drop it and send again
    "one rank sees a success": (["primary", "second"], [Fault("second", 12, "lie", (0,))], {}),
    # during a send, one rank's end is gone: the other's real all-reduce waits for it until the deadline
    "during a send": (["primary", "second"], [Fault("second", 12, ranks=(0,))], {}),
    # while rank 0 plans in the background: the plan it made with the lost link is not run
    "during the plan": (["primary", "second"], [Fault("second", 5)], {}),
    # the second loss while rank 0 re-plans after the first (its re-plan slowed: SLOW_REPLAN), on a link
    # that re-plan would have used
    "two in a row": (["primary", "second", "third"], [Fault("second", 10), Fault("third", 12)], {}),
    # before the first plan: during a send of the first profile iteration (one rank's end gone) ...
    "in a profile iteration": (["primary", "second"], [Fault("second", 1, ranks=(0,))], {}),
    # ... and in the probe of the links' start-up after the last one (iteration 2's step)
    "in the alpha probe": (["primary", "second"], [Fault("second", 2, ranks=(0,), probe=True)], {}),
    # in the first iteration: the warm-up's layout is made for the links left
    "in the first iteration": (["primary", "second"], [Fault("second", 0, ranks=(0,))], {}),
}
SLOW_REPLAN = {"two in a row"}
#: the first plan (with every link) of rank 0 slowed, so that the loss surely falls while it is made
SLOW_FIRST_PLAN = {"during the plan"}
#: the cases whose loss falls before the first plan is installed: that plan is made on the links left
BEFORE_PLAN = {"during the plan", "in a profile iteration", "in the alpha probe", "in the first iteration"}
#: name -> per loss, whether the re-plan in the background was run (default: the one loss's was)
PLANNED = {"two in a row": [False, True], **{name: [False] for name in BEFORE_PLAN}}
#: name -> per loss, the phase ``plan_info["link_failures"]`` names (default: one loss, in training)
PHASES = {"during the plan": ["waiting for the first plan"], "two in a row": ["training", "training"],
          "in a profile iteration": ["profile iteration"], "in the alpha probe": ["alpha probe"],
          "in the first iteration": ["first iteration"]}


def survive_worker(rank: int, world: int, names: list[str]) -> dict[str, object]:
    ref = _reference(rank)
    out: dict[str, object] = {}
    for name in names:
        links, faults, config = CASES[name]
        if name in SLOW_REPLAN:
            _slow_replan()
        with _slow_first_plan(name in SLOW_FIRST_PLAN):
            ddp, ours = _deft_run(rank, links, faults, **config)
        merged = sorted(t for _, its in ddp.update_log for t in its)
        out[name] = {"worst": _worst(ours, ref), "merged": merged, "failures": ddp.plan_info.get("link_failures", []),
                     "links": list(ddp.schedule.links), "params": [p.sum().item() for p in ours.parameters()]}
    out["resumed"] = _resumed(rank, ref)
    return out


@pytest.fixture(scope="module")
def survived() -> list[dict[str, object]]:
    """Every case of :data:`CASES`, then the resumed run, in one pair of ranks."""
    return values(run_ranks(survive_worker, 2, (list(CASES),), timeout=480))


@pytest.mark.slow
@pytest.mark.serial
def test_a_lost_link_is_survived_with_torch_ddps_parameters(survived: list[dict[str, Any]]) -> None:
    res = survived
    for name in CASES:
        a, b = res[0][name], res[1][name]
        links, faults, _ = CASES[name]
        assert a["params"] == b["params"], name  # the ranks applied the same updates
        assert a["worst"] < 1e-5, (name, a["worst"])  # torch DDP's parameters
        assert a["merged"] == list(range(STEPS)), (name, a["merged"])  # every gradient applied once
        lost = [f["link"] for f in a["failures"]]
        assert lost == [f.link for f in faults], (name, a["failures"])
        assert a["failures"] == b["failures"] or [f["link"] for f in b["failures"]] == lost, name
        assert [rec["phase"] for rec in a["failures"]] == PHASES.get(name, ["training"]), (name, a["failures"])
        for fault, rec in zip(faults, a["failures"], strict=True):
            assert fault.at <= rec["iteration"] <= fault.at + 1, (name, rec)
            assert rec["links_left"] == [n for n in links if n not in lost[:lost.index(rec["link"]) + 1]]
            assert "replan" in rec, (name, rec)
        assert a["links"] == ["primary"], (name, a["links"])  # re-planned on the link left
        # after the plan: torch DDP's schedule at once, then the lag-free plan rank 0 made without the lost link
        last = a["failures"][-1]["replan"]
        expected = (("the first plan, on the links left", None, None) if name in BEFORE_PLAN
                    else ("synchronous", "lagfree_plan (epsilon = 0)", ["primary"]))
        assert (last["source"], last.get("plan", {}).get("source"), last.get("plan", {}).get("links")) == expected
        # a re-plan overtaken by the next loss is dropped, never run (its plan used the link lost next)
        assert ["plan" in f["replan"] for f in a["failures"]] == PLANNED.get(name, [True]), (name, a["failures"])


@pytest.mark.slow
@pytest.mark.serial
def test_a_resumed_run_never_sends_on_a_link_its_checkpoint_lost(survived: list[dict[str, Any]]) -> None:
    """The checkpoint was taken before the first plan: the resumed run profiles and plans again, on the
    links its record left (not on the working ``second``), with torch DDP's parameters."""
    for r in survived:
        res = r["resumed"]
        assert res["worst"] < 1e-5, res  # an uninterrupted torch DDP run's parameters
        assert res["merged"] == list(range(STEPS)), res  # every gradient applied once, across the resume
        assert res["second"] == 0 and res["links"] == ["primary"], res
        assert [(f["link"], f["phase"], f["resumed_at"]) for f in res["failures"]] == \
            [("second", "profile iteration", [RESUME_AT])], res


@pytest.mark.slow
@pytest.mark.serial
def test_a_rank_stuck_on_the_lost_link_exits_without_waiting_for_it(tmp_path: Path) -> None:
    """Rank 1's all-reduce on ``second`` waits for rank 0, whose end is gone and who stays alive (its
    socket never closes, as behind a dead NIC) until rank 1 has exited: rank 1 closes the wrapper,
    destroys the process groups and exits normally. Waiting for the stuck collective would take gloo's
    timeout (``timeout_s``, 600 s here), which this test's 150 s bound fails."""
    go = tmp_path / "go"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "DEFT_TEST_GO": str(go), "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests._failover_exit_worker"], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out, err = procs[1].communicate(timeout=150)
        go.write_text("")
        procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == 0, err[-3000:]
    doc = json.loads(out.strip().splitlines()[-1])
    assert [f["link"] for f in doc["failures"]] == ["second"], doc
    assert procs[0].returncode == 0


def primary_worker(rank: int, world: int) -> dict[str, object]:
    from deft.errors import CommunicationError

    try:
        _deft_run(rank, ["primary", "second"], [Fault("primary", 12)], timeout_s=6.0)
    except CommunicationError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.serial
def test_the_primary_link_lost_stops_the_run_naming_it() -> None:
    for r in values(run_ranks(primary_worker, 2, timeout=180)):
        assert r["error"] is not None and "link 'primary'" in r["error"], r


def alone_worker(rank: int, world: int, path: str) -> dict[str, object]:
    """deft on a schedule whose update finishes in the next forward with a bucket of the second link
    deferred (tests/test_runtime_parity.py's early schedule); after each step rank 0 alone reads the
    module's state_dict, which applies the deferred parameters on rank 0 only (an evaluation forward is
    collective with this model: its batch-norm buffers are broadcast, as torch DDP does)."""
    from tests.test_runtime_parity import Net as ParityNet
    from tests.test_runtime_parity import _batch as parity_batch
    from tests.test_runtime_parity import deferring_run

    ours, opt, ddp = deferring_run(path, rank)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(8):
        x, y = parity_batch(rank, step)
        loss_fn(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            ours.state_dict()
    ddp.flush()
    torch.manual_seed(0)
    ref = ParityNet()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    tddp = nn.parallel.DistributedDataParallel(ref)
    for step in range(8):
        x, y = parity_batch(rank, step)
        loss_fn(tddp(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"worst": max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                         for a, b in zip(ours.parameters(), ref.parameters(), strict=True)),
            "second": ddp.link_stats["second"]["calls"]}


@pytest.mark.slow
@pytest.mark.serial
def test_one_rank_alone_applies_a_deferred_guarded_bucket_without_a_collective(tmp_path: Path) -> None:
    """What one rank does alone between iterations (a state_dict) needs no agreement: the guarded sends
    were judged by every rank after the step."""
    for r in values(run_ranks(alone_worker, 2, (str(tmp_path / "schedule.json"),), timeout=120)):
        assert r["second"] > 0 and r["worst"] < 1e-5, r
