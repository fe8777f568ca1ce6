"""nestling: train EAGLE-3 draft models for a target LLM and ship them to vLLM and SGLang.

The public API is one function per pipeline stage:

    from nestling import prepare_data, capture, train, export, evaluate, regenerate, run

Names resolve lazily so that `import nestling` stays cheap (no torch until a stage is used).
`capture`, `train`, `export`, `evaluate` and `regenerate` are also subpackages; those packages are callable
and run their stage (see nestling/stage.py), so both meanings of the name hold.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "prepare_data": "nestling.data.run:prepare_data",
    "capture": "nestling.capture",
    "train": "nestling.train",
    "export": "nestling.export",
    "evaluate": "nestling.evaluate",
    "regenerate": "nestling.regenerate",
    "run": "nestling.pipeline.run:run",
}

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'nestling' has no attribute {name!r}")
    target = _API[name]
    if ":" not in target:
        return importlib.import_module(target)  # a callable stage package
    from nestling.stage import resolve

    return resolve(target)
