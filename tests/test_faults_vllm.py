"""Faults inside the vLLM engine (issue 57, cases 1 and 2), in the real engine (CPU build): SIGTERM to
nestling's main process only (as `kill` sends it) while vLLM captures, regenerates or evaluates, and a
vLLM worker process killed with SIGKILL (what the out-of-memory killer sends). Each ends within seconds
with one line (what was kept and how to go on, or which engine process died), leaves no process and no
half-written file behind, and the rerun completes keeping what was finished."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from capture_fixture import TINY_TRAIN, cached_capture
from fault_helpers import Child, strays, temp_files
from vllm_capture_helpers import LAYERS, _data

from nestling.capture.store import shard_key
from nestling.capture.verify import verify
from nestling.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ENV = {"NESTLING_PROGRESS_INTERVAL": "0"}


def vllm_worker(child: Child) -> int:
    """The pid of the engine's worker process (`VLLM::Worker`) under `child` (its engine core's: ENGINES)."""
    from fault_helpers import cmdline

    procs = {p: cmdline(p) for p in child.snapshot()}  # its own session's, and a subprocess's in another
    found = [p for p, c in procs.items() if c.startswith("VLLM::Worker")]
    assert len(found) == 1, procs
    ENGINES[child.pid] = next(p for p, c in procs.items() if c.startswith("VLLM::EngineCore"))
    return found[0]


def stopped_then(child: Child, fault) -> float:
    """Wait for the child's stop line, apply `fault`, let it go on; the time the fault was applied."""
    child.wait_stopped(600)
    fault()
    t0 = time.monotonic()
    child.resume()
    return t0


def test_capture_a_dead_worker_then_resume(tiny_target, tmp_path):
    target = tiny_target("llama")
    data = _data(tmp_path, target, n_train=40, n_heldout=0)
    out = tmp_path / "cap"
    args = ["capture", data, "--target", target, "--out", out, "--backend", "vllm", "--device", "cpu"]
    args += ["--dtype", "float32", "--layers", LAYERS, "token_budget=256", "shard_size=40KB"]
    child = Child(args, env=ENV, stop_at=r"^\[capture train\] 3/")
    try:
        pid: list[int] = []
        t0 = stopped_then(child, lambda: (pid.append(vllm_worker(child)), os.kill(pid[0], signal.SIGKILL)))
        assert child.finish(120) == 1, child.text[-3000:]
        assert time.monotonic() - t0 < 60
        n = len(list((out / "train").glob("shard-*.safetensors")))
        assert n >= 1
        assert child.lines[-1] == (
            f"nestling capture: error: the vLLM engine stopped: its process VLLM::Worker (pid {pid[0]}) died, then "
            f"VLLM::EngineCore (pid {child_engine(child)}) stopped (killed, or out of memory: check `dmesg`; vLLM's "
            f"log above has the details); kept {n} finished shard(s) ({size(out)}) in {out}; the rerun captures only "
            "the rest: run the same command again"
        ), child.text[-3000:]
        assert strays(child) == [] and temp_files(out) == []
    finally:
        child.kill()
    kept = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in (out / "train").glob("shard-*.safetensors")}

    child = Child(args)
    assert child.finish(600) == 0, child.text[-3000:]
    assert verify(out) == []
    shards = sorted((out / "train").glob("shard-*.safetensors"))
    for f in shards:
        if f.name in kept:  # finished shards were kept, not written again
            assert (f.stat().st_ino, f.stat().st_mtime_ns) == kept[f.name]
        assert shard_key(f) is not None
    assert len(shards) > len(kept)


ENGINES: dict[int, int] = {}


def child_engine(child: Child) -> int:
    return ENGINES[child.pid]


def size(out: Path) -> str:
    from nestling.progress import format_bytes

    return format_bytes(sum(f.stat().st_size for f in out.glob("*/shard-*.safetensors")))


