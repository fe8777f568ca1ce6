"""Settings of the train stage (YAML keys = field names; `key=value` on the command line)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from nestling.errors import NestlingError


@dataclass
class TrainSettings:
    # what to train
    target: str | None = None  # target folder; default: the one recorded in the capture manifest
    aux_layer_ids: list[int] | None = None  # must equal the capture's when given
    # the defaults are the measured best (docs/train.md, "Recipe options"): K = 3, equal step weights, Muon
    ttt_steps: int = 3  # K: draft steps trained per anchor (the engine's num_speculative_tokens)
    ttt_decay: float = 1.0  # step j is weighted decay**j (1.0 = equal weights, as speculators)
    # tokens the draft can propose, capped at the target vocabulary; 0 = auto: the fewest most frequent that
    # cover 99% of the training split's supervised tokens, at least 32,000 (draft/vocab.py, AUTO_COVERAGE)
    draft_vocab_size: int = 0
    vocab: str | None = None  # reuse an existing vocab.safetensors instead of counting the data
    lm_head_init: Literal["target", "random"] = "target"
    # keep lm_head at the target's rows (not trained, not in the optimizer); unset = frozen when it starts
    # from them (lm_head_init=target). Frozen won at equal data by +0.10-0.12 tokens per target forward
    # in vLLM (2 prompt sets) and tied at the demo's budget (docs/train.md, "Recipe options")
    freeze_lm_head: bool | None = None
    intermediate_size: int = 0  # the draft layer's MLP width; 0 = the target's (engines read it from config.json)
    draft_layers: int = 1  # decoder layers of the draft; layer 0 reads the embedding, later ones are plain Llama layers
    # draft norms (docs/train.md, "EAGLE-3.1 norms"); vLLM 0.32 reads them from config.json. The two
    # EAGLE-3.1 norms are on by default: +0.17 tokens per target forward in vLLM at K = 3 (45M tokens,
    # 2 layers), 1.15 -> 1.33 in the CPU demo (1 layer); SGLang at 03d5a77 ignores them (export says so)
    draft_fc_norm: bool = True  # EAGLE-3.1: one RMSNorm per aux state before fc (vLLM's fc_norm)
    draft_norm_output: bool = True  # EAGLE-3.1: the next draft step reads the normed h (vLLM's norm_output)
    draft_norm_before_residual: bool = (
        False  # layer 0's residual is hidden_norm(g), not g (vLLM's norm_before_residual)
    )
    # online: run the target batch by batch on the training device (DIR = the data stage's folder)
    # instead of reading a capture; auto = decided by `nestling run` (docs/train.md), an error in `nestling train`
    online: bool | Literal["auto"] = "auto"
    target_dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # online target; auto = capture's rule
    heldout_data: str | None = (
        None  # online: evaluate on this data folder (all its samples) instead of DIR's held-out split
    )

    # how long
    epochs: float = 1.0
    steps: int | None = None  # optimizer steps; overrides epochs

    # batches
    batch_tokens: int = 4096  # token budget of one packed microbatch (longer samples are truncated)
    grad_accum: int = 1  # microbatches per optimizer step and rank
    pad_to_budget: bool | None = None  # fixed shapes (default on CUDA: no recompiles)

    # optimizer
    lr: float | None = None  # None: default_lr(hidden size, steps), logged with the reason
    optimizer: Literal["adamw", "muon"] = "muon"  # muon: Muon for the 2-D hidden matrices, AdamW for the rest
    muon_lr: float | None = None  # Muon group's lr; None = lr (speculators 0.9.0)
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    hidden_noise: float = 0.0  # uniform noise in [-x, x] on the aux states fed to fc, training only (0 = off)
    min_lr_ratio: float = 0.0
    warmup_steps: int | None = None  # default: warmup_ratio of all steps
    warmup_ratio: float = 0.02
    weight_decay: float = 0.0
    betas: list[float] | None = None  # default [0.9, 0.95]
    grad_clip: float = 0.5
    seed: int = 0

    # precision and device
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # autocast dtype; master weights stay fp32
    attention: Literal["auto", "mask", "flex"] = "auto"
    compile: bool = False  # torch.compile the draft's layer halves
    parallel: Literal["ddp", "fsdp"] = "ddp"  # under torchrun
    teacher_chunk: int = 1024  # tokens per teacher-head chunk

    # bookkeeping
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    eval_every: int = 500
    eval_batches: int = 50  # held-out microbatches per evaluation (0 = no evaluation)
    log_every: int = 10
    progress_interval: float = 5.0

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)
        _check_positive("muon_lr", self.muon_lr)
        if self.steps is not None and self.steps < 1:
            raise NestlingError(
                f"steps must be at least 1 (an untrained draft is no result), got {self.steps}; "
                "or leave it unset to train `epochs` passes"
            )
        _check_positive("epochs", self.epochs)
        if self.draft_vocab_size < 0:
            raise NestlingError(
                "draft_vocab_size is the number of tokens the draft can propose (0 = auto: from the data's "
                f"coverage), got {self.draft_vocab_size}"
            )
        for name in ("min_lr_ratio", "warmup_ratio"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0 <= v <= 1):
                raise NestlingError(f"{name} is a fraction in [0, 1], got {v}")
        for name in ("weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise NestlingError(f"{name} must be a finite number >= 0 (0 = off), got {v}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise NestlingError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.optimizer not in ("adamw", "muon"):
            raise NestlingError(f"optimizer must be adamw or muon, got {self.optimizer!r}")
        if not (math.isfinite(self.hidden_noise) and self.hidden_noise >= 0):
            raise NestlingError(
                f"hidden_noise is the half-width of uniform noise, >= 0 (0 = off), got {self.hidden_noise}"
            )
        if not (math.isfinite(self.ttt_decay) and self.ttt_decay > 0):
            raise NestlingError(f"ttt_decay must be > 0 (1.0 = equal step weights), got {self.ttt_decay}")
        if not 0 <= self.muon_momentum < 1 or self.muon_weight_decay < 0:
            raise NestlingError(
                f"muon_momentum must lie in [0, 1) and muon_weight_decay be >= 0, got "
                f"{self.muon_momentum} and {self.muon_weight_decay}"
            )
        if self.freeze_lm_head and self.lm_head_init != "target":
            raise NestlingError(
                "freeze_lm_head keeps lm_head at its initial rows, which only makes sense for "
                "lm_head_init=target (a frozen random head cannot predict anything); drop "
                "freeze_lm_head=true (unset, it trains a random head)"
            )

    @property
    def head_frozen(self) -> bool:
        """freeze_lm_head as resolved: unset, the head is frozen when it starts at the target's rows."""
        return self.freeze_lm_head if self.freeze_lm_head is not None else self.lm_head_init == "target"


