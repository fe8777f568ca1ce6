"""Pipeline mechanics with small stand-in stages: keys, skip / resume / redo, --from / --force, status.

The stand-ins are real functions writing real files; only the stage table differs from `nestling run`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from nestling.errors import NestlingError
from nestling.manifest import write_manifest
from nestling.pipeline.run import run
from nestling.pipeline.settings import load_run_config
from nestling.pipeline.stages import Stage
from nestling.pipeline.state import read_state, state_path, write_state
from nestling.pipeline.status import format_status, stage_rows
from nestling.progress import Progress


@dataclass
class RepeatSettings:
    n: int = 3
    progress_interval: float = 5.0


@dataclass
class ScaleSettings:
    scale: int = 2
    parts: int = 4


CALLS: list[tuple[str, str]] = []


def repeat_stage(ctx) -> None:
    CALLS.append(("repeat", str(ctx.out)))
    text = Path(ctx.inputs[0]).read_text().strip()
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "out.txt").write_text(" ".join([text] * ctx.settings.n))
    write_manifest(
        ctx.out, "repeat", {"n": ctx.settings.n}, {}, splits={"train": {"samples": 1, "tokens": ctx.settings.n}}
    )


def scale_stage(ctx) -> None:
    """Writes one part file per step and skips parts already there (resume); fails on request."""
    src = (ctx.dir("repeat") / "out.txt").read_text()
    parts = ctx.out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    prog = Progress("scale", total=ctx.settings.parts, unit="parts", interval=0.0)
    for i in range(ctx.settings.parts):
        p = parts / f"{i}.txt"
        if p.exists():
            prog.update(1, tokens=1)
            continue
        if os.environ.get("STANDIN_FAIL_AT") == str(i):
            raise RuntimeError(f"injected failure at part {i}")
        CALLS.append(("scale-part", str(i)))
        p.write_text(src * ctx.settings.scale)
        prog.update(1, tokens=10)
    (ctx.out / "done.txt").write_text("".join((parts / f"{i}.txt").read_text() for i in range(ctx.settings.parts)))


# A stage declares what it writes: a redo deletes those names only (nestling/outdir.py).
REPEAT_OWNS, SCALE_OWNS = ("out.txt",), ("parts/*.txt", "done.txt")
STAGES = (
    Stage("repeat", RepeatSettings, repeat_stage, uses=("target", "inputs"), owns=REPEAT_OWNS),
    Stage("scale", ScaleSettings, scale_stage, uses=(), owns=SCALE_OWNS),
)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    CALLS.clear()
    monkeypatch.delenv("STANDIN_FAIL_AT", raising=False)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 6}))
    inp = tmp_path / "in.txt"
    inp.write_text("hello")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("target: target\ninputs: [in.txt]\nrun_dir: runs/r1\nrepeat:\n  n: 2\n")
    return tmp_path, cfg


def go(cfg: Path, *overrides: str, **kw):
    return {o.name: o.action for o in run(cfg, list(overrides), stages=STAGES, **kw)}


def test_skip_when_unchanged_and_rerun_after_change(setup):
    tmp, cfg = setup
    assert go(cfg) == {"repeat": "ran", "scale": "ran"}
    out = tmp / "runs/r1/scale/done.txt"
    assert out.read_text() == "hello hello" * 2 * 4
    CALLS.clear()
    assert go(cfg) == {"repeat": "skipped", "scale": "skipped"}
    assert CALLS == []
    # a speed-only setting keeps the key
    assert go(cfg, "repeat.progress_interval=1") == {"repeat": "skipped", "scale": "skipped"}
    # a later stage's setting reruns only that stage
    assert go(cfg, "scale.scale=3") == {"repeat": "skipped", "scale": "ran"}
    assert out.read_text() == "hello hello" * 3 * 4
    # an earlier stage's setting reruns it and everything after it
    assert go(cfg, "scale.scale=3", "repeat.n=1") == {"repeat": "ran", "scale": "ran"}
    assert out.read_text() == "hello" * 3 * 4
    # changed input data changes the first key
    (tmp / "in.txt").write_text("bye")
    assert go(cfg, "scale.scale=3", "repeat.n=1") == {"repeat": "ran", "scale": "ran"}
    assert out.read_text() == "bye" * 3 * 4


def test_interrupted_stage_resumes_in_place(setup, monkeypatch):
    tmp, cfg = setup
    monkeypatch.setenv("STANDIN_FAIL_AT", "2")
    with pytest.raises(RuntimeError, match="injected"):
        go(cfg)
    run_dir = tmp / "runs/r1"
    assert read_state(run_dir, "scale")["status"] == "failed"
    rows = {r["stage"]: r for r in stage_rows(run_dir)}
    assert rows["repeat"]["status"] == "complete" and rows["scale"]["status"] == "failed"
    assert rows["scale"]["done"] == 2 and rows["scale"]["total"] == 4
    assert "injected failure" in format_status(run_dir)
    assert [c for c in CALLS if c[0] == "scale-part"] == [("scale-part", "0"), ("scale-part", "1")]
    CALLS.clear()
    monkeypatch.delenv("STANDIN_FAIL_AT")
    assert go(cfg) == {"repeat": "skipped", "scale": "resumed"}
    assert CALLS == [("scale-part", "2"), ("scale-part", "3")]  # parts 0, 1 were kept
    assert (run_dir / "scale/done.txt").read_text() == "hello hello" * 2 * 4
    # the log holds the progress lines of both attempts, flushed
    log = (run_dir / "run.log").read_text()
    assert log.count("==== ") == 2 and "[scale] 2/4 parts" in log and "failed: RuntimeError" in log


def test_force_and_from(setup):
    tmp, cfg = setup
    go(cfg)
    CALLS.clear()
    assert go(cfg, force=["repeat"]) == {"repeat": "ran", "scale": "skipped"}
    assert go(cfg, from_stage="repeat") == {"repeat": "ran", "scale": "ran"}
    assert go(cfg, from_stage="scale") == {"repeat": "skipped", "scale": "ran"}
    assert go(cfg, "scale.scale=5", until="repeat") == {"repeat": "skipped"}
    with pytest.raises(NestlingError, match="'nope' is not a stage; stages: repeat, scale"):
        go(cfg, from_stage="nope")


def test_changed_setting_wipes_a_partial_stage(setup, monkeypatch):
    tmp, cfg = setup
    monkeypatch.setenv("STANDIN_FAIL_AT", "2")
    with pytest.raises(RuntimeError):
        go(cfg)
    monkeypatch.delenv("STANDIN_FAIL_AT")
    CALLS.clear()
    assert go(cfg, "scale.scale=4") == {"repeat": "skipped", "scale": "ran"}
    assert [c[1] for c in CALLS if c[0] == "scale-part"] == ["0", "1", "2", "3"]  # nothing stale reused
    assert (tmp / "runs/r1/scale/done.txt").read_text() == "hello hello" * 4 * 4


def test_config_errors(setup):
    tmp, cfg = setup
    with pytest.raises(
        NestlingError, match=r"unknown setting 'repeat.m'; valid settings of repeat: n, progress_interval"
    ):
        go(cfg, "repeat.m=1")
    with pytest.raises(
        NestlingError,
        match=r"unknown setting 'trian'.*valid top-level keys: target, inputs, run_dir, prompts, repeat, scale",
    ):
        go(cfg, "trian.steps=1")
    with pytest.raises(NestlingError, match="expected int"):
        go(cfg, "repeat.n=many")
    bad = tmp / "bad.yaml"
    bad.write_text("inputs: [in.txt]\nrun_dir: r\n")
    with pytest.raises(NestlingError, match="no 'target'"):
        go(bad)
    with pytest.raises(NestlingError, match="does not exist"):
        go(cfg, f"target={tmp / 'missing'}")
    with pytest.raises(NestlingError, match="input file .* does not exist"):
        go(cfg, f"inputs={tmp / 'nothing.json'}")
    with pytest.raises(NestlingError, match="not a local folder"):
        go(cfg, "target=HuggingFaceTB/SmolLM2-135M-Instruct")


def test_status_reports_a_killed_run(setup):
    tmp, cfg = setup
    go(cfg)
    run_dir = tmp / "runs/r1"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state = read_state(run_dir, "scale")
    write_state(run_dir, "scale", key=state["key"], status="running", started=state["started"])
    data = json.loads(state_path(run_dir, "scale").read_text())
    data["pid"] = dead.pid
    state_path(run_dir, "scale").write_text(json.dumps(data))
    text = format_status(run_dir)
    assert "interrupted" in text and "repeat" in text and "4/4 parts (100%)" in text
    assert go(cfg) == {"repeat": "skipped", "scale": "resumed"}
    assert {r["stage"]: r["status"] for r in stage_rows(run_dir)} == {"repeat": "complete", "scale": "complete"}


def test_status_of_a_folder_that_is_no_run(tmp_path):
    with pytest.raises(NestlingError, match="not a nestling run folder"):
        format_status(tmp_path)


def test_config_paths_are_relative_to_the_file(setup, monkeypatch):
    tmp, cfg = setup
    monkeypatch.chdir("/")
    config = load_run_config(cfg, STAGES)
    assert Path(config.target) == tmp / "target" and Path(config.run_dir) == tmp / "runs/r1"
    assert config.settings["repeat"].n == 2 and config.settings["scale"].scale == 2


def _dry_scale(s: ScaleSettings) -> ScaleSettings:
    return ScaleSettings(scale=s.scale, parts=1)


DRY_STAGES = (STAGES[0], Stage("scale", ScaleSettings, scale_stage, dry=_dry_scale, owns=SCALE_OWNS))


def test_dry_run_runs_every_stage_in_scratch_and_checks_disk(setup, monkeypatch):
    from nestling.pipeline import dryrun

    tmp, cfg = setup
    report = run(cfg, stages=DRY_STAGES, dry_run=True)
    scratch = tmp / "runs/r1/dry-run"
    assert report["scratch"] == str(scratch)
    assert (scratch / "scale/parts/0.txt").exists() and not (scratch / "scale/parts/1.txt").exists()
    assert not (tmp / "runs/r1/scale").exists()  # the real run folder is untouched
    assert [s["stage"] for s in report["stages"]] == ["repeat", "scale"]
    assert report["need_bytes"] == sum(s["disk_bytes"] for s in report["stages"]) > 0
    assert json.loads((scratch / "estimate.json").read_text())["need_bytes"] == report["need_bytes"]
    monkeypatch.setattr(dryrun, "free_bytes", lambda path: 10)
    with pytest.raises(NestlingError, match=r"not enough disk for the full run: it needs about .* only 10 B is free"):
        run(cfg, stages=DRY_STAGES, dry_run=True)
    # once the real run is complete its outputs are on disk already: nothing more is needed
    go(cfg)
    assert run(cfg, stages=DRY_STAGES, dry_run=True)["need_bytes"] == 0
    assert "dry-run estimate of the full run: 0 B disk" in format_status(tmp / "runs/r1")


def test_one_run_per_folder(setup):
    tmp, cfg = setup
    seen = []

    def nested(ctx) -> None:
        try:
            run(cfg, stages=STAGES)
        except NestlingError as e:
            seen.append(str(e))
        repeat_stage(ctx)

    assert {
        o.name: o.action
        for o in run(cfg, stages=(Stage("repeat", RepeatSettings, nested, owns=REPEAT_OWNS), STAGES[1]))
    } == {"repeat": "ran", "scale": "ran"}
    assert len(seen) == 1 and "another nestling run is using" in seen[0] and f"pid {os.getpid()}" in seen[0]
    assert go(cfg, from_stage="repeat") == {"repeat": "ran", "scale": "ran"}  # the lock is released
