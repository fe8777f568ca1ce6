"""Settings of the data stage (the pipeline composes this dataclass under `data:`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class DataSettings:
    """How chat records become tokenized, loss-masked samples. See docs/data.md."""

    # chat: render with the chat template, supervise the assistant turns; text: plain documents, every
    # token supervised, packed into rows of max_length (base models; text.py); auto: text when the
    # target's tokenizer has no chat template (and none is given), else chat
    mode: Literal["auto", "chat", "text"] = "auto"
    max_length: int = 2048  # tokens per sample; longer samples are truncated or dropped (`overflow`)
    overflow: Literal["truncate", "drop"] = "truncate"
    last_turn_only: bool = False  # supervise only the last assistant turn of each conversation
    # conversation: one sample per conversation, every assistant turn supervised; turn: one sample per
    # assistant turn, the conversation through that turn, supervising that turn only (speculators' rows)
    rows: Literal["conversation", "turn"] = "conversation"
    system_prompt: str | None = None  # replaces (or inserts) the system message of every conversation
    chat_template: str | None = None  # path of a Jinja template file; default: the tokenizer's own
    held_out: float = 0.0  # fraction of kept samples that go to the `heldout` split
    seed: int = 0  # seed of the held-out assignment
    limit: int | None = None  # read only the first N records of each input (quick runs, tests)
    shard_samples: int = 4096  # samples per parquet shard
    workers: int = 0  # processes for rendering + tokenizing; 0 = all CPU cores
    role_map: dict = field(default_factory=dict)  # extra `from`/`role` names -> user|assistant|system|tool
    # input -> how many times its conversations are used (2: twice, 0.5: a seeded half); docs/data.md "Mixing"
    weights: dict = field(default_factory=dict)
    template_timeout: float = (
        10.0  # CPU seconds one conversation may take to render; slower ones are dropped (0 = no bound)
    )

    def __post_init__(self) -> None:
        from nestling.errors import NestlingError

        if self.mode not in ("auto", "chat", "text"):
            raise NestlingError(f"mode must be auto, chat or text, got {self.mode!r}")
        if self.rows not in ("conversation", "turn"):
            raise NestlingError(f"rows must be conversation or turn, got {self.rows!r}")
        if self.max_length < 2:
            raise NestlingError(f"max_length must be at least 2, got {self.max_length}")
        if not 0.0 <= self.held_out < 1.0:
            raise NestlingError(f"held_out is a fraction in [0, 1), got {self.held_out}")
        if self.shard_samples < 1:
            raise NestlingError(f"shard_samples must be positive, got {self.shard_samples}")
        if not (self.template_timeout >= 0 and self.template_timeout < float("inf")):
            raise NestlingError(
                f"template_timeout is CPU seconds per conversation (0 = no bound), got {self.template_timeout}"
            )
        if self.limit is not None and self.limit < 1:
            raise NestlingError(f"limit must be positive, got {self.limit}")
        if self.workers < 0:
            raise NestlingError(f"workers is a number of processes (0 = one per CPU core), got {self.workers}")
        for k, w in self.weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf"):
                raise NestlingError(
                    f"weights.{k}={w!r}: a weight is a positive number (how many times the input's conversations are used)"
                )
        from nestling.data.normalize import ROLES

        bad = {k: v for k, v in self.role_map.items() if v not in ROLES}
        if bad:
            k, v = next(iter(bad.items()))
            raise NestlingError(
                f"role_map.{k}={v!r} maps to no role nestling knows; map each name to one of {', '.join(ROLES)}"
            )
