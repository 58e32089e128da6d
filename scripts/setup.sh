#!/usr/bin/env bash
# Create .venv (if missing) and install deft with its test tools. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# The installed requirements' stamp: pip runs again only when pyproject.toml or this script changed
# (deft is installed editable, so its code needs no re-install), which keeps the fast lane fast.
STAMP=.venv/.deft-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import torch, ortools, deft" 2>/dev/null; then
  # torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import torch, ortools, deft" || { echo "setup failed: deft or its dependencies do not import" >&2; exit 1; }
  echo "$want" > "$STAMP"
fi
# The netns tests and `deft testbed` need iproute2 (ip, tc), which minimal images (Debian slim, most
# containers) do not ship. As root we install it; otherwise those tests skip and say why.
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing iproute2 (ip, tc) for the network-namespace testbed" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; } \
      || echo "setup: could not install iproute2; the netns tests will skip" >&2
  else
    echo "setup: iproute2 (ip, tc) not found; the netns tests will skip (install iproute2 as root to run them)" >&2
  fi
fi
