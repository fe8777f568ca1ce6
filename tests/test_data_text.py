"""The data stage's text mode (base targets, no chat template): every token supervised, documents as the
target sees them (its tokenizer's special tokens, then EOS) packed whole into rows of max_length, the
same rows for any number of workers; `mode=auto` picks it where the tokenizer has no chat template.
Real tokenizers (SmolLM2's, with and without its template, and with a BOS post-processor)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from base_helpers import without_chat_template
from nestling.data.dataset import load_samples
from nestling.data.run import prepare_data
from nestling.data.settings import DataSettings
from nestling.errors import NestlingError

WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls watch from an old oak".split()
DOCS = [" ".join(WORDS[(3 * i) % len(WORDS) :] + WORDS[: (3 * i) % len(WORDS)]) * (1 + i % 4) for i in range(12)]


@pytest.fixture(scope="module")
def base_dir(tiny_target) -> Path:
    """The tiny Llama without a chat template (a base model); its tokenizer adds no BOS."""
    from nestling.assets import cache_dir

    return without_chat_template(tiny_target("llama"), cache_dir() / "tiny" / "llama-s0-base")


@pytest.fixture(scope="module")
def base_bos_dir(tiny_target) -> Path:
    """The same with a tokenizer that starts every text with BOS (as Llama's and Gemma's do)."""
    from nestling.assets import cache_dir

    return without_chat_template(tiny_target("llama"), cache_dir() / "tiny" / "llama-s0-base-bos", with_bos=True)


def _write(tmp_path: Path, records: list[dict], name: str = "docs.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


def _docs_as_target_sees_them(target: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    return [list(tok(t)["input_ids"]) + [tok.eos_token_id] for t in texts]


def _expected_rows(docs: list[list[int]], max_length: int) -> list[list[int]]:
    """Whole documents, in order, into rows of at most max_length (each doc already <= max_length)."""
    rows: list[list[int]] = [[]]
    for d in docs:
        if rows[-1] and len(rows[-1]) + len(d) > max_length:
            rows.append([])
        rows[-1] += d
    return rows


@pytest.mark.parametrize("bos", [False, True])
def test_text_rows_are_whole_documents_packed_with_every_token_supervised(tmp_path, base_dir, base_bos_dir, bos):
    target = base_bos_dir if bos else base_dir
    src = _write(tmp_path, [{"text": t} for t in DOCS])
    m = prepare_data([src], target, tmp_path / "out", DataSettings(workers=1, max_length=96))
    assert m["mode"] == "text" and m["mask_method"] == "text_every_token"
    docs = _docs_as_target_sees_them(target, DOCS)
    assert all(len(d) <= 96 for d in docs) and (docs[0][0] == 1) == bos  # BOS where the tokenizer adds it
    rows = load_samples(tmp_path / "out", "train")
    assert [list(r.input_ids) for r in rows] == _expected_rows(docs, 96)
    assert len(rows) < len(DOCS)  # packed: several documents share a row
    for r in rows:
        assert len(r.input_ids) <= 96 and list(r.loss_mask) == [1] * len(r.input_ids)  # every token supervised
    # a row's id names its first document and how many follow it; together they are every document once
    n = [1 + int(r.sample_id.split("+")[1]) if "+" in r.sample_id else 1 for r in rows]
    assert sum(n) == len(DOCS)
    firsts = [int(r.sample_id.split("+")[0].split(":")[1]) for r in rows]
    assert firsts == [sum(n[:k]) for k in range(len(rows))] and [r.source_index for r in rows] == firsts
    assert m["counts"]["rows"] == len(rows) and m["splits"]["train"]["supervised_tokens"] == sum(map(len, docs))


def test_text_rows_are_the_same_for_any_workers_and_runs(tmp_path, base_dir):
    src = _write(tmp_path, [{"text": t} for t in DOCS * 12])  # 144 records: 3 worker chunks
    s = dict(max_length=128, held_out=0.25)
    m1 = prepare_data([src], base_dir, tmp_path / "a", DataSettings(workers=1, **s))
    m2 = prepare_data([src], base_dir, tmp_path / "b", DataSettings(workers=2, **s))
    assert m1["fingerprint"] == m2["fingerprint"] and m1["splits"] == m2["splits"] and m1["counts"] == m2["counts"]
    for split in ("train", "heldout"):
        a, b = load_samples(tmp_path / "a", split), load_samples(tmp_path / "b", split)
        assert [(x.sample_id, list(x.input_ids)) for x in a] == [(y.sample_id, list(y.input_ids)) for y in b]
        assert a  # both splits hold rows: each is packed from its own documents
    # regenerated continuations of one input text (greedy, sampled: same source_index) share a split
    from nestling.data.workers import split_group

    assert split_group("a.jsonl:0", {"source_index": 3, "text": "x"}) == split_group(
        "b.jsonl:7", {"source_index": 3, "text": "y"}
    )
    # the split is per document, before packing: no document is in both
    train_ids = {sid for r in load_samples(tmp_path / "a", "train") for sid in [r.sample_id.split("+")[0]]}
    held_ids = {sid for r in load_samples(tmp_path / "a", "heldout") for sid in [r.sample_id.split("+")[0]]}
    assert not train_ids & held_ids


def test_long_documents_are_cut_or_dropped_and_bad_records_counted(tmp_path, base_dir):
    long = " ".join(WORDS * 20)
    records = [
        {"text": "short one"},
        {"text": long},
        {"text": ""},
        {"text": 7},
        {"text": "has <|im_end|> inside"},
        {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]},
        {"other": 1},
    ]
    src = _write(tmp_path, records)
    m = prepare_data([src], base_dir, tmp_path / "t", DataSettings(workers=1, max_length=64))
    c = m["counts"]
    assert c["dropped"] == {"empty_text": 1, "malformed_record": 2, "special_token_in_content": 1}
    assert c["altered"] == {"chat_flattened_to_text": 1, "truncated_to_max_length": 1} and c["kept"] == 3
    rows = load_samples(tmp_path / "t", "train")
    docs = _docs_as_target_sees_them(base_dir, ["short one", long, "Hi there\n\nHello!"])
    assert [list(r.input_ids) for r in rows] == _expected_rows([docs[0], docs[1][:64], docs[2]], 64)
    assert c["supervised_tokens_cut"] == len(docs[1]) - 64

    m = prepare_data([src], base_dir, tmp_path / "d", DataSettings(workers=1, max_length=64, overflow="drop"))
    assert m["counts"]["dropped"]["too_long"] == 1 and m["counts"]["kept"] == 2


def test_auto_mode_picks_text_without_a_chat_template_and_chat_with_one(base_dir, smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    from nestling.data.chat import ChatFormat
    from nestling.data.text import TextFormat, data_format, resolve_mode

    base, chat = AutoTokenizer.from_pretrained(base_dir), AutoTokenizer.from_pretrained(smollm2_dir)
    assert resolve_mode("auto", base, None) == "text" and isinstance(data_format(base, None, "auto"), TextFormat)
    assert resolve_mode("auto", chat, None) == "chat" and isinstance(data_format(chat, None, "auto"), ChatFormat)
    assert resolve_mode("auto", base, chat.chat_template) == "chat"  # a template given in the settings
    assert isinstance(data_format(chat, None, "text"), TextFormat)  # asked for: a chat target read as text
    with pytest.raises(NestlingError, match="mode=text"):
        data_format(base, None, "chat")
    with pytest.raises(NestlingError, match="mode must be"):
        DataSettings(mode="plain")  # type: ignore[arg-type]

    # the data stage end to end: a chat target and chat data stay in chat mode
    src = _write(tmp_path, [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}])
    m = prepare_data([src], smollm2_dir, tmp_path / "c", DataSettings(workers=1))
    assert m["mode"] == "chat" and m["mask_method"] == "prefix_diff"


def test_text_mode_held_out_rows_give_plain_text_eval_prompts(tmp_path, base_bos_dir):
    from transformers import AutoTokenizer

    from nestling.evaluate.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(base_bos_dir)
    src = _write(tmp_path, [{"text": t} for t in DOCS])
    prepare_data([src], base_bos_dir, tmp_path / "d", DataSettings(workers=1, max_length=96, held_out=0.5))
    held = load_samples(tmp_path / "d", "heldout")
    prompts = load_prompts(tmp_path / "d", tok)
    assert len(prompts) == len(held)
    for p, r in zip(prompts, held):
        first = list(r.input_ids[: list(r.input_ids).index(tok.eos_token_id)])  # the row's first document
        assert p == first[: len(first) // 2] and p[0] == tok.bos_token_id
    # a prompts file for a base target: plain text, BOS added, no chat template needed
    pf = tmp_path / "prompts.jsonl"
    pf.write_text(json.dumps({"prompt": "Once upon"}) + "\n" + json.dumps({"text": "The owl"}) + "\n")
    assert load_prompts(pf, tok) == [tok("Once upon")["input_ids"], tok("The owl")["input_ids"]]


def test_a_gguf_targets_bos_flag_is_read_from_its_header():
    """transformers' GGUF tokenizer drops `tokenizer.ggml.add_bos_token` (Gemma's and Llama-2's texts then
    start without BOS); the conversion reads it from the header and passes add_bos_token=True (targets/load.py)."""
    from nestling.assets import smollm2_gguf, vocab_gguf
    from nestling.targets.load import gguf_adds_bos

    # as the gguf package's reader reads them (which parses the whole vocabulary first: seconds)
    for g, adds in ((vocab_gguf("llama-spm"), True), (vocab_gguf("llama-bpe"), False), (smollm2_gguf(), False)):
        assert gguf_adds_bos(g) is adds, g.name


def test_two_text_inputs_are_logged_as_documents(tmp_path, base_dir, capsys):
    """With several text inputs the data log gives each one's share in documents, not conversations."""
    a = _write(tmp_path, [{"text": t} for t in DOCS[:5]], "a.jsonl")
    b = _write(tmp_path, [{"text": t} for t in DOCS[5:]], "b.jsonl")
    m = prepare_data([a, b], base_dir, tmp_path / "out", DataSettings(workers=1, max_length=96, held_out=0.0))
    err = capsys.readouterr().err
    assert m["mode"] == "text" and "documents" in err
    assert re.search(r"\[data\] source a\.jsonl: 5 documents, [\d,]+ tokens", err), err
    assert re.search(r"\[data\] source b\.jsonl: 7 documents, [\d,]+ tokens", err), err
    assert "conversations" not in err, err
