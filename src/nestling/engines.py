"""Which optional engines this machine has (one answer for every stage that may use vLLM)."""

from __future__ import annotations

import importlib.util


def vllm_installed() -> bool:
    """vLLM can be imported here (found on the path; importing it takes seconds, so it is not done)."""
    return importlib.util.find_spec("vllm") is not None
