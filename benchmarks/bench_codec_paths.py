"""What each codec's collectives take on the testbed, against the price the plan gives them.

    python benchmarks/bench_codec_paths.py [--layouts 2x2,4x1] [--rate 50] [--repeats 5] [--note TEXT]

The plan prices a bucket's send on a link as ``alpha + beta * wire`` (the link's fit from the profile,
``wire`` from :func:`deft.runtime.codecs.wire.wire_nbytes`: the bytes of the link's own all-reduce that
costs what the codec's collectives cost, with :func:`~deft.runtime.codecs.wire.flat_path_factor` where the
links all-reduce hierarchically and a hook's collectives run on the flat group) plus the codec's compute
timed alone. This measures each part on the testbed, one link at ``--rate`` Mbit/s, ``H`` hosts of ``M``
ranks (torchrun's multi-node launch in each host's namespace), for buckets of ``--sizes`` float32
elements:

* ``fp32``: the link's own all-reduce (``CommLink.all_reduce``: hierarchical at ``M > 1``); ``alpha`` and
  ``beta`` are fitted on these (least squares over the sizes), as the profile fits the link;
* ``fp16``, ``int8``: torch's ``fp16_compress_hook`` and deft's int8 hook, as the executor launches them
  (on the link's flat group), each also timed on a one-rank group (its compute alone, as the profile
  times a codec).

Each send is timed from its launch to its future's completion, one at a time (a barrier on the default
group between them), the slowest rank's time; the median of ``--repeats``. Reported per layout, size and
codec: measured, priced (``alpha + beta * wire`` and the compute alone) and their ratio. The machine's 2
cores are shared by every rank and the links' gloo threads. Writes ``benchmarks/results/codec_paths.md``
(``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_seeds import free_port, write_fragment
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "codec_paths.md"
#: The hand-written part of the results file, kept when the tables are written again.
READING = "### Reading the codecs' prices (written by hand)"
CODECS = ("fp32", "fp16", "int8")


def _time(launch: Any, repeats: int) -> list[float]:
    """Seconds from each launch to its completion (a Work's or a future's ``wait``), the slowest rank's,
    ``repeats`` times after one untimed send."""
    out = []
    for i in range(repeats + 1):
        dist.barrier()
        t = time.perf_counter()
        launch().wait()
        took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i:
            out.append(float(took.item()))
    return out


def _row(n: int, link: Any, solo: dist.ProcessGroup, hooks: dict[str, Any], hosts: tuple[int, int] | None,
         repeats: int) -> dict[str, Any]:
    """One size's times: the link's own all-reduce, and each hook on the link's flat group and alone."""
    from deft.runtime.codecs.hooks import HookBucket
    from deft.runtime.codecs.wire import wire_nbytes

    x = torch.randn(n, generator=torch.Generator().manual_seed(n + dist.get_rank()))

    def bucket() -> HookBucket:
        buf = x.clone()
        return HookBucket(0, buf, [buf], [buf], True)

    row: dict[str, Any] = {"n": n, "fp32": statistics.median(_time(lambda: link.launch(x.clone()), repeats)),
                           "wire": {"fp32": 4 * n}}
    for name, hook in hooks.items():
        row[name] = statistics.median(_time(lambda h=hook: h.launch(link.group, bucket()), repeats))
        row[name + "_alone"] = statistics.median(_time(lambda h=hook: h.launch(solo, bucket()), repeats))
        row["wire"][name] = wire_nbytes(hook, [(n,)], 4, True, hosts)
    return row


def worker(out_dir: Path, sizes: list[int], repeats: int) -> None:
    """One rank (under torchrun): time every codec's send of every size on the config's primary link."""
    from deft.config import DeftConfig
    from deft.runtime.codecs import int8
    from deft.runtime.codecs.hooks import CommHook
    from deft.runtime.links import make_links, make_solo_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = DeftConfig.load(os.environ["DEFT_CONFIG"])
    link = next(iter(make_links(config, cuda=False, ranks=None).values()))
    solo = make_solo_group("gloo", config.timeout_s, None)
    hosts = None if link.hierarchy is None else (link.hierarchy.groups.layout.hosts,
                                                 link.hierarchy.groups.layout.per_host)
    hooks = {"fp16": CommHook(None, default_hooks.fp16_compress_hook, "fp16"),
             "int8": CommHook(int8.Int8State(), int8.int8_compress_hook, "int8")}
    rows = [_row(n, link, solo, hooks, hosts, repeats) for n in sizes]
    if dist.get_rank() == 0:
        (out_dir / "rows.json").write_text(json.dumps({"hosts": hosts, "world": dist.get_world_size(),
                                                       "rows": rows}), encoding="utf-8")
    dist.barrier()
    os._exit(0)  # gloo can abort at teardown (torch 2.13)


