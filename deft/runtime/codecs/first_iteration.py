"""The first iteration's codec: its own sends, and the codec of the profile iterations after it.

Where the links are the bound, the iterations before the plan (the first, the profile iterations,
those run while rank 0 plans) cost what torch DDP's do, several times a coded iteration. So the codec
is judged on the first iteration itself; every rank decides alike (gathered samples, times maximised
over the ranks). Rules:

* **The screen** (:func:`screen_first_sends`, at the first gradient, collective): the sends are judged
  only where the links may be the bound: the construction's broadcast of the model, scaled to an
  all-reduce of the gradients over the links (:class:`TimedBroadcast`), is longer than the forward and
  backward, estimated as :data:`COMPUTE_PER_FIRST_GRADIENT` times the time to the first gradient (a
  layer's backward computes two products to its forward's one). An exact all-reduce that fits within
  the compute is hidden by it, so elsewhere the sends go exact, unjudged. The estimate is made before
  the backward's one-off costs, which inflate the measured forward and backward.
* **Speculation**: judged sends do not wait for the verdict, so the backward keeps its overlap. They go
  in :func:`speculative_codec` from the first gradient, each hook on a copy of its bucket so that the
  buffers keep the exact local gradient: int8 where it puts fewer bytes than 16 bits and the 16-bit
  all-reduce would still outlast the compute (:func:`deft.runtime.codecs.choice.links_bound_in_16_bits`
  at :data:`deft.runtime.codecs.choice.PRE_PLAN_INT8_SHARE`), else :data:`SPECULATIVE_CODEC`.
* **The verdict** (:func:`first_sends_codec`, at the end of the backward, once every send is launched on
  every rank, so each link has carried the same collectives everywhere): the preserver judges the codec
  on a sample of the gradients (below). Where it names another codec, or none (the preserver refuses,
  or a non-finite sample as GradScaler's overflow gives), every bucket is sent again with it and the
  speculative results are dropped: the update is exactly the judged codec's. The verdict does not judge
  the timing again: the sends are on the wire, and sending them again exact costs the whole exact
  all-reduce on top of them. int8 sends stand where int8's bound passes, and a 16-bit speculation never
  becomes int8: by the end of the backward most of the bytes are sent.
* **The sample**: each rank contributes :data:`SAMPLE_SIZE` coordinates of its local gradient (drawn
  with a seed every rank shares), its largest element and its int8 block peak. The sample's mean over
  ranks and spread between ranks estimate ``|g|²`` and ``tr Σ`` as the preserver's estimators do on
  whole gradients (:func:`sampled_scale`); the noise is taken :data:`SAMPLE_Z` standard errors below its
  estimate and :data:`SAMPLE_MARGIN` times smaller again, because one iteration's noise judges the
  iterations to come.
* **The profile iterations' codec** (``config.profile_codec``, :func:`profile_iterations_codec`, decided
  after the first iteration): where the sends were judged, their sample decides it too (the
  whole-gradient statistics are then not gathered: their passes over the gradient would slow the first
  backward, and the sample's margin judges more strictly); elsewhere :class:`FirstIteration`'s
  whole-gradient statistics do. The preserver's accepted codec is used where coding saves at least
  :data:`PROFILE_GAIN` of the first iteration's time: the profile iterations run torch DDP's synchronous
  schedule, so coding saves at most the all-reduce time exposed after the backward and at most half the
  whole all-reduce, ``saving = min(exposed, comm / 2)`` (``exposed / 2`` where no broadcast was timed).
  The bar is above the plan's because a coded profile gives the plan exact times derived from coded
  ones; the first iteration's compute includes one-off costs, so the rule errs towards exact. Under
  ``"auto"`` a 16-bit decision becomes int8 where int8 passes and either the first sends went in int8 or
  the links stay the bound in 16 bits. The profile is then measured coded, and
  :func:`deft.solver.codecs.exact_profile` gives the exact times the plan's choice starts from.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import DeftError
from deft.preserver import codec_error
from deft.preserver.codec_error import CodecVerdict, GradientScale
from deft.runtime.codecs import int8
from deft.runtime.codecs.choice import PRE_PLAN_INT8_SHARE, links_bound_in_16_bits
from deft.runtime.codecs.hooks import CommHook
from deft.runtime.codecs.int8 import BLOCK as INT8_BLOCK
from deft.runtime.codecs.int8 import block_maxima
from deft.runtime.codecs.wire import int8_fewer_bytes
from deft.runtime.control import ControlPlane
from deft.runtime.executor import Executor
from deft.runtime.grad_stats import GradStats, gradient_scale

#: Coordinates of the first iteration's local gradient each rank contributes to the judgement of its sends.
SAMPLE_SIZE = 65536
#: The sampled noise is taken this many standard errors below its estimate (its confidence interval over
#: the sampled coordinates, one-sided: a chance of about 3e-5 that the whole gradient's is lower) ...
SAMPLE_Z = 4.0
#: ... and then this many times smaller: one iteration's noise judges the iterations to come, whose own
#: estimate (the plan's, over the profile iterations) may be smaller (benchmarks/results/slow_links.md).
SAMPLE_MARGIN = 4.0
#: The seed of the sampled coordinates (the same on every rank).
SAMPLE_SEED = 0x5EED
#: The profile iterations are coded where that saves at least this share of the first iteration's time.
PROFILE_GAIN = 0.10
#: The first iteration's forward and backward, estimated as this many times its time to the first
#: gradient (the screen at it: a layer's backward computes two products to its forward's one).
COMPUTE_PER_FIRST_GRADIENT = 3.0
#: The codecs of the first iteration's own sends and of the profile iterations: 16 bits, or int8 where
#: its bound passes on the first iteration's sample and the links are the bound even in 16 bits.
PROFILE_CODECS = (*codec_error.UNIT_ROUNDOFF, "int8")
#: The codec the first iteration's judged sends go in before the verdict where int8 cannot pay (the
#: preserver's first choice): :func:`speculative_codec`.
SPECULATIVE_CODEC = "fp16"

log = logging.getLogger("deft.runtime")


@dataclass(frozen=True)
class CodecDecision:
    """A codec decision of the first iteration, and why: its own sends' (:func:`first_sends_codec`) or the
    profile iterations' (:func:`profile_iterations_codec`, ``plan_info["profile_codec"]``); ``""``: exact."""

    codec: str
    reason: str
    exposed_s: float | None = None  # the first iteration: all-reduce time after its backward (max over ranks)
    compute_s: float | None = None  # the first iteration: forward + backward (max over ranks)
    delta: float | None = None  # the accepted codec's variance bound (deft.preserver.codec_error)
    first: JsonDict | None = None  # the first iteration's own sends: first_sends_codec's decision
    speculative: str = ""  # the first iteration's sends: the codec they went in before the verdict ("": none)

    def to_dict(self) -> JsonDict:
        return {"codec": self.codec, "reason": self.reason, "exposed_s": self.exposed_s,
                "compute_s": self.compute_s, "delta": self.delta, "first": self.first,
                "speculative": self.speculative}

    @classmethod
    def from_dict(cls, doc: object) -> CodecDecision:
        """A checkpoint's ``plan_info["profile_codec"]`` (the run resumes sending what it sent)."""
        if not isinstance(doc, dict) or not isinstance(doc.get("codec"), str) or not isinstance(doc.get("reason"), str):
            raise DeftError(f"deft checkpoint: plan_info.profile_codec: expected an object with the strings "
                            f"'codec' and 'reason', got {doc!r}")
        codec = str(doc["codec"])
        if codec not in ("", *PROFILE_CODECS):
            raise DeftError(f"deft checkpoint: plan_info.profile_codec.codec: expected '' or one of "
                            f"{list(PROFILE_CODECS)}, got {codec!r}")
        def num(key: str) -> float | None:
            v = doc.get(key)
            return float(v) if isinstance(v, (int, float)) else None
        first = doc.get("first")
        if first is not None and not (isinstance(first, dict) and isinstance(first.get("codec"), str)):
            raise DeftError(f"deft checkpoint: plan_info.profile_codec.first: expected null or an object with "
                            f"the string 'codec', got {first!r}")
        speculative = doc.get("speculative", "")
        if speculative not in ("", *PROFILE_CODECS):
            raise DeftError(f"deft checkpoint: plan_info.profile_codec.speculative: expected '' or one of "
                            f"{list(PROFILE_CODECS)}, got {speculative!r}")
        return cls(codec, str(doc["reason"]), num("exposed_s"), num("compute_s"), num("delta"), first,
                   str(speculative))


