"""The schedule: a cyclic plan of which bucket is all-reduced when, on which link (docs/DESIGN.md section 3).

Vocabulary
----------
* The schedule repeats every ``cycle`` iterations; *position* ``p`` in ``0..cycle-1`` is an iteration's
  place in the cycle, and every iteration has two *stages*, ``forward`` then ``backward``.
* The gradients of the iterations of one cycle are partitioned into *update groups* of consecutive
  positions (:class:`Update`). A group of ``k`` iterations is merged (averaged, as gradient
  accumulation does: batch ``k*B``) and applied as one optimizer step; ``K = k_1..k_m`` is the paper's
  batch-size sequence.
* A :class:`CommTask` all-reduces one bucket of one group on one link. ``origin`` says which group:
  the group whose *last* iteration is ``origin`` iterations before the current one (``origin == 0``:
  the group ends with this iteration, so in backward the task waits until the bucket's gradient is
  ready; in forward ``origin >= 1`` always).

Invariants (checked by :meth:`Schedule.validate`)
-------------------------------------------------
1. Every bucket of every group is communicated exactly once per cycle, after all the group's
   gradients exist (never in the forward stage of the group's last iteration or before).
2. An update is applied after the optimizer step of position ``apply_after`` (may be ``>= cycle``:
   then in the next cycle), no earlier than the end of the stage of its group's last communication
   and within one cycle of the group's last iteration; updates are applied in group order, also across
   the cycle boundary (the last group no later than the next cycle's first).
3. The launch order on each link is the order of ``comms`` in each stage, the same on every rank.
4. Link names are unique; bucket ids, origins and positions are integers (JSON ``true`` is not one).
5. ``codecs`` is empty (every bucket sent exact) or names one codec per bucket: ``""`` (exact) or an
   element-wise codec of :data:`CODECS` (``"fp16"``, ``"bf16"``: the bucket is cast to it for the
   all-reduce, as torch's ``fp16_compress_hook`` does; ``"int8"``: deft's 8-bit hook,
   ``deft.runtime.int8_hook``). The plan chooses them (deft.solver.codecs);
   they are part of the digest the ranks agree on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from deft._json import Fields, JsonDict, JsonValue, read_json, write_json
from deft.errors import ContractError

SCHEMA_VERSION = 1
STAGES = ("forward", "backward")
#: The per-bucket codecs a schedule may name (invariant 5); ``""``: the bucket is sent exact.
CODECS = ("", "fp16", "bf16", "int8")


def _is_int(x: object) -> TypeGuard[int]:
    """A JSON integer (``true`` parses as a Python ``bool``, an ``int`` subclass: not a bucket id)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class CommTask:
    """All-reduce ``bucket`` of the group that ended ``origin`` iterations ago, on ``link``."""

    bucket: int
    origin: int
    link: str


@dataclass(frozen=True)
class StagePlan:
    """The communications launched in one stage of one cycle position, in launch order."""

    position: int
    stage: str
    comms: tuple[CommTask, ...] = ()


@dataclass(frozen=True)
class Update:
    """One optimizer step: merges the gradients of ``positions`` and is applied after ``apply_after``.

    ``finish_in_forward`` (then ``apply_after == last``): the update is applied in parts, without
    staleness. At the step of ``last`` every parameter whose buckets are all sent in backward stages is
    updated; the buckets listed in the forward stage of the next position (``origin == 1``) are waited
    for, and their parameters updated, just before the module owning them runs its forward. Each
    parameter thus gets exactly the update torch DDP would have applied before that forward.

    ``deferred`` (only with ``finish_in_forward``): buckets sent in the backward stage of ``last``
    (``origin == 0``, launched as soon as their gradient is ready, in their link's listed order) whose
    parameters are nonetheless *not* waited for at the step but, like the next forward stage's sends,
    just before their module's forward. The step waits for every other bucket. So the set of buckets
    applied in the forward is ``deferred`` plus the next position's forward-stage sends of the group;
    ``deferred`` lets the links start them early in the backward instead of after it.
    """

    positions: tuple[int, ...]
    apply_after: int
    finish_in_forward: bool = False
    deferred: tuple[int, ...] = ()

    @property
    def k(self) -> int:
        return len(self.positions)

    @property
    def last(self) -> int:
        return self.positions[-1]


