"""No silent garbage (issue #16, item 3) and no stale cache (item 4): NaN states stop training at the
first bad step, naming it; export and eval refuse non-finite drafts; settings that would measure or
train nothing are refused when read; non-text and non-UTF-8 records are dropped and counted; a
tokenizer with other merges gets another fingerprint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from capture_fixture import one_thread, tiny_llama, tiny_llama_capture, TINY_TRAIN  # noqa: F401 (fixtures)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle_helpers import make_train_dir, new_draft, write_prompts_jsonl
from nestling.cli import main
from nestling.errors import NestlingError
from nestling.export.run import export
from nestling.export.settings import ExportSettings


def cli(capsys, *args) -> tuple[int, str]:
    """Run `nestling ARGS` in this process; (exit code, stderr), and never a traceback."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


# ---- train: the first non-finite loss stops the run ----------------------------------------------------


def _poison(capture: Path, dst: Path, sample: int) -> str:
    """A copy of `capture` whose training sample number `sample` has NaN hidden states; its id."""
    shutil.copytree(capture, dst)
    index = json.loads((dst / "train" / "index.json").read_text())
    e = index[sample]
    path = dst / "train" / e["shard"]
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["hidden"][e["offset"] : e["offset"] + e["length"]] = float("nan")
    save_file(tensors, str(path), metadata=meta)
    return e["sample_id"]


def test_nan_states_stop_training_at_the_first_bad_step(capture, tmp_path, capsys):
    from nestling.train.data import Stream

    index = json.loads((capture / "train" / "index.json").read_text())
    stream = Stream([e["length"] for e in index], 64, 0)
    bad = stream[2][0]  # first seen in microbatch 2 = step 3 (one microbatch per step)
    assert all(bad not in stream[m] for m in (0, 1))
    sid = _poison(capture, tmp_path / "cap", bad)
    out = tmp_path / "train"
    rc, err = cli(capsys, "train", tmp_path / "cap", "--out", out, "--steps", 6, "checkpoint_every=1", *TINY_TRAIN)
    assert rc == 1
    assert "loss is not finite" in err and "step 3" in err and sid in err and "capture --verify" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]
    assert torch.isfinite(
        load_file(str(out / "checkpoints" / "step-00000002" / "model.safetensors"))["fc.weight"]
    ).all()
    assert not (out / "manifest.json").exists() and not (out / "model.safetensors").exists()


def test_guard_reports_a_non_finite_gradient():
    from nestling.train import dist
    from nestling.train.guard import NonFiniteGuard, check_due, describe_non_finite

    g = NonFiniteGuard(torch.device("cpu"))
    g.note_loss(torch.tensor(1.5), 0)
    g.note_grad(torch.tensor(2.0), 0)
    g.note_grad(torch.tensor(float("inf")), 4)
    g.note_grad(torch.tensor(float("nan")), 7)  # later: the first one is reported
    with pytest.raises(NestlingError, match=r"gradient norm is not finite .* at step 5 \(its samples: a4, b4\)"):
        g.check(dist.Dist(), lambda kind, n: describe_non_finite(kind, n, 1, 1, lambda m: [f"a{m}", f"b{m}"], "CAP"))
    assert check_due(10, 100, (10, 0, 1000)) and not check_due(11, 100, (10, 0, 1000)) and check_due(100, 100, (7,))


# ---- export and eval refuse NaN weights; eval refuses to report acceptance of nothing ---------------------


@pytest.fixture(scope="module")
def draft_dir(tiny, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("draft")
    draft = new_draft(tiny, [1, 3, 4], draft_vocab_size=64)
    return export(make_train_dir(draft, root / "train"), root / "draft", ExportSettings(dtype="float32"))


def test_export_refuses_non_finite_weights(tiny, tmp_path, capsys):
    draft = new_draft(tiny, [1, 3, 4], draft_vocab_size=64)
    with torch.no_grad():
        draft.fc.weight[0, 0] = float("nan")
    train_dir = make_train_dir(draft, tmp_path / "train")
    rc, err = cli(capsys, "export", train_dir, "--out", tmp_path / "d")
    assert rc == 1 and "fc.weight holds 1 non-finite value" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / ".d.tmp").exists()


