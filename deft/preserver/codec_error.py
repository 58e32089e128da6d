"""Whether a codec (fp16, bf16, int8) keeps the preserver's promise, and which one.

The maths
---------
torch's ``fp16_compress_hook`` (and bf16's) sends ``sum_r Q(g_r / R)``: each rank's gradient divided
by the world size ``R``, rounded to 16 bits, summed over the ranks in 16 bits, cast back. With ``u``
the format's unit roundoff (fp16 ``2^-11``, bf16 ``2^-8``), the cast and each of the ``R - 1``
additions round with a relative error at most ``u`` (normal range), so per element

    |e_i| <= R u mean_r |g_{r,i}|,    hence    |e|² <= R² u² A,    A = mean_r |g_r|²

(Jensen: ``(mean_r |x_r|)² <= mean_r x_r²``). ``A`` is what :mod:`deft.preserver.noise` measures
anyway: ``E A = |g|² + tr Σ / b`` for a per-rank batch ``b``. The mini-batch noise of the averaged
gradient is ``tr Σ / (R b)``; the codec adds at most the fraction

    δ = R² u² A / (tr Σ / (R b)) = R³ u² (b |g|² / tr Σ + 1)

of it. A gradient with ``(1 + δ)`` times the noise variance is, to the walk, a batch of ``B / (1 + δ)``
(:mod:`deft.preserver.gaussian_walk`: the noise enters one step only as ``tau = lr σ / sqrt(B)``), so
the codec is judged like any schedule, by the walk's ratio ``E_B / E_{B/(1+δ)}`` of one step, which
must lie in ``[1 - epsilon, 1 + epsilon]`` (``epsilon == 0`` refuses every codec: ``δ > 0``). That
ratio needs no ``σ``: one step's expected loss above ``S*`` is ``E|m + tau Z|``, and for ``c >= 1``
``E|m + c tau Z| <= E|m + tau Z| + (c - 1) tau E|Z| <= c E|m + tau Z|`` (as ``E|m + tau Z| >= tau E|Z|``),
so with ``c = sqrt(1 + δ)`` the ratio is at least ``1 / sqrt(1 + δ)`` whatever ``|g|``, ``σ``, ``lr``
and the loss: the codec passes when ``1 / sqrt(1 + δ) >= 1 - epsilon``. ``δ`` is a bound, not an
estimate: the rounding errors are in fact unbiased and mostly cancel. Elementwise relative errors
scale like the gradient under Adam's diagonal metric, so ``δ`` is the same in either metric as long
as ``|g|²`` and ``tr Σ`` come from one.

The 8-bit codec (``int8``, :mod:`deft.runtime.codecs.int8`) is not a rounding relative to each element:
each block of 256 elements is rounded stochastically to 255 levels of its largest element. Its error is
unbiased and, with ``P`` the largest over ranks of ``sum_k n_k max_{i in k} g_{r,i}²`` (blocks ``k`` of
``n_k`` elements, measured on the profile's buckets), ``E|e|² <= P / (4 · 127² · R)``, so against the
averaged gradient's noise ``tr Σ / (R b)``

    δ = b P / (4 · 127² · tr Σ),

judged by the same walk ratio. From three ranks on, the codec may instead reduce-scatter: each rank
averages one chunk of every rank's rounded blocks and rounds that average again before the chunks are
exchanged. The second rounding is unbiased given the first's result, so the two errors add in variance,
and each block's average is at most the ranks' mean block maximum, so its error is at most ``P / (4 · 127²)``:
not divided by ``R``, since it rounds the average itself. Then ``E|e|² <= (R + 1) P / (4 · 127² · R)`` and

    δ = (R + 1) b P / (4 · 127² · tr Σ),

charged at every ``R >= 3`` (:func:`int8_rounding_factor`), whichever path each bucket takes (the
gather path's bound is the smaller, so this overstates where it runs, never understates).
``P >= mean_r |g_r|²``, so the gather path's ``δ`` is at least ``(b |g|² / tr Σ + 1) / 64516``:
the bound passes where the gradient's noise dominates its mean (small batches, most of training) and its
largest elements are not far above the rest. The block maxima are not relative to each element, so
``P`` and ``tr Σ`` are Euclidean (``raw_trace``; Adam's metric would scale the error and the noise
differently); the scales are float32, so no range applies.

Range: fp16's largest finite value is 65504; a gradient sum beyond it becomes ``inf`` where the exact
all-reduce would not (with a GradScaler that is a skipped step torch DDP without the codec would not
skip). fp16 is chosen only while the measured largest ``|g_r|`` times ``R`` stays below
``65504 / FP16_HEADROOM`` (a GradScaler that doubles its scale 10 more times still fits); else bf16,
which has float32's range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deft._json import JsonDict
from deft.errors import ContractError
from deft.preserver.feedback import passes

#: Unit roundoff of the 16-bit formats (round to nearest): half an ulp of 1.
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
#: The 8-bit codec's largest level (deft.runtime.codecs.int8.LEVELS; the preserver does not import the runtime).
INT8_LEVELS = 127
#: Every codec the preserver judges.
CODECS = (*UNIT_ROUNDOFF, "int8")
FP16_MAX = 65504.0
#: fp16 only while ``R max|g_r|`` is this many times below fp16's largest value (10 doublings).
FP16_HEADROOM = 2.0 ** 10

_SOURCE = "<codec_error>"


@dataclass(frozen=True)
class GradientScale:
    """What the codec's error is measured against, from the statistics deft gathers anyway:
    ``world`` ranks of ``batch`` samples each, ``|g|²`` and ``tr Σ`` (one metric), and the largest
    ``|g_r|`` element seen on any rank; for ``int8``, the block peak ``P`` and the Euclidean ``tr Σ``
    (``None``: not measured, and int8 is not judged)."""

    world: int
    batch: int
    mu: float
    trace: float
    max_abs: float
    block_peak: float | None = None
    raw_trace: float | None = None

    def __post_init__(self) -> None:
        if self.world < 2 or self.batch < 1:
            raise ContractError(_SOURCE, "world",
                                f"expected >= 2 ranks of >= 1 sample, got {self.world} x {self.batch}")
        for name in ("mu", "trace", "max_abs", "block_peak", "raw_trace"):
            v = getattr(self, name)
            if name in ("block_peak", "raw_trace") and v is None:
                continue
            if not (math.isfinite(v) and v >= 0.0):
                raise ContractError(_SOURCE, name, f"expected a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class CodecVerdict:
    """The preserver's word on one codec: its variance bound ``delta``, the walk's ratio (at least), and why."""

    codec: str
    delta: float
    ratio: float
    accepted: bool
    reason: str

    def to_dict(self) -> JsonDict:
        return {"codec": self.codec, "delta": self.delta, "ratio": self.ratio, "accepted": self.accepted,
                "reason": self.reason}


def int8_rounding_factor(world: int) -> float:
    """The int8 bound's factor for its roundings at ``world`` ranks: 1 where only the all-gather path
    runs (two ranks), ``R + 1`` where the reduce-scatter path may (module docstring)."""
    return 1.0 if world <= 2 else float(world + 1)


def variance_bound(codec: str, scale: GradientScale) -> float:
    """``δ``: the codec's error variance over the averaged gradient's noise, at most (module docstring)."""
    if codec == "int8":
        if scale.block_peak is None or scale.raw_trace is None or scale.raw_trace <= 0.0:
            return math.inf
        return (int8_rounding_factor(scale.world) * scale.batch * scale.block_peak
                / (4.0 * INT8_LEVELS ** 2 * scale.raw_trace))
    u = UNIT_ROUNDOFF[codec]
    if scale.trace <= 0.0:
        return math.inf  # no measured noise to hide the rounding in
    r = float(scale.world)
    return r ** 3 * u * u * (scale.batch * scale.mu / scale.trace + 1.0)


def judge(codec: str, scale: GradientScale, epsilon: float) -> CodecVerdict:
    """The codec passes when the walk's one-step ratio, at least ``1 / sqrt(1 + δ)``, is within
    ``epsilon`` of 1 and, for fp16, the gradients leave the headroom (module docstring)."""
    if codec not in CODECS:
        raise ContractError(_SOURCE, "codec", f"expected one of {list(CODECS)}, got {codec!r}")
    delta = variance_bound(codec, scale)
    if codec == "int8" and (scale.block_peak is None or scale.raw_trace is None):
        return CodecVerdict(codec, delta, 0.0, False, "no block peaks or Euclidean noise measured")
    if codec == "fp16" and scale.world * scale.max_abs > FP16_MAX / FP16_HEADROOM:
        return CodecVerdict(codec, delta, math.nan, False,
                            f"gradients up to {scale.max_abs:.3g} x {scale.world} ranks leave less than "
                            f"{FP16_HEADROOM:.0f}x headroom below fp16's {FP16_MAX:.0f}")
    if not math.isfinite(delta):
        return CodecVerdict(codec, delta, 0.0, False, "no gradient noise measured (tr Σ = 0)")
    ratio = 1.0 / math.sqrt(1.0 + delta)
    ok = epsilon > 0.0 and passes((1,), ratio, epsilon)
    why = (f"rounding adds at most {delta:.2g} of the gradient noise; walk ratio >= {ratio:.6f}"
           + ("" if ok else f", outside 1 +- {epsilon:g}" if epsilon > 0 else "; epsilon = 0 keeps torch DDP's maths"))
    return CodecVerdict(codec, delta, ratio, ok, why)


def pick(scale: GradientScale, epsilon: float) -> tuple[CodecVerdict, ...]:
    """The verdicts in order of preference, fp16 (smaller rounding) then bf16 (float32's range); the
    first accepted one is the codec to use (none accepted: every bucket stays exact). The 16-bit codecs
    only: ``int8`` is judged on its own (:func:`judge`) where the plan prices it against them."""
    return tuple(judge(c, scale, epsilon) for c in ("fp16", "bf16"))
