#!/usr/bin/env bash
# Set up .venv, lint and type-check (scripts/lint.sh: ruff + mypy) and run the test suite. Extra arguments go to pytest.
#   bash scripts/test.sh           the full suite (what CI runs)
#   bash scripts/test.sh --fast    the fast lane: -m "not vllm and not slow" (no vLLM engine, no real
#                                  SmolLM2 runs; a few minutes on 2 cores)
#   Tests run in NESTLING_TEST_WORKERS processes (default 2, pytest-xdist), whole files per process,
#   so a file's module fixtures are built once; NESTLING_TEST_WORKERS=0 runs everything in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=()
ARGS=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then FAST=(-m "not vllm and not slow"); else ARGS+=("$a"); fi
done
bash scripts/setup.sh
PYTHON=.venv/bin/python bash scripts/lint.sh
export NESTLING_CACHE=${NESTLING_CACHE:-$HOME/.cache/nestling}
WORKERS=${NESTLING_TEST_WORKERS:-2}
PAR=()
if [ "$WORKERS" != 0 ]; then PAR=(-n "$WORKERS" --dist loadfile); fi
set +e
.venv/bin/python -m pytest -q -ra --durations=25 "${PAR[@]}" "${FAST[@]}" "${ARGS[@]}"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: treating as failure"; exit 1; fi
exit $rc
