"""Hostile and careless inputs: nestling never deletes or overwrites files it did not write, never
writes into or over its own inputs, never runs code from a checkpoint, and lets one writer at a time
into a folder (docs/safety.md). Every case goes through the real command line (`nestling.cli.main`,
or a subprocess where two processes are the point) on tiny random-weight targets, and checks the
exact outcome: exit status, a message that names the problem, no traceback, foreign bytes untouched."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from capture_fixture import RunsAShellCommand, cached_capture, one_thread, run_cli, threads  # noqa: F401 (autouse fixture)

from nestling.cli import main

TRAIN = [
    "--ttt-steps",
    "2",
    "batch_tokens=64",
    "draft_vocab_size=100",
    "lr=3e-3",
    "checkpoint_every=1",
    "eval_every=0",
    "progress_interval=100",
]
CHAT = {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello! How can I help?"}]}


# ---- fixtures: one real folder per stage, built once ---------------------------------------------


@pytest.fixture(scope="module")
def target(tiny_target) -> Path:
    return tiny_target("llama")


@pytest.fixture(scope="module")
def capture(target) -> Path:
    return cached_capture(target)


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text(json.dumps(CHAT) + "\n")
    return path


@pytest.fixture(scope="module")
def data_dir(chat, target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "data"
    assert main(["data", str(chat), "--target", str(target), "--out", str(out), "workers=1"]) == 0
    return out


@pytest.fixture(scope="module")
def trained(capture, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "train"
    with threads(1):
        assert main(["train", str(capture), "--out", str(out), "--steps", "2", *TRAIN]) == 0
    return out


@pytest.fixture(scope="module")
def draft(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "draft"
    assert main(["export", str(trained), "--out", str(out)]) == 0
    return out


# ---- helpers ------------------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes: equal snapshots = nothing written, nothing lost."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def foreign_folder(path: Path) -> dict[str, bytes]:
    """A user's folder: a parquet named like a data shard, a manifest of someone else's, a note."""
    path.mkdir(parents=True)
    (path / "train-00007.parquet").write_bytes(os.urandom(256))
    (path / "manifest.json").write_text('{"owner": "someone else"}\n')
    (path / "notes.txt").write_text("my thesis, no backup\n")
    return snapshot(path)


def refused(argv: list[str], capsys, *needles: str) -> str:
    """Run the CLI; assert it exits 1 with a clean message holding every needle; return the message."""
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    message = err.strip().splitlines()[-1]
    assert message.startswith(f"nestling {argv[0]}: error: "), err
    for needle in needles:
        assert needle in message, (needle, err)
    return message


FOREIGN = ("is not empty and was not written by nestling", "never writes over or deletes files it did not write")


# ---- a non-empty folder nestling did not write is never written to ------------------------------


def test_export_refuses_a_foreign_folder(trained, tmp_path, capsys):
    before, train_before = foreign_folder(tmp_path / "mine"), snapshot(trained)
    refused(["export", str(trained), "--out", str(tmp_path / "mine")], capsys, *FOREIGN, "notes.txt")
    assert snapshot(tmp_path / "mine") == before and snapshot(trained) == train_before


def test_data_refuses_a_foreign_folder_and_another_stages_folder(chat, target, trained, tmp_path, capsys):
    before = foreign_folder(tmp_path / "mine")
    refused(
        ["data", str(chat), "--target", str(target), "--out", str(tmp_path / "mine"), "workers=1"], capsys, *FOREIGN
    )
    assert snapshot(tmp_path / "mine") == before
    train_before = snapshot(trained)
    refused(
        ["data", str(chat), "--target", str(target), "--out", str(trained), "workers=1"],
        capsys,
        "holds the output of `nestling train`, not of `nestling data`",
    )
    assert snapshot(trained) == train_before


def test_capture_train_eval_regenerate_refuse_a_foreign_folder(
    data_dir, capture, draft, chat, target, tmp_path, capsys
):
    mine = tmp_path / "mine"
    before = foreign_folder(mine)
    for argv in (
        ["capture", str(data_dir), "--target", str(target), "--out", str(mine)],
        ["train", str(capture), "--out", str(mine), "--steps", "1", *TRAIN],
        ["eval", str(draft), "--target", str(target), "--prompts", str(chat), "--out", str(mine)],
        ["regenerate", str(chat), "--target", str(target), "--out", str(mine), "--engine", "hf"],
    ):
        refused(argv, capsys, *FOREIGN)
        assert snapshot(mine) == before, argv[0]


def test_a_folder_path_that_is_a_file_is_refused(capture, tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("keep me")
    refused(["train", str(capture), "--out", str(f), "--steps", "1", *TRAIN], capsys, "exists and is not a folder")
    assert f.read_text() == "keep me"


def test_run_refuses_a_foreign_stage_folder(chat, target, tmp_path, capsys):
    run_dir = tmp_path / "run"
    before = foreign_folder(run_dir / "data")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"target: {target}\ninputs: [{chat}]\nrun_dir: {run_dir}\ndata:\n  workers: 1\n")
    refused(["run", str(cfg)], capsys, f"run_dir {run_dir} is not empty and was not written by nestling", "run_dir")
    assert snapshot(run_dir / "data") == before and sorted(p.name for p in run_dir.iterdir()) == ["data"]
    # inside a run folder of nestling's own, the stage folder is still checked on its own
    (run_dir / "run.json").write_text("{}")
    refused(
        ["run", str(cfg)],
        capsys,
        f"the data folder of run_dir {run_dir / 'data'} is not empty and was not written by nestling",
        "set run_dir to a new folder",
    )
    assert snapshot(run_dir / "data") == before


def test_run_keeps_a_stage_folder_the_user_filled_after_an_earlier_run(chat, target, tmp_path, capsys):
    """The run's state says data ran here, but the unmarked data folder now holds the user's files (one named
    like a shard): --force data must refuse, not take the folder back and delete the shard-named file."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text("{}")
    (run_dir / "state").mkdir()
    (run_dir / "state" / "data.json").write_text('{"stage": "data", "status": "complete"}')
    before = foreign_folder(run_dir / "data")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"target: {target}\ninputs: [{chat}]\nrun_dir: {run_dir}\ndata:\n  workers: 1\n  held_out: 0.5\n")
    refused(["run", str(cfg), "--force", "data"], capsys, f"the data folder of run_dir {run_dir / 'data'} is not empty")
    assert snapshot(run_dir / "data") == before


