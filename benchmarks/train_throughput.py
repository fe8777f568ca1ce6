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

--online measures online training's step (docs/train-reference.md): a random-weight target of the shape
(Llama layers: smollm2 30, llama8b 32) runs through the trainer's own `TargetStates` (capture's
HFBackend: no LM head, stops after the last needed layer) on the same token batch, then the same
draft step; it prints the online/offline step-time ratio (the issue's goal: <= 1.2 for smollm2 on
the H200), tokens/s, and MFU with the target forward counted separately as

    2 * P_target * N + sum over layers of 2 * 2 * n_heads * head_dim * (L + 1) / 2 * N

(P_target = the decoder layers' weights, no embedding or LM head; causal attention QK^T and PV).

    python benchmarks/train_throughput.py --device cuda --shape smollm2 --online --ttt-steps 7
    python benchmarks/train_throughput.py --device cuda --shape smollm2 --online --docs 8 --ragged   # real packing
    python benchmarks/train_throughput.py --device cuda --shape smollm2 --online --docs 8 --ragged --padded  # before
    python benchmarks/train_throughput.py --device cuda --shape llama8b --online --ttt-steps 7
    python benchmarks/train_throughput.py --device cpu --shape tiny --online --seq 128 --ttt-steps 3
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
    "llama8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=49152,
        rope_theta=10000.0,
    ),
}
TARGET_LAYERS = {"llama8b": 32, "smollm2": 30, "tiny": 8}  # --online: decoder layers of the random target


def build(shape: str, draft_vocab: int, K: int, device: torch.device, attention: str):
    from nestling.draft.model import DraftConfig, Eagle3Draft
    from nestling.train.objective import TTTObjective
    from nestling.train.ttt import attention_backend

    sh = dict(SHAPES[shape])
    theta = sh.pop("rope_theta")
    cfg = DraftConfig(
        **sh,
        draft_vocab_size=min(draft_vocab, sh["vocab_size"]),
        aux_layer_ids=[2, 16, 29],
        num_target_layers=32,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    with torch.device(device):
        draft = Eagle3Draft(cfg)
    return cfg, TTTObjective(draft, K, 0.8, attention_backend(attention, device))


def flops_per_step(cfg, trainable: int, N: int, L: int, K: int) -> float:
    attn = cfg.num_hidden_layers * sum(
        3 * 4 * cfg.num_attention_heads * cfg.head_dim * ((L + 1) / 2 + j) * N for j in range(K)
    )
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

    step = draft_step(fwd, opt, params, w_draft, w_rest, K, amp, device, args.teacher_chunk)
    if args.online is not None:
        return run_online(args, K, cfg, trainable, step, batch(), amp, device, sync)

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
    peak_mem = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    )
    return {
        "K": K,
        "tokens_per_s": N / dt,
        "step_s": dt,
        "tflops": fl / dt / 1e12,
        "flops_per_step": fl,
        "peak_mem_gib": peak_mem / 2**30,
        "saved_activations_gib": saved / 2**30,
        "trainable_params": trainable,
        "tokens_per_step": N,
    }


