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


@pytest.mark.parametrize("call", ["waitdata", "same", "finish", "rest", "equals"])
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
