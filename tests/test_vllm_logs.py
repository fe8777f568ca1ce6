"""The filter that keeps vLLM's known-harmless chat-template warmup warning (and its traceback) out of a
stage's log, and every other record in (nestling.vllm_logs). Real logging records, no vLLM import."""

from __future__ import annotations

import logging
import sys

import pytest

from nestling import vllm_logs
from nestling.vllm_logs import HarmlessVllmRecords, quiet_harmless_vllm_logs

NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"


def _exc_info(exc: BaseException):
    """A real exc_info triple, traceback included, as `logger.warning(..., exc_info=True)` records it."""
    try:
        raise exc
    except BaseException:
        return sys.exc_info()


def _record(name="vllm.renderers.base", level=logging.WARNING, msg="Chat template warmup failed", exc=None):
    exc = ValueError(NO_TOKENIZER) if exc is None else exc
    exc_info = _exc_info(exc) if exc is not False else None
    return logging.getLogger(name).makeRecord(name, level, "base.py", 380, msg, (), exc_info)


def test_the_known_warning_is_dropped_and_everything_else_kept():
    keep = HarmlessVllmRecords().filter
    assert not keep(_record())
    assert not keep(_record(name="vllm.entrypoints.llm"))  # the same record from elsewhere in vLLM
    assert keep(_record(exc=ValueError("the template's Jinja is broken")))  # a warmup that really failed
    assert keep(_record(exc=RuntimeError(NO_TOKENIZER)))
    assert keep(_record(exc=False))  # no exception: not the known record
    assert keep(_record(msg="Chat template warmup completed in %.3fs"))
    assert keep(_record(level=logging.ERROR))
    assert keep(_record(name="transformers.tokenization_utils"))  # not vLLM's
    assert keep(_record(name="vllmx.renderers"))


@pytest.fixture
def vllm_logging(monkeypatch):
    """The `vllm` logger with a handler of its own, as vLLM configures it (propagate off); the filters
    installed by the test are removed afterwards."""
    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record)

    root = logging.getLogger("vllm")
    origin = logging.getLogger("vllm.renderers.base")
    handler = Collect(logging.DEBUG)
    monkeypatch.setattr(root, "handlers", [handler])
    monkeypatch.setattr(root, "propagate", False)
    monkeypatch.setattr(origin, "filters", [])
    level = root.level
    root.setLevel(logging.DEBUG)  # setLevel, not the attribute: it clears the loggers' cached levels
    yield seen
    root.setLevel(level)


def test_installed_it_quiets_the_real_logger_path(vllm_logging):
    seen = vllm_logging
    quiet_harmless_vllm_logs()
    quiet_harmless_vllm_logs()  # idempotent
    origin = logging.getLogger("vllm.renderers.base")
    assert origin.filters.count(vllm_logs._FILTER) == 1
    assert logging.getLogger("vllm").handlers[0].filters.count(vllm_logs._FILTER) == 1

    try:
        raise ValueError(NO_TOKENIZER)
    except ValueError:
        origin.warning("Chat template warmup failed", exc_info=True)  # exactly as vLLM logs it
    try:
        raise ValueError("unexpected end of template")
    except ValueError:
        origin.warning("Chat template warmup failed", exc_info=True)
    logging.getLogger("vllm.worker").warning("KV cache: %d tokens", 1024)
    try:  # from another vLLM module: the handler's filter drops it
        raise ValueError(NO_TOKENIZER)
    except ValueError:
        logging.getLogger("vllm.other").warning("Chat template warmup failed", exc_info=True)

    kept = [(r.name, r.getMessage(), str(r.exc_info[1]) if r.exc_info else None) for r in seen]
    assert kept == [
        ("vllm.renderers.base", "Chat template warmup failed", "unexpected end of template"),
        ("vllm.worker", "KV cache: 1024 tokens", None),
    ]
