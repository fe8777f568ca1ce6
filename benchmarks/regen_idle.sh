#!/usr/bin/env bash
# What idle slots cost the hf regeneration engine's flash decode loop.
usage() {
  cat <<'HELP'
usage: bash benchmarks/regen_idle.sh --out DIR [--device cuda|cpu] [--requests N] [--max-new-tokens N] [--smoke]

Answers of random length (uniform 1..--max-new-tokens, as real answers end at different steps) leave
slots idle until a refill or the end of a wave. Each workload runs as the loop does now (an idle slot
reads one key; prompts prefilled packed) and as it did before (`--read-idle --padded-prefill`: an idle
slot reads its last occupant's keys; right-padded prefill): one wave (every slot filled once with a long
history) and refills (four slots' worth of requests). SmolLM2 shape, random weights, flash attention.
Defaults: --requests 1024, --max-new-tokens 384.
Time: about 4 minutes on one H100 or H200; --smoke (a 2-layer, 128-wide model, 8 requests of 8 tokens)
runs the same commands on a CPU in a minute.
Result: DIR/idle_{wave,refill}_{before,now}.json, the log DIR/regen_idle.log, a table last. Measured on
one H200: a step 20-25% cheaper where half the slots idle (docs/results/speed.md). PYTHON names the
interpreter (default: python3).
HELP
}
set -euo pipefail
OUT="" DEVICE=cuda REQ=1024 NEW=384 SMOKE=""
while [ $# -gt 0 ]; do
  case "$1" in
  -h | --help) usage; exit 0 ;;
  --out) OUT=${2:?--out needs a folder}; shift 2 ;;
  --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
  --requests) REQ=${2:?--requests needs a number}; shift 2 ;;
  --max-new-tokens) NEW=${2:?--max-new-tokens needs a number}; shift 2 ;;
  --smoke) SMOKE="--layers 2 --hidden 128 --slots 4" REQ=8 NEW=8; shift ;;
  *) echo "[regen-idle] unknown argument $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -n "$OUT" ] || { echo "[regen-idle] --out DIR is required (--help)" >&2; exit 2; }
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
run() {  # NAME WHEN ARGS...: one benchmark run, its JSON in $OUT
  local name=$1 when=$2; shift 2
  echo "[regen-idle] $name $when $*"
  # shellcheck disable=SC2086  # SMOKE is a list of flags
  $PY "$ROOT/benchmarks/regenerate_gpu.py" --shape smollm2 --device "$DEVICE" --attention flash --max-new-tokens "$NEW" \
    --answer-min 1 "$@" $SMOKE --json "$OUT/idle_${name}_${when}.json" 2>&1 | grep -a "^shape:\|^stats\|Error" || true
}
{
  for when in before now; do
    flag=""; [ $when = before ] && flag="--read-idle --padded-prefill"
    # one wave: every slot filled once with a long history, then drained (a ShareGPT wave's shape)
    # shellcheck disable=SC2086  # flag is a list of flags
    run wave $when --requests $((REQ / 2)) --slots $((REQ / 2)) --prompt-min 1024 --prompt-max 2048 $flag
    # four slots' worth of requests: refills keep slots busy until the queue empties
    # shellcheck disable=SC2086
    run refill $when --requests $((4 * REQ)) --prompt-min 64 --prompt-max 2048 $flag
  done
} 2>&1 | tee "$OUT/regen_idle.log"
$PY "$ROOT/benchmarks/regenerate_gpu.py" --table "$OUT"/idle_{wave,refill}_{before,now}.json
