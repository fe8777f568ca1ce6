#!/usr/bin/env bash
# Issue #14: capture tokens/s of a W4A16 target against its bf16 twin on the H200. SmolLM2-135M-Instruct
# (the GGUF h200_curve.sh's setup assembles) is converted to a bf16 folder (the dense twin), that folder
# is written as a W4A16 compressed-tensors checkpoint (pack-quantized, groups of 32:
# benchmarks/quantize_w4a16.py), and benchmarks/capture_throughput.py measures both (bf16 on cuda; the
# W4A16 one is dequantized at load). Results: $OUT/capture_h200_smollm2_{dense,w4a16}.json (plus
# peak_gpu_mem_GB, peak_gpu_reserved_GB), the log $OUT/h200_w4a16.log, and a table printed last.
# One step on the H200 host, after a `bash benchmarks/h200_curve.sh` step there that ran its setup
# (stage, then start/one/equal/regen...: /root/smollm2.gguf and the gguf package in /tmp/site).
# Copy .whl14 to the host first, then:
#   bash benchmarks/h200_w4a16.sh
# .whl14 holds compressed-tensors 0.17.0 and what the GPU host lacks of its requirements.
# Locally (CPU): GGUF=/tmp/x/smollm2.gguf DEVICE=cpu SAMPLES=8 SEQ_LEN=256 WORK=/tmp/w4 OUT=/tmp/w4out PY=.venv/bin/python
set -euo pipefail
GGUF=${GGUF:-/root/smollm2.gguf} DEVICE=${DEVICE:-cuda} WORK=${WORK:-/root/w4a16bench} PY=${PY:-python3}
SAMPLES=${SAMPLES:-256} SEQ_LEN=${SEQ_LEN:-2048} WHL=${WHL:-.whl14} SITE14=${SITE14:-/tmp/site14}
: "${OUT:?OUT (the folder whose files come back) is not set}"
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE14:/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}

measure() {  # NAME DIR: capture_throughput.py in-process, then the process's peak CUDA memory into its JSON
  $PY - --device "$DEVICE" --target "$2" --peak-tflops 790 --samples "$SAMPLES" --seq-len "$SEQ_LEN" \
    --json "$OUT/capture_h200_smollm2_$1.json" <<'EOF'
import json, runpy, sys, torch
sys.argv = ["benchmarks/capture_throughput.py", *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
j = sys.argv[sys.argv.index("--json") + 1]
r = json.load(open(j))
cuda = torch.cuda.is_initialized()
r["peak_gpu_mem_GB"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else None  # tensors
r["peak_gpu_reserved_GB"] = torch.cuda.max_memory_reserved() / 1e9 if cuda else None  # + allocator cache
open(j, "w").write(json.dumps(r, indent=2) + "\n")
EOF
}

main() {
  if [ ! -f "$GGUF" ]; then
    echo "[w4a16] $GGUF is missing: run a \`bash benchmarks/h200_curve.sh\` step that runs its setup (after" \
      "\`stage\`: start, one, equal, regen...) on this host first, or set GGUF=" >&2
    exit 1
  fi
  $PY -c "import gguf" 2>/dev/null || { echo "[w4a16] the gguf package is not in /tmp/site (h200_curve.sh's setup installs it)" >&2; exit 1; }
  ls "$WHL"/compressed_tensors-0.17.0-*.whl >/dev/null || { echo "[w4a16] copy $WHL (the wheels) over first" >&2; exit 1; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE14" "$WHL"/*.whl
  $PY -c "import compressed_tensors, pydantic, torch, transformers as t; print('[w4a16] compressed-tensors', \
compressed_tensors.__version__, 'pydantic', pydantic.VERSION, 'torch', torch.__version__, 'transformers', t.__version__)"
  [ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  rm -rf "$WORK" && mkdir -p "$WORK"
  local t0=$(date +%s)
  # bf16, not float32: int4 rounding dwarfs bf16's (relative RMS error of the Linear weights against the GGUF's
  # float32 ones: 0.0013 for bf16; W4A16 0.09855 from float32, 0.09857 from bf16), the scales come out bf16 as
  # in released W4A16 checkpoints, and the dense twin is exactly the folder that was quantized
  $PY -c "from pathlib import Path; from nestling.targets.load import convert_gguf
convert_gguf(Path('$GGUF'), Path('$WORK/dense'), 'bfloat16')"
  $PY benchmarks/quantize_w4a16.py "$WORK/dense" "$WORK/w4a16"
  du -sh "$WORK/dense" "$WORK/w4a16"
  echo "[w4a16] convert + quantize: $(($(date +%s) - t0)) s"
  measure dense "$WORK/dense"
  measure w4a16 "$WORK/w4a16"
  $PY - "$OUT" <<'EOF'
import json, sys
r = {n: json.load(open(f"{sys.argv[1]}/capture_h200_smollm2_{n}.json")) for n in ("dense", "w4a16")}
d = r["dense"]
print(f"\n{d['device']}, {d['dtype']}, {d['samples']} x {d['seq_len']} tokens, budget {d['token_budget']}")
print(f"{'target':8} {'load s':>7} {'capture tok/s':>14} {'prefill tok/s':>14} {'cap/pre':>8} {'peak GPU GB':>12}")
for n, x in r.items():
    m = "-" if x["peak_gpu_mem_GB"] is None else f"{x['peak_gpu_mem_GB']:.2f}"
    print(f"{n:8} {x['load_s']:7.2f} {x['capture_tok_s']:14,.0f} {x['prefill_tok_s']:14,.0f} "
          f"{x['capture_over_prefill']:8.3f} {m:>12}")
print(f"w4a16 / dense capture tok/s = {r['w4a16']['capture_tok_s'] / d['capture_tok_s']:.3f}")
EOF
}

main 2>&1 | tee "$OUT/h200_w4a16.log"
