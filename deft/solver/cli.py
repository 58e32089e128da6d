"""``deft simulate`` and ``deft plan``: the solver's command line (dispatched by :mod:`deft.cli`).

* ``deft simulate PROFILE [--schemes ddp,bytescheduler,usbyte,mgwfbp,deft] [--png FILE] [--workers N]
  [--config deft.toml] [--stats loss=L,mu=M,sigma=S,lr=R,batch=B]``: simulate each scheme on the
  profile, print a comparison table and draw the timeline picture. DeFT gets two rows: ``deft``, the
  planner's first schedule (what a run with the preserver off uses), and ``deft+preserver``, what a run
  with this config uses: the preserver's choice for the given walk statistics (without ``--stats``:
  the statistics a run has before it measures them, i.e. none, and the no-delay schedule).
* ``deft plan PROFILE [--out schedule.json] [--epsilon E] [--config deft.toml] [--workers N]
  [--png FILE]``: plan a DeFT schedule, print its cycle, batch-size sequence K and the all-reduces of
  every stage, compare it with the baselines in simulation, and write the schedule JSON.

Bad input (a damaged profile, an unknown scheme, an invalid config) raises a :class:`DeftError`; the
dispatcher prints its message (which names the file and the field) and exits with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from deft.config import DeftConfig
from deft.errors import ContractError
from deft.preserver.feedback import PreserveResult, WalkStats, preserve
from deft.profile import Profile
from deft.schedule import Schedule
from deft.solver.compare import SCHEMES, plan_deft, simulate
from deft.solver.partition import profile_for_schedule
from deft.solver.simulate import SimResult, scale_workers, simulate_schedule
from deft.solver.timeline import draw_timeline

DEFAULT_SCHEMES = ("ddp", "bytescheduler", "usbyte", "mgwfbp", "deft")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected >= 1, got {v}")
    return v


def _epsilon(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {v}")
    return v


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="profile JSON (deft-profile output or examples/profiles/*.json)")
    parser.add_argument("--config", metavar="TOML", help="deft.toml with solver settings (default: built-in)")
    parser.add_argument("--workers", type=_positive_int, metavar="N",
                        help="rescale communication to N workers (ring all-reduce model)")
    parser.add_argument("--png", metavar="FILE", help="write the timeline picture (compute stream and links)")
    if name == "simulate":
        parser.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                            help=f"comma-separated, from {', '.join(SCHEMES)} (default: %(default)s)")
        parser.add_argument("--stats", metavar="loss=L,mu=M,sigma=S,lr=R,batch=B",
                            help="walk statistics for the deft+preserver row (s_star=X optional; default: "
                                 "unknown, as before a run has measured them)")
    elif name == "plan":
        parser.add_argument("--out", default="schedule.json", metavar="FILE",
                            help="where to write the schedule JSON (default: %(default)s)")
        parser.add_argument("--epsilon", type=_epsilon, metavar="E",
                            help="accuracy knob in [0, 1]; 0 forbids delayed updates (default: config's)")
    else:  # pragma: no cover - the dispatcher only registers the two names above
        raise ValueError(f"unknown subcommand {name!r}")


def run(name: str, args: argparse.Namespace) -> int:
    if name == "simulate":
        return _simulate(args)
    if name == "plan":
        return _plan(args)
    raise ValueError(f"unknown subcommand {name!r}")  # pragma: no cover


# --------------------------------------------------------------------------------------------------
def _load(args: argparse.Namespace) -> tuple[Profile, DeftConfig]:
    profile = Profile.load(args.profile)
    config = DeftConfig.resolve(args.config)
    if args.workers is not None:
        profile = scale_workers(profile, args.workers)
    return profile, config


def _schemes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ContractError("command line", "--schemes", f"expected a comma-separated list of {', '.join(SCHEMES)}")
    for s in names:
        if s not in SCHEMES:
            raise ContractError("command line", "--schemes", f"unknown scheme {s!r}; expected {', '.join(SCHEMES)}")
    return list(dict.fromkeys(names))


_STATS_FIELDS = ("loss", "mu", "sigma", "lr", "batch")


def parse_stats(text: str) -> WalkStats:
    """``loss=2,mu=0.3,sigma=20,lr=0.05,batch=512`` (and optionally ``s_star=...``) as :class:`WalkStats`."""
    expected = "expected loss=L,mu=M,sigma=S,lr=R,batch=B (s_star=X optional)"
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in (*_STATS_FIELDS, "s_star") or key in values:
            raise ContractError("command line", "--stats", f"{expected}; got {text!r}")
        try:
            values[key] = float(raw)
        except ValueError:
            raise ContractError("command line", "--stats", f"{key}: expected a number, got {raw!r}") from None
    missing = [k for k in _STATS_FIELDS if k not in values]
    if missing:
        raise ContractError("command line", "--stats", f"{expected}; {', '.join(missing)} missing in {text!r}")
    return WalkStats(loss=values["loss"], mu=values["mu"], sigma=values["sigma"], lr=values["lr"],
                     batch=values["batch"], s_star=values.get("s_star", 0.0))


def describe_stats(stats: WalkStats | None) -> str:
    if stats is None:
        return ("statistics unknown (a run before it has measured mu and sigma; give them with "
                "--stats loss=L,mu=M,sigma=S,lr=R,batch=B)")
    text = ", ".join(f"{k} {getattr(stats, k):g}" for k in _STATS_FIELDS)
    return f"walk statistics {text}" + (f", s_star {stats.s_star:g}" if stats.s_star else "")


def simulate_pipeline(profile: Profile, config: DeftConfig,
                      stats: WalkStats | None) -> tuple[SimResult, PreserveResult]:
    """What a run with ``config`` uses for these statistics (:func:`deft.preserver.feedback.preserve`),
    simulated on the (partitioned) profile it refers to; the result's ``meta["schedule"]`` is it."""
    chosen = preserve(profile, config, stats)
    planned = profile_for_schedule(profile, chosen.schedule, config)
    res = simulate_schedule(planned, chosen.schedule, scheme="deft+preserver")
    return dataclasses.replace(res, meta={**res.meta, "schedule": chosen.schedule, "profile": planned}), chosen


