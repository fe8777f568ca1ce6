"""benchmarks/base_model.sh: takes a target, a text file and an output folder, says its time and result,
refuses what it does not know, and runs the GPU recipe on the base target before its ngram table (checked
with a `python3` that records its arguments; a real smoke run on a tiny target is in docs/base-models.md)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ["bash", str(ROOT / "benchmarks" / "base_model.sh")]


def _fake_python(tmp_path: Path) -> Path:
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n')
    fake.chmod(0o755)
    return fake


def test_help_says_its_time_and_result():
    r = subprocess.run(SCRIPT + ["--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("usage: bash benchmarks/base_model.sh TARGET TEXT OUT")
    assert "Time" in r.stdout and "Result" in r.stdout


def test_refuses_what_it_does_not_know_and_runs_the_recipe_then_the_table(tmp_path):
    env = {**os.environ, "PYTHON": str(_fake_python(tmp_path))}
    (tmp_path / "t.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "model").mkdir()
    for bad, says in (
        ([], "usage:"),
        (["model", "t.jsonl"], "usage:"),
        (["--bogus", "model", "t.jsonl", "o"], "unknown option --bogus"),
        (["none", "t.jsonl", "o"], "target none: no such"),
        (["model", "none.jsonl", "o"], "text input none.jsonl: no such file"),
    ):
        r = subprocess.run(SCRIPT + bad, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == 2 and says in r.stderr and not (tmp_path / "calls").exists(), (bad, r.stderr)
    cmd = SCRIPT + ["model", "t.jsonl", "o", "train.steps=5", "--k", "3 5", "--", "--until", "eval"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.replace(str(ROOT) + "/", "") for c in calls] == [
        "-m nestling run examples/gpu.yaml target=model inputs=t.jsonl run_dir=o/run train.steps=5 --until eval",
        "- o 1 3 5",
    ]
