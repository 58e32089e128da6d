#!/usr/bin/env bash
# Install into .venv and run the demo: simulate every scheme on the VGG-19 reference profile.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
.venv/bin/deft simulate examples/profiles/vgg19.json --png out/vgg19_timeline.png