@dataclass(frozen=True)
class Schedule:
    """A cyclic DeFT plan; see the module docstring for the invariants."""

    cycle: int
    links: tuple[str, ...]
    bucket_numel: tuple[int, ...]
    bucket_nbytes: tuple[int, ...]
    stages: tuple[StagePlan, ...]
    updates: tuple[Update, ...]
    predicted_iteration_s: float = 0.0
    predicted_bubble_ratio: float = 0.0
    profile_digest: str = ""
    meta: JsonDict = field(default_factory=dict)
    codecs: tuple[str, ...] = ()  # per bucket ("": exact); empty: all exact (invariant 5)

    def __post_init__(self) -> None:
        self.validate("<schedule>")

    # -- derived views -------------------------------------------------------------------------
    @property
    def n_buckets(self) -> int:
        return len(self.bucket_numel)

    @property
    def batch_sequence(self) -> tuple[int, ...]:
        """The paper's K = k_1..k_m: how many iterations each update merges."""
        return tuple(u.k for u in self.updates)

    @property
    def updates_per_iteration(self) -> float:
        return len(self.updates) / self.cycle

    def codec_of(self, bucket: int) -> str:
        """The codec bucket ``bucket`` is sent with (``""``: exact)."""
        return self.codecs[bucket] if self.codecs else ""

    @property
    def compressed(self) -> bool:
        """Whether any bucket is sent with a codec."""
        return any(self.codecs)

    def stage(self, position: int, stage: str) -> StagePlan:
        return self.stages[2 * (position % self.cycle) + STAGES.index(stage)]

    def group_of(self, position: int) -> int:
        """Index of the update group that position ``position`` (mod cycle) belongs to."""
        p = position % self.cycle
        for g, u in enumerate(self.updates):
            if p in u.positions:
                return g
        raise AssertionError("validated schedules cover every position")

    def updates_due(self, position: int) -> list[tuple[int, int]]:
        """(group index, cycles back) of the updates applied after the optimizer step at ``position``.

        ``cycles back`` is 0 when the group belongs to the current cycle and 1 when it belongs to the
        previous one (``apply_after >= cycle``).
        """
        p = position % self.cycle
        due = []
        for g, u in enumerate(self.updates):
            if u.apply_after == p:
                due.append((g, 0))
            elif u.apply_after == p + self.cycle:
                due.append((g, 1))
        return sorted(due, key=lambda gc: (-gc[1], gc[0]))

    # -- validation ----------------------------------------------------------------------------
    def validate(self, source: str) -> None:
        """Check the invariants of the module docstring; a :class:`ContractError` names ``source`` and the
        first field that breaks one."""
        self._validate_layout(source)
        self._validate_updates(source)
        self._validate_completion(source, self._validate_sends(source))

    def _validate_layout(self, source: str) -> None:
        """Buckets, links, and one stage plan per (position, stage) in cycle order (invariant 4)."""
        n, c = self.n_buckets, self.cycle
        if c < 1:
            raise ContractError(source, "cycle", f"expected >= 1, got {c}")
        if n < 1:
            raise ContractError(source, "bucket_numel", "expected at least one bucket")
        if len(self.bucket_nbytes) != n:
            raise ContractError(source, "bucket_nbytes",
                                f"expected one entry per bucket of bucket_numel ({n}), got {len(self.bucket_nbytes)}")
        if not self.links:
            raise ContractError(source, "links", "expected at least one link")
        if len(set(self.links)) != len(self.links):
            raise ContractError(source, "links", f"link names must be unique, got {list(self.links)}")
        if len(self.stages) != 2 * c:
            raise ContractError(source, "stages",
                                f"expected {2 * c} stage plans (2 per position), got {len(self.stages)}")
        for i, sp in enumerate(self.stages):
            if sp.position != i // 2 or sp.stage != STAGES[i % 2]:
                raise ContractError(source, f"stages[{i}]", f"expected position {i // 2} stage {STAGES[i % 2]}")
        if self.codecs and len(self.codecs) != n:
            raise ContractError(source, "codecs",
                                f"expected one codec per bucket ({n}) or none, got {len(self.codecs)}")
        for b, name in enumerate(self.codecs):
            if name not in CODECS:
                raise ContractError(source, f"codecs[{b}]", f"expected one of {list(CODECS)}, got {name!r}")

    def _validate_updates(self, source: str) -> None:
        """The update groups partition the cycle into runs of consecutive positions, and are applied in
        group order within one cycle of their last iteration (invariant 2, the timing alone)."""
        n, c = self.n_buckets, self.cycle
        covered = sorted(p for u in self.updates for p in u.positions)
        if covered != list(range(c)):
            raise ContractError(source, "updates", f"positions of the update groups must partition 0..{c - 1}")
        for g, u in enumerate(self.updates):
            if list(u.positions) != list(range(u.positions[0], u.positions[0] + u.k)):
                raise ContractError(source, f"updates[{g}].positions", "must be consecutive")
            if u.finish_in_forward and u.apply_after != u.last:
                raise ContractError(source, f"updates[{g}].apply_after",
                                    f"an update finishing in the forward is lag-free: expected apply_after == "
                                    f"{u.last} (its last position), got {u.apply_after}")
            if u.deferred and not u.finish_in_forward:
                raise ContractError(source, f"updates[{g}].deferred",
                                    "only an update finishing in the forward (finish_in_forward) defers buckets")
            if not all(_is_int(b) and 0 <= b < n for b in u.deferred) or list(u.deferred) != sorted(set(u.deferred)):
                raise ContractError(source, f"updates[{g}].deferred",
                                    f"expected increasing distinct bucket ids in 0..{n - 1}, got {list(u.deferred)}")
            if not u.last <= u.apply_after < u.last + c:
                raise ContractError(source, f"updates[{g}].apply_after",
                                    f"expected in [{u.last}, {u.last + c}), got {u.apply_after}")
            if g and u.positions[0] < self.updates[g - 1].positions[0]:
                raise ContractError(source, "updates", "groups must be listed in position order")
            if g and u.apply_after < self.updates[g - 1].apply_after:
                raise ContractError(source, f"updates[{g}].apply_after", "updates must be applied in group order")
            # The next cycle's first group follows the last one: it may share its step, not precede it.
            if u.apply_after > self.updates[0].apply_after + c:
                raise ContractError(source, f"updates[{g}].apply_after",
                                    f"updates must be applied in group order: {u.apply_after} is after the next "
                                    f"cycle's first update ({self.updates[0].apply_after} + cycle {c})")

    def _validate_sends(self, source: str) -> dict[tuple[int, int], int]:
        """Every send names a bucket, a link and the last position of a group, and no (group, bucket)
        is sent twice (invariants 1 and 4). Returns when each (group, bucket) is sent: ``2 * origin``
        plus the stage's index, i.e. stages elapsed since the forward of the group's last iteration."""
        n, c = self.n_buckets, self.cycle
        seen: dict[tuple[int, int], int] = {}
        for i, sp in enumerate(self.stages):
            for j, t in enumerate(sp.comms):
                where = f"stages[{i}].comms[{j}]"
                if not 0 <= t.bucket < n:
                    raise ContractError(source, f"{where}.bucket", f"expected 0..{n - 1}, got {t.bucket}")
                if t.link not in self.links:
                    raise ContractError(source, f"{where}.link", f"unknown link {t.link!r}")
                if t.origin < (1 if sp.stage == "forward" else 0):
                    raise ContractError(source, f"{where}.origin",
                                        f"{sp.stage} stage needs origin >= {1 if sp.stage == 'forward' else 0}")
                # A forward stage may carry the group that ended with the same position one cycle
                # back (a cycle-1 schedule sending in the next forward); a backward stage may not.
                limit = c if sp.stage == "forward" else c - 1
                if t.origin > limit:
                    raise ContractError(source, f"{where}.origin", f"expected <= {limit} in the {sp.stage} "
                                        f"stage of a cycle of {c}, got {t.origin}")
                g = self.group_of(sp.position - t.origin)
                if self.updates[g].last != (sp.position - t.origin) % c:
                    raise ContractError(source, f"{where}.origin",
                                        f"position {sp.position} - origin {t.origin} is not the last of a group")
                if (g, t.bucket) in seen:
                    raise ContractError(source, where, f"bucket {t.bucket} of group {g} sent twice")
                # Iterations elapsed since the group's last iteration, counting stage order.
                seen[(g, t.bucket)] = 2 * t.origin + STAGES.index(sp.stage)
        return seen

    def _validate_completion(self, source: str, seen: dict[tuple[int, int], int]) -> None:
        """Every bucket of every group is sent, deferred buckets in the backward of the group's last
        position, and each update is applied no earlier than the stage of its group's last send
        (invariants 1 and 2); ``seen`` is :meth:`_validate_sends`'s."""
        n = self.n_buckets
        for g, u in enumerate(self.updates):
            for b in range(n):
                if (g, b) not in seen:
                    raise ContractError(source, "stages", f"bucket {b} of update group {g} is never sent")
            for b in u.deferred:
                if seen[(g, b)] != 1:  # 2 * origin 0 + backward
                    raise ContractError(source, f"updates[{g}].deferred",
                                        f"deferred bucket {b} must be sent in the backward stage of position "
                                        f"{u.last} with origin 0 (the forward stage's sends are deferred anyway)")
            done = max(seen[(g, b)] for b in range(n))  # 2*origin + stage index of the last send
            # Applied after the step of apply_after: needs the last send's stage at or before it; an
            # update finishing in the forward may also send in the next position's forward stage.
            allowed = 2 * (u.apply_after - u.last) + (2 if u.finish_in_forward else 1)
            if allowed < done:
                raise ContractError(source, f"updates[{g}].apply_after",
                                    "applied before its last bucket is communicated" + (
                                        " (an update finishing in the forward may send in the next position's "
                                        "forward stage, no later)" if u.finish_in_forward else ""))

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> JsonDict:
        return {
            "kind": "deft.schedule",
            "schema": SCHEMA_VERSION,
            "cycle": self.cycle,
            "links": list(self.links),
            "bucket_numel": list(self.bucket_numel),
            "bucket_nbytes": list(self.bucket_nbytes),
            "stages": [
                {"position": s.position, "stage": s.stage,
                 "comms": [[t.bucket, t.origin, t.link] for t in s.comms]}
                for s in self.stages
            ],
            # finish_in_forward only when set, so the digests of schedules without it stay as they were
            "updates": [{"positions": list(u.positions), "apply_after": u.apply_after,
                         **({"finish_in_forward": True} if u.finish_in_forward else {}),
                         **({"deferred": list(u.deferred)} if u.deferred else {})} for u in self.updates],
            "predicted_iteration_s": self.predicted_iteration_s,
            "predicted_bubble_ratio": self.predicted_bubble_ratio,
            "profile_digest": self.profile_digest,
            # codecs only when a bucket has one, so the digests of exact schedules stay as they were
            **({"codecs": list(self.codecs)} if self.compressed else {}),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, JsonValue], source: str = "<dict>") -> Schedule:
        f = Fields(doc, source, "")
        kind = f.str("kind")
        if kind != "deft.schedule":
            raise f.error("kind", f"expected 'deft.schedule', got {kind!r}")
        schema = f.int("schema")
        if schema != SCHEMA_VERSION:
            raise f.error("schema", f"this deft reads schema {SCHEMA_VERSION}, file has {schema}")

        def ints(key: str) -> tuple[int, ...]:
            v = f.list(key)
            out = tuple(x for x in v if _is_int(x) and x >= 0)
            if len(out) != len(v):
                raise f.error(key, "expected a list of non-negative integers")
            return out

        links = _strs(f.list("links"))
        if links is None:
            raise f.error("links", "expected a list of link names")
        codecs = _strs(f.list("codecs", []))
        if codecs is None:
            raise f.error("codecs", f"expected a list of codec names, one of {list(CODECS)} per bucket")
        stages = []
        for sf in f.items("stages"):
            comms = []
            for j, t in enumerate(sf.list("comms")):
                bucket, origin, link = t if isinstance(t, list) and len(t) == 3 else (None, None, None)
                if not (_is_int(bucket) and _is_int(origin) and isinstance(link, str)):
                    raise sf.error(f"comms[{j}]", f"expected [bucket, origin, link], got {t!r}")
                comms.append(CommTask(bucket=bucket, origin=origin, link=link))
            stages.append(StagePlan(position=sf.int("position", minimum=0),
                                    stage=sf.str("stage", choices=STAGES), comms=tuple(comms)))
        updates = []
        for uf in f.items("updates"):
            pos = _ints(uf.list("positions"))
            if not pos:
                raise uf.error("positions", "expected a non-empty list of integers")
            raw_deferred = uf.list("deferred", [])
            deferred = _ints(raw_deferred)
            if deferred is None:
                raise uf.error("deferred", f"expected a list of bucket ids, got {raw_deferred!r}")
            updates.append(Update(positions=pos, apply_after=uf.int("apply_after", minimum=0),
                                  finish_in_forward=uf.bool("finish_in_forward", False), deferred=deferred))
        sched = object.__new__(cls)
        for k, v in {
            "cycle": f.int("cycle", minimum=1), "links": links,
            "bucket_numel": ints("bucket_numel"), "bucket_nbytes": ints("bucket_nbytes"),
            "stages": tuple(stages), "updates": tuple(updates),
            "predicted_iteration_s": f.float("predicted_iteration_s", 0.0),
            "predicted_bubble_ratio": f.float("predicted_bubble_ratio", 0.0),
            "profile_digest": f.str("profile_digest", ""), "meta": f.dict("meta", {}),
            "codecs": codecs,
        }.items():
            object.__setattr__(sched, k, v)
        sched.validate(source)
        return sched

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        return cls.from_dict(read_json(path, "schedule"), str(path))

    def digest(self) -> str:
        """Hash of everything the ranks must agree on (not the free-form meta)."""
        d = self.to_dict()
        d.pop("meta")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _ints(values: Sequence[JsonValue]) -> tuple[int, ...] | None:
    """``values`` as JSON integers (not ``true``/``false``), or ``None`` when one is not."""
    out = tuple(x for x in values if _is_int(x))
    return out if len(out) == len(values) else None


