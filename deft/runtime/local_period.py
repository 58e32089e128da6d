"""The local-steps period H chosen from measurements and adapted over training (``local_period = "adacomm"``).

Pure decisions, no collectives: :class:`deft.runtime.local_steps.LocalSteps` measures, agrees the
values over the ranks and hands them here, so every rank computes the same H from the same numbers.

**The time model.** ``c`` is the compute seconds of one local step (forward, backward, optimizer step),
``a`` the seconds of one averaging's all-reduce over the links (launch to completion), ``D`` the local
steps an averaging overlaps before it is applied (``local_overlap_iters``; 0 without overlap). With
period ``H`` the averaging hides behind ``D c`` of compute and the rest, ``e = max(0, a - D c)``, is
exposed once per period:

    step time(H) = c + e / H

**H_0, from the measurements.** The smallest ``H`` in ``[h_min, H_max]`` whose exposed communication
per step is at most a fraction ``f`` of the compute, ``e / H <= f c``, i.e. ``H_0 = ceil(e / (f c))``
clipped to ``[h_min, H_max]`` (``H_max`` when none is enough; ``h_min = max(1, D)``, so that an
averaging is applied before the next one is launched). ``e = 0`` (the averaging hidden) gives
``h_min``.

**AdaComm's rule** (Wang and Joshi 2019, "Adaptive Communication Strategies to Achieve the Best
Error-Runtime Trade-off in Local-Update SGD", the adaptive period for a fixed learning rate): at
averaging point ``l``, with ``F_0`` the training loss when ``H_0`` was chosen and ``F_l`` the current
one,

    H_l = ceil( sqrt(F_l / F_0) * H_0 )   clipped to [h_min, H_0]

so the period shrinks as the loss falls (a shorter period lowers the error floor local updates leave)
and never exceeds ``H_0`` (the period the measurements allow). Without a usable loss (none reported,
or one the ratio cannot take: ``F_0 <= 0``, not finite) H stays where it is, and the record says why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deft._json import JsonDict

#: ``f``: the exposed communication per step H_0 allows, as a fraction of the compute per step. AdaComm
#: starts from the period that makes the run compute-bound (its exposed communication a small fraction of
#: the compute: a longer period buys little more speed, only more error), then lowers the period as the
#: loss falls to cut the error floor.
EXPOSED_FRACTION = 0.1
#: plan_info keeps the latest choices only, so a long run's report stays small.
HISTORY_LIMIT = 256


@dataclass(frozen=True)
class Measurements:
    """What H_0 came from: ``c`` (``compute_s``), ``a`` (``allreduce_s``), ``D`` (``overlap_steps``),
    every value already agreed over the ranks (the maximum of their times)."""

    compute_s: float
    allreduce_s: float
    overlap_steps: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compute_s) and self.compute_s > 0):
            raise ValueError(f"compute_s: expected a finite number of seconds > 0, got {self.compute_s}")
        if not (math.isfinite(self.allreduce_s) and self.allreduce_s >= 0):
            raise ValueError(f"allreduce_s: expected a finite number of seconds >= 0, got {self.allreduce_s}")
        if self.overlap_steps < 0:
            raise ValueError(f"overlap_steps: expected an integer >= 0, got {self.overlap_steps}")

    @property
    def exposed_s(self) -> float:
        """``e = max(0, a - D c)``: the averaging's time not hidden behind the D overlapped steps."""
        return max(0.0, self.allreduce_s - self.overlap_steps * self.compute_s)

    def step_s(self, h: int) -> float:
        """The model's time per step at period ``h``: ``c + e / h``."""
        return self.compute_s + self.exposed_s / h

    def to_json(self) -> JsonDict:
        return {"compute_s": self.compute_s, "allreduce_s": self.allreduce_s, "overlap_steps": self.overlap_steps,
                "exposed_s": self.exposed_s}


def period_floor(overlap_steps: int) -> int:
    """``h_min = max(1, D)``: an averaging is applied D steps after its launch, before the next launch."""
    return max(1, overlap_steps)


def _check_bounds(h_min: int, h_max: int) -> None:
    if h_min < 1:
        raise ValueError(f"h_min: expected an integer >= 1, got {h_min}")
    if h_max < h_min:
        raise ValueError(f"h_max: expected an integer >= h_min ({h_min}), got {h_max}")


def initial_period(m: Measurements, h_max: int, fraction: float = EXPOSED_FRACTION) -> int:
    """``H_0``: the smallest ``H`` in ``[max(1, D), h_max]`` with ``e / H <= fraction * c``; ``h_max`` if
    none (module docstring)."""
    h_min = period_floor(m.overlap_steps)
    _check_bounds(h_min, h_max)
    if not fraction > 0:
        raise ValueError(f"fraction: expected > 0, got {fraction}")
    budget = fraction * m.compute_s  # exposed seconds allowed per step
    h = max(1, math.ceil(m.exposed_s / budget))
    while h > 1 and m.exposed_s <= budget * (h - 1):  # the ceiling of a rounded quotient may be one too many
        h -= 1
    return min(h_max, max(h_min, h))


