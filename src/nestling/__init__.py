"""nestling: train EAGLE-3 draft models for a target LLM and ship them to vLLM and SGLang.

The public API is one function per pipeline stage. Names resolve lazily so that
`import nestling` stays cheap (no torch import until a stage is used).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute"; each stage owns its module.
_API = {
    "prepare_data": "nestling.data.prepare:prepare_data",
    "capture": "nestling.capture.run:capture",
    "train": "nestling.train.loop:train",
    "export": "nestling.export.eagle3:export",
    "evaluate": "nestling.evaluate.run:evaluate",
    "regenerate": "nestling.regenerate:regenerate",
    "run": "nestling.pipeline:run",
}

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'nestling' has no attribute {name!r}")
    module, attr = _API[name].split(":")
    return getattr(importlib.import_module(module), attr)
