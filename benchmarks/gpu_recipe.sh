#!/usr/bin/env bash
# The headline draft and its figure on one GPU: the shipped recipe (examples/gpu.yaml) end to end, then
# the quality benchmark's measurement of the draft it exports.
usage() {
  cat <<'EOF'
usage: bash benchmarks/gpu_recipe.sh [--out DIR] [--input FILE] [--max-prompts N] [--domains "chat code maths"]
                                     [--k "3 5"] [--no-quality] [KEY=VALUE ...] [-- NESTLING-RUN-FLAGS]

Runs on any machine with one CUDA GPU (80 GB is plenty) and nestling installed (`pip install -e .`,
or `pip install -e '.[vllm]'` to measure in vLLM):
  1. the training input, unless --input FILE names one: every ShareGPT conversation outside the quality
     benchmark's held-out ones (benchmarks/mix_source.py --chat 1000000 --maths 0), in DIR/input/;
  2. nestling run examples/gpu.yaml run_dir=DIR/run inputs=FILE KEY=VALUE...: the target rewrites the
     answers (greedy, then one sampled answer each), a 2-layer draft with the EAGLE-3.1 norms trains
     online for 90M tokens, export, eval (the log: DIR/run/run.log; a rerun resumes, skipping what is done);
  3. unless --no-quality: benchmarks/quality.py --draft DIR/run/export on the held-out prompts
     (--max-prompts, default 36; --domains, default chat; --k, default "3 5"), in vLLM with vLLM's ngram
     beside it where vLLM is installed, else with nestling's reference decoder on the GPU.

Time on one H100: about 40 minutes (regenerate ~20, train ~12, eval and the measurement a few).
Result: the table printed last, DIR/quality/full/quality-export.json, the draft in DIR/run/export.
Measured this way: 3.043 tokens per target forward at K = 3, 3.852 at K = 5 (vLLM's ngram: 1.901 / 2.113).
KEY=VALUE settings go to `nestling run` (e.g. train.steps=1374 for half the budget), and so does what
follows `--` (e.g. -- --until export). PYTHON names the interpreter (default: python3).
EOF
}
set -euo pipefail
OUT=runs/gpu-recipe INPUT="" PROMPTS=36 DOMAINS="chat" KS="3 5" QUALITY=1 RUN_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
  -h | --help) usage; exit 0 ;;
  --out) OUT=${2:?--out needs a folder}; shift 2 ;;
  --input) INPUT=${2:?--input needs a file}; shift 2 ;;
  --max-prompts) PROMPTS=${2:?--max-prompts needs a number}; shift 2 ;;
  --domains) DOMAINS=${2:?--domains needs a list}; shift 2 ;;
  --k) KS=${2:?--k needs a list}; shift 2 ;;
  --no-quality) QUALITY=0; shift ;;
  --) shift; RUN_ARGS+=("$@"); break ;;
  -*) echo "[gpu-recipe] unknown option $1 (--help lists them)" >&2; exit 2 ;;
  *=*) RUN_ARGS+=("$1"); shift ;;
  *) echo "[gpu-recipe] $1 is neither an option nor a KEY=VALUE setting (--help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}  # runs from a checkout too
if [ -n "$INPUT" ]; then
  [ -f "$INPUT" ] || { echo "[gpu-recipe] --input $INPUT: no such file" >&2; exit 2; }
else
  INPUT=$OUT/input/sharegpt-train.jsonl
  [ -s "$INPUT" ] || $PY "$ROOT/benchmarks/mix_source.py" --out "$INPUT" --chat 1000000 --maths 0
fi
echo "[gpu-recipe] nestling run examples/gpu.yaml run_dir=$OUT/run inputs=$INPUT ${RUN_ARGS[*]-}"
$PY -m nestling run "$ROOT/examples/gpu.yaml" run_dir="$OUT/run" inputs="$INPUT" ${RUN_ARGS[@]+"${RUN_ARGS[@]}"}
[ "$QUALITY" = 1 ] || exit 0
if $PY -c "import vllm" 2>/dev/null; then ENGINES=(--engines vllm); else ENGINES=(--engines reference --no-ngram --device cuda); fi
# shellcheck disable=SC2086  # DOMAINS and KS are lists
$PY "$ROOT/benchmarks/quality.py" --budget full --draft "$OUT/run/export" "${ENGINES[@]}" --max-prompts "$PROMPTS" \
  --k $KS --domains $DOMAINS --out "$OUT/quality"
