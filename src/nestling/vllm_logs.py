"""vLLM log records nestling knows to be harmless, kept out of a stage's log.

nestling hands vLLM token ids and starts it with `skip_tokenizer_init=True` (capture renders its own
prompts), so vLLM's chat-template warmup in `LLM.__init__` finds no tokenizer and logs a WARNING,
"Chat template warmup failed", with the traceback of `ValueError: Tokenizer not available when
`skip_tokenizer_init=True``. Nothing is wrong, yet a user reads a traceback in a log as a crash.

`HarmlessVllmRecords` drops exactly that record: from the `vllm` logger hierarchy, at WARNING, with that
message and that exception. Every other vLLM record passes, a chat-template warmup that fails for any
other reason included. `quiet_harmless_vllm_logs()` installs it; call it in the process that creates
the `vllm.LLM`, before creating it.
"""

from __future__ import annotations

import logging

WARMUP_MESSAGE = "Chat template warmup failed"
NO_TOKENIZER = ("Tokenizer not available when", "skip_tokenizer_init=True")
# Where vLLM logs it (vLLM 0.32: `vllm/renderers/base.py`, `BaseRenderer.warmup`). A filter on the logger a
# record starts from is checked for that record wherever it propagates, and survives vLLM's own
# `dictConfig`, which replaces the handlers of the `vllm` logger.
KNOWN_ORIGINS = ("vllm.renderers.base",)


def is_harmless(record: logging.LogRecord) -> bool:
    """True for the chat-template warmup warning of an engine started without a tokenizer, only."""
    if record.name != "vllm" and not record.name.startswith("vllm."):
        return False
    if record.levelno != logging.WARNING or record.getMessage() != WARMUP_MESSAGE:
        return False
    exc = record.exc_info[1] if record.exc_info else None
    return isinstance(exc, ValueError) and all(part in str(exc) for part in NO_TOKENIZER)


class HarmlessVllmRecords(logging.Filter):
    """Drops the records `is_harmless` names; keeps everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_harmless(record)


_FILTER = HarmlessVllmRecords()


def quiet_harmless_vllm_logs() -> None:
    """Install the filter on the loggers the record starts from and on the handlers the `vllm` logger has
    now (a record from another vLLM module reaches those). Idempotent; imports nothing from vLLM."""
    targets: list[logging.Filterer] = [logging.getLogger(name) for name in KNOWN_ORIGINS]
    targets += logging.getLogger("vllm").handlers
    for target in targets:
        if _FILTER not in target.filters:
            target.addFilter(_FILTER)
