"""The device benchmark driver (benchmarks/h200_curve.sh) stops at once on a fresh machine.

Why: the lent GPU goes back after ~30 s idle, taking its background runs with it; a follow-up call that
waited out WAIT_SECONDS for a run that no longer exists spent 200 s of a 30-minute device budget
(4 Dec 2026). The script's home is redirected to an empty folder, as a fresh machine's would be."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("call", ["waitdata", "same", "finish", "rest", "waitruns", "equals"])
def test_curve_script_fails_fast_on_a_fresh_machine(tmp_path, call):
    env = {**os.environ, "H200_HOME": str(tmp_path), "OUT": str(tmp_path / "out"), "WAIT_SECONDS": "300"}
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", "benchmarks/h200_curve.sh", call, "x"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 3, r.stderr
    assert "fresh machine" in r.stderr and "start again with `stage`" in r.stderr
    assert time.monotonic() - t0 < 30  # not the 300 s it was told to wait
    assert not (tmp_path / "repo").exists()  # nothing set up on the way


def test_equals_waits_for_a_running_regeneration_before_setting_up(tmp_path):
    """Right after `regenall`, `equals` reports the regeneration (at most REGEN_WAIT seconds) before its
    setup replaces the code that run is using; then, on this empty home, setup stops for the GGUF."""
    (tmp_path / "lc").mkdir()
    (tmp_path / "lc" / "prep.log").write_text("[regenerate] 10/20 turn (50.0%) 1 turn/s 300 tok/s\n")
    (tmp_path / "out").mkdir()
    env = {**os.environ, "H200_HOME": str(tmp_path), "OUT": str(tmp_path / "out"), "REGEN_WAIT": "1"}
    r = subprocess.run(
        ["bash", "benchmarks/h200_curve.sh", "equals", "a=lr=1e-3"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 3, r.stderr
    assert "300 tok/s" in r.stdout and "still regenerating" in r.stdout  # the report came first
    assert (tmp_path / "out" / "regenall.log").exists()


def test_pack_draft_runs_no_shell_on_a_hostile_work_path(tmp_path, monkeypatch):
    """Benchmarks return drafts as tar parts; the work folder is a user's --work path, so a name with shell
    syntax in it must stay a name (it once went through `shell=True` unquoted). Parts rejoin to the folder."""
    import sys
    import tarfile

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("quality", None)
    import quality

    work = tmp_path / "w; touch PWNED #"
    (work / "export-a").mkdir(parents=True)
    payload = os.urandom(5000)
    (work / "export-a" / "model.safetensors").write_bytes(payload)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    parts = quality.pack_draft(work, "export-a", out, "draft-a.tar.", part_bytes=4096)
    assert [p.name for p in parts] == ["draft-a.tar.00", "draft-a.tar.01", "draft-a.tar.02"]
    assert not list(tmp_path.rglob("PWNED")) and sorted(p.name for p in out.iterdir()) == [p.name for p in parts]
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as t:
        t.extractall(tmp_path / "back", filter="data")
    assert (tmp_path / "back" / "export-a" / "model.safetensors").read_bytes() == payload
