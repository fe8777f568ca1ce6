"""What a training run is, decided from its checked inputs before anything is built.

`plan_run` fixes the draft vocabulary, the draft's config, the number of optimizer steps and the lr,
and hashes everything that decides the trajectory into `Plan.key`: a checkpoint resumes, and a
finished run is recognised, under the same key only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from nestling.config import to_dict
from nestling.draft.model import DraftConfig, without_off_norms
from nestling.manifest import hash_bytes, hash_json
from nestling.train import dist, features
from nestling.train.data import Stream
from nestling.train.inputs import Inputs, make_vocab, vocab_coverage
from nestling.train.settings import NORM_SETTING_PREFIX, TrainSettings, draft_norms, resolve_lr


def _config_key(
    cfg: DraftConfig,
    d2t: torch.Tensor,
    inp: Inputs,
    s: TrainSettings,
    total: int,
    world: int,
    device: torch.device,
    lr: float,
) -> str:
    """What decides the trajectory; a checkpoint resumes only under the same key (`lr`: the one used,
    given or derived)."""
    return hash_json(
        {
            "draft": cfg.key_fields(),
            "vocab": hash_bytes(d2t.numpy().tobytes()),
            "target": inp.target_fp,
            "capture": hash_json(inp.manifest),
            "settings": trajectory_settings(s, lr),
            "total_steps": total,
            "global_microbatches": world * s.grad_accum,
            **features.key_extra(inp, s, device),
        }
    )


def trajectory_settings(s: TrainSettings, lr: float) -> dict:
    """The settings that decide the trajectory (the key's part). Draft norm settings that are off are
    left out, so that runs and checkpoints from before those settings existed keep their key."""
    kept = {
        k: v
        for k, v in {**to_dict(s), "lr": lr}.items()
        if k
        not in (
            "checkpoint_every",
            "keep_checkpoints",
            "eval_every",
            "eval_batches",
            "log_every",
            "progress_interval",
            "device",
            "attention",
            "compile",
            "parallel",
            "teacher_chunk",
            "target",
            "vocab",
            "grad_accum",
            "steps",
            "epochs",
            "online",
            "target_dtype",
            "heldout_data",
        )
    }
    return without_off_norms(kept, NORM_SETTING_PREFIX)


@dataclass
class Plan:
    """What the run is, decided from the inputs before anything is built: a finished run or a
    checkpoint is recognised by `key` alone."""

    cfg: DraftConfig
    d2t: torch.Tensor
    t2d: torch.Tensor
    vocab_size: int
    hidden_size: int
    microbatches: int  # per optimizer step, over all ranks (world x grad_accum)
    train_stream: Stream
    total: int  # optimizer steps
    lr: float
    lr_why: str
    key: str
    vocab_coverage: float  # share of supervised tokens in the draft vocabulary (inputs.vocab_coverage)
    vocab_coverage_split: str  # ... of this split: heldout where it has supervised tokens, else train


def plan_run(inp: Inputs, s: TrainSettings, out: Path, d: dist.Dist, device: torch.device) -> Plan:
    """The vocabulary, the draft's config, the number of steps and the lr: everything the key covers."""
    text = getattr(inp.hf_config, "text_config", None) or inp.hf_config
    V, H = int(text.vocab_size), int(text.hidden_size)
    d2t, t2d = make_vocab(inp, s, out, V)
    coverage, split = vocab_coverage(inp, t2d, V)
    cfg = DraftConfig.from_target(
        inp.hf_config,
        int(d2t.numel()),
        inp.aux_layer_ids,
        target=str(inp.target),
        target_fingerprint=inp.target_fp,
        num_hidden_layers=s.draft_layers,
        **draft_norms(s),
    )
    if s.intermediate_size:
        cfg.intermediate_size = s.intermediate_size
    G = d.world * s.grad_accum
    train_stream = Stream([e["length"] for e in inp.train_index], s.batch_tokens, s.seed)
    total = s.steps if s.steps is not None else max(1, math.ceil(s.epochs * train_stream.per_epoch() / G))
    lr, lr_why = resolve_lr(s, H, total)
    key = _config_key(cfg, d2t, inp, s, total, d.world, device, lr)
    return Plan(cfg, d2t, t2d, V, H, G, train_stream, total, lr, lr_why, key, coverage, split)
