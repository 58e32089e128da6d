"""Reference profiles shared by the solver tests: VGG-19 from the DeFT paper's Table II.

Paper bucket 1 is the input side; our bucket 0 is the first ready in backward (output side), paper
bucket 6. Table II prints ms but its numbers are microseconds: forward and backward sum to Table I's
37 and 93 ms. Communication is kept exactly as printed (bucket 1: 1968 us, a column total of 248 ms),
with bucket sizes as rounded parameter counts; ``examples/profiles/vgg19.json`` (:func:`example_profile`)
is the curated variant instead: torchvision's exact sizes, bucket 1 corrected to 11968 us, fitted links.
"""

from __future__ import annotations

from pathlib import Path

from deft.profile import Bucket, BucketTimes, Link, Profile

US = 1e-6
VGG_FWD_US = (103, 326, 1899, 4801, 28799, 1238)
VGG_BWD_US = (162, 484, 2319, 4872, 12786, 72496)
VGG_COMM_US = (8651, 31754, 178643, 15447, 11262, 1968)
VGG_NUMEL = (4_097_000, 16_781_312, 102_764_544, 7_079_424, 7_079_424, 5_865_536)
GLOO_SLOWDOWN = 1.65  # the paper's mu: NCCL over gloo
EXAMPLE_PROFILES = Path(__file__).resolve().parents[1] / "examples" / "profiles"


def vgg19(two_links: bool = False, alpha_s: float = 0.0) -> Profile:
    """Table II on one ``nccl`` link (fitted ``alpha_s``, ``beta = 0``), plus a ``gloo`` link with
    every time ``GLOO_SLOWDOWN`` times longer (no fitted model) when ``two_links``."""
    links = [Link("nccl", "nccl", None, alpha_s, 0.0)] + ([Link("gloo", "gloo")] if two_links else [])
    buckets = tuple(Bucket(i, (f"vgg.b{6 - i}",), VGG_NUMEL[i], 4 * VGG_NUMEL[i]) for i in range(6))
    times = []
    for i in range(6):
        comm = {"nccl": VGG_COMM_US[i] * US}
        if two_links:
            comm["gloo"] = VGG_COMM_US[i] * US * GLOO_SLOWDOWN
        times.append(BucketTimes(VGG_FWD_US[i] * US, VGG_BWD_US[i] * US, comm))
    return Profile(buckets, tuple(times), tuple(links), 16, "reference", model="vgg19")


def example_profile(name: str) -> Profile:
    """One of the reference profiles in ``examples/profiles`` (``vgg19``, ``resnet101``, ``gpt2``)."""
    return Profile.load(EXAMPLE_PROFILES / f"{name}.json")
