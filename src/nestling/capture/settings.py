"""Settings of the capture stage (YAML keys, `key=value` overrides and CLI flags share these names)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from nestling.errors import NestlingError


@dataclass
class CaptureSettings:
    """How to run the target and how to store what it produces.

    `layers` None means docs/architecture.md's default `[2, L//2, L-3]` plus the final state L. `token_budget`
    bounds padded tokens per forward (batch size x longest sample). `shard_size` is in bytes or with
    a unit (`1GB`, `512MiB`). `dtype` auto is bfloat16 on a GPU and float32 on a CPU (CPUs without
    bf16 matrix units run bf16 tens of times slower); float8 runs the target in auto's dtype and
    stores float8_e4m3fn with a float32 scale per token and layer slot (half of bf16's disk).
    `tensor_parallel_size` N splits every layer over N GPUs: the vllm backend's engines start their own
    workers; the hf backend runs under `torchrun --nproc-per-node N` (capture/tp.py). The vllm backend
    also reads `data_parallel_size`, `max_model_len` (None: the longest sample to capture) and
    `vllm_kv_cache_gib` (the CPU build's KV cache size, VLLM_CPU_KVCACHE_SPACE), and passes
    `enable_expert_parallel` (a MoE target's experts spread whole over the TP ranks instead of sliced)
    and `attention_backend` (vLLM's attention backend by name, e.g. CPU_MLA; None: vLLM's choice,
    except float32 MLA on a CPU, which takes CPU_MLA) to the engine.
    """

    backend: Literal["hf", "vllm"] = "hf"
    layers: list[int] | None = None
    dtype: Literal["auto", "bfloat16", "float32", "float8"] = "auto"
    device: str = "auto"
    device_map: str | None = None
    token_budget: int = 16384
    shard_size: str = "1GB"
    ignore_disk_check: bool = False
    queue_size: int = 4
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_model_len: int | None = None
    vllm_kv_cache_gib: int = 1
    enable_expert_parallel: bool = False
    attention_backend: str | None = None
    progress_interval: float = 5.0

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise NestlingError(f"token_budget must be positive, got {self.token_budget}")
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise NestlingError("tensor_parallel_size and data_parallel_size must be at least 1")
        if self.queue_size < 1:
            raise NestlingError(f"queue_size must be at least 1, got {self.queue_size}")
        parse_size(self.shard_size)
        if self.layers is not None and len(self.layers) < 2:
            raise NestlingError(
                f"layers {list(self.layers)} name no aux layer: give the aux layer ids followed by the final state "
                "L (e.g. --layers 2,15,27,30 for a 30-layer target), or leave --layers out for the default"
            )


def resolve(settings: CaptureSettings) -> CaptureSettings:
    """Replace `auto` device and dtype by what this machine will use (recorded in the manifest)."""
    import dataclasses

    from nestling.devices import resolve_device

    device = resolve_device(settings.device)
    dtype = settings.dtype if settings.dtype == "float8" else compute_dtype(settings, device)
    return dataclasses.replace(settings, device=device, dtype=dtype)


def compute_dtype(settings: CaptureSettings, device: str | None = None) -> str:
    """The dtype the target runs in: auto's rule (bf16 on a GPU, fp32 on a CPU) for auto and for float8,
    whose states are computed at full width and quantized only to be stored."""
    if settings.dtype not in ("auto", "float8"):
        return settings.dtype
    device = device or settings.device
    return "bfloat16" if device.startswith("cuda") or settings.device_map else "float32"


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(size: str | int) -> int:
    """'1GB' -> 10**9, '512MiB' -> 2**29, 4096 -> 4096."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
    if not m or m.group(2).lower() not in _UNITS:
        raise NestlingError(f"shard_size {size!r} is not a size; write e.g. 1GB, 512MiB or a byte count")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise NestlingError(f"shard_size must be at least 1 byte, got {size!r}")
    return n
