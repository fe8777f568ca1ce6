"""A GGUF's tokenizer as transformers rebuilds it must split words as the model's own vocabulary does:
transformers 5.16-5.17 rebuild Gemma-3's without its merges, and nothing else fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_data_chat import gguf_tokenizer

from nestling.errors import NestlingError
from nestling.targets.load import WORD_PROBE, check_tokenizer_splits_words


@pytest.mark.parametrize("name", ["qwen2", "phi-3", "llama-bpe", "llama-spm", "gpt-2"])
def test_real_vocabularies_pass(name):
    check_tokenizer_splits_words(gguf_tokenizer(name), Path(f"{name}.gguf"))


def test_smollm2_passes(smollm2_dir):
    from transformers import AutoTokenizer

    check_tokenizer_splits_words(AutoTokenizer.from_pretrained(smollm2_dir), Path("smollm2.gguf"))


def _without_merges(name: str):
    """The same real vocabulary with the merges lost, as the faulty rebuild leaves it: every word in pieces."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(gguf_tokenizer(name).backend_tokenizer.to_str())
    spec["model"]["merges"] = []
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


def test_a_vocabulary_without_its_merges_is_refused():
    broken = _without_merges("llama-bpe")
    assert len(broken(WORD_PROBE, add_special_tokens=False)["input_ids"]) > 2 * len(WORD_PROBE.split())
    with pytest.raises(NestlingError, match=r"splits 21 English words into \d+ tokens.*transformers>=5\.18"):
        check_tokenizer_splits_words(broken, Path("gemma.gguf"))


def test_the_conversion_builds_nothing_from_a_broken_tokenizer(tmp_path, monkeypatch):
    """convert_gguf checks the tokenizer before it writes a folder: no cache entry is left to reuse."""
    import transformers

    from nestling.assets import smollm2_gguf
    from nestling.targets.load import convert_gguf

    broken = _without_merges("gpt-2")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: broken)
    out = tmp_path / "model"
    with pytest.raises(NestlingError, match="lost the vocabulary's merges"):
        convert_gguf(smollm2_gguf(), out)
    assert not out.exists() and not Path(str(out) + ".part").exists()


@pytest.mark.slow
def test_a_gguf_converted_before_the_check_is_converted_again(tmp_path, monkeypatch):
    """A cached conversion from before the check (named without "-words") may hold a faulty tokenizer:
    resolve_target converts the GGUF again, checked, beside it, and never reads the old folder."""
    from nestling.assets import smollm2_gguf
    from nestling.manifest import hash_files
    from nestling.targets.load import resolve_target

    gguf = smollm2_gguf()  # from the real cache, before the cache moves
    monkeypatch.setenv("NESTLING_CACHE", str(tmp_path))
    old = tmp_path / "models" / f"{gguf.stem}-{hash_files([gguf])}"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")  # would break any load that used it
    got = resolve_target(gguf)
    assert got.name == f"{old.name}-words" and (got / "tokenizer.json").exists()
    assert (old / "config.json").read_text() == "{}"
