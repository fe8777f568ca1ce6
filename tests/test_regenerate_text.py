"""Regeneration for base targets (mode=text): each text record's prefix is kept and the target writes the
rest. On the tiny random-weight Llama without a chat template, through the hf engine: the stored text is
the record's own prefix followed by the target's greedy continuation (token for token what transformers
`generate` gives from the prefix), and the data stage's text mode reads the result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from base_helpers import without_chat_template
from nestling.errors import NestlingError
from nestling.regenerate.run import regenerate
from nestling.regenerate.settings import RegenerateSettings

TEXTS = [
    "Owls hunt at night, and their soft feathers make their flight almost silent.",
    "A river carves its valley over thousands of years.",
    "Hi",  # shorter than the prefix: continued from its end
]


@pytest.fixture(scope="module")
def base_bos_dir(tiny_target) -> Path:
    from nestling.assets import cache_dir

    return without_chat_template(tiny_target("llama"), cache_dir() / "tiny" / "llama-s0-base-bos", with_bos=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _greedy(model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_new,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    gen = out[0, len(prompt) :].tolist()
    stop = next((i for i, t in enumerate(gen) if t in eos), None)
    return gen if stop is None else gen[: stop + 1]


def test_text_mode_keeps_the_prefix_and_writes_the_targets_greedy_continuation(tmp_path, base_bos_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nestling.data.dataset import load_samples
    from nestling.data.run import prepare_data
    from nestling.data.settings import DataSettings

    src = tmp_path / "texts.jsonl"
    recs = [{"text": t} for t in TEXTS] + [
        {"messages": [{"role": "user", "content": "Name a bird."}, {"role": "assistant", "content": "A wren."}]}
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = RegenerateSettings(engine="hf", prefix_tokens=6, max_new_tokens=7, save_token_ids=True, hf_batch_size=2)
    m = regenerate(src, base_bos_dir, tmp_path / "regen", s)  # mode auto: no chat template, so text
    assert m["settings"]["mode"] == "text" and m["files"]["messages"] == "text.jsonl"
    assert m["counts"]["kept"] == 4 and m["counts"]["altered"] == {"chat_flattened_to_text": 1}
    rows = [json.loads(x) for x in (tmp_path / "regen" / "text.jsonl").read_text().splitlines()]
    assert not (tmp_path / "regen" / "messages.jsonl").exists()

    tok = AutoTokenizer.from_pretrained(base_bos_dir)
    model = AutoModelForCausalLM.from_pretrained(base_bos_dir, dtype=torch.float32)
    eos = [tok.eos_token_id]
    originals = TEXTS + ["Name a bird.\n\nA wren."]
    for row, original in zip(rows, originals):
        ids = tok(original)["input_ids"]
        prefix = ids[: min(6, len(ids))]  # BOS + 5 tokens (all of "Hi")
        assert prefix[0] == tok.bos_token_id
        kept = row["text"][: row["prefix_chars"]]
        assert original.startswith(kept) and tok(kept)["input_ids"] == prefix  # the record's own prefix text
        gen = _greedy(model, prefix, 7, eos)
        assert row["completion_token_ids"] == gen  # the target's greedy continuation, token for token
        assert (
            row["text"]
            == kept
            + tok.decode(prefix + gen, skip_special_tokens=True)[len(tok.decode(prefix, skip_special_tokens=True)) :]
        )
    assert rows[2]["text"].startswith("Hi") and rows[2]["prefix_chars"] == 2

    # the data stage's text mode reads what regenerate wrote
    d = prepare_data([tmp_path / "regen" / "text.jsonl"], base_bos_dir, tmp_path / "data", DataSettings(workers=1))
    assert d["mode"] == "text" and d["counts"]["kept"] == 4
    (row,) = load_samples(tmp_path / "data", "train")  # four short documents: one packed row
    assert row.input_ids[0] == tok.bos_token_id and sum(row.loss_mask) == len(row.input_ids)

    # a rerun is a no-op; the same folder with another prefix is refused
    assert regenerate(src, base_bos_dir, tmp_path / "regen", s)["fingerprint"] == m["fingerprint"]
    with pytest.raises(NestlingError, match="other inputs or settings"):
        regenerate(src, base_bos_dir, tmp_path / "regen", RegenerateSettings(**{**s.__dict__, "prefix_tokens": 3}))


def test_prefix_fraction_and_chat_mode_on_a_base_target(tmp_path, base_bos_dir):
    from transformers import AutoTokenizer

    from nestling.regenerate.settings import output_settings
    from nestling.regenerate.text import prefixes

    tok = AutoTokenizer.from_pretrained(base_bos_dir)
    s = RegenerateSettings(mode="text", prefix_fraction=0.5)
    (p,) = prefixes(tok, [TEXTS[0]], s)
    n = len(tok(TEXTS[0])["input_ids"])
    assert len(p.ids) == round(n * 0.5) and TEXTS[0].startswith(p.text)
    # a prefix never ends inside a character several byte tokens spell
    # (BOS, "O", "wl", then three byte tokens spell " 🦉": 4 tokens would end inside it)
    (p,) = prefixes(tok, ["Owl 🦉 flies"], RegenerateSettings(prefix_tokens=4))
    assert p.text == "Owl 🦉" and len(p.ids) == 6 and tok.decode(p.ids, skip_special_tokens=True) == p.text

    # the prefix settings count only in text mode; chat-mode fingerprints are as before
    assert "prefix_tokens" not in output_settings(RegenerateSettings(mode="chat"))
    assert "mode" not in output_settings(RegenerateSettings(mode="chat"))
    assert output_settings(RegenerateSettings(mode="text"))["prefix_tokens"] == 64

    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(NestlingError, match="no chat template.*mode=text"):
        regenerate(src, base_bos_dir, tmp_path / "chat", RegenerateSettings(engine="hf", mode="chat"))
