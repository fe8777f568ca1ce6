"""Hostile and broken input, round 2 (issue #40), the families that ended in a traceback: each now ends in
one or two lines and exit 1, checked where the input enters (`nestling.inputs`, the plan's config check,
the GGUF header, the target's safetensors headers, the stage folders' manifests and indexes, the
safetensors writer), never deep inside transformers, safetensors, pyarrow or the GGUF reader."""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
from pathlib import Path

import pytest
from capture_fixture import TINY_TRAIN, one_thread, tiny_llama, tiny_llama_capture  # noqa: F401 (fixtures)
from hostile_helpers import TRAIN, chat_line, cli, fails_cleanly, hostile_data_dir, hostile_draft, hostile_trained  # noqa: F401 (fixtures)
from safetensors.torch import load_file, save_file

# ---- nestling plan on a malformed config.json -----------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda c: [c], "holds list at its top level, not a mapping"),
        (lambda c: {**c, "hidden_size": 0}, "hidden_size is 0"),
        (lambda c: {**c, "hidden_size": None}, "has no hidden_size"),
        (lambda c: {**c, "hidden_size": float("nan")}, "hidden_size is nan"),
        (lambda c: {**c, "hidden_size": "big"}, "hidden_size is 'big'"),
        (lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads is 0"),
        (lambda c: {**c, "num_key_value_heads": 0}, "num_key_value_heads is 0"),
        (lambda c: {**c, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        (lambda c: {**c, "vocab_size": 0}, "vocab_size is 0"),
        (lambda c: {**c, "intermediate_size": [1]}, "intermediate_size is [1]"),
        (lambda c: {**c, "hidden_size": 10**20}, "hidden_size is 100000000000000000000"),
        (lambda c: {**c, "hidden_size": 2**24, "intermediate_size": 2**24, "num_hidden_layers": 2**24}, "parameters"),
        (lambda c: {"model_type": "llama", "text_config": "oops"}, "text_config is a str"),
    ],
)
def test_plan_refuses_a_malformed_config(tiny, tmp_path, capsys, edit, needle):
    cfg = json.loads((tiny / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(edit(cfg)))  # NaN is written as the token NaN
    msg = fails_cleanly(capsys, "plan", tmp_path / "config.json", "--tokens", 10**6)
    assert needle in msg and "config" in msg


@pytest.mark.parametrize("tflops", ["nan", "0", "-5", "inf"])
def test_plan_refuses_a_gpu_speed_that_is_no_speed(tiny, capsys, tflops):
    msg = fails_cleanly(capsys, "plan", tiny, "--tokens", 1000, "--gpu-tflops", tflops)
    assert "gpu_tflops" in msg and "positive" in msg


# ---- a corrupt .gguf target, in the stages that convert it ----------------------------------------------------


def _gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


GGUFS = {
    "empty": b"",
    "random": os.urandom(4096),
    "huge counts": b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62) + bytes(64),
    "huge string length": b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**60) + b"abc",
    # a plausible header cut off inside its first metadata value
    "truncated": b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + _gguf_string(b"general.architecture") + struct.pack("<I", 8),
}


@pytest.mark.parametrize("kind", sorted(GGUFS))
def test_a_corrupt_gguf_target_is_named(tmp_path, capsys, kind):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(GGUFS[kind])
    (tmp_path / "in.jsonl").write_text(chat_line())
    msg = fails_cleanly(capsys, "data", tmp_path / "in.jsonl", "--target", gguf, "--out", tmp_path / "d", "workers=1")
    assert str(gguf) in msg and "cut off or damaged" in msg and "download it again" in msg
    assert not (tmp_path / "d").exists()


# ---- a target folder whose weights are broken or unlike its config ----------------------------------------------


def _target_copy(tiny: Path, dst: Path) -> Path:
    shutil.copytree(tiny, dst)
    return dst


def _truncate_half(t: Path) -> None:
    w = t / "model.safetensors"
    os.truncate(w, w.stat().st_size // 2)


def _huge_header(t: Path) -> None:
    w = t / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(struct.pack("<Q", 2**40) + data[8:])


def _config_unlike_weights(t: Path) -> None:
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 2 * cfg["intermediate_size"]}))