def loss_problem(f0: float | None, loss: float | None) -> str | None:
    """Why AdaComm's rule cannot use these losses (``None``: it can)."""
    if loss is None:
        return "no loss reported by every rank since the last averaging point (ddp.observe_loss)"
    if not math.isfinite(loss) or loss < 0:
        return f"the loss F_l = {loss} is not a finite number >= 0"
    if f0 is None:
        return "no F_0 (no loss was reported when H_0 was chosen)"
    if not (math.isfinite(f0) and f0 > 0):
        return f"F_0 = {f0}: the rule's ratio F_l / F_0 needs a finite F_0 > 0"
    return None


def adacomm_period(h0: int, f0: float, loss: float, h_min: int) -> int:
    """AdaComm's rule: ``ceil(sqrt(loss / f0) * h0)`` clipped to ``[h_min, h0]``."""
    _check_bounds(h_min, h0)
    problem = loss_problem(f0, loss)
    if problem is not None:
        raise ValueError(problem)
    return min(h0, max(h_min, math.ceil(math.sqrt(loss / f0) * h0)))


@dataclass(frozen=True)
class PeriodChoice:
    """One decision at an averaging point: the period until the next point, from the loss ``F_l``."""

    step: int                 # the step after which the averaging point was (and H chosen)
    h: int                    # the period chosen: the next point is after step ``step + h``
    loss: float | None        # F_l: the mean over the ranks of the losses reported since the last point
    ratio: float | None       # F_l / F_0 (None: the rule was not applied)

    def to_json(self) -> JsonDict:
        return {"step": self.step, "H": self.h, "loss": self.loss, "ratio": self.ratio}


@dataclass
class AdaComm:
    """The running period of ``local_period = "adacomm"``: ``h`` is ``h_max`` until :meth:`start` chooses
    ``H_0``, then follows :func:`adacomm_period` at every :meth:`adapt`. Every rank holds an equal copy:
    it is fed only values agreed over the ranks."""

    h_max: int
    h_min: int
    fraction: float = EXPOSED_FRACTION
    h: int = 0                                   # the running period (h_max until H_0 is chosen)
    h0: int | None = None
    f0: float | None = None
    measured: Measurements | None = None
    note: str | None = None                      # why the last decision did not follow the rule
    history: list[PeriodChoice] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_bounds(self.h_min, self.h_max)
        self.h = self.h or self.h_max

    def start(self, step: int, compute_s: float, allreduce_s: float, overlap_steps: int, loss: float | None) -> int:
        """The first averaging point: ``H_0`` from the measurements (``h_max`` when no local step was timed:
        ``compute_s <= 0``) and ``F_0 = loss``; returns the period."""
        if compute_s > 0:
            self.measured = Measurements(compute_s, allreduce_s, overlap_steps)
            self.h0 = initial_period(self.measured, self.h_max, self.fraction)
        else:
            self.h0 = self.h_max
        self.h = self.h0
        return self.adapt(step, loss)

    def adapt(self, step: int, loss: float | None) -> int:
        """An averaging point after H_0: the rule on ``F_l = loss`` (``F_0`` is the first usable loss, when
        none was there at H_0); ``h`` unchanged when the loss is not usable (``note`` says why)."""
        assert self.h0 is not None, "internal: adapt() before start()"
        if self.f0 is None and loss is not None and math.isfinite(loss) and loss > 0:
            self.f0 = loss
        self.note = loss_problem(self.f0, loss)
        ratio = None
        if self.note is None:
            assert self.f0 is not None and loss is not None
            self.h, ratio = adacomm_period(self.h0, self.f0, loss, self.h_min), loss / self.f0
        self.history = [*self.history[-(HISTORY_LIMIT - 1):], PeriodChoice(step, self.h, loss, ratio)]
        return self.h

    def to_json(self) -> JsonDict:
        """``plan_info["local_steps"]["adacomm"]`` and the checkpoint's record (plain types only)."""
        return {"H_max": self.h_max, "h_min": self.h_min, "fraction": self.fraction, "H": self.h, "H0": self.h0,
                "F0": self.f0, "measured": None if self.measured is None else self.measured.to_json(),
                "note": self.note, "history": [c.to_json() for c in self.history]}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> AdaComm:
        """The inverse of :meth:`to_json` (a checkpoint's record; a damaged one raises KeyError, TypeError
        or ValueError, which the caller reports with its source)."""
        m = doc["measured"]
        measured = None if m is None else Measurements(float(m["compute_s"]), float(m["allreduce_s"]),
                                                       int(m["overlap_steps"]))
        history = [PeriodChoice(int(c["step"]), int(c["H"]), _opt_float(c["loss"]), _opt_float(c["ratio"]))
                   for c in doc["history"]]
        h0 = doc["H0"]
        return cls(int(doc["H_max"]), int(doc["h_min"]), float(doc["fraction"]), int(doc["H"]),
                   None if h0 is None else int(h0), _opt_float(doc["F0"]), measured,
                   None if doc["note"] is None else str(doc["note"]), history)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
