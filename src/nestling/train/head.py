"""The two target tensors the trainer needs: embedding (frozen draft input) and lm_head (teacher and
draft lm_head init). They are read straight from the safetensors files; the target model is never
built. (The final norm is not needed: every capture stores the post-norm final state.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nestling.draft.vocab import draft_ids_to_target
from nestling.errors import NestlingError
from nestling.targets.load import head_tensor_names, read_tensors


@dataclass
class TargetHead:
    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H] (the embedding when tied)


def read_head(target: Path, vocab_size: int, hidden_size: int) -> TargetHead:
    names = head_tensor_names(target)
    t = read_tensors(target, sorted({names["embed"], names["lm_head"]}))
    head = TargetHead(t[names["embed"]], t[names["lm_head"]])
    for what, w in (("embedding", head.embed), ("lm_head", head.lm_head)):
        if tuple(w.shape) != (vocab_size, hidden_size):
            raise NestlingError(
                f"target {what} has shape {tuple(w.shape)}, but the capture says vocab {vocab_size} x "
                f"hidden {hidden_size}: the capture was made from another target"
            )
    return head


def teacher_rows(head: TargetHead, d2t: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lm_head rows of the draft vocabulary, in draft order; all other rows)."""
    return head.lm_head[draft_ids_to_target(d2t)], head.lm_head[~t2d]