@dataclass(frozen=True)
class TimedBroadcast:
    """The construction's broadcast of rank 0's parameters and buffers on the primary link, timed (after
    a one-element all-reduce has set the group up): the one measurement of the links before the first
    iteration."""

    seconds: float
    nbytes: int

    def allreduce_s(self, nbytes: int, world: int, links: int) -> float:
        """An all-reduce of ``nbytes`` split over ``links`` equal links, predicted from it: a ring
        all-reduce moves ``2 (R - 1) / R`` of the bytes through each rank, a broadcast all of them once."""
        if self.nbytes <= 0 or links < 1:
            return 0.0
        return self.seconds * (nbytes / self.nbytes) * 2.0 * (world - 1) / world / links


def _screen(mode: str, verdicts: tuple[CodecVerdict, ...], whose: str, exposed_s: float | None,
            compute_s: float | None) -> CodecDecision | CodecVerdict:
    """The rules both decisions share: ``"never"`` and a preserver accepting no codec (on ``whose``
    gradients) keep the sends exact (that decision is returned); otherwise the accepted verdict."""
    if mode == "never":
        return CodecDecision("", "profile_codec = \"never\"", exposed_s=exposed_s, compute_s=compute_s)
    accepted = next((v for v in verdicts if v.accepted), None)
    if accepted is None:
        return CodecDecision("", f"the preserver accepts no codec on {whose} gradients: "
                            + "; ".join(f"{v.codec}: {v.reason}" for v in verdicts),
                            exposed_s=exposed_s, compute_s=compute_s)
    return accepted


