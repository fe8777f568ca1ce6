"""Settings of the export stage (YAML keys, `key=value` overrides and CLI flags share these names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ExportSettings:
    format: Literal["eagle3", "speculators"] = "eagle3"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # float weights; d2t/t2d keep theirs
    num_speculative_tokens: int = 3  # written into the speculators layout (vllm serve DRAFT)
    target: str | None = None  # where the target is now, if it moved since training (still fingerprinted)
    checkpoint: str | None = None  # a checkpoints/step-N folder instead of the final model.safetensors

    def __post_init__(self) -> None:
        from nestling.errors import NestlingError

        if self.num_speculative_tokens < 1:
            raise NestlingError(
                f"num_speculative_tokens (--k) is how many tokens the draft proposes per step, at least 1, got "
                f"{self.num_speculative_tokens}"
            )
