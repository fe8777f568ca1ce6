"""The one interface every capture backend implements: token sequences in, per-token states out.

A backend knows nothing about shards, indexes or disks: the store is independent of it. It returns
the states of a batch *packed* (samples concatenated along tokens, in the order given), because that
is what the store writes and what an engine without padding (vLLM) produces naturally.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from nestling.capture.settings import CaptureSettings
from nestling.errors import NestlingError
from nestling.stage import resolve

# backend name -> "module:class"; imported lazily so that a missing engine only hurts its users.
BACKENDS = {"hf": "nestling.capture.hf:HFBackend", "vllm": "nestling.capture.vllm:VLLMBackend"}


class Backend(ABC):
    """Runs the target prefill-only and returns the states at `layer_ids` (nestling's convention).

    `capture(seqs)` returns a tensor `[sum(len(s)), len(layer_ids), hidden_size]` whose last id is the
    final state after the norm. It may live on an accelerator; the caller copies it to the host.
    """

    layer_ids: list[int]
    hidden_size: int
    dtype: torch.dtype
    device: torch.device

    @abstractmethod
    def capture(self, seqs: list[list[int]]) -> torch.Tensor: ...

    def close(self) -> None:  # noqa: B027  (optional hook, deliberately not abstract)
        """Free the model (default: nothing to do)."""


def make_backend(name: str, target: Path, layer_ids: list[int], settings: CaptureSettings) -> Backend:
    if name not in BACKENDS:
        raise NestlingError(f"unknown capture backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return resolve(BACKENDS[name])(target, layer_ids, settings)
