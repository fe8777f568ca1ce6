"""Training throughput of the EAGLE-3 TTT step: tokens/s, MFU and peak memory against K.

Random weights and random bf16 features generated on the device (throughput does not depend on
values), so no capture is needed. It runs the trainer's own pieces: `TTTObjective` (batched TTT +
loss), the chunked teacher, AdamW (fused on CUDA), bf16 autocast with fp32 master weights, and
gradient clipping.

    python benchmarks/train_throughput.py --device cuda --shape llama8b --json out.json
    python benchmarks/train_throughput.py --device cpu --shape smollm2 --seq 512

FLOPs per optimizer step (what MFU counts; N = tokens in the step, L = row length):

    6 * P_trainable * N * K                                 draft forward + backward, every TTT step
  + sum_j 3 * 4 * n_heads * head_dim * ((L + 1) / 2 + j) * N   attention (QK^T and PV, fwd + 2x bwd),
                                                            causal context plus j chain keys at step j
  + 2 * H * V * N                                           teacher head (forward only; all V rows:
                                                            the draft-vocab rows and the argmax check)

P_trainable = fc + the decoder layer + norms + lm_head (draft vocab); the frozen embedding is not
counted. MFU = FLOPs / time / peak; the peak is --peak-tflops (default: 989 for CUDA = H200 dense
bf16; on CPU a measured fp32 matmul rate).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

SHAPES = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, vocab_size=128256, rope_theta=500000.0),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, vocab_size=49152, rope_theta=100000.0),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=64, vocab_size=49152, rope_theta=10000.0),
}


def build(shape: str, draft_vocab: int, K: int, device: torch.device, attention: str):
    from nestling.draft.model import DraftConfig, Eagle3Draft
    from nestling.train.loop import TTTObjective
    from nestling.train.ttt import attention_backend

    sh = dict(SHAPES[shape])
    theta = sh.pop("rope_theta")
    cfg = DraftConfig(**sh, draft_vocab_size=min(draft_vocab, sh["vocab_size"]), aux_layer_ids=[2, 16, 29],
                      num_target_layers=32, rope_parameters={"rope_type": "default", "rope_theta": theta},
                      max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        draft = Eagle3Draft(cfg)
    return cfg, TTTObjective(draft, K, 0.8, attention_backend(attention, device))


def flops_per_step(cfg, trainable: int, N: int, L: int, K: int) -> float:
    attn = cfg.num_hidden_layers * sum(3 * 4 * cfg.num_attention_heads * cfg.head_dim * ((L + 1) / 2 + j) * N
                                       for j in range(K))
    return 6 * trainable * N * K + attn + 2 * cfg.hidden_size * cfg.vocab_size * N


def run_one(args, K: int) -> dict:
    from nestling.train.loss import supervised_counts, teacher
    from nestling.train.ttt import PackedBatch

    device = torch.device(args.device)
    amp = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    cfg, objective = build(args.shape, args.draft_vocab, K, device, args.attention)
    draft = objective.draft
    if amp != torch.float32:
        draft.embed_tokens.to(amp)
    H, V, Vd, L, B = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size, args.seq, args.rows
    g = torch.Generator(device=device).manual_seed(0)
    w_head = torch.randn(V, H, device=device, dtype=amp, generator=g) * 0.02
    w_draft, w_rest = w_head[:Vd], w_head[Vd:]
    params = [p for p in objective.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    fwd = torch.compile(objective) if args.compile else objective
    doc_len = L // args.docs

    def batch() -> PackedBatch:
        ids = torch.randint(0, V, (B, L), device=device, generator=g)
        doc = (torch.arange(L, device=device) // doc_len).clamp(max=args.docs - 1).expand(B, L).contiguous()
        pos = (torch.arange(L, device=device) - doc[0] * doc_len).expand(B, L).contiguous()
        aux = torch.randn(B, L, 3 * H, device=device, dtype=amp, generator=g)
        final = torch.randn(B, L, H, device=device, dtype=amp, generator=g)
        mask = torch.ones(B, L, dtype=torch.bool, device=device)
        return PackedBatch(ids, mask, doc, pos, aux, final, num_tokens=B * L)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(b: PackedBatch) -> None:
        denom = supervised_counts(b, K)
        t = teacher(b.final, w_draft, w_rest, args.teacher_chunk)
        with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
            loss = fwd(b, t, denom)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def saved_activation_bytes(b: PackedBatch) -> int:
        """Bytes autograd keeps for the backward of one microbatch (distinct storages): the exact
        quantity that must grow linearly in K, free of allocator noise."""
        seen: dict[int, int] = {}

        def pack(x):
            st = x.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
            return x

        denom = supervised_counts(b, K)
        t = teacher(b.final, w_draft, w_rest, args.teacher_chunk)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
                objective(b, t, denom)[0]
        return sum(seen.values())

    b = batch()
    saved = saved_activation_bytes(b)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: weights + data, before any step
    for _ in range(args.warmup):
        step(b)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step(b)
    sync()
    dt = (time.perf_counter() - t0) / args.iters
    N = B * L
    fl = flops_per_step(cfg, trainable, N, L, K)
    # CUDA: allocator high-water mark of the timed steps; CPU: RSS high-water mark above the state before
    # the first step (activations, gradients, optimizer state; the latter two do not grow with K)
    peak_mem = (torch.cuda.max_memory_allocated() if device.type == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0)
    return {"K": K, "tokens_per_s": N / dt, "step_s": dt, "tflops": fl / dt / 1e12, "flops_per_step": fl,
            "peak_mem_gib": peak_mem / 2**30, "saved_activations_gib": saved / 2**30, "trainable_params": trainable, "tokens_per_step": N}


def cpu_peak_tflops() -> float:
    """Measured fp32 matmul rate on this machine (the CPU has no single published peak)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t0 = time.perf_counter()
    n = 10
    for _ in range(n):
        a @ b
    return 2 * 1024**3 * n / (time.perf_counter() - t0) / 1e12


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="llama8b on CUDA, smollm2 on CPU by default")
    p.add_argument("--seq", type=int, default=None, help="row length (default 2048 on CUDA, 512 on CPU)")
    p.add_argument("--rows", type=int, default=1, help="packed rows per microbatch")
    p.add_argument("--docs", type=int, default=1, help="samples packed per row")
    p.add_argument("--ttt-steps", type=int, default=7, help="K of the throughput row")
    p.add_argument("--mem-steps", default="1,3,7", help="K values for the peak-memory sweep")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    p.add_argument("--attention", choices=["auto", "mask", "flex"], default="auto")
    p.add_argument("--compile", action="store_true", help="torch.compile the TTT objective")
    p.add_argument("--teacher-chunk", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child run of one K (CPU memory)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("llama8b" if cuda else "smollm2")
    args.seq = args.seq or (2048 if cuda else 512)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.iters = args.iters if args.iters is not None else (10 if cuda else 2)
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    if args.one is not None:  # child: one K, print JSON
        print(json.dumps(run_one(args, args.one)))
        return

    ks = sorted({int(k) for k in args.mem_steps.split(",") if k} | {args.ttt_steps})
    rows = []
    for K in ks:
        if cuda:
            torch.cuda.empty_cache()
            r = run_one(args, K)
        else:  # a fresh process per K: ru_maxrss is a high-water mark
            child = [a for a in sys.argv[1:]]
            out = subprocess.run([sys.executable, __file__, *child, "--one", str(K)], capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr)
            r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"K={K}: {r['tokens_per_s']:,.0f} tok/s, {r['tflops']:.2f} TFLOP/s, peak {r['peak_mem_gib']:.2f} GiB",
              flush=True)
    peak = args.peak_tflops or (989.0 if cuda else cpu_peak_tflops())
    for r in rows:
        r["mfu"] = r["tflops"] / peak
    mem = {r["K"]: r["peak_mem_gib"] for r in rows}
    act = {r["K"]: r["saved_activations_gib"] for r in rows}
    linear = None
    if {1, 3, 7} <= set(mem):
        d13, d37 = mem[3] - mem[1], mem[7] - mem[3]
        a13, a37 = act[3] - act[1], act[7] - act[3]
        linear = {"per_step_gib_1_to_3": d13 / 2, "per_step_gib_3_to_7": d37 / 4,
                  "ratio": (d37 / 4) / (d13 / 2) if d13 > 0 else None,
                  "saved_per_step_gib_1_to_3": a13 / 2, "saved_per_step_gib_3_to_7": a37 / 4}
    device_name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    result = {"device": device_name, "shape": args.shape, "seq": args.seq, "rows": args.rows, "docs": args.docs,
              "dtype": args.dtype, "compile": args.compile, "attention": args.attention, "peak_tflops": peak,
              "torch": torch.__version__, "runs": rows, "memory_linearity": linear}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print()
    print(f"train throughput: {args.shape} on {device_name}, {args.rows}x{args.seq} tokens/step, {args.dtype}, "
          f"peak {peak:.3g} TFLOP/s")
    print(f"{'K':>3} {'tok/s':>10} {'TFLOP/s':>9} {'MFU':>6} {'peak GiB':>9} {'saved GiB':>10}")
    for r in rows:
        print(f"{r['K']:>3} {r['tokens_per_s']:>10,.0f} {r['tflops']:>9.2f} {100 * r['mfu']:>5.1f}% "
              f"{r['peak_mem_gib']:>9.2f} {r['saved_activations_gib']:>10.3f}")
    if linear:
        print(f"memory per TTT step: peak {linear['per_step_gib_1_to_3']:.3f} GiB (K 1->3), "
              f"{linear['per_step_gib_3_to_7']:.3f} GiB (K 3->7); saved activations "
              f"{linear['saved_per_step_gib_1_to_3']:.3f} / {linear['saved_per_step_gib_3_to_7']:.3f} GiB")


if __name__ == "__main__":
    main()