def first_sends_codec(mode: str, verdicts: tuple[CodecVerdict, ...], comm_s: float | None,
                      compute_s: float, int8: CodecVerdict | None = None, speculative: str = "") -> CodecDecision:
    """Pure: the codec of the first iteration's own sends (module docstring), from the preserver's
    verdicts on the sampled statistics, ``comm_s`` (the construction's broadcast scaled to the
    gradients' all-reduce over the links; None: not measured) and the iteration's forward and backward
    (recorded: the screen at the first gradient judged the timing). Where they went speculatively in
    int8 (``speculative``) and int8's verdict on the same sample (``int8``) passes, a 16-bit decision
    becomes int8: the sends stand (sending them again in 16 bits would cost more link time than they
    have left). 16-bit sends never become int8 for the same reason."""
    decision = _first_sends_codec(mode, verdicts, comm_s, compute_s)
    if decision.codec and speculative == "int8" and int8 is not None:
        if int8.accepted:
            return replace(decision, codec="int8", delta=int8.delta,
                           reason=f"{decision.reason}; the sends went in int8 and stand: {int8.reason}")
        return replace(decision, reason=f"{decision.reason}; the sends went in int8, refused: {int8.reason}")
    return decision


def _first_sends_codec(mode: str, verdicts: tuple[CodecVerdict, ...], comm_s: float | None,
                       compute_s: float) -> CodecDecision:
    accepted = _screen(mode, verdicts, "the first iteration's sampled", comm_s, compute_s)
    if isinstance(accepted, CodecDecision):
        return accepted
    if mode == "auto":
        if comm_s is None:
            return CodecDecision("", "no timed broadcast of the model at construction (init_sync off)",
                                exposed_s=comm_s, compute_s=compute_s)
        # No timing rule here: the screen at the first gradient judged the links possibly the bound and
        # the sends are on the wire; sending them again exact would add the whole exact all-reduce.
        why = (f"the gradients' all-reduce predicts {comm_s:.3g} s ({compute_s:.3g} s of forward and backward "
               "measured)")
    else:
        why = "profile_codec = \"always\""
    return CodecDecision(accepted.codec, f"{why}; on a sample of the gradients, {accepted.reason}",
                        delta=accepted.delta, exposed_s=comm_s, compute_s=compute_s)


