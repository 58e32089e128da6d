"""Regenerate the reference profiles of this folder: ``python examples/profiles/make_profiles.py``.

``vgg19.json`` is Table II of the DeFT paper (seeds/deft.txt); see README.md here for every choice.
``resnet101.json`` and ``gpt2.json`` are synthetic: bucket sizes from the models' parameter counts,
times spread so that their totals equal Table I of the paper.
"""

from __future__ import annotations

import sys
from pathlib import Path

from deft.profile import Bucket, BucketTimes, Link, Profile, fit_alpha_beta

HERE = Path(__file__).resolve().parent
GLOO_SLOWDOWN = 1.65  # the paper's mu: NCCL is 1.59-1.69x faster than gloo above 4M elements (Fig. 6)
CITE = "Meng and Sun, DeFT (seeds/deft.txt)"


def vgg19() -> Profile:
    """Table II, converted to our bucket order (our bucket 0 = the paper's bucket 6, nearest the output).

    Table II's unit is printed as ms but the numbers are microseconds (they sum to Table I's 37/93/258
    ms). Its bucket 1 communication reads 1968; we use 11968: the printed column total (257725) needs it,
    and 11968 us is what the bucket's 23.5 MB take at the bandwidth every other bucket shows.
    """
    # (paper bucket id, torchvision vgg19 parameters in DDP's backward-ready order, forward, backward, comm) us
    features = {  # conv layers of torchvision's vgg19: features.<i>, (in, out) channels, 3x3 kernels
        0: (3, 64), 2: (64, 64), 5: (64, 128), 7: (128, 128), 10: (128, 256), 12: (256, 256), 14: (256, 256),
        16: (256, 256), 19: (256, 512), 21: (512, 512), 23: (512, 512), 25: (512, 512), 28: (512, 512),
        30: (512, 512), 32: (512, 512), 34: (512, 512),
    }
    sizes: dict[str, int] = {}
    for i, (cin, cout) in features.items():
        sizes[f"features.{i}.weight"] = cin * cout * 9
        sizes[f"features.{i}.bias"] = cout
    for i, (fin, fout) in {0: (512 * 7 * 7, 4096), 3: (4096, 4096), 6: (4096, 1000)}.items():
        sizes[f"classifier.{i}.weight"] = fin * fout
        sizes[f"classifier.{i}.bias"] = fout

    def layer(name: str) -> list[str]:
        return [f"{name}.bias", f"{name}.weight"]  # reversed parameter order: bias is ready first

    buckets = [  # our id order; DDP buckets of 1 MiB (first) then 25 MiB over reversed parameters
        (6, layer("classifier.6"), 103, 162, 8651),
        (5, layer("classifier.3"), 326, 484, 31754),
        (4, layer("classifier.0"), 1899, 2319, 178643),
        (3, layer("features.34") + layer("features.32") + layer("features.30"), 4801, 4872, 15447),
        (2, layer("features.28") + layer("features.25") + layer("features.23"), 28799, 12786, 11262),
        (1, [p for i in (21, 19, 16, 14, 12, 10, 7, 5, 2, 0) for p in layer(f"features.{i}")], 1238, 72496, 11968),
    ]
    numel = [sum(sizes[p] for p in params) for _, params, *_ in buckets]
    nbytes = [4 * x for x in numel]
    comm = [c * 1e-6 for *_, c in buckets]
    fit = fit_alpha_beta(nbytes, comm, source="VGG-19, Table II")
    alpha, beta = fit.alpha, fit.beta
    links = (
        Link("nccl", "nccl", None, alpha, beta),
        Link("gloo", "gloo", None, alpha * GLOO_SLOWDOWN, beta * GLOO_SLOWDOWN),
    )
    return Profile(
        buckets=tuple(Bucket(i, tuple(params), n, b) for i, ((_, params, *_), n, b) in
                      enumerate(zip(buckets, numel, nbytes, strict=True))),
        times=tuple(BucketTimes(f * 1e-6, bw * 1e-6, {"nccl": c * 1e-6, "gloo": c * 1e-6 * GLOO_SLOWDOWN})
                    for _, _, f, bw, c in buckets),
        links=links, world_size=16, source="reference", model="vgg19",
        versions={"paper": "DeFT, Table II"},
        meta={
            "cite": CITE + ", Table II (VGG-19, 16 A100 GPUs, 2 nodes, 40 Gbit/s Ethernet)",
            "paper_bucket_of": [pb for pb, *_ in buckets],
            "units": "Table II prints ms; its numbers are microseconds (totals = Table I: 37, 93, 258 ms)",
            "correction": "paper bucket 1 communication printed 1968 us, used 11968 us (column total 257725)",
            "gloo": f"gloo times = {GLOO_SLOWDOWN} x nccl (the paper's mu), a second NIC",
            "sizes": "torchvision vgg19 parameters (143,667,240; Table VI: 143,652,544) in DDP buckets",
        },
    )


