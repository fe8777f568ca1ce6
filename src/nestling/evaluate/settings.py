"""Settings of the eval stage (YAML keys, `key=value` overrides and CLI flags share these names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from nestling.errors import NestlingError


DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # vLLM's speculative_config.draft_sample_method


def drafting_note(temperature: float, draft_sample_method: str) -> str:
    """` (draft_sample_method M)` where sampling makes the method matter, else nothing: for the log and
    the report's head."""
    return f" (draft_sample_method {draft_sample_method})" if temperature > 0 else ""


@dataclass
class EvalSettings:
    k: int = 3  # draft tokens per target forward
    engine: Literal["auto", "reference", "vllm", "both"] = "auto"  # auto: vllm where installed, else reference
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    # at temperature > 0, how the draft proposes (vLLM's speculative_config.draft_sample_method):
    # greedy (vLLM's default) drafts its argmax, accepted with the target's p(d); probabilistic samples
    # the draft and accepts with min(1, p/q) (docs/eval.md, "Two ways to draft at a temperature")
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    max_prompts: int | None = None
    # auto: bfloat16 on a GPU, float32 on a CPU (fp32: greedy output with and without the draft identical)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"  # reference decoder: auto = cuda where torch sees a GPU, else cpu
    batch_size: int = 0  # prompts the reference decoder runs at once; 0 = all of them
    seed: int = 0
    max_model_len: int = 2048  # vLLM context; grown to fit the longest prompt + max_new_tokens
    baseline: bool = True  # also run the target alone (tokens/s without the draft, identical-output share)

    def __post_init__(self) -> None:
        """Settings that would measure nothing (no token generated, no draft) are refused here, when
        they are read: otherwise the report says acceptance 1.000 about zero drafts."""
        import math

        if self.batch_size < 0:
            raise NestlingError(f"batch_size must be at least 0 (0 = every prompt at once), got {self.batch_size}")
        for name in ("k", "max_new_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise NestlingError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise NestlingError(
                f"draft_sample_method must be greedy (vLLM's default) or probabilistic, got {self.draft_sample_method!r}"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise NestlingError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise NestlingError(f"max_prompts must be at least 1 (or unset for all), got {self.max_prompts}")


def choose(s: EvalSettings, vllm: bool, cuda: bool) -> tuple[EvalSettings, list[str]]:
    """Replace the `auto` engine, device and dtype by what a machine with (`vllm` installed, `cuda` GPU)
    runs -> settings and one line per choice made, saying why. A pure function of its inputs."""
    from nestling.devices import auto_dtype, choose_device

    notes = []
    engine = s.engine
    if engine == "auto":
        engine = "vllm" if vllm else "reference"
        notes.append(
            "engine auto: vLLM (installed here)"
            if vllm
            else "engine auto: nestling's reference decoder (vLLM is not installed here; install it to "
            "measure in the engine that serves the draft)"
        )
    device = choose_device(s.device, cuda)
    if s.device == "auto" and engine != "vllm":
        notes.append(f"device auto: {device} ({'torch sees a GPU' if cuda else 'torch sees no GPU'})")
    # vLLM runs where its build runs: the GPU when there is one
    dtype = auto_dtype("cuda" if engine == "vllm" and cuda else device) if s.dtype == "auto" else s.dtype
    if s.dtype == "auto":
        notes.append(f"dtype auto: {dtype} ({'bf16 on a GPU' if dtype == 'bfloat16' else 'float32 on a CPU'})")
    return dataclasses.replace(s, engine=engine, device=device, dtype=dtype), notes  # type: ignore[arg-type]


def resolve(s: EvalSettings) -> tuple[EvalSettings, list[str]]:
    """`choose` for this machine."""
    import torch

    from nestling.engines import vllm_installed

    return choose(s, vllm_installed(), torch.cuda.is_available())