def screen_first_sends(mode: str, comm_s: float | None, to_first_grad_s: float) -> CodecDecision | None:
    """Pure: the screen at the first iteration's first gradient (module docstring). None: its sends are
    judged at the end of its backward (speculatively coded meanwhile); else the decision to send them
    exact, unjudged, and why. ``comm_s``: the construction's broadcast scaled to the gradients'
    all-reduce over the links (None: not timed); ``to_first_grad_s``: from the forward's start to the
    first gradient."""
    if mode == "always":
        return None
    compute = COMPUTE_PER_FIRST_GRADIENT * to_first_grad_s
    if comm_s is None:
        return CodecDecision("", "no timed broadcast of the model at construction (init_sync off)", compute_s=compute)
    if comm_s > compute:
        return None
    return CodecDecision("", f"the links cannot be the bound: the gradients' all-reduce predicts {comm_s:.3g} s from "
                        f"the construction's broadcast, against about {compute:.3g} s of forward and backward "
                        f"({COMPUTE_PER_FIRST_GRADIENT:g}x the {to_first_grad_s:.3g} s to the first gradient); "
                        "sent exact, not judged", exposed_s=comm_s, compute_s=compute)


def speculative_codec(mode: str, comm_s: float | None, compute_s: float, world: int,
                      numels: Sequence[int] = (2 ** 20,), scatter_ok: bool = True) -> str:
    """Pure: the codec the first iteration's judged sends go in before the verdict: under ``"auto"``
    (``mode``: ``config.profile_codec``), int8 where it puts fewer bytes on the wire than 16 bits
    (:func:`deft.runtime.codecs.wire.int8_fewer_bytes` on buckets of ``numels`` elements at ``world``
    ranks; ``scatter_ok``: its scatter path may run) and the links would stay the bound in 16 bits
    (:func:`links_bound_in_16_bits` at :data:`PRE_PLAN_INT8_SHARE` on the predicted all-reduce ``comm_s``
    and ``compute_s``, the screen's estimate of the forward and backward: the rule of
    :func:`profile_iterations_codec`), else :data:`SPECULATIVE_CODEC`. ``"always"`` codes
    whatever the timing, so it keeps to the 16-bit codec, which no timing chooses. A verdict refusing
    int8 sends every bucket again in 16 bits (or exact): the int8 sends' link time lost, a quarter of the
    exact all-reduce's at two ranks."""
    if (mode == "auto" and comm_s is not None and int8_fewer_bytes(world, numels, scatter_ok)
            and links_bound_in_16_bits(comm_s, compute_s, PRE_PLAN_INT8_SHARE)):
        return "int8"
    return SPECULATIVE_CODEC


