"""The run built from its plan: the draft inside its TTT objective (wrapped for DDP / FSDP), the
optimizer and lr schedule, the teacher's rows and, when resuming, the checkpoint's state.

`Run` is what the step (step.py), the data feed (feed.py), the held-out pass (heldout.py) and the
step loop (loop.py) read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from nestling.draft.model import DraftConfig, Eagle3Draft
from nestling.draft.vocab import draft_ids_to_target, save_vocab
from nestling.errors import NestlingError
from nestling.progress import log
from nestling.train import checkpoint as ckpt
from nestling.train import dist
from nestling.train.head import read_head, teacher_rows
from nestling.train.inputs import Inputs
from nestling.train.objective import TTTObjective
from nestling.train.optim import Optimizers, build_optimizer
from nestling.train.plan import Plan
from nestling.train.settings import TrainSettings
from nestling.train.ttt import attention_backend


def build_draft(
    cfg: DraftConfig, head, d2t: torch.Tensor, t2d: torch.Tensor, lm_head_init: str, freeze_lm_head: bool = False
) -> Eagle3Draft:
    """A fresh draft: the target's (frozen) embedding, the vocabulary, and the lm_head either from
    the target's rows of the draft vocabulary or left at its random init; `freeze_lm_head` keeps it
    out of training (as speculators does: the target's own output rows)."""
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(head.embed.float())
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        if lm_head_init == "target":
            draft.lm_head.weight.copy_(head.lm_head[draft_ids_to_target(d2t)].float())
    draft.lm_head.weight.requires_grad_(not freeze_lm_head)
    return draft


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to `min_ratio` of the peak lr."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _amp(device: torch.device, s: TrainSettings) -> torch.dtype:
    if s.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, s.dtype)


@dataclass
class Run:
    """One training run, built: the draft inside its TTT objective (wrapped for DDP / FSDP), the
    optimizer, the teacher's rows and the step it starts at. The step (step.py), the held-out
    pass (heldout.py) and the step loop with its checkpoints (loop.py) read it."""

    s: TrainSettings
    d: dist.Dist
    device: torch.device
    out: Path
    plan: Plan
    model: nn.Module
    fwd: Callable  # `model`, or torch.compile of it
    optimizer: Optimizers
    params: list[nn.Parameter]  # the trainable ones
    amp: torch.dtype
    backend: str  # attention backend
    w_draft: torch.Tensor  # lm_head rows of the draft vocabulary (the teacher)
    w_rest: torch.Tensor  # all other rows
    step: int  # where it starts: 0, or the checkpoint's step

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"


def build_run(
    inp: Inputs, plan: Plan, s: TrainSettings, out: Path, d: dist.Dist, device: torch.device, start: Path | None
) -> Run:
    """The model and optimizer, from the same seed on every rank (identical initial weights), then the
    checkpoint's weights, optimizer, schedule and RNG when resuming (its key is checked first)."""
    state = None
    if start is not None:
        weights, optim_state, state = ckpt.load(start, plan.key)  # checks the configuration first
    torch.manual_seed(s.seed)
    head = read_head(inp.target, plan.vocab_size, plan.hidden_size)
    draft = build_draft(plan.cfg, head, plan.d2t, plan.t2d, s.lm_head_init, s.head_frozen)
    if state is not None:
        ckpt.check_weights(start, weights, draft.export_state_dict())  # type: ignore[arg-type]
    amp = _amp(device, s)
    draft.to(device)
    if amp != torch.float32:
        draft.embed_tokens.to(amp)  # frozen: no fp32 master copy needed
    w_draft, w_rest = (w.to(device, amp) for w in teacher_rows(head, plan.d2t, plan.t2d))
    del head
    backend = attention_backend(s.attention, device)
    if backend == "flex" and device.type != "cuda":
        raise NestlingError(
            "attention=flex trains on CUDA only (PyTorch has no flex-attention backward on CPU); "
            "use attention=auto or attention=mask"
        )
    objective = TTTObjective(draft, s.ttt_steps, s.ttt_decay, backend, s.hidden_noise)
    model = dist.wrap(objective, d, s.parallel, device)
    params = [p for p in model.parameters() if p.requires_grad]
    total = plan.total
    warmup = s.warmup_steps if s.warmup_steps is not None else int(s.warmup_ratio * total)
    optimizer = build_optimizer(model, s, plan.lr, lambda st: lr_factor(st, total, warmup, s.min_lr_ratio), device)
    step = 0
    if state is not None:
        dist.load_full_state(model, optimizer, weights, optim_state, d, s.parallel)
        optimizer.load_scheduler_state(state["scheduler"])
        ckpt.restore_rng(state)
        step = int(state["step"])
        log(f"[train] resumed from {start} at step {step}/{total}")
    fwd = torch.compile(model) if s.compile else model
    return Run(s, d, device, out, plan, model, fwd, optimizer, params, amp, backend, w_draft, w_rest, step)


def start_out(run: Run) -> None:
    """Rank 0 writes the draft config and vocabulary into `out` and drops a half-written checkpoint."""
    if run.d.main:
        run.out.mkdir(parents=True, exist_ok=True)
        ckpt.clean_partial(run.checkpoints)
        run.plan.cfg.save(run.out / "draft_config.json")
        if not (run.out / "vocab.safetensors").exists():
            save_vocab(run.out / "vocab.safetensors", run.plan.d2t, run.plan.t2d)