def describe_profile(profile: Profile, path: str) -> str:
    links = ", ".join(k.name if k.name == k.backend else f"{k.name} ({k.backend})" for k in profile.links)
    compute = (profile.forward_s + profile.backward_s) * 1e3
    return (f"{profile.model or 'model'} ({profile.source} profile {path}): {profile.n} buckets, "
            f"{profile.world_size} workers, links {links}\n"
            f"forward {profile.forward_s * 1e3:.1f} ms + backward {profile.backward_s * 1e3:.1f} ms = compute bound "
            f"{compute:.1f} ms; all-reduce {profile.total_comm_s() * 1e3:.1f} ms "
            f"on {profile.links[0].name} (coverage rate {profile.coverage_rate:.2f})"
            + ("\n" + describe_compression(profile) if profile.compressed else ""))


SHOWN_BUCKETS = 40  # per-bucket compression lines printed at most


def describe_compression(profile: Profile) -> str:
    """The codec, its total bytes on the wire against the gradient's, its compute, and one line per bucket."""
    nbytes = sum(b.nbytes for b in profile.buckets)
    wire = sum(b.wire for b in profile.buckets)
    codec = sum(t.codec_s for t in profile.times)
    lines = [f"compression {profile.codec}: {wire / 2**20:.3f} MiB on the wire per iteration for "
             f"{nbytes / 2**20:.3f} MiB of gradient ({wire / nbytes if nbytes else 1.0:.3f}x); codec compute "
             f"{codec * 1e3:.2f} ms per iteration (every scheme below is simulated with this codec: its compute on the "
             "compute stream before each send, sends one at a time over all links)",
             "  bucket   gradient B    wire B   codec ms"]
    lines += [f"  {b.id:>6} {b.nbytes:>12} {b.wire:>9} {t.codec_s * 1e3:>10.3f}"
              for b, t in zip(profile.buckets[:SHOWN_BUCKETS], profile.times, strict=False)]
    if profile.n > SHOWN_BUCKETS:
        lines.append(f"  ... {profile.n - SHOWN_BUCKETS} more buckets (all in the profile JSON)")
    return "\n".join(lines)


def format_table(results: dict[str, SimResult], baseline: SimResult | None) -> str:
    """The comparison table: scheme, iteration ms, speedup vs ddp, bubble %, updates/iter, links.

    Every figure comes from the discrete-event simulator on the profile's times, and the title says
    so: a user must not read it as a measurement of training.
    """
    head = f"{'scheme':<14} {'iteration ms':>12} {'vs ddp':>8} {'bubble %':>9} {'updates/iter':>13}  link utilisation"
    lines = ["simulated steady state (deft.solver.simulate on the profile's times; not measured):",
             head, "-" * len(head)]
    for name, r in results.items():
        speed = f"{r.speedup_over(baseline):.2f}x" if baseline is not None else "-"
        util = "  ".join(f"{k} {v:.0%}" for k, v in r.link_utilization.items() if v > 0) or "-"
        lines.append(f"{name:<14} {r.iteration_s * 1e3:>12.2f} {speed:>8} {r.bubble_ratio * 100:>9.1f} "
                     f"{r.updates_per_iteration:>13.2f}  {util}")
    return "\n".join(lines)


