#!/usr/bin/env bash
# The hf regeneration engine's decode loop with flash decode attention (each slot reads its own keys)
# against the masked matmul (every slot up to the longest busy position).
usage() {
  cat <<'HELP'
usage: bash benchmarks/regen_flash.sh --out DIR [--device cuda|cpu] [--smoke]

Random weights in SmolLM2-135M's and Llama-3-8B's shapes, every answer run to its cap, prompts of random
length (so slots sit at different positions), once with `--attention matmul` and once with `auto`
(flash where it runs, after its first-step check). Runs benchmarks/regenerate_gpu.py four times.
Time: about 5 minutes on one H100 or H200; --smoke (a 2-layer, 128-wide model, 8 requests) runs the
same commands on a CPU in a minute.
Result: DIR/regen_{smollm2,llama8b}_{matmul,auto}.json, the log DIR/regen_flash.log, a table last.
Measured on one H200: SmolLM2 shape 52.6k output tok/s with flash against 42.9k with the matmul
(docs/results/speed.md). PYTHON names the interpreter (default: python3).
HELP
}
set -euo pipefail
OUT="" DEVICE=cuda SMOKE=""
while [ $# -gt 0 ]; do
  case "$1" in
  -h | --help) usage; exit 0 ;;
  --out) OUT=${2:?--out needs a folder}; shift 2 ;;
  --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
  --smoke) SMOKE="--layers 2 --hidden 128 --requests 8 --max-new-tokens 8 --slots 4"; shift ;;
  *) echo "[regen-flash] unknown argument $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -n "$OUT" ] || { echo "[regen-flash] --out DIR is required (--help)" >&2; exit 2; }
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
run() {  # SHAPE ATTENTION ARGS...: one benchmark run, its JSON in $OUT
  local shape=$1 att=$2; shift 2
  echo "[regen-flash] $shape $att $*"
  # shellcheck disable=SC2086  # SMOKE is a list of flags
  $PY "$ROOT/benchmarks/regenerate_gpu.py" --shape "$shape" --device "$DEVICE" --attention "$att" "$@" $SMOKE \
    --json "$OUT/regen_${shape}_${att}.json" 2>&1 | grep -a "flash decode\|fast decode\|^mode\|^shape:\|^stats\|Error" || true
}
{
  for att in matmul auto; do  # auto: flash where it runs, after its first-step check (logged)
    run smollm2 $att --requests 2048 --max-new-tokens 384 --prompt-min 64 --prompt-max 1024
    run llama8b $att --requests 1024 --max-new-tokens 256 --prompt-min 64 --prompt-max 1024
  done
} 2>&1 | tee "$OUT/regen_flash.log"
$PY "$ROOT/benchmarks/regenerate_gpu.py" --table "$OUT"/regen_{smollm2,llama8b}_{matmul,auto}.json
