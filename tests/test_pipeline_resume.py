"""kill -9 during capture and again during training; `nestling run` then finishes with the very same
draft as an uninterrupted run (tiny target, fp32, real stages, real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import nestling

SRC = str(Path(nestling.__file__).resolve().parents[1])


def config(tmp: Path, target: Path, inputs: Path, run_dir: Path) -> Path:
    cfg = tmp / f"{run_dir.name}.yaml"
    cfg.write_text(f"""
target: {target}
inputs: [{inputs}]
run_dir: {run_dir}
data: {{limit: 16, max_length: 128, held_out: 0.2, workers: 1}}
capture: {{dtype: float32, token_budget: 128, shard_size: 200KB, progress_interval: 0}}
train: {{steps: 6, batch_tokens: 256, checkpoint_every: 2, ttt_steps: 2, draft_vocab_size: 1024,
         eval_every: 3, eval_batches: 1, log_every: 1, progress_interval: 0, dtype: float32, device: cpu}}
export: {{dtype: float32}}
""")
    return cfg


def start(cfg: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, "-m", "nestling", "run", str(cfg), "--until", "export"],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def kill_when(proc: subprocess.Popen, ready, log: Path, timeout: float = 300.0) -> None:
    """SIGKILL the run (its whole process group) as soon as `ready()` holds."""
    t0 = time.monotonic()
    while not ready():
        assert proc.poll() is None, f"run ended before it could be killed:\n{log.read_text()[-3000:]}"
        assert time.monotonic() - t0 < timeout, "timed out waiting for the stage"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def finish(cfg: Path, log: Path) -> str:
    proc = start(cfg, log)
    assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    return log.read_text()


@pytest.mark.slow
def test_kill_during_capture_and_train_then_same_draft(tmp_path, tiny_target, sharegpt_path):
    from safetensors.torch import load_file

    target = tiny_target("llama")
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref_log, log = tmp_path / "ref.log", tmp_path / "killed.log"
    finish(config(tmp_path, target, sharegpt_path, ref_dir), ref_log)

    cfg = config(tmp_path, target, sharegpt_path, run_dir)
    shards = run_dir / "capture" / "train"
    kill_when(
        start(cfg, log),
        lambda: (
            len(list(shards.glob("shard-*.safetensors"))) >= 2 and not (run_dir / "capture" / "manifest.json").exists()
        ),
        log,
    )
    assert not (run_dir / "capture" / "manifest.json").exists()
    kept = sorted(p.name for p in shards.glob("shard-*.safetensors"))

    ckpts = run_dir / "train" / "checkpoints"
    kill_when(
        start(cfg, log),
        lambda: (
            ckpts.exists()
            and any(ckpts.glob("step-*/state.json"))
            and not (run_dir / "train" / "manifest.json").exists()
        ),
        log,
    )
    text = log.read_text()
    assert "capture: resuming the interrupted run" in text and "data: complete" in text
    assert not (run_dir / "train" / "manifest.json").exists()

    text = finish(cfg, log)
    assert "train: resuming the interrupted run" in text and "capture: complete" in text
    assert set(kept) <= {p.name for p in shards.glob("shard-*.safetensors")}

    ref = load_file(ref_dir / "export" / "model.safetensors")
    got = load_file(run_dir / "export" / "model.safetensors")
    assert ref.keys() == got.keys() and len(ref) > 5
    for name in ref:
        assert ref[name].equal(got[name]), f"{name} differs after kill -9 and resume"
