"""Test helper: a data-stage folder built directly from the real tokenizer's chat template.

The data stage is built in parallel; this helper writes its documented format (docs/formats.md)
with `write_shard` + `write_manifest`, so capture tests do not depend on it. Swap for the real stage later.
"""

from __future__ import annotations

import random
from pathlib import Path

from nestling.data.dataset import Sample, write_shard
from nestling.manifest import write_manifest
from nestling.targets.load import tokenizer_fingerprint

WORDS = (
    "the cat sat on a warm mat while rain fell over quiet hills and seven birds sang about "
    "bread, rivers, numbers 42 and 1999, code like def f(x): return x*2, and questions?"
).split()


def _ids(tok, messages, gen: bool = False) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def conversation_sample(tok, messages: list[dict], sample_id: str, index: int) -> Sample:
    """Render with the template; loss_mask = tokens each assistant turn adds (prefix diff)."""
    ids = _ids(tok, messages)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            a, b = len(_ids(tok, messages[:i], gen=True)), len(_ids(tok, messages[: i + 1]))
            mask[a:b] = [1] * (b - a)
    return Sample(sample_id, index, ids, mask)


def random_conversations(n: int, seed: int, min_words: int = 2, max_words: int = 40) -> list[list[dict]]:
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))

    convs = []
    for _ in range(n):
        turns = rng.randint(1, 2)
        msgs = []
        for _ in range(turns):
            msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        convs.append(msgs)
    return convs


def make_data_dir(
    out: Path,
    tokenizer,
    target: Path | str,
    n_train: int = 6,
    n_heldout: int = 2,
    seed: int = 0,
    min_words: int = 2,
    max_words: int = 40,
) -> Path:
    """A complete data folder (train + heldout parquet shards and a manifest) tokenized by `tokenizer`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    convs = random_conversations(n_train + n_heldout, seed, min_words, max_words)
    samples = [conversation_sample(tokenizer, c, f"test.jsonl:{i}", i) for i, c in enumerate(convs)]
    splits = {"train": samples[:n_train], "heldout": samples[n_train:]}
    info = {}
    for split, ss in splits.items():
        if not ss:
            continue
        write_shard(out / f"{split}-00000.parquet", ss)
        info[split] = {
            "samples": len(ss),
            "tokens": sum(len(s.input_ids) for s in ss),
            "supervised_tokens": sum(sum(s.loss_mask) for s in ss),
            "files": [f"{split}-00000.parquet"],
        }
    write_manifest(
        out,
        "data",
        {"seed": seed},
        inputs={"tokenizer": tokenizer_fingerprint(tokenizer), "data": ["test.jsonl"]},
        target=str(target),
        counts={"read": len(samples), "kept": len(samples)},
        splits=info,
    )
    return out
