#!/usr/bin/env bash
# Set up .venv and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NESTLING_CACHE=${NESTLING_CACHE:-$HOME/.cache/nestling}
set +e
.venv/bin/python -m pytest -q -ra --durations=20 "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: treating as failure"; exit 1; fi
exit $rc
