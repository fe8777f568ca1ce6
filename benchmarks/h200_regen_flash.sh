#!/usr/bin/env bash
# Issue #13: the hf engine's decode loop with flash decode attention (each slot reads its own keys)
# against the masked matmul (every slot up to the longest busy position), random weights, every answer
# to its cap, prompts of random length (so slots sit at different positions), on an H200. One step on the
# GPU host, no staging (the code alone):
#   bash benchmarks/h200_regen_flash.sh
# Results: $OUT/regen_{smollm2,llama8b}_{matmul,auto}.json, the log $OUT/h200_regen_flash.log, a table last.
# Smoke test on a CPU (flash there runs the masked matmul over its layout):
#   OUT=/tmp/rf DEVICE=cpu SMOKE="--layers 2 --hidden 128 --requests 8 --max-new-tokens 8 --slots 4" bash benchmarks/h200_regen_flash.sh
set -euo pipefail
: "${OUT:?OUT (the folder whose files come back) is not set}"
DEVICE=${DEVICE:-cuda} PY=${PY:-python3} SMOKE=${SMOKE:-}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
run() {  # SHAPE ATTENTION ARGS...: one benchmark run, its JSON in $OUT
  local shape=$1 att=$2; shift 2
  echo "[regen-flash] $shape $att $*"
  # shellcheck disable=SC2086
  $PY benchmarks/regenerate_gpu.py --shape "$shape" --device "$DEVICE" --attention "$att" "$@" $SMOKE \
    --json "$OUT/regen_${shape}_${att}.json" 2>&1 | grep -a "flash decode\|fast decode\|^mode\|^shape:\|^stats\|Error" || true
}
{
  for att in matmul auto; do  # auto: flash where it runs, after its first-step check (logged)
    run smollm2 $att --requests 2048 --max-new-tokens 384 --prompt-min 64 --prompt-max 1024
    run llama8b $att --requests 1024 --max-new-tokens 256 --prompt-min 64 --prompt-max 1024
  done
} 2>&1 | tee "$OUT/h200_regen_flash.log"
$PY benchmarks/regenerate_gpu.py --table "$OUT"/regen_{smollm2,llama8b}_{matmul,auto}.json
