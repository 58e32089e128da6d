"""Two-link testbed: all-reduce cost of each link alone and of both links at once, with alpha-beta fits.

    sudo .venv/bin/python benchmarks/bench_links.py [--rates 250,1000] [--iters 10]

For each rate it builds the testbed of docs/DESIGN.md section 6 (2 hosts x 2 links, tbf-shaped), runs
``python -m deft.profiler.links`` as one rank per host (rank 0 on host 0, default group on nic0, the
second link's gloo group on nic1), and reports the fit per link and the 4 MB all-reduce alone and on
both links at once. If the two links are really independent, both at once takes about as long as
either alone. Results go to ``benchmarks/results/testbed.md`` (section "links").

This module also holds the helpers the other testbed benchmarks share: running one rank per host
with live output, and rewriting one section of the results file.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deft.testbed import Testbed  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "testbed.md"
PORT = 29500  # every testbed has fresh namespaces, so a fixed port never collides
# c10d warns once per rank that namespace addresses have no host name; harmless, so not echoed
_NOISE = "hostname of the client socket cannot be retrieved"


def handle_signals() -> None:
    """Turn SIGTERM/SIGHUP into SystemExit so ``with Testbed`` tears down when the run is killed."""
    def _exit(signum: int, _frame: Any) -> None:
        raise SystemExit(f"terminated by signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


def run_ranks(tb: Testbed, argv: Sequence[str], timeout_s: float, label: str, config: Path | None = None,
              echo: Callable[[int, str], bool] | None = None, alone: bool = False, per_host: int = 1) -> list[str]:
    """Run ``argv`` as rank ``h * per_host + l`` on host h (world = hosts x ``per_host``, with the
    environment torchrun's ``--nproc-per-node per_host`` gives); stream output; raise on failure or timeout.

    ``echo(rank, line)`` decides which lines to print live (default: rank 0's, and any line with
    "error" from the others). ``alone``: every rank runs its own single-rank job instead (same CPU
    load, no communication). ``{host}`` in an argument becomes the rank's index, which is the host's
    with one rank per host (distinct output files for jobs that each think they are rank 0); each rank
    also gets it as ``BENCH_SLOT``. Returns each rank's full output.
    """
    if per_host < 1:
        raise ValueError(f"per_host: expected at least 1 rank per host, got {per_host}")
    world = tb.hosts * per_host
    echo = echo or (lambda rank, line: (rank == 0 or "error" in line.lower()) and _NOISE not in line)
    procs = []
    logs: list[list[str]] = [[] for _ in range(world)]
    threads = []
    for rank in range(world):
        h, local = divmod(rank, per_host)
        env = tb.env_for(h, rank=rank, world=world, port=PORT, config=config, local_rank=local,
                         local_world=per_host)
        env["BENCH_SLOT"] = str(rank)
        if alone:  # a port of its own: the ranks of one host share its addresses
            env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR=tb.addr(h, 0), MASTER_PORT=str(PORT + local),
                       LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        host_argv = [a.replace("{host}", str(rank)) for a in argv]
        p = tb.popen(h, host_argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        procs.append(p)

        def pump(rank: int = rank, proc: Any = p) -> None:
            for line in proc.stdout:
                logs[rank].append(line)
                if echo(rank, line):
                    print(f"  [{label} r{rank}] {line.rstrip()}", flush=True)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        threads.append(t)
    deadline = time.monotonic() + timeout_s
    failed = None
    for rank, p in enumerate(procs):
        left = max(1.0, deadline - time.monotonic())
        try:
            rc = p.wait(timeout=left)
        except subprocess.TimeoutExpired:
            failed = f"rank {rank} did not finish within {timeout_s:.0f} s"
            break
        if rc != 0:
            failed = f"rank {rank} exited with {rc}"
            break
    if failed:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for t in threads:
        t.join(timeout=5)
    if failed:
        tail = "".join(f"[rank {rank}] " + "".join(lg[-15:]) for rank, lg in enumerate(logs))
        raise RuntimeError(f"{label}: {failed}\n--- last output ---\n{tail}")
    return ["".join(lg) for lg in logs]


def update_section(key: str, text: str, path: Path = RESULTS) -> None:
    """Replace the section between ``<!-- key:start -->`` and ``<!-- key:end -->`` (append if absent)."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    body = f"{start}\n{text.rstrip()}\n{end}\n"
    old = path.read_text(encoding="utf-8") if path.exists() else "# Two-link testbed results\n\n"
    if start in old and end in old:
        new = old[: old.index(start)] + body + old[old.index(end) + len(end) + 1:]
    else:
        new = old.rstrip() + "\n\n" + body
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new, encoding="utf-8")


