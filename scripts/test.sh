#!/usr/bin/env bash
# Install into .venv and run the whole test suite (lint first). Used by CI as is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check deft tests benchmarks examples
.venv/bin/mypy deft
.venv/bin/python -m pytest -q -ra "$@"
