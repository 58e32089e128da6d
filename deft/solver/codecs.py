"""Which buckets the plan sends in fewer bytes: an element-wise codec (fp16, bf16, int8) per bucket.

The decision (DESIGN.md section 4, "Codecs in the plan")
--------------------------------------------------------
A bucket sent with an element-wise codec is cast to 16 bits before its all-reduce and back after it,
as torch's ``fp16_compress_hook`` does (divided by the world size first), or sent through deft's 8-bit
hook (``deft.runtime.codecs.int8``: blocks rounded to 8 bits, one all-gather; its ``wire`` bytes are those
of an all-reduce costing as much). It puts ``wire`` bytes on the link instead of ``nbytes`` and costs
``codec_s`` of compute beside the model. Whether that pays
depends on the rest of the plan: a bucket whose all-reduce already hides behind the backward gains
nothing and would only round its gradient. So the choice is made on predicted iteration times:

* :func:`encoded_profile` is the measured profile with the buckets of a set ``C`` coded: their wire
  bytes and codec compute from the codec's measurement (:class:`CodecCost`), their comm time on each
  link ``alpha + (t - alpha) * wire / nbytes`` (the measured time's bandwidth part scaled to the
  wire bytes, the start-up kept), the other buckets exact.
* ``T(C)``: the predicted iteration time of the no-delay plan of that profile (cheap: list scheduling
  over the links and one short simulation, ``plan.NO_DELAY_WINDOW``), the plan whose parameters are
  torch DDP's.
* Codecs are used only when coding every bucket gains at least :data:`MIN_GAIN` over coding none
  (the links are the bound). Then buckets are un-coded one at a time, those that save the least
  first, while ``T`` stays within :data:`TOLERANCE` of coding all, priced with the links
  :data:`COMM_MARGIN` times slower than profiled: the fewest coded buckets at about the fastest time,
  each left exact only where its send stays hidden should the links run slower beside the model than
  they were profiled alone. Why the margin: the links run slower beside the model than profiled alone
  (the adaptation's measured factor), and a bucket left exact as hidden on the profile as measured is
  then exposed (benchmarks/results/slow_links.md).

The planner then plans on the chosen :func:`encoded_profile`, so its knapsacks are weighted by the
coded buckets' wire times; :func:`mark` reads the per-bucket codecs of the schedule it returns off the
(partitioned) profile (a partition never fuses a coded with an exact piece). Whether a codec may be
used at all is the preserver's decision (:mod:`deft.preserver.codec_error`); this module only prices.

Pure functions of the profile and the codec's measurement; no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError
from deft.profile import ELEMENTWISE_CODECS, Bucket, BucketTimes, Profile
from deft.schedule import Schedule
from deft.solver.partition import profile_for_schedule
from deft.solver.plan import no_delay_plan

#: Coding every bucket must predict at least this much less time per iteration than coding none.
MIN_GAIN = 0.03
#: int8 replaces the 16-bit choice only where it predicts at least this much less per iteration: its
#: sends cost what the profile does not price (two collectives per bucket on the scatter path, four
#: passes over the bucket on the cores the model uses) and round eight times coarser, so a small
#: predicted gain was a measured loss (benchmarks/results/peers_lm_hosts.md, "int8 against fp16").
INT8_MIN_GAIN = 0.10
#: A bucket stays exact when leaving it so costs at most this much over coding every bucket ...
TOLERANCE = 0.01
#: ... with the links this many times slower than profiled (module docstring).
COMM_MARGIN = 1.5
#: ``Profile.meta`` key of a profile whose coded buckets deft chose (``mark`` reads codecs only there).
CHOSEN = "codecs_chosen"

_SOURCE = "<codecs>"


@dataclass(frozen=True)
class CodecCost:
    """An element-wise codec measured on the profile's buckets: the bytes it puts on the wire and its
    encode + decode compute, per bucket (``deft.runtime.codecs.timing.measure_codec`` measures both)."""

    name: str
    wire_nbytes: tuple[int, ...]
    codec_s: tuple[float, ...]

    def check(self, profile: Profile) -> None:
        if self.name not in ELEMENTWISE_CODECS:
            raise ContractError(_SOURCE, "name", f"expected one of {list(ELEMENTWISE_CODECS)}, got {self.name!r}")
        if len(self.wire_nbytes) != profile.n or len(self.codec_s) != profile.n:
            raise ContractError(_SOURCE, "wire_nbytes", f"expected one entry per profile bucket ({profile.n}), got "
                                f"{len(self.wire_nbytes)} wire sizes and {len(self.codec_s)} codec times")
        if profile.compressed:
            raise ContractError(_SOURCE, "profile.codec", f"the profile is already compressed ({profile.codec!r})")


@dataclass(frozen=True)
class CodecChoice:
    """What :func:`choose` decided: the coded profile buckets and the predicted times behind it."""

    codec: str
    coded: tuple[int, ...]  # profile bucket ids sent with the codec (empty: none)
    exact_s: float  # T(no bucket coded)
    all_s: float  # T(every bucket coded)
    chosen_s: float  # T(coded)
    reason: str

    def to_dict(self) -> JsonDict:
        return {"codec": self.codec, "coded": list(self.coded), "exact_s": self.exact_s, "all_s": self.all_s,
                "chosen_s": self.chosen_s, "reason": self.reason}


def encoded_profile(profile: Profile, cost: CodecCost, coded: Iterable[int]) -> Profile:
    """``profile`` with the buckets ``coded`` sent with ``cost.name`` (module docstring); the others exact."""
    cost.check(profile)
    chosen = set(coded)
    if not chosen:
        return profile
    buckets: list[Bucket] = []
    times: list[BucketTimes] = []
    for b, (bucket, t) in enumerate(zip(profile.buckets, profile.times, strict=True)):
        if b not in chosen:
            buckets.append(bucket)
            times.append(t)
            continue
        frac = cost.wire_nbytes[b] / bucket.nbytes if bucket.nbytes else 1.0
        comm = {}
        for name in profile.link_names:
            measured = profile.comm_time(b, name)
            alpha = min(profile.link(name).alpha_s, measured)
            comm[name] = alpha + (measured - alpha) * frac
        buckets.append(replace(bucket, wire_nbytes=cost.wire_nbytes[b]))
        times.append(replace(t, comm_s=comm, codec_s=cost.codec_s[b]))
    return replace(profile, buckets=tuple(buckets), times=tuple(times), codec=cost.name,
                   meta={**profile.meta, CHOSEN: cost.name})


def exact_profile(profile: Profile) -> Profile:
    """The inverse of :func:`encoded_profile` on a profile deft coded (:data:`CHOSEN`): every bucket exact,
    its comm time ``alpha + (t - alpha) * nbytes / wire``; any other profile unchanged."""
    if not isinstance(profile.meta.get(CHOSEN), str):
        return profile
    buckets: list[Bucket] = []
    times: list[BucketTimes] = []
    for b, (bucket, t) in enumerate(zip(profile.buckets, profile.times, strict=True)):
        if bucket.wire_nbytes is None or bucket.wire_nbytes == 0:
            buckets.append(bucket)
            times.append(t)
            continue
        comm = {}
        for name in profile.link_names:
            coded = profile.comm_time(b, name)
            alpha = min(profile.link(name).alpha_s, coded)
            comm[name] = alpha + (coded - alpha) * bucket.nbytes / bucket.wire_nbytes
        buckets.append(replace(bucket, wire_nbytes=None))
        times.append(replace(t, comm_s=comm, codec_s=0.0))
    meta = {k: v for k, v in profile.meta.items() if k != CHOSEN}
    return replace(profile, buckets=tuple(buckets), times=tuple(times), codec="", meta=meta)


def predicted_s(profile: Profile, config: DeftConfig) -> float:
    """``T``: the no-delay plan's predicted iteration time on ``profile``."""
    return no_delay_plan(profile, config).predicted_iteration_s


