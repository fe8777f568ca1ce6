"""The one rule for `device: auto` (every stage that runs the target or the draft uses it)."""

from __future__ import annotations

from nestling.errors import NestlingError


def resolve_device(device: str) -> str:
    """`auto` -> `cuda` when torch sees a GPU, else `cpu`; any other name is kept. Asking for CUDA on
    a machine without a GPU fails here with what to do, not later inside torch."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NestlingError(f"device {device!r} was asked for but torch sees no CUDA GPU; use device cpu (or auto)")
    return device
