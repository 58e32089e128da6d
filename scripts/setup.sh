#!/usr/bin/env bash
# Create .venv (if missing) and install deft with its test tools. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c "import torch, ortools, deft" || { echo "setup failed: deft or its dependencies do not import" >&2; exit 1; }
