"""The largest fp32 deviation tests/test_capture_parity.py::test_smollm2_matches_hidden_states sees, under
several CPU code paths: what its tolerance (FP32_STATE_TOL) is set from.

    python benchmarks/capture_parity_tolerance.py [--out benchmarks/results/capture_parity_tolerance.json]

Each configuration runs in its own process (the caps are read when torch, MKL and oneDNN load): the
ISA capped by ATEN_CPU_CAPABILITY / MKL_ENABLE_INSTRUCTIONS / ONEDNN_MAX_CPU_ISA (AVX2 is the suite's
pin, tests/conftest.py), one or two threads, and the machine's own best path. Reports the max over
every comparison the test makes of |capture - batch-of-one forward| / token RMS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAPS = {
    "avx2": dict(ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2"),
    "avx512": dict(ATEN_CPU_CAPABILITY="avx512", MKL_ENABLE_INSTRUCTIONS="AVX512", ONEDNN_MAX_CPU_ISA="AVX512_CORE"),
    "sse4": dict(ATEN_CPU_CAPABILITY="default", MKL_ENABLE_INSTRUCTIONS="SSE4_2", ONEDNN_MAX_CPU_ISA="SSE41"),
    "native": {},
}
CONFIGS = [("avx2", 1), ("avx512", 1), ("sse4", 1), ("avx2", 2), ("native", 1)]


def measure(threads: int) -> dict:
    """In this process: the test's comparisons, recording the error instead of asserting it."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    torch.set_num_threads(threads)
    import test_capture_parity as t
    from capture_data import make_data_dir
    from transformers import AutoTokenizer

    from nestling.assets import smollm2_dir

    errs: list[float] = []

    def close(got, ref, dtype, tol=0.0):
        got, ref = got.float(), ref.float()
        scale = ref.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1.0)
        errs.append(float(((got - ref).abs() / scale).max()))

    t.close = close
    tmp = Path(tempfile.mkdtemp())
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    data = make_data_dir(tmp / "data", tok, smollm2_dir(), n_train=4, n_heldout=2, seed=1, max_words=14)
    t.check_capture(smollm2_dir(), data, tmp / "c", "float32")
    return {"max_err": max(errs), "comparisons": len(errs), "isa": torch.backends.cpu.get_cpu_capability()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: threads, in a child process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one))))
        return
    rows = []
    for cap, threads in CONFIGS:
        base = {k: v for k, v in os.environ.items() if k not in CAPS["avx2"]}
        env = {**base, **CAPS[cap], "PYTHONPATH": str(ROOT / "src")}
        r = subprocess.run(
            [sys.executable, __file__, "--one", str(threads)], env=env, capture_output=True, text=True, check=True
        )
        row = {"code_path": cap, "threads": threads, **json.loads(r.stdout.strip().splitlines()[-1])}
        print(json.dumps(row), flush=True)
        rows.append(row)
    from specdec_throughput import _cpu_name

    res = {"cpu": _cpu_name(), "rows": rows, "max": max(r["max_err"] for r in rows), "command": " ".join(sys.argv)}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
