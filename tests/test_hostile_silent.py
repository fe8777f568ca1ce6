"""Hostile and broken input, round 2 (issue #40): the families that exited 0 with an empty or wrong result,
and the ones that hung or grew without bound. Empty inputs, settings that mean nothing and absurd plans
are refused; a byte-order mark costs nothing; NaN held-out shards, edited indexes and manifests, and a
NaN checkpoint stop the run; a named pipe is refused at once; a template that builds gigabytes is a
counted template error; a prompt past the target's context is cut with a line that says so."""

from __future__ import annotations

import json
import os
import resource
import shutil

import pytest
from capture_fixture import TINY_TRAIN, one_thread, tiny_llama, tiny_llama_capture  # noqa: F401 (fixtures)
from hostile_helpers import TRAIN, chat_line, cli, fails_cleanly, hostile_draft, hostile_trained, within  # noqa: F401
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nestling.cli import main

# ---- empty inputs: refused, naming the file ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("in.jsonl", "", "is empty (0 bytes)"),
        ("in.jsonl", "\n  \n\t\n", "holds no records"),
        ("in.json", "[]", "holds no records"),
        ("in.json", "  [ ]  ", "holds no records"),
        ("in.jsonl", '{"a": 1}\n{"b": 2}\n', "all 2 records were dropped (malformed_record=2)"),
    ],
)
def test_an_input_without_a_usable_conversation_is_refused(tiny, tmp_path, capsys, name, content, needle):
    src = tmp_path / name
    src.write_text(content)
    msg = fails_cleanly(capsys, "data", src, "--target", tiny, "--out", tmp_path / "d", "workers=1")
    assert needle in msg and str(src) in msg
    assert not (tmp_path / "d" / "manifest.json").exists()


def test_one_empty_file_among_several_is_named(tiny, tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text(chat_line())
    (tmp_path / "b.jsonl").write_text("")
    msg = fails_cleanly(
        capsys, "data", tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--target", tiny, "--out", tmp_path / "d"
    )
    assert str(tmp_path / "b.jsonl") in msg and "a.jsonl" not in msg


# ---- a byte-order mark costs nothing ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_a_byte_order_mark_keeps_the_first_record(tiny, tmp_path, capsys, fmt):
    lines = [chat_line("First."), chat_line("Second.")]
    text = "".join(lines) if fmt == "jsonl" else "[" + ", ".join(line.strip() for line in lines) + "]"
    src = tmp_path / f"in.{fmt}"
    src.write_bytes(b"\xef\xbb\xbf" + text.encode())
    rc, err = cli(capsys, "data", src, "--target", tiny, "--out", tmp_path / "d", "workers=1")
    assert rc == 0, err[-2000:]
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["counts"]["kept"] == 2 and m["counts"]["dropped"] == {}


# ---- settings that mean nothing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--workers", "-1"], "workers is a number of processes"),
        (["role_map.narrator=wizard"], "role_map.narrator='wizard' maps to no role"),
    ],
)
def test_data_settings_that_mean_nothing(tiny, tmp_path, capsys, args, needle):
    (tmp_path / "in.jsonl").write_text(chat_line())
    msg = fails_cleanly(capsys, "data", tmp_path / "in.jsonl", "--target", tiny, "--out", tmp_path / "d", *args)
    assert needle in msg and not (tmp_path / "d").exists()


@pytest.mark.parametrize("args", [["--k", "0", "--format", "speculators"], ["num_speculative_tokens=-2"]])
def test_export_with_no_speculative_tokens(trained, tmp_path, capsys, args):
    msg = fails_cleanly(capsys, "export", trained, "--out", tmp_path / "d", *args)
    assert "num_speculative_tokens (--k)" in msg and "at least 1" in msg
    assert not (tmp_path / "d").exists()


def test_a_draft_vocabulary_larger_than_the_target_s_is_capped_with_a_line(capture, tmp_path, capsys):
    rc, err = cli(
        capsys, "train", capture, "--out", tmp_path / "t", "--steps", 1, *TINY_TRAIN, "draft_vocab_size=999999"
    )
    assert rc == 0, err[-2000:]
    assert "draft_vocab_size=999999 is larger than the target's vocabulary" in err
    cfg = json.loads((tmp_path / "t" / "draft_config.json").read_text())
    assert cfg["draft_vocab_size"] == cfg["vocab_size"]


# ---- nestling plan: an absurd machine or model never "fits" ------------------------------------------------------


@pytest.mark.parametrize(
    "edit, args",
    [
        (lambda c: {**c, "num_key_value_heads": 0}, []),
        (lambda c: {**c, "vocab_size": 0}, []),
        (lambda c: c, ["--gpu-tflops", "0"]),
        (lambda c: {**c, "hidden_size": 2**24, "intermediate_size": 2**24, "num_hidden_layers": 2**24}, []),
    ],
)
def test_plan_never_says_fits_for_an_absurd_config(tiny, tmp_path, capsys, edit, args):
    (tmp_path / "config.json").write_text(json.dumps(edit(json.loads((tiny / "config.json").read_text()))))
    capsys.readouterr()
    rc = main(["plan", str(tmp_path / "config.json"), "--tokens", str(10**6), *args])
    out, err = capsys.readouterr()
    assert rc == 1 and "fits" not in out and "TiB" not in out and "Traceback" not in err


# ---- training inputs that promise more than they hold ------------------------------------------------------------