def sampled_scale(samples: torch.Tensor, numel: int, batch: int | None, max_abs: float,
                  margin: float = SAMPLE_MARGIN, block_peak: float | None = None,
                  z: float = SAMPLE_Z) -> GradientScale | None:
    """Pure: the :class:`GradientScale` of the first iteration from ``samples`` (one row per rank, the
    same ``k`` coordinates of each rank's local gradient, float64) of a gradient of ``numel`` elements:
    the noise at the lower end of its confidence interval over the sampled coordinates (``z`` standard
    errors below the estimate) and then divided by ``margin`` (module docstring); ``block_peak``: the
    largest rank's int8 block peak of its whole local gradient (None: int8 not judged). None where it
    cannot be judged: one rank, no batch size, a non-finite sample (an fp16 overflow), or a noise the
    sample cannot tell from zero (no spread between ranks, or less than ``z`` standard errors of it).

    Each sampled coordinate ``j`` (drawn with replacement, the same on every rank) gives an unbiased
    estimate of the whole trace, ``c_j = n (mean_r x_rj² - (mean_r x_rj)²) R b / (R - 1)``; the estimate
    is their mean and its standard error ``std_j(c_j) / sqrt(k)`` (none where every coordinate is in the
    sample). A few coordinates far noisier than the rest are the sample's danger: missed, the estimate
    is low (the safe side); caught, they widen the standard error with it."""
    world, k = samples.shape
    if world < 2 or batch is None or k == 0 or not bool(torch.isfinite(samples).all()) or not math.isfinite(max_abs):
        return None
    spread = samples.square().mean(dim=0) - samples.mean(dim=0).square()  # per coordinate, over ranks
    per_coordinate = spread.clamp(min=0.0) * numel * world * batch / (world - 1)
    trace = float(per_coordinate.mean())
    if k < numel and k > 1:
        trace -= z * float(per_coordinate.std()) / math.sqrt(k)
    if trace <= 0.0:
        return None
    avg_sq = numel / k * float(samples.mean(dim=0).square().sum())  # |ḡ|²
    mu = max(0.0, avg_sq - float(per_coordinate.mean()) / (world * batch))
    peak = block_peak if block_peak is not None and math.isfinite(block_peak) else None
    # the sample is of the plain gradients: its trace is the Euclidean one int8 is judged against
    return GradientScale(world=world, batch=batch, mu=mu, trace=trace / margin, max_abs=max_abs,
                         block_peak=peak, raw_trace=trace / margin if peak is not None else None)


def sample_coordinates(numel: int, k: int = SAMPLE_SIZE) -> torch.Tensor:
    """``k`` coordinates of ``numel``, drawn with replacement (sums over them, scaled by ``numel / k``,
    are unbiased), the same on every rank; every coordinate where ``numel <= k``."""
    if numel <= k:
        return torch.arange(numel)
    return torch.randint(0, numel, (k,), generator=torch.Generator().manual_seed(SAMPLE_SEED))


def profile_iterations_codec(mode: str, verdicts: tuple[CodecVerdict, ...], exposed_s: float, compute_s: float,
                  first_codec: str = "", comm_s: float | None = None,
                  int8: CodecVerdict | None = None) -> CodecDecision:
    """Pure: the profile iterations' codec from the preserver's verdicts on the first iteration's
    statistics and its timing (module docstring); ``mode`` is ``config.profile_codec``;
    ``first_codec``: the codec the first iteration's own sends used (its time then says nothing of
    the exact sends: the links were judged the bound before it); ``comm_s``: the predicted
    all-reduce of the gradients (None: no timed broadcast); ``int8``: the preserver's verdict on int8 on
    the same statistics (None: not judged, as where it puts no fewer bytes on the wire). Under ``"auto"`` a 16-bit
    decision becomes int8 where int8 passes and either the first iteration's sends stood in int8 (the
    screen at its first gradient judged int8 to pay: :func:`speculative_codec`) or the links stay the
    bound in 16 bits (:func:`links_bound_in_16_bits` at :data:`PRE_PLAN_INT8_SHARE`);
    ``"always"`` codes whatever the timing, so it keeps to 16 bits, which no timing chooses."""
    decision = _profile_iterations_codec(mode, verdicts, exposed_s, compute_s, first_codec, comm_s)
    if mode == "auto" and decision.codec and int8 is not None and int8.accepted and first_codec == "int8":
        return replace(decision, codec="int8", delta=int8.delta,
                       reason=f"{decision.reason}; int8, as the first iteration's sends: {int8.reason}")
    if (mode == "auto" and decision.codec and int8 is not None and int8.accepted and comm_s is not None
            and links_bound_in_16_bits(comm_s, compute_s, PRE_PLAN_INT8_SHARE)):
        return replace(decision, codec="int8", delta=int8.delta,
                       reason=f"{decision.reason}; int8: the links stay the bound in 16 bits (the all-reduce "
                              f"predicts {comm_s:.3g} s, half of it above {PRE_PLAN_INT8_SHARE:g} x the "
                              f"{compute_s:.3g} s of forward and backward), {int8.reason}")
    if decision.codec and int8 is not None:  # say why not, with its bound on these statistics
        return replace(decision, reason=f"{decision.reason}; int8 not taken: {int8.reason}")
    return decision


