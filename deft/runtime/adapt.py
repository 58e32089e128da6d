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

4. **Never slower than the warm-up**: the synchronous schedule deft warmed up and profiled with
   (torch DDP's: every bucket all-reduced in its own backward, one update per iteration, on the
   warm-up's bucket layout) is a measured candidate too (:class:`Synchronous`). When the running
   schedule measures more than ``SWITCH_GAIN`` slower than it (and it is the fastest measured so
   far), every rank switches back to it at a cycle boundary, on the layout it was measured on, the
   record carries both times (``measured_s``, ``synchronous_s``), and adaptation stops. The
   simulator does not model the CPU contention between a comm hook's compute on the gloo threads and
   the model (measured on the 2-core testbed: deft + PowerSGD planned 5-7 buckets at 238-267 ms where
   the warm-up's buckets ran 219-236 ms), so a plan can lose to the warm-up in ways no calibration of
   two factors sees.

   Which iterations count (:class:`SynchronousClock`): forward to next forward, the time deft spends
   planning taken out of the last. When deft measures its profile, the profile iterations
   ``warm_end <= t < plan_at``; the warm-up iterations before them are left out: iteration 0 runs
   another bucket layout (the ready order is not known yet) on cold caches, a comm hook's plain
   iterations cost something else (PowerSGD sends its first ``start_powerSGD_iter`` uncompressed),
   its first compressed iteration is slow (PowerSGD allocates its memories there; torch DDP +
   PowerSGD measured 342 ms against 200-210 after), and with several links the warm-up runs every
   bucket on the first link while the profile iterations rotate them over the links
   (:func:`deft.runtime.warmup_timer.link_rotation`). The profile iterations run the warm-up timer; its
   overhead was measured within the noise (digits CNN + PowerSGD from iteration 2, ``warmup_iters``
   6, 2 ranks on the 2 shared cores of this machine, forward start to step end, one link: warm-up
   iterations 3-7 465-692 ms, median 600; profile iterations 535 and 556 ms; two links: warm-up
   370-448 ms, median 390; profile iterations 285, 399, 481 ms; ``torchrun --nproc-per-node 2
   examples/train_cnn.py --ddp deft --compression powersgd --powersgd-start 2 --max-iters 30`` with
   ``warmup_iters = 6``, ``profile_iters = 3`` (4 with two links), ``adapt = false``, ``epsilon = 0``;
   load average 2-4.6 from other jobs), so they count. The candidate is the
   first profile iteration's schedule (:func:`synchronous_candidate`: bucket ``b`` on link
   ``b mod L``) and its time the median over the rotations (the same work in each: every bucket sent
   once). With a given profile (no profile iterations) the warm-up iterations ``1 <= t < warm_end``
   count (none with the default ``warmup_iters`` 1: then there is no candidate). The figure is each
   rank's median, maximum over ranks, taken with the first window's (no extra collective).

At ``epsilon == 0`` every candidate is a lag-free plan or the synchronous schedule and every switch
flushes, so the parameters stay torch DDP's. Each decision is recorded in ``plan_info["adapt"]``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from scipy.optimize import brentq

from deft.config import DeftConfig
from deft.profile import BucketTimes, Link, Profile
from deft.schedule import Schedule, synchronous_schedule
from deft.solver.partition import profile_for_schedule
from deft.solver.simulate import simulate_schedule

if TYPE_CHECKING:
    from deft.runtime.buckets import FlatLayout

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
    synchronous: Synchronous | None = None        # the warm-up's schedule and its measured time (step 4)

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
        sync = self.synchronous
        if sync is not None:
            record["synchronous_s"] = sync.measured_s
            fastest = self.best is None or sync.measured_s <= self.best[0]
            if (fastest and measured_s > (1.0 + SWITCH_GAIN) * sync.measured_s
                    and plan_digest(running) != plan_digest(sync.schedule)):
                self.done = True
                record["decision"] = (f"slower than the warm-up's synchronous schedule {sync.schedule.digest()} "
                                      f"({measured_s * 1e3:.1f} ms against {sync.measured_s * 1e3:.1f} ms): back to it")
                return replace(sync.schedule, predicted_iteration_s=sync.measured_s), None, record
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


def plan_digest(schedule: Schedule) -> str:
    """The digest of what a schedule does (its prediction left out)."""
    return replace(schedule, predicted_iteration_s=0.0).digest()


def window_medians(iteration_s: list[float], backward_s: list[float]) -> list[float]:
    """This rank's medians of one window (the max over ranks is taken by the caller)."""
    return [statistics.median(iteration_s) if iteration_s else 0.0,
            statistics.median(backward_s) if backward_s else 0.0]


# -- the warm-up's synchronous schedule as a measured candidate (module docstring, step 4) -------------
@dataclass(frozen=True)
class Synchronous:
    """The synchronous schedule deft warmed up with, on the warm-up's bucket layout, and its measured
    iteration time (slowest rank's median over the counted iterations)."""

    schedule: Schedule
    measured_s: float


def synchronous_candidate(layout: FlatLayout, links: tuple[str, ...]) -> Schedule:
    """The schedule the counted iterations ran: every bucket of ``layout`` in its own backward, bucket
    ``b`` on ``links[b mod L]`` (the first profile iteration's links; all on the first with one link)."""
    n = layout.n_buckets
    return synchronous_schedule(layout.bucket_numel, layout.bucket_nbytes(), links,
                                tuple(links[b % len(links)] for b in range(n)))


@dataclass
class SynchronousClock:
    """Forward-to-forward times of the iterations ``first <= t < end`` (module docstring, step 4), less
    the time deft spent on its own work in them (:meth:`exclude`: planning)."""

    seconds: list[float] = field(default_factory=list)
    start: tuple[int, float] | None = None  # (iteration, its forward start)
    excluded_s: float = 0.0

    def forward(self, t: int, now: float, first: int, end: int) -> None:
        """Iteration ``t`` begins at ``now``: iteration ``t - 1``, if it counts, lasted until now."""
        if self.start is not None and self.start[0] == t - 1 and first <= t - 1 < end:
            self.seconds.append(now - self.start[1] - self.excluded_s)
        self.start, self.excluded_s = (t, now), 0.0

    def exclude(self, seconds: float) -> None:
        """``seconds`` of the running iteration were deft's own work, not the schedule's."""
        self.excluded_s += seconds

    def median(self) -> float:
        """This rank's median (0.0: nothing counted; the max over ranks is taken by the caller)."""
        return statistics.median(self.seconds) if self.seconds else 0.0
