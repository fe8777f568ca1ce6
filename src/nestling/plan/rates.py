"""The speeds nestling has measured (benchmarks/results/*.json), scaled to another target and GPU.

Capture is a prefill: its time per token scales with the target's forward FLOPs per token (active
parameters only for a MoE). Training touches only the draft: its time per token scales with the
draft's trainable parameters, and is linear in the TTT steps K (the measured runs at K = 1, 3, 7 fit
a + b*K). Both scale with the GPU's dense bf16 peak against the measured GPU's. These are ideal
figures at the measured utilisation (llama8b-class dense kernels); MoE and INT4 kernels usually run
at a lower one, so read capture times as lower bounds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nestling.errors import NestlingError

# Dense bf16 peak of the GPUs the results were measured on (the scale for --gpu-tflops).
PEAK_TFLOPS = {"NVIDIA H200": 989.0, "NVIDIA H100 80GB HBM3": 989.0}


def default_results_dir() -> Path:
    """benchmarks/results of the source checkout nestling runs from."""
    return Path(__file__).resolve().parents[3] / "benchmarks" / "results"


@dataclass
class CaptureRate:
    tokens_per_s: float  # per GPU
    flops_per_token: float  # of the measured target (decoder, causal attention at its seq_len)
    peak_tflops: float
    source: str

    def scaled(self, flops_per_token: float, tflops: float | None) -> float:
        """Tokens/s per GPU for a target of `flops_per_token` on a GPU of `tflops` peak."""
        return (
            self.tokens_per_s * self.flops_per_token / flops_per_token * (tflops or self.peak_tflops) / self.peak_tflops
        )


@dataclass
class TrainRate:
    a: float  # seconds per token, constant part
    b: float  # seconds per token per TTT step
    trainable_params: int
    peak_tflops: float
    source: str

    def scaled(self, trainable_params: int, ttt_steps: int, tflops: float | None) -> float:
        """Tokens/s per GPU for a draft of `trainable_params` trained with K = ttt_steps."""
        per_token = (self.a + self.b * ttt_steps) * trainable_params / self.trainable_params
        return (tflops or self.peak_tflops) / self.peak_tflops / per_token


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise NestlingError(f"cannot read benchmark result {path}: {e}") from None


def _peak(d: dict) -> float:
    return PEAK_TFLOPS.get(d.get("device", ""), float(d.get("peak_tflops") or 989.0))


def capture_rate(results: Path) -> CaptureRate | None:
    """The capture benchmark with the most tokens (the steadiest figure); None when there is none."""
    runs = [(p, _load(p)) for p in sorted(Path(results).glob("capture_*.json"))]
    runs = [(p, d) for p, d in runs if d.get("capture_tok_s") and d.get("decoder_params")]
    if not runs:
        return None
    p, d = max(runs, key=lambda r: r[1].get("tokens", 0))
    attn = 2 * d["layers"] * 2 * d["hidden"] * d["seq_len"] / 2  # heads x head_dim = hidden (llama8b)
    return CaptureRate(d["capture_tok_s"], 2 * d["decoder_params"] + attn, _peak(d), p.name)


def _fit(runs: list[dict]) -> tuple[float, float]:
    """Least squares of seconds per token against K."""
    xs = [r["K"] for r in runs]
    ys = [1 / r["tokens_per_s"] for r in runs]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if n > 1 and var else my / mx
    return my - b * mx, b


def train_rate(results: Path, ttt_steps: int) -> TrainRate | None:
    """The train benchmark file that is fastest at `ttt_steps`; None when there is none."""
    best = None
    for p in sorted(Path(results).glob("train_*.json")):
        d = _load(p)
        runs = [r for r in d.get("runs") or [] if r.get("tokens_per_s") and r.get("K")]
        if not runs:
            continue
        a, b = _fit(runs)
        rate = TrainRate(a, b, int(runs[0]["trainable_params"]), _peak(d), p.name)
        if best is None or rate.a + rate.b * ttt_steps < best.a + best.b * ttt_steps:
            best = rate
    return best