def _profile_iterations_codec(mode: str, verdicts: tuple[CodecVerdict, ...], exposed_s: float, compute_s: float,
                   first_codec: str, comm_s: float | None) -> CodecDecision:
    accepted = _screen(mode, verdicts, "the first iteration's", exposed_s, compute_s)
    if isinstance(accepted, CodecDecision):
        return accepted
    if first_codec:
        return CodecDecision(accepted.codec, f"the first iteration was sent in {first_codec} (the links judged the "
                            f"bound before it); on the same sample, {accepted.reason}",
                            delta=accepted.delta, exposed_s=exposed_s, compute_s=compute_s)
    saving = min(exposed_s, comm_s / 2.0) if comm_s is not None else exposed_s / 2.0
    bar = PROFILE_GAIN * (compute_s + exposed_s)
    if mode == "auto" and not saving >= bar:
        return CodecDecision("", f"coding saves too little in the first iteration: its all-reduces ran "
                            f"{exposed_s:.3g} s after the backward ({compute_s:.3g} s of forward and backward), at "
                            f"most {saving:.3g} s saved against {PROFILE_GAIN:.0%} of the iteration ({bar:.3g} s)",
                            exposed_s=exposed_s, compute_s=compute_s)
    why = (f"coding saves up to {saving:.3g} s of the first iteration's {compute_s + exposed_s:.3g} s (its all-reduces "
           f"ran {exposed_s:.3g} s after the backward)" if mode == "auto" else "profile_codec = \"always\"")
    return CodecDecision(accepted.codec, f"{why}; {accepted.reason}", delta=accepted.delta,
                        exposed_s=exposed_s, compute_s=compute_s)