def choose(profile: Profile, cost: CodecCost, config: DeftConfig,
           predict: Callable[[Profile, DeftConfig], float] = predicted_s, margin: float = COMM_MARGIN) -> CodecChoice:
    """The coded buckets (module docstring); ``predict`` prices a profile (default :func:`predicted_s`);
    ``margin``: the links' slow-down a bucket left exact must stay hidden under (:data:`COMM_MARGIN`)."""
    cost.check(profile)
    every = tuple(range(profile.n))
    exact_s = predict(profile, config)
    all_s = predict(encoded_profile(profile, cost, every), config)
    if not all_s < exact_s * (1.0 - MIN_GAIN):
        return CodecChoice(cost.name, (), exact_s, all_s, exact_s,
                           f"coding every bucket predicts {all_s:.4g} s against {exact_s:.4g} s exact: less than "
                           f"{MIN_GAIN:.0%} faster, the links are not the bound")
    slow = profile.scaled(comm=margin)
    slow_all = predict(encoded_profile(slow, cost, every), config)
    coded = set(every)
    for b in sorted(every, key=lambda b: (_saving(profile, cost, b), b)):
        trial = coded - {b}
        if predict(encoded_profile(slow, cost, trial), config) <= slow_all * (1.0 + TOLERANCE):
            coded = trial
    if not coded:  # leaving every bucket exact stayed within the tolerance after all
        return CodecChoice(cost.name, (), exact_s, all_s, exact_s, "exact is within the tolerance of coding all")
    chosen_s = predict(encoded_profile(profile, cost, coded), config)
    return CodecChoice(cost.name, tuple(sorted(coded)), exact_s, all_s, chosen_s,
                       f"{len(coded)} of {profile.n} buckets coded: {chosen_s:.4g} s against {exact_s:.4g} s exact")


