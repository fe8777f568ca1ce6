"""A worker process that dies (issue 57, case 2): a data worker killed with SIGKILL (what the out-of-memory
killer sends) mid-run is a clear error naming the process, within seconds (multiprocessing's pool would
wait for the lost task forever), nothing is left running or half-written, and the rerun gives the result
of a run that never lost a worker. The vLLM engine's worker processes: tests/test_faults_vllm.py."""

from __future__ import annotations

import json
import os
import signal
import time

from fault_helpers import Child, strays, temp_files


def test_a_killed_data_worker_is_named_and_the_rerun_completes(tiny_target, sharegpt_path, tmp_path):
    """Killed at the first progress line of 600 conversations, with seconds of work left for both workers,
    so the one killed holds a task (a worker killed while idle loses nothing, and the run just completes)."""
    target = tiny_target("llama")
    out = tmp_path / "data"
    args = ["data", sharegpt_path, "--target", target, "--out", out, "limit=600", "max_length=128", "workers=2"]
    child = Child(args, env={"NESTLING_PROGRESS_INTERVAL": "0"}, stop_at=r"^\[data\] 64/600")
    try:
        child.wait_stopped(240)
        workers = child.snapshot()
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        child.resume()
        assert child.finish(60) == 1, child.text[-3000:]
        assert time.monotonic() - t0 < 20
        assert child.lines[-1] == (
            f"nestling data: error: data worker process {workers[0]} was killed by SIGKILL while tokenizing (the "
            "out-of-memory killer sends SIGKILL: check `dmesg`, or use fewer workers); no shard was marked complete: "
            "run the same command again (workers=1 tokenizes in the main process)"
        )
        assert "Traceback" not in child.text
        assert strays(child) == [] and temp_files(out) == []
        assert not (out / "manifest.json").exists()
    finally:
        child.kill()
    child = Child(args)
    assert child.finish(240) == 0, child.text[-3000:]
    assert json.loads((out / "manifest.json").read_text())["counts"]["read"] == 600
