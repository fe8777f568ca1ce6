"""Settings, manifests, progress and layer ids: the pieces every stage shares."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from nestling.config import from_dict, load_settings, parse_overrides, settings_from_args
from nestling.errors import NestlingError
from nestling.manifest import atomic_write_json, read_manifest, write_manifest
from nestling.progress import Progress
from nestling.targets.layers import (
    default_aux_layers,
    default_capture_layers,
    sglang_layer_ids,
    validate_layer_ids,
    vllm_layer_ids,
)


@dataclass
class Inner:
    lr: float = 1e-3
    layers: list[int] = field(default_factory=lambda: [2, 3])


@dataclass
class Outer:
    name: str = "x"
    steps: int = 10
    flag: bool = False
    inner: Inner = field(default_factory=Inner)


def test_from_dict_types_and_nesting():
    cfg = from_dict(Outer, {"steps": "20", "flag": "true", "inner": {"lr": "3e-4", "layers": "1,5"}})
    assert cfg.steps == 20 and cfg.flag is True
    assert cfg.inner.lr == pytest.approx(3e-4) and cfg.inner.layers == [1, 5]


def test_unknown_key_names_key_and_valid_ones():
    with pytest.raises(NestlingError) as e:
        from_dict(Outer, {"inner": {"lrr": 1}})
    assert "inner.lrr" in str(e.value) and "layers, lr" in str(e.value)


def test_bad_value_type_is_clear():
    with pytest.raises(NestlingError, match="steps: expected int"):
        from_dict(Outer, {"steps": "many"})


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 5\ninner:\n  lr: 0.1\n")
    cfg = load_settings(Outer, p, ["inner.lr=0.5", "name=y"])
    assert (cfg.steps, cfg.inner.lr, cfg.name) == (5, 0.5, "y")
    with pytest.raises(NestlingError, match="key=value"):
        parse_overrides(["oops"])


def test_cli_flags_sit_between_the_config_file_and_key_value_overrides(tmp_path):
    """Every stage CLI reads its settings through settings_from_args: a flag the user gave beats the
    YAML, a key=value beats the flag, and a flag left unset (None) changes nothing."""
    import argparse

    p = tmp_path / "c.yaml"
    p.write_text("steps: 5\nname: yaml\n")
    args = argparse.Namespace(config=p, overrides=["name=kv"], steps=7, name="flag", extra=["steps=9"])
    c = settings_from_args(Outer, args, ("steps", "name"))
    assert (c.steps, c.name) == (7, "kv")
    args.steps = None
    assert settings_from_args(Outer, args, ("steps",)).steps == 5
    assert settings_from_args(Outer, args, ("steps", "name"), args.extra).steps == 9  # overrides given apart


def test_manifest_roundtrip_and_missing(tmp_path):
    with pytest.raises(NestlingError, match="manifest.json is missing"):
        read_manifest(tmp_path, "data")
    write_manifest(tmp_path, "data", {"a": 1}, {"x": "y"}, counts={"kept": 3})
    m = read_manifest(tmp_path, "data")
    assert m["settings"] == {"a": 1} and m["counts"]["kept"] == 3
    with pytest.raises(NestlingError, match="expected 'capture'"):
        read_manifest(tmp_path, "capture")


def test_atomic_write_leaves_no_temp(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"k": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    assert json.loads((tmp_path / "a.json").read_text()) == {"k": 1}


def test_progress_lines_have_rate_and_eta(tmp_path, capsys):
    state = tmp_path / "state.json"
    p = Progress("capture", total=10, unit="samples", interval=0, state_file=state)
    p.update(5, tokens=500)
    err = capsys.readouterr().err
    assert "5/10 samples" in err and "tok/s" in err and "ETA" in err
    assert json.loads(state.read_text())["done"] == 5


def test_layer_ids():
    assert default_aux_layers(30) == [2, 15, 27]
    assert default_capture_layers(61) == [2, 30, 58, 61]
    with pytest.raises(NestlingError, match="valid ids are 0..6"):
        validate_layer_ids([2, 3, 9], 6)
    with pytest.raises(NestlingError, match="final state"):
        validate_layer_ids([1, 2, 3], 6)


def test_engine_layer_ids():
    """docs/architecture.md's table for SmolLM2 (L = 30): vLLM spells nestling's ids the same, SGLang one lower."""
    assert vllm_layer_ids([2, 15, 27]) == vllm_layer_ids([2, 15, 27, 30], 30)[:3] == [2, 15, 27]
    assert sglang_layer_ids([2, 15, 27]) == [1, 14, 26]
    with pytest.raises(NestlingError, match=r"layer ids \[31\] are outside 0..30"):
        vllm_layer_ids([2, 31], 30)


def test_public_api_names_are_the_stage_functions():
    """`from nestling import capture` runs the stage, before and after its subpackage is imported,
    and `import nestling.capture.run` still works (the packages are callable, nestling/stage.py).
    Checked in a fresh interpreter: other tests' imports must not decide what the names are."""
    import subprocess
    import sys

    code = """
import importlib, inspect
import nestling
from nestling.errors import NestlingError
from nestling.stage import resolve
expected = {"prepare_data": "nestling.data.run", "capture": "nestling.capture.run",
            "train": "nestling.train.run", "export": "nestling.export.run",
            "evaluate": "nestling.evaluate.run", "regenerate": "nestling.regenerate.run", "run": "nestling.pipeline.run"}
for sub in ("nestling.capture.run", "nestling.train.data", "nestling.export.contract", "nestling.regenerate.chat",
            "nestling.evaluate.run", "nestling.data.run", "nestling.pipeline"):
    importlib.import_module(sub)
import nestling.capture.run as run_module
for name, module in expected.items():
    fn = getattr(nestling, name)
    assert callable(fn), name
    impl = getattr(importlib.import_module(module), name)
    assert inspect.isfunction(impl), name
    assert resolve(f"{module}:{name}") is impl
try:
    nestling.capture("/nonexistent-data", "/nonexistent-target", "/nonexistent-out")
except NestlingError as e:
    print("stage-error:", e)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "stage-error:" in res.stdout and "does not exist" in res.stdout, res.stdout


BUILD = """
import sys, time
from pathlib import Path
from nestling.assets import build_once

def build(folder):
    folder.mkdir()
    with open(sys.argv[2], "a") as log:
        log.write("built\\n")
    time.sleep(1.0)  # long enough for the other process to arrive while this one builds
    (folder / "config.json").write_text("{}")

print(build_once(Path(sys.argv[1]), build))
"""


def test_a_cache_entry_is_built_once_when_two_processes_ask_at_once(tmp_path):
    """Two runs (or parallel test workers) asking for the same cache entry: one builds, the other
    waits and gets the finished folder; nobody sees half of it."""
    import subprocess
    import sys

    entry, log = tmp_path / "cache" / "model", tmp_path / "builds.log"
    procs = [
        subprocess.Popen([sys.executable, "-c", BUILD, str(entry), str(log)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs == [str(entry)] * 2 and (entry / "config.json").exists()
    assert log.read_text() == "built\n"  # built once
    assert not any(n.name.endswith(".part") for n in entry.parent.iterdir())
