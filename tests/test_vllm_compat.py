"""The vLLM compat layer: the accepted range, its one constant, and the refusal outside it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from nestling.errors import NestlingError
from nestling.vllm_compat import ANY_ENV, PIN, RANGE, check_version, in_range

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.26.0", True),
        ("0.26.0+cpu", True),
        ("0.29.1", True),
        ("0.32.0", True),
        ("0.34.0", True),
        ("0.34.9", True),
        ("0.25.1", False),
        ("0.26.0rc1", False),
        ("0.35.0", False),
        ("1.0.0", False),
        ("0.10.1", False),
        ("nonsense", False),
    ],
)
def test_version_range(version, ok, monkeypatch):
    monkeypatch.delenv(ANY_ENV, raising=False)
    assert in_range(version) is ok
    if ok:
        check_version(version)
    else:
        with pytest.raises(NestlingError, match=rf"vLLM >= {RANGE[0]}, < {RANGE[1]}.*{version}.*--backend hf"):
            check_version(version, "use `--backend hf` instead")


def test_outside_the_range_goes_on_when_asked(monkeypatch, capsys):
    monkeypatch.setenv(ANY_ENV, "1")
    check_version("0.40.0")
    assert "0.40.0" in capsys.readouterr().err


def test_the_extra_pins_the_accepted_range():
    """pyproject's `vllm` extra and the range nestling accepts are one constant."""
    from packaging.specifiers import SpecifierSet

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{PIN}"]
    spec = SpecifierSet(PIN)
    for v in ["0.25.1", RANGE[0], "0.30.0", "0.34.0", "0.34.9", RANGE[1], "0.36.0"]:
        assert (v in spec) == in_range(v), v
