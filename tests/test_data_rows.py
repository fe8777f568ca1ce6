"""rows=turn: one sample per assistant turn (the conversation through that turn, supervising only it),
with the real SmolLM2 tokenizer and chat template; counts, length limit, split and workers."""

from __future__ import annotations

import json
from pathlib import Path

from nestling.data.dataset import load_samples
from nestling.data.run import prepare_data
from nestling.data.settings import DataSettings

THREE = {
    "conversations": [
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello! How can I help?"},
        {"from": "human", "value": "2+2?"},
        {"from": "gpt", "value": "4."},
        {"from": "human", "value": "And 3+3?"},
        {"from": "gpt", "value": "6, of course."},
    ]
}
LONG = {  # its first turn's row is ~80 tokens; the second turn's prompt alone is longer than 64
    "conversations": [
        {"from": "human", "value": "Tell me a story."},
        {"from": "gpt", "value": "Hi. " * 40},
        {"from": "human", "value": "Thanks!"},
        {"from": "gpt", "value": "You're welcome."},
    ]
}
REPLIES = ["Hello! How can I help?<|im_end|>", "4.<|im_end|>", "6, of course.<|im_end|>"]


def _prepare(tmp_path: Path, name: str, records: list, smollm2_dir, **kw) -> tuple[dict, Path]:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / name
    return prepare_data([src], smollm2_dir, out, DataSettings(**{"workers": 1, **kw})), out


def _supervised(tok, s) -> list[str]:
    runs, run = [], []
    for i, m in zip(s.input_ids, s.loss_mask):
        if m:
            run.append(i)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs + ([tok.decode(run)] if run else [])