@pytest.mark.parametrize(
    "damage, needle",
    [
        (_truncate_half, "cut off or damaged"),
        (_huge_header, "its header claims 1,099,511,627,776 bytes"),
        (_config_unlike_weights, "does not match its weights"),
    ],
)
def test_a_target_folder_with_broken_weights(tiny, data_dir, tmp_path, capsys, damage, needle):
    t = _target_copy(tiny, tmp_path / "t")
    damage(t)
    msg = fails_cleanly(capsys, "capture", data_dir, "--target", t, "--out", tmp_path / "c")
    assert needle in msg and str(t) in msg
    assert not (tmp_path / "c" / "manifest.json").exists()


# ---- stage folders damaged or edited --------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda d: (d / "manifest.json").write_text("{garbage"), "manifest"),
        (lambda d: (d / "manifest.json").write_text("[]"), "holds list at its top level"),
        (lambda d: os.truncate(next(d.glob("train-*.parquet")), 100), "cut off or damaged"),
        (lambda d: _edit_json(d / "manifest.json", lambda m: m["splits"]["train"].update(samples=5)), "promises 5"),
    ],
)
def test_capture_refuses_a_damaged_data_folder(tiny, data_dir, tmp_path, capsys, damage, needle):
    d = _copy(data_dir, tmp_path / "data")
    damage(d)
    msg = fails_cleanly(capsys, "capture", d, "--target", tiny, "--out", tmp_path / "c")
    assert needle in msg and str(d) in msg
    assert not (tmp_path / "c").exists()


def _edit_json(path: Path, edit) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def _shift_second_sample(cap: Path) -> None:
    _edit_json(cap / "train" / "index.json", lambda ix: ix[1].update(offset=ix[1]["offset"] + 3))


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda c: (c / "manifest.json").write_text("nope"), "is not valid JSON"),
        (_shift_second_sample, "the index was edited or is damaged"),
        (lambda c: (c / "train" / "index.json").write_text('{"a": 1}'), "holds dict at its top level, not a list"),
    ],
)
def test_train_refuses_a_damaged_capture_folder(capture, tmp_path, capsys, damage, needle):
    cap = _copy(capture, tmp_path / "cap")
    damage(cap)
    msg = fails_cleanly(capsys, "train", cap, "--out", tmp_path / "t", *TRAIN)
    assert needle in msg and str(cap) in msg
    assert not (tmp_path / "t").exists()


def _ckpt(train_dir: Path, dst: Path, step: int, edit) -> Path:
    c = _copy(train_dir / "checkpoints" / f"step-{step:08d}", dst)
    if edit == "huge header":
        _huge_header(c)
    else:
        w = load_file(str(c / "model.safetensors"))
        save_file({k: v.contiguous() for k, v in edit(w).items()}, str(c / "model.safetensors"))
    return c


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda w: {k: v[:, :-1] if k == "fc.weight" else v for k, v in w.items()}, "fc.weight: shape"),
        (lambda w: {k: v for k, v in w.items() if k != "norm.weight"}, "missing norm.weight"),
        ("huge header", "cut off or damaged"),
    ],
)
def test_resume_from_a_damaged_checkpoint(capture, trained, tmp_path, capsys, edit, needle):
    ck = _ckpt(trained, tmp_path / "ck", 1, edit)
    msg = fails_cleanly(capsys, "train", capture, "--out", tmp_path / "t", *TRAIN, "--resume-from", ck)
    assert needle in msg and str(ck) in msg
    assert not (tmp_path / "t" / "model.safetensors").exists()