class FirstIteration:
    """The first iteration's gradient statistics and timing, for :func:`profile_iterations_codec` (an executor
    observer while that iteration runs; the facade's events give the times)."""

    def __init__(self) -> None:
        # Whole-gradient statistics, unless the sends are judged: their sample then decides the profile
        # iterations too (_sampled), and nobody pays a pass over the gradients in the backward.
        self.stats: GradStats | None = GradStats(scale_only=True)
        self._judged = False  # judge_sends ran: its sampled scale is the iteration's (None: unusable)
        self._sampled: GradientScale | None = None
        self._begin: float | None = None
        self._backward_end: float | None = None
        self._end: float | None = None
        self._screen_wait = 0.0  # seconds screen_sends waited for the other ranks
        self._comm_s: float | None = None  # the predicted all-reduce the ranks agreed on (None: not timed)
        self._screened_compute_s = 0.0  # the screen's estimate of the forward and backward (max over ranks)
        self.sends: CodecDecision | None = None  # the first iteration's own sends (judge_sends), once judged
        # int8's wire bytes: the buckets' elements and whether its scatter path may run (FirstSendsJudge)
        self.wire_buckets: tuple[Sequence[int], bool] = ((2 ** 20,), True)

    def _compute_s(self) -> float | None:
        """This rank's forward and backward of the first iteration so far (to the end of its backward
        once that is known), less the screen's wait for the other ranks; None before its forward."""
        if self._begin is None:
            return None
        bwd = self._backward_end if self._backward_end is not None else time.perf_counter()
        return bwd - self._begin - self._screen_wait

    def forward_begins(self, executor: Executor, params: list[torch.Tensor],
                       optimizer: torch.optim.Optimizer | None) -> None:
        if self.stats is not None:
            self.stats.begin_iteration(executor, params, optimizer, True)
        self._begin = time.perf_counter()

    def backward_ends(self, now: float) -> None:
        if self._backward_end is None:
            self._backward_end = now

    def iteration_ends(self) -> None:
        if self._end is None:
            self._end = time.perf_counter()

    def screen_sends(self, cfg: DeftConfig, control: ControlPlane, comm_s: float | None) -> bool:
        """Collective (control group), at the first gradient of the first iteration: whether its sends
        are judged by :meth:`judge_sends` (:func:`screen_first_sends`, the same on every rank)."""
        start = time.perf_counter()
        mine = start - self._begin if self._begin is not None else 0.0
        agreed_comm, to_first = control.max_rows([[comm_s if comm_s is not None else -1.0, mine]],
                                                 "first iteration's time to its first gradient")[0]
        # Not compute: the wait for the other ranks (rank 0 starts first, its broadcast's receivers later)
        self._screen_wait = time.perf_counter() - start
        self._comm_s = agreed_comm if agreed_comm >= 0 else None
        self._screened_compute_s = COMPUTE_PER_FIRST_GRADIENT * to_first
        self.sends = screen_first_sends(cfg.profile_codec, self._comm_s, to_first)
        return self.sends is None

    def speculative_codec(self, cfg: DeftConfig, world: int) -> str:
        """After :meth:`screen_sends` judged the sends: the codec they go in meanwhile (:func:`speculative_codec`)."""
        return speculative_codec(cfg.profile_codec, self._comm_s, self._screened_compute_s, world, *self.wire_buckets)

    def sample_only(self, executor: Executor) -> None:
        """The sends are judged (:meth:`judge_sends`): its sample decides the profile iterations' codec
        too, so the whole-gradient statistics stop before the backward's first bucket (their passes over
        the gradient would slow that backward). The sample keeps its margin (module docstring), so the
        profile iterations are judged more strictly than on whole gradients."""
        if self.stats is not None:
            executor.unobserve(self.stats)
            self.stats = None

    def judge_sends(self, executor: Executor, cfg: DeftConfig, control: ControlPlane, batch: int | None,
                    speculative: str = "") -> str:
        """Collective (control group), at the end of the first backward: its sends' codec (``""``: exact),
        the same on every rank (module docstring); ``speculative``: the codec they went in meanwhile.
        After :meth:`screen_sends`, whose agreed all-reduce prediction it judges with. The local
        gradient is read from the executor's buffers, which stay exact under speculative sends."""
        compute = self._compute_s() or 0.0
        (flat,) = executor.local_gradient().values()  # considered(): one dtype
        with torch.no_grad():
            local = flat.detach()
            maxima = block_maxima(local)
            largest = maxima.amax().reshape(1).to(local.dtype) if local.numel() else local.new_zeros(1)
            peak = (maxima.double().square().sum() * INT8_BLOCK).reshape(1).to(local.dtype)
            # the sampled coordinates, this rank's largest element and its int8 block peak: one row of the
            # gather, in the gradient's own dtype (a float32 gradient's sample loses nothing; half the
            # bytes of float64)
            mine = torch.cat([local[sample_coordinates(local.numel()).to(local.device)], largest, peak]).cpu()
        rows = [torch.empty_like(mine) for _ in range(control.world)]
        control.wait(dist.all_gather(rows, mine, group=control.group, async_op=True),
                     "all-gather of the first iteration's sampled gradients")
        gathered = torch.stack(rows).double()
        (compute,) = control.max_rows([[compute]], "first iteration's forward and backward")[0]
        comm = self._comm_s
        scale = self._sampled = sampled_scale(gathered[:, :-2], flat.numel(), batch, float(gathered[:, -2].max()),
                                              block_peak=float(gathered[:, -1].max()))
        self._judged = True
        if scale is None:
            self.sends = CodecDecision("", "no usable sample of the first iteration's gradients (non-finite, "
                                      "no spread between ranks, or no batch size)", comm, compute)
        else:
            int8 = codec_error.judge("int8", scale, cfg.epsilon) if speculative == "int8" else None
            self.sends = first_sends_codec(cfg.profile_codec, codec_error.pick(scale, cfg.epsilon), comm, compute,
                                           int8, speculative)
        self.sends = replace(self.sends, speculative=speculative)
        return self.sends.codec

    def decide(self, cfg: DeftConfig, control: ControlPlane, batch: int | None) -> CodecDecision:
        """Collective (control group): the same decision on every rank (gathered statistics, times
        maximised over the ranks)."""
        compute, bwd, end = self._compute_s(), self._backward_end, self._end
        # A rank whose first iteration had no backward (a step without one) adds no time of its own.
        mine = [end - bwd, compute] if compute is not None and bwd is not None and end is not None else [0.0, 0.0]
        exposed, compute = control.max_rows([mine], "first iteration's times")[0]
        # judged: the sends' sample (the same on every rank); else the whole statistics (collective)
        scale = self._sampled if self._judged else gradient_scale(self.stats, control, batch)
        first = None if self.sends is None else self.sends.to_dict()
        if scale is None:
            return CodecDecision("", "no gradient statistics from the first iteration", exposed, compute, first=first)
        int8 = None
        if int8_fewer_bytes(control.world, *self.wire_buckets):
            int8 = codec_error.judge("int8", scale, cfg.epsilon)
        decision = profile_iterations_codec(cfg.profile_codec, codec_error.pick(scale, cfg.epsilon), exposed, compute,
                                 "" if self.sends is None else self.sends.codec, self._comm_s, int8)
        return replace(decision, first=first)