def _picture(results: dict[str, SimResult], png: str, title: str) -> None:
    out = draw_timeline(results, png, title=title)
    print(f"timeline picture: {out}")


def _simulate(args: argparse.Namespace) -> int:
    profile, config = _load(args)
    schemes = _schemes(args.schemes)
    stats = parse_stats(args.stats) if args.stats is not None else None
    results = {s: simulate(profile, s, config) for s in schemes}
    chosen: PreserveResult | None = None
    if "deft" in results and config.preserver:
        results["deft+preserver"], chosen = simulate_pipeline(profile, config, stats)
    baseline = results.get("ddp") or simulate(profile, "ddp", config)
    print(describe_profile(profile, args.profile))
    print()
    print(format_table(results, baseline))
    if "deft" in results:
        sched = results["deft"].meta["schedule"]
        assert isinstance(sched, Schedule)  # compare.simulate(..., "deft") records the schedule it planned
        print(f"\nrow deft: the planner's first schedule, preserver off (what a run with preserver = false "
              f"uses): cycle {sched.cycle}, K = {list(sched.batch_sequence)}, {sched.n_buckets} buckets after "
              f"partition; deft/compute bound = {results['deft'].iteration_s / results['deft'].compute_bound_s:.3f}")
        if chosen is None:
            print("row deft+preserver: none, this config disables the preserver (a run uses the deft row's schedule)")
        else:
            run = chosen.schedule
            print(f"row deft+preserver: what a run with this config (preserver on, epsilon {config.epsilon:g}) "
                  f"uses for {describe_stats(stats)}: cycle {run.cycle}, K = {list(run.batch_sequence)} "
                  f"({run.meta.get('mode', 'deft')}); preserver: {chosen.reason}")
    if args.png:
        _picture(results, args.png, f"{profile.model or args.profile}: simulated steady-state iterations")
    return 0


def format_stages(schedule: Schedule) -> str:
    """Each position's forward and backward all-reduces: ``bucket(origin)@link`` in launch order."""
    lines = []
    for sp in schedule.stages:
        comms = " ".join(f"{t.bucket}" + (f"({t.origin})" if t.origin else "") + f"@{t.link}" for t in sp.comms)
        lines.append(f"  position {sp.position} {sp.stage:<8} {comms or '-'}")
    for g, u in enumerate(schedule.updates):
        when = (f"{u.apply_after - schedule.cycle} of the next cycle" if u.apply_after >= schedule.cycle
                else f"{u.apply_after}")
        how = (" (lag-free: buckets sent in the next forward" + (f" and buckets {list(u.deferred)} sent in "
                                                                  "backward" if u.deferred else "")
               + " are applied per layer, just before that layer's forward)") if u.finish_in_forward else ""
        lines.append(f"  update {g}: merges positions {list(u.positions)} (k={u.k}), "
                     f"applied after position {when}{how}")
    return "\n".join(lines)


def _plan(args: argparse.Namespace) -> int:
    profile, config = _load(args)
    if args.epsilon is not None:
        config = dataclasses.replace(config, epsilon=args.epsilon)
    schedule, planned = plan_deft(profile, config)
    print(describe_profile(profile, args.profile))
    mode = schedule.meta.get("mode", "deft")
    print(f"\nschedule ({mode}, epsilon {config.epsilon}): cycle {schedule.cycle} iterations, "
          f"K = {list(schedule.batch_sequence)}, {schedule.updates_per_iteration:.2f} updates/iteration, "
          f"{planned.n} buckets after partition, links {', '.join(schedule.links)}")
    print("all-reduces per stage (bucket(k) = the bucket of the group that ended k iterations before):")
    print(format_stages(schedule))
    if config.epsilon > 0:
        print("note: during training the preserver tests this plan against measured loss statistics and "
              "may re-plan with more capacity (fewer merged updates).")
    results = {s: simulate(profile, s, config) for s in DEFAULT_SCHEMES if s != "deft"}
    results["deft"] = simulate_schedule(planned, schedule, scheme="deft")
    print()
    print(format_table(results, results["ddp"]))
    out = Path(args.out)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    schedule.save(out)
    print(f"\nschedule written to {out} (digest {schedule.digest()})")
    if args.png:
        _picture(results, args.png, f"{profile.model or args.profile}: planned schedule vs baselines")
    return 0
