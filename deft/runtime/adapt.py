"""Closing the loop: the running schedule's measured iteration time against the plan's prediction.

The warm-up profile measures each bucket's compute and each link's all-reduce, but not how they slow
each other down when they run together (on a CPU the gloo threads of every link and the model share
the cores; on a GPU NCCL kernels share the SMs and memory bandwidth). So a plan can be right about
torch DDP and 40% off about itself. After a schedule is installed, every rank times its iterations
(forward start to forward start) and its backward passes; every ``adapt_window`` iterations rank 0
gets the slowest rank's medians (one max-reduction of two numbers) and decides:

1. **Calibrate** when the measured iteration differs from the prediction by more than
   ``adapt_tolerance``: compute is scaled by ``g = measured backward / profiled backward`` (the
   slow-down of compute under the communication running beside it), then communication by the
   factor ``f`` for which the simulator, on the profile with compute x ``g`` and comm x ``f``,
   predicts exactly the measured iteration (``scipy.optimize.brentq``; the simulated time rises
   with ``f``). The corrected profile is planned again; a different schedule is tried (all ranks
   switch at a cycle boundary, as the preserver's re-check does) only when the simulator predicts it
   at least ``SWITCH_GAIN`` faster than the running one on the same corrected profile: a re-plan
   predicted slower than what runs now would be a step back (seen on the testbed: a 1035 ms plan
   replacing a schedule that measured 705 ms).
2. **Keep the fastest**: a schedule tried after a re-plan that measures slower than the best one
   measured so far is abandoned for that one, and adaptation stops. The schedule returned to carries
   its measured time as its prediction (it was planned on another partition of the buckets, so the
   corrected profile cannot simulate it; and a measurement is the better prediction anyway).
3. **Settle**: adaptation stops when the prediction is within tolerance, when a re-plan yields the
   running schedule again, or after ``adapt_max_replans`` re-plans. It never oscillates: a schedule
   abandoned once is never tried again, and a stop is final.

At ``epsilon == 0`` every candidate is a lag-free plan and every switch flushes, so the parameters
stay torch DDP's. Each decision is recorded in ``plan_info["adapt"]``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from scipy.optimize import brentq

from deft.config import DeftConfig
from deft.profile import BucketTimes, Link, Profile
from deft.schedule import Schedule
from deft.solver.partition import profile_for_schedule
from deft.solver.simulate import simulate_schedule

F_RANGE = (0.05, 50.0)  # search interval of the communication factor
#: A re-planned schedule is tried only when predicted at least this much faster than the running one.
SWITCH_GAIN = 0.03


def scaled(profile: Profile, compute: float = 1.0, comm: float = 1.0) -> Profile:
    """``profile`` with every compute time (the codec's included) x ``compute`` and every all-reduce (and
    link model) x ``comm``."""
    times = tuple(BucketTimes(t.forward_s * compute, t.backward_s * compute, {k: v * comm for k, v in t.comm_s.items()},
                              t.codec_s * compute) for t in profile.times)
    links = tuple(Link(lk.name, lk.backend, lk.ifname, lk.alpha_s * comm, lk.beta_s_per_byte * comm)
                  for lk in profile.links)
    return replace(profile, times=times, links=links)


@dataclass(frozen=True)
class Calibration:
    compute: float   # g: measured / profiled compute
    comm: float      # f: the communication factor that makes the simulation match
    predicted_s: float  # the running schedule simulated on the corrected profile


def calibrate(profile: Profile, schedule: Schedule, config: DeftConfig, measured_s: float,
              measured_backward_s: float) -> Calibration:
    """The factors (module docstring, step 1) that make the simulator reproduce ``measured_s``."""
    part = profile_for_schedule(profile, schedule, config)
    g = measured_backward_s / part.backward_s if part.backward_s > 0 and measured_backward_s > 0 else 1.0

    def predicted(f: float) -> float:
        return float(simulate_schedule(scaled(part, g, f), schedule).iteration_s)

    lo, hi = F_RANGE
    p_lo, p_hi = predicted(lo), predicted(hi)
    if measured_s <= p_lo:
        f = lo
    elif measured_s >= p_hi:
        f = hi
    else:
        f = float(brentq(lambda x: predicted(x) - measured_s, lo, hi, xtol=1e-3, rtol=1e-4))
    return Calibration(g, f, predicted(f))


@dataclass
class Adapter:
    """Rank 0's adaptation state: what was tried, what it measured, whether to go on."""

    config: DeftConfig
    replans: int = 0
    done: bool = False
    best: tuple[float, Schedule] | None = None   # fastest measured schedule so far
    tried: set[str] = field(default_factory=set)  # digests already run

    def decide(self, running: Schedule, profile: Profile, measured_s: float, measured_backward_s: float,
               replan: Any) -> tuple[Schedule | None, Profile | None, dict[str, Any]]:
        """After a measurement window: the schedule to switch to (or None), the corrected profile (or
        None) and the record. ``replan(profile) -> Schedule`` plans on a corrected profile."""
        cfg = self.config
        predicted = running.predicted_iteration_s
        error = (predicted - measured_s) / measured_s if measured_s > 0 else 0.0
        record: dict[str, Any] = {"schedule": running.digest(), "predicted_s": predicted, "measured_s": measured_s,
                                  "error": error}
        self.tried.add(running.digest())
        if self.best is not None and measured_s > self.best[0] and self.best[1].digest() != running.digest():
            self.done = True
            record["decision"] = f"slower than {self.best[1].digest()} ({self.best[0] * 1e3:.1f} ms): back to it"
            back = replace(self.best[1], predicted_iteration_s=self.best[0])  # measured: module docstring
            return back, None, record
        if self.best is None or measured_s < self.best[0]:
            self.best = (measured_s, running)
        if abs(error) <= cfg.adapt_tolerance:
            self.done = True
            record["decision"] = "prediction within tolerance: settled"
            return None, None, record
        if self.replans >= cfg.adapt_max_replans:
            self.done = True
            record["decision"] = f"{self.replans} re-plans made: settled"
            return None, None, record
        cal = calibrate(profile, running, cfg, measured_s, measured_backward_s)
        # Corrected in the buckets the running schedule refers to (its partition of ``profile``): then the
        # corrected profile and the running schedule always fit together (`deft simulate` on it, the
        # timeline of the run, a later calibration), even when adaptation keeps that schedule; a
        # re-plan partitions it again as any profile.
        corrected = scaled(profile_for_schedule(profile, running, cfg), cal.compute, cal.comm)
        record.update(compute_factor=cal.compute, comm_factor=cal.comm, calibrated_s=cal.predicted_s)
        self.replans += 1
        new = replan(corrected)
        record["new_schedule"] = new.digest()
        record["new_predicted_s"] = new.predicted_iteration_s
        if new.digest() in self.tried:
            self.done = True
            record["decision"] = "the corrected profile gives a schedule already run: settled"
            return None, corrected, record
        if new.predicted_iteration_s >= (1.0 - SWITCH_GAIN) * cal.predicted_s:
            self.done = True
            record["decision"] = (f"the corrected profile's plan is not predicted faster "
                                  f"({new.predicted_iteration_s * 1e3:.1f} ms against {cal.predicted_s * 1e3:.1f} ms "
                                  "for the running schedule): settled")
            return None, corrected, record
        record["decision"] = "try the schedule planned on the corrected profile"
        return new, corrected, record


def window_medians(iteration_s: list[float], backward_s: list[float]) -> list[float]:
    """This rank's medians of one window (the max over ranks is taken by the caller)."""
    return [statistics.median(iteration_s) if iteration_s else 0.0,
            statistics.median(backward_s) if backward_s else 0.0]
