"""Tokens/s of nestling's reference speculative decoder against the target's own `generate`.

    python benchmarks/specdec_throughput.py --draft DRAFT_DIR [--target MODEL] [--device cpu|cuda]
        [--prompts 8] [--max-new-tokens 128] [--max-prompt-tokens 512] [--k 3] [--batch-size 0] [--out FILE]

Both decode the same prompts greedily on the same device in the same dtype: the first user turns of
the last ShareGPT conversations (the package index's file, as benchmarks/quality.py holds them out),
rendered with the target's chat template. `generate` gets them all at once, left-padded (transformers'
own batching); the reference decoder in batches of `--batch-size` (0: all). Tokens count up to each
output's EOS or the budget. Each side runs once to warm up, then `--repeats` times; the best run counts.
The target defaults to SmolLM2-135M-Instruct from the asset cache. Works with a decoder that has no
batched entry point too (one prompt at a time), to measure a version before batching.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def held_out_prompts(tokenizer, n: int, work: Path, max_tokens: int) -> list[list[int]]:
    """The first `n` of benchmarks/quality.py's held-out ShareGPT prompts of at most `max_tokens`
    tokens, as token ids (a few run to ~3,000: one of them pads a whole batch to its length)."""
    from quality import split_sharegpt

    from nestling.evaluate.prompts import load_prompts

    _, path, _ = split_sharegpt(work, n_heldout=100, n_train=0)
    return [p for p in load_prompts(path, tokenizer) if len(p) <= max_tokens][:n]


def cut(tokens: list[int], eos: set[int]) -> list[int]:
    """Tokens up to and including the first EOS."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def hf_generate(model, prompts: list[list[int]], max_new: int, pad: int, eos: set[int]) -> tuple[int, float]:
    """transformers' `generate`, greedy, every prompt in one left-padded batch -> (tokens, seconds)."""
    import torch

    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p)
        mask[b, P - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=sorted(eos) or None,
        )
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return sum(len(cut(row[P:].tolist(), eos)) for row in out), dt


def reference(dec, prompts: list[list[int]], max_new: int, batch: int) -> tuple[int, float, float]:
    """The reference decoder -> (tokens, seconds, tokens per target forward)."""
    import torch

    tokens = forwards = 0
    t0 = time.perf_counter()
    if hasattr(dec, "generate_batch"):
        size = batch or len(prompts)
        for i in range(0, len(prompts), size):
            outs, stats, _ = dec.generate_batch(prompts[i : i + size], max_new)
            tokens += sum(map(len, outs))
            forwards += sum(s.target_forwards for s in stats)
    else:  # a decoder of one prompt at a time
        for p in prompts:
            out, st = dec.generate(p, max_new)
            tokens += len(out)
            forwards += st.target_forwards
    if str(dec.draft.d2t.device).startswith("cuda"):
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - t0, tokens / max(forwards, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, required=True, help="an exported draft folder of the target")
    ap.add_argument("--target", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct, cached)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on a CPU")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=0, help="reference decoder prompts per batch (0: all)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    ap.add_argument("--work", type=Path, default=Path("bench-specdec"), help="folder for the prompts file")
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = ap.parse_args()

    import torch

    from nestling.devices import auto_dtype, resolve_device
    from nestling.evaluate.run import _eos_ids
    from nestling.evaluate.specdec import SpecDecoder, load_draft
    from nestling.targets.load import load_model, load_tokenizer, resolve_target

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target is None:
        from nestling.assets import smollm2_dir

        args.target = str(smollm2_dir())
    target = resolve_target(args.target)
    device = resolve_device(args.device)
    dtype = auto_dtype(device) if args.dtype == "auto" else args.dtype
    tok = load_tokenizer(target)
    prompts = held_out_prompts(tok, args.prompts, args.work, args.max_prompt_tokens)
    model = load_model(target, dtype=dtype, device=device)
    eos = set(_eos_ids(target, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else sorted(eos)[0]
    dec = SpecDecoder(model, load_draft(args.draft, model, getattr(torch, dtype)), args.k, 0.0, sorted(eos))

    warm = prompts[: max(1, min(2, len(prompts)))]
    hf_generate(model, warm, 8, pad, eos)
    reference(dec, warm, 8, args.batch_size)
    runs: dict[str, list] = {"generate": [], "reference": []}
    for _ in range(args.repeats):
        runs["generate"].append(hf_generate(model, prompts, args.max_new_tokens, pad, eos))
        runs["reference"].append(reference(dec, prompts, args.max_new_tokens, args.batch_size))
    best = {k: max(v, key=lambda r: r[0] / r[1]) for k, v in runs.items()}
    g_tps = best["generate"][0] / best["generate"][1]
    r_tokens, r_s, per_forward = best["reference"]
    r_tps = r_tokens / r_s
    res = {
        "device": device,
        "dtype": dtype,
        "machine": platform.processor() or platform.machine(),
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "batch_size": args.batch_size,
        "batched_decoder": hasattr(dec, "generate_batch"),
        "generate": {"tokens": best["generate"][0], "seconds": best["generate"][1], "tokens_per_s": g_tps},
        "reference": {
            "tokens": r_tokens,
            "seconds": r_s,
            "tokens_per_s": r_tps,
            "tokens_per_target_forward": per_forward,
        },
        "reference_over_generate": r_tps / g_tps,
        "command": " ".join(sys.argv),
    }
    print(
        f"{device} {dtype}, {len(prompts)} prompts x {args.max_new_tokens} tokens: generate {g_tps:.1f} tok/s, "
        f"reference decoder {r_tps:.1f} tok/s ({per_forward:.2f} tokens per target forward) = "
        f"{r_tps / g_tps:.2f}x generate"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