class FirstSendsJudge:
    """The first iteration's :class:`~deft.runtime.executor.SendJudge`: screened at its first gradient
    (:meth:`FirstIteration.screen_sends`), sent speculatively (:func:`speculative_codec`), judged at the
    end of its backward (:meth:`FirstIteration.judge_sends`) and sent again where the verdict differs.
    ``hooks(codec)``: the executor's hook table sending every bucket with ``codec`` (``""``: exact)."""

    def __init__(self, first: FirstIteration, cfg: DeftConfig, control: ControlPlane,
                 batch: Callable[[], int | None], broadcast: TimedBroadcast | None,
                 links_bound: Callable[[], None], hooks: Callable[[str], Sequence[CommHook | None]]) -> None:
        self.first, self.cfg, self.control, self.batch, self.broadcast = first, cfg, control, batch, broadcast
        self.links_bound = links_bound  # called where the screen judges the sends (the links may be the bound)
        self.hooks = hooks
        self.speculative = SPECULATIVE_CODEC  # the codec the judged sends went in (the same on every rank)

    def _comm_s(self, executor: Executor) -> float | None:
        """The construction's broadcast scaled to this layout's all-reduce over the schedule's links."""
        if self.broadcast is None or executor.layout is None:
            return None
        links = len(executor.schedule.links) if executor.schedule is not None else 1
        return self.broadcast.allreduce_s(sum(executor.layout.bucket_nbytes()), self.control.world, links)

    def at_first_gradient(self, executor: Executor) -> bool:
        if executor.layout is not None:
            self.first.wire_buckets = (executor.layout.bucket_numel,
                                       int8.scatter_supported(self.control.group, executor.device))
        judged = self.first.screen_sends(self.cfg, self.control, self._comm_s(executor))
        if judged:
            self.first.sample_only(executor)
            self.speculative = self.first.speculative_codec(self.cfg, self.control.world)
            # each hook on a copy of its bucket: the buffers stay exact until the verdict
            executor.use_hooks(self.hooks(self.speculative), copies=True)
            self.links_bound()
        else:
            self._log()
        return judged

    def at_backward_end(self, executor: Executor) -> None:
        codec = self.first.judge_sends(executor, self.cfg, self.control, self.batch(), self.speculative)
        if codec != self.speculative:
            executor.send_again(self.hooks(codec))
        self._log()

    def _log(self) -> None:
        sends = self.first.sends
        if self.control.rank == 0 and sends is not None:
            again = "" if sends.speculative in ("", sends.codec) else f", sent again after going in {sends.speculative}"
            log.info("deft: first iteration sent %s%s (%s)", f"in {sends.codec}" if sends.codec else "exact", again,
                     sends.reason)
