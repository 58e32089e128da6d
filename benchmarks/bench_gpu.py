"""torch DDP against deft on one GPU: NCCL at world size 1, and two ranks sharing the GPU over gloo.

    python benchmarks/bench_gpu.py [--epochs 6] [--schemes nccl1-torch,nccl1-deft,...] [--out DIR]

Every scheme trains the digits CNN of ``examples/train_cnn.py`` (4.4M parameters, batch 32 per rank,
SGD lr 0.02 momentum 0.9, the same seed and initial model) on ``cuda:0``, data and model on the
device, in fresh processes (one per rank, ``env://`` on loopback):

* ``nccl1-torch`` / ``nccl1-deft``: one rank, an NCCL process group; torch DDP against deft's default
  config. The all-reduce of a one-rank job moves nothing: this measures deft's own cost per iteration.
* ``gloo2-torch`` / ``gloo2-deft`` / ``gloo2-deft-2links``: two ranks on the one GPU, gloo on CUDA
  tensors over loopback (NCCL refuses two ranks on one device); deft with its default single link,
  and with a second gloo link.

An iteration is timed from its forward to the end of its ``step()`` with the device synchronized, so
the time is what the loop waits. Reported: the median iteration after the first ``--skip`` (deft's
warm-up, profile and planning happen there), the wall time to 93 % test accuracy counted from the
wrapper's construction (deft's warm-up and planning included, evaluation excluded) and the final
accuracy. Speedup = torch DDP's time / the scheme's time, within one transport. Writes ``gpu.md`` and
``gpu.json`` into ``--out``; the numbers go into ``benchmarks/results/gpu.md`` by hand with the
device named.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.93
TWO_GLOO_LINKS = [{"name": "primary", "backend": "gloo"}, {"name": "second", "backend": "gloo"}]

# name -> (world size, backend, wrapper, deft links or None for deft's default)
SCHEMES: dict[str, tuple[int, str, str, list[dict[str, str]] | None]] = {
    "nccl1-torch": (1, "nccl", "torch", None),
    "nccl1-deft": (1, "nccl", "deft", None),
    "gloo2-torch": (2, "gloo", "torch", None),
    "gloo2-deft": (2, "gloo", "deft", None),
    "gloo2-deft-2links": (2, "gloo", "deft", TWO_GLOO_LINKS),
}


def worker(name: str, epochs: int, skip: int, out: Path, device: str) -> None:
    """One rank of one scheme (``RANK``/``WORLD_SIZE`` from the environment); rank 0 writes the record."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples"))
    from models import DigitsCNN
    from train_cnn import load_digits_split

    world, backend, wrapper, links = SCHEMES[name]
    rank = int(os.environ["RANK"])
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    ids = [dev.index or 0] if on_gpu else None
    dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = load_digits_split(0)
    x_train, y_train, x_test, y_test = (t.to(dev) for t in (x_train, y_train, x_test, y_test))
    model = DigitsCNN(width=64, hidden=832).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    sync()
    start = time.perf_counter()
    if wrapper == "torch":
        ddp: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    else:
        import deft

        config = {"links": links} if links is not None else None
        ddp = deft.DistributedDataParallel(model, device_ids=ids, optimizer=opt, config=config)
    torch.manual_seed(1000 + rank)
    batch = 32
    per_epoch = len(y_train) // (batch * world)
    iters: list[float] = []
    evals: list[dict[str, float]] = []
    eval_s = 0.0
    for epoch in range(epochs):
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch)).to(dev)
        mine = order[rank::world]
        model.train()
        for i in range(per_epoch):
            idx = mine[i * batch:(i + 1) * batch]
            t0 = time.perf_counter()
            F.cross_entropy(ddp(x_train[idx]), y_train[idx]).backward()
            opt.step()
            opt.zero_grad()
            sync()
            iters.append(time.perf_counter() - t0)
        t_eval = time.perf_counter()
        if wrapper == "deft":
            ddp.flush()  # type: ignore[operator]  # deferred updates land before the model is judged
        model.eval()
        with torch.no_grad():
            acc = float((model(x_test).argmax(1) == y_test).float().mean())
        sync()
        eval_s += time.perf_counter() - t_eval
        evals.append({"epoch": epoch + 1, "time_s": time.perf_counter() - start - eval_s, "acc": acc})
    if rank == 0:
        reached = [e["time_s"] for e in evals if e["acc"] >= TARGET]
        record: dict[str, Any] = {
            "scheme": name, "world": world, "backend": backend, "iters": len(iters),
            "median_ms": 1e3 * statistics.median(iters[skip:]), "first_ms": 1e3 * sum(iters[:skip]),
            "to_target_s": reached[0] if reached else None, "final_acc": evals[-1]["acc"], "evals": evals,
            "device": torch.cuda.get_device_name(dev) if on_gpu else "cpu", "torch": torch.__version__,
        }
        if wrapper == "deft":
            record["plan"] = dict(ddp.plan_info)  # type: ignore[union-attr]
        out.write_text(json.dumps(record, default=str))
    sys.stdout.flush()
    os._exit(0)  # torch's gloo can abort at teardown; the record is written


def run_scheme(name: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    world = SCHEMES[name][0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = out_dir / f"{name}.json"
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", name, "--epochs", str(args.epochs),
                                       "--skip", str(args.skip), "--record", str(out),
                                       "--device", args.device], env=env))
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes) or not out.exists():
        return {"scheme": name, "error": f"exit codes {codes}"}
    return dict(json.loads(out.read_text()))


def table(records: list[dict[str, Any]]) -> str:
    base = {r["backend"]: r for r in records if r["scheme"].endswith("-torch") and "error" not in r}
    lines = ["| scheme | iters | median iteration (ms) | speedup | first iterations (ms) | 93 % at (s) | final acc |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['scheme']} | failed: {r['error']} | | | | | |")
            continue
        ref = base.get(r["backend"])
        speed = f"{ref['median_ms'] / r['median_ms']:.2f}x" if ref else "-"
        target = f"{r['to_target_s']:.2f}" if r["to_target_s"] is not None else "never"
        lines.append(f"| {r['scheme']} | {r['iters']} | {r['median_ms']:.2f} | {speed} | {r['first_ms']:.0f} | "
                     f"{target} | {r['final_acc']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--skip", type=int, default=20, help="iterations left out of the median")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--out", default="out/gpu")
    ap.add_argument("--device", default="cuda:0", help="cpu: a smoke run of the gloo schemes without a GPU")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.epochs, args.skip, Path(args.record), args.device)
    names = [n for n in args.schemes.split(",") if n]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        ap.error(f"--schemes: unknown {unknown}; expected names from {list(SCHEMES)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for name in names:
        t0 = time.perf_counter()
        records.append(run_scheme(name, args, out_dir))
        print(f"[bench_gpu] {name}: {time.perf_counter() - t0:.1f} s {json.dumps(records[-1], default=str)[:600]}",
              flush=True)
    text = table(records)
    print(text)
    (out_dir / "gpu.md").write_text(text + "\n")
    (out_dir / "gpu.json").write_text(json.dumps(records, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
