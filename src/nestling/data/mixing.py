"""Mixing several inputs: `data.weights` and each source's share of the kept tokens.

`weights` maps an input, as the config or command line names it (`builtin:maths`, a path, or a file
name), to how many times each of its conversations is used: 2 uses each twice, 0.5 a seeded half of them
(`seed`), 1.5 each once and a seeded half a second time. An input not named keeps weight 1. Repeats of a
conversation keep its sample id, so they fall in the same split (a held-out prompt never trains the draft
through its copy).

The log then gives one line per source: conversations kept, tokens and share of all kept tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

from nestling.errors import NestlingError


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _matches(key: str, path: Path) -> bool:
    """Whether the `weights` key `key` names the input file `path`."""
    if key.startswith("builtin:"):
        from nestling.data.builtin import NAMES, expected_path

        name = key[len("builtin:") :]
        return name in NAMES and _same_file(expected_path(name), path)
    return key == str(path) or key == path.name or _same_file(Path(key), path)


def input_weights(inputs: list[Path], weights: dict) -> list[float]:
    """Each input's weight; a key naming no input is an error (a typo would silently weigh nothing)."""
    out = [1.0] * len(inputs)
    for key, w in weights.items():
        hits = [i for i, p in enumerate(inputs) if _matches(str(key), p)]
        if not hits:
            raise NestlingError(
                f"data.weights names {key!r}, which is none of the inputs ({', '.join(str(p) for p in inputs)}); "
                "name an input as the config does (builtin:maths, its path or its file name)"
            )
        for i in hits:
            out[i] = float(w)
    return out


def weighed_count(n: int, w: float) -> int:
    """How many records `weigh` makes of `n` at weight `w`."""
    return n * int(w) + round((w - int(w)) * n)


def weigh(groups: list[list], weights: list[float], seed: int) -> list:
    """The records of each input (`groups`, in input order) repeated or sampled by its weight: whole
    copies first, then a seeded subset for the fraction, each in the input's own order."""
    out: list = []
    for k, (recs, w) in enumerate(zip(groups, weights)):
        out += recs * int(w)
        extra = weighed_count(len(recs), w) - len(recs) * int(w)
        if extra:
            pick = sorted(random.Random(f"{seed}:{k}").sample(range(len(recs)), extra))
            out += [recs[i] for i in pick]
    return out


def source_of(sample_id: str) -> str:
    """The input a sample id names (`file:index`, the reader's ids)."""
    return sample_id.rsplit(":", 1)[0]


def share_lines(by_source: dict[str, dict[str, int]], unit: str = "conversations") -> list[str]:
    """One log line per source: its records (`unit`: conversations, or a text run's documents), tokens
    and share of all kept tokens."""
    total = sum(s["tokens"] for s in by_source.values()) or 1
    return [
        f"[data] source {name}: {s['conversations']:,} {unit}, {s['tokens']:,} tokens, "
        f"{s['tokens'] / total:.1%} of the tokens"
        for name, s in by_source.items()
    ]
