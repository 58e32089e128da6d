"""Checkpoint in the middle of a cycle, resume in new processes: the same run as without stopping.

The checkpoint is taken after iteration 6 of a delayed schedule (cycle 4 from t0 = 1): the update
merging iterations 5 and 6 has two buckets in flight and one not yet sent. Every rank saves its own
``ddp.state_dict()`` (which carries its local, not yet communicated gradients) and the optimizer's,
loads them in fresh processes and finishes the run; the final parameters and the update log must equal
those of the uninterrupted run bit for bit. The wrapper's state_dict is saved twice, with ``torch.save``
and with ``safetensors`` (tensors only: deft's record is one uint8 tensor); the resumed run loads the
safetensors file, the torch.save one is loaded with ``weights_only=True`` for the checks of bad input.
The same checkpoint taken with ``torch.distributed.checkpoint`` (every rank saves at once) resumes the
same way.
"""

from __future__ import annotations

import copy
import dataclasses
import io
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from deft.config import DeftConfig
from deft.errors import ContractError
from deft.runtime.checkpoint import (
    LocalStepsState,
    check_mode,
    check_stamp,
    decode_record,
    encode_record,
    record_key,
    stamp,
    take_records,
)
from deft.runtime.compat import shared_config
from tests._dist import run_ranks, slow_first_planner, values
from tests.test_runtime_delayed import delayed_schedule

TOTAL, STOP = 13, 7


def make_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))  # 56 + 27 = 83 elements


def batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * t + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def config(schedule_path: str, compression: str = "none") -> dict[str, object]:
    # PowerSGD at rank 1 compresses the 3x8 weight (whole in bucket 0); its error feedback, P/Q memories,
    # iteration counter and random state must survive the checkpoint.
    # "int8-schedule": no comm hook; the schedule names int8 for its buckets (deft's own choice)
    return {"epsilon": 0.1, "warmup_iters": 1, "schedule_path": schedule_path, "timeout_s": 30,
            "links": [{"name": "primary"}, {"name": "second"}],
            "compression": "none" if compression == "int8-schedule" else compression, "powersgd_rank": 1}


def train(ddp: nn.Module, opt: torch.optim.Optimizer, rank: int, start: int, stop: int) -> None:
    for t in range(start, stop):
        x, y = batch(rank, t)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


def first_half_worker(rank: int, world: int, schedule_path: str, ckpt_dir: str,
                      compression: str = "none") -> dict[str, object]:
    import deft

    # The uninterrupted run.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=config(schedule_path, compression))
    train(ddp, opt, rank, 0, TOTAL)
    ddp.flush()
    full = {"params": [p.tolist() for p in model.parameters()], "log": [[t, list(i)] for t, i in ddp.update_log]}
    ddp.close()

    # The run that stops after iteration STOP - 1, mid-cycle, with collectives in flight.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=config(schedule_path, compression))
    train(ddp, opt, rank, 0, STOP)
    groups = {u.iterations[-1]: (list(u.buckets_sent), list(u.iterations)) for u in ddp.pending_updates}
    torch.save({"ddp": ddp.state_dict(), "opt": opt.state_dict()}, Path(ckpt_dir) / f"rank{rank}.pt")
    safetensors.torch.save_file(ddp.state_dict(), Path(ckpt_dir) / f"rank{rank}.safetensors")
    return {"full": full, "pending_at_stop": {str(k): v for k, v in groups.items()}}


def resume_worker(rank: int, world: int, schedule_path: str, ckpt_dir: str,
                  compression: str = "none") -> dict[str, object]:
    import deft

    model = make_model()
    with torch.no_grad():  # garbage: the checkpoint must restore everything
        for p in model.parameters():
            p.mul_(-3.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=config(schedule_path, compression))
    # Another rank's checkpoint holds that rank's local gradients: refused with a clear error.
    other = torch.load(Path(ckpt_dir) / f"rank{1 - rank}.pt", weights_only=True)
    try:
        ddp.load_state_dict(other["ddp"])
        raise AssertionError("loading another rank's pending gradients must fail")
    except deft.ContractError as e:
        assert f"load it on rank {1 - rank} of 2" in str(e), e
    ckpt = torch.load(Path(ckpt_dir) / f"rank{rank}.pt", weights_only=True)
    if compression == "int8-schedule":  # a damaged codec state is refused, naming the field, before any change
        key = record_key(rank)
        state = decode_record(ckpt["ddp"][key])
        assert isinstance(state, dict)
        assert state["codec_hooks"]["int8"]["state"]["calls"] > 0  # the schedule's int8 hook ran and counted
        for bad, says in (({"int4": {}}, "codec_hooks: expected codec names"),
                          ({"int8": {"kind": "state_dict", "state": {"seed": "x"}}}, "codec_hooks.int8: Int8State")):
            try:
                ddp.load_state_dict({**ckpt["ddp"], key: encode_record({**state, "codec_hooks": bad})})
                raise AssertionError(f"a damaged codec state must be refused: {bad}")
            except deft.ContractError as e:
                assert says in str(e), e
    ddp.load_state_dict(safetensors.torch.load_file(Path(ckpt_dir) / f"rank{rank}.safetensors"))
    opt.load_state_dict(ckpt["opt"])
    assert ddp.iteration == STOP
    train(ddp, opt, rank, STOP, TOTAL)
    ddp.flush()
    return {"params": [p.tolist() for p in model.parameters()], "log": [[t, list(i)] for t, i in ddp.update_log]}


