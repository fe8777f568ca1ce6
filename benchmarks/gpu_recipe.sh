#!/usr/bin/env bash
# The headline draft and its figures on one GPU: the shipped recipe (examples/gpu.yaml) end to end, then
# the quality benchmark's measurement of the draft it exports on chat, code and maths.
usage() {
  cat <<'EOF'
usage: bash benchmarks/gpu_recipe.sh [--out DIR] [--input FILE] [--max-prompts N] [--domains "chat code maths"]
                                     [--k "3 5"] [--no-quality] [KEY=VALUE ...] [-- NESTLING-RUN-FLAGS]

Runs on any machine with one CUDA GPU (80 GB is plenty) and nestling installed (`pip install -e .`,
or `pip install -e '.[vllm]'` to measure in vLLM):
  1. the chat input, unless --input FILE names one: every ShareGPT conversation outside the quality
     benchmark's held-out ones (benchmarks/mix_source.py --chat 1000000 --maths 0), in DIR/input/, so
     the measured chat prompts stay unseen; it takes the place of builtin:sharegpt;
  2. nestling run examples/gpu.yaml run_dir=DIR/run inputs=FILE,builtin:maths,builtin:code KEY=VALUE...:
     the recipe as shipped (an `inputs=...` setting replaces all three): the target rewrites every
     input's answers (greedy, then one sampled answer each), a 2-layer draft with the EAGLE-3.1 norms
     trains online for 98M tokens, export, eval (the log: DIR/run/run.log; a rerun resumes, skipping
     what is done);
  3. unless --no-quality: benchmarks/quality.py --draft DIR/run/export on the held-out prompts
     (--max-prompts, default 24 per domain; --domains, default "chat code maths"; --k, default "3 5"),
     in vLLM with vLLM's ngram beside it where vLLM is installed, else with nestling's reference decoder
     on the GPU.

Time on one H100: about 40 minutes without vLLM (regenerate ~25, train ~13.5, summed from the runs that
built the measured draft), plus the measurement.
Result: the table printed last, DIR/quality/full/quality-export.json, the draft in DIR/run/export.
The draft measured (these sources, regenerated in three runs; docs/results/quality.md) gave, K = 3 / K = 5:
chat 3.004 / 3.711, code 2.919 / 3.601, maths 2.991 / 3.769 tokens per target forward in vLLM (vLLM's
ngram: 1.993 / 2.236, 1.563 / 1.652, 1.832 / 1.995).
KEY=VALUE settings go to `nestling run` (e.g. train.steps=1500 for half the budget), and so does what
follows `--` (e.g. -- --until export). PYTHON names the interpreter (default: python3).
EOF
}
set -euo pipefail
OUT=runs/gpu-recipe INPUT="" PROMPTS=24 DOMAINS="chat code maths" KS="3 5" QUALITY=1 RUN_ARGS=()
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
INPUTS=$INPUT,builtin:maths,builtin:code
echo "[gpu-recipe] nestling run examples/gpu.yaml run_dir=$OUT/run inputs=$INPUTS ${RUN_ARGS[*]-}"
$PY -m nestling run "$ROOT/examples/gpu.yaml" run_dir="$OUT/run" inputs="$INPUTS" ${RUN_ARGS[@]+"${RUN_ARGS[@]}"}
[ "$QUALITY" = 1 ] || exit 0
if $PY -c "import vllm" 2>/dev/null; then ENGINES=(--engines vllm); else ENGINES=(--engines reference --no-ngram --device cuda); fi
# shellcheck disable=SC2086  # DOMAINS and KS are lists
$PY "$ROOT/benchmarks/quality.py" --budget full --draft "$OUT/run/export" "${ENGINES[@]}" --max-prompts "$PROMPTS" \
  --k $KS --domains $DOMAINS --out "$OUT/quality"