def test_three_turns_give_three_prefix_rows_each_supervising_its_turn(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    m, out = _prepare(tmp_path, "turn", [THREE], smollm2_dir, rows="turn")
    whole_m, whole = _prepare(tmp_path, "conv", [THREE], smollm2_dir)
    (conv,) = load_samples(whole, "train")
    rows = load_samples(out, "train")
    assert [r.sample_id for r in rows] == [f"{conv.sample_id}#{k}" for k in range(3)]
    assert _supervised(tok, conv) == REPLIES
    for k, r in enumerate(rows):
        assert _supervised(tok, r) == [REPLIES[k]]  # that turn only, with its end-of-turn token
        assert r.input_ids == conv.input_ids[: len(r.input_ids)]  # the conversation through the turn
        assert r.loss_mask[-1] == 1 and tok.decode(r.input_ids[-1:]) == "<|im_end|>"  # nothing after it
        assert r.source_index == conv.source_index
    assert rows[-1].input_ids == conv.input_ids[:-1]  # the last row: all but the newline after <|im_end|>
    c = m["counts"]
    assert c["read"] == c["kept"] == 1 and c["rows"] == 3 and c["rows_dropped"] == {}
    assert whole_m["counts"]["rows"] == 1
    st = m["splits"]["train"]
    assert st["samples"] == 3 and st["supervised_tokens"] == whole_m["splits"]["train"]["supervised_tokens"]
    assert st["tokens"] == sum(len(r.input_ids) for r in rows)
    assert m["fingerprint"] != whole_m["fingerprint"]


def test_turn_rows_past_max_length_are_left_out_and_counted(tmp_path, smollm2_dir):
    # row 0 is ~80 tokens: truncated to 64, it keeps part of its reply; row 1's prompt alone exceeds 64
    m, out = _prepare(tmp_path, "t", [LONG, THREE], smollm2_dir, rows="turn", max_length=64)
    c = m["counts"]
    assert c["kept"] == 2 and c["rows"] == 1 + 2 and c["dropped"] == {}  # THREE's third row needs > 64 too
    assert c["rows_dropped"] == {"no_supervised_tokens_after_truncation": 2}
    assert c["altered"]["turn_rows_past_max_length_dropped"] == 2
    assert c["altered"]["truncated_to_max_length"] == 2
    assert max(len(s.input_ids) for s in load_samples(out, "train")) == 64
    m, out = _prepare(tmp_path, "d", [LONG, THREE], smollm2_dir, rows="turn", max_length=64, overflow="drop")
    assert m["counts"]["dropped"] == {"too_long": 1}  # every row of `LONG` is too long: the record goes
    assert m["counts"]["rows"] == 2 and m["counts"]["rows_dropped"] == {"too_long": 1}


def test_supervision_past_max_length_is_counted_alike_in_both_layouts_and_logged(tmp_path, smollm2_dir, capsys):
    from nestling.data.run import CUT_HINT, cut_hint

    full, _ = _prepare(tmp_path, "full", [LONG, THREE], smollm2_dir)  # nothing is past 2,048
    assert full["counts"]["supervised_tokens_cut"] == 0
    assert "not trained on" not in capsys.readouterr().err
    everything = full["splits"]["train"]["supervised_tokens"]
    for rows in ("conversation", "turn"):  # right truncation loses the same supervised tokens either way
        m, _ = _prepare(tmp_path, rows, [LONG, THREE], smollm2_dir, rows=rows, max_length=64)
        kept = m["splits"]["train"]["supervised_tokens"]
        assert 0 < kept < everything and m["counts"]["supervised_tokens_cut"] == everything - kept
        err = capsys.readouterr().err
        share = (everything - kept) / everything
        assert share > CUT_HINT and f"{share:.0%} of the assistant tokens" in err
    m, _ = _prepare(tmp_path, "drop", [LONG, THREE], smollm2_dir, rows="turn", max_length=64, overflow="drop")
    assert m["counts"]["supervised_tokens_cut"] == everything - m["splits"]["train"]["supervised_tokens"]
    assert cut_hint(10, 90, 64) is None and "max_length=64" in (cut_hint(11, 89, 64) or "")


def test_rows_of_a_conversation_share_its_split_and_workers_change_nothing(tmp_path, smollm2_dir):
    many = [
        {
            "conversations": [
                {"from": "human", "value": f"q{i}"},
                {"from": "gpt", "value": f"a{i}"},
                {"from": "human", "value": f"r{i}"},
                {"from": "gpt", "value": f"b{i}"},
            ]
        }
        for i in range(40)
    ]
    m1, one = _prepare(tmp_path, "one", many, smollm2_dir, rows="turn", held_out=0.3)
    m2, two = _prepare(tmp_path, "two", many, smollm2_dir, rows="turn", held_out=0.3, workers=2)  # head start
    assert m1["fingerprint"] == m2["fingerprint"] and m1["splits"] == m2["splits"] and m1["counts"] == m2["counts"]
    for split in ("train", "heldout"):
        assert [(s.sample_id, s.input_ids, s.loss_mask) for s in load_samples(one, split)] == [
            (s.sample_id, s.input_ids, s.loss_mask) for s in load_samples(two, split)
        ]
    ids = {split: {s.sample_id.split("#")[0] for s in load_samples(one, split)} for split in ("train", "heldout")}
    assert ids["heldout"] and not ids["train"] & ids["heldout"]
    assert m1["counts"]["rows"] == 80 and m1["splits"]["heldout"]["samples"] == 2 * len(ids["heldout"])


def test_turn_ranges_from_generation_tags_and_prefix_diff_agree(smollm2_dir):
    """`Encoded.turns` (the rows' spans) is the same for the template's own mask and for prefix diffing."""
    from test_data_chat import CHAT, CHATML_GENERATION, SYSTEM
    from transformers import AutoTokenizer

    from nestling.data.chat import chat_format, encode_conversations

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tagged = encode_conversations(chat_format(tok, CHATML_GENERATION), [SYSTEM + CHAT])[0]
    diffed = encode_conversations(chat_format(tok), [SYSTEM + CHAT])[0]
    assert tagged.input_ids == diffed.input_ids and tagged.turns == diffed.turns and len(tagged.turns) == 2
    assert [tok.decode(tagged.input_ids[a : b + 1]) for a, b in tagged.turns] == [
        "The capital of France is Paris.<|im_end|>",
        "Rome.<|im_end|>",
    ]