def _strs(values: Sequence[JsonValue]) -> tuple[str, ...] | None:
    """``values`` as strings, or ``None`` when one is not."""
    out = tuple(x for x in values if isinstance(x, str))
    return out if len(out) == len(values) else None


def synchronous_schedule(bucket_numel: tuple[int, ...], bucket_nbytes: tuple[int, ...],
                         links: tuple[str, ...], assignment: tuple[str, ...] | None = None) -> Schedule:
    """Cycle of one iteration, no delayed update: every bucket all-reduced in its own backward.

    This is what ``epsilon == 0`` permits (same parameters as torch DDP); ``assignment`` gives each
    bucket's link (default: all on the first link).
    """
    n = len(bucket_numel)
    assign = assignment or tuple(links[0] for _ in range(n))
    comms = tuple(CommTask(bucket=b, origin=0, link=assign[b]) for b in range(n))
    return Schedule(cycle=1, links=links, bucket_numel=bucket_numel, bucket_nbytes=bucket_nbytes,
                    stages=(StagePlan(0, "forward"), StagePlan(0, "backward", comms)),
                    updates=(Update(positions=(0,), apply_after=0),))


def update_pattern_schedule(cycle: int, updates: Sequence[tuple[tuple[int, ...], int]],
                            link: str = "l0") -> Schedule:
    """The smallest schedule with a given update timing: one bucket (one element), one link, and the
    update groups ``[(positions, apply_after), ...]``, each group's bucket sent in the backward of its
    last position. What the preserver's stability maths reads of a schedule is exactly this timing."""
    backward = {u[0][-1]: (CommTask(bucket=0, origin=0, link=link),) for u in updates}
    stages: list[StagePlan] = []
    for p in range(cycle):
        stages += [StagePlan(p, "forward"), StagePlan(p, "backward", backward.get(p, ()))]
    return Schedule(cycle=cycle, links=(link,), bucket_numel=(1,), bucket_nbytes=(4,), stages=tuple(stages),
                    updates=tuple(Update(positions=pos, apply_after=a) for pos, a in updates))
