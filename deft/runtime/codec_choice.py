"""deft's own codec choice in a live run (``compression = "auto"``, the default).

When it is considered: ``epsilon > 0`` with the preserver on, two ranks or more, deft measuring its own
profile (no profile or schedule file), no comm hook registered (a user's or the config's, which runs
on every bucket instead), and every trainable parameter in float32 or float64 (casting 16-bit
gradients to 16 bits saves nothing; a mixed-dtype bucket cannot be cast as one tensor).

What it measures, collectively at the end of the profile (every rank, the same result):

* the codec's wire bytes and compute per profiled bucket: torch's ``fp16_compress_hook`` timed on a
  one-rank group (:func:`deft.runtime.comm_hooks.agree_codec`, the maximum over ranks); bf16's cast
  costs the same passes over memory, so one measurement prices both;
* the scale the rounding is judged against (:func:`deft.runtime.grad_stats.gradient_scale`).

Rank 0 then decides inside its plan (:func:`deft.runtime.planning.choose_codec`); every rank rebuilds
the profile the schedule was planned on from the decision's record (:func:`planned_profile`), so the
adaptation and the re-checks calibrate and re-plan on coded times.

The profile iterations' codec (``config.profile_codec``)
--------------------------------------------------------
Where the links are the bound, the iterations before the plan (profile iterations, and those run
while rank 0 plans in the background) cost what torch DDP's do, several times a coded iteration. So
the codec is judged once before them, on the *first* iteration (exact, as every iteration before a
judgement must be): :class:`FirstIteration` gathers that iteration's gradient statistics (the same
estimators as the plan's, a separate instance: the preserver's own statistics start where they always
did) and times it. :func:`profile_codec` decides: the codec the preserver accepts on those statistics
(:func:`deft.preserver.codec_error.pick`, the same bound the plan applies), used when the links look
like the bound: the all-reduces of the first iteration still ran after its backward for longer than
its forward and backward took (``exposed > compute``; then even split evenly over two links the
communication outlasts the compute, which is when coding pays, :data:`deft.solver.codecs.MIN_GAIN`).
The first iteration's compute includes one-off costs, so the screen errs towards exact. Then every
bucket of the profile iterations is sent with it (``Schedule.codecs``); the profile is measured coded
and :func:`deft.solver.codecs.exact_profile` gives the exact times the plan's choice starts from
(the wire time scaled by the bytes, the start-up kept). At the plan the codec is judged again on all
the statistics; the iterations run while rank 0 plans stay coded only if it still passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import DeftError
from deft.preserver import codec_error
from deft.preserver.codec_error import CodecVerdict, GradientScale
from deft.profile import ELEMENTWISE_CODECS, Profile
from deft.runtime.buckets import FlatLayout
from deft.runtime.comm_hooks import agree_codec, codec_hook
from deft.runtime.control import ControlPlane
from deft.runtime.executor import Executor
from deft.runtime.grad_stats import GradStats, gradient_scale
from deft.runtime.planning import CodecInputs
from deft.solver import codecs
from deft.solver.codecs import CodecCost

#: Gradient dtypes a 16-bit codec makes smaller.
WIDE_DTYPES = (torch.float32, torch.float64)


def considered(cfg: DeftConfig, world: int, measuring: bool, hooked: bool, layout: FlatLayout | None) -> bool:
    """Whether deft chooses codecs in this run (module docstring); the same on every rank."""
    return (cfg.compression == "auto" and cfg.epsilon > 0 and cfg.preserver and world >= 2 and measuring
            and not hooked and layout is not None and set(layout.dtype_numel) <= set(WIDE_DTYPES)
            and len(layout.dtype_numel) == 1)


def measure(layout: FlatLayout, params: list[torch.Tensor], solo: dist.ProcessGroup, device: torch.device,
            control: ControlPlane, stats: GradStats | None, batch: int | None) -> CodecInputs | None:
    """Collective: the codec's cost on ``layout``'s buckets and the gradients' scale; None while the
    scale is unknown (no noise estimate yet: the preserver could not judge the rounding)."""
    measured = agree_codec(codec_hook("fp16"), layout, params, solo, device, control)
    scale = gradient_scale(stats, control, batch)
    if measured is None or scale is None:
        return None
    return CodecInputs(CodecCost("fp16", measured.wire_nbytes, measured.codec_s), scale)


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
    cost = CodecCost(name, inputs.cost.wire_nbytes, inputs.cost.codec_s)
    return codecs.encoded_profile(profile, cost, [int(b) for b in coded])  # ints: checked above


# -- the profile iterations' codec (module docstring) ------------------------------------------------------
@dataclass(frozen=True)
class ProfileCodec:
    """The codec every bucket of the profile iterations is sent with (``""``: exact), and why."""

    codec: str
    reason: str
    exposed_s: float | None = None  # the first iteration: all-reduce time after its backward (max over ranks)
    compute_s: float | None = None  # the first iteration: forward + backward (max over ranks)
    delta: float | None = None  # the accepted codec's variance bound (deft.preserver.codec_error)

    def to_dict(self) -> JsonDict:
        return {"codec": self.codec, "reason": self.reason, "exposed_s": self.exposed_s,
                "compute_s": self.compute_s, "delta": self.delta}

    @classmethod
    def from_dict(cls, doc: object) -> ProfileCodec:
        """A checkpoint's ``plan_info["profile_codec"]`` (the run resumes sending what it sent)."""
        if not isinstance(doc, dict) or not isinstance(doc.get("codec"), str) or not isinstance(doc.get("reason"), str):
            raise DeftError(f"deft checkpoint: plan_info.profile_codec: expected an object with the strings "
                            f"'codec' and 'reason', got {doc!r}")
        codec = str(doc["codec"])
        if codec not in ("", *ELEMENTWISE_CODECS):
            raise DeftError(f"deft checkpoint: plan_info.profile_codec.codec: expected '' or one of "
                            f"{list(ELEMENTWISE_CODECS)}, got {codec!r}")
        def num(key: str) -> float | None:
            v = doc.get(key)
            return float(v) if isinstance(v, (int, float)) else None
        return cls(codec, str(doc["reason"]), num("exposed_s"), num("compute_s"), num("delta"))


