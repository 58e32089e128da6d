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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import DeftError
from deft.profile import Profile
from deft.runtime.buckets import FlatLayout
from deft.runtime.comm_hooks import agree_codec, codec_hook
from deft.runtime.control import ControlPlane
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
