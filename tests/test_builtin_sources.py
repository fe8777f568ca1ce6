"""builtin:maths and builtin:code (nestling.data.builtin): built deterministically from packages on the
package index, each with a manifest, and disjoint from the evaluation sets (HumanEval's functions,
CHAMP's problems) on the text: no run of 10 normalized words in common, checked here by the test's own
n-gram code, not the builder's. The maths generator runs in nestling's own environment in the cache
(made once, about a minute, on the first run of this file on a machine)."""

from __future__ import annotations

import hashlib
import json
import re
import textwrap
import types
from pathlib import Path

import pytest

from nestling.data import builtin

N = 10


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def grams(text: str) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + N]) for i in range(len(w) - N + 1)}


@pytest.fixture(scope="module")
def eval_grams() -> set[tuple[str, ...]]:
    """Every 10-word run of HumanEval's prompts and CHAMP's problems, read from their files, whose words
    are mostly real words (runs of digits such as `0 1 2 3 4 5 6 7 8 9` are in every kind of text)."""
    import gzip

    from nestling.assets import champ_json, humaneval_jsonl

    with gzip.open(humaneval_jsonl(), "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    texts += [p["_text"] for p in json.loads(champ_json().read_text())["problems"].values()]
    assert len(texts) == 164 + 270
    out: set[tuple[str, ...]] = set()
    for t in texts:
        out |= {g for g in grams(t) if sum(len(x) >= 3 and x.isalpha() for x in g) * 2 >= N}
    assert len(out) > 5000
    return out


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shared(rows: list[dict], eval_grams: set) -> list[str]:
    return [r["id"] for r in rows if grams("\n".join(m["value"] for m in r["conversations"])) & eval_grams]


def check_manifest(path: Path, source: str, rows: list[dict]) -> dict:
    m = json.loads((path.parent / "manifest.json").read_text())
    assert m["source"] == source and m["count"] == len(rows) and m["file"] == path.name
    assert m["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert m["packages"] and all("==" in p for p in m["packages"])
    return m


def test_the_overlap_filter_finds_an_evaluation_problem_however_it_is_written():
    from nestling.evaluate.domains import domain_prompts

    code = domain_prompts("code")[0]  # has_close_elements, inside nestling's own instruction
    champ = domain_prompts("maths")[5]
    planted = [
        {"id": "a", "conversations": [{"from": "human", "value": "Please do this:\n" + code.upper()}]},
        {"id": "b", "conversations": [{"from": "human", "value": "  ".join(champ.split())[20:400]}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Sort 0 1 2 3 4 5 6 7 8 9 10 11 please."}]},
        {"id": "d", "conversations": [{"from": "human", "value": "Write a haiku about the sea and the sky."}]},
    ]
    found = [r["id"] for r in builtin.overlapping(planted, builtin.eval_ngrams())]
    assert found == ["a", "b"]


def _fake_module(name: str, source: str) -> types.ModuleType:
    import linecache

    mod = types.ModuleType(name)
    filename = f"<{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), mod.__dict__)
    return mod


def test_code_source_is_deterministic_has_a_manifest_and_leaves_out_evaluation_text(tmp_path, monkeypatch, eval_grams):
    import heapq
    import statistics

    # a library function whose docstring is HumanEval's first problem under another name: left out
    leak = _fake_module(
        "leaky_lib",
        textwrap.dedent('''
        def close_pairs(numbers, threshold):
            """ Check if in given list of numbers, are any two numbers closer to each other than
            given threshold.
            >>> close_pairs([1.0, 2.0, 3.0], 0.5)
            False
            """
            return False
        '''),
    )
    mods = [heapq, statistics, textwrap, leak]
    built = []
    for k in range(2):
        monkeypatch.setattr(builtin, "source_dir", lambda name, k=k: tmp_path / str(k) / name)
        built.append(builtin.build_code(40, seed=3, modules=mods))
    assert built[0].read_bytes() == built[1].read_bytes()
    rows = rows_of(built[0])
    assert len(rows) >= 30 and len({r["id"] for r in rows}) == len(rows)
    m = check_manifest(built[0], "code", rows)
    assert m["left_out_for_eval_overlap"] == ["code-leaky_lib.close_pairs"] and m["seed"] == 3
    assert any(p.startswith("networkx==") for p in m["packages"])
    assert shared(rows, eval_grams) == []


def test_maths_source_is_deterministic_has_a_manifest_and_shares_no_text_with_champ(tmp_path, monkeypatch, eval_grams):
    built = []
    for k in range(2):
        monkeypatch.setattr(builtin, "source_dir", lambda name, k=k: tmp_path / str(k) / name)
        built.append(builtin.build_maths(300, seed=0))
    assert built[0].read_bytes() == built[1].read_bytes()  # the same questions, statement order included
    rows = rows_of(built[0])
    m = check_manifest(built[0], "maths", rows)
    assert "mathematics-dataset==1.0.1" in m["packages"] and m["generated"] == 300
    assert len(rows) == 300 - len(m["left_out_for_eval_overlap"]) >= 290
    assert len({r["module"] for r in rows}) > 40  # round-robin over the generator's modules
    assert all(r["conversations"][0]["from"] == "human" and r["conversations"][1]["from"] == "gpt" for r in rows)
    assert shared(rows, eval_grams) == []


def test_run_config_names_the_builtin_inputs(monkeypatch, tmp_path):
    from nestling.errors import NestlingError
    from nestling.pipeline.settings import resolve_builtin

    monkeypatch.setattr(builtin, "build_maths", lambda: tmp_path / "m.jsonl")
    monkeypatch.setattr(builtin, "build_code", lambda: tmp_path / "c.jsonl")
    assert resolve_builtin("builtin:maths") == str(tmp_path / "m.jsonl")
    assert resolve_builtin("builtin:code") == str(tmp_path / "c.jsonl")
    with pytest.raises(NestlingError, match="builtin:maths, builtin:code"):
        resolve_builtin("builtin:physics")


@pytest.mark.slow
def test_the_shipped_sources_at_full_size_share_no_text_with_the_evaluation_sets(eval_grams, sharegpt_path):
    """builtin:maths (10,000), builtin:code (5,000, the whole standard library and packages) as a run
    gets them, and the prompts of builtin:sharegpt: no 10-word run of an evaluation problem."""
    from nestling.data.readers import read_input

    for name, path in (("maths", builtin.build_maths()), ("code", builtin.build_code())):
        rows = rows_of(path)
        check_manifest(path, name, rows)
        assert len(rows) >= (9_900 if name == "maths" else 4_900)
        assert shared(rows, eval_grams) == []
    records, _ = read_input(sharegpt_path, None)
    prompts = [
        {"id": r.data.get("id"), "conversations": [m for m in r.data["conversations"] if m.get("from") == "human"]}
        for r in records
        if r.data
    ]
    assert len(prompts) > 17_000 and shared(prompts, eval_grams) == []
