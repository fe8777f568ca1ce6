"""kill -9 during capture, run again: the store is byte-identical to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from capture_data import make_data_dir
from capture_fixture import run_cli
from nestling.capture.run import capture
from nestling.capture.settings import CaptureSettings

OPTS = dict(dtype="float32", device="cpu", token_budget=96, shard_size="60KB", progress_interval=60)


def store_files(d: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != "manifest.json"
    }


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float8"])
def test_kill9_then_resume_equals_uninterrupted(tiny_target, tmp_path, dtype):
    """float8 too: its scales are held until a shard's end, and the quantization is deterministic.

    Three processes compute shards here (the uninterrupted run, the killed one, the resumed one), and
    bytes agree across processes only where each computes the same way: the torch thread count decides
    how the CPU GEMMs reduce (on this tiny target, 1 and 2 threads differ in every shard's bytes), and a
    pytest process's own count is whatever earlier tests left (a vLLM engine run in-process replaces
    torch.set_num_threads), which made this test flaky in the full suite. So every capture runs through
    `run_cli`, one thread and no dynamic thread adjustment, on the suite's pinned ISA (conftest.py).
    And what resume promises is checked as such: the shards the killed run finished stay untouched."""
    opts = {**OPTS, "dtype": dtype}
    target = tiny_target("llama")
    tok = AutoTokenizer.from_pretrained(target)
    data = make_data_dir(tmp_path / "data", tok, target, n_train=40, n_heldout=2, seed=3, min_words=8, max_words=24)
    args = ["capture", str(data), "--target", str(target)] + [f"{k}={v}" for k, v in opts.items()]
    ref = tmp_path / "ref"
    r = run_cli([*args, "--out", str(ref)])
    assert r.returncode == 0, r.stdout + r.stderr
    n_shards = len(list((ref / "train").glob("shard-*.safetensors")))
    assert n_shards >= 10

    out = tmp_path / "out"
    proc = run_cli([*args, "--out", str(out)], popen=True)
    deadline = time.monotonic() + 120
    while not list((out / "train").glob("shard-*.safetensors")):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no shard appeared"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert not (out / "manifest.json").exists()
    kept = {k: v for k, v in store_files(out).items() if "/shard-" in k}  # written whole (temp file, rename)
    done = len([k for k in kept if k.startswith("train/")])
    assert done < n_shards, "the run finished before it was killed; the test proves nothing"

    r = run_cli([*args, "--out", str(out)])  # the rerun
    assert r.returncode == 0, r.stdout + r.stderr
    after = store_files(out)
    assert {k: after.get(k) for k in kept} == kept  # finished shards kept as they were
    assert json.loads((out / "train" / "index.json").read_text()) == json.loads(
        (ref / "train" / "index.json").read_text()
    )
    assert after == store_files(ref)
    run_key = json.loads((out / "manifest.json").read_text())["run_key"]
    assert run_key == json.loads((ref / "manifest.json").read_text())["run_key"]
    assert not list(out.rglob(".*.tmp"))


def test_complete_capture_is_skipped_and_damaged_shard_redone(tiny_target, tmp_path, monkeypatch):
    target = tiny_target("llama")
    tok = AutoTokenizer.from_pretrained(target)
    data = make_data_dir(tmp_path / "data", tok, target, n_train=6, n_heldout=0, seed=4)
    out = tmp_path / "out"
    capture(data, target, out, CaptureSettings(**OPTS))
    before = store_files(out)
    import nestling.capture.run as run

    def no_model(*a, **k):
        raise AssertionError("a complete capture must not load the model")

    monkeypatch.setattr(run, "make_backend", no_model)
    capture(data, target, out, CaptureSettings(**OPTS))
    monkeypatch.undo()
    # a shard that is not the planned one (here: truncated) is redone, the others are kept
    shard = sorted((out / "train").glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    capture(data, target, out, CaptureSettings(**OPTS))
    assert store_files(out) == before
