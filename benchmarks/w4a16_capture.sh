#!/usr/bin/env bash
# Capture tokens/s of a W4A16 (compressed-tensors) target against its bf16 twin.
usage() {
  cat <<'HELP'
usage: bash benchmarks/w4a16_capture.sh --out DIR [--target DENSE_DIR] [--device cuda|cpu]
                                        [--samples N] [--seq-len N] [--peak-tflops P]

The dense folder (default: nestling's cached SmolLM2-135M-Instruct, bf16) is written as a W4A16
compressed-tensors checkpoint (pack-quantized, groups of 32: benchmarks/quantize_w4a16.py), and
benchmarks/capture_throughput.py measures both, with the process's peak GPU memory added to each JSON.
transformers dequantizes the W4A16 weights at load, so the forward is the dense one; what differs is
the load. Needs compressed-tensors in the environment (measured with 0.17.0).
Defaults: --device cuda, --samples 128, --seq-len 2048, --peak-tflops 790 (an H200's measured bf16 peak).
Time: about 2 minutes on one H100 or H200; on a CPU, `--device cpu --samples 8 --seq-len 256` about 3.
Result: DIR/capture_{dense,w4a16}.json, the log DIR/w4a16_capture.log, a table last. Measured on one
H200: W4A16 195k capture tok/s against 201k for bf16 (0.97x; docs/results/speed.md). PYTHON names the
interpreter (default: python3).
HELP
}
set -euo pipefail
OUT="" TARGET="" DEVICE=cuda SAMPLES=128 SEQ_LEN=2048 PEAK=790
while [ $# -gt 0 ]; do
  case "$1" in
  -h | --help) usage; exit 0 ;;
  --out) OUT=${2:?--out needs a folder}; shift 2 ;;
  --target) TARGET=${2:?--target needs a folder}; shift 2 ;;
  --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
  --samples) SAMPLES=${2:?--samples needs a number}; shift 2 ;;
  --seq-len) SEQ_LEN=${2:?--seq-len needs a number}; shift 2 ;;
  --peak-tflops) PEAK=${2:?--peak-tflops needs a number}; shift 2 ;;
  *) echo "[w4a16] unknown argument $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -n "$OUT" ] || { echo "[w4a16] --out DIR is required (--help)" >&2; exit 2; }
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"

measure() {  # NAME DIR: capture_throughput.py in-process, then the process's peak CUDA memory into its JSON
  $PY - --device "$DEVICE" --target "$2" --peak-tflops "$PEAK" --samples "$SAMPLES" --seq-len "$SEQ_LEN" \
    --json "$OUT/capture_$1.json" "$ROOT/benchmarks/capture_throughput.py" <<'PYEOF'
import json, runpy, sys, torch
script = sys.argv.pop()
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
j = sys.argv[sys.argv.index("--json") + 1]
r = json.load(open(j))
cuda = torch.cuda.is_initialized()
r["peak_gpu_mem_GB"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else None  # tensors
r["peak_gpu_reserved_GB"] = torch.cuda.max_memory_reserved() / 1e9 if cuda else None  # + allocator cache
open(j, "w").write(json.dumps(r, indent=2) + "\n")
PYEOF
}

main() {
  $PY -c "import compressed_tensors" 2>/dev/null \
    || { echo "[w4a16] compressed-tensors is not installed here: pip install compressed-tensors==0.17.0" >&2; exit 1; }
  [ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  if [ -z "$TARGET" ]; then TARGET=$($PY -c "from nestling.assets import smollm2_dir; print(smollm2_dir())"); fi
  local t0=$SECONDS
  rm -rf "$OUT/w4a16"
  # bf16 in, bf16 scales out, as released W4A16 checkpoints carry them: int4 rounding dwarfs bf16's
  $PY "$ROOT/benchmarks/quantize_w4a16.py" "$TARGET" "$OUT/w4a16"
  echo "[w4a16] quantize: $((SECONDS - t0)) s"
  measure dense "$TARGET"
  measure w4a16 "$OUT/w4a16"
  $PY - "$OUT" <<'PYEOF'
import json, sys
r = {n: json.load(open(f"{sys.argv[1]}/capture_{n}.json")) for n in ("dense", "w4a16")}
d = r["dense"]
print(f"\n{d['device']}, {d['dtype']}, {d['samples']} x {d['seq_len']} tokens, budget {d['token_budget']}")
print(f"{'target':8} {'load s':>7} {'capture tok/s':>14} {'prefill tok/s':>14} {'cap/pre':>8} {'peak GPU GB':>12}")
for n, x in r.items():
    m = "-" if x["peak_gpu_mem_GB"] is None else f"{x['peak_gpu_mem_GB']:.2f}"
    print(f"{n:8} {x['load_s']:7.2f} {x['capture_tok_s']:14,.0f} {x['prefill_tok_s']:14,.0f} "
          f"{x['capture_over_prefill']:8.3f} {m:>12}")
print(f"w4a16 / dense capture tok/s = {r['w4a16']['capture_tok_s'] / d['capture_tok_s']:.3f}")
PYEOF
}

main 2>&1 | tee "$OUT/w4a16_capture.log"
