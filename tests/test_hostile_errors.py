"""One error path (issue #16, item 5): hostile or broken input gets nestling's own message (what, where,
what to do), exit code 1 and no traceback (unless --debug); a bad record is a counted skip, never an
aborted run; nothing complete is lost."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from capture_fixture import RunsAShellCommand, one_thread, tiny_llama, tiny_llama_capture, TINY_TRAIN  # noqa: F401 (fixtures)

from hostile_helpers import cli, fails_cleanly


def chat_line(content: str = "Hello.") -> str:
    return (
        json.dumps({"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": content}]}) + "\n"
    )


# ---- inputs --------------------------------------------------------------------------------------------------


def test_input_that_is_a_folder(tiny, tmp_path, capsys):
    (tmp_path / "in.jsonl").mkdir()
    msg = fails_cleanly(capsys, "data", tmp_path / "in.jsonl", "--target", tiny, "--out", tmp_path / "d", "workers=1")
    assert "is a folder" in msg and "in.jsonl" in msg and not (tmp_path / "d").exists()


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_a_record_nested_100k_deep_is_a_counted_skip(tiny, tmp_path, capsys, fmt):
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    good = [json.loads(chat_line(f"Answer {i}.")) for i in range(2)]
    if fmt == "jsonl":
        text = json.dumps(good[0]) + "\n" + deep + "\n" + json.dumps(good[1]) + "\n"
    else:
        text = "[" + json.dumps(good[0]) + ", " + deep + ", " + json.dumps(good[1]) + "]"
    src = tmp_path / f"in.{fmt}"
    src.write_text(text)
    rc, err = cli(capsys, "data", src, "--target", tiny, "--out", tmp_path / "d", "workers=1")
    assert rc == 0 and "Traceback" not in err
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["counts"]["read"] == 3 and m["counts"]["kept"] == 2
    assert m["counts"]["dropped"] == {"too_deeply_nested": 1}


# ---- settings on the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override", ["lr=!!python/object/apply:os.system ['touch {marker}']", "lr=[1, 2", "lr={marker}: x: y"]
)
def test_override_that_is_not_plain_yaml(capture, tmp_path, capsys, override):
    marker = tmp_path / "pwned"
    msg = fails_cleanly(capsys, "train", capture, "--out", tmp_path / "t", override.format(marker=marker))
    assert not marker.exists() and not (tmp_path / "t").exists()
    assert ("not a plain YAML value" in msg and "lr=" in msg) or "unknown setting" in msg


def test_out_under_a_regular_file(tiny, tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text(chat_line())
    (tmp_path / "file").write_text("a file, not a folder")
    msg = fails_cleanly(
        capsys, "data", tmp_path / "in.jsonl", "--target", tiny, "--out", tmp_path / "file" / "d", "workers=1"
    )
    assert str(tmp_path / "file") in msg
    assert (tmp_path / "file").read_text() == "a file, not a folder"


# ---- targets ---------------------------------------------------------------------------------------------------


def _target_copy(
    tiny: Path,
    dst: Path,
    keep=("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors"),
) -> Path:
    dst.mkdir()
    for name in keep:
        shutil.copy(tiny / name, dst / name)
    return dst


def test_target_folder_with_only_config_json(tiny, tmp_path, capsys):
    t = _target_copy(tiny, tmp_path / "t", keep=("config.json",))
    (tmp_path / "in.jsonl").write_text(chat_line())
    msg = fails_cleanly(capsys, "data", tmp_path / "in.jsonl", "--target", t, "--out", tmp_path / "d", "workers=1")
    assert "has no tokenizer" in msg and str(t) in msg
    (tmp_path / "d").mkdir()
    msg = fails_cleanly(capsys, "capture", tmp_path / "d", "--target", t, "--out", tmp_path / "c")
    assert "no .safetensors weights" in msg and str(t) in msg


def test_unknown_model_type(tiny, capture, tmp_path, capsys):
    t = _target_copy(tiny, tmp_path / "t")
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**cfg, "model_type": "nosuchmodel"}))
    data = tmp_path / "data"
    data.mkdir()
    msg = fails_cleanly(capsys, "capture", data, "--target", t, "--out", tmp_path / "c")
    assert "cannot read the config" in msg and "nosuchmodel" in msg and str(t) in msg


def test_pickled_weights_are_refused_before_anything_loads_them(tiny, tmp_path, capsys):
    t = _target_copy(
        tiny, tmp_path / "t", keep=("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    )
    marker = tmp_path / "pwned"
    with open(t / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": RunsAShellCommand(marker)}, f)
    data = tmp_path / "data"
    data.mkdir()
    msg = fails_cleanly(capsys, "capture", data, "--target", t, "--out", tmp_path / "c")
    assert "pytorch_model.bin" in msg and "pickle" in msg and "safetensors" in msg
    from nestling.errors import NestlingError
    from nestling.targets.load import load_model

    with pytest.raises(NestlingError, match="pickle"):
        load_model(t, dtype="float32")
    assert not marker.exists()


# ---- train ----------------------------------------------------------------------------------------------------


def test_train_on_a_truncated_shard(capture, tmp_path, capsys):
    cap = tmp_path / "cap"
    shutil.copytree(capture, cap)
    shard = cap / "train" / "shard-00001.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    msg = fails_cleanly(capsys, "train", cap, "--out", tmp_path / "t", "--steps", 2, *TINY_TRAIN)
    assert str(shard) in msg and "cut off or damaged" in msg and "nestling capture" in msg
    assert not (tmp_path / "t").exists()


def test_disk_full_at_a_checkpoint_keeps_the_previous_one(capture, tmp_path, capsys, monkeypatch):
    """ENOSPC while writing checkpoint 2 (simulated: the write raises after a partial file): a message,
    the partial checkpoint removed, checkpoint 1 intact and resumable."""
    import safetensors.torch

    real = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):
        if "step-00000002" in str(filename):
            Path(filename).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    out = tmp_path / "t"
    msg = fails_cleanly(capsys, "train", capture, "--out", out, "--steps", 4, "checkpoint_every=1", *TINY_TRAIN)
    assert "No space left on device" in msg and "step-00000002" in msg and "step-00000001 is kept" in msg
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    rc, err = cli(capsys, "train", capture, "--out", out, "--steps", 4, "checkpoint_every=1", *TINY_TRAIN, "--resume")
    assert rc == 0 and "resumed from" in err and (out / "manifest.json").exists(), err[-2000:]


# ---- status, and --debug -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["[]", "{}", '{"stages": "data"}', "\udcff garbage"])
def test_status_on_a_damaged_run_json(tmp_path, capsys, content):
    (tmp_path / "run.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    msg = fails_cleanly(capsys, "status", tmp_path)
    assert str(tmp_path) in msg and ("damaged" in msg or "cannot be parsed" in msg)


def test_debug_shows_the_traceback(tmp_path, capsys):
    (tmp_path / "run.json").write_text("{}")
    rc, err = cli(capsys, "--debug", "status", tmp_path)
    assert rc == 1 and "Traceback" in err and "damaged" in err
    rc, err = cli(capsys, "status", tmp_path, "--debug")  # accepted anywhere on the line
    assert rc == 1 and "Traceback" in err


# ---- chat templates that never end -------------------------------------------------------------------------------

TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] == 'BOOM' %}{% for i in range(10**12) %}x{% endfor %}{% endif %}"
    "{% if message['content'] == 'HANG' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_with_a_huge_range_or_an_endless_loop_skips_the_record(tiny, tmp_path, capsys):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    (tmp_path / "in.jsonl").write_text(chat_line("Fine.") + chat_line("BOOM") + chat_line("HANG") + chat_line("Ok."))
    rc, err = cli(
        capsys,
        "data",
        tmp_path / "in.jsonl",
        "--target",
        tiny,
        "--out",
        tmp_path / "d",
        "--chat-template",
        tmp_path / "t.jinja",
        "workers=1",
        "template_timeout=1",
    )
    assert rc == 0 and "Traceback" not in err
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["counts"]["kept"] == 2 and m["counts"]["dropped"] == {"template_error": 1, "template_timeout": 1}
    assert "OverflowError" in m["examples"]["template_error"][0]


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": "caf\xe9"}\n', "is not UTF-8 (byte 0xe9"),
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", "p.jsonl:1 is nested too deeply"),
    ],
)
def test_eval_prompts_that_are_not_utf8_or_too_deep(tmp_path, capsys, content, message):
    from nestling.evaluate.prompts import load_prompts
    from nestling.errors import NestlingError

    (tmp_path / "p.jsonl").write_bytes(content)
    with pytest.raises(NestlingError, match=message.replace("(", r"\(")):
        load_prompts(tmp_path / "p.jsonl", None, None)
