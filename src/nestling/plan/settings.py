"""Settings of `nestling plan` (flags and `key=value` overrides share these names)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nestling.errors import NestlingError
from nestling.train.settings import TrainSettings


@dataclass
class PlanSettings:
    """The data size, the machine, and the capture/train settings that change the cost.

    `tokens` or `data` (a data-stage folder whose manifest counts them) gives the data size. Sizes
    take units (`96GB`, `4TB`); `disk` None skips the disk check. `gpu_tflops` None assumes GPUs as
    fast as the measured one (an H200). `seq_len` is the typical sample length (attention FLOPs, and
    the smallest capture batch). `backend` auto picks the capture backend that fits (plan/target.py);
    vllm or hf prices that one. `moe_efficiency` is the share of the dense capture rate a MoE target
    reaches (docs/plan.md says where 0.5 comes from). `vllm_check` asks the vLLM installed here whether
    it serves an EAGLE-3 draft beside the target (off: vLLM is not imported, which takes seconds). The
    rest mirror capture's and train's settings of the same names.
    """

    tokens: int | None = None
    data: str | None = None
    gpus: int = 8
    gpu_memory: str = "80GB"
    disk: str | None = None
    gpu_tflops: float | None = None
    memory_utilization: float = 0.9  # share of each GPU's memory a run may use (vLLM's default)
    layers: list[int] | None = None
    seq_len: int = 2048
    backend: str = "auto"
    moe_efficiency: float = 0.5
    token_budget: int = 16384
    batch_tokens: int = TrainSettings.batch_tokens  # the train settings' defaults, so a plan prices the default run
    ttt_steps: int = TrainSettings.ttt_steps
    draft_vocab_size: int = TrainSettings.draft_vocab_size
    draft_layers: int = TrainSettings.draft_layers
    intermediate_size: int = 0
    epochs: float = 1.0
    results: str | None = None  # benchmark results folder (default: the checkout's benchmarks/results)
    vllm_check: bool = True

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise NestlingError(f"gpus must be at least 1, got {self.gpus}")
        if self.tokens is not None and self.tokens < 1:
            raise NestlingError(f"tokens must be positive, got {self.tokens}")
        if not 0 < self.memory_utilization <= 1:
            raise NestlingError(f"memory_utilization is a share of GPU memory in (0, 1], got {self.memory_utilization}")
        for name in ("seq_len", "token_budget", "batch_tokens", "ttt_steps", "draft_layers"):
            if getattr(self, name) < 1:
                raise NestlingError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.draft_vocab_size < 0:
            raise NestlingError(f"draft_vocab_size must be 0 (auto) or positive, got {self.draft_vocab_size}")
        if self.backend not in ("auto", "vllm", "hf"):
            raise NestlingError(f"backend is auto, vllm or hf, got {self.backend!r}")
        if not 0 < self.moe_efficiency <= 1:
            raise NestlingError(
                f"moe_efficiency is a share of the dense capture rate in (0, 1], got {self.moe_efficiency}"
            )
        if not (math.isfinite(self.epochs) and self.epochs > 0):
            raise NestlingError(f"epochs must be positive, got {self.epochs}")
        if self.gpu_tflops is not None and not (math.isfinite(self.gpu_tflops) and self.gpu_tflops > 0):
            raise NestlingError(
                f"gpu_tflops is the GPU's dense bf16 TFLOP/s, a positive number (or unset), got {self.gpu_tflops}"
            )