@pytest.mark.slow
# int8: deft's 8-bit hook on every bucket (the comm hook's state); int8-schedule: the schedule names int8
# for its buckets, as deft's own choice does (the schedule's codec hooks' state): both resume the rounding
@pytest.mark.parametrize("compression", ["none", "powersgd", "int8", "int8-schedule"])
def test_checkpoint_mid_cycle_resumes_exactly(tmp_path: Path, compression: str) -> None:
    sched = tmp_path / "schedule.json"
    schedule = delayed_schedule((30, 30, 23))
    if compression == "int8-schedule":
        schedule = dataclasses.replace(schedule, codecs=("int8",) * schedule.n_buckets)
    schedule.save(sched)
    first = values(run_ranks(first_half_worker, 2, (str(sched), str(tmp_path), compression), timeout=120))
    # Iterations 5 and 6 form the pending group; two of its buckets were launched in iteration 6.
    assert first[0]["pending_at_stop"] == {"6": [[0, 1], [5, 6]]}
    resumed = values(run_ranks(resume_worker, 2, (str(sched), str(tmp_path), compression), timeout=120))
    for r in range(2):
        assert resumed[r]["log"] == first[r]["full"]["log"]
        assert resumed[r]["params"] == first[r]["full"]["params"]  # bit for bit
    assert resumed[0]["params"] == resumed[1]["params"]


# -- torch.distributed.checkpoint ---------------------------------------------------------------------
def dcp_save_worker(rank: int, world: int, schedule_path: str, ckpt_dir: str, compression: str) -> None:
    """The first half of :func:`first_half_worker`'s run, saved as torch's DCP recipe does for a DDP
    model: ``get_state_dict(model, optimizer)`` into ``dcp.save``, every rank at once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import deft

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=config(schedule_path, compression))
    train(ddp, opt, rank, 0, STOP)
    model_sd, optim_sd = get_state_dict(ddp, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(ckpt_dir) / "dcp"))


def dcp_resume_worker(rank: int, world: int, schedule_path: str, ckpt_dir: str,
                      compression: str) -> dict[str, object]:
    """A fresh wrapper and optimizer loaded as torch's DCP recipe does (``get_state_dict``, ``dcp.load``,
    ``set_state_dict``), trained to the end."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import deft

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=config(schedule_path, compression))
    model_sd, optim_sd = get_state_dict(ddp, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(Path(ckpt_dir) / "dcp"))
    set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert ddp.iteration == STOP
    train(ddp, opt, rank, STOP, TOTAL)
    ddp.flush()
    return {"params": [p.tolist() for p in model.parameters()], "log": [[t, list(i)] for t, i in ddp.update_log]}


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "powersgd"])
def test_a_torch_distributed_checkpoint_mid_cycle_resumes_exactly(tmp_path: Path, compression: str) -> None:
    """DCP keeps one copy of a key every rank saves, and loads a tensor only into one of the saved size:
    each rank's record (its own queued gradients, PowerSGD's error feedback) must come back to it."""
    sched = tmp_path / "schedule.json"
    delayed_schedule((30, 30, 23)).save(sched)
    first = values(run_ranks(first_half_worker, 2, (str(sched), str(tmp_path), compression), timeout=120))
    assert first[0]["pending_at_stop"] == {"6": [[0, 1], [5, 6]]}
    values(run_ranks(dcp_save_worker, 2, (str(sched), str(tmp_path), compression), timeout=120))
    resumed = values(run_ranks(dcp_resume_worker, 2, (str(sched), str(tmp_path), compression), timeout=120))
    for r in range(2):
        assert resumed[r]["log"] == first[r]["full"]["log"]
        assert resumed[r]["params"] == first[r]["full"]["params"]  # bit for bit


