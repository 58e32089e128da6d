"""The preserver's live statistics: gradient noise from the buffers deft all-reduces anyway, and the
:class:`~deft.preserver.feedback.WalkStats` the preserver needs (loss, mu, sigma, learning rate, batch,
and for the stability check the top curvature and the optimizer's update rule).

Curvature (:func:`stability_inputs`): a Lanczos probe when the user ran ``ddp.calibrate(closure)``,
else the free secant estimate :class:`deft.preserver.curvature.SecantCurvature` (its median with the
mini-batch noise ``2 tr(Σ) / B`` removed, ``debiased``) over the lag-free
single-iteration updates this rank applies while statistics run (every warm-up and profile iteration):
the averaged gradient and the parameters it was computed at, both identical on every rank, so no
collective. It is biased low on the digits CNN (benchmarks/results/stability.md), a screen, not
a measurement. The optimizer's rule is :meth:`deft.preserver.stability.OptimizerSpec.from_torch` (param
groups that differ in ``lr`` or ``weight_decay``: the hardest combination); for Adam/AdamW the step
scale is the median of ``1 / (sqrt(v_hat) + eps)`` (:func:`adam_scale`). Without a curvature or a rule
the stats say why (``WalkStats.unchecked``) and the preserver refuses stale schedules.

The learning rate the walk and the check judge is :func:`deft.preserver.stability.planning_lr`: the
largest over the groups of the ``lr`` now and what torch's LR schedulers record as its base or peak
(``initial_lr``, ``max_lr``), so that statistics taken during a warm-up judge the rate the plan will
run at. The runtime re-checks when the ``lr`` outgrows it anyway (:mod:`deft.runtime.course`).

The walk's metric (:func:`deft.preserver.noise.walk_geometry`): for Adam/AdamW, ``mu`` and ``sigma``
are measured on the gradients scaled elementwise by ``sqrt(P)``, ``P = 1 / (sqrt(v_hat) + eps)`` from
the optimizer's state before the step being measured (:meth:`GradStats.refresh`, once per applied
update), so that ``mu = gᵀ P g`` and ``sigma² = gᵀ P Σ P g`` (deft.preserver.gaussian_walk, "The walk
in the optimizer's geometry"); the raw ``tr Σ`` the secant's noise correction needs is estimated
beside them (one more all-gather of four scalars per update, Adam only). Before Adam's first step the
metric is Euclidean; the estimates restart when it becomes Adam's, so they never mix metrics.

Runs before planning (warm-up and profile iterations) and, after it, in a window of iterations before
each preserver re-check. Every collective here is on the control group and matched on every rank:
all ranks apply the same updates, so they call :meth:`GradStats.update` at the same points.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from deft._json import JsonDict
from deft.config import DeftConfig
from deft.errors import ContractError, DeftError
from deft.preserver.codec_error import GradientScale
from deft.preserver.curvature import RAW_SCREEN, SecantCurvature, adam_preconditioner, adam_scale, top_eigenvalue
from deft.preserver.feedback import WalkStats
from deft.preserver.float64 import dot64
from deft.preserver.noise import (
    DirectionPair,
    LocalStats,
    NoiseEstimate,
    NoiseEstimator,
    WalkGeometry,
    all_gather_stats,
    local_stats,
    walk_geometry,
)
from deft.preserver.stability import OptimizerSpec
from deft.runtime.buckets import FlatLayout
from deft.runtime.codecs.int8 import BLOCK as INT8_BLOCK
from deft.runtime.codecs.int8 import block_maxima
from deft.runtime.control import Collective, ControlPlane
from deft.runtime.executor import DueUpdate, Executor

log = logging.getLogger("deft.runtime")


@dataclasses.dataclass
class _GroupSums:
    """One update group's local sums over its buckets (:meth:`GradStats.bucket`): ``|g_r|²``, the
    projections on the two directions (while every bucket had them), and the plain ``|g_r|²`` when the
    walk's metric is Adam's."""

    batch: int
    sq_norm: float = 0.0
    proj_a: float = 0.0
    proj_b: float = 0.0
    has_dirs: bool = True
    raw_sq_norm: float = 0.0
    block_peak: torch.Tensor | float = 0.0  # sum_k n_k max_{i in k} g_i² of the local gradient (int8's P)

    def local(self) -> LocalStats:
        return LocalStats(sq_norm=self.sq_norm, proj_a=self.proj_a if self.has_dirs else None,
                          proj_b=self.proj_b if self.has_dirs else None, batch=self.batch)


def _finite(rows: list[LocalStats], *values: float) -> bool:
    """Every gathered scalar and every value finite? (fp16 overflow puts inf/NaN in gradients: such a
    step says nothing about the noise, and every rank sees the same gathered rows, so all skip it.)"""
    xs = [*values, *(x for r in rows for x in (r.sq_norm, r.proj_a, r.proj_b) if x is not None)]
    return all(math.isfinite(x) for x in xs)


class GradStats:
    """The preserver's gradient-noise statistics, from the buffers deft all-reduces anyway.

    Glue around :mod:`deft.preserver.noise`. When bucket ``b`` of an update group is complete (the
    bucket is ready in the group's last iteration), this rank's ``|g_r|²`` and projections on the two
    directions are accumulated for that group (``local_stats`` per bucket, summed: the quantities are
    sums over elements). The buffer holds the *sum* of the group's ``k`` local gradients, so the
    local mean gradient over ``k x batch`` samples is ``buffer / k``: ``|g_r|²`` is scaled by ``1/k²``
    and the projections by ``1/k``. When the group's update is applied, the ranks all-gather those
    scalars (control group; every rank applies the same updates, so the collective is matched), the
    estimator gets ``|ḡ|²`` of the averaged gradient, and the directions absorb it. Pieces are the
    layout's bucket segments, in bucket order; a new layout restarts the directions.

    Cost per update: one pass of dot products over the gradient and one all-gather of four scalars
    per rank; after planning it runs only in the window of iterations before each re-check.
    """

    def __init__(self, scale_only: bool = False) -> None:
        # scale_only: only |g|², tr Σ and the largest element (a codec's judgement): no directions (sigma)
        # and no secant, which copy the gradient and the parameters at every update
        self.scale_only = scale_only
        self.noise = NoiseEstimator()  # in the walk's metric (self.geometry.metric)
        self.raw = NoiseEstimator()    # Euclidean, while the walk's metric is not: the raw tr Σ
        self.directions = DirectionPair()
        self.secant = SecantCurvature()
        self.geometry = WalkGeometry("euclidean", None)
        self._layout: FlatLayout | None = None
        self._scale: dict[torch.dtype, torch.Tensor] | None = None  # sqrt(P) per dtype, layout order
        self._fresh = False  # the metric was read from the optimizer since the last applied update
        self._first_piece: dict[int, int] = {}  # bucket -> index of its first piece in u_a, u_b
        self._acc: dict[int, _GroupSums] = {}  # group key -> its local sums so far
        # The iteration being measured (begin_iteration): what the executor's events are read against.
        self._executor: Executor | None = None
        self._params: list[torch.Tensor] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._wanted = False
        self.batch: int | None = None  # the per-rank batch (the forward's first tensor argument)
        self._max_abs: torch.Tensor | None = None  # largest finite |local gradient| element seen (bucket())
        self._peak_sum = 0.0  # the block peaks of the updates measured (update()), for block_peak()
        self._peak_n = 0

    @classmethod
    def start(cls, cfg: DeftConfig, world: int) -> GradStats | None:
        """Statistics are needed only when the preserver may delay or merge, over two ranks or more."""
        if cfg.epsilon == 0 or not cfg.preserver or world < 2:
            return None
        return cls()

    # -- the runtime's events ------------------------------------------------------------------------
    def begin_iteration(self, executor: Executor, params: list[torch.Tensor],
                        optimizer: torch.optim.Optimizer | None, wanted: bool) -> None:
        """An iteration begins; ``wanted``: its gradients feed the statistics (the run's calendar)."""
        self._executor, self._params, self._optimizer, self._wanted = executor, params, optimizer, wanted

    def bucket_ready(self, b: int) -> None:
        """ExecutorObserver: bucket ``b`` of the current group is complete; measured when the group's
        ``k`` iterations have all contributed (the group's last iteration)."""
        ex = self._executor
        if not self._wanted or ex is None:
            return
        g = ex.current_group()
        if g is not None and ex.layout is not None:
            self.refresh(ex.layout, self._params, self._optimizer)
            k = len(g.iterations)
            self.bucket(g.last, b, ex.layout.bucket_views(g.buffers, b), (self.batch or 1) * k, k)

    def hook_started(self, b: int, t: float) -> None:
        pass

    def launched(self, b: int, link: str, works: list[Collective], t_start: float) -> None:
        pass

    def on_due(self, lasts: list[int], updates: list[DueUpdate], t: int, control: dist.ProcessGroup,
               device: torch.device) -> bool:
        """Collective: the updates due at iteration ``t``'s step (group keys ``lasts``) are about to be
        applied: the whole ones complete their group's estimate; one finishing in the next forward has
        no whole gradient at this step and is dropped. Returns False when a non-finite gradient made
        the statistics skip this step (GradScaler's overflow steps: normal input, not an error)."""
        ex = self._executor
        if ex is None:
            return True
        assert ex.layout is not None
        kept = True
        for last, upd in zip(lasts, updates, strict=True):
            if ex.is_pending(last):
                self.drop(last)
                continue
            if not self.update(last, ex.layout, upd.grads, control, device):
                kept = False
                continue
            # lag-free, one iteration: computed at the parameters now (only while statistics are
            # gathered: each observation copies the parameters and the gradient)
            if upd.iterations == (t,) and self._wanted and not self.scale_only:
                self.observe_point(self._params, upd.grads)
        return kept

    def on_layout(self) -> None:
        """A new flat layout: the directions' pieces no longer match; start them over."""
        self.directions = DirectionPair()
        self._first_piece = {}
        self._acc.clear()
        self._fresh = False

    def refresh(self, layout: FlatLayout, params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> None:
        """Before a group's buckets are measured: the walk's metric from the optimizer's state now (read
        once per applied update). A change of metric (Adam's first step) restarts the estimates."""
        if self._fresh and self._layout is layout:
            return
        self._fresh, self._layout = True, layout
        geo = walk_geometry(optimizer, params)
        if geo.metric != self.geometry.metric:
            self.noise, self.raw = NoiseEstimator(), NoiseEstimator()
            self.on_layout()
            self._fresh = True
        self.geometry = geo
        self._scale = None
        if geo.roots is not None:
            scale = {d: torch.zeros(n, dtype=torch.float32, device=geo.roots[0].device)
                     for d, n in layout.dtype_numel.items()}
            for i, r in enumerate(geo.roots):
                slot = layout.slots[i]
                scale[slot.dtype][slot.dtype_offset:slot.dtype_offset + slot.numel] = r.reshape(-1)
            self._scale = scale

    def _dirs_of(self, first: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        pair = self.directions.get()
        if pair is None:
            return None
        a, b = pair
        if first + n > len(a):
            return None
        return a[first:first + n], b[first:first + n]

    def bucket(self, key: int, b: int, views: list[torch.Tensor], batch: int, k: int) -> None:
        acc = self._acc.setdefault(key, _GroupSums(batch))
        for v in views:  # the largest finite local gradient element (a codec's range), no device sync here
            if v.numel():
                maxima = torch.nan_to_num(block_maxima(v.detach()) / k, nan=0.0, posinf=0.0)
                m = maxima.amax()
                self._max_abs = m if self._max_abs is None else torch.maximum(self._max_abs, m.to(self._max_abs))
                acc.block_peak = acc.block_peak + maxima.square().sum() * INT8_BLOCK
        if self._scale is not None and self._layout is not None:
            acc.raw_sq_norm += local_stats(views, None, batch).sq_norm / (k * k)
            views = [v.float() * r for v, r in zip(views, self._layout.bucket_views(self._scale, b), strict=True)]
        dirs = self._dirs_of(self._first_piece.get(b, 0), len(views))
        st = local_stats(views, dirs, batch)
        acc.sq_norm += st.sq_norm / (k * k)
        if dirs is None or st.proj_a is None or st.proj_b is None:
            acc.has_dirs = False
        else:
            acc.proj_a += st.proj_a / k
            acc.proj_b += st.proj_b / k

    def drop(self, key: int) -> None:
        """Forget one group (its update is applied in parts; no whole gradient to measure)."""
        self._fresh = False
        self._acc.pop(key, None)

    def discard(self) -> None:
        """Forget every accumulated group (their updates are applied without an estimate)."""
        self._fresh = False
        self._acc.clear()

    def observe_point(self, params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """A lag-free single-iteration update: ``grads`` (the averaged gradient) was computed at ``params``
        (the parameters now, before the step); feeds the secant curvature. Local, no collective."""
        pairs = [(i, params[i], g) for i, g in enumerate(grads) if g is not None]
        if pairs:
            self.secant.observe([p for _, p, _ in pairs], [g for _, _, g in pairs], key=tuple(i for i, _, _ in pairs))

    def update(self, key: int, layout: FlatLayout, grads: list[torch.Tensor | None], control: dist.ProcessGroup,
               device: torch.device) -> bool:
        """Collective (control group): group ``key``'s update is applied next; its statistics go into the
        estimators. Returns False when they were skipped as non-finite (on every rank alike)."""
        self._fresh = False  # an update is applied next: the optimizer's state (Adam's v) moves on
        acc = self._acc.pop(key, None)
        if acc is None:  # the same on every rank: bucket() ran for the same groups everywhere
            return True
        mean = {d: torch.zeros(n, dtype=torch.float32, device=device) for d, n in layout.dtype_numel.items()}
        for i, gr in enumerate(grads):
            if gr is not None:
                s = layout.slots[i]
                mean[s.dtype][s.dtype_offset:s.dtype_offset + s.numel] = gr.reshape(-1).float()
        finite = True
        if self._scale is not None:
            raw_mean_sq = sum(float(dot64(v)) for v in mean.values())
            raw_rows = all_gather_stats(LocalStats(sq_norm=acc.raw_sq_norm, proj_a=None, proj_b=None,
                                                   batch=acc.batch), control)
            finite = _finite(raw_rows, raw_mean_sq)
            if finite:
                self.raw.update(raw_rows, raw_mean_sq)
            for d, v in mean.items():
                v.mul_(self._scale[d].to(v.device))
        pieces: list[torch.Tensor] = []
        self._first_piece = {}
        for b in range(layout.n_buckets):
            self._first_piece[b] = len(pieces)
            pieces += [mean[s.dtype][s.start:s.end] for s in layout.segments[b] if s.end > s.start]
        mean_sq = sum(float(dot64(v)) for v in mean.values())
        dot = self.directions.dot() if acc.has_dirs else None
        rows = all_gather_stats(acc.local(), control)  # every rank gathers, whatever it found locally
        if not (finite and _finite(rows, mean_sq)):
            self.directions = DirectionPair()  # a direction with inf in it says nothing either
            self._first_piece = {}
            return False
        self.noise.update(rows, mean_sq, dot)
        self._peak_sum += float(acc.block_peak)
        self._peak_n += 1
        if not self.scale_only:
            self.directions.observe(pieces)
        return True

    def estimate(self) -> NoiseEstimate | None:
        return self.noise.estimate

    def max_abs(self) -> float:
        """The largest finite element of any local gradient this rank measured (0 before any)."""
        return 0.0 if self._max_abs is None else float(self._max_abs)

    def block_peak(self) -> float | None:
        """This rank's ``sum_k n_k max_{i in k} g_i²`` over blocks of the int8 codec's size on the layout's
        buckets (:mod:`deft.runtime.int8_hook`), the mean over the updates measured (None before any)."""
        return self._peak_sum / self._peak_n if self._peak_n else None

    def raw_trace(self) -> float | None:
        """``tr Σ`` of the plain gradients (the secant's noise correction), ``None`` while unknown."""
        est = self.raw.estimate if self.geometry.metric != "euclidean" else self.noise.estimate
        return None if est is None else est.trace


def stability_inputs(optimizer: torch.optim.Optimizer | None, secant: float | None, calibrated: float | None,
                     preconditioned: bool = False) -> tuple[float | None, OptimizerSpec | None, str]:
    """(curvature, optimizer rule, how) for :class:`WalkStats`; ``(None, None, why)`` when unknown.

    The calibrated (Lanczos) value wins over the secant one. ``preconditioned``: the calibrated value
    is Adam's preconditioned curvature (``D^1/2 H D^1/2``), so the spec's scale is 1; otherwise
    Adam's scale is the median of ``1 / (sqrt(v_hat) + eps)``. ``how`` is ``"lanczos (calibrate)"``,
    ``"secant"`` or the reason there is none (unsupported optimizer, no estimate yet).
    """
    if calibrated is not None:
        lam, how = calibrated, "lanczos (calibrate)"
    elif secant is not None:
        lam, how = secant, "secant"
    else:
        return None, None, "no curvature estimate yet (no parameter move observed; ddp.calibrate not called)"
    if optimizer is None:
        return None, None, "optimizer unknown"
    try:
        scale = 1.0
        adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        if adam and not (calibrated is not None and preconditioned):
            scale = adam_scale(optimizer, "median")
        spec = OptimizerSpec.from_torch(optimizer, scale=scale)
    except ContractError as e:
        return None, None, f"stability not checked: {e}"
    return float(lam), spec, how


def walk_stats(config: DeftConfig, control: ControlPlane, losses: collections.deque[float],
               stats: GradStats | None, optimizer: torch.optim.Optimizer | None,
               batch: int | None, calibrated: JsonDict | None = None) -> tuple[WalkStats | None, str]:
    """WalkStats for the preserver from the live statistics (collective on the control group), or None and why.

    ``loss``: the mean over ranks of the last observed loss; ``lr`` and ``metric``:
    :func:`deft.preserver.noise.walk_geometry` (for SGD with momentum the effective step
    ``lr / (1 - momentum)``; for Adam the raw ``lr`` in its preconditioned metric);
    ``batch``: ranks x the first dimension of the forward's first tensor argument;
    ``curvature``/``optimizer``: :func:`stability_inputs` (``calibrated``: ``ddp.calibrate``'s record).
    The reason string says how the curvature was obtained (or why there is none).
    """
    if config.epsilon == 0 or not config.preserver:
        return None, "not needed"
    loss = control.mean(losses[-1] if losses else float("nan"), "observed loss")
    estimate = stats.estimate() if stats is not None else None
    if loss != loss:
        return None, "no loss observed (call ddp.observe_loss(loss) every iteration)"
    if estimate is None or estimate.sigma is None:
        return None, f"gradient noise not estimated yet ({estimate})"
    if optimizer is None or batch is None:
        return None, ("batch size unknown" if optimizer is not None else
                      "optimizer unknown (none has stepped yet, or several step: the walk models one)")
    # Heavy-ball SGD moves lr / (1 - momentum) per unit gradient in steady state: that is the step the
    # walk must see, or a stale or merged update looks 1/(1 - momentum) times cheaper; Adam's walk runs
    # in its preconditioned metric with its lr (deft.preserver.noise.walk_geometry).
    geo = walk_geometry(optimizer, with_roots=False)
    if geo.lr is None:
        return None, geo.why
    measured = stats.geometry.metric if stats is not None else "euclidean"
    if geo.metric != measured:
        return None, (f"gradient noise measured in the {measured} metric, the optimizer's is {geo.metric} "
                      "(not re-measured yet)")
    walk = WalkStats.from_estimate(max(loss, config.s_star), estimate, geo.lr, batch * control.world, config.s_star,
                                   metric=geo.metric)
    # Secant with the two batches' gradient noise removed: E|e - e'|² = 2 tr(Σ) / B_global (raw tr Σ).
    trace = None if stats is None else stats.raw_trace()
    secant, raw = (None, False) if stats is None or trace is None else \
        stats.secant.screen(2.0 * trace / (batch * control.world))
    lam, spec, how = stability_inputs(optimizer, secant,
                                      None if calibrated is None else _number(calibrated, "value"),
                                      bool(calibrated and calibrated.get("preconditioned")))
    if how == "secant" and raw:
        how = f"secant ({RAW_SCREEN})"
    if walk is not None and lam is not None:
        walk = dataclasses.replace(walk, curvature=lam, optimizer=spec)
    elif walk is not None:  # the preserver then refuses stale schedules and says why
        walk = dataclasses.replace(walk, unchecked=how)
    return walk, f"estimated during warm-up; curvature: {how}" + ("" if lam is None else f" {lam:.4g}")


def gradient_scale(stats: GradStats | None, control: ControlPlane, batch: int | None) -> GradientScale | None:
    """Collective (control group): what a codec's rounding is judged against
    (:class:`deft.preserver.codec_error.GradientScale`): ``|g|²`` and ``tr Σ`` of the walk's estimate,
    the per-rank batch, the largest local gradient element over all ranks, and for int8 the largest
    rank's block peak with the Euclidean ``tr Σ`` (every rank's raw estimate is the same: gathered
    rows). None while unknown
    (the same on every rank: the estimate is built from gathered rows)."""
    estimate = None if stats is None else stats.estimate()
    mine = 0.0 if stats is None else stats.max_abs()
    peak = None if stats is None else stats.block_peak()
    largest, most_peak = control.max_rows([[mine, -1.0 if peak is None else peak]],
                                          "largest gradient element and block peak")[0]
    if estimate is None or batch is None or control.world < 2:
        return None
    raw = stats.raw_trace() if stats is not None else None
    return GradientScale(world=control.world, batch=batch, mu=estimate.mu, trace=estimate.trace, max_abs=largest,
                         block_peak=most_peak if most_peak >= 0.0 and raw is not None else None, raw_trace=raw)


# -- the curvature probe (ddp.calibrate) ---------------------------------------------------------------
def check_probe_args(closure: object, tol: float, ncv: int | None, maxiter: int) -> None:
    """``ddp.calibrate``'s arguments, checked on every rank before any collective."""
    if not callable(closure):
        raise DeftError(f"calibrate(closure): expected a callable returning the loss, got {type(closure).__name__}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1:
        raise DeftError(f"calibrate(tol=...): expected a relative tolerance in (0, 1), got {tol!r}")
    if ncv is not None and (isinstance(ncv, bool) or not isinstance(ncv, int) or ncv < 3):
        raise DeftError(f"calibrate(ncv=...): expected None or an integer >= 3 (Lanczos vectors), got {ncv!r}")
    if isinstance(maxiter, bool) or not isinstance(maxiter, int) or maxiter < 1:
        raise DeftError(f"calibrate(maxiter=...): expected an integer >= 1, got {maxiter!r}")


def probe_curvature(closure: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer | None,
                    params: list[torch.Tensor], tol: float, ncv: int | None, maxiter: int) -> JsonDict:
    """Rank 0: the top Hessian eigenvalue by Lanczos on Hessian-vector products of ``closure()``'s loss
    (:func:`deft.preserver.curvature.top_eigenvalue`), as the record every rank receives. For Adam/AdamW
    with state, the curvature of Adam's preconditioned step (exact for linearised Adam). A failure is
    returned as ``{"error": ...}``: the secant estimate stays in use."""
    try:
        pre = None
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and optimizer.state:
            pre = adam_preconditioner(optimizer, params)
        est = top_eigenvalue(closure, params, tol=tol, ncv=ncv, maxiter=maxiter, preconditioner=pre)
        return {**est.to_dict(), "preconditioned": pre is not None}
    except Exception as e:  # told to the other ranks; the secant estimate stays in use
        log.exception("deft: calibrate() failed on rank 0")
        return {"error": f"{type(e).__name__}: {e}"}


def _number(doc: JsonDict, key: str) -> float:
    value = doc.get(key)
    if not isinstance(value, (int, float)):
        raise DeftError(f"internal: {key!r} of the curvature probe's record is not a number: {value!r}")
    return float(value)