def test_eval_refuses_a_non_finite_draft(tiny, draft_dir, tmp_path, capsys):
    bad = tmp_path / "draft"
    shutil.copytree(draft_dir, bad)
    w = load_file(str(bad / "model.safetensors"))
    w["lm_head.weight"][3] = float("inf")
    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    prompts = write_prompts_jsonl(tmp_path / "p.jsonl", ["Say hello."])
    rc, err = cli(
        capsys,
        "eval",
        bad,
        "--target",
        tiny,
        "--prompts",
        prompts,
        "--out",
        tmp_path / "e",
        "--max-new-tokens",
        4,
        "--engine",
        "reference",
    )
    assert rc == 1 and "lm_head.weight holds" in err and "non-finite" in err
    assert not (tmp_path / "e" / "report.json").exists() and not (tmp_path / "e" / "manifest.json").exists()


def test_eval_with_nothing_drafted_is_an_error_not_acceptance_one(tiny, draft_dir, tmp_path, capsys):
    prompts = write_prompts_jsonl(tmp_path / "p.jsonl", ["Say hello."])
    rc, err = cli(
        capsys,
        "eval",
        draft_dir,
        "--target",
        tiny,
        "--prompts",
        prompts,
        "--out",
        tmp_path / "e",
        "--max-new-tokens",
        1,
        "--engine",
        "reference",
    )  # the prefill's token only: no draft step
    assert rc == 1 and "nothing was drafted over 1 prompt" in err and "1.000" not in err
    assert not (tmp_path / "e" / "manifest.json").exists()


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--temperature", -1, "temperature must be >= 0"),
        ("--max-new-tokens", 0, "max_new_tokens must be at least 1"),
        ("--k", 0, "k must be at least 1"),
    ],
)
def test_eval_settings_that_measure_nothing_are_refused(draft_dir, tiny, tmp_path, capsys, flag, value, message):
    prompts = write_prompts_jsonl(tmp_path / "p.jsonl", ["Say hello."])
    rc, err = cli(
        capsys, "eval", draft_dir, "--target", tiny, "--prompts", prompts, "--out", tmp_path / "e", flag, value
    )
    assert rc == 1 and message in err and not (tmp_path / "e").exists()


# ---- train settings refused when read ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "steps must be at least 1"),
        (["--steps", "-3"], "steps must be at least 1"),
        (["--epochs", "0"], "epochs must be a positive number"),
        (["lr=-1e-3"], "lr must be a positive number"),
        (["lr=nan"], "lr must be a positive number"),
        (["lr=.nan"], "lr must be a positive number"),
        (["warmup_ratio=2"], "warmup_ratio is a fraction"),
        (["grad_clip=-1"], "grad_clip must be a finite number >= 0"),
    ],
)
def test_train_settings_refused_before_anything_is_written(capture, tmp_path, capsys, args, message):
    out = tmp_path / "train"
    rc, err = cli(capsys, "train", capture, "--out", out, *args)
    assert rc == 1 and message in err and not out.exists()


# ---- capture: a layer list without aux layers ----------------------------------------------------------------


def test_capture_layers_without_aux_refused_before_loading(tiny, tmp_path, capsys):
    out = tmp_path / "cap"
    rc, err = cli(capsys, "capture", tmp_path / "no-such-data", "--target", tiny, "--out", out, "--layers", "6")
    assert rc == 1 and "layers [6] name no aux layer" in err and not out.exists()


# ---- data: non-text content and invalid UTF-8 are dropped and counted ---------------------------------------


def _data(tmp_path: Path, tiny: Path, lines: list[bytes], name: str = "in.jsonl", *extra) -> tuple[int, dict]:
    src = tmp_path / name
    src.write_bytes(b"".join(lines))
    out = tmp_path / "data"
    rc = main(["data", str(src), "--target", str(tiny), "--out", str(out), "workers=1", *extra])
    return rc, (json.loads((out / "manifest.json").read_text()) if rc == 0 else {})


