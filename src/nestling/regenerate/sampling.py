"""Token choice on the device, per row, with no random-number-generator state.

Sampling uses the Gumbel-max trick with noise hashed from (request seed, token index, vocabulary
id), so a request's sampled answer depends only on its own seed and logits: not on which slot or
batch it ran in, nor on what ran before. That makes sampled output repeat exactly on a rerun or a
resumed run, and the function has no host work, so it can sit inside a CUDA graph.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX = 0x45D9F3B  # < 2**27: products of 32-bit values stay inside int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (three xor-shift-multiply rounds) on int64 tensors holding 32-bit values."""
    x = ((x >> 16) ^ x) * MIX & MASK32
    x = ((x >> 16) ^ x) * MIX & MASK32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [rows, vocab] fixed by each row's seed and token index."""
    row = _mix(_mix(seeds.long() & MASK32) ^ (index.long() & MASK32))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    x = _mix((row[:, None] * 0x9E37 ^ ids[None, :]) & MASK32)
    u = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(-torch.log(u))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits outside the top k or the nucleus p set to -inf (the usual sampling filters)."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keeps the first token that crosses p
        ordered = ordered.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return logits


def pick_tokens(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    index: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:
    """The next token of every row: argmax when temperature is 0, else a seeded sample."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    return (logits + gumbel_noise(seeds, index, logits.shape[-1])).argmax(-1)
