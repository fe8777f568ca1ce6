"""Typed settings: dataclasses per stage, loaded from YAML and overridden with `key=value`.

Each stage defines its own settings dataclass next to its code; this module only holds the
machinery they share. Unknown keys are errors that name the valid ones, because a typo in a
config must never be silently ignored.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from nestling.errors import NestlingError

T = TypeVar("T")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except NestlingError as e:
                errors.append(str(e))
        raise NestlingError(errors[0] if errors else f"{where}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # type: ignore[arg-type]
            return value
        if not isinstance(value, dict):
            raise NestlingError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)  # type: ignore[arg-type]
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise NestlingError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise NestlingError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is typing.Literal:
        if value not in args:
            raise NestlingError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise NestlingError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise NestlingError(f"{where}: expected a number, got {value!r}")
        try:
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return tp(value)
        except (TypeError, ValueError):
            raise NestlingError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)):
            raise NestlingError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if tp is Path:
        return Path(value)
    return value


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys raise an error naming the valid ones."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    unknown = [k for k in data if k not in fields]
    if unknown:
        prefix = f"{where}." if where else ""
        raise NestlingError(
            f"unknown setting '{prefix}{unknown[0]}'; valid settings{' of ' + where if where else ''}: "
            + ", ".join(sorted(fields))
        )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(obj: Any) -> dict:
    """Plain-data view of a settings object (for manifests and fingerprints)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(obj)


def load_yaml(path: Path) -> dict:
    from nestling.inputs import read_text

    path = Path(path)
    text = read_text(path, "config file")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise NestlingError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise NestlingError(f"{path}: the top level must be a mapping of settings")
    return data


def parse_overrides(items: list[str]) -> dict:
    """Turn ['train.lr=1e-4', 'data.max_length=512'] into a nested dict (values parsed as YAML)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise NestlingError(f"override {item!r} must look like key=value (e.g. train.lr=3e-4)")
        key, raw = item.split("=", 1)
        value = _override_value(key, raw)
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise NestlingError(f"override {item!r}: {p} was given a value earlier and cannot also hold settings")
        node[parts[-1]] = value
    return out


def _override_value(key: str, raw: str) -> Any:
    """The YAML value of one override; YAML that does not parse (or asks for a Python object with a
    `!!python/...` tag, which safe_load refuses) is the user's typo, named with its key."""
    if not raw:
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise NestlingError(
            f"override {key}={raw[:80]!r} is not a plain YAML value ({why}); quote a string, e.g. {key}='\"...\"'"
        ) from None


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_settings(cls: type[T], path: Path | None = None, overrides: list[str] | None = None, **given: Any) -> T:
    """Settings from YAML (optional), then explicit keyword values, then `key=value` overrides."""
    data = load_yaml(path) if path else {}
    data = merge(data, {k: v for k, v in given.items() if v is not None})
    data = merge(data, parse_overrides(overrides or []))
    return from_dict(cls, data)


def settings_from_args(cls: type[T], args: Any, flags: tuple[str, ...], overrides: list[str] | None = None) -> T:
    """A stage CLI's settings: `--config`, then the named flags the user gave (argparse attributes of the
    same name as the settings field; unset ones are None), then `key=value` overrides (`args.overrides`
    unless given). One rule for every stage, so a flag and its key=value twin always agree."""
    given = {f: getattr(args, f) for f in flags}
    return load_settings(cls, args.config, args.overrides if overrides is None else overrides, **given)