def test_run_refuses_a_foreign_run_dir_before_writing_anything(chat, target, tmp_path, capsys):
    """`run_dir: .` in a project folder, or the home folder: its own run.json-less files, a lock-named file
    and a state/ folder stay as they were (the run folder was once taken, emptied and rewritten)."""
    run_dir = tmp_path / "project"
    before = foreign_folder(run_dir)
    (run_dir / ".lock").write_text("my lock file\n")
    (run_dir / "state").mkdir()
    (run_dir / "state" / "data.json").write_text('{"mine": true}\n')
    before = snapshot(run_dir)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"target: {target}\ninputs: [{chat}]\nrun_dir: {run_dir}\ndata:\n  workers: 1\n  held_out: 0.5\n")
    refused(["run", str(cfg)], capsys, f"run_dir {run_dir} is not empty and was not written by nestling")
    refused(["run", str(cfg), "--dry-run"], capsys, f"run_dir {run_dir} is not empty")
    assert snapshot(run_dir) == before


# ---- --out is never an input, inside one, or above one ------------------------------------------


@pytest.mark.parametrize("where, relation", [("same", "is"), ("inside", "lies inside"), ("parent", "contains")])
def test_export_out_at_the_training_folder(trained, where, relation, capsys):
    out = {"same": str(trained), "inside": str(trained / "draft"), "parent": f"{trained}/.."}[where]
    runs = trained.parent
    (runs / "other-run").mkdir(exist_ok=True)
    (runs / "other-run" / "model.safetensors").write_bytes(b"another run's weights")
    before = snapshot(runs)
    refused(
        ["export", str(trained), "--out", out],
        capsys,
        f"{relation} the training folder {trained}",
        "apart from the stage's inputs",
    )
    assert snapshot(runs) == before  # the training run and its siblings: every byte still there
    assert not (trained / "draft").exists()


