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
