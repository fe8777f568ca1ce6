"""The hf engine's fast decode loop at scale: all of ShareGPT with SmolLM2, or an 8B-shaped model.

ShareGPT mode (default): `nestling regenerate` over every conversation and every assistant turn
(or --limit / --max-turns) with the hf engine, one chunk holding everything (so each turn index
is one engine call that keeps all slots busy), and reports output tok/s (generation time, from
the manifest), wall time (with loading and prompt rendering), turns, tokens and cap hits:

    PYTHONPATH=src python benchmarks/regenerate_gpu.py --sharegpt ShareGPT_V3_unfiltered_cleaned_split.json \\
        --target ./SmolLM2-135M-Instruct --json regen_gpu.json

Shape mode (`--shape llama8b`): random weights of a Llama-3-8B shape (hidden 4096, 32 layers, 32
heads, 8 KV heads, MLP 14336, vocab 128256) in bf16, random prompts, no end token (every answer
runs to --max-new-tokens): the decode loop's own throughput.

    PYTHONPATH=src python benchmarks/regenerate_gpu.py --shape llama8b --requests 4096 --max-new-tokens 256

CPU smoke tests: `--device cpu --limit 2 --max-new-tokens 8` and `--shape llama8b --device cpu
--layers 1 --hidden 256 --requests 4 --max-new-tokens 4`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

SHAPES = {
    "llama8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "smollm2": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}


def sharegpt_run(a) -> dict:
    from nestling.regenerate.run import regenerate
    from nestling.regenerate.settings import RegenerateSettings

    if a.target is None:
        from nestling.assets import smollm2_dir

        a.target = smollm2_dir()
    if a.sharegpt is None:
        from nestling.assets import sharegpt_json

        a.sharegpt = sharegpt_json()
    s = RegenerateSettings(
        engine="hf",
        device=a.device,
        dtype=a.dtype,
        max_new_tokens=a.max_new_tokens,
        max_turns=a.max_turns,
        limit=a.limit,
        chunk_size=10**9,
        temperature=a.temperature,
        n=a.n,
        hf_batch_size=a.slots,
        hf_batch_tokens=a.cache_tokens,
    )
    out = Path(a.out or tempfile.mkdtemp(prefix="regen_gpu_"))
    t0 = time.monotonic()
    m = regenerate(a.sharegpt, a.target, out, s)
    wall = time.monotonic() - t0
    g, c = m["generation"], m["counts"]
    return {
        "mode": "sharegpt",
        "target": str(a.target),
        "input": str(a.sharegpt),
        "device": a.device,
        "dtype": a.dtype,
        "max_new_tokens": a.max_new_tokens,
        "n": a.n,
        "out": str(out),
        "conversations": c["read"],
        "kept": c["kept"],
        "failed": c["failed"],
        "turns": g["turns"],
        "output_tokens": g["output_tokens"],
        "cap_hits": g["truncated_turns"],
        "cap_share": g["truncated_share"],
        "generation_s": g["seconds"],
        "wall_s": round(wall, 1),
        "output_tok_s": g["output_tokens_per_s"],
    }


def random_model(a):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SHAPES[a.shape])
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    if a.hidden:  # smoke tests: a narrower model with the same head layout
        shape.update(
            hidden_size=a.hidden,
            intermediate_size=a.hidden * 7 // 2,
            num_attention_heads=a.hidden // 128,
            num_key_value_heads=max(1, a.hidden // 512),
        )
    dtype = getattr(torch, a.dtype if a.dtype != "auto" else ("bfloat16" if a.device != "cpu" else "float32"))
    cfg = LlamaConfig(**shape, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(a.device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval(), cfg


def shape_run(a) -> dict:
    import torch

    from nestling.regenerate.decode import Decoder, Job, Sampling, cache_length
    from nestling.regenerate.hf_engine import fast_limits, kv_bytes_per_token
    from nestling.regenerate.settings import RegenerateSettings

    model, cfg = random_model(a)
    on_cuda = a.device.startswith("cuda")
    free = torch.cuda.mem_get_info(model.device)[0] if on_cuda else 0
    kv = kv_bytes_per_token(cfg, next(model.parameters()).element_size())
    slots, cache_tokens = fast_limits(
        RegenerateSettings(hf_batch_size=a.slots, hf_batch_tokens=a.cache_tokens), on_cuda, kv, free
    )
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(a.prompt_min, a.prompt_max + 1, (a.requests,), generator=g).tolist()
    lo = min(a.answer_min or a.max_new_tokens, a.max_new_tokens)  # random lengths end at different steps
    caps = torch.randint(lo, a.max_new_tokens + 1, (a.requests,), generator=g).tolist()
    jobs = [
        Job(torch.randint(10, cfg.vocab_size, (n,), generator=g).tolist(), cap, i)
        for i, (n, cap) in enumerate(zip(lens, caps))
    ]
    length = cache_length(max(lens) + a.max_new_tokens)
    slots = max(1, min(slots, cache_tokens // length, a.requests))
    dec = Decoder(
        model,
        [],
        0,
        Sampling(a.temperature),
        slots,
        length,
        a.max_new_tokens,
        a.sync_every or (16 if on_cuda else 4),
        on_cuda and not a.eager,
        attention=a.attention,
    )
    if a.padded_prefill:  # as earlier: right-padded prefill batches through transformers' forward
        dec.sm.packed_why, dec.sm.prefill_check_pending = "--padded-prefill", False
    if a.read_idle:  # as earlier: idle slots read their last occupant's keys every step
        logits = dec.sm.logits
        dec.sm.logits = lambda tokens, pos, window, live=None: logits(tokens, pos, window)  # type: ignore[method-assign]
    t0 = time.monotonic()
    with torch.inference_mode():
        out = dec.run(jobs, 65536 if on_cuda else 8192)
    if on_cuda:
        torch.cuda.synchronize()
    secs = time.monotonic() - t0
    tokens = sum(len(o) for o in out)
    if a.profile:
        profile_step(dec, a.profile)
    return {
        "stats": dec.stats.as_dict(slots),
        "attention": dec.sm.attention,  # what ran (auto resolved; a failed flash check falls back)
        "attention_asked": a.attention,
        "mode": f"shape:{a.shape}",
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "device": a.device,
        "dtype": str(next(model.parameters()).dtype),
        "requests": a.requests,
        "slots": slots,
        "cache_length": length,
        "cuda_graphs": dec.use_graphs,
        "output_tokens": tokens,
        "answer_min": lo,
        "read_idle": a.read_idle,
        "prefill": "padded" if dec.sm.packed_why else "packed",
        "cap_hits": sum(c == a.max_new_tokens for c in caps),
        "cap_share": round(sum(c == a.max_new_tokens for c in caps) / len(caps), 4),
        "turns": len(out),
        "generation_s": round(secs, 3),
        "wall_s": round(secs, 1),
        "output_tok_s": round(tokens / secs, 1),
    }


def profile_step(dec, window: int) -> None:
    """The GPU kernels of three eager decode steps at this window (a graph replay hides them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        dec.state.live.fill_(True)
        for _ in range(2):
            dec._step(window)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                dec._step(window)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def table(paths: list[Path]) -> None:
    """One line per result JSON of shape mode (the device scripts' summary, printed last)."""
    print(
        f"\n{'run':28} {'attention':14} {'idle reads':10} {'prefill':8} {'out tok/s':>10} {'ms/step':>8} "
        f"{'steps':>6} {'slot use':>8} {'decode s':>8} {'prefill s':>9}"
    )
    for f in paths:
        if not f.exists():
            print(f"{f.stem:28} (no result)")
            continue
        r = json.loads(f.read_text())
        s = r["stats"]
        att = f"{r.get('attention_asked', '?')}->{r.get('attention', '?')}"
        idle = "history" if r.get("read_idle") else "one key"
        print(
            f"{f.stem:28} {att:14} {idle:10} {r.get('prefill', 'padded'):8} {r['output_tok_s']:>10,.0f} "
            f"{s['ms_per_step']:>8} {s['steps']:>6} {s['slot_use']:>8} {s['step_s']:>8} {s['prefill_s']:>9}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sharegpt", type=Path, help="ShareGPT JSON/JSONL (default: nestling's cached copy)")
    ap.add_argument("--target", type=Path, help="model folder (default: nestling's cached SmolLM2-135M-Instruct)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="random-weight throughput mode instead of ShareGPT")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=384, help="cap per answer (384: the quality benchmark's)")
    ap.add_argument("--max-turns", type=int, default=0, help="0 = every assistant turn")
    ap.add_argument("--limit", type=int, default=0, help="0 = every conversation")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--n", type=int, default=1, help="samples per conversation (needs --temperature > 0)")
    ap.add_argument("--slots", type=int, default=0, help="decode slots (0 = auto: 1024 on CUDA)")
    ap.add_argument("--cache-tokens", type=int, default=0, help="KV-cache tokens (0 = auto: from free GPU memory)")
    ap.add_argument("--out", type=Path, help="regenerate output folder (default: a temporary one)")
    ap.add_argument("--requests", type=int, default=4096, help="shape mode: number of requests")
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--layers", type=int, default=0, help="shape mode: fewer layers (smoke tests)")
    ap.add_argument("--hidden", type=int, default=0, help="shape mode: narrower model (smoke tests; a multiple of 128)")
    ap.add_argument("--eager", action="store_true", help="shape mode: no CUDA graphs (to see what they buy)")
    ap.add_argument(
        "--answer-min",
        type=int,
        default=0,
        help="shape mode: each answer's length uniform in [N, --max-new-tokens] (0: all to the cap), so slots idle",
    )
    ap.add_argument(
        "--padded-prefill",
        action="store_true",
        help="shape mode: right-padded prefill batches (the earlier way) instead of packed ones",
    )
    ap.add_argument(
        "--read-idle",
        action="store_true",
        help="shape mode: idle slots read their last occupant's keys each step (the earlier flash loop)",
    )
    ap.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "matmul", "sdpa", "flash"],
        help="shape mode: the step's attention (auto: flash where it runs, checked against matmul on the first step)",
    )
    ap.add_argument("--sync-every", type=int, default=0, help="shape mode: steps between host syncs (0 = auto)")
    ap.add_argument(
        "--profile", type=int, default=0, help="shape mode: print the kernels of an eager step at this window"
    )
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--table", type=Path, nargs="+", help="print a summary of these result JSONs and exit")
    a = ap.parse_args()
    if a.table:
        return table(a.table)
    res = shape_run(a) if a.shape else sharegpt_run(a)
    keys = [
        "mode",
        "device",
        "turns",
        "output_tokens",
        "cap_hits",
        "cap_share",
        "generation_s",
        "wall_s",
        "output_tok_s",
    ]
    print(" | ".join(keys))
    print(" | ".join(str(res.get(k, "")) for k in keys))
    if "stats" in res:
        print("stats:", res["stats"])
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"-> {a.json}")


if __name__ == "__main__":
    main()
