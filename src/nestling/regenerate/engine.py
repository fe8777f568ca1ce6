"""The engine interface: token-id prompts in, completions out; one implementation per backend.

Every engine receives the same already-rendered prompts, so outputs differ only by numerics.
A request that fails comes back with `error` set (and the conversation is recorded as failed);
an engine never drops a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Protocol

from nestling import engines
from nestling.errors import NestlingError
from nestling.regenerate.settings import RegenerateSettings


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    seed: int


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] | None = None
    num_tokens: int = 0
    finish_reason: str = ""  # "stop" (end of turn) or "length" (max tokens)
    error: str | None = None  # reason, e.g. "server_error"; None when it worked
    detail: str = ""


Follow = Callable[[list[tuple[int, "Completion"]]], list[tuple[int, "Request"]]]
"""Finished (key, completion) pairs -> the (key, request) pairs they lead to (a conversation's next turn)."""


class Engine(Protocol):
    name: str
    max_model_len: int | None  # the engine's own limit when it knows one

    def generate(self, requests: list[Request]) -> list[Completion]: ...

    def close(self) -> None: ...


def waves(engine: Engine, first: list[tuple[int, Request]], follow: Follow) -> None:
    """Run a chain of requests in waves: all of `first` in one `generate` call, then everything they
    led to in the next, and so on (for conversations: turn k of all of them at once). Engines that
    can start a follow-up while other requests still run have their own `stream`."""
    batch = list(first)
    while batch:
        outs = engine.generate([r for _, r in batch])
        batch = follow([(k, o) for (k, _), o in zip(batch, outs)])


def run_chain(engine: Engine, first: list[tuple[int, Request]], follow: Follow) -> None:
    """`engine.stream` where the engine has one, else `waves`."""
    stream = getattr(engine, "stream", None)
    if stream is None:
        waves(engine, first, follow)
    else:
        stream(first, follow)


def resolve_engine(s: RegenerateSettings) -> str:
    if s.engine != "auto":
        return s.engine
    if s.urls:
        return "openai"
    return "vllm" if engines.vllm_installed() else "hf"


CPU_CHUNK, GPU_CHUNK = 64, 2048


def default_chunk_size(engine: str, on_gpu: bool) -> int:
    """Conversations per engine call when `chunk_size` is 0. A GPU needs many requests in flight: on
    an H200 the hf engine ran 8.3k output tok/s with 512 conversations per call, 10.8k with 1,425 and
    25.4k with all 17,571 of ShareGPT, and a 64-conversation call keeps at most 64 of its 1,024 slots
    busy. A chunk is also what a crash loses, so not all of a large set: 2,048 conversations are
    minutes of work for a small target. CPUs and remote servers keep 64."""
    return GPU_CHUNK if on_gpu and engine in ("vllm", "hf") else CPU_CHUNK


def resolve_chunk_size(engine: str, s: RegenerateSettings) -> int:
    """`chunk_size`, or where it is 0 the default for this engine on this machine."""
    if s.chunk_size:
        return s.chunk_size
    import torch

    from nestling.devices import resolve_device

    # vllm takes the GPU when there is one; hf runs where `device` says; a server's device is not ours
    on_gpu = (engine == "vllm" and torch.cuda.is_available()) or (
        engine == "hf" and resolve_device(s.device).startswith("cuda")
    )
    return default_chunk_size(engine, on_gpu)


def make_engine(name: str, target: Path, s: RegenerateSettings, max_model_len: int) -> Engine:
    if name == "vllm":
        from nestling.regenerate.vllm_engine import VLLMEngine

        return VLLMEngine(target, s, max_model_len)
    if name == "openai":
        from nestling.regenerate.openai_engine import OpenAIEngine

        return OpenAIEngine(s)
    if name == "hf":
        from nestling.regenerate.hf_engine import HFEngine

        return HFEngine(target, s)
    raise NestlingError(f"unknown engine {name!r}; choose vllm, openai or hf")
