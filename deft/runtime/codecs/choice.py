"""The plan's codec choice (``compression = "auto"``, the default): which buckets go in fewer bytes.

Rules:

* **When deft chooses.** ``epsilon > 0`` with the preserver on, two ranks or more, deft measuring its
  own profile (no profile or schedule file), no comm hook registered (a user's or the config's runs on
  every bucket instead), and every trainable parameter in one dtype, float32 or float64 (casting
  16-bit gradients to 16 bits saves nothing; a mixed-dtype bucket cannot be cast as one tensor):
  :func:`considered`.
* **What is measured**, collectively at the end of the profile (every rank the same): the 16-bit
  codec's wire bytes and compute per profiled bucket (torch's ``fp16_compress_hook`` on a one-rank
  group, the maximum over ranks; bf16's cast makes the same passes over memory, so one measurement
  prices both), int8's likewise where it may pay (:func:`int8_may_pay`), and the gradients' scale the
  rounding is judged against (:func:`measure_inputs`).
* **The choice** (rank 0, inside its plan): the 16-bit codec the preserver accepts first; int8 in its
  place where the preserver accepts it too and it predicts at least
  :data:`deft.solver.codecs.INT8_MIN_GAIN` less per iteration (:func:`choose_codec`). Every rank rebuilds
  the coded profile the schedule was planned on from the decision's record (:func:`planned_profile`),
  so the adaptation and the re-checks calibrate and re-plan on coded times.
* **int8 is weighed** only where it puts fewer bytes on the wire than 16 bits (its wire bytes on the
  profile's buckets at the run's world size, by the path each bucket takes: :func:`int8_may_pay`) and
  the links stay the bound in 16 bits (:func:`links_bound_in_16_bits`); the first iteration's
  speculation and the profile iterations apply it with the whole compute (:data:`PRE_PLAN_INT8_SHARE`).
  The plan weighs it only where the 16-bit choice leaves room for its gain above the forward and
  backward, and above every bucket in int8 with its casts free (:func:`choose_codec`).
* **While rank 0 plans** the iterations keep the profile iterations' codec while the preserver still
  accepts it on every statistic so far (:func:`lag_codec`).
* **On calibration** the choice is made again on the measured exact profile corrected by the same
  factors as the running one (:class:`Recoding`): the choice priced each bucket on the profiled
  links, and a bucket whose exact all-reduce looked hidden behind the compute is not hidden where the
  links run slower beside the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import DeftError
from deft.preserver import codec_error
from deft.preserver.codec_error import GradientScale
from deft.profile import Profile
from deft.runtime.buckets import FlatLayout
from deft.runtime.codecs.hooks import codec_hook
from deft.runtime.codecs.timing import Codec, measure_codec
from deft.runtime.codecs.wire import int8_fewer_bytes
from deft.runtime.control import ControlPlane
from deft.runtime.grad_stats import GradStats, gradient_scale
from deft.schedule import Schedule
from deft.solver import codecs
from deft.solver.codecs import CodecCost

#: Gradient dtypes a 16-bit codec makes smaller.
WIDE_DTYPES = (torch.float32, torch.float64)
#: int8 is weighed where the 16-bit all-reduce exceeds this share of the forward and backward
#: (:func:`links_bound_in_16_bits`).
INT8_COMPUTE_SHARE = 0.5
#: Before the plan (the first iteration's sends, the profile iterations and those beside rank 0's plan)
#: int8 is taken only where the 16-bit all-reduce exceeds this share of the compute: nothing prices int8
#: against 16 bits there (its start-ups and casts beside the model cost more on many small buckets than
#: on a few large ones), and where the 16-bit all-reduce was about half the compute it cost accuracy as
#: well (benchmarks/results/peers_lm_hosts.md, "int8 against fp16"). The plan weighs int8 from
#: :data:`INT8_COMPUTE_SHARE` on, with its measured costs.
PRE_PLAN_INT8_SHARE = 1.0


@dataclass(frozen=True)
class CodecInputs:
    """What the plan's codec choice needs, the same on every rank: the 16-bit codec measured on the
    profile's buckets, the gradients' scale it is judged against, and the 8-bit codec measured likewise
    (None: not weighed, as where it would not put fewer bytes on the wire)."""

    cost: CodecCost
    scale: GradientScale
    int8: CodecCost | None = None

    def cost_of(self, name: str) -> CodecCost:
        """The measured cost of the codec ``name`` (``int8``, else the 16-bit measurement under that name)."""
        if name == "int8":
            if self.int8 is None:
                raise DeftError("internal: the plan chose int8, which was not measured")
            return self.int8
        return dataclasses.replace(self.cost, name=name)


def considered(cfg: DeftConfig, world: int, measuring: bool, hooked: bool, layout: FlatLayout | None) -> bool:
    """Whether deft chooses codecs in this run (module docstring); the same on every rank."""
    return (cfg.compression == "auto" and cfg.epsilon > 0 and cfg.preserver and world >= 2 and measuring
            and not hooked and layout is not None and set(layout.dtype_numel) <= set(WIDE_DTYPES)
            and len(layout.dtype_numel) == 1)


def measure_inputs(layout: FlatLayout, params: list[torch.Tensor], solo: dist.ProcessGroup, device: torch.device,
                   control: ControlPlane, stats: GradStats | None, batch: int | None,
                   profiled: Codec | None = None, profile: Profile | None = None,
                   hosts: tuple[int, int] | None = None) -> CodecInputs | None:
    """Collective: the codecs' cost on ``layout``'s buckets and the gradients' scale; None while the
    scale is unknown (no noise estimate yet: the preserver could not judge the rounding). ``profiled``:
    the profile iterations' own codec (16-bit or int8), already measured on ``layout`` (every rank has
    it), reused; ``profile``: the measured profile (every rank has it), which says whether int8 is
    measured (:func:`int8_may_pay`); ``hosts``: the links' hierarchical layout (wire bytes priced by
    :func:`deft.runtime.codecs.wire.flat_path_factor`)."""
    eight = profiled if profiled is not None and profiled.name == "int8" else None
    sixteen = profiled if profiled is not None and profiled.name != "int8" else None
    measured = sixteen if sixteen is not None else measure_codec(codec_hook("fp16"), layout, params, solo, device,
                                                                 control, hosts)
    scale = gradient_scale(stats, control, batch)
    if measured is None or scale is None:
        return None
    if eight is not None:
        int8: CodecCost | None = CodecCost("int8", eight.wire_nbytes, eight.codec_s)
    else:
        int8 = measure_int8(layout, params, solo, device, control, hosts) if int8_may_pay(profile, control.world) \
            else None
    return CodecInputs(CodecCost("fp16", measured.wire_nbytes, measured.codec_s), scale, int8)


def measure_int8(layout: FlatLayout, params: list[torch.Tensor], solo: dist.ProcessGroup, device: torch.device,
                 control: ControlPlane, hosts: tuple[int, int] | None = None) -> CodecCost | None:
    """Collective: the 8-bit codec's cost on ``layout``'s buckets (for the plan's choice, or for a choice
    made again where the plan did not weigh it: :meth:`Recoding.int8_wanted`)."""
    eight = measure_codec(codec_hook("int8"), layout, params, solo, device, control, hosts)
    return None if eight is None else CodecCost("int8", eight.wire_nbytes, eight.codec_s)


def choose_codec(cfg: DeftConfig, profile: Profile, codec: CodecInputs | None) -> tuple[Profile, JsonDict | None]:
    """Rank 0: the profile to plan on, with the buckets deft sends coded (:func:`deft.solver.codecs.choose`)
    and the record of why (None: not considered). The 16-bit codec the preserver accepts first
    (:func:`deft.preserver.codec_error.pick`) is chosen; where int8 was measured and the preserver
    accepts it too, its choice replaces the 16-bit one (coded or left exact) when it predicts at least
    :data:`deft.solver.codecs.INT8_MIN_GAIN` less per iteration (fewer bits only where they clearly pay).
    int8 is not weighed where the 16-bit choice already predicts within that gain of the forward and
    backward, which no plan's iteration is shorter than, nor where every bucket coded with int8 at no
    codec compute (:func:`deft.solver.codecs.free_floor_s`) predicts within it: the answer is the same,
    for one plan or none instead of ``n + 3``."""
    if codec is None or cfg.epsilon == 0:
        return profile, None
    verdicts = codec_error.pick(codec.scale, cfg.epsilon)
    if codec.int8 is not None:
        verdicts = (*verdicts, codec_error.judge("int8", codec.scale, cfg.epsilon))
    record: JsonDict = {"verdicts": [v.to_dict() for v in verdicts], "coded": []}
    sixteen = next((v for v in verdicts if v.accepted and v.codec != "int8"), None)
    eight = next((v for v in verdicts if v.accepted and v.codec == "int8"), None)
    if sixteen is None and eight is None:
        record["reason"] = "the preserver accepts no codec"
        return profile, record
    choices = [] if sixteen is None else [codecs.choose(profile, codec.cost_of(sixteen.codec), cfg)]
    floor_s = profile.forward_s + profile.backward_s
    if eight is not None and choices and choices[0].chosen_s * (1.0 - codecs.INT8_MIN_GAIN) <= floor_s:
        # no plan's iteration is shorter than its forward and backward: int8 cannot predict the gain
        record["int8"] = (f"not weighed: {choices[0].codec} predicts {choices[0].chosen_s:.4g} s, within "
                          f"{codecs.INT8_MIN_GAIN:.0%} of the {floor_s:.4g} s of forward and backward")
    elif eight is not None and choices and choices[0].chosen_s * (1.0 - codecs.INT8_MIN_GAIN) \
            <= (best_s := codecs.free_floor_s(profile, codec.cost_of(eight.codec), cfg)):
        # not even every bucket in int8 at no codec cost predicts the gain: no choice of int8's can
        record["int8"] = (f"not weighed: {choices[0].codec} predicts {choices[0].chosen_s:.4g} s, within "
                          f"{codecs.INT8_MIN_GAIN:.0%} of the {best_s:.4g} s of every bucket in int8 with no "
                          f"codec compute")
    elif eight is not None:
        choices.append(codecs.choose(profile, codec.cost_of(eight.codec), cfg))
    choice = choices[0]
    if len(choices) == 2:
        record["alternatives"] = [c.to_dict() for c in choices]
        if choices[1].coded and choices[1].chosen_s < choice.chosen_s * (1.0 - codecs.INT8_MIN_GAIN):
            choice = choices[1]
    cost = codec.cost_of(choice.codec)
    record.update(choice.to_dict())
    record["parameters"] = [name for b in choice.coded for name in profile.buckets[b].params]
    return codecs.encoded_profile(profile, cost, choice.coded), record


def lag_codec(profile_codec: str, inputs: CodecInputs | None, epsilon: float) -> str:
    """Pure: the codec of the iterations run while rank 0 plans: the profile iterations' (``profile_codec``,
    ``""`` exact) while the preserver still accepts a codec on every statistic so far (``inputs``, the
    same on every rank): int8 where they were int8 and it still passes (and was measured), else the
    16-bit codec that passes, else exact."""
    if not profile_codec or inputs is None:
        return ""
    if profile_codec == "int8" and inputs.int8 is not None \
            and codec_error.judge("int8", inputs.scale, epsilon).accepted:
        return "int8"
    accepted = next((v for v in codec_error.pick(inputs.scale, epsilon) if v.accepted), None)
    return "" if accepted is None else accepted.codec


def links_bound_in_16_bits(comm_s: float, compute_s: float, share: float = INT8_COMPUTE_SHARE) -> bool:
    """Pure: whether the links stay the bound in 16 bits, so that fewer bytes may pay, from the exact
    all-reduce's time over the links ``comm_s`` and the forward and backward ``compute_s``: the 16-bit
    all-reduce, ``comm_s / 2``, exceeds ``share`` of the compute (:data:`INT8_COMPUTE_SHARE` for the
    plan's weighing, :data:`PRE_PLAN_INT8_SHARE` before the plan). Not the whole
    compute: sends start only as the backward produces their buckets, the last one's is exposed
    whatever the compute, and the all-reduces run slower beside the model than profiled alone (the
    adaptation's measured factor), so where the 16-bit all-reduce about equals the compute the links
    are still the bound (benchmarks/results/slow_links.md). Where int8 does not pay after all, the
    plan's simulation leaves it out (:func:`choose_codec`)."""
    return comm_s / 2.0 > share * compute_s


def int8_may_pay(profile: Profile | None, world: int) -> bool:
    """Pure: whether the 8-bit codec is measured for the plan's choice: it puts fewer bytes on the wire
    than 16 bits (:func:`deft.runtime.codecs.wire.int8_fewer_bytes` on the profile's buckets at ``world``
    ranks, the scatter path counted where every link is gloo) and :func:`links_bound_in_16_bits` holds
    on the profile's exact all-reduce time, spread over its links, and its forward and backward.
    Elsewhere the 16-bit sends
    hide under the compute, and timing int8's encode and decode (four passes over every bucket) would
    only delay the plan."""
    if profile is None:
        return False
    gloo = all(profile.link(lk).backend == "gloo" for lk in profile.link_names)
    if not int8_fewer_bytes(world, [b.numel for b in profile.buckets], scatter_ok=gloo):
        return False
    exact = codecs.exact_profile(profile)
    comm = sum(min(exact.comm_time(b, lk) for lk in exact.link_names) for b in range(exact.n))
    return links_bound_in_16_bits(comm / len(exact.link_names), exact.forward_s + exact.backward_s)


def planned_profile(profile: Profile, inputs: CodecInputs | None, info: JsonDict) -> Profile:
    """The profile rank 0 planned on: ``profile`` with the buckets its decision coded (``info["codecs"]``)."""
    record = info.get("codecs")
    if inputs is None or not isinstance(record, dict):
        return profile
    coded, name = record.get("coded"), record.get("codec")
    if not coded:
        return profile
    if not (isinstance(coded, list) and all(isinstance(b, int) for b in coded) and isinstance(name, str)):
        raise DeftError(f"internal: rank 0's codec decision is malformed: {record!r}")
    return codecs.encoded_profile(profile, inputs.cost_of(name), [int(b) for b in coded])  # ints: checked above


def schedule_profile(exact: Profile, inputs: CodecInputs | None, schedule: Schedule) -> Profile | None:
    """Pure: ``exact`` (every bucket exact) priced as ``schedule`` sends it, for a schedule on its buckets
    in one codec at most (the warm-up's candidates of :mod:`deft.runtime.adapt`, step 4); None where it
    cannot be priced (other buckets, several codecs, a codec not measured)."""
    if tuple(b.nbytes for b in exact.buckets) != schedule.bucket_nbytes:
        return None
    names = {c for c in schedule.codecs if c}
    if not names:
        return exact
    name = names.pop()
    if names or inputs is None or (name == "int8" and inputs.int8 is None):
        return None
    return codecs.encoded_profile(exact, inputs.cost_of(name), [b for b, c in enumerate(schedule.codecs) if c])


@dataclass(frozen=True)
class Recoding:
    """The plan's codec choice, to be made again on a calibrated profile (module docstring)."""

    base: Profile  # the measured profile with every bucket exact, corrected as the running profile was
    inputs: CodecInputs  # the codecs' measured costs on base's buckets and the gradients' scale
    chosen: tuple[str, tuple[int, ...]]  # the running choice: its codec and base's coded buckets

    @classmethod
    def of(cls, base: Profile | None, inputs: CodecInputs | None, info: Mapping[str, object]) -> Recoding | None:
        """From the first plan: its exact profile, the codec inputs and its record (``info["codecs"]``);
        None where deft did not choose the codecs (no inputs, or no decision recorded)."""
        record = info.get("codecs")
        if base is None or inputs is None or not isinstance(record, dict):
            return None
        return cls(base, inputs, _choice(record))

    def scaled(self, compute: float, comm: float) -> Recoding:
        """The exact profile corrected by a calibration's factors (later calibrations, measured against
        the corrected running profile, then compose)."""
        return replace(self, base=self.base.scaled(compute, comm))

    def int8_wanted(self) -> bool:
        """int8 was not measured for the first plan (its links were not the bound in 16 bits) and on
        ``base`` as corrected now they are (:func:`int8_may_pay`): worth measuring before choosing again."""
        return self.inputs.int8 is None and int8_may_pay(self.base, self.base.world_size)

    def with_int8(self, cost: CodecCost) -> Recoding:
        """int8 measured since (:meth:`int8_wanted`): weighed from the next choice on."""
        return replace(self, inputs=replace(self.inputs, int8=cost))

    def choose(self, config: DeftConfig) -> tuple[Profile, tuple[str, tuple[int, ...]], JsonDict]:
        """The codec choice on ``base``: the coded profile, the choice and its record (with ``weighed``,
        each codec's predicted iteration where 16 bits and int8 were both weighed, and ``int8``, why int8
        was not, where it says)."""
        profile, record = choose_codec(config, self.base, self.inputs)
        record = record or {}
        out: JsonDict = {k: record[k] for k in ("codec", "coded", "chosen_s", "reason", "int8") if k in record}
        alternatives = record.get("alternatives")
        if isinstance(alternatives, list):
            out["weighed"] = {str(a["codec"]): a["chosen_s"] for a in alternatives if isinstance(a, dict)}
        return profile, _choice(record), out


def _choice(record: Mapping[str, object]) -> tuple[str, tuple[int, ...]]:
    """The codec and coded buckets of a codec decision's record (none coded: ``("", ())``)."""
    coded = record.get("coded")
    buckets = tuple(int(b) for b in coded if isinstance(b, int)) if isinstance(coded, list) else ()
    codec = record.get("codec")
    return (str(codec), buckets) if buckets and isinstance(codec, str) else ("", ())
