"""The reduced draft vocabulary: the N most frequent target tokens among supervised positions.

Stored the way the engines read it: `d2t[i] = target_id(i) - i` (int64 offsets, target ids in
ascending order) and `t2d` (bool over the target vocabulary).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from nestling.errors import NestlingError

# draft_vocab_size 0 (auto): the fewest most frequent tokens that cover AUTO_COVERAGE of the training
# split's supervised tokens, never fewer than AUTO_MIN. Each 1% of served tokens outside the vocabulary
# cost 0.015-0.03 tokens per target forward on SmolLM2, whose 32,000 cover 99.4%
# (docs/train.md, "Draft vocabulary"); a 262k multilingual vocabulary (Gemma-3) needs more rows for the
# same share (docs/results/recipe.md, "The draft vocabulary").
AUTO_COVERAGE = 0.99
AUTO_MIN = 32000
AUTO_ROUND = 128  # rows come in multiples of this (matmul tiles); capped at the vocabulary


def auto_size(counts: torch.Tensor, coverage: float = AUTO_COVERAGE, floor: int = AUTO_MIN) -> int:
    """The draft vocabulary's size for `draft_vocab_size` 0: see AUTO_COVERAGE."""
    ordered = torch.cumsum(torch.sort(counts.flatten(), descending=True).values, 0)
    need = int(torch.searchsorted(ordered, math.ceil(coverage * int(ordered[-1])))) + 1
    n = -(-max(need, floor) // AUTO_ROUND) * AUTO_ROUND
    return min(n, counts.numel())


def resolve_size(counts: torch.Tensor, requested: int) -> int:
    """`requested` (capped at the vocabulary), or the automatic size where it is 0."""
    return auto_size(counts) if requested == 0 else min(requested, counts.numel())


def count_tokens(token_batches, vocab_size: int) -> torch.Tensor:
    """Histogram of token ids over an iterable of 1-D id tensors (the supervised targets)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in token_batches:
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise NestlingError(f"token id {int(ids.max())} is outside the target vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent ids (ties broken by lower id)."""
    vocab_size = counts.numel()
    n = min(draft_vocab_size, vocab_size)
    if counts.sum() == 0:
        raise NestlingError("no supervised tokens to build the draft vocabulary from (is the data empty?)")
    # stable order: most frequent first, lower id first among equals
    order = torch.argsort(counts * vocab_size + (vocab_size - 1 - torch.arange(vocab_size)), descending=True)
    chosen = torch.sort(order[:n]).values
    d2t = chosen - torch.arange(n)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_ids_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id (the lm_head rows to take from the target)."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def target_to_draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """Map target id -> draft id (-1 where not in the draft vocabulary)."""
    out = torch.full((t2d.numel(),), -1, dtype=torch.long, device=t2d.device)
    out[t2d] = torch.arange(int(t2d.sum()), device=t2d.device)
    return out


def save_vocab(path: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    from nestling.inputs import save_safetensors

    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    save_safetensors({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, tmp)
    tmp.replace(path)


def load_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from nestling.errors import NestlingError
    from nestling.inputs import load_safetensors

    t = load_safetensors(path, "vocabulary file", "remove it, or give a vocabulary a nestling run wrote")
    if "d2t" not in t or "t2d" not in t:
        raise NestlingError(f"vocabulary file {path} holds {sorted(t)[:4]}, not d2t and t2d: not a draft vocabulary")
    return t["d2t"], t["t2d"]
