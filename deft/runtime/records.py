"""What a run decided, as typed records: the plan, its re-checks, switches, adaptation, skipped steps.

:class:`RunRecord` is the one place these are written (each collaborator returns its record; the
facade appends it). Users read them through ``ddp.plan_info``: :meth:`RunRecord.view` renders a
fresh, read-only mapping (a :class:`PlanInfoView`), so code that reads ``plan_info`` cannot change
what deft recorded, and the mapping is plain JSON (``json.dumps(ddp.plan_info)`` works).

The view's keys: the agreed plan's own (``source``, ``accepted``, ``tries``, ``reason``, ``stats``,
``try_log``, ``recheck``, ``fallback``, ...; :func:`deft.runtime.planning.make_schedule`), ``t0`` (the
iteration it began), ``stats_reason``, ``background`` (planned in the background: how long), and,
when not empty, ``finish_in_forward``, ``skipped_steps``, ``calibrations``, ``rechecks``,
``switches``, ``adapt``, ``replans`` (the adaptation's re-planned schedules offered: when, why, from and
to which schedule, each link's own factor, rank 0's planning seconds) and ``link_failures`` (a link
lost: when, what was sent again, what it cost, the re-plan; :mod:`deft.runtime.failover`), ``profile_codec``
(the codec of the profile iterations and why,
:class:`deft.runtime.codecs.first_iteration.CodecDecision`), ``nonfinite_steps`` (iterations whose gradient
statistics were skipped: a gradient was inf/NaN, as GradScaler's overflow steps have). Before the first plan only
``skipped_steps``, ``nonfinite_steps``, ``calibrations``, ``link_failures``, ``profile_codec`` and
``used_before_forward`` can be present.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

from deft._json import JsonDict, JsonValue
from deft.errors import DeftError
from deft.schedule import Schedule

T = TypeVar("T")

#: A record as broadcast between ranks and shown to users.
Doc = JsonDict


def as_object(doc: Mapping[str, JsonValue], key: str) -> JsonDict:
    """``doc[key]`` as a JSON object (an empty one when absent): documents rank 0 built, read back."""
    value = doc.get(key, {})
    if not isinstance(value, Mapping):
        raise DeftError(f"internal: {key!r} of a document broadcast by rank 0 is not an object: {value!r}")
    return dict(value)


class PlanInfoView(dict[str, JsonValue]):
    """A read-only snapshot of a run's records (``ddp.plan_info``). Pickles and copies as a plain dict."""

    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("ddp.plan_info is a read-only view of what deft recorded; copy it (dict(ddp.plan_info)) "
                        "to change it")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __reduce__(self) -> tuple[type[dict[str, JsonValue]], tuple[dict[str, JsonValue]]]:
        return dict, (dict(self),)


@dataclass(frozen=True)
class SwitchRecord:
    """All ranks switched schedules at a cycle boundary (a re-check's or the adaptation's decision)."""

    iteration: int
    old: str             # digest of the schedule replaced
    new: Schedule
    flushed_updates: int  # updates ``flush()`` applied before the switch
    info: Doc            # the decision's own record (source, reason, ...)

    def to_dict(self) -> Doc:
        return {"iteration": self.iteration, "from": self.old, "to": self.new.digest(), "cycle": self.new.cycle,
                "batch_sequence": list(self.new.batch_sequence), "flushed_updates": self.flushed_updates,
                **self.info}