def saved_runs(dirs: Iterable[Path]) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every run ``bench_peers.py --save-runs`` recorded under ``dirs`` (recursively): its path and its
    record; copies under a ``by/`` folder and hosts' own records left out, and a file that is not such a
    record (unreadable, or without its ``summary``) named on standard error and left out."""
    for d in dirs:
        for path in sorted(d.rglob("*.r*.json")):
            if "by" in path.relative_to(d).parts or ".host" in path.name:
                continue
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                print(f"{path}: skipped, not a readable JSON record ({e})", file=sys.stderr)
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("summary"), dict):
                print(f"{path}: skipped, no 'summary' object (not a bench_peers.py --save-runs record)",
                      file=sys.stderr)
                continue
            yield path, doc


def report_section(text: str, key: str, path: Path, write: bool) -> int:
    """A report script's end: print its section and, where ``write``, put it in ``path`` under ``key``."""
    print(text)
    if write:
        update_section(key, text, path)
    return 0


def command_line() -> str:
    return "sudo .venv/bin/python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])
                                                                             .resolve().relative_to(ROOT)),
                                                                         *sys.argv[1:]])


def recorded_command(run_dir: Path, default: str) -> str:
    """The command that made the saved runs in ``run_dir`` (its command.txt), else ``default``."""
    cmd = run_dir / "command.txt"
    return cmd.read_text(encoding="utf-8").strip() if cmd.exists() else default


def runs_dir(path: Path, command: str) -> Path:
    """``path`` created, with ``command`` recorded in its command.txt (what :func:`recorded_command` reads)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "command.txt").write_text(command + "\n", encoding="utf-8")
    return path


def machine() -> str:
    import os
    import platform

    import torch

    return f"{platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, torch {torch.__version__}"


def measure_rate(rate: float, sizes: str, iters: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, Testbed(hosts=2, links=2, rate_mbit=rate) as tb:
        out = Path(tmp) / "links.json"
        print(f"[bench_links] {rate:g} Mbit/s: testbed {tb.base} up; measuring", flush=True)
        run_ranks(tb, [sys.executable, "-m", "deft.profiler.links", "--sizes", sizes, "--iters", str(iters),
                       "--warmup", "2", "--concurrent-sizes", "4194304", "--out", str(out)],
                  timeout_s=600, label=f"{rate:g}M")
        return json.loads(out.read_text())


def report(results: dict[float, dict[str, Any]], sizes: list[int]) -> str:
    lines = ["## Links: all-reduce cost per link, alone and both at once (`benchmarks/bench_links.py`)", "",
             f"Command: `{command_line()}`  ", f"Machine: {machine()}; 2 ranks, one per host (network "
             "namespace), gloo on CPU; each NIC shaped by `tc tbf`. Time = max over ranks of each rank's "
             "median over the iterations.", "",
             "| rate (Mbit/s) | link | NIC | alpha (us) | beta (ns/B) | fitted bandwidth (Mbit/s) | r2 | "
             "relative rmse | 4 MB alone (ms) | 4 MB, both links at once: this link (ms) | both done (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    four = 4 * 1024 * 1024
    for rate, doc in results.items():
        conc = doc.get("concurrent", {})
        both = conc.get("all", [{}])[0].get("seconds")
        for name, lk in doc["links"].items():
            f = lk["fit"]
            alone = next((s["seconds"] for s in lk["samples"] if s["nbytes"] == four), None)
            mine = conc.get("per_link", {}).get(name, [{}])[0].get("seconds")
            bw = 8 / f["beta_s_per_byte"] / 1e6 if f["beta_s_per_byte"] > 0 else float("inf")
            lines.append(f"| {rate:g} | {name} | {lk['ifname']} | {f['alpha_s'] * 1e6:.0f} | "
                         f"{f['beta_s_per_byte'] * 1e9:.3f} | {bw:.0f} | {f['r2']:.4f} | {f['rel_rmse']:.1%} | "
                         f"{_ms(alone)} | {_ms(mine)} | {_ms(both)} |")
    lines += ["", "Samples (ms, max over ranks of the median):", "",
              "| rate | link | " + " | ".join(_size(s) for s in sizes) + " |",
              "|---|---|" + "---|" * len(sizes)]
    for rate, doc in results.items():
        for name, lk in doc["links"].items():
            by = {s["nbytes"]: s["seconds"] for s in lk["samples"]}
            lines.append(f"| {rate:g} | {name} | " + " | ".join(_ms(by.get(s)) for s in sizes) + " |")
    lines += ["", "Expected from the rate alone: a 2-rank ring all-reduce sends the whole buffer once per "
              "rank, so 4 MB takes 4 MiB x 8 / rate: 134 ms at 250 Mbit/s, 34 ms at 1 Gbit/s "
              "(docs/DESIGN.md section 6 measured 34 ms alone and 35 ms both at once at 1 Gbit/s)."]
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _size(b: int) -> str:
    return f"{b // 1024} KiB" if b < 1024 * 1024 else f"{b // (1024 * 1024)} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="250,1000", help="comma-separated link rates in Mbit/s")
    ap.add_argument("--sizes", default=",".join(str(2**k) for k in (14, 16, 18, 20, 22, 24)))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-write", action="store_true", help="print the report, do not touch results/testbed.md")
    args = ap.parse_args()
    handle_signals()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    for rate in (float(r) for r in args.rates.split(",")):
        results[rate] = measure_rate(rate, args.sizes, args.iters)
    text = report(results, sizes)
    print(text)
    if not args.no_write:
        update_section("links", text)
        print(f"[bench_links] wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
