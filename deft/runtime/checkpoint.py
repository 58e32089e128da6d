"""deft's state in a checkpoint: a typed, versioned record per training mode, carried by ``state_dict()``.

A record is a document of tensors and plain types, carried in the wrapper's ``state_dict()`` as one
``uint8`` tensor holding the document in ``torch.save``'s format (:func:`encode_record`) under a key of
the rank that saved it (:func:`record_key`), so a state_dict holds tensors only: ``safetensors``
(Accelerate's and the HuggingFace Trainer's default) saves it as it saves parameters, and
``torch.load(..., weights_only=True)`` reads it (:func:`decode_record`, which also takes the document
itself). Two records, one per mode (:mod:`deft.runtime.mode`):

* :class:`RuntimeState` (the scheduled run): the iteration counter, the schedule and where its cycle
  started, the flat layout's order, the queued *local* gradient buffers of every pending update group
  (and which of their buckets were already reduced), the update log and ``plan_info``;
* :class:`LocalStepsState` (local-steps mode, marked ``mode = "local_steps"``): the iteration counter
  and :class:`deft.runtime.local_steps.LocalSteps`'s own record (the averaging in flight, the anchor,
  the outer momentum, the period).

A record is refused by the other mode (:func:`check_mode`), by another world size, and by a config
that differs in a field the record's meaning rests on (:data:`RECORD_FIELDS`, :func:`check_stamp`).
Because pending buffers and an averaging's snapshot are this rank's own, every rank saves and loads
its own checkpoint while one is pending; loading another rank's fails with a clear error.

Note: ``torch.distributed.checkpoint`` (DCP) saves a state_dict from every rank at once and keeps one
copy of a key every rank saves, and it loads a tensor only into one of the saved size. So the key is
the rank's own (each rank's record is kept) and the value a :class:`RecordTensor`, which DCP saves as
bytes (it loads those whatever the fresh wrapper's record's size); elsewhere it acts as a plain ``uint8``
tensor, and pickles as one.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypedDict

import torch

from deft._json import JsonDict
from deft.errors import ContractError
from deft.schedule import CODECS, Schedule

STATE_VERSION = 1
#: The version of local-steps mode's record (its engine's own record has its own version).
LOCAL_STATE_VERSION = 1
LOCAL_MODE = "local_steps"
SOURCE = "deft checkpoint"

#: A saved document of tensors and plain types (what ``torch.load(..., weights_only=True)`` gives back):
#: its fields are typed by the code that reads them back, which checks them there.
StateDoc: TypeAlias = dict[str, Any]


#: The config fields a saved record is only valid under: the schedule was accepted at its epsilon and
#: names its links, the queued groups and codec states follow the compression, a merged update's
#: learning rate its scaling, and local-steps mode's averaging its settings. The others (timeouts, the
#: solver's and the adaptation's knobs) may change between a save and a resume.
RECORD_FIELDS = ("epsilon", "links", "compression", "powersgd_rank", "merge_lr_scaling", "forward_updates",
                 "local_steps", "local_outer", "local_outer_lr", "local_outer_momentum", "local_period")


def stamp(doc: StateDoc, shared: JsonDict) -> StateDoc:
    """``doc`` with the :data:`RECORD_FIELDS` of the config it was made under (``shared``: the
    settings every rank shares, :func:`deft.runtime.compat.shared_config`)."""
    return {**doc, "config": json.dumps({k: shared.get(k) for k in RECORD_FIELDS}, sort_keys=True)}


def check_stamp(doc: object, world: int, shared: JsonDict) -> None:
    """Refuse a record saved at another world size or under another value of a :data:`RECORD_FIELDS`
    field, naming each; a record without a stamp (older checkpoints) is checked by its mode only."""
    if not isinstance(doc, dict):
        return  # the mode's reader names what it expected
    if doc.get("solo") is True and shared.get("solo") is False:
        raise ContractError(SOURCE, "deft_state.solo",
                            "the checkpoint was saved by deft's solo mode (one rank, nothing scheduled) and this "
                            "wrapper runs with solo = false; build it with solo = true, or load only ddp.module's "
                            "and the optimizer's state dicts")
    check_mode(doc, local_steps=bool(shared.get("local_steps")))
    saved_world = doc.get("world")
    if isinstance(saved_world, int) and saved_world != world:
        raise ContractError(SOURCE, "deft_state.world",
                            f"the checkpoint was saved by a job of {saved_world} ranks and this one has {world}; "
                            "to resume at another world size load only ddp.module's and the optimizer's state "
                            "dicts (deft profiles and plans anew)")
    if not isinstance(doc.get("config"), str):
        return
    saved = json.loads(doc["config"])
    now = {k: shared.get(k) for k in RECORD_FIELDS}
    diff = [f"{k} (saved {saved.get(k)!r}, now {now[k]!r})" for k in RECORD_FIELDS if saved.get(k) != now[k]]
    if diff:
        raise ContractError(SOURCE, "deft_state.config",
                            f"the checkpoint was saved under another deft config: {'; '.join(diff)}. Build the "
                            "wrapper with the saved values, or load only ddp.module's and the optimizer's state "
                            "dicts (deft profiles and plans anew)")


#: The wrapper's state_dict key of rank ``r``'s record: ``RECORD_KEY.format(rank=r)`` (module Note).
RECORD_KEY = "deft_state_rank{rank}"
_RECORD_KEY = re.compile(r"deft_state_rank(\d+)")
#: Where older checkpoints hold the record (one key for every rank): still loaded.
LEGACY_KEY = "_extra_state"


def record_key(rank: int) -> str:
    return RECORD_KEY.format(rank=rank)


def take_records(state_dict: dict[str, Any], prefix: str) -> dict[int | None, object]:
    """Remove every deft record under ``prefix`` from ``state_dict``: the saving rank -> the record
    (None: an older checkpoint's, :data:`LEGACY_KEY`)."""
    found: dict[int | None, object] = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name = key[len(prefix):]
        m = _RECORD_KEY.fullmatch(name)
        if m is not None:
            found[int(m.group(1))] = state_dict.pop(key)
        elif name == LEGACY_KEY:
            found[None] = state_dict.pop(key)
    return found


class RecordTensor(torch.Tensor):
    """A record's ``uint8`` tensor as a state_dict value (module Note): ``torch.distributed.checkpoint``
    writes it as bytes (``__create_write_items__``, its protocol for values that choose how they are
    saved); it pickles as the plain tensor it holds."""

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> RecordTensor:  # copy.deepcopy(ddp.state_dict())
        out = self.as_subclass(torch.Tensor).clone().as_subclass(RecordTensor)
        memo[id(self)] = out
        return out


def encode_record(doc: StateDoc) -> torch.Tensor:
    """``doc`` as a 1-D ``uint8`` CPU tensor (its ``torch.save`` bytes; a :class:`RecordTensor`): a
    state_dict entry every tensor format saves."""
    buf = io.BytesIO()
    torch.save(doc, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).as_subclass(RecordTensor)


def decode_record(state: object, device: torch.device | str = "cpu") -> object:
    """The document :func:`encode_record` encoded (its tensors on ``device``); a document given as
    such (a dict, as older checkpoints hold) is returned unchanged for the mode's reader to check."""
    if not isinstance(state, torch.Tensor):
        return state
    if state.dtype != torch.uint8 or state.dim() != 1:
        raise ContractError(SOURCE, "deft_state", f"expected deft's record (a 1-D uint8 tensor or a dict), "
                            f"got a {state.dim()}-D {state.dtype} tensor")
    try:
        return torch.load(io.BytesIO(state.cpu().numpy().tobytes()), map_location=device, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as e:
        raise ContractError(SOURCE, "deft_state", "the uint8 tensor is not a deft record (torch.load "
                            f"could not read it: {type(e).__name__})") from e


class GroupState(TypedDict):
    """A pending update group in a checkpoint (``Executor.group_states``): tensors and plain types."""

    last: int
    k: int
    iterations: list[int]
    buffers: dict[str, torch.Tensor]  # dtype name -> this rank's local gradient sum
    used: torch.Tensor
    launched: list[int]
    used_launched: bool
    finish_in_forward: bool
    deferred: list[int] | None


@dataclass
class RuntimeState:
    """One rank's runtime state between iterations."""

    rank: int
    world: int
    t: int                      # the next training iteration
    t0: int                     # iteration at which the running schedule's cycle started
    planned: bool
    plan_at: int
    order_known: bool
    order: list[int]            # the flat layout's parameter order
    schedule: Schedule
    groups: list[GroupState]    # pending update groups
    update_log: list[tuple[int, tuple[int, ...]]]
    plan_info: JsonDict = field(default_factory=dict)  # saved as JSON text (a non-JSON value as its str)
    comm_hook: StateDoc | None = None  # the comm hook's state (deft.runtime.codecs.hooks)
    codec_hooks: dict[str, StateDoc] = field(default_factory=dict)  # the schedule's codecs' states (int8's generator)

    def to_dict(self) -> StateDoc:
        return {
            "version": STATE_VERSION, "rank": self.rank, "world": self.world, "t": self.t, "t0": self.t0,
            "planned": self.planned, "plan_at": self.plan_at, "order_known": self.order_known,
            "order": torch.tensor(self.order, dtype=torch.int64),
            "schedule": json.dumps(self.schedule.to_dict()), "groups": self.groups,
            "update_log": [[t, list(its)] for t, its in self.update_log],
            "plan_info": json.dumps(self.plan_info, default=str),
            "comm_hook": self.comm_hook,
            "codec_hooks": self.codec_hooks,
        }

    @classmethod
    def from_dict(cls, state: object) -> RuntimeState:
        """Read and check a saved record; every problem names the field."""
        if not isinstance(state, dict):
            raise ContractError(SOURCE, "deft_state", f"expected a dict, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ContractError(SOURCE, "deft_state.version",
                                f"expected deft runtime state version {STATE_VERSION}, got {state.get('version')!r}")
        missing = [k for k in ("rank", "world", "t", "t0", "planned", "plan_at", "order_known", "order",
                               "schedule", "groups", "update_log") if k not in state]
        if missing:
            raise ContractError(SOURCE, "deft_state", f"missing field(s) {missing}")
        schedule = Schedule.from_dict(json.loads(state["schedule"]), f"{SOURCE}: schedule")
        return cls(rank=int(state["rank"]), world=int(state["world"]), t=int(state["t"]), t0=int(state["t0"]),
                   planned=bool(state["planned"]), plan_at=int(state["plan_at"]),
                   order_known=bool(state["order_known"]), order=[int(i) for i in state["order"].tolist()],
                   schedule=schedule, groups=list(state["groups"]),
                   update_log=[(int(t), tuple(int(i) for i in its)) for t, its in state["update_log"]],
                   plan_info=json.loads(state.get("plan_info", "{}")), comm_hook=state.get("comm_hook"),
                   codec_hooks=_codec_hooks(state.get("codec_hooks", {})))

    def check_owner(self, rank: int, world: int) -> None:
        """Pending local gradients not yet communicated belong to the rank that saved them."""
        unsent = any(len(g["launched"]) < self.schedule.n_buckets for g in self.groups)
        if self.groups and (self.world != world or (unsent and self.rank != rank)):
            raise ContractError(SOURCE, "deft_state.rank",
                                f"this checkpoint holds rank {self.rank}'s (of {self.world}) local gradients "
                                f"not yet communicated; load it on rank {self.rank} of {self.world} (this is "
                                f"rank {rank} of {world}) or call ddp.flush() before saving")


def check_mode(state: object, local_steps: bool) -> None:
    """A record is loaded by the mode that saved it (``config.local_steps`` must match)."""
    saved_local = isinstance(state, dict) and state.get("mode") == LOCAL_MODE
    if saved_local != local_steps:
        raise ContractError(SOURCE, "deft_state.mode",
                            f"the checkpoint was saved {'in' if saved_local else 'outside'} local-steps mode and this "
                            f"wrapper runs {'in' if local_steps else 'outside'} it (config.local_steps must match)")


@dataclass
class LocalStepsState:
    """One rank's local-steps state between iterations."""

    rank: int
    world: int
    t: int                      # the next training iteration
    local_steps: object         # LocalSteps.state_dict(): checked by LocalSteps.load_state_dict

    def to_dict(self) -> StateDoc:
        return {"version": LOCAL_STATE_VERSION, "mode": LOCAL_MODE, "rank": self.rank, "world": self.world,
                "t": self.t, "local_steps": self.local_steps}

    @classmethod
    def from_dict(cls, state: object) -> LocalStepsState:
        """Read and check a saved record; every problem names the field."""
        if not isinstance(state, dict):
            raise ContractError(SOURCE, "deft_state", f"expected a dict, got {type(state).__name__}")
        if state.get("version") != LOCAL_STATE_VERSION:
            raise ContractError(SOURCE, "deft_state.version", f"expected local-steps state version "
                                f"{LOCAL_STATE_VERSION}, got {state.get('version')!r}")
        missing = [k for k in ("rank", "world", "t", "local_steps") if k not in state]
        if missing:
            raise ContractError(SOURCE, "deft_state", f"missing field(s) {missing}")
        return cls(rank=int(state["rank"]), world=int(state["world"]), t=int(state["t"]),
                   local_steps=state["local_steps"])

    def check_owner(self, rank: int, world: int) -> None:
        """An averaging in flight holds the saving rank's own snapshot."""
        doc = self.local_steps
        pending = isinstance(doc, dict) and doc.get("pending") is not None
        if self.world != world or (pending and self.rank != rank):
            raise ContractError(SOURCE, "deft_state.rank",
                                f"this checkpoint holds rank {self.rank}'s (of {self.world}) snapshot of an "
                                f"averaging in flight; load it on rank {self.rank} of {self.world} (this is "
                                f"rank {rank} of {world}) or call ddp.flush() before saving")


def _codec_hooks(doc: object) -> dict[str, StateDoc]:
    """``codec_hooks``: the schedule's codec hooks' states by codec name (absent in older checkpoints)."""
    if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in doc.items()):
        raise ContractError(SOURCE, "deft_state.codec_hooks",
                            f"expected an object of codec name -> state object, got {doc!r}")
    unknown = sorted(k for k in doc if k not in CODECS or not k)
    if unknown:
        raise ContractError(SOURCE, "deft_state.codec_hooks",
                            f"expected codec names of {[c for c in CODECS if c]}, got {unknown}")
    return dict(doc)