def profile_codec(mode: str, verdicts: tuple[CodecVerdict, ...], exposed_s: float, compute_s: float) -> ProfileCodec:
    """Pure: the profile iterations' codec from the preserver's verdicts on the first iteration's
    statistics and its timing (module docstring); ``mode`` is ``config.profile_codec``."""
    times = {"exposed_s": exposed_s, "compute_s": compute_s}
    if mode == "never":
        return ProfileCodec("", "profile_codec = \"never\"", **times)
    accepted = next((v for v in verdicts if v.accepted), None)
    if accepted is None:
        return ProfileCodec("", "the preserver accepts no codec on the first iteration's gradients: "
                            + "; ".join(f"{v.codec}: {v.reason}" for v in verdicts), **times)
    if mode == "auto" and not exposed_s > compute_s:
        return ProfileCodec("", f"the links are not the bound in the first iteration: its all-reduces ran "
                            f"{exposed_s:.3g} s after the backward, its forward and backward took {compute_s:.3g} s",
                            **times)
    why = (f"the first iteration's all-reduces ran {exposed_s:.3g} s after the backward against {compute_s:.3g} s "
           "of compute" if mode == "auto" else "profile_codec = \"always\"")
    return ProfileCodec(accepted.codec, f"{why}; {accepted.reason}", delta=accepted.delta, **times)


class FirstIteration:
    """The first iteration's gradient statistics and timing, for :func:`profile_codec` (an executor
    observer while that iteration runs; the facade's events give the times)."""

    def __init__(self) -> None:
        self.stats = GradStats(scale_only=True)
        self._begin: float | None = None
        self._backward_end: float | None = None
        self._end: float | None = None

    def forward_begins(self, executor: Executor, params: list[torch.Tensor],
                       optimizer: torch.optim.Optimizer | None) -> None:
        self.stats.begin_iteration(executor, params, optimizer, True)
        self._begin = time.perf_counter()

    def backward_ends(self, now: float) -> None:
        if self._backward_end is None:
            self._backward_end = now

    def iteration_ends(self) -> None:
        if self._end is None:
            self._end = time.perf_counter()

    def decide(self, cfg: DeftConfig, control: ControlPlane, batch: int | None) -> ProfileCodec:
        """Collective (control group): the same decision on every rank (gathered statistics, times
        maximised over the ranks)."""
        begin, bwd, end = self._begin, self._backward_end, self._end
        # A rank whose first iteration had no backward (a step without one) adds no time of its own.
        mine = [end - bwd, bwd - begin] if begin is not None and bwd is not None and end is not None else [0.0, 0.0]
        exposed, compute = control.max_rows([mine], "first iteration's times")[0]
        scale: GradientScale | None = gradient_scale(self.stats, control, batch)
        if scale is None:
            return ProfileCodec("", "no gradient statistics from the first iteration", exposed, compute)
        return profile_codec(cfg.profile_codec, codec_error.pick(scale, cfg.epsilon), exposed, compute)