def _synthetic(model: str, layers: list[tuple[str, int, float]], totals_ms: tuple[float, float, float],
               note: str) -> Profile:
    """DDP 25 MiB buckets over ``layers`` (name, numel, relative compute weight), output first.

    Forward and backward times are split over buckets in proportion to the compute weights, and
    communication follows a linear alpha + beta * bytes model whose totals match Table I.
    """
    from deft.solver.baselines import ddp_buckets

    order = list(reversed(layers))  # backward-ready order
    groups = ddp_buckets([4 * n for _, n, _ in order])
    numel = [sum(order[i][1] for i in g) for g in groups]
    weight = [sum(order[i][2] for i in g) for g in groups]
    fwd_ms, bwd_ms, comm_ms = totals_ms
    alpha = 1.7e-3  # the start-up fitted on VGG-19's Table II (same cluster)
    beta = (comm_ms * 1e-3 - alpha * len(groups)) / (4 * sum(numel))
    wsum = sum(weight)
    buckets = tuple(Bucket(i, tuple(order[j][0] for j in g), numel[i], 4 * numel[i]) for i, g in enumerate(groups))
    times = tuple(
        BucketTimes(fwd_ms * 1e-3 * weight[i] / wsum, bwd_ms * 1e-3 * weight[i] / wsum,
                    {"nccl": alpha + beta * 4 * numel[i], "gloo": GLOO_SLOWDOWN * (alpha + beta * 4 * numel[i])})
        for i in range(len(groups)))
    return Profile(buckets=buckets, times=times,
                   links=(Link("nccl", "nccl", None, alpha, beta),
                          Link("gloo", "gloo", None, alpha * GLOO_SLOWDOWN, beta * GLOO_SLOWDOWN)),
                   world_size=16, source="synthetic", model=model, versions={"paper": "DeFT, Table I totals"},
                   meta={"cite": CITE + ", Table I (totals only)", "synthetic": note})


def resnet101() -> Profile:
    """Torchvision ResNet-101's parameters; compute weight = parameters (a crude but monotone proxy)."""
    layers: list[tuple[str, int, float]] = [("conv1", 9408 + 128, 1.0)]
    stages = [(64, 256, 3), (128, 512, 4), (256, 1024, 23), (512, 2048, 3)]
    cin = 64
    for s, (mid, out, blocks) in enumerate(stages, start=1):
        for k in range(blocks):
            n = cin * mid + mid * mid * 9 + mid * out + 2 * (2 * mid + out)
            if k == 0:
                n += cin * out + 2 * out  # downsample
            # Every block costs about the same FLOPs (channels double as resolution halves).
            layers.append((f"layer{s}.{k}", n, 1.0))
            cin = out
    layers.append(("fc", 2048 * 1000 + 1000, 0.05))
    return _synthetic("resnet101", layers, (59.0, 118.0, 242.0),
                      "ResNet-101 block sizes (44.5M parameters), equal compute per block, Table I totals")


def gpt2() -> Profile:
    """GPT-2 small's structure (12 blocks, d=768), 21128-token vocabulary: 102M parameters (Table VI: 81.9M)."""
    d, vocab, ctx = 768, 21128, 1024
    block = 12 * d * d + 13 * d
    layers = [("wte+wpe", vocab * d + ctx * d, 0.5)]
    layers += [(f"h.{i}", block, 1.0) for i in range(12)]
    layers.append(("ln_f", 2 * d, 0.0))
    return _synthetic("gpt2", layers, (169.0, 381.0, 546.4),
                      "GPT-2 small layer sizes with a 21128-token vocabulary, equal compute per block, Table I totals")


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else HERE
    for name, prof in (("vgg19", vgg19()), ("resnet101", resnet101()), ("gpt2", gpt2())):
        prof.save(out / f"{name}.json")
        print(f"{name}: {prof.n} buckets, forward {prof.forward_s * 1e3:.1f} ms, backward "
              f"{prof.backward_s * 1e3:.1f} ms, comm {prof.total_comm_s() * 1e3:.1f} ms, CR {prof.coverage_rate:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
