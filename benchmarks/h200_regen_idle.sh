#!/usr/bin/env bash
# Issue #13: what idle slots cost the flash decode loop. Answers of random length (uniform 1..384, as
# real answers end at different steps) leave slots idle until a refill or the end of a wave; earlier
# an idle slot still read its last occupant's keys every step (`--read-idle` restores that),
# now it reads one; and prompts are prefilled packed instead of in right-padded batches
# (`--padded-prefill` restores those). SmolLM2 shape, random weights, on an H200; one step on the GPU
# host:
#   bash benchmarks/h200_regen_idle.sh
# Results: $OUT/idle_{wave,refill}_{before,now}.json, the log, a table last.
# CPU smoke: OUT=/tmp/ri DEVICE=cpu SMOKE="--layers 2 --hidden 128 --slots 4" REQ=8 NEW=8 bash benchmarks/h200_regen_idle.sh
set -euo pipefail
: "${OUT:?OUT (the folder whose files come back) is not set}"
DEVICE=${DEVICE:-cuda} PY=${PY:-python3} SMOKE=${SMOKE:-} REQ=${REQ:-1024} NEW=${NEW:-384}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
run() {  # NAME WHEN ARGS...: one benchmark run, its JSON in $OUT
  local name=$1 when=$2; shift 2
  echo "[regen-idle] $name $when $*"
  # shellcheck disable=SC2086
  $PY benchmarks/regenerate_gpu.py --shape smollm2 --device "$DEVICE" --attention flash --max-new-tokens "$NEW" \
    --answer-min 1 "$@" $SMOKE --json "$OUT/idle_${name}_${when}.json" 2>&1 | grep -a "^shape:\|^stats\|Error" || true
}
{
  for when in before now; do
    flag=""; [ $when = before ] && flag="--read-idle --padded-prefill"
    # one wave: every slot filled once with a long history, then drained (a ShareGPT wave's shape)
    run wave $when --requests $((REQ / 2)) --slots $((REQ / 2)) --prompt-min 1024 --prompt-max 2048 $flag
    # four slots' worth of requests: refills keep slots busy until the queue empties
    run refill $when --requests $((4 * REQ)) --prompt-min 64 --prompt-max 2048 $flag
  done
} 2>&1 | tee "$OUT/h200_regen_idle.log"
$PY benchmarks/regenerate_gpu.py --table "$OUT"/idle_{wave,refill}_{before,now}.json
