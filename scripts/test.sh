#!/usr/bin/env bash
# Install into .venv, lint, type-check, and run the test suite. Used by CI as is (no arguments: everything).
#
#   bash scripts/test.sh                      the whole suite, as CI runs it: the unit tests and the
#                                             multi-process tests whose outcome holds under load two at a
#                                             time, then the testbed, GPU and serial tests one at a time
#   bash scripts/test.sh --fast               the fast lane, for development: lint, mypy, the unit tests and
#                                             one end-to-end multi-process run (deft against torch DDP); leaves
#                                             out tests marked slow (they start processes or take seconds),
#                                             netns and cuda, keeps the one marked e2e_fast
#   bash scripts/test.sh tests/test_plan.py   any other arguments go to pytest (with or without --fast; in
#                                             both phases)
#
# The markers are registered in pyproject.toml ([tool.pytest.ini_options]).
set -euo pipefail
cd "$(dirname "$0")/.."
UNIT="not slow and not netns and not cuda"
FAST_LANE="($UNIT) or e2e_fast"
args=()
fast=0
for a in "$@"; do
  if [ "$a" = "--fast" ]; then fast=1; else args+=("$a"); fi
done
bash scripts/setup.sh
.venv/bin/ruff check deft tests benchmarks examples
.venv/bin/mypy deft
# pytest exits 5 when a selection holds no test (a file of unit tests only, in the second phase): not a failure.
run() { .venv/bin/python -m pytest "$@" || { rc=$?; [ "$rc" = 5 ] || exit "$rc"; }; }
# Tests whose outcome holds on a busy machine run two at a time (pytest-xdist, a file per worker: a module's
# fixture runs once): the unit tests and the multi-process runs that compare results, not times. The
# testbed's, the GPU's and those marked serial (deadlines, measured windows) run one at a time after them:
# their ranks and gloo threads take both cores, and their timing assumes nothing else runs.
ALONE="netns or cuda or serial"
if [ "$fast" = 1 ]; then
  run -q -ra -n 2 -m "$FAST_LANE" ${args[@]+"${args[@]}"}
else
  run -q -ra -n 2 --dist loadfile --durations=20 -m "not ($ALONE)" ${args[@]+"${args[@]}"}
  run -q -ra --durations=20 -m "$ALONE" ${args[@]+"${args[@]}"}
fi
