"""The piecewise tokenization (pieces between special tokens, no offsets) must give exactly the ids and
masks of the reference method (whole text with offsets), on real ShareGPT conversations."""

from __future__ import annotations

import numpy as np
import pytest

from nestling.data.chat import chat_format, encode_conversations
from nestling.data.normalize import normalize_record
from nestling.data.readers import read_input

from test_data_chat import gguf_tokenizer

N = 300  # conversations: enough for code, lists, multilingual text and long multi-turn chats


@pytest.fixture(scope="module")
def conversations(sharegpt_path):
    recs, _ = read_input(sharegpt_path, N)
    out = [normalize_record(r.data).messages for r in recs if r.data is not None]
    return [m for m in out if m]


def assert_same(tok, convs, **kw):
    fmt = chat_format(tok)
    fast = encode_conversations(fmt, convs, piecewise=True, **kw)
    ref = encode_conversations(fmt, convs, piecewise=False, **kw)
    kept = 0
    for a, b in zip(fast, ref):
        assert (a.drop, a.detail, sorted(a.altered)) == (b.drop, b.detail, sorted(b.altered))
        if b.drop is None:
            kept += 1
            assert list(a.input_ids) == list(b.input_ids)
            assert np.array_equal(a.loss_mask, b.loss_mask)
    assert kept > len(convs) // 2  # the comparison covered real samples


@pytest.mark.slow
@pytest.mark.parametrize("last_turn_only", [False, True])
def test_piecewise_matches_reference_smollm2(smollm2_dir, conversations, last_turn_only):
    from transformers import AutoTokenizer

    assert_same(AutoTokenizer.from_pretrained(smollm2_dir), conversations, last_turn_only=last_turn_only)


@pytest.mark.parametrize("name", ["qwen2", "phi-3"])
def test_piecewise_matches_reference_other_templates(name, conversations):
    assert_same(gguf_tokenizer(name), conversations[:120])


def test_metaspace_first_tokenizer_uses_the_reference_method():
    from nestling.data.chat import _segment_ids

    tok = gguf_tokenizer("llama-spm")  # Metaspace(prepend_scheme=first): pieces are not independent
    assert _segment_ids(chat_format(tok, "{{ messages }}")) is None
