"""Ctrl-C, SIGTERM and SIGHUP at every stage of `nestling run` (issue 57, case 1): each run stops within
seconds with one line that says what was kept and how to resume, leaves no process and no temporary
file behind, records the stage as interrupted, and the rerun finishes with the very result of a run that
was never interrupted (bit for bit: the regenerated answers, data shards, capture store, draft weights
and the eval's decoded tokens and counts).

The signal is sent at the stage's own progress line: the child stops itself right after printing it
(`fault_helpers.Child(stop_at=...)`), the test sends the signal, then lets it go on. Ctrl-C goes to the
whole process group, as a terminal sends it; SIGTERM and SIGHUP to the main process only, as `kill` and
job schedulers do (a data worker or engine process must then be stopped by nestling itself)."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest
from fault_helpers import Child, strays, temp_files

STAGES = {  # stage: its progress line (the first one is where the signal lands)
    "regenerate": r"^\[regenerate\] \d+/\d+ turn",
    "data": r"^\[data\] \d+/\d+ conv",
    "capture": r"^\[capture train\] 1/",
    "train": r"^\[train\] 3/6 steps",  # after the checkpoint of step 2
    "export": r"^\[export\] .* written; reloading it",
    "eval": r"^\[eval reference\] \d+/",
}
NAME = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
CODE = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
# which signal each stage gets; the slow test swaps Ctrl-C and SIGTERM, so each stage sees both
# each stage meets one of the three signals, each signal two stages: one handler serves all three, and
# what a stage keeps does not depend on which signal stopped it
FAST = dict(zip(STAGES, [signal.SIGINT, signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGTERM]))
ENV = {"NESTLING_PROGRESS_INTERVAL": "0"}  # a line per update, so every stage has one mid-way


def config(tmp: Path, target: Path, inputs: Path, run_dir: Path) -> Path:
    cfg = tmp / f"{run_dir.name}.yaml"
    cfg.write_text(f"""
target: {target}
inputs: [{inputs}]
run_dir: {run_dir}
regenerate: {{engine: hf, limit: 24, max_new_tokens: 8, max_turns: 1, dtype: float32, chunk_size: 8}}
data: {{max_length: 128, held_out: 0.2, workers: 1}}
capture: {{dtype: float32, token_budget: 128, shard_size: 50KB}}
train: {{online: false, steps: 6, batch_tokens: 256, checkpoint_every: 2, ttt_steps: 2, draft_vocab_size: 1024,
         eval_every: 3, eval_batches: 1, log_every: 1, dtype: float32, device: cpu}}
export: {{dtype: float32}}
eval: {{engine: reference, max_prompts: 4, max_new_tokens: 16, baseline: false}}
""")
    return cfg


@pytest.fixture(scope="module")
def reference(tiny_target, sharegpt_path, tmp_path_factory) -> Path:
    """The run never interrupted."""
    tmp = tmp_path_factory.mktemp("reference")
    run_dir = tmp / "ref"
    child = Child(["run", config(tmp, tiny_target("llama"), sharegpt_path, run_dir)], env=ENV)
    assert child.finish(600) == 0, child.text
    return run_dir


def interrupt_at(cfg: Path, run_dir: Path, stage: str, sig: int) -> None:
    """Run until `stage`'s progress line, send `sig` there, check how the run stopped."""
    child = Child(["run", cfg], env=ENV, stop_at=STAGES[stage])
    try:
        child.wait_for(STAGES[stage])
        child.wait_stopped()
        child.signal(sig, group=sig == signal.SIGINT)
        child.resume()
        rc = child.finish(120)
        assert child.seconds_since_signal() < 30, f"{stage}: took {child.seconds_since_signal():.0f} s to stop"
        assert rc == CODE[sig], child.text[-3000:]
        last = child.lines[-1]
        assert last.startswith(f"nestling run: interrupted by {NAME[sig]} during {stage}; kept "), child.text[-3000:]
        assert last.endswith("; run the same command again to resume (complete stages are skipped)."), last
        assert "Traceback" not in child.text, child.text[-3000:]
        assert strays(child) == [], stage
        assert temp_files(run_dir) == [], stage
        state = json.loads((run_dir / "state" / f"{stage}.json").read_text())
        assert state["status"] == "interrupted" and state["error"].startswith(("KeyboardInterrupt", "Interrupted"))
        assert last in (run_dir / "run.log").read_text()  # the log has the line too
        check_kept(stage, run_dir, last)
    finally:
        child.kill()


def check_kept(stage: str, run_dir: Path, line: str) -> None:
    """The line names what the rerun will keep, as it is on disk."""
    if stage == "capture":
        n = len(list((run_dir / "capture").glob("*/shard-*.safetensors")))
        assert (f"capture: {n} finished shard(s)" if n else "capture: no finished shard yet") in line, line
    elif stage == "train":
        ckpts = sorted((run_dir / "train" / "checkpoints").glob("step-*"))
        assert ckpts, "no checkpoint before the signal: the stage's line moved"
        assert f"train: checkpoint {ckpts[-1].name} in" in line and "the rerun resumes from it" in line, line
    elif stage == "regenerate":
        assert "answered conversation(s) in" in line, line
    if stage != "regenerate":
        done = list(STAGES)[: list(STAGES).index(stage)]
        assert f"kept {', '.join(done)} complete; {stage}: " in line, line


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(ta[k].dtype == tb[k].dtype and ta[k].equal(tb[k]) for k in ta)