@dataclass
class RunRecord:
    """Every decision of one run, in the order made (module docstring)."""

    plan: Doc = field(default_factory=dict)  # the agreed plan's record, with t0, stats_reason, background
    finish_in_forward: str | None = None
    skipped_steps: list[int] = field(default_factory=list)
    nonfinite_steps: list[int] = field(default_factory=list)  # statistics skipped: a gradient was inf/NaN
    calibrations: list[Doc] = field(default_factory=list)
    rechecks: list[Doc] = field(default_factory=list)
    switches: list[Doc] = field(default_factory=list)
    adapt: list[Doc] = field(default_factory=list)
    replans: list[Doc] = field(default_factory=list)  # the adaptation's re-planned schedules offered
    link_failures: list[Doc] = field(default_factory=list)  # links lost and the re-plans without them
    profile_codec: Doc | None = None  # the profile iterations' codec and why (deft.runtime.codecs.first_iteration)
    used_before_forward: Doc | None = None  # deferred parameters used after the step (deft.runtime.param_watch)

    def planned(self, info: Mapping[str, JsonValue], t0: int, stats_reason: str, background: Doc | None) -> None:
        """The first plan is installed: its record starts the run's; what happened before it (skipped
        steps, non-finite statistics, calibrations) stays on record, anything about an earlier schedule
        goes."""
        self.plan = {**info, "t0": t0, "stats_reason": stats_reason,
                     **({} if background is None else {"background": background})}
        self.rechecks, self.switches, self.adapt, self.replans = [], [], [], []

    def used(self, t: int, what: str) -> None:
        """After the step of iteration ``t`` the loop used ``what``, a parameter with a deferred update."""
        if self.used_before_forward is None:
            self.used_before_forward = {"iterations": 0, "first_iteration": t, "first": what}
        self.used_before_forward["iterations"] = int(str(self.used_before_forward["iterations"])) + 1

    def switched(self, record: SwitchRecord) -> None:
        self.switches.append(record.to_dict())

    def view(self) -> PlanInfoView:
        """A fresh read-only snapshot (module docstring)."""
        out: Doc = copy.deepcopy(self.plan)
        if self.finish_in_forward is not None:
            out["finish_in_forward"] = self.finish_in_forward
        if self.profile_codec is not None:
            out["profile_codec"] = copy.deepcopy(self.profile_codec)
        if self.used_before_forward is not None:
            out["used_before_forward"] = dict(self.used_before_forward)
        lists: dict[str, list[int] | list[Doc]] = {
            "skipped_steps": self.skipped_steps, "nonfinite_steps": self.nonfinite_steps,
            "calibrations": self.calibrations, "rechecks": self.rechecks, "switches": self.switches,
            "adapt": self.adapt, "replans": self.replans, "link_failures": self.link_failures}
        out.update({key: copy.deepcopy(value) for key, value in lists.items() if value})
        return PlanInfoView(out)

    @classmethod
    def from_view(cls, doc: Mapping[str, JsonValue]) -> RunRecord:
        """The inverse of :meth:`view` (a checkpoint's ``plan_info``)."""
        rest = {k: v for k, v in doc.items() if k not in _RECORD_KEYS}
        finish = doc.get("finish_in_forward")
        return cls(plan=rest, finish_in_forward=None if finish is None else str(finish),
                   profile_codec=_object_or_none(doc, "profile_codec"),
                   used_before_forward=_object_or_none(doc, "used_before_forward"),
                   skipped_steps=_ints(doc, "skipped_steps"), nonfinite_steps=_ints(doc, "nonfinite_steps"),
                   calibrations=_objects(doc, "calibrations"), rechecks=_objects(doc, "rechecks"),
                   switches=_objects(doc, "switches"), adapt=_objects(doc, "adapt"),
                   replans=_objects(doc, "replans"), link_failures=_objects(doc, "link_failures"))


#: The keys of a view that are the record's own fields, not the plan's.
_RECORD_KEYS = ("finish_in_forward", "profile_codec", "used_before_forward", "skipped_steps", "nonfinite_steps",
                "calibrations", "rechecks", "switches", "adapt", "replans", "link_failures")


def _object_or_none(doc: Mapping[str, JsonValue], key: str) -> Doc | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise DeftError(f"deft checkpoint: plan_info.{key}: expected an object, got {value!r}")
    return None if value is None else dict(value)


def _items(doc: Mapping[str, JsonValue], key: str) -> list[JsonValue]:
    value = doc.get(key, [])
    if not isinstance(value, list):
        raise DeftError(f"deft checkpoint: plan_info.{key}: expected a list, got {value!r}")
    return value


def _ints(doc: Mapping[str, JsonValue], key: str) -> list[int]:
    return _checked(doc, key, int, "iteration numbers")


def _objects(doc: Mapping[str, JsonValue], key: str) -> list[Doc]:
    return [dict(v) for v in _checked(doc, key, dict, "records (objects)")]


def _checked(doc: Mapping[str, JsonValue], key: str, kind: type[T], expected: str) -> list[T]:
    """``doc[key]``'s items, each a ``kind``, or the checkpoint is refused naming the field and what it expected."""
    out: list[T] = []
    for v in _items(doc, key):
        if not isinstance(v, kind):
            raise DeftError(f"deft checkpoint: plan_info.{key}: expected {expected}, got {v!r}")
        out.append(v)
    return out
