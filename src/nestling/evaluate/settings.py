"""Settings of the eval stage (YAML keys, `key=value` overrides and CLI flags share these names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nestling.errors import NestlingError


@dataclass
class EvalSettings:
    k: int = 3  # draft tokens per target forward
    engine: Literal["reference", "vllm", "both"] = "reference"
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    max_prompts: int | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # fp32: greedy with/without draft identical
    device: str = "cpu"  # reference decoder only
    seed: int = 0
    max_model_len: int = 2048  # vLLM context; grown to fit the longest prompt + max_new_tokens
    baseline: bool = True  # also run the target alone (tokens/s without the draft, identical-output share)

    def __post_init__(self) -> None:
        """Settings that would measure nothing (no token generated, no draft) are refused here, when
        they are read: otherwise the report says acceptance 1.000 about zero drafts."""
        import math

        for name in ("k", "max_new_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise NestlingError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise NestlingError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise NestlingError(f"max_prompts must be at least 1 (or unset for all), got {self.max_prompts}")
