"""kill -9 during training, then --resume: the same weights as an uninterrupted run (fp32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from capture_fixture import assert_same_weights, cached_capture, one_thread, run_cli, train_killed_at  # noqa: F401

ARGS = [
    "--steps",
    "12",
    "--ttt-steps",
    "3",
    "batch_tokens=64",
    "draft_vocab_size=100",
    "lr=3e-3",
    "checkpoint_every=4",
    "eval_every=4",
    "log_every=1",
    "progress_interval=100",
]


@pytest.fixture(scope="module")
def capture(tiny_target):
    return cached_capture(tiny_target("llama"))


def _train_losses(out):
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["split"], r["loss"]) for r in recs]


def _train_in_process(capture, out):
    from nestling.cli import main

    assert main(["train", str(capture), "--out", str(out), *ARGS]) == 0


@pytest.mark.slow
def test_kill_then_resume_equals_straight_run(capture, tmp_path):
    straight = tmp_path / "straight"
    _train_in_process(capture, straight)  # one thread, like the subprocesses: bitwise comparable

    out = tmp_path / "killed"
    train_killed_at(capture, out, ARGS, step=4)
    assert not (out / "checkpoints" / "step-00000012").exists()

    r = run_cli(["train", str(capture), "--out", str(out), *ARGS, "--resume"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stderr
    assert_same_weights(straight, out)
    assert _train_losses(straight) == _train_losses(out)
    # the optimizer state came back too: the last checkpoints are identical
    sa = torch.load(straight / "checkpoints" / "step-00000012" / "optimizer.pt", weights_only=True)
    sb = torch.load(out / "checkpoints" / "step-00000012" / "optimizer.pt", weights_only=True)
    parts = ("muon", "adamw") if "muon" in sa else (None,)  # Muon + AdamW (the default), or AdamW alone
    for part in parts:
        pa, pb = (sa[part], sb[part]) if part else (sa, sb)
        assert pa["state"].keys() == pb["state"].keys()
        for i in pa["state"]:
            for name, v in pa["state"][i].items():
                assert torch.equal(v, pb["state"][i][name]), (part, i, name)


def test_resume_from_an_older_checkpoint_keeps_the_newer_ones(capture, tmp_path, capsys):
    """Rotation keeps the highest steps: continuing from step 4 where step 8 exists would delete every new
    checkpoint as it is written, then replace step 8; refused, nothing touched."""
    from nestling.cli import main

    out = tmp_path / "run"
    args = [a if a != "12" else "8" for a in ARGS]
    assert main(["train", str(capture), "--out", str(out), *args]) == 0
    root = out / "checkpoints"
    before = {p.name: (p / "state.json").read_bytes() for p in root.iterdir()}
    assert sorted(before) == ["step-00000004", "step-00000008"]
    (out / "manifest.json").unlink()  # as if killed after step 8's checkpoint
    capsys.readouterr()
    assert main(["train", str(capture), "--out", str(out), *args, "--resume-from", str(root / "step-00000004")]) == 1
    assert "holds checkpoints newer than" in capsys.readouterr().err
    assert {p.name: (p / "state.json").read_bytes() for p in root.iterdir()} == before
