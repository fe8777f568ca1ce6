"""The optional regenerate stage runs first and the data stage reads what it wrote."""

from __future__ import annotations

import json

import pytest

from nestling.pipeline.run import run


@pytest.mark.slow
def test_regenerate_feeds_data(tmp_path, tiny_target, sharegpt_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"target: {tiny_target('llama')}\ninputs: [{sharegpt_path}]\nrun_dir: {tmp_path / 'run'}\n"
        "regenerate: {engine: hf, limit: 3, max_new_tokens: 4, max_turns: 1, dtype: float32}\n"
        "data: {max_length: 256, workers: 1}\n"
    )
    outcomes = run(cfg, until="data")
    assert [(o.name, o.action) for o in outcomes] == [("regenerate", "ran"), ("data", "ran")]
    regen = json.loads((tmp_path / "run" / "regenerate" / "manifest.json").read_text())
    data = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert data["counts"]["read"] == regen["counts"]["kept"] > 0
    assert "messages.jsonl" in json.dumps(data["inputs"]) or "messages.jsonl" in json.dumps(data)
    # a regenerate setting changes its key and, through the chain, the data stage's
    outcomes = run(cfg, ["regenerate.max_new_tokens=5"], until="data")
    assert [(o.name, o.action) for o in outcomes] == [("regenerate", "ran"), ("data", "ran")]
    assert [(o.name, o.action) for o in run(cfg, ["regenerate.max_new_tokens=5"], until="data")] == [
        ("regenerate", "skipped"),
        ("data", "skipped"),
    ]


@pytest.mark.slow
def test_sampled_pass_feeds_data_in_the_same_split(tmp_path, tiny_target, sharegpt_path):
    """regenerate sampled: 1 -> the data stage reads the greedy and the sampled answers, and every answer
    to one conversation lands in one split (else a held-out prompt trains the draft through its twin)."""
    from nestling.data.dataset import load_samples

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"target: {tiny_target('llama')}\ninputs: [{sharegpt_path}]\nrun_dir: {tmp_path / 'run'}\n"
        "regenerate: {engine: hf, limit: 12, max_new_tokens: 4, max_turns: 1, dtype: float32, sampled: 1}\n"
        "data: {max_length: 256, workers: 1, held_out: 0.4}\n"
    )
    run(cfg, until="data")
    regen, data_dir = tmp_path / "run" / "regenerate", tmp_path / "run" / "data"
    files = [regen / "messages.jsonl", regen / "sampled" / "messages.jsonl"]
    rows = [[json.loads(x) for x in f.read_text().splitlines()] for f in files]
    assert len(rows[0]) == len(rows[1]) > 0
    data = json.loads((data_dir / "manifest.json").read_text())
    assert data["counts"]["read"] == len(rows[0]) + len(rows[1])
    split_of: dict[int, set[str]] = {}
    for split in ("train", "heldout"):
        for smp in load_samples(data_dir, split):
            name, index = smp.sample_id.rsplit(":", 1)
            src = rows[int(name.split("-", 1)[0])][int(index)]["source_index"]
            split_of.setdefault(src, set()).add(split)
    assert {len(v) for v in split_of.values()} == {1}  # never both
    assert {s for v in split_of.values() for s in v} == {"train", "heldout"}  # the fraction held some out
    # sampled back to 0: the stage reruns from a cleared folder, and data reads the greedy answers alone
    run(cfg, ["regenerate.sampled=0"], until="data")
    assert not (regen / "sampled").exists()
    assert json.loads((data_dir / "manifest.json").read_text())["counts"]["read"] == len(rows[0])