def test_data_out_holding_its_input_or_inside_the_target(chat, target, capsys):
    before = snapshot(chat.parent)
    refused(
        ["data", str(chat), "--target", str(target), "--out", str(chat.parent), "workers=1"],
        capsys,
        f"contains the input file {chat}",
    )
    refused(
        ["data", str(chat), "--target", str(target), "--out", str(chat), "workers=1"],
        capsys,
        f"is the input file {chat}",
    )
    assert snapshot(chat.parent) == before
    target_before = snapshot(target)
    refused(
        ["data", str(chat), "--target", str(target), "--out", str(target / "data"), "workers=1"],
        capsys,
        f"lies inside the target {target}",
    )
    assert snapshot(target) == target_before and not (target / "data").exists()


def test_capture_train_eval_regenerate_out_at_an_input(data_dir, capture, draft, chat, target, capsys):
    cases = [
        (["capture", str(data_dir), "--target", str(target), "--out", str(data_dir)], "is the data folder"),
        (
            ["train", str(capture), "--out", str(capture / "train"), "--steps", "1", *TRAIN],
            "lies inside the capture folder",
        ),
        (
            ["eval", str(draft), "--target", str(target), "--prompts", str(chat), "--out", str(draft)],
            "is the draft folder",
        ),
        (
            ["regenerate", str(chat), "--target", str(target), "--out", str(chat.parent), "--engine", "hf"],
            "contains the input file",
        ),
    ]
    before = {p: snapshot(p) for p in (data_dir, capture, draft, chat.parent)}
    for argv, message in cases:
        refused(argv, capsys, message)
    assert {p: snapshot(p) for p in before} == before


# ---- what nestling wrote itself is reused, resumed or replaced as before ------------------------


def test_export_again_replaces_its_own_files_and_keeps_the_users(trained, tmp_path, capsys):
    out = tmp_path / "draft"
    assert main(["export", str(trained), "--out", str(out), "--dtype", "float32"]) == 0
    (out / "README.md").write_text("# my draft\n")
    first = (out / "model.safetensors").read_bytes()
    assert main(["export", str(trained), "--out", str(out)]) == 0  # bfloat16 now: the weights change
    assert (out / "README.md").read_text() == "# my draft\n"
    assert (out / "model.safetensors").read_bytes() != first
    assert json.loads((out / "manifest.json").read_text())["settings"]["dtype"] == "bfloat16"
    assert sorted(p.name for p in out.iterdir()) == [
        ".nestling-stage.json",
        "README.md",
        "config.json",
        "manifest.json",
        "model.safetensors",
    ]


def test_a_killed_export_leaves_no_half_folder(trained, tmp_path):
    """kill -9 while the export builds: the folder holds the build only under a temporary name and no
    manifest; the next export removes the build and completes."""
    out = tmp_path / "draft"
    proc = run_cli(["export", str(trained), "--out", str(out)], popen=True)
    deadline = time.time() + 120
    while not list(out.glob(".export-build-*/config.json")) and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    if proc.returncode != 0:  # killed mid-build (else it finished first: nothing left to check)
        assert not (out / "manifest.json").exists()
    r = run_cli(["export", str(trained), "--out", str(out)])
    assert r.returncode == 0, r.stderr
    assert not list(out.glob(".export-build-*")) and (out / "manifest.json").exists()


