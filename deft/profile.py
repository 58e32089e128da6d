"""The profile: what the profiler measured and the solver plans from (DESIGN.md section 3).

Invariants
----------
* ``buckets[i].id == i`` and ``times[i]`` belongs to ``buckets[i]``.
* Bucket ``0`` is the first to become ready in backward (nearest the output); in forward the order
  is reversed: bucket ``n-1`` (nearest the input) is computed first.
* Every link named in a ``BucketTimes.comm_s`` is one of ``links``; a bucket with no measured time on
  a link falls back to that link's fitted model ``alpha + beta * wire_nbytes``.
* **Compression** (``Profile.codec``, e.g. ``"fp16"``, ``"powersgd (rank 4)"``; ``""``: none): a comm hook
  encodes each bucket before its collectives and decodes after. ``Bucket.wire_nbytes`` is what the
  codec puts on the wire for the bucket (``None``: the bucket's ``nbytes``, no codec); ``comm_s`` and the
  links' alpha-beta are wire times (fitted over wire bytes); ``BucketTimes.codec_s`` is the codec's
  encode + decode compute for one send of the bucket, which competes with the model's compute (the
  simulator runs it on the compute stream before the send). ``wire_nbytes``/``codec_s`` only with a
  ``codec``.

The JSON form carries ``schema`` and ``kind == "deft.profile"``; :meth:`Profile.load` rejects anything
else with an error naming the file and the field. Schema 1: no compression; schema 2
(:data:`SCHEMA_VERSION`) adds ``codec`` and per-bucket ``wire_nbytes``/``codec_s``. A profile without a
codec is written as schema 1 (so its digest and older readers are unchanged); one with a codec as
schema 2, which an older deft refuses instead of planning on uncompressed sizes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from deft._json import Fields, JsonDict, JsonValue, read_json, write_json
from deft.errors import ContractError

log = logging.getLogger("deft.profile")

SCHEMA_VERSION = 2
SCHEMAS = (1, 2)  # schema 1: no compression fields
#: Codec names (``Profile.codec``) of torch's fp16/bf16 hooks and deft's int8 hook: ``deft.runtime.codecs.hooks``
#: names them so.
ELEMENTWISE_CODECS = ("fp16", "bf16", "int8")
SOURCES = ("timing", "kineto", "nsys", "reference", "synthetic")
BACKENDS = ("nccl", "gloo")


def _nonneg(x: float) -> bool:
    """A time or cost: finite and >= 0 (NaN compares false with everything, so test it explicitly)."""
    return math.isfinite(x) and x >= 0


def _validate_link(source: str, i: int, link: Link) -> None:
    """``links[i]`` of a profile read from ``source``: a known backend, finite non-negative figures."""
    if link.backend not in BACKENDS:
        raise ContractError(source, f"links[{i}].backend", f"expected nccl or gloo, got {link.backend!r}")
    if not _nonneg(link.alpha_s) or not _nonneg(link.beta_s_per_byte):
        raise ContractError(source, f"links[{i}]", "alpha_s and beta_s_per_byte must be finite and >= 0, "
                            f"got {link.alpha_s} and {link.beta_s_per_byte}")
    for name, value, unit in (("contention", link.contention, ""), ("drag", link.drag, ""),
                              ("lag_s", link.lag_s, " (seconds per send)")):
        if not _nonneg(value):
            raise ContractError(source, f"links[{i}].{name}", f"expected a finite number >= 0{unit}, got {value}")
    if isinstance(link.sends_at_once, bool) or not isinstance(link.sends_at_once, int) or link.sends_at_once < 0:
        raise ContractError(source, f"links[{i}].sends_at_once", "expected an integer >= 0 (0: the backend's "
                            f"default), got {link.sends_at_once!r}")
    if i == 0 and link.guarded:
        raise ContractError(source, "links[0].guarded", "expected false: the first link is the primary, which "
                            "carries the ranks' verdicts on the guarded links")


@dataclass(frozen=True)
class Bucket:
    """A group of parameters whose gradients are communicated together."""

    id: int
    params: tuple[str, ...]
    numel: int
    nbytes: int
    wire_nbytes: int | None = None  # bytes the codec sends for it (None: nbytes, no compression)

    @property
    def wire(self) -> int:
        """Bytes on the wire per send: ``wire_nbytes`` under a codec, else ``nbytes``."""
        return self.nbytes if self.wire_nbytes is None else self.wire_nbytes


@dataclass(frozen=True)
class BucketTimes:
    """Seconds spent on one bucket: its forward and backward compute, and its all-reduce per link."""

    forward_s: float
    backward_s: float
    comm_s: dict[str, float] = field(default_factory=dict)
    codec_s: float = 0.0  # the codec's encode + decode compute per send (0: none)


@dataclass(frozen=True)
class Link:
    """A communication link: one process group, optionally bound to its own NIC.

    ``T(nbytes) = alpha_s + beta_s_per_byte * nbytes`` is the fitted all-reduce time at the
    profile's world size. ``contention``: what the link's transfers take from the compute that shares
    the processor with them; while links ``l`` carry a rank's collectives its compute runs at
    ``1 / (1 + sum_l contention_l)`` of its speed (0: none, as for NCCL's copies engines; gloo's
    reductions and socket copies run on the CPU cores the model computes on). ``drag``: the mirror, what
    the compute takes from the link's transfers where they share the processor; while the rank's
    compute stream is busy the link's sends run at ``1 / (1 + drag)`` of their speed, and the link's
    model and measured times are its sends' with the cores free (0: none, as on NCCL). ``lag_s``: the
    seconds after its launch that a send of the link waits for the last rank to reach it, where the
    launch is the rank's whose compute the profile prices (the ranks' pace, :mod:`deft.profiler.pace`):
    a send starts no earlier than ``lag_s`` after it is handed to the link (0: none, as for one rank or
    ranks in step). The link's measured times are the last rank's, who waits for nobody. ``guarded``:
    its sends' results are used only after the ranks' verdict on them, a message over the primary link
    (the runtime's link-failover guard, :mod:`deft.runtime.verdicts`; False: used as they arrive).
    ``sends_at_once``: how many of its collectives the link's group runs at once, in launch order (0: its
    backend's default, :meth:`at_once`): the ones a message on another group over the same NIC (the
    verdicts on the primary's) finds on the wire.
    """

    name: str
    backend: str
    ifname: str | None = None
    alpha_s: float = 0.0
    beta_s_per_byte: float = 0.0
    contention: float = 0.0
    drag: float = 0.0
    lag_s: float = 0.0
    guarded: bool = False
    sends_at_once: int = 0

    def time(self, nbytes: int) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes

    def at_once(self) -> int:
        """``sends_at_once``, or the backend's: gloo two (torch's two worker threads per group), NCCL one
        (one stream per group)."""
        return self.sends_at_once or (2 if self.backend == "gloo" else 1)


@dataclass(frozen=True)
class AlphaBetaFit:
    """``T(nbytes) = alpha + beta * nbytes`` fitted to measured all-reduce times, and how well it fits."""

    alpha: float
    beta: float
    r2: float          # share of the times' variance the line explains
    rmse: float        # root-mean-square error, seconds
    rel_rmse: float    # root-mean-square relative error
    free_alpha: float  # the unconstrained weighted least-squares line (nan: one size only)
    free_beta: float

    @property
    def constrained(self) -> bool:
        """The free line had ``alpha < 0`` or ``beta < 0``: the non-negativity rule decided."""
        return self.free_alpha < 0 or self.free_beta < 0


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float],
                   weights: Sequence[float] | None = None, source: str = "<samples>") -> AlphaBetaFit:
    """The alpha-beta fit of deft's (size, time) samples: weighted least squares with ``alpha >= 0`` and
    ``beta >= 0``. (The warm-up timer models groups of several collectives, ``count * alpha + bytes * beta``,
    with ``alpha`` measured by one-element all-reduces and ``beta`` fitted with it fixed:
    :func:`deft.runtime.warmup_timer.fit_group_beta`.)

    Minimizes ``sum_i w_i (alpha + beta b_i - T_i)^2`` over ``alpha, beta >= 0``
    (``scipy.optimize.nnls`` on the rows scaled by ``sqrt(w_i)``). The non-negativity rule: a negative
    intercept or slope is measurement noise (time cannot fall with size, nor be below zero at size 0),
    so the constrained optimum is taken; it lies on the boundary (a line through the origin, or a flat
    line at the weighted mean) when the free line leaves the feasible set.

    With a single distinct size ``b0`` every non-negative line through the weighted mean ``T0`` there
    fits equally well; the rule then is the line through the origin, ``alpha = 0, beta = T0 / b0`` (all
    of the time is transfer, so a piece of the bucket costs its share; the convention of the fits this
    one replaces), or the flat line ``alpha = T0`` when ``b0 = 0``. ``free_alpha``/``free_beta`` are nan.

    Raises :class:`ContractError` naming ``source`` and the first bad entry (``nbytes[i]``,
    ``seconds[i]``, ``weights[i]``) or the mismatched lengths.
    """
    # Imported here: the contract module stays light to import (numpy and scipy are slow to import).
    import numpy as np
    from scipy.optimize import nnls

    b = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if b.shape != t.shape or b.ndim != 1 or len(b) == 0:
        raise ContractError(source, "samples", f"expected equally many sizes and times (at least one), got "
                            f"{len(b)} and {len(t)}")
    w = np.ones_like(t) if weights is None else np.asarray(weights, dtype=float)
    if w.shape != t.shape:
        raise ContractError(source, "weights", f"expected one weight per sample ({len(t)}), got {len(w)}")
    for name, values, ok in (("nbytes", b, np.isfinite(b) & (b >= 0)), ("seconds", t, np.isfinite(t) & (t >= 0)),
                             ("weights", w, np.isfinite(w) & (w > 0))):
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            expected = "a finite weight > 0" if name == "weights" else "a finite number >= 0"
            raise ContractError(source, f"{name}[{i}]", f"expected {expected}, got {values[i]}")
    if len(set(b.tolist())) < 2:
        b0, t0 = float(b[0]), float(np.sum(w * t) / np.sum(w))
        alpha, beta = (0.0, t0 / b0) if b0 > 0 else (t0, 0.0)
        free = np.array([math.nan, math.nan])
        scale = 1.0
    else:
        sw = np.sqrt(w)
        scale = float(b.max())  # columns of similar magnitude: nnls is then well conditioned
        design = np.column_stack([np.ones_like(b), b / scale]) * sw[:, None]
        (alpha, beta_scaled), _ = nnls(design, t * sw)
        beta = float(beta_scaled) / scale
        free = np.linalg.lstsq(design, t * sw, rcond=None)[0]
    pred = alpha + beta * b
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    exact = ss_res <= 1e-18 * float(np.sum(t**2))  # zero up to rounding in the solver
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if exact else 0.0)
    rel = (t - pred) / np.where(t > 0, t, 1.0)
    return AlphaBetaFit(alpha=float(alpha), beta=beta, r2=r2, rmse=float(np.sqrt(ss_res / len(t))),
                        rel_rmse=float(np.sqrt(np.mean(rel ** 2))), free_alpha=float(free[0]),
                        free_beta=float(free[1]) / scale)


@dataclass(frozen=True)
class Profile:
    """Per-bucket forward, backward and communication times of one model on one cluster.

    ``step_s``: the seconds per iteration the rank computes outside the forward and the backward, the
    optimizer's step and the training loop's own work after the backward (clipping, the learning-rate
    schedule, the next batch): charged to the compute stream at each iteration's step (0: not measured,
    as from a trace)."""

    buckets: tuple[Bucket, ...]
    times: tuple[BucketTimes, ...]
    links: tuple[Link, ...]
    world_size: int
    source: str
    versions: dict[str, str] = field(default_factory=dict)
    model: str = ""
    meta: JsonDict = field(default_factory=dict)
    codec: str = ""  # the comm hook compressing every send ("": none)
    step_s: float = 0.0

    def __post_init__(self) -> None:
        self.validate("<profile>")

    # -- derived views -------------------------------------------------------------------------
    # Cached: the fields are immutable after construction, and the simulator reads these per event.
    @cached_property
    def n(self) -> int:
        return len(self.buckets)

    @cached_property
    def link_names(self) -> tuple[str, ...]:
        return tuple(link.name for link in self.links)

    def link(self, name: str) -> Link:
        for link in self.links:
            if link.name == name:
                return link
        raise KeyError(f"profile has no link {name!r}; links are {', '.join(self.link_names)}")

    def comm_time(self, bucket: int, link: str) -> float:
        """Measured all-reduce time of ``bucket`` on ``link``, else the link's fitted model."""
        measured = self.times[bucket].comm_s.get(link)
        if measured is not None:
            return measured
        return self.link(link).time(self.buckets[bucket].wire)

    def codec_time(self, bucket: int) -> float:
        """The codec's compute for one send of ``bucket`` (0 without compression)."""
        return self.times[bucket].codec_s

    @property
    def compressed(self) -> bool:
        return bool(self.codec)

    @property
    def elementwise_codec(self) -> bool:
        """A codec that treats every element alike and keeps no state between buckets (``fp16``, ``bf16``;
        ``int8``, whose blocks start at each bucket's start and whose generator is drawn in the call):
        its buckets may be split anywhere and its sends overlap across links. Any other codec
        (PowerSGD, an unknown hook) is sent one bucket at a time and its tensors are kept whole."""
        return self.codec in ELEMENTWISE_CODECS

    def scaled(self, compute: float = 1.0, comm: float = 1.0) -> Profile:
        """This profile with every compute time (the codec's and the step's included) x ``compute`` and
        every all-reduce (and link model) x ``comm``."""
        times = tuple(BucketTimes(t.forward_s * compute, t.backward_s * compute,
                                  {k: v * comm for k, v in t.comm_s.items()}, t.codec_s * compute) for t in self.times)
        links = tuple(replace(lk, alpha_s=lk.alpha_s * comm, beta_s_per_byte=lk.beta_s_per_byte * comm)
                      for lk in self.links)
        return replace(self, times=times, links=links, step_s=self.step_s * compute)

    @property
    def forward_s(self) -> float:
        return sum(t.forward_s for t in self.times)

    @property
    def backward_s(self) -> float:
        return sum(t.backward_s for t in self.times)

    @cached_property
    def gradient_ready(self) -> tuple[int, ...]:
        """``ready[b]``: the bucket at the end of whose backward bucket ``b``'s gradient is complete.

        A parameter's gradient appears at once, when its layer's backward ends (torch accumulates it
        whole; the runtime's bucket is ready when all its parameters are). A parameter cut into pieces
        (``"fc.weight[0:100]"``, ``"fc.weight[100:200]"``: the partition's names) spans consecutive
        buckets whose ``backward_s`` split its layer's backward in proportion to size, so that layer's
        backward ends with the last of them (the highest id: the backward runs buckets ``0 .. n-1``).
        So ``ready[b]`` is the highest bucket sharing a parameter with ``b`` (by base name; a name
        ``"a|b[lo:hi]"``, a range of several parameters' concatenation, holds each of them) directly, not
        through a third parameter: ``a[0:10]`` in bucket 0 and ``a[10:20], c[0:5]`` in bucket 1 make
        bucket 0 ready after bucket 1, not after ``c``'s bucket 2. Invariants: ``ready[b] >= b``, and
        ``ready`` is non-decreasing (a shared parameter's buckets are consecutive).
        """
        names = [_base_names(b.params) for b in self.buckets]
        ready = list(range(self.n))
        for b in range(self.n):
            nxt = b + 1
            while nxt < self.n and names[b] & names[nxt]:
                ready[b] = nxt
                nxt += 1
        return tuple(ready)

    @cached_property
    def forward_gates(self) -> tuple[int, ...]:
        """``gate[b]``: the bucket whose forward is the first to need bucket ``b``'s parameters.

        A parameter cut into pieces (``"fc.weight[0:100]"``, ``"fc.weight[100:200]"``) spans consecutive
        buckets, and its module runs its forward once, when the first of them (the highest id: the
        forward runs buckets ``n-1 .. 0``) does. So the buckets sharing a parameter (transitively, unlike
        :attr:`gradient_ready`) form a run ``lo..hi`` with ``gate = hi`` for each; a bucket sharing none
        is its own gate. A name ``"a|b[lo:hi]"`` (a range of several parameters' concatenation) shares
        with every one of them.
        """
        names = [_base_names(b.params) for b in self.buckets]
        gates = list(range(self.n))
        for b in range(self.n - 2, -1, -1):
            if names[b] & names[b + 1]:
                gates[b] = gates[b + 1]
        return tuple(gates)

    @cached_property
    def ready_s(self) -> tuple[float, ...]:
        """When each bucket's gradient is ready, from the start of backward: ``R_i = B_0 + ... + B_r``
        with ``r = gradient_ready[i]`` (``r == i`` unless bucket ``i`` holds a piece of a cut parameter)."""
        cum = tuple(itertools.accumulate(t.backward_s for t in self.times))
        return tuple(cum[r] for r in self.gradient_ready)

    def total_comm_s(self, link: str | None = None) -> float:
        """Total all-reduce time of all buckets on ``link`` (default: the first, primary link)."""
        name = link if link is not None else self.links[0].name
        return sum(self.comm_time(b.id, name) for b in self.buckets)

    @property
    def coverage_rate(self) -> float:
        """CR = T_comm / (T_forward + T_backward) on the primary link (paper, Table I)."""
        compute = self.forward_s + self.backward_s
        return self.total_comm_s() / compute if compute > 0 else float("inf")

    # -- validation and JSON -------------------------------------------------------------------
    def validate(self, source: str) -> None:
        if self.world_size < 1:
            raise ContractError(source, "world_size", f"expected >= 1, got {self.world_size}")
        if self.source not in SOURCES:
            raise ContractError(source, "source", f"expected one of {', '.join(SOURCES)}, got {self.source!r}")
        if not self.buckets:
            raise ContractError(source, "buckets", "expected at least one bucket")
        if len(self.times) != len(self.buckets):
            raise ContractError(
                source, "times", f"expected one entry per bucket ({len(self.buckets)}), got {len(self.times)}"
            )
        if not self.links:
            raise ContractError(source, "links", "expected at least one link")
        if not _nonneg(self.step_s):
            raise ContractError(source, "step_s", f"expected a finite number >= 0 (seconds per iteration), "
                                f"got {self.step_s}")
        names = [link.name for link in self.links]
        if len(set(names)) != len(names):
            raise ContractError(source, "links", f"link names must be unique, got {names}")
        for i, link in enumerate(self.links):
            _validate_link(source, i, link)
        for i, b in enumerate(self.buckets):
            if b.id != i:
                raise ContractError(source, f"buckets[{i}].id", f"expected {i} (ids are 0..n-1 in order), got {b.id}")
            if b.numel < 0 or b.nbytes < 0:
                raise ContractError(source, f"buckets[{i}]", "numel and nbytes must be >= 0")
            if b.wire_nbytes is not None:
                if not self.codec:
                    raise ContractError(source, f"buckets[{i}].wire_nbytes",
                                        "given without a codec: say which compression produced it (codec)")
                if b.wire_nbytes < 0:
                    raise ContractError(source, f"buckets[{i}].wire_nbytes", f"expected >= 0, got {b.wire_nbytes}")
        for i, t in enumerate(self.times):
            if not _nonneg(t.forward_s) or not _nonneg(t.backward_s):
                raise ContractError(source, f"times[{i}]", "forward_s and backward_s must be finite and >= 0, "
                                    f"got {t.forward_s} and {t.backward_s}")
            if not _nonneg(t.codec_s):
                raise ContractError(source, f"times[{i}].codec_s", f"expected a finite number >= 0, got {t.codec_s}")
            if t.codec_s > 0 and not self.codec:
                raise ContractError(source, f"times[{i}].codec_s",
                                    "given without a codec: say which compression produced it (codec)")
            for name, v in t.comm_s.items():
                if name not in names:
                    raise ContractError(source, f"times[{i}].comm_s.{name}", f"unknown link; links are {names}")
                if not _nonneg(v):
                    raise ContractError(source, f"times[{i}].comm_s.{name}", f"expected a finite number >= 0, got {v}")
            for name in names:
                if name not in t.comm_s and self.links[names.index(name)].beta_s_per_byte == 0 \
                        and self.links[names.index(name)].alpha_s == 0:
                    raise ContractError(
                        source, f"times[{i}].comm_s.{name}",
                        "missing, and the link has no fitted alpha/beta to fall back on",
                    )

    def to_dict(self) -> JsonDict:
        buckets: list[JsonDict] = [
            {"id": b.id, "params": list(b.params), "numel": b.numel, "nbytes": b.nbytes,
             "forward_s": t.forward_s, "backward_s": t.backward_s, "comm_s": dict(t.comm_s)}
            for b, t in zip(self.buckets, self.times, strict=True)
        ]
        doc: JsonDict = {
            "kind": "deft.profile",
            "schema": SCHEMA_VERSION if self.codec else 1,
            "model": self.model,
            "source": self.source,
            "world_size": self.world_size,
            **({"step_s": self.step_s} if self.step_s else {}),  # absent when 0: older profiles' digests unchanged
            "versions": dict(self.versions),
            "links": [
                {"name": k.name, "backend": k.backend, "ifname": k.ifname,
                 "alpha_s": k.alpha_s, "beta_s_per_byte": k.beta_s_per_byte,
                 # absent when 0: older profiles' digests unchanged
                 **({"contention": k.contention} if k.contention else {}),
                 **({"drag": k.drag} if k.drag else {}),
                 **({"lag_s": k.lag_s} if k.lag_s else {}),
                 **({"guarded": True} if k.guarded else {}),
                 **({"sends_at_once": k.sends_at_once} if k.sends_at_once else {})}
                for k in self.links
            ],
            "buckets": buckets,
            "meta": self.meta,
        }
        if self.codec:
            doc["codec"] = self.codec
            for bd, b, t in zip(buckets, self.buckets, self.times, strict=True):
                bd["wire_nbytes"] = b.wire
                bd["codec_s"] = t.codec_s
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, JsonValue], source: str = "<dict>") -> Profile:
        f = Fields(doc, source, "")
        kind = f.str("kind")
        if kind != "deft.profile":
            raise f.error("kind", f"expected 'deft.profile', got {kind!r}")
        schema = f.int("schema")
        if schema not in SCHEMAS:
            raise f.error("schema", f"this deft reads schemas {', '.join(map(str, SCHEMAS))}, file has {schema}")
        codec = f.str("codec", "") if schema >= 2 else ""
        if schema < 2 and "codec" in doc:
            raise f.error("codec", "compression fields need schema 2; this file says schema 1")
        if schema >= 2 and not codec:
            raise f.error("codec", "schema 2 carries compression: expected the codec's name (a non-empty string)")
        links = []
        for i, lf in enumerate(f.items("links")):
            if "wait_s" in lf.doc:
                log.warning("%s: links[%d].wait_s is an older deft's wait per iteration for the last rank; it is "
                            "not priced (this deft prices the last rank's lag per send, lag_s)", source, i)
            links.append(Link(
                name=lf.str("name"), backend=lf.str("backend", choices=BACKENDS), ifname=lf.opt_str("ifname"),
                alpha_s=lf.float("alpha_s", 0.0), beta_s_per_byte=lf.float("beta_s_per_byte", 0.0),
                contention=lf.float("contention", 0.0), drag=lf.float("drag", 0.0),
                lag_s=lf.float("lag_s", 0.0), guarded=lf.bool("guarded", False),
                sends_at_once=lf.int("sends_at_once", 0, minimum=0),
            ))
        buckets, times = [], []
        for bf in f.items("buckets"):
            raw_params = bf.list("params", [])
            params = [p for p in raw_params if isinstance(p, str)]
            if len(params) != len(raw_params):
                raise bf.error("params", "expected a list of parameter names")
            if not codec:
                for key in ("wire_nbytes", "codec_s"):
                    if key in bf.doc:
                        raise bf.error(key, "a compression field in a profile without a codec (schema 2 and "
                                       "'codec' carry compression)")
            buckets.append(Bucket(id=bf.int("id", minimum=0), params=tuple(params),
                                  numel=bf.int("numel", minimum=0), nbytes=bf.int("nbytes", minimum=0),
                                  wire_nbytes=bf.int("wire_nbytes", minimum=0) if codec else None))
            comm = bf.sub("comm_s") if "comm_s" in bf.doc else None
            comm_s = {k: comm.float(k) for k in comm.doc} if comm is not None else {}
            times.append(BucketTimes(forward_s=bf.float("forward_s"), backward_s=bf.float("backward_s"),
                                     comm_s=comm_s, codec_s=bf.float("codec_s", 0.0) if codec else 0.0))
        versions = f.dict("versions", {})
        prof = object.__new__(cls)
        object.__setattr__(prof, "buckets", tuple(buckets))
        object.__setattr__(prof, "times", tuple(times))
        object.__setattr__(prof, "links", tuple(links))
        object.__setattr__(prof, "world_size", f.int("world_size", minimum=1))
        object.__setattr__(prof, "source", f.str("source", choices=SOURCES))
        object.__setattr__(prof, "versions", {str(k): str(v) for k, v in versions.items()})
        object.__setattr__(prof, "model", f.str("model", ""))
        object.__setattr__(prof, "meta", f.dict("meta", {}))
        object.__setattr__(prof, "codec", codec)
        object.__setattr__(prof, "step_s", f.float("step_s", 0.0))
        prof.validate(source)
        return prof

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(read_json(path, "profile"), str(path))

    def digest(self) -> str:
        """Stable hash of the content (sha256 of canonical JSON), used to tie a schedule to its profile."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


#: A bucket's name for an element range of a parameter (or of ``"a|b"``, several parameters'
#: concatenation), as the partition writes it: ``"fc.weight[100:200]"``; groups: base, lo, hi.
PARAM_RANGE = re.compile(r"^(.*)\[(\d+):(\d+)\]$")


def param_names(name: str) -> tuple[tuple[str, ...], bool]:
    """The parameters one bucket name refers to, in order, and whether it is a range of them:
    ``"w"`` is ``(("w",), False)``, ``"w[0:5]"`` ``(("w",), True)``, ``"a|b[0:3]"`` ``(("a", "b"), True)``."""
    m = PARAM_RANGE.match(name)
    return tuple((m.group(1) if m else name).split("|")), m is not None


def _base_names(params: Sequence[str]) -> set[str]:
    """The parameters a bucket's names refer to: ``"w[0:5]"`` is ``w``; ``"a|b[0:3]"`` is ``a`` and ``b``."""
    return {base for name in params for base in param_names(name)[0]}