def test_regenerate_sigterm_then_a_dead_worker_resumed(tiny_target, sharegpt_path, tmp_path):
    """SIGTERM to nestling only, while vLLM generates in its own processes: the engine is shut down with
    nestling. Then a worker killed: the run stops naming it, instead of failing every conversation left
    (before, those were written to failed.jsonl and the run 'completed'). Each time the committed chunks
    and the journal are kept; the rerun answers the rest."""
    target = tiny_target("llama")
    out = tmp_path / "regen"
    args = ["regenerate", sharegpt_path, "--target", target, "--out", out, "--engine", "vllm"]
    args += ["limit=8", "max_turns=1", "max_new_tokens=8", "chunk_size=2", "dtype=float32"]
    child = Child(args, env=ENV, stop_at=r"^\[regenerate\] [1-9]\d*/")
    try:
        t0 = stopped_then(child, lambda: child.signal(signal.SIGTERM))
        assert child.finish(120) == 143, child.text[-3000:]
        assert time.monotonic() - t0 < 60
        last = child.lines[-1]
        assert (
            last.startswith("nestling regenerate: interrupted by SIGTERM; kept ")
            and "answered conversation(s) in" in last
        )
        assert last.endswith("the rerun answers only the rest; run the same command again to continue."), last
        assert strays(child) == [] and temp_files(out) == []
    finally:
        child.kill()
    before = (out / "messages.jsonl").read_bytes() if (out / "messages.jsonl").exists() else b""

    child = Child(args, env=ENV, stop_at=r"^\[regenerate\] [1-9]\d*/")
    try:
        pid: list[int] = []
        t0 = stopped_then(child, lambda: (pid.append(vllm_worker(child)), os.kill(pid[0], signal.SIGKILL)))
        assert child.finish(120) == 1, child.text[-3000:]
        assert time.monotonic() - t0 < 60
        last = child.lines[-1]
        assert last.startswith(
            f"nestling regenerate: error: the vLLM engine stopped: its process VLLM::Worker (pid {pid[0]}) died"
        ), child.text[-3000:]
        assert "answered conversation(s) in" in last and last.endswith("run the same command again"), last
        assert strays(child) == [] and temp_files(out) == []
        assert not (out / "failed.jsonl").exists() or (out / "failed.jsonl").read_bytes() == b""
        # this run resumed the first: what SIGTERM kept is kept again, and more answered before the
        # worker died, if anything (that a rerun then completes is test_regenerate_vllm's kill -9 test)
        after = (out / "messages.jsonl").read_bytes()
        assert after.startswith(before) and before.count(b"\n") <= after.count(b"\n") <= 8
    finally:
        child.kill()


@pytest.fixture(scope="module")
def draft(tiny_target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("draft")
    target = tiny_target("llama")
    assert main(["train", str(cached_capture(target)), "--out", str(root / "t"), "--steps", "2", *TINY_TRAIN]) == 0
    assert main(["export", str(root / "t"), "--out", str(root / "d"), "dtype=float32"]) == 0
    return root / "d"


def test_eval_sigterm_leaves_no_engine_behind(tiny_target, draft, tmp_path):
    """vLLM's eval runs in a subprocess of its own (evaluate/vllm_worker.py): SIGTERM to nestling stops it
    and its engine's processes too, not only nestling."""
    target = tiny_target("llama")
    prompts = _data(tmp_path, target, n_train=2, n_heldout=4)  # a data folder: its held-out prompts
    out = tmp_path / "eval"
    args = ["eval", draft, "--target", target, "--prompts", prompts, "--out", out, "--engine", "vllm"]
    args += ["max_prompts=4", "max_new_tokens=32", "baseline=false", "dtype=float32"]
    child = Child(args, env=ENV, stop_at=r"^\[eval vllm\] ")
    try:
        t0 = stopped_then(child, lambda: child.signal(signal.SIGTERM))
        assert child.finish(120) == 143, child.text[-3000:]
        assert time.monotonic() - t0 < 60
        assert child.lines[-1].startswith("nestling eval: interrupted by SIGTERM; kept nothing of eval"), child.lines[
            -1
        ]
        assert strays(child) == []
    finally:
        child.kill()


def test_eval_a_dead_worker_is_named(tiny_target, draft, tmp_path):
    target = tiny_target("llama")
    out = tmp_path / "eval"
    prompts = _data(tmp_path, target, n_train=2, n_heldout=4)
    args = ["eval", draft, "--target", target, "--prompts", prompts, "--out", out, "--engine", "vllm"]
    args += ["max_prompts=4", "max_new_tokens=32", "baseline=false", "dtype=float32"]
    child = Child(args, env=ENV, stop_at=r"^\[eval vllm\] ")
    try:
        pid: list[int] = []
        stopped_then(child, lambda: (pid.append(vllm_worker(child)), os.kill(pid[0], signal.SIGKILL)))
        assert child.finish(120) == 1, child.text[-3000:]
        last = child.lines[-1]  # the engine core ends within moments of its worker, the subprocess after
        assert last.startswith(
            f"nestling eval: error: the vLLM engine stopped: its process VLLM::Worker (pid {pid[0]}) died"
        ), child.text[-3000:]
        assert last.endswith(
            "(killed, or out of memory: check `dmesg`); nothing of this eval was written: run the same command again"
        ), last
        assert "Traceback" not in child.lines[-1] and strays(child) == []
        assert not out.exists() or not any(out.iterdir())  # nothing half-written: the rerun is a plain eval
    finally:
        child.kill()
