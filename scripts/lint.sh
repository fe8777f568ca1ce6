#!/usr/bin/env bash
# Lint and type-check (configured in pyproject.toml: [tool.ruff], [tool.mypy]); scripts/test.sh runs it before pytest.
#   PYTHON=/path/to/python bash scripts/lint.sh   to use another environment than .venv
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
echo "[lint] ruff check src tests benchmarks"
"$PY" -m ruff check src tests benchmarks
echo "[lint] ruff format --check src tests benchmarks  (fix: ruff format src tests benchmarks)"
"$PY" -m ruff format --check src tests benchmarks
echo "[lint] mypy src/nestling"
"$PY" -m mypy src/nestling