def draft_norms(s: TrainSettings) -> dict[str, bool]:
    """The draft norm settings as DraftConfig fields (`draft_fc_norm` -> `fc_norm`, ...)."""
    from nestling.draft.model import NORM_OPTIONS

    return {k: bool(getattr(s, NORM_SETTING_PREFIX + k)) for k in NORM_OPTIONS}


NORM_SETTING_PREFIX = "draft_"  # train setting `draft_X` = DraftConfig field / config.json key `X`


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise NestlingError(f"{name} must be a positive number (or left unset for the default), got {value}")


# ---- the default learning rate -------------------------------------------------------------------------

# Measured anchors (docs/results/recipe.md, "The learning rate"): 2e-3 was the best lr for SmolLM2-135M
# (hidden 576) at a short budget; 1e-4 is the usual value for 8B-class (hidden 4096) targets.
SMALL_HIDDEN, SMALL_LR = 576, 2e-3
LARGE_HIDDEN, LARGE_LR = 4096, 1e-4


def default_lr(hidden_size: int, total_steps: int) -> float:
    """The lr used when `lr` is unset: SMALL_LR at hidden <= 576, LARGE_LR at hidden >= 4096, and in
    between linear in log(lr) against log(hidden). `total_steps` is taken so that the rule can
    depend on the budget once that is measured; today it does not."""
    del total_steps  # not used yet: see the docstring
    h = min(max(hidden_size, SMALL_HIDDEN), LARGE_HIDDEN)
    f = math.log(h / SMALL_HIDDEN) / math.log(LARGE_HIDDEN / SMALL_HIDDEN)
    return math.exp(math.log(SMALL_LR) + f * (math.log(LARGE_LR) - math.log(SMALL_LR)))


def resolve_lr(s: TrainSettings, hidden_size: int, total_steps: int) -> tuple[float, str]:
    """(lr, why): the given lr, or default_lr's with the inputs it was derived from."""
    if s.lr is not None:
        return s.lr, "given"
    lr = default_lr(hidden_size, total_steps)
    return lr, (
        f"default for hidden size {hidden_size} (2e-3 at <= {SMALL_HIDDEN}, 1e-4 at >= {LARGE_HIDDEN}, "
        "log-linear between; set lr= to override)"
    )
