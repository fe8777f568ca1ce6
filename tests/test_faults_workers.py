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


def test_a_dead_engine_stops_regenerate_and_keeps_what_finished(tiny_target, tmp_path, monkeypatch, capsys):
    """An engine whose processes died answers every request left with vLLM's EngineDeadError. Those are
    not failed conversations (recorded as such, the run 'completed' with them lost for good): the run
    stops, keeps the chunks and conversations that finished, and the rerun answers the rest. The real
    engine: tests/test_faults_vllm.py; here the hf engine returns vLLM's error from its second call on."""
    from hostile_helpers import cli, fails_cleanly

    from nestling.regenerate import hf_engine
    from nestling.regenerate.engine import Completion, waves

    src = tmp_path / "in.jsonl"
    src.write_text("".join(
        json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": f"Say {i}."}, {"from": "gpt", "value": "x"}]})
        + "\n"
        for i in range(8)
    ))  # fmt: skip
    real, calls = hf_engine.HFEngine.generate, []

    def dying(self, requests):
        calls.append(len(requests))
        if len(calls) > 1:
            return [Completion(error="engine_error", detail="EngineDeadError: EngineCore encountered an issue.")] * len(
                requests
            )
        return real(self, requests)

    monkeypatch.setattr(hf_engine.HFEngine, "stream", lambda self, first, follow: waves(self, first, follow))
    monkeypatch.setattr(hf_engine.HFEngine, "generate", dying)
    out = tmp_path / "regen"
    args = ["regenerate", src, "--target", tiny_target("llama"), "--out", out, "--engine", "hf"]
    args += ["chunk_size=4", "max_new_tokens=4", "dtype=float32"]
    msg = fails_cleanly(capsys, *args)
    assert msg.startswith("error: the vLLM engine stopped: one of its processes died"), msg
    assert f"kept 4 answered conversation(s) in {out}; the rerun answers only the rest" in msg, msg
    assert (out / "messages.jsonl").read_bytes().count(b"\n") == 4
    assert not (out / "failed.jsonl").exists() or (out / "failed.jsonl").read_bytes() == b""
    monkeypatch.setattr(hf_engine.HFEngine, "generate", real)
    rc, err = cli(capsys, *args)
    assert rc == 0, err
    assert "8 kept, 0 failed" in err