def draft_step(fwd, opt, params, w_draft, w_rest, K: int, amp, device, chunk: int):
    """One optimizer step of the draft on a batch whose states are on the device (the trainer's order)."""
    from nestling.train.loss import supervised_counts, teacher

    def step(b) -> None:
        denom = supervised_counts(b, K)
        t = teacher(b.final, w_draft, w_rest, chunk)
        with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
            loss = fwd(b, t, denom)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_target(shape: str, device: torch.device, dtype: torch.dtype, padded: bool = False):
    """A random-weight Llama target of the shape, wrapped as online training runs it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nestling.capture.hf import HFBackend
    from nestling.capture.settings import CaptureSettings
    from nestling.targets.layers import default_capture_layers
    from nestling.train.features import TargetStates

    sh = dict(SHAPES[shape])
    n = TARGET_LAYERS[shape]
    cfg = LlamaConfig(**sh, num_hidden_layers=n, max_position_embeddings=8192, tie_word_embeddings=shape != "llama8b")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    layers = sum(p.numel() for p in model.model.layers.parameters())
    backend = HFBackend(
        Path("."),
        default_capture_layers(n),
        CaptureSettings(device=str(device), dtype=str(dtype).split(".")[-1]),
        model=model,
        packed=False if padded else None,  # None: packed where it can run (CUDA, bf16), else padded
    )
    return cfg, layers, backend, TargetStates


def run_online(args, K: int, cfg, trainable: int, step, dev_batch, amp, device, sync) -> dict:
    """Offline step (states already on the device) against online step (target forward + the same step)."""
    from nestling.train.ttt import PackedBatch

    tcfg, target_params, backend, TargetStates = build_target(args.shape, device, amp, args.padded)
    states = TargetStates(backend, args.seq)
    n_aux = len(backend.layer_ids) - 1
    ids, doc, pos = (x[:1].cpu() for x in (dev_batch.input_ids, dev_batch.doc, dev_batch.pos))
    if args.ragged:  # samples of random lengths, as real data packs: the target pads within groups
        doc, pos = ragged_docs(ids.shape[1], args.docs)
    cpu_batch = PackedBatch(ids, torch.ones_like(ids, dtype=torch.bool), doc, pos, None, None, ids.numel())
    H = cfg.hidden_size
    g = torch.Generator(device=device).manual_seed(1)
    L = ids.shape[1]
    off_batch = PackedBatch(
        ids.to(device),
        cpu_batch.loss_mask.to(device),
        doc.to(device),
        pos.to(device),
        torch.randn(1, L, n_aux * H, device=device, dtype=amp, generator=g),
        torch.randn(1, L, H, device=device, dtype=amp, generator=g),
        L,
    )
    if n_aux != 3:  # the benchmark's draft takes 3 aux layers; the default ids of a 30-32 layer target give 3
        raise SystemExit(f"--online: the target's default aux layers are {n_aux}, the draft expects 3")

    def online_step() -> None:
        step(states.fill(cpu_batch).to(device, amp))

    def timed(fn) -> float:
        for _ in range(args.warmup):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        sync()
        return (time.perf_counter() - t0) / args.iters

    def target_only() -> None:
        states.fill(cpu_batch)

    t_off = timed(lambda: step(off_batch))
    t_on = timed(online_step)
    t_tgt = timed(target_only)
    N = L
    fl_draft = flops_per_step(cfg, trainable, N, L, K)
    fl_target = (
        2 * target_params * N
        + tcfg.num_hidden_layers * 2 * 2 * tcfg.num_attention_heads * tcfg.head_dim * (L + 1) / 2 * N
    )
    return {
        "K": K,
        "tokens_per_step": N,
        "offline_step_s": t_off,
        "online_step_s": t_on,
        "target_forward_s": t_tgt,
        "ratio": t_on / t_off,
        "offline_tokens_per_s": N / t_off,
        "online_tokens_per_s": N / t_on,
        "draft_flops_per_step": fl_draft,
        "target_flops_per_step": fl_target,
        "target_params": target_params,
        "trainable_params": trainable,
        "offline_tflops": fl_draft / t_off / 1e12,
        "online_draft_tflops": fl_draft / t_on / 1e12,
        "online_target_tflops": fl_target / t_on / 1e12,
        "target_forward_tflops": fl_target / t_tgt / 1e12,
        "target_packed": backend.packed,  # one padding-free forward per step, or padded groups
        "target_padded_why": backend.packed_why,
    }


def ragged_docs(L: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`doc` and `pos` rows [1, L] of n samples with random lengths (seeded) filling L tokens."""
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(L - 1, generator=g)[: n - 1] + 1).values.tolist()
    lens = [b - a for a, b in zip([0] + cuts, cuts + [L])]
    doc = torch.cat([torch.full((k,), d) for d, k in enumerate(lens)])[None]
    pos = torch.cat([torch.arange(k) for k in lens])[None]
    return doc, pos


