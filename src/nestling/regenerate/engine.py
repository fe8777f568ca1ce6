"""The engine interface: token-id prompts in, completions out; one implementation per backend.

Every engine receives the same already-rendered prompts, so outputs differ only by numerics.
A request that fails comes back with `error` set (and the conversation is recorded as failed);
an engine never drops a request.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Protocol

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
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


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
