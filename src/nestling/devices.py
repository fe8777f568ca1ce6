"""Device rules every stage shares: `device: auto`, and where PyTorch's flash-attention kernel runs."""

from __future__ import annotations

from nestling.errors import NestlingError


def resolve_device(device: str) -> str:
    """`choose_device` for this machine."""
    import torch

    return choose_device(device, torch.cuda.is_available())


def choose_device(device: str, cuda: bool) -> str:
    """`auto` -> `cuda` where there is a GPU (`cuda`), else `cpu`; any other name is kept. Asking for
    CUDA on a machine without a GPU fails here with what to do, not later inside torch."""
    if device == "auto":
        return "cuda" if cuda else "cpu"
    if device.startswith("cuda") and not cuda:
        raise NestlingError(f"device {device!r} was asked for but torch sees no CUDA GPU; use device cpu (or auto)")
    return device


def auto_dtype(device: str) -> str:
    """What `dtype: auto` runs a target in: bfloat16 on a GPU, float32 on a CPU (CPUs without bf16
    matrix units run bf16 tens of times slower, and fp32 keeps greedy outputs exact)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def flash_unavailable(dtype, device) -> str | None:
    """None where PyTorch's own flash-attention kernels run (`aten::_flash_attention_forward`: an
    NVIDIA GPU of compute capability 8.0 or newer, bf16 or fp16), else why not, for a log line."""
    import torch

    if device.type != "cuda":
        return "flash attention needs CUDA (this runs on the CPU)"
    if torch.version.hip is not None or torch.cuda.get_device_capability(device) < (8, 0):
        return "PyTorch's flash attention needs an NVIDIA GPU of compute capability 8.0 or newer"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"flash attention needs bf16 or fp16 (the model runs in {str(dtype).replace('torch.', '')})"
    return None
