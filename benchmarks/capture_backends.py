"""Capture throughput of the vllm and hf backends on the same samples (tokens/s and their ratio).

    PYTHONPATH=src python benchmarks/capture_backends.py [--device cpu|cuda] [--samples 200] [--json OUT]

Samples: the first N ShareGPT conversations rendered with the target's own chat template (SmolLM2 by
default), truncated to --max-length. Both backends get the same length-sorted, token-budget batches.
Timed per backend, after the model is loaded:
- hf: `HFBackend.capture` per batch plus the copy to the host (what the runner streams to the writer);
- vllm: `VLLMBackend.write_shard` (the real path: the connector writes rows into the shard file), and
  with --generic the generic `capture()` (rows round-trip through a scratch file) for comparison.
Prints a table and writes JSON. Not a test: wall-clock figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path


def sharegpt_conversations(path: Path, n: int) -> list[list[dict]]:
    """The first `n` usable conversations; the file is cut off mid-record, so decode record by record."""
    text = path.read_text(encoding="utf-8", errors="replace")
    dec, i, out = json.JSONDecoder(), text.index("[") + 1, []
    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
    while len(out) < n:
        while text[i] in " \n\r\t,":
            i += 1
        rec, i = dec.raw_decode(text, i)
        msgs = [
            {"role": roles.get(t.get("from")), "content": t.get("value") or ""} for t in rec.get("conversations", [])
        ]
        msgs = [m for m in msgs if m["role"] and m["content"].strip()]
        if len(msgs) >= 2 and msgs[0]["role"] == "user":
            out.append(msgs)
    return out


def tokenize(target: Path, convs: list[list[dict]], max_length: int):
    from nestling.data.dataset import Sample
    from nestling.targets.load import load_tokenizer

    tok = load_tokenizer(target)
    samples = []
    for k, msgs in enumerate(convs):
        ids = tok.apply_chat_template(msgs, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[:max_length]
        samples.append(Sample(f"sharegpt:{k}", k, ids, [1] * len(ids)))
    return sorted(samples, key=lambda s: -len(s.input_ids))


def parity_rows(backend, batches):
    """Each batch's rows from the generic `capture()` ([tokens, ids, hidden], fp32 on the host)."""
    import torch

    return torch.cat([backend.capture([s.input_ids for s in batch]).float().cpu() for batch in batches])


def parity(vllm_rows, hf_rows, layer_ids) -> dict:
    """Per stored layer: the per-token relative L2 distance of vLLM's rows from hf's (p50, p99, max)."""
    import torch

    rel = (vllm_rows - hf_rows).norm(dim=-1) / hf_rows.norm(dim=-1).clamp_min(1e-6)  # [tokens, ids]
    out = {}
    for j, layer in enumerate(layer_ids):
        r = rel[:, j]
        out[str(layer)] = {q: float(torch.quantile(r, v)) for q, v in (("p50", 0.5), ("p99", 0.99))}
        out[str(layer)]["max"] = float(r.max())
    return out


def bench_hf(target, layer_ids, settings, batches, check=None) -> dict:
    import torch

    from nestling.capture.hf import HFBackend

    t0 = time.perf_counter()
    b = HFBackend(target, layer_ids, settings)
    load = time.perf_counter() - t0
    b.capture([s.input_ids for s in batches[-1]])  # warm-up (allocator, kernels)
    if b.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for batch in batches:
        b.capture([s.input_ids for s in batch]).cpu()
    dt = time.perf_counter() - t0
    rows = parity_rows(b, check) if check else None
    b.close()
    return {"load_s": load, "capture_s": dt, "rows": rows}


def bench_vllm(target, layer_ids, settings, batches, samples, generic: bool, check=None) -> dict:
    from nestling.capture.store import ShardPlan
    from nestling.capture.vllm import VLLMBackend

    t0 = time.perf_counter()
    b = VLLMBackend(target, layer_ids, settings)
    load = time.perf_counter() - t0
    b.capture([s.input_ids for s in batches[-1]])  # warm-up
    with tempfile.TemporaryDirectory() as d:
        plan = ShardPlan(0, samples, "bench")
        t0 = time.perf_counter()
        b.write_shard(Path(d) / "shard-00000.safetensors", plan, {}, settings.token_budget)
        dt_shard = time.perf_counter() - t0
    out = {"load_s": load, "capture_s": dt_shard}
    if generic:
        t0 = time.perf_counter()
        for batch in batches:
            b.capture([s.input_ids for s in batch])
        out["generic_capture_s"] = time.perf_counter() - t0
    out["rows"] = parity_rows(b, check) if check else None
    b.close()
    return out