def dcp_into_plain_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, object]:
    """A DCP checkpoint of the wrapper (``get_model_state_dict``), loaded into the bare model as an
    evaluation script does; the checkpoint's keys beside torch DDP's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import deft

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "timeout_s": 30}
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=cfg)
    train(ddp, opt, rank, 0, 6)
    saved = get_model_state_dict(ddp)
    dcp.save({"model": saved}, checkpoint_id=str(Path(ckpt_dir) / "dcp-plain"))
    torch_keys = sorted(get_model_state_dict(nn.parallel.DistributedDataParallel(make_model())))
    plain = make_model()
    state = {"model": get_model_state_dict(plain)}
    dcp.load(state, checkpoint_id=str(Path(ckpt_dir) / "dcp-plain"))
    set_model_state_dict(plain, state["model"])
    worst = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    return {"keys": sorted(saved), "torch_keys": torch_keys, "worst": worst, "rank": rank}


@pytest.mark.slow
def test_a_torch_distributed_checkpoint_of_the_wrapper_loads_into_the_bare_model(tmp_path: Path) -> None:
    """As for torch DDP, the state dict DCP takes of the wrapper names the model's own parameters (no
    ``module.`` prefix); deft's record is one key more (each rank's own), which a bare model does not
    ask for."""
    for v in values(run_ranks(dcp_into_plain_worker, 2, (str(tmp_path),), timeout=120)):
        assert v["keys"] == sorted([*v["torch_keys"], f"deft_state_rank{v['rank']}"]), v
        assert v["worst"] == 0.0, v


# -- a checkpoint while rank 0 plans in the background -----------------------------------------------
LAG_TOTAL, LAG_STOP = 14, 4


def lag_worker(rank: int, world: int) -> dict[str, object]:
    """Measured profile, epsilon 0; rank 0's planner is slowed (1 s) so that the checkpoint after
    iteration 3 falls while it plans in the background (warm-up 1 + profile 2: planning began after
    iteration 2). The resumed run profiles and plans again; whatever runs, epsilon 0 is torch DDP's maths."""
    import deft

    slow_first_planner(rank, 1.0)
    cfg = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "plan_lag_iters": 3, "timeout_s": 30,
           "links": [{"name": "primary"}, {"name": "second"}]}
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = deft.DistributedDataParallel(model, optimizer=opt, config=cfg)
    train(ddp, opt, rank, 0, LAG_STOP)
    in_flight = "t0" not in ddp.plan_info  # no plan installed yet: the checkpoint falls in the lag
    state = {"ddp": ddp.state_dict(), "opt": opt.state_dict()}
    model2 = make_model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    ddp2 = deft.DistributedDataParallel(model2, optimizer=opt2, config=cfg)
    import logging

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deft.runtime").addHandler(handler)
    ddp2.load_state_dict(state["ddp"])
    logging.getLogger("deft.runtime").removeHandler(handler)
    opt2.load_state_dict(state["opt"])
    train(ddp2, opt2, rank, LAG_STOP, LAG_TOTAL)
    ddp2.flush()
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    train(nn.parallel.DistributedDataParallel(ref), ref_opt, rank, 0, LAG_TOTAL)
    worst = max((a - b).abs().max().item() for a, b in zip(model2.parameters(), ref.parameters(), strict=True))
    return {"in_flight": in_flight, "worst": worst, "t0": ddp2.plan_info.get("t0"), "said": said,
            "log": [[t, list(i)] for t, i in ddp2.update_log]}


@pytest.mark.slow
def test_a_checkpoint_taken_while_rank_0_plans_resumes_to_torch_ddps_parameters() -> None:
    a, b = values(run_ranks(lag_worker, 2, timeout=120))
    assert a["in_flight"] and b["in_flight"]
    assert a["worst"] < 1e-5 and b["worst"] < 1e-5
    # Resumed at 4: profiled again (warm-up counted as done: 2 profile iterations, 4 and 5), planned in
    # the background from 6, the slowed planner collected at the latest 3 iterations later.
    assert a["t0"] == b["t0"] and 6 < a["t0"] <= 9
    # ... and says so, once (rank 0), with the iteration it plans at (4 + 2 profile iterations)
    assert [m for m in a["said"] if "before planning finished" in m] == [
        "deft: the checkpoint was taken at iteration 4, before planning finished; deft profiles again from "
        "here and plans at iteration 6 (torch DDP's schedule until the plan is in)"]
    assert not [m for m in b["said"] if "before planning finished" in m]
    assert sorted(t for _, its in a["log"] for t in its) == list(range(LAG_TOTAL))  # each iteration once