def assert_same_result(ref: Path, got: Path) -> None:
    """Everything the stages promise to reproduce, bit for bit (a capture shard's metadata names its run's
    key, which hashes the data folder's path: its tensors are compared)."""
    for f in [
        "regenerate/messages.jsonl",
        "export/config.json",
        *sorted(p.name for p in (ref / "data").glob("*.parquet")),
    ]:
        f = f if "/" in f else f"data/{f}"
        assert digest(ref / f) == digest(got / f), f"{f} differs from the uninterrupted run"
    tensors = ["export/model.safetensors", "train/model.safetensors"]
    tensors += sorted(str(p.relative_to(ref)) for p in ref.glob("capture/*/shard-*.safetensors"))
    assert len(tensors) > 4
    for f in tensors:
        assert same_tensors(ref / f, got / f), f"{f} differs from the uninterrupted run"
    keep = ("outputs", "forwards", "num_accepted_tokens", "num_draft_tokens", "accepted_per_pos", "acceptance_length")
    a, b = (json.loads((d / "eval" / "report.json").read_text())["engines"]["reference"] for d in (ref, got))
    assert {k: a[k] for k in keep} == {k: b[k] for k in keep}


def interrupted_everywhere(reference: Path, tiny_target, sharegpt_path, tmp: Path, signals: dict) -> None:
    run_dir = tmp / "interrupted"
    cfg = config(tmp, tiny_target("llama"), sharegpt_path, run_dir)
    for stage in STAGES:
        interrupt_at(cfg, run_dir, stage, signals[stage])
    child = Child(["run", cfg], env=ENV)
    assert child.finish(600) == 0, child.text[-3000:]
    assert "eval: resuming the interrupted run" in child.text
    assert_same_result(reference, run_dir)


def test_a_signal_at_every_stage_then_the_same_result(reference, tiny_target, sharegpt_path, tmp_path):
    interrupted_everywhere(reference, tiny_target, sharegpt_path, tmp_path, FAST)


def test_a_signal_to_a_stage_command_says_how_to_continue(tiny_target, sharegpt_path, tmp_path):
    """Outside `nestling run`: `nestling data` with worker processes, SIGTERM to the main process only,
    stops its workers; `nestling train` says what it kept and that --resume continues."""
    from capture_fixture import TINY_TRAIN, cached_capture

    target = tiny_target("llama")
    data = tmp_path / "data"
    child = Child(
        ["data", sharegpt_path, "--target", target, "--out", data, "limit=200", "workers=2", "max_length=128"],
        env=ENV,
        stop_at=r"^\[data\] \d+/200",
    )
    child.wait_stopped(240)
    child.signal(signal.SIGTERM)
    child.resume()
    assert child.finish(60) == 143, child.text[-3000:]
    assert child.lines[-1] == (
        f"nestling data: interrupted by SIGTERM; kept no data shards: the data stage starts over in {data}; "
        "run the same command again to continue."
    )
    assert strays(child) == [] and temp_files(data) == []

    out = tmp_path / "train"
    args = ["train", cached_capture(target), "--out", out, "--steps", "8", "checkpoint_every=2", *TINY_TRAIN]
    child = Child(args, env=ENV, stop_at=r"^\[train\] 3/8 steps")
    child.wait_stopped(240)
    child.signal(signal.SIGINT, group=True)
    child.resume()
    assert child.finish(60) == 130, child.text[-3000:]
    assert child.lines[-1] == (
        f"nestling train: interrupted by Ctrl-C; kept checkpoint step-00000002 in {out / 'checkpoints'}; the rerun "
        "resumes from it; run the same command with --resume to continue."
    )
    assert strays(child) == [] and temp_files(out) == []
    child = Child([*args, "--resume"], env=ENV)
    assert child.finish(240) == 0, child.text[-3000:]
    assert "step-00000002" in child.text


def test_the_command_line_in_a_callers_process_leaves_its_signal_handlers(tmp_path):
    """`nestling.cli.main` called from a program (or a test) puts back the handlers it found."""
    from nestling.cli import main

    def mine(signum, frame):
        pass

    old = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        main(["status", str(tmp_path / "nothing")])
        assert all(signal.getsignal(s) is mine for s in old)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_a_stopped_text_regeneration_counts_its_documents(tmp_path):
    """A base target's regeneration writes text.jsonl: what a stop keeps is counted there, as documents
    (the state's byte count vouches for three rows; a torn fourth and the journal's one row count as
    the state and journal say)."""
    from nestling.interrupt import kept

    (tmp_path / "text.jsonl").write_bytes(b'{"text": "a"}\n' * 3 + b'{"text": "torn')
    (tmp_path / "state.json").write_text(json.dumps({"bytes": {"text.jsonl": 14 * 3, "failed.jsonl": 0}}))
    (tmp_path / "partial.jsonl").write_text('{"row": 1}\n')
    assert kept("regenerate", tmp_path) == f"4 continued document(s) in {tmp_path}; the rerun answers only the rest"
    (tmp_path / "state.json").write_text(json.dumps({"bytes": {"text.jsonl": 14, "failed.jsonl": 0}}))
    assert kept("regenerate", tmp_path).startswith("2 continued document(s)")
