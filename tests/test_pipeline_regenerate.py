"""The optional regenerate stage runs first and the data stage reads what it wrote."""

from __future__ import annotations

import json
from pathlib import Path

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


def two_input_run(tmp_path: Path, target, record, regenerate: str, data: str = "") -> Path:
    """A run config over two inputs, a.jsonl (3 records) and b.jsonl (2), each record `record(stem, i)`,
    regenerated in the hf engine with the `regenerate` settings; `data`: more data settings."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, n in ((a, 3), (b, 2)):
        path.write_text("".join(json.dumps(record(path.stem, i)) + "\n" for i in range(n)))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"target: {target}\ninputs: [{a}, {b}]\nrun_dir: {tmp_path / 'run'}\n"
        f"regenerate: {{engine: hf, {regenerate}}}\n"
        f"data: {{max_length: 256, workers: 1{', ' + data if data else ''}}}\n"
    )
    return cfg


@pytest.mark.slow
def test_every_input_is_regenerated_and_weighed_by_its_config_name(tmp_path, tiny_target, capsys):
    """inputs: [a, b] -> regenerate answers both (regenerate/0-a/, regenerate/1-b/, each with its sampled
    pass), the data stage reads all four files, `data.weights` named as the config names an input weighs
    what regenerate wrote for it, and the log gives each input's share; a changed setting clears both."""
    conv = [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue, like the sky."}]
    cfg = two_input_run(
        tmp_path,
        tiny_target("llama"),
        lambda stem, i: {"id": f"{stem}{i}", "conversations": conv},
        "max_new_tokens: 4, max_turns: 1, dtype: float32, sampled: 1",
        "weights: {b.jsonl: 2}",
    )
    assert [(o.name, o.action) for o in run(cfg, until="data")] == [("regenerate", "ran"), ("data", "ran")]
    regen = tmp_path / "run" / "regenerate"
    files = [regen / d / s / "messages.jsonl" for d in ("0-a", "1-b") for s in ("", "sampled")]
    rows = [[json.loads(x) for x in f.read_text().splitlines()] for f in files]
    assert [len(r) for r in rows] == [3, 3, 2, 2]
    for r in rows:  # the target's own answers, not the input's
        assert all(m["messages"][-1]["content"] != "Blue, like the sky." for m in r)
    data = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert [Path(d["path"]) for d in data["inputs"]["data"]] == [f.resolve() for f in files]
    assert data["counts"]["read"] == 3 + 3 + 2 * 2 + 2 * 2  # b's answers twice each
    err = capsys.readouterr().err
    assert "[data] input a (2 regenerated file(s)): 6 conversations" in err
    assert "[data] input b (2 regenerated file(s)): 8 conversations" in err
    # a changed setting reruns the stage from a cleared folder: every input's answers are written again
    outcomes = run(cfg, ["regenerate.max_new_tokens=5"], until="data")
    assert [(o.name, o.action) for o in outcomes] == [("regenerate", "ran"), ("data", "ran")]
    assert all(
        json.loads(f.parent.joinpath("manifest.json").read_text())["settings"]["max_new_tokens"] == 5 for f in files
    )


@pytest.mark.slow
def test_two_base_target_inputs_are_continued_and_logged_as_documents(tmp_path, tiny_target, capsys):
    """A target without a chat template: each input's texts are continued (text.jsonl) and the data log
    gives each input's share in documents."""
    from base_helpers import without_chat_template

    target = without_chat_template(tiny_target("llama"), tmp_path / "base")
    cfg = two_input_run(
        tmp_path,
        target,
        lambda stem, i: {"text": f"Text {i} of {stem}: the sky is blue."},
        "max_new_tokens: 4, dtype: float32, sampled: 0, prefix_tokens: 4",
    )
    assert [(o.name, o.action) for o in run(cfg, until="data")] == [("regenerate", "ran"), ("data", "ran")]
    regen = tmp_path / "run" / "regenerate"
    assert [len((regen / d / "text.jsonl").read_text().splitlines()) for d in ("0-a", "1-b")] == [3, 2]
    err = capsys.readouterr().err
    assert "[data] input a (1 regenerated file(s)): 3 documents" in err, err
    assert "[data] input b (1 regenerated file(s)): 2 documents" in err, err
