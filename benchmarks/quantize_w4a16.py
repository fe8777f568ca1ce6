"""Write a dense HF folder as a W4A16 (pack-quantized, groups of 32) compressed-tensors checkpoint,
with the compressed-tensors library itself (the scheme Kimi-K2.5's routed experts ship in), so that
capture's throughput on a quantized target can be measured against its dense twin:

    python benchmarks/quantize_w4a16.py DENSE_DIR W4A16_DIR        # default DENSE_DIR: the cached SmolLM2
    python benchmarks/capture_throughput.py --target DENSE_DIR --peak-tflops P --json dense.json
    python benchmarks/capture_throughput.py --target W4A16_DIR --peak-tflops P --json w4a16.json

The quantizer is the test suite's (tests/quant_fixture.py: one definition for tests and benchmark).
transformers loads the checkpoint dequantized (docs/capture.md, "Quantized targets"), so the
forward is the dense one; what differs is the load (decompression) and the states (the rounded weights).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from quant_fixture import quantize_w4a16  # noqa: E402


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    if len(sys.argv) == 3:
        src, out = Path(sys.argv[1]), Path(sys.argv[2])
    else:
        from nestling.assets import smollm2_dir

        src, out = smollm2_dir(), Path(sys.argv[1])
    quantize_w4a16(src, out)
    print(f"wrote {out} (W4A16 pack-quantized, groups of 32) from {src}")


if __name__ == "__main__":
    main()