def main_online(args, cuda: bool) -> None:
    K = args.ttt_steps
    r = run_one(args, K)
    peak = args.peak_tflops or (989.0 if cuda else cpu_peak_tflops())
    for k in ("offline", "online_draft", "online_target", "target_forward"):
        r[f"{k}_mfu"] = r[f"{k}_tflops"] / peak
    r["online_mfu"] = r["online_draft_mfu"] + r["online_target_mfu"]
    device_name = (
        torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    )
    result = {
        "device": device_name,
        "shape": args.shape,
        "target_layers": TARGET_LAYERS[args.shape],
        "seq": args.seq,
        "docs": args.docs,
        "ragged": args.ragged,
        "dtype": args.dtype,
        "compile": args.compile,
        "attention": args.attention,
        "peak_tflops": peak,
        "torch": torch.__version__,
        "online": r,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(
        f"online vs offline step: {args.shape} ({TARGET_LAYERS[args.shape]}-layer random target, {args.docs} "
        f"{'ragged ' if args.ragged else ''}sample(s) per row, "
        f"{r['target_params'] / 1e9:.2f}B decoder params) on {device_name}, 1x{args.seq} tokens/step, K={K}, "
        f"{args.dtype}, peak {peak:.3g} TFLOP/s"
    )
    print(
        f"  offline step {1e3 * r['offline_step_s']:9.1f} ms  {r['offline_tokens_per_s']:>10,.0f} tok/s  "
        f"MFU {100 * r['offline_mfu']:.1f}%"
    )
    print(
        f"  online step  {1e3 * r['online_step_s']:9.1f} ms  {r['online_tokens_per_s']:>10,.0f} tok/s  "
        f"MFU {100 * r['online_mfu']:.1f}% (draft {100 * r['online_draft_mfu']:.1f}% + target "
        f"{100 * r['online_target_mfu']:.1f}%)"
    )
    how = "packed" if r["target_packed"] else f"padded groups: {r['target_padded_why']}"
    print(
        f"  target forward alone {1e3 * r['target_forward_s']:.1f} ms (MFU {100 * r['target_forward_mfu']:.1f}%; {how})"
    )
    print(f"  ratio online / offline: {r['ratio']:.3f}x (goal for smollm2 on the H200: <= 1.2x)")


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
    p.add_argument(
        "--online",
        action="store_const",
        const=True,
        default=None,
        help="compare an online step (target forward + draft step) with an offline one, at --ttt-steps",
    )
    p.add_argument(
        "--ragged",
        action="store_true",
        help="--online: --docs samples of random lengths per row (the target packs them, or pads within groups)",
    )
    p.add_argument(
        "--padded",
        action="store_true",
        help="--online: the target in padded groups even where it could pack (the before of a before/after)",
    )
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

    if args.online:
        if args.rows != 1:
            raise SystemExit("--online packs one row per microbatch, as the trainer does (drop --rows)")
        main_online(args, cuda)
        return
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
        print(
            f"K={K}: {r['tokens_per_s']:,.0f} tok/s, {r['tflops']:.2f} TFLOP/s, peak {r['peak_mem_gib']:.2f} GiB",
            flush=True,
        )
    peak = args.peak_tflops or (989.0 if cuda else cpu_peak_tflops())
    for r in rows:
        r["mfu"] = r["tflops"] / peak
    mem = {r["K"]: r["peak_mem_gib"] for r in rows}
    act = {r["K"]: r["saved_activations_gib"] for r in rows}
    linear = None
    if {1, 3, 7} <= set(mem):
        d13, d37 = mem[3] - mem[1], mem[7] - mem[3]
        a13, a37 = act[3] - act[1], act[7] - act[3]
        linear = {
            "per_step_gib_1_to_3": d13 / 2,
            "per_step_gib_3_to_7": d37 / 4,
            "ratio": (d37 / 4) / (d13 / 2) if d13 > 0 else None,
            "saved_per_step_gib_1_to_3": a13 / 2,
            "saved_per_step_gib_3_to_7": a37 / 4,
        }
    device_name = (
        torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    )
    result = {
        "device": device_name,
        "shape": args.shape,
        "seq": args.seq,
        "rows": args.rows,
        "docs": args.docs,
        "dtype": args.dtype,
        "compile": args.compile,
        "attention": args.attention,
        "peak_tflops": peak,
        "torch": torch.__version__,
        "runs": rows,
        "memory_linearity": linear,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print()
    print(
        f"train throughput: {args.shape} on {device_name}, {args.rows}x{args.seq} tokens/step, {args.dtype}, "
        f"peak {peak:.3g} TFLOP/s"
    )
    print(f"{'K':>3} {'tok/s':>10} {'TFLOP/s':>9} {'MFU':>6} {'peak GiB':>9} {'saved GiB':>10}")
    for r in rows:
        print(
            f"{r['K']:>3} {r['tokens_per_s']:>10,.0f} {r['tflops']:>9.2f} {100 * r['mfu']:>5.1f}% "
            f"{r['peak_mem_gib']:>9.2f} {r['saved_activations_gib']:>10.3f}"
        )
    if linear:
        print(
            f"memory per TTT step: peak {linear['per_step_gib_1_to_3']:.3f} GiB (K 1->3), "
            f"{linear['per_step_gib_3_to_7']:.3f} GiB (K 3->7); saved activations "
            f"{linear['saved_per_step_gib_1_to_3']:.3f} / {linear['saved_per_step_gib_3_to_7']:.3f} GiB"
        )


if __name__ == "__main__":
    main()
