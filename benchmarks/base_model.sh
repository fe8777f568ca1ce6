#!/usr/bin/env bash
# A draft for a base model (a target without a chat template) end to end, measured against vLLM's ngram.
usage() {
  cat <<'EOF'
usage: bash benchmarks/base_model.sh TARGET TEXT OUT [--k "3 5"] [--no-ngram] [KEY=VALUE ...] [-- NESTLING-RUN-FLAGS]

TARGET: a base model's folder or .gguf file (no chat template; e.g. Gemma-3-270M base). TEXT: JSONL of
{"text": ...} records (chat records are flattened to their text). OUT: the folder for everything below.
  1. nestling run examples/gpu.yaml target=TARGET inputs=TEXT run_dir=OUT/run KEY=VALUE...: the GPU recipe,
     which a base target turns into the text recipe by itself (mode auto, docs/base-models.md): regenerate
     continues each text's first 64 tokens (greedy, then once sampled), data packs the documents into
     rows of 2,048 tokens with every token supervised, a 2-layer draft trains online, export, eval at
     K = 3 on the held-out documents' first halves (the log: OUT/run/run.log; a rerun resumes);
  2. unless --no-ngram: vLLM's ngram speculation on the same prompts with the same number of new tokens,
     at each K of --k (default: the eval's K), where vLLM is installed.
Result: a table printed last (tokens per target forward, every decode step counted; acceptance length
over the steps that drafted), OUT/base_model.json, the draft in OUT/run/export. KEY=VALUE settings and what follows `--` go to `nestling run`
(e.g. train.steps=500, eval.max_prompts=8). PYTHON names the interpreter (default: python3).
Time: the GPU recipe's (about 40 minutes for SmolLM2-135M on one H100), which depends on the text given.
Smoke run on a CPU: add regenerate.max_new_tokens=8 regenerate.sampled=0 data.max_length=128
train.steps=2 train.batch_tokens=256 eval.max_prompts=1 eval.max_new_tokens=8 eval.engine=reference.
EOF
}
set -euo pipefail
POS=() KS="" NGRAM=1 RUN_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
  -h | --help) usage; exit 0 ;;
  --k) KS=${2:?--k needs a list}; shift 2 ;;
  --no-ngram) NGRAM=0; shift ;;
  --) shift; RUN_ARGS+=("$@"); break ;;
  -*) echo "[base-model] unknown option $1 (--help lists them)" >&2; exit 2 ;;
  *=*) RUN_ARGS+=("$1"); shift ;;
  *) POS+=("$1"); shift ;;
  esac
done
[ ${#POS[@]} -eq 3 ] || { usage >&2; exit 2; }
TARGET=${POS[0]} TEXT=${POS[1]} OUT=${POS[2]}
[ -e "$TARGET" ] || { echo "[base-model] target $TARGET: no such file or folder" >&2; exit 2; }
[ -f "$TEXT" ] || { echo "[base-model] text input $TEXT: no such file" >&2; exit 2; }
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
echo "[base-model] nestling run examples/gpu.yaml target=$TARGET inputs=$TEXT run_dir=$OUT/run ${RUN_ARGS[*]-}"
$PY -m nestling run "$ROOT/examples/gpu.yaml" target="$TARGET" inputs="$TEXT" run_dir="$OUT/run" \
  ${RUN_ARGS[@]+"${RUN_ARGS[@]}"}
$PY - "$OUT" "$NGRAM" "$KS" <<'PYEOF'
"""The table: the draft as eval measured it, then vLLM's ngram on the eval's own prompts."""
import importlib.util
import json
import sys
from pathlib import Path

out, ngram, ks = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split()
report = json.loads((out / "run" / "eval" / "report.json").read_text())
data = json.loads((out / "run" / "data" / "manifest.json").read_text())
k, new, target = report["k"], report["max_new_tokens"], report["target"]
rows = [
    {"method": f"eagle3 ({engine})", "k": k, "tokens_per_forward": r.get("mean_tokens_per_target_forward"),
     "acceptance_length": r.get("acceptance_length")}
    for engine, r in report["engines"].items()
]
if ngram and importlib.util.find_spec("vllm") is None:
    print("[base-model] vLLM is not installed: no ngram row", flush=True)
elif ngram:
    from quality import run_ngram  # benchmarks/quality.py: vLLM's ngram in a subprocess, forwards counted

    from nestling.evaluate.prompts import fit_context, load_prompts
    from nestling.targets.load import load_config, load_tokenizer

    prompts = load_prompts(out / "run" / "data", load_tokenizer(target), report["num_prompts"])
    context = getattr(load_config(target).get_text_config(), "max_position_embeddings", None)
    for kk in [int(x) for x in ks] or [k]:
        work = out / "ngram"
        work.mkdir(exist_ok=True)
        r = run_ngram(target, fit_context(prompts, context, new + kk + 1), kk, new, "auto", work, 5, 2)
        rows.append({"method": "ngram (vllm)", "k": kk, "tokens_per_forward": r.get("mean_tokens_per_target_forward"),
                     "acceptance_length": r.get("acceptance_length")})
result = {"target": target, "data_mode": data.get("mode"), "prompts": report["num_prompts"], "max_new_tokens": new,
          "rows": rows}
(out / "base_model.json").write_text(json.dumps(result, indent=2))
fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
print(f"\n{target} (data mode {data.get('mode')}), {report['num_prompts']} held-out prompts, {new} new tokens\n")
print("| method | K | tokens per target forward | acceptance length |\n|---|---|---|---|")
for r in rows:
    print(f"| {r['method']} | {r['k']} | {fmt(r['tokens_per_forward'])} | {fmt(r['acceptance_length'])} |")
print(f"\nwrote {out / 'base_model.json'}")
PYEOF
