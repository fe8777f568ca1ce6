"""The quality benchmark's held-out prompt sets (chat, code, maths): they load from the package
index, render with the target's chat template, and share no text with the training data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nestling.errors import NestlingError
from nestling.evaluate.domains import domain_prompts, write_domain_prompts
from nestling.evaluate.prompts import load_prompts
from nestling.targets.load import load_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))


def test_domain_sets_load_and_render(smollm2_dir, tmp_path):
    tok = load_tokenizer(smollm2_dir)
    for domain, count, needle in (("code", 164, "def has_close_elements("), ("maths", 270, "strings of length 6")):
        prompts = domain_prompts(domain)
        assert len(prompts) == len(set(prompts)) == count
        path = write_domain_prompts(domain, tmp_path / f"{domain}.jsonl", limit=5)
        ids = load_prompts(path, tok)
        assert len(ids) == 5
        text = tok.decode(ids[0])
        assert needle in text and text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(NestlingError, match="unknown prompt domain"):
        domain_prompts("poetry")


def _long_lines(text: str, least: int = 40) -> set[str]:
    """Lines distinctive enough that sharing one means sharing the problem (short ones, like
    `def is_prime(n):` or `Task`, occur everywhere)."""
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) >= least}


@pytest.mark.slow
def test_domain_sets_disjoint_from_training(tmp_path):
    """The quality benchmark trains on ShareGPT minus its held-out tail: no held-out chat prompt is a
    user turn of a training conversation, and no code or maths problem shares a distinctive line with
    any ShareGPT conversation (all of it, held out or not)."""
    import quality

    train_path, chat_path, _ = quality.split_sharegpt(tmp_path, 100, None)
    train = json.loads(train_path.read_text())
    seen: set[str] = set()
    user_turns: set[str] = set()
    for conv in train:
        for turn in conv["conversations"]:
            value = str(turn.get("value", ""))
            seen |= _long_lines(value)
            if quality.ROLES.get(str(turn.get("from")).lower()) == "user":
                user_turns.add(value.strip())
    chat = [json.loads(line)["messages"][0]["content"] for line in chat_path.read_text().splitlines()]
    assert len(chat) >= 90 and not [c for c in chat if c.strip() in user_turns]
    for c in chat:
        seen |= _long_lines(c)  # the held-out conversations too, for code and maths
    for domain in ("code", "maths"):
        shared = [p for p in domain_prompts(domain) if _long_lines(p) & seen]
        assert not shared, (domain, len(shared), shared[:2])
