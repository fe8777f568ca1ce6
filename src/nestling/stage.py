"""Stage packages that are also their stage's function: `nestling.capture(...)` runs capture.

`nestling.capture`, `.train`, `.export`, `.evaluate` and `.regenerate` are subpackages *and* public
API functions. Python binds a subpackage to its parent's attribute when it is imported, so a plain
function of the same name would be replaced (or, bound eagerly, would break `import
nestling.capture.run`). Making the package itself callable keeps both meanings.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


def make_callable(package: str, target: str) -> None:
    """Turn `sys.modules[package]` into a module that calls `target` ("module:function")."""

    class StagePackage(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return resolve(target)(*args, **kwargs)

    sys.modules[package].__class__ = StagePackage


def resolve(target: str) -> Any:
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)