def _line(content, role="assistant") -> bytes:
    return (
        json.dumps({"messages": [{"role": "user", "content": "Hi there."}, {"role": role, "content": content}]}) + "\n"
    ).encode()


def test_non_text_content_and_invalid_utf8_are_dropped_and_counted(tiny, tmp_path, capsys):
    lines = [
        _line("Hello."),
        _line(42),
        _line(["a", "b"]),
        _line(True),
        _line([{"type": "text", "text": "Ok."}]),
        _line("caf\u00e9").replace("caf\\u00e9".encode(), b"caf\xe9"),  # latin-1 byte: not UTF-8
        _line("\udc80x"),  # a JSON escape of half a character
        _line("Fine."),
    ]
    rc, m = _data(tmp_path, tiny, lines)
    assert rc == 0
    assert m["counts"]["read"] == 8 and m["counts"]["kept"] == 3
    assert m["counts"]["dropped"] == {"non_text_content": 3, "invalid_utf8": 2}
    assert "byte 0xe9" in " ".join(m["examples"]["invalid_utf8"])
    assert "Traceback" not in capsys.readouterr().err


def test_invalid_utf8_in_a_json_list_is_counted(tiny, tmp_path):
    good = {"conversations": [{"from": "human", "value": "Hi."}, {"from": "gpt", "value": "Hello."}]}
    body = json.dumps([good, {**good, "id": "BAD"}, good]).encode().replace(b'"BAD"', b'"B\xffD"')
    rc, m = _data(tmp_path, tiny, [body], "in.json")
    assert rc == 0 and m["counts"]["kept"] == 2 and m["counts"]["dropped"] == {"invalid_utf8": 1}


# ---- item 4: the tokenizer fingerprint covers the whole tokenizer --------------------------------------------


@pytest.fixture
def fewer_merges(tiny, tmp_path) -> Path:
    """The tiny target with its first 1,000 BPE merges removed: same vocabulary, other splits."""
    d = tmp_path / "fewer-merges"
    shutil.copytree(tiny, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["model"]["merges"] = tj["model"]["merges"][1000:]
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return d


def test_fingerprint_sees_removed_merges(tiny, fewer_merges):
    from nestling.targets.load import load_tokenizer, tokenizer_files_fingerprint, tokenizer_fingerprint

    a, b = load_tokenizer(tiny), load_tokenizer(fewer_merges)
    assert a.get_vocab() == b.get_vocab()  # what the old fingerprint looked at
    text = "The weather is nice today and the river runs through the hills."
    assert a(text)["input_ids"] != b(text)["input_ids"]
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(load_tokenizer(tiny))
    assert tokenizer_files_fingerprint(tiny) != tokenizer_files_fingerprint(fewer_merges)  # `nestling run`'s key


def test_data_redone_and_capture_refuses_for_another_tokenizer(tiny, fewer_merges, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(_line(f"The weather is nice today, reply {i}.") for i in range(3)))
    out = tmp_path / "data"
    assert main(["data", str(src), "--target", str(tiny), "--out", str(out), "workers=1"]) == 0
    first = json.loads((out / "manifest.json").read_text())
    capsys.readouterr()
    assert main(["data", str(src), "--target", str(fewer_merges), "--out", str(out), "workers=1"]) == 0
    err = capsys.readouterr().err
    assert "already complete" not in err and "redoing" in err
    second = json.loads((out / "manifest.json").read_text())
    assert second["inputs"]["tokenizer"] != first["inputs"]["tokenizer"]
    assert second["tokenizer_fingerprint_version"] == 2
    # the data now belongs to the new tokenizer: the old target's capture refuses it, before loading weights
    rc, err = cli(capsys, "capture", out, "--target", tiny, "--out", tmp_path / "cap")
    assert rc == 1 and "tokenized with another tokenizer" in err
