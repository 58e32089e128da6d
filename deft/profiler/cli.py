"""``deft-profile``: run a user's training under profiling and write a profile plus a readable report.

    deft-profile [--nproc-per-node N] [--backend auto|timing|torch|nsys] [--iters N] [--out FILE]
                 train.py [script args]
    deft-profile [options] -- CMD [ARGS...]

The training script is launched like ``torchrun`` launches it. Profiling is switched on through the
environment (read by ``deft.DistributedDataParallel``):

* ``DEFT_PROFILE_OUT``: rank 0 writes the in-process timing profile there, then training goes on;
* ``DEFT_PROFILE_ITERS``: how many iterations are measured;
* ``DEFT_TRACE_DIR``: with ``--backend torch``, every rank records its measured iterations with
  ``torch.profiler`` and exports a Chrome trace ``rank{r}.json.gz`` there, which
  :func:`deft.profiler.kineto.load` turns into the profile.

``--backend nsys`` wraps the launch in ``nsys profile`` (CUDA + NVTX) and exports SQLite, which
:func:`deft.profiler.nsys.load` reads; ``auto`` takes nsys when it is on PATH and CUDA is there, else torch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from deft.errors import DeftError
from deft.profile import Profile

BACKENDS = ("auto", "timing", "torch", "nsys")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deft-profile",
        description="Profile a training script per bucket (forward, backward, communication per link).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes to launch (like torchrun)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="where the times come from")
    p.add_argument("--iters", type=int, default=5, help="iterations to measure after warm-up")
    p.add_argument("--out", default="deft-profile.json", help="profile JSON to write")
    p.add_argument("--no-png", action="store_true", help="skip the timeline picture")
    p.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    p.add_argument("command", nargs=argparse.REMAINDER, help="train.py [args], or -- CMD [ARGS...]")
    return p


def choose_backend(requested: str) -> str:
    """``auto``: Nsight Systems when it is installed and a GPU is there, else torch.profiler."""
    if requested != "auto":
        return requested
    if shutil.which("nsys") is not None:
        try:
            import torch

            if torch.cuda.is_available():
                return "nsys"
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
    return "torch"


def build_command(args: argparse.Namespace, trace_dir: Path, backend: str) -> list[str]:
    cmd = list(args.command)
    if not cmd:
        raise DeftError("deft-profile: no training script given (usage: deft-profile [options] train.py [args])")
    if cmd[0] == "--":
        cmd = cmd[1:]
        if not cmd:
            raise DeftError("deft-profile: nothing after '--'")
    else:
        script = Path(cmd[0])
        if not script.is_file():
            raise DeftError(f"deft-profile: training script {script} not found (use -- CMD for another command)")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc_per_node}", *cmd]
    if backend == "nsys":
        nsys = shutil.which("nsys")
        if nsys is None:
            raise DeftError("deft-profile: --backend nsys but no 'nsys' on PATH (install Nsight Systems)")
        cmd = [nsys, "profile", "--trace=cuda,nvtx,osrt", "--export=sqlite", "--force-overwrite=true",
               "-o", str(trace_dir / "deft"), *cmd]
    return cmd


def collect(backend: str, out: Path, trace_dir: Path) -> Profile:
    """Read what the run left behind into one Profile."""
    timing = Profile.load(out) if out.exists() else None
    if backend == "timing":
        if timing is None:
            raise DeftError(f"deft-profile: the run wrote no profile to {out}: does the script use "
                            "deft.DistributedDataParallel and train for at least warm-up + --iters iterations?")
        return timing
    if backend == "torch":
        from deft.profiler import kineto

        traces = sorted(trace_dir.glob("rank*.json*"))
        if not traces:
            raise DeftError(f"deft-profile: no torch.profiler trace in {trace_dir}: does the script use "
                            "deft.DistributedDataParallel and train for at least warm-up + --iters iterations?")
        # every rank's trace: median over iterations per rank; compute at the slowest rank's pace, comm max over
        # ranks (as the timing profile's compute)
        prof = kineto.load(trace_dir)
    else:
        from deft.profiler import nsys

        exports = sorted(trace_dir.glob("*.sqlite"))
        if not exports:
            raise DeftError(f"deft-profile: nsys wrote no SQLite export in {trace_dir}")
        prof = nsys.load(exports[0])
    if timing is not None and [b.numel for b in timing.buckets] == [b.numel for b in prof.buckets] \
            and set(prof.link_names) <= set(timing.link_names):
        # Traces know times, not which parameters form a bucket nor each link's fitted alpha/beta:
        # take those from the timing profile of the same run (same buckets, same links).
        from dataclasses import replace

        links = tuple(lk for lk in timing.links if lk.name in prof.link_names)
        prof = replace(prof, buckets=timing.buckets, links=links, model=timing.model,
                       meta={**prof.meta, "params_known": True, "timing_profile": str(out)})
    return prof


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--iters", args.iters)):
            if value < 1:
                raise DeftError(f"deft-profile: {flag}: expected an integer >= 1, got {value}")
        if args.timeout is not None and not args.timeout > 0:
            raise DeftError(f"deft-profile: --timeout: expected seconds > 0, got {args.timeout}")
        backend = choose_backend(args.backend)
        out = Path(args.out).resolve()
        trace_dir = out.with_suffix("").with_name(out.stem + "-traces")
        cmd = build_command(args, trace_dir, backend)  # bad usage fails before anything is touched
        trace_dir.mkdir(parents=True, exist_ok=True)
        # a previous run's files must not pass for this run's
        for stale in [out, *trace_dir.glob("rank*.json*"), *trace_dir.glob("*.sqlite"), *trace_dir.glob("*.nsys-rep")]:
            stale.unlink(missing_ok=True)
        env = dict(os.environ, DEFT_PROFILE_OUT=str(out), DEFT_PROFILE_ITERS=str(args.iters))
        if backend == "torch":
            env["DEFT_TRACE_DIR"] = str(trace_dir)
        if backend == "nsys":
            env["DEFT_NVTX"] = "1"  # ranges on whether or not nsys sets NVTX_INJECTION64_PATH
        print(f"deft-profile: backend {backend}; running: {' '.join(cmd)}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            rc = subprocess.run(cmd, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            raise DeftError(f"deft-profile: the run did not finish within {args.timeout} s") from None
        except OSError as e:  # e.g. `-- CMD` where CMD does not exist or is not executable
            raise DeftError(f"deft-profile: cannot run {cmd[0]!r}: {e.strerror or e}") from None
        print(f"deft-profile: run finished in {time.perf_counter() - start:.1f} s (exit {rc})",
              file=sys.stderr, flush=True)
        if rc != 0:
            raise DeftError(f"deft-profile: the training command failed with exit code {rc}")
        prof = collect(backend, out, trace_dir)
        prof.save(out)
        from deft.profiler.report import write_report

        report = write_report(prof, out.with_suffix(".md"), None if args.no_png else out.with_suffix(".png"))
        print(report.read_text(encoding="utf-8"))
        print(f"deft-profile: wrote {out} and {report}", file=sys.stderr)
        return 0
    except DeftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
