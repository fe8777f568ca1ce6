#!/usr/bin/env bash
# nestling on vLLM's CUDA build, on one GPU: capture parity and speed against the hf backend, the INT4
# MLA+MoE parity test, a draft served by vLLM (greedy identity, acceptance against the reference decoder,
# sampling), the speed-up in tokens/s, and regeneration through vLLM against the hf engine.
#
#   bash benchmarks/gpu_vllm.sh STEP OUT      STEP: capture | mla | draft | serve | speed | regen | all
#
# OUT receives each step's JSON and log. The target and data are nestling's embedded defaults (SmolLM2-135M-
# Instruct, ShareGPT) from $NESTLING_CACHE; set TARGET=DIR and SHAREGPT=FILE to use others. Needs a CUDA GPU,
# vLLM 0.26 to 0.34 and nestling importable (pip install -e '.[vllm]', or PYTHONPATH=src). Times on one H100:
#   capture ~2 min, mla ~2 min, draft ~6 min (data on LIMIT=20000 conversations, online training for STEPS=600
#   x 32,768 tokens, export),
#   serve ~4 min, speed ~5 min, regen ~3 min.
set -euo pipefail
STEP=${1:?usage: gpu_vllm.sh capture|mla|draft|serve|speed|regen|all OUT}
OUT=$(mkdir -p "${2:?OUT}" && cd "$2" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
TARGET=${TARGET:-$($PY -c 'from nestling.assets import smollm2_dir; print(smollm2_dir())')}
RUN=${RUN:-$OUT/run}            # the draft's run folder (step draft); serve and speed read its export
DRAFT=$RUN/export
PROMPTS=${PROMPTS:-$RUN/data}   # held-out split of the run's data: prompts no training saw
say() { echo "[gpu_vllm] $*" | tee -a "$OUT/steps.log"; }
timed() { local t0=$SECONDS; "$@"; say "$1 ${2:-}: $((SECONDS - t0)) s"; }

capture() {  # a: vllm against hf, bf16: per-token relative L2 per stored layer, and tokens/s of each
  $PY benchmarks/capture_backends.py --target "$TARGET" --device cuda --dtype bfloat16 --samples 400 \
    --parity 64 --json "$OUT/capture_smollm2.json" 2>&1 | tee "$OUT/capture.log" | grep -E '^\[bench\]|^[a-z]' || true
}

mla() {  # b: the INT4 MLA+MoE target, routed experts packed in vLLM's int4 MoE kernel, against hf's capture
  $PY -m pytest -q -rA tests/test_capture_vllm_mla.py -k "cuda or gpu" -p no:cacheprovider 2>&1 | tail -40 \
    | tee "$OUT/mla.log"
}

draft() {  # the draft served below: the shipped recipe's structure on a small budget (no regeneration)
  cat > "$OUT/draft.yaml" <<EOF
target: ${TARGET}
inputs: [${SHAREGPT:-builtin:sharegpt}]
run_dir: ${RUN}
data: {max_length: 2048, held_out: 0.005, limit: ${LIMIT:-20000}}
train: {online: true, draft_layers: 2, steps: ${STEPS:-600}, batch_tokens: 32768, ttt_steps: 3, eval_every: 400}
export: {}
eval: {engine: reference, k: 3, max_prompts: 32}
EOF
  nestling_run "$OUT/draft.yaml" --until export 2>&1 | tail -30 | tee "$OUT/draft.log"
}
nestling_run() { $PY -m nestling run "$@"; }

serve() {  # c: vLLM with the draft against the reference decoder, greedy and at temperature 0.7
  for t in 0 0.7; do
    $PY -m nestling eval "$DRAFT" --target "$TARGET" --prompts "$PROMPTS" --out "$OUT/serve_t$t" --engine both \
      --k 3 --max-new-tokens 256 --max-prompts 64 --temperature "$t" 2>&1 | tail -25 | tee "$OUT/serve_t$t.log"
  done
  $PY benchmarks/serve_compare.py "$OUT/serve_t0/report.json" "$OUT/serve_t0.7/report.json" | tee "$OUT/serve.txt"
}

speed() {  # d: output tokens/s with the draft, with ngram and alone, at concurrency 1 and 16, CUDA graphs on
  local c=${CONC:-1,16}
  $PY benchmarks/vllm_speed.py --target "$TARGET" --draft "$DRAFT" --prompts "$PROMPTS" --out "$OUT/speed_c${c/,/_}.json" \
    --concurrency "$c" --prompts-n 32 --max-new-tokens 256 2>&1 | grep -vE '^(INFO|DEBUG|WARNING)' | tail -30 \
    | tee "$OUT/speed_c${c/,/_}.log"
  rm -f "$OUT"/speed.*.c*.json "$OUT"/speed.*.c*.spec
}

regen() {  # e: regenerate through vLLM against the hf engine on the same conversations
  $PY benchmarks/regenerate_throughput.py --target "$TARGET" --device cuda --engines vllm,hf --n 256 --max-new-tokens 256 \
    --json "$OUT/regen.json" 2>&1 | tail -15 | tee "$OUT/regen.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/steps.log" || true
$PY -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tee -a "$OUT/steps.log"
case "$STEP" in
  capture | mla | draft | serve | speed | regen) timed "$STEP" ;;
  all) for s in capture mla draft serve speed regen; do timed "$s" || say "$s failed"; done ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
