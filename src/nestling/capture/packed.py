"""Padding-free target forwards: a batch's samples packed into one row, attention kept per sample.

Why: right padding costs real compute on ragged data. Measured on the target-written ShareGPT rows
(microbatches of 32,768 tokens, rows up to 2,048): the padded groups hold 1.31x the real tokens and
1.47x the attention work, and every group needs a mask, which keeps SDPA off its flash kernel; online
training then spent 54% of its step in the target. Packed, the decoder's matmuls see only real tokens
and attention runs as variable-length flash attention (`cu_seqlens`: each sample attends causally to
itself alone), the same layout vLLM and FlashAttention's varlen kernels use.

How: transformers' attention interface takes a registered function by name; the model's config is
switched to it for a packed forward only. Position ids restart at 0 for every sample, so rotary
embeddings see the positions a batch-of-one forward sees. On CUDA the kernel is PyTorch's own flash
attention (`aten::_flash_attention_forward`, bf16/fp16); elsewhere the same contract runs as one
causal SDPA call per sample, which is how the CPU tests prove the plumbing exact against padded
forwards. Architectures whose attention is not plain causal self-attention over equal q/k/v head
dims (MLA, sliding windows, soft-capping) are not packed: `packable` says why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "nestling_packed"  # the attention implementation's name in transformers' registry

# The first packed batch must agree with the padded path's: numerics.disagreement (the 99th
# percentile of the per-state relative error, or the worst sample's median) below this. bf16 alone
# moves real targets' states: SmolLM2-135M-Instruct measured 0.026 on an H200 and 0.029-0.046 in
# bf16 on a CPU, its W4A16 twin 0.047 on the H200. Packing bugs, measured on the same CPU forwards:
# a sample attending to the previous one 0.98-1.10, boundaries off by one token 0.90-1.34. 0.2 sits
# ~4x above the first and ~4x below the second (the 2% this started with sent every real target
# back to padded batches; tests/test_capture_parity.py).
TOLERANCE = 0.2
# decoder families whose attention is plain causal GQA self-attention with one head dim (checked here)
PACKABLE = {"llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral"}


def packable(config, dtype: torch.dtype, device: torch.device, force: bool = False) -> str | None:
    """None when a packed forward can run this target here, else why not (logged once by the caller).
    `force` skips the device and dtype rule (CPU tests of the plumbing)."""
    cfg = getattr(config, "text_config", None) or config
    kind = getattr(cfg, "model_type", "?")
    if kind not in PACKABLE:
        return f"model type {kind!r} is not one of {sorted(PACKABLE)}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "it uses sliding-window attention"
    if force:
        return None
    from nestling.devices import flash_unavailable

    return flash_unavailable(dtype, device)


def _per_sample(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float | None):
    """The reference: one causal SDPA per sample ([N, H, D] in and out)."""
    rep = q.shape[1] // k.shape[1]
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(out)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: q/k/v [1, heads, N, D] in, ([1, N, heads, D], None) out."""
    # nothing here reads a mask or a window: transformers builds none for this name (packable keeps
    # sliding windows out); should that change, fail loudly (auto mode then falls back to padding)
    assert attention_mask is None and kwargs.get("sliding_window") is None and query.shape[0] == 1
    cu, cu_list, longest = kwargs["nestling_cu"], kwargs["nestling_cu_list"], kwargs["nestling_max"]
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    if q.is_cuda:
        cu = cu.to(q.device)  # a no-op, unless a device map left it on another GPU
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scaling
        )[0]
    else:
        out = _per_sample(q, k, v, cu_list, scaling)
    return out[None], None


def register() -> None:
    """Make NAME known to transformers (idempotent). An unknown name gets no mask built for it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)


def packed_inputs(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(input_ids [1, N], position_ids [1, N], the attention kwargs) for samples laid end to end, all
    on the CPU (the caller moves the tensors without a blocking copy)."""
    lengths = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu_list = [0] + torch.tensor(lengths).cumsum(0).tolist()
    cu = torch.tensor(cu_list, dtype=torch.int32)
    kw = {"nestling_cu": cu, "nestling_cu_list": cu_list, "nestling_max": max(lengths)}
    return ids, pos, kw