def test_local_steps_record_round_trips_and_names_what_it_refuses() -> None:
    pending = {"pending": {"step": 3}}
    st = LocalStepsState(rank=1, world=2, t=7, local_steps=pending)
    doc = st.to_dict()
    assert doc["mode"] == "local_steps" and LocalStepsState.from_dict(doc) == st
    with pytest.raises(ContractError, match=r"deft_state\.version: expected local-steps state version 1, got 2"):
        LocalStepsState.from_dict({**doc, "version": 2})
    with pytest.raises(ContractError, match=r"deft_state: missing field\(s\) \['t'\]"):
        LocalStepsState.from_dict({k: v for k, v in doc.items() if k != "t"})
    with pytest.raises(ContractError, match=r"deft_state: expected a dict, got list"):
        LocalStepsState.from_dict([])
    # an averaging in flight belongs to the rank that saved it; without one any rank of the same world loads
    with pytest.raises(ContractError, match=r"deft_state\.rank: this checkpoint holds rank 1's \(of 2\) snapshot"):
        st.check_owner(0, 2)
    st.check_owner(1, 2)
    dataclasses.replace(st, local_steps={"pending": None}).check_owner(0, 2)
    with pytest.raises(ContractError, match=r"deft_state\.rank"):
        dataclasses.replace(st, local_steps={"pending": None}).check_owner(0, 3)


def test_a_record_is_loaded_only_by_the_mode_that_saved_it() -> None:
    local_doc = LocalStepsState(rank=0, world=1, t=0, local_steps={}).to_dict()
    check_mode(local_doc, local_steps=True)
    check_mode({"version": 1}, local_steps=False)
    with pytest.raises(ContractError, match=r"deft_state\.mode: the checkpoint was saved in local-steps mode and "
                                            r"this wrapper runs outside it \(config.local_steps must match\)"):
        check_mode(local_doc, local_steps=False)
    with pytest.raises(ContractError, match="saved outside local-steps mode and this wrapper runs in it"):
        check_mode({"version": 1}, local_steps=True)


def test_the_record_travels_as_one_uint8_tensor_and_bad_bytes_are_named() -> None:
    doc = {"version": 1, "order": torch.arange(4), "groups": [{"buffers": {"float32": torch.ones(3)}}]}
    t = encode_record(doc)
    assert t.dtype == torch.uint8 and t.dim() == 1
    back = decode_record(t)
    assert isinstance(back, dict) and back["version"] == 1 and back["order"].tolist() == [0, 1, 2, 3]
    assert back["groups"][0]["buffers"]["float32"].tolist() == [1.0, 1.0, 1.0]
    assert decode_record({"version": 1}) == {"version": 1}  # the document itself (an older checkpoint)
    with pytest.raises(ContractError, match=r"deft_state: the uint8 tensor is not a deft record"):
        decode_record(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ContractError, match=r"deft_state: expected deft's record .* got a 2-D torch.float32"):
        decode_record(torch.zeros(2, 2))


def test_the_record_copies_and_pickles_as_a_plain_uint8_tensor() -> None:
    """``copy.deepcopy(ddp.state_dict())`` (a kept best model) and ``torch.save``: nothing of deft's needed
    to read it back."""
    t = encode_record({"version": 1})
    kept = copy.deepcopy({"r": t})["r"]
    assert decode_record(kept) == {"version": 1}
    buf = io.BytesIO()
    torch.save({"r": t}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["r"]
    assert type(back) is torch.Tensor and decode_record(back) == {"version": 1}


def test_each_ranks_record_and_an_older_checkpoints_are_taken_out_of_the_state_dict() -> None:
    sd = {"module.w": torch.ones(1), "deft_state_rank0": torch.zeros(1), "deft_state_rank1": torch.ones(2),
          "_extra_state": torch.ones(3), "inner.deft_state_rank0": torch.ones(4)}
    found = take_records(sd, "")
    assert sorted(found, key=str) == [0, 1, None] and found[1].numel() == 2 and found[None].numel() == 3
    assert sorted(sd) == ["inner.deft_state_rank0", "module.w"]  # another prefix's stays
    assert record_key(1) == "deft_state_rank1"


def test_a_record_of_another_world_or_config_is_refused_naming_the_field() -> None:
    shared = shared_config(DeftConfig.resolve({"epsilon": 0.1}))
    doc = stamp({"version": 1, "world": 2}, shared)
    check_stamp(doc, 2, shared)
    check_stamp(doc, 2, shared_config(DeftConfig.resolve({"epsilon": 0.1, "timeout_s": 5, "adapt": False})))
    with pytest.raises(ContractError, match=r"deft_state\.world: the checkpoint was saved by a job of 2 ranks "
                                            r"and this one has 4"):
        check_stamp(doc, 4, shared)
    other = shared_config(DeftConfig.resolve({"epsilon": 0.0, "compression": "fp16"}))
    with pytest.raises(ContractError, match=r"deft_state\.config: .*epsilon \(saved 0\.1, now 0\.0\); "
                                            r"compression \(saved 'auto', now 'fp16'\)"):
        check_stamp(doc, 2, other)
    check_stamp({"version": 1, "world": 2}, 2, other)  # no stamp (an older checkpoint): its mode checks it
