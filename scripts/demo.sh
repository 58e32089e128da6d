#!/usr/bin/env bash
# The demo, after installing into .venv (scripts/setup.sh).
#
# As root, with iproute2 (scripts/setup.sh installs it): a real run on the two-link testbed (two network
# namespaces joined by two tc-shaped 250 Mbit/s links, one rank in each): torch DDP, then deft, one
# epoch each of examples/train_cnn.py with a progress bar each; then the table (iteration time, accuracy,
# updates) and out/deft_timeline.png, the schedule deft actually ran, simulated on the profile it
# measured, under torch DDP on the same profile. About 2 minutes on a 2-core machine.
#
# Otherwise (or if the testbed cannot be built): the simulation of every scheduling scheme on the
# VGG-19 reference profile of the paper, with out/vgg19_timeline.png, and one line saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out

simulate() {
  echo "demo: $1; showing the simulation of the paper's VGG-19 profile instead" >&2
  .venv/bin/deft simulate examples/profiles/vgg19.json --png out/vgg19_timeline.png
}

if [ "$(id -u)" != 0 ]; then
  simulate "not root (the testbed creates network namespaces and tc qdiscs; run as root for the real run)"
elif ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  simulate "iproute2 (ip, tc) is missing, so the testbed cannot be built"
else
  echo "demo: torch DDP and deft on the two-link testbed (2 hosts x 2 links at 250 Mbit/s), one epoch each" >&2
  if ! .venv/bin/python benchmarks/bench_peers.py --rates 250 --epochs 1 --schemes torch,deft --live \
      --no-write --eval-every 11 --skip-iters 10 --timeline out/deft_timeline.png --note "scripts/demo.sh"; then
    simulate "the testbed run failed (see above)"
  fi
fi