def main() -> None:
    from nestling.assets import sharegpt_json, smollm2_dir
    from nestling.capture.settings import CaptureSettings
    from nestling.capture.store import batches as make_batches
    from nestling.targets.layers import default_capture_layers, num_layers
    from nestling.targets.load import load_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, help="model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--max-length", type=int, default=1024, help="truncate samples to this many tokens")
    ap.add_argument("--generic", action="store_true", help="also time the vllm backend's generic capture()")
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--backends", default="vllm,hf")
    ap.add_argument("--parity", type=int, default=0, help="compare both backends' rows on the first N samples")
    ap.add_argument("--json", type=Path, default=Path("capture_backends.json"))
    args = ap.parse_args()

    target = args.target or smollm2_dir()
    samples = tokenize(target, sharegpt_conversations(sharegpt_json(), args.samples), args.max_length)
    n_tok = sum(len(s.input_ids) for s in samples)
    layer_ids = default_capture_layers(num_layers(load_config(target)))
    longest = len(samples[0].input_ids)
    settings = CaptureSettings(
        device=args.device,
        dtype=args.dtype,
        token_budget=max(args.token_budget, longest),
        max_model_len=longest,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    batches = make_batches(samples, settings.token_budget)
    check = make_batches(samples[-args.parity :], settings.token_budget) if args.parity else None
    results, rows = {}, {}
    for name in args.backends.split(","):
        if name == "hf":
            r = bench_hf(target, layer_ids, settings, batches, check)
        else:
            r = bench_vllm(target, layer_ids, settings, batches, samples, args.generic, check)
        rows[name] = r.pop("rows")
        r["tokens_per_s"] = n_tok / r["capture_s"]
        results[name] = r
        print(
            f"[bench] {name}: load {r['load_s']:.1f} s, capture {r['capture_s']:.2f} s, "
            f"{r['tokens_per_s']:.0f} tokens/s, load avg {os.getloadavg()}",
            flush=True,
        )
    try:
        load_avg = os.getloadavg()
    except OSError:
        load_avg = None
    report = {
        "target": str(target),
        "device": args.device,
        "dtype": args.dtype,
        "samples": len(samples),
        "tokens": n_tok,
        "longest": longest,
        "token_budget": settings.token_budget,
        "layer_ids": layer_ids,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_at_end": load_avg,
        "results": results,
    }
    if "hf" in results and "vllm" in results:
        report["vllm_over_hf"] = results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    if check and rows.get("hf") is not None and rows.get("vllm") is not None:
        report["parity_samples"] = args.parity
        report["parity"] = parity(rows["vllm"], rows["hf"], layer_ids)
        worst = max(v["p99"] for v in report["parity"].values())
        print(f"[bench] parity on {args.parity} samples: worst per-layer p99 relative L2 {worst:.4%}", flush=True)
    print(
        f"{len(samples)} samples, {n_tok:,} tokens (longest {longest}), {args.device}, {args.dtype}, "
        f"layers {layer_ids}, load avg {load_avg}"
    )
    print(f"{'backend':8} {'load s':>8} {'capture s':>10} {'tokens/s':>10}")
    for name, r in results.items():
        print(f"{name:8} {r['load_s']:8.1f} {r['capture_s']:10.2f} {r['tokens_per_s']:10.0f}")
        if "generic_capture_s" in r:
            print(
                f"{'  (capture() via scratch file)':30} {r['generic_capture_s']:8.2f} s = "
                f"{n_tok / r['generic_capture_s']:.0f} tokens/s"
            )
    if "vllm_over_hf" in report:
        print(f"vllm / hf = {report['vllm_over_hf']:.2f}x")
    args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