def run_layout(hosts: int, per_host: int, rate: float, sizes: list[int], repeats: int) -> dict[str, Any]:
    """Every row of one layout, from rank 0's file."""
    from deft.testbed import Testbed

    with tempfile.TemporaryDirectory() as tmp, Testbed(hosts=hosts, links=1, rate_mbit=rate, prefix="codecp") as tb:
        out = Path(tmp)
        out.chmod(0o777)
        config = tb.write_config(timeout_s=120)
        port = free_port()
        procs = []
        for h in range(hosts):
            env = tb.env_for(h, rank=h * per_host, world=hosts * per_host, port=port, config=config)
            links = {k: env[k] for k in ("GLOO_SOCKET_IFNAME", "DEFT_CONFIG", "OMP_NUM_THREADS")}
            argv = [*tb.torchrun_argv(h, per_host, port), str(Path(__file__).resolve()), "--worker", str(out),
                    "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)]
            procs.append(tb.popen(h, argv, env=links, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
        errs = [p.communicate(timeout=1800)[1] for p in procs]
        if not (out / "rows.json").exists():
            raise SystemExit("bench_codec_paths.py: no result from the ranks:\n" + "\n".join(e[-3000:] for e in errs))
        return json.loads((out / "rows.json").read_text(encoding="utf-8"))


def fit(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """``alpha`` (s) and ``beta`` (s/byte) of the link's own all-reduce, least squares over the sizes."""
    xs, ys = [r["wire"]["fp32"] for r in rows], [r["fp32"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - beta * mx), beta


def table(layout: str, got: dict[str, Any]) -> list[str]:
    rows = got["rows"]
    alpha, beta = fit(rows)
    path = f"hierarchical ({got['hosts'][0]} hosts x {got['hosts'][1]})" if got["hosts"] else "flat"
    lines = [f"#### {layout}: {got['world']} ranks, the link's all-reduce {path}; alpha {alpha * 1e3:.2f} ms, "
             f"{8 / beta / 1e6 if beta > 0 else float('inf'):.1f} Mbit/s effective", "",
             "| elements | codec | wire bytes (priced) | measured (ms) | compute alone (ms) | priced (ms) "
             "| measured / priced |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for c in CODECS:
            alone = r.get(c + "_alone", 0.0)
            priced = alpha + beta * r["wire"][c] + alone
            lines.append(f"| {r['n']} | {c} | {r['wire'][c]} | {r[c] * 1e3:.1f} | {alone * 1e3:.1f} | "
                         f"{priced * 1e3:.1f} | {r[c] / priced:.2f} |")
    return [*lines, ""]


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``--layouts``: ``HxM`` items, H >= 2 hosts of M >= 1 ranks, comma-separated."""
    out = []
    for item in text.split(","):
        h, sep, m = item.strip().partition("x")
        if not (sep and h.isdigit() and m.isdigit() and int(h) >= 2 and int(m) >= 1):
            raise SystemExit(f"bench_codec_paths.py: --layouts: {item!r} is not HxM with H >= 2 hosts and M >= 1 "
                             "ranks per host (e.g. 2x2)")
        out.append((int(h), int(m)))
    return out


def parse_sizes(text: str) -> list[int]:
    """``--sizes``: two or more different positive element counts (the fit needs two)."""
    try:
        sizes = [int(v) for v in text.split(",")]
    except ValueError:
        sizes = []
    if len(set(sizes)) < 2 or min(sizes) < 1:
        raise SystemExit(f"bench_codec_paths.py: --sizes: {text!r}: expected two or more different positive "
                         "element counts, comma-separated (the link's fit needs two)")
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="2x2,4x1", help="HxM: H hosts of M ranks, comma-separated")
    ap.add_argument("--rate", type=float, default=50.0, help="the link's rate, Mbit/s")
    ap.add_argument("--sizes", default="65536,262144,1048576", help="bucket sizes, float32 elements")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--note", default="", help="a line on the machine's state, for the results")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = parse_sizes(a.sizes)
    if a.worker is not None:
        worker(a.worker, sizes, a.repeats)
        return
    lines = ["## What each codec's collectives take, against their price (`benchmarks/bench_codec_paths.py`)", "",
             f"Command: `{shlex.join(['benchmarks/bench_codec_paths.py', *sys.argv[1:]])}`  ",
             f"One link at {a.rate:g} Mbit/s; the machine's 2 cores shared by every rank and the link's gloo threads. "
             "Priced: the link's fit on its own all-reduce (fp32 rows) times the codec's wire bytes, plus its "
             f"compute alone. {a.note}", ""]
    for hosts, per_host in parse_layouts(a.layouts):
        lines += table(f"{hosts}x{per_host}", run_layout(hosts, per_host, a.rate, sizes, a.repeats))
    text = "\n".join(lines)
    print(text)
    if not a.no_write:
        write_fragment(text, RESULTS, READING)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
