"""Settings of the train stage (YAML keys = field names; `key=value` on the command line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class TrainSettings:
    # what to train
    target: str | None = None  # target folder; default: the one recorded in the capture manifest
    aux_layer_ids: list[int] | None = None  # must equal the capture's when given
    ttt_steps: int = 7  # K: draft steps trained per anchor (the engine's num_speculative_tokens)
    ttt_decay: float = 0.8  # step j is weighted decay**j
    draft_vocab_size: int = 32000  # capped at the target vocabulary
    vocab: str | None = None  # reuse an existing vocab.safetensors instead of counting the data
    lm_head_init: Literal["target", "random"] = "target"
    intermediate_size: int = 0  # the draft layer's MLP width; 0 = the target's (engines read it from config.json)
    draft_layers: int = 1  # decoder layers of the draft; layer 0 reads the embedding, later ones are plain Llama layers

    # how long
    epochs: float = 1.0
    steps: int | None = None  # optimizer steps; overrides epochs

    # batches
    batch_tokens: int = 4096  # token budget of one packed microbatch (longer samples are truncated)
    grad_accum: int = 1  # microbatches per optimizer step and rank
    pad_to_budget: bool | None = None  # fixed shapes (default on CUDA: no recompiles)

    # optimizer
    lr: float = 1e-4
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
