"""Capture throughput: tokens/s, MFU, and capture time / prefill-only time (not a timed test).

  CPU, real SmolLM2:      python benchmarks/capture_throughput.py --device cpu --shape smollm2 --peak-tflops 0.2
  H200, Llama-3.1-8B shape with random bf16 weights (no assets needed):
                          python benchmarks/capture_throughput.py --device cuda --shape llama8b --peak-tflops 790 --json out.json

"prefill-only" is the same base-model forward over the same batches with no hooks, no gather, no
device-to-host copy and no writes; "capture" is the real path (hf backend + streamed shard writer to
`--out`, default a temporary folder). MFU = 2 x params x tokens / time / peak, params = the decoder
layers' weights (embedding lookup and the LM head are not run by capture; attention FLOPs not counted).
Targets on the H200: >= 60% MFU for llama8b and capture <= 1.1 x prefill-only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from nestling.capture.hf import HFBackend, base_model  # noqa: E402
from nestling.capture.run import write_shards  # noqa: E402
from nestling.capture.settings import CaptureSettings, parse_size  # noqa: E402
from nestling.capture.store import batches, bytes_per_token, plan_shards  # noqa: E402
from nestling.data.dataset import Sample  # noqa: E402
from nestling.targets.layers import default_capture_layers  # noqa: E402

LLAMA8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    vocab_size=128256,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def build_model(shape: str, device: str, dtype: torch.dtype, target: str | None):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if shape == "llama8b":
        cfg = LlamaConfig(**LLAMA8B)
        with torch.device(device):  # random init straight on the GPU: no weights on disk, no host copy
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        return model.eval()
    from nestling.targets.load import load_model

    if target is None:
        from nestling.assets import smollm2_dir

        target = str(smollm2_dir())
    return load_model(target, dtype=str(dtype).split(".")[1], device=device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def prefill_only(model, groups: list[list[Sample]], device: str) -> float:
    base = base_model(model)
    t0 = time.perf_counter()
    for b in groups:
        T = max(len(s.input_ids) for s in b)
        ids = torch.zeros(len(b), T, dtype=torch.long)
        mask = torch.zeros(len(b), T, dtype=torch.long)
        for i, s in enumerate(b):
            ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
            mask[i, : len(s.input_ids)] = 1
        attn = None if bool(mask.all()) else mask.to(device)
        base(input_ids=ids.to(device), attention_mask=attn, use_cache=False)
    sync(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=["smollm2", "llama8b"], default="smollm2")
    ap.add_argument("--target", help="model folder for --shape smollm2 (default: the cached SmolLM2)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--samples", type=int, help="samples per measurement (default 64 on cuda, 16 on cpu)")
    ap.add_argument("--seq-len", type=int, help="tokens per sample (default 2048 on cuda, 512 on cpu)")
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--shard-size", default="1GB")
    ap.add_argument("--repeats", type=int, default=2, help="best of N for each measurement")
    ap.add_argument("--peak-tflops", type=float, required=True, help="peak dense FLOP/s of the device, in TFLOP/s")
    ap.add_argument("--out", help="folder the capture writes its shards to (default: a temporary folder)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    n, T = a.samples or (64 if cuda else 16), a.seq_len or (2048 if cuda else 512)

    t0 = time.perf_counter()
    model = build_model(a.shape, a.device, dtype, a.target)
    load_s = time.perf_counter() - t0
    cfg = model.config
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    params = sum(p.numel() for p in base_model(model).layers.parameters())
    layer_ids = default_capture_layers(L)
    rng = random.Random(0)
    samples = [Sample(f"s{i}", i, [rng.randrange(V) for _ in range(T)], [1] * T) for i in range(n)]
    settings = CaptureSettings(
        dtype=str(dtype).split(".")[1],
        device=a.device,
        token_budget=a.token_budget,
        shard_size=a.shard_size,
        progress_interval=1e9,
    )
    groups = batches(samples, a.token_budget)
    tokens = n * T

    prefill_only(model, groups[:1], a.device)  # warm-up (kernels, allocator)
    pre = min(prefill_only(model, groups, a.device) for _ in range(a.repeats))

    backend = HFBackend(None, layer_ids, settings, model=model)
    bpt = bytes_per_token(len(layer_ids), H, dtype)
    plans = plan_shards(samples, bpt, parse_size(settings.shard_size), "bench")
    caps, written = [], 0
    with tempfile.TemporaryDirectory(dir=a.out) as tmp:
        for r in range(a.repeats + 1):  # the first is a warm-up of the writer and the pinned host allocator
            out = Path(tmp) / f"r{r}"
            (out / "train").mkdir(parents=True)
            sync(a.device)
            t0 = time.perf_counter()
            written = write_shards({"train": plans}, backend, out, settings, {"bench": "1"})
            sync(a.device)
            caps.append(time.perf_counter() - t0)
            for f in (out / "train").glob("*"):
                f.unlink()
    cap = min(caps[1:])
    backend.close()

    peak = a.peak_tflops * 1e12
    res = {
        "device": torch.cuda.get_device_name()
        if cuda
        else f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)",
        "shape": a.shape,
        "dtype": str(dtype).split(".")[1],
        "layers": L,
        "hidden": H,
        "vocab": V,
        "decoder_params": params,
        "layer_ids": layer_ids,
        "samples": n,
        "seq_len": T,
        "tokens": tokens,
        "token_budget": a.token_budget,
        "batches": len(groups),
        "load_s": load_s,
        "prefill_s": pre,
        "capture_s": cap,
        "capture_over_prefill": cap / pre,
        "prefill_tok_s": tokens / pre,
        "capture_tok_s": tokens / cap,
        "prefill_mfu": 2 * params * tokens / pre / peak,
        "capture_mfu": 2 * params * tokens / cap / peak,
        "bytes_written": written,
        "write_GB_s": written / cap / 1e9,
        "peak_tflops": a.peak_tflops,
        "torch": torch.__version__,
    }
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"\n{res['device']}  {a.shape} {res['dtype']}  {n} x {T} tokens, budget {a.token_budget}, ids {layer_ids}")
    print(f"{'':10} {'time s':>8} {'tok/s':>10} {'MFU':>7}")
    print(f"{'prefill':10} {pre:8.3f} {res['prefill_tok_s']:10,.0f} {100 * res['prefill_mfu']:6.1f}%")
    print(f"{'capture':10} {cap:8.3f} {res['capture_tok_s']:10,.0f} {100 * res['capture_mfu']:6.1f}%")
    print(
        f"capture / prefill-only = {res['capture_over_prefill']:.3f}  (target <= 1.1); "
        f"wrote {written / 1e9:.2f} GB at {res['write_GB_s']:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