def _draft_copy(src: Path, dst: Path, config=None, weights=None) -> Path:
    d = _copy(src, dst)
    if config:
        _edit_json(d / "config.json", config)
    if weights:
        w = load_file(str(d / "model.safetensors"))
        save_file(weights(w), str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize(
    "config, weights, needle",
    [
        (lambda c: c.update(hidden_size=2 * c["hidden_size"]), None, "export contract"),
        (lambda c: c.update(draft_vocab_size=7), None, "export contract"),
        (None, lambda w: {k: v.t().contiguous() if k == "fc.weight" else v for k, v in w.items()}, "fc.weight"),
        (lambda c: c.pop("hidden_size"), None, "damaged or edited"),
        (lambda c: c.update(hidden_size="wide"), None, "damaged or edited"),
    ],
)
def test_eval_refuses_an_edited_draft_folder(tiny, draft, tmp_path, capsys, config, weights, needle):
    d = _draft_copy(draft, tmp_path / "draft", config, weights)
    (tmp_path / "p.jsonl").write_text('{"prompt": "Hello"}\n')
    msg = fails_cleanly(
        capsys, "eval", d, "--target", tiny, "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "ev"
    )
    assert needle in msg and str(d) in msg
    assert not (tmp_path / "ev").exists()


def test_export_of_a_training_folder_with_a_damaged_manifest(trained, tmp_path, capsys):
    t = _copy(trained, tmp_path / "train")
    (t / "manifest.json").write_text("{")
    msg = fails_cleanly(capsys, "export", t, "--out", tmp_path / "d")
    assert "is not valid JSON" in msg and "nestling train" in msg


# ---- writes that fail: a file-size limit ----------------------------------------------------------------------


class file_size_limit:
    """RLIMIT_FSIZE for this process (Python ignores SIGXFSZ: a write past it fails with EFBIG)."""

    def __init__(self, limit: int):
        self.limit = limit

    def __enter__(self):
        self.saved = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.saved[1]))

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_FSIZE, self.saved)


def test_a_checkpoint_past_the_file_size_limit_leaves_no_partial_folder(capture, tmp_path, capsys):
    out = tmp_path / "t"
    with file_size_limit(100_000):
        msg = fails_cleanly(capsys, "train", capture, "--out", out, *TRAIN)
    assert "File too large" in msg and "step-00000001" in msg and "partial checkpoint was removed" in msg
    assert list((out / "checkpoints").iterdir()) == []  # no .tmp-step-* folder left
    assert not (out / "manifest.json").exists()


def test_an_export_past_the_file_size_limit_leaves_nothing_half_written(trained, tmp_path, capsys):
    out = tmp_path / "d"
    with file_size_limit(100_000):
        msg = fails_cleanly(capsys, "export", trained, "--out", out)
    assert "File too large" in msg and "ulimit -f" in msg
    assert not out.exists() or {p.name for p in out.iterdir()} <= {".nestling-stage.json", ".lock"}


# ---- a template that is not UTF-8, a number too long for Python, no draft vocabulary ---------------------------


def test_a_chat_template_file_that_is_not_utf8(tiny, tmp_path, capsys):
    (tmp_path / "t.jinja").write_bytes(b"{{ 'caf\xe9' }}")
    (tmp_path / "in.jsonl").write_text(chat_line())
    msg = fails_cleanly(
        capsys, "data", tmp_path / "in.jsonl", "--target", tiny, "--out", tmp_path / "d", "--chat-template",
        tmp_path / "t.jinja", "workers=1",
    )  # fmt: skip
    assert "t.jinja is not UTF-8 (byte 0xe9 at offset 7)" in msg


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_a_5000_digit_number_in_an_unused_field_keeps_the_record(tiny, tmp_path, capsys, fmt):
    huge = json.loads(chat_line("Fine."))
    text = json.dumps(huge).replace('{"messages"', '{"id_num": ' + "9" * 5000 + ', "messages"')
    good = chat_line("Ok.").strip()
    src = tmp_path / f"in.{fmt}"
    src.write_text(f"{text}\n{good}\n" if fmt == "jsonl" else f"[{text}, {good}]")
    rc, err = cli(capsys, "data", src, "--target", tiny, "--out", tmp_path / "d", "workers=1")
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["counts"]["kept"] == 2


def test_eval_prompts_with_a_5000_digit_number(tiny, tmp_path):
    from nestling.evaluate.prompts import load_prompts
    from nestling.targets.load import load_tokenizer

    (tmp_path / "p.jsonl").write_text('{"prompt": "Hello", "n": ' + "9" * 5000 + "}\n")
    assert len(load_prompts(tmp_path / "p.jsonl", load_tokenizer(tiny))) == 1


def test_a_negative_draft_vocab_size_is_refused_when_read(capture, tmp_path, capsys):
    msg = fails_cleanly(capsys, "train", capture, "--out", tmp_path / "t", *TINY_TRAIN, "draft_vocab_size=-1")
    assert "draft_vocab_size" in msg and "0 = auto" in msg
    assert not (tmp_path / "t").exists()
