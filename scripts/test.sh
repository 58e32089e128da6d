#!/usr/bin/env bash
# Install into .venv, lint, type-check, and run the test suite. Used by CI as is (no arguments: everything).
#
#   bash scripts/test.sh                      the whole suite, as CI runs it
#   bash scripts/test.sh --fast               the fast lane, for development: lint, mypy, the unit tests and
#                                             one end-to-end multi-process run (deft against torch DDP); leaves
#                                             out tests marked slow (they start processes or take seconds),
#                                             netns and cuda, keeps the one marked e2e_fast
#   bash scripts/test.sh tests/test_plan.py   any other arguments go to pytest (with or without --fast)
#
# The markers are registered in pyproject.toml ([tool.pytest.ini_options]).
set -euo pipefail
cd "$(dirname "$0")/.."
FAST_LANE="(not slow and not netns and not cuda) or e2e_fast"
args=()
fast=0
for a in "$@"; do
  if [ "$a" = "--fast" ]; then fast=1; else args+=("$a"); fi
done
bash scripts/setup.sh
.venv/bin/ruff check deft tests benchmarks examples
.venv/bin/mypy deft
if [ "$fast" = 1 ]; then
  .venv/bin/python -m pytest -q -ra -m "$FAST_LANE" ${args[@]+"${args[@]}"}
else
  .venv/bin/python -m pytest -q -ra --durations=20 ${args[@]+"${args[@]}"}
fi
