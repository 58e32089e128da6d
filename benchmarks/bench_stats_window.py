"""What the preserver's statistics window costs a lag-free plan: one deft default run of
examples/train_cnn.py on the two-link testbed with a short ``recheck_every``, iterations inside the
window before each re-check (``t % recheck_every >= recheck_every - STATS_WINDOW``) against the others.

In the window every update is applied whole at the step (the statistics need the whole averaged
gradient), so a lag-free plan's forward overlap is lost there. Needs root (network namespaces)::

    .venv/bin/python benchmarks/bench_stats_window.py --recheck-every 64 --epochs 5

On this 2-core machine the gloo threads of both links and the model share the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench_links import ROOT, run_ranks

from deft.runtime.calendar import STATS_WINDOW
from deft.testbed import Testbed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recheck-every", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--rate", type=float, default=250.0, help="link rate in Mbit/s")
    ap.add_argument("--skip-iters", type=int, default=12, help="warm-up, planning and adaptation left out")
    args = ap.parse_args()
    if args.recheck_every <= STATS_WINDOW:
        ap.error(f"--recheck-every must exceed STATS_WINDOW ({STATS_WINDOW}), or every iteration is in the window")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory() as tmp, Testbed(hosts=2, links=2, rate_mbit=args.rate) as tb:
        out = Path(tmp) / "run.json"
        cfg = tb.write_config(Path(tmp) / "deft.toml", links=2, recheck_every=args.recheck_every)
        argv = [sys.executable, str(ROOT / "examples" / "train_cnn.py"), "--ddp", "deft", "--epochs",
                str(args.epochs), "--eval-every", "1000", "--seed", "0", "--json", str(out), "--no-progress"]
        run_ranks(tb, argv, timeout_s=900, label="stats-window", config=cfg, alone=False)
        doc = json.loads(out.read_text(encoding="utf-8"))
    it = [r["iter_s"] * 1e3 for r in doc["iters"]]
    every, first = args.recheck_every, args.skip_iters
    inside = [x for t, x in enumerate(it) if t >= first and t % every >= every - STATS_WINDOW]
    outside = [x for t, x in enumerate(it) if t >= first and t % every < every - STATS_WINDOW]
    rechecks = doc["summary"]["schedule"]["plan_info"].get("rechecks", [])
    print(f"STATS_WINDOW {STATS_WINDOW}, recheck_every {every}, {args.rate:g} Mbit/s x 2 links: median iteration "
          f"{statistics.median(inside):.0f} ms inside the window (n={len(inside)}), "
          f"{statistics.median(outside):.0f} ms outside (n={len(outside)}); mean of all "
          f"{statistics.mean(it[first:]):.0f} ms; re-checks: {[r.get('reason') for r in rechecks]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