def test_nan_in_the_held_out_shards_stops_training(capture, tmp_path, capsys):
    cap = tmp_path / "cap"
    shutil.copytree(capture, cap)
    for shard in (cap / "heldout").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        tensors["hidden"][:] = float("nan")
        save_file(tensors, str(shard), metadata=meta)
    out = tmp_path / "t"
    msg = fails_cleanly(capsys, "train", cap, "--out", out, "--steps", 2, *TINY_TRAIN[:-2], "eval_every=1")
    assert "held-out loss is not finite" in msg and "step 1" in msg and str(cap) in msg
    assert not (out / "model.safetensors").exists() and not (out / "manifest.json").exists()


def test_resume_from_a_nan_checkpoint_writes_no_model(capture, trained, tmp_path, capsys):
    """The checkpoint of the last step: resuming trains no step, and used to write its NaN weights."""
    ck = tmp_path / "ck"
    shutil.copytree(trained / "checkpoints" / "step-00000002", ck)
    w = load_file(str(ck / "model.safetensors"))
    save_file(
        {k: v * float("nan") if v.is_floating_point() else v for k, v in w.items()}, str(ck / "model.safetensors")
    )
    out = tmp_path / "t"
    msg = fails_cleanly(capsys, "train", capture, "--out", out, *TRAIN, "--resume-from", ck)
    assert "cannot be resumed" in msg and "non-finite" in msg and str(ck) in msg
    assert not (out / "model.safetensors").exists()


# ---- hangs: named pipes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["input", "chat template", "config"])
def test_a_named_pipe_is_refused_at_once(tiny, tmp_path, capsys, which):
    fifo = tmp_path / f"pipe.{'jinja' if which == 'chat template' else 'yaml' if which == 'config' else 'jsonl'}"
    os.mkfifo(fifo)
    (tmp_path / "in.jsonl").write_text(chat_line())
    src = fifo if which == "input" else tmp_path / "in.jsonl"
    extra = {"input": [], "chat template": ["--chat-template", fifo], "config": ["--config", fifo]}[which]
    with within(30):
        msg = fails_cleanly(capsys, "data", src, "--target", tiny, "--out", tmp_path / "d", "workers=1", *extra)
    assert "named pipe (FIFO)" in msg and str(fifo) in msg


def test_eval_prompts_from_a_named_pipe(tiny, draft, tmp_path, capsys):
    os.mkfifo(tmp_path / "p.jsonl")
    with within(30):
        msg = fails_cleanly(
            capsys, "eval", draft, "--target", tiny, "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "ev"
        )
    assert "named pipe (FIFO)" in msg


# ---- runaway templates: bounded memory, counted -------------------------------------------------------------------

GREEDY = {
    "one huge string": "{{ 'x' * 10**10 }}",
    "a string doubled 40 times": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
}


@pytest.mark.parametrize("kind", sorted(GREEDY))
def test_a_template_that_builds_gigabytes_is_a_counted_template_error(tiny, tmp_path, capsys, kind):
    template = (
        "{% for m in messages %}{% if m['content'] == 'BIG' %}" + GREEDY[kind] + "{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tmp_path / "t.jinja").write_text(template)
    (tmp_path / "in.jsonl").write_text(chat_line("Fine.") + chat_line("BIG") + chat_line("Ok."))
    limit = resource.getrlimit(resource.RLIMIT_AS)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with within(120):
        rc, err = cli(
            capsys, "data", tmp_path / "in.jsonl", "--target", tiny, "--out", tmp_path / "d", "--chat-template",
            tmp_path / "t.jinja", "workers=1", "template_timeout=5",
        )  # fmt: skip
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    # whichever bound a machine hits first counts it: the 2 GB of address space, or on a slow or loaded
    # CPU the 5 CPU seconds before the string reaches it
    says = {"template_error": "MemoryError", "template_timeout": "template_timeout="}
    (reason,) = m["counts"]["dropped"]
    assert m["counts"]["kept"] == 2 and m["counts"]["dropped"] == {reason: 1} and reason in says
    assert says[reason] in str(m["examples"][reason]), m["examples"]
    assert resource.getrlimit(resource.RLIMIT_AS) == limit  # restored after each render
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kb < 3 * 2**20  # the peak grew by less than 3 GB (the bound is 2 GB of address space)


# ---- a prompt longer than the target's context ---------------------------------------------------------------------


def test_a_prompt_past_the_context_is_cut_with_a_line(tiny, draft, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hello world " * 3000}) + "\n")
    rc, err = cli(
        capsys, "eval", draft, "--target", tiny, "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "ev",
        "max_new_tokens=4", "k=2", "baseline=false",
    )  # fmt: skip
    assert "Traceback" not in err
    assert "1 prompt(s) longer than the target's context allows (2041 tokens of 2048" in err, err[-2000:]
    if rc == 0:
        report = json.loads((tmp_path / "ev" / "report.json").read_text())
        assert report["num_prompts"] == 1
    else:  # a random-weight target may end the generation before a draft step: said so, no report
        assert "nothing was drafted" in err


def test_fit_context_refuses_when_nothing_fits():
    from nestling.errors import NestlingError
    from nestling.evaluate.prompts import fit_context

    assert fit_context([[1] * 10, [2] * 3], 8, 4) == [[1] * 4, [2] * 3]
    assert fit_context([[1] * 10], None, 4) == [[1] * 10]
    with pytest.raises(NestlingError, match="no room for a prompt"):
        fit_context([[1]], 8, 8)