def test_resume_into_its_own_folder_with_overrides_after_the_flag(capture, trained, tmp_path, capsys):
    """`--resume` takes no value: `--resume lr=...` is a setting, not a checkpoint path."""
    out = tmp_path / "train"
    assert main(["train", str(capture), "--out", str(out), "--steps", "4", *TRAIN]) == 0
    for name in ("manifest.json", "model.safetensors"):  # as if killed right after the step-2 checkpoint
        (out / name).unlink()
    for step in (3, 4):
        shutil.rmtree(out / "checkpoints" / f"step-{step:08d}")
    capsys.readouterr()
    assert (
        main(
            ["train", str(capture), "--out", str(out), "--steps", "4", "--resume", *TRAIN[:-1], "progress_interval=50"]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "resumed from" in err and "step-00000002" in err
    assert (out / "manifest.json").exists()
    # an explicit checkpoint has its own option; the checkpoint of another folder is an input
    out2 = tmp_path / "train2"
    assert (
        main(
            [
                "train",
                str(capture),
                "--out",
                str(out2),
                "--steps",
                "4",
                *TRAIN,
                "--resume-from",
                str(out / "checkpoints" / "step-00000004"),
            ]
        )
        == 0
    )
    assert "resumed from" in capsys.readouterr().err


def test_rerun_of_data_into_its_own_folder_is_a_no_op(chat, target, data_dir, capsys):
    before = snapshot(data_dir)
    capsys.readouterr()
    assert main(["data", str(chat), "--target", str(target), "--out", str(data_dir), "workers=1"]) == 0
    assert "already complete" in capsys.readouterr().err
    assert snapshot(data_dir) == before


# ---- nothing from an input is executed ----------------------------------------------------------


def test_resume_refuses_an_optimizer_file_that_would_run_code(capture, tmp_path, capsys):
    out = tmp_path / "train"
    assert main(["train", str(capture), "--out", str(out), "--steps", "2", *TRAIN]) == 0
    (out / "manifest.json").unlink()
    marker = tmp_path / "pwned"
    opt = out / "checkpoints" / "step-00000002" / "optimizer.pt"
    state = torch.load(opt, weights_only=True)
    (state["muon"] if "muon" in state else state)["param_groups"][0]["payload"] = RunsAShellCommand(marker)
    torch.save(state, opt)
    before = snapshot(out)
    refused(
        ["train", str(capture), "--out", str(out), "--steps", "2", "--resume", *TRAIN],
        capsys,
        f"refusing to load {opt}",
        "posix.system",
        "can run code when loaded",
    )
    assert not marker.exists()
    assert snapshot(out) == before


# ---- one writer per folder ----------------------------------------------------------------------


def test_a_second_train_on_the_same_folder_is_refused(capture, tmp_path, capsys):
    out = tmp_path / "train"
    first = run_cli(["train", str(capture), "--out", str(out), "--steps", "100000", *TRAIN], popen=True)
    try:
        deadline = time.time() + 120
        while not list(out.glob("checkpoints/step-*/state.json")):  # a whole checkpoint is there
            assert first.poll() is None, first.stdout.read()
            assert time.time() < deadline
            time.sleep(0.05)
        refused(
            ["train", str(capture), "--out", str(out), "--steps", "2", *TRAIN],
            capsys,
            f"another `nestling train` is using {out} (pid {first.pid} on",
            "write to another --out folder",
        )
        assert first.poll() is None  # the first run goes on undisturbed
    finally:
        first.kill()
        first.wait()
    # the lock died with the process: the next run gets the folder (and is told to resume it)
    refused(
        ["train", str(capture), "--out", str(out), "--steps", "2", *TRAIN],
        capsys,
        "already holds checkpoints; pass --resume",
    )


# ---- every file a stage writes is one it may delete again ----------------------------------------


def test_every_file_a_stage_writes_is_in_its_owned_names(data_dir, target, trained, draft, tmp_path):
    """A stage restarted on its folder removes only `outdir.OWNS[stage]`: a name missing there would
    survive the restart and mix an old run's file (a stale checksum, a metric) into the new one."""
    from nestling import outdir

    captured = tmp_path / "capture"  # a real capture (the shared fixture is built by hand)
    with threads(1):
        assert main(["capture", str(data_dir), "--target", str(target), "--out", str(captured)]) == 0
    assert (captured / "train" / "checksums.jsonl").is_file()
    for stage, folder in (("data", data_dir), ("capture", captured), ("train", trained), ("export", draft)):
        owned = set(outdir.owned(folder, stage))
        written = {p for p in Path(folder).rglob("*") if p.is_file() and not any(q in owned for q in p.parents)}
        assert written - owned == set(), (stage, sorted(str(p.relative_to(folder)) for p in written - owned))