def free_floor_s(profile: Profile, cost: CodecCost, config: DeftConfig,
                 predict: Callable[[Profile, DeftConfig], float] = predicted_s) -> float:
    """``T`` with every bucket coded with ``cost.name`` and its encode and decode free: no set of coded
    buckets :func:`choose` may pick predicts less (a bucket left exact puts more bytes on its link, a
    codec's compute only adds to the stream the model runs on; the links' list scheduling could in
    principle place a longer send better, which the tests' grid of profiles never shows), so where this
    is not faster than another codec's choice by the margin asked, weighing the codec bucket by bucket
    does not change the answer. A screen, one prediction in place of ``n + 3``."""
    free = replace(cost, codec_s=(0.0,) * len(cost.codec_s))
    return predict(encoded_profile(profile, free, range(profile.n)), config)


def _saving(profile: Profile, cost: CodecCost, b: int) -> float:
    """Seconds of link time coding bucket ``b`` saves on the fastest link, less its codec compute."""
    one = encoded_profile(profile, cost, (b,))
    return min(profile.comm_time(b, lk) - one.comm_time(b, lk) for lk in profile.link_names) - cost.codec_s[b]


def mark(schedule: Schedule, profile: Profile, config: DeftConfig) -> Schedule:
    """``schedule`` (planned on ``profile``) with the codec of each of its buckets: the codec deft chose
    (:data:`CHOSEN`) on the buckets the (partitioned) profile codes. Unchanged for any other profile
    (exact, or compressed by a comm hook the user asked for, which the runtime runs on every bucket)."""
    name = profile.meta.get(CHOSEN)
    if not isinstance(name, str) or not profile.compressed:
        return schedule
    part = profile_for_schedule(profile, schedule, config)
    codecs = tuple(name if b.wire_nbytes is not None else "" for b in part.buckets)
    return replace(schedule, codecs=codecs if any(codecs) else ())


def coded_buckets(codecs: Sequence[str]) -> tuple[int, ...]:
    """The ids of the coded buckets of a ``Schedule.codecs``."""
    return tuple(b for b, c in enumerate(codecs) if c)
