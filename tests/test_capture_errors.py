"""Bad input gets one clear error (no traceback, no model load where avoidable), never silent loss."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from capture_data import make_data_dir
from nestling.capture.run import capture
from nestling.capture.settings import CaptureSettings, parse_size
from nestling.capture.store import CaptureDataset, batches
from nestling.cli import main
from nestling.data.dataset import Sample
from nestling.errors import NestlingError

OPTS = dict(dtype="float32", device="cpu", progress_interval=60)


@pytest.fixture
def target(tiny_target):
    return tiny_target("llama")


@pytest.fixture
def tok(target):
    return AutoTokenizer.from_pretrained(target)


@pytest.fixture
def data(tmp_path, tok, target):
    return make_data_dir(tmp_path / "data", tok, target, n_train=5, n_heldout=1, seed=2, min_words=20, max_words=40)


@pytest.fixture
def no_model(monkeypatch):
    import nestling.capture.run as run

    def fail(*a, **k):
        raise AssertionError("the model must not be loaded for this input")

    monkeypatch.setattr(run, "make_backend", fail)


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB filesystem (tmpfs; needs root, as here and in CI)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_missing_data_folder(tmp_path, target, capsys):
    assert main(["capture", str(tmp_path / "nope"), "--target", str(target), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "nestling data" in err and "Traceback" not in err


def test_data_from_another_tokenizer(tmp_path, target, tok, no_model):
    """Same vocabulary, another chat template: token ids of different text, so the fingerprint differs."""
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    data = make_data_dir(tmp_path / "d2", tok, target, n_train=2, n_heldout=0)
    with pytest.raises(NestlingError, match="another tokenizer"):
        capture(data, target, tmp_path / "o", CaptureSettings(**OPTS))


def test_unknown_layer_ids_fail_before_loading(tmp_path, target, data, no_model, capsys):
    rc = main(["capture", str(data), "--target", str(target), "--out", str(tmp_path / "o"), "--layers", "2,3,9"])
    err = capsys.readouterr().err
    assert rc == 1 and "do not fit this target" in err and "6 decoder layers" in err
    with pytest.raises(NestlingError, match="final state 6"):
        capture(data, target, tmp_path / "o", CaptureSettings(layers=[1, 2], **OPTS))


def test_disk_precheck_refuses(tmp_path, target, data, small_fs, no_model):
    with pytest.raises(NestlingError, match="not enough disk space.*--ignore-disk-check"):
        capture(data, target, small_fs / "cap", CaptureSettings(**OPTS))
    assert not list(small_fs.rglob("*.safetensors"))


def test_real_full_disk_is_a_clear_error(tmp_path, target, data, small_fs, capsys):
    rc = main(
        [
            "capture",
            str(data),
            "--target",
            str(target),
            "--out",
            str(small_fs / "cap"),
            "--ignore-disk-check",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--shard-size",
            "100MB",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "disk is full" in err and "Traceback" not in err, err
    assert not list(small_fs.rglob("*.tmp")) and not (small_fs / "cap" / "manifest.json").exists()


def test_verify_catches_corruption(tmp_path, target, data, capsys):
    out = tmp_path / "cap"
    capture(data, target, out, CaptureSettings(shard_size="20KB", **OPTS))
    assert main(["capture", "--verify", str(out)]) == 0
    shards = sorted((out / "train").glob("shard-*.safetensors"))
    assert len(shards) >= 3
    raw = bytearray(shards[0].read_bytes())
    hdr = 8 + int.from_bytes(raw[:8], "little")
    raw[hdr + 64 : hdr + 128] = b"\xff" * 64  # NaNs in hidden
    shards[0].write_bytes(bytes(raw))
    shards[1].write_bytes(shards[1].read_bytes()[:-1000])  # truncated
    h = CaptureDataset(out, "train")._handle(shards[2].name)
    raw = bytearray(shards[2].read_bytes())
    del h
    n = int.from_bytes(raw[:8], "little")
    import json

    off = json.loads(raw[8 : 8 + n])["hidden"]["data_offsets"]
    raw[8 + n + off[0] : 8 + n + off[1]] = bytes(off[1] - off[0])  # all-zero hidden
    shards[2].write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["capture", "verify", str(out)]) == 1
    o = capsys.readouterr()
    assert f"{shards[0].name}: " in o.out and "NaN/Inf" in o.out
    assert f"{shards[1].name}: cannot be read" in o.out
    assert f"{shards[2].name}: layer slot 0 is all zero" in o.out
    assert "failed verification: " in o.err and "Traceback" not in o.err


def _flip_finite(path: Path) -> None:
    """Flip the lowest mantissa bit of one hidden value: still finite, not constant; only a checksum sees it."""
    raw = bytearray(path.read_bytes())
    hdr = 8 + int.from_bytes(raw[:8], "little")
    raw[hdr + 100] ^= 0x01
    path.write_bytes(bytes(raw))


def test_verify_checksum_catches_finite_overwrite(tmp_path, target, data, capsys):
    out = tmp_path / "cap"
    capture(data, target, out, CaptureSettings(shard_size="20KB", **OPTS))
    lines = (out / "train" / "checksums.jsonl").read_text().splitlines()
    shards = sorted((out / "train").glob("shard-*.safetensors"))
    assert [json.loads(x)["shard"] for x in lines] == [p.name for p in shards]
    assert main(["capture", "--verify", str(out)]) == 0
    _flip_finite(shards[1])
    capsys.readouterr()
    assert main(["capture", "--verify", str(out)]) == 1
    o = capsys.readouterr().out
    assert f"train/{shards[1].name}: checksum mismatch" in o
    assert shards[0].name not in o and "NaN" not in o and "all zero" not in o  # the other checks pass it


def test_checksums_rebuilt_for_complete_shards_that_lack_them(tmp_path, target, data, capsys):
    """A run that died between a shard's rename and its checksum line (or a store from before
    checksums): the rerun reads those shards once and records them; verify then passes."""
    out = tmp_path / "cap"
    capture(data, target, out, CaptureSettings(shard_size="20KB", **OPTS))
    before = (out / "train" / "checksums.jsonl").read_bytes()
    (out / "train" / "checksums.jsonl").write_bytes(b"\n".join(before.splitlines()[1:]) + b"\n{torn")
    (out / "manifest.json").unlink()
    capture(data, target, out, CaptureSettings(shard_size="20KB", **OPTS))
    assert (out / "train" / "checksums.jsonl").read_bytes() == before
    (out / "train" / "checksums.jsonl").unlink()  # a store from before checksums: verified without them
    capsys.readouterr()
    assert main(["capture", "--verify", str(out)]) == 0
    assert "no checksums.jsonl" in capsys.readouterr().err


def test_batches_respect_token_budget():
    ss = [Sample(str(i), i, [1] * n, [0] * n) for i, n in enumerate([50, 40, 40, 30, 10, 10, 10, 200])]
    bs = batches(ss, 100)
    assert [len(b) for b in bs] == [2, 1, 3, 1, 1] or all(
        len(b) * max(len(s.input_ids) for s in b) <= 100 or len(b) == 1 for b in bs
    )
    assert [s for b in bs for s in b] == ss  # order kept, nothing lost
    assert parse_size("1GB") == 10**9 and parse_size("512MiB") == 2**29 and parse_size(4096) == 4096
    with pytest.raises(NestlingError):
        parse_size("lots")
