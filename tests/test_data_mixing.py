"""data.weights (how many times each input's conversations are used) and the data log's line per source
(conversations, tokens, share of the tokens), with the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nestling.data import mixing
from nestling.data.run import prepare_data
from nestling.data.settings import DataSettings
from nestling.errors import NestlingError


def _conv(k: int, words: int) -> dict:
    return {"conversations": [{"from": "human", "value": f"Question {k}?"}, {"from": "gpt", "value": "ok " * words}]}


def _inputs(tmp_path: Path) -> list[Path]:
    a, b = tmp_path / "chat.jsonl", tmp_path / "maths.jsonl"
    a.write_text("".join(json.dumps(_conv(k, 30)) + "\n" for k in range(10)))
    b.write_text("".join(json.dumps(_conv(k, 10)) + "\n" for k in range(20)))
    return [a, b]


def test_weigh_repeats_whole_copies_and_samples_the_fraction_with_the_seed():
    a, b = list(range(10)), list(range(100, 120))
    assert mixing.weigh([a, b], [2.0, 1.0], 0) == a + a + b
    half = mixing.weigh([a, b], [1.0, 0.5], 0)
    assert half[:10] == a and len(half) == 20 and half[10:] == sorted(half[10:]) and set(half[10:]) < set(b)
    assert mixing.weigh([a, b], [1.0, 0.5], 0) == half and mixing.weigh([a, b], [1.0, 0.5], 1) != half
    assert len(mixing.weigh([a], [1.5], 0)) == 15


def test_weights_name_inputs_by_builtin_name_path_or_file_name(tmp_path, monkeypatch):
    from nestling.data import builtin

    paths = _inputs(tmp_path)
    monkeypatch.setattr(builtin, "expected_path", lambda name: tmp_path / f"{name}.jsonl")
    assert mixing.input_weights(paths, {"builtin:maths": 0.5}) == [1.0, 0.5]
    assert mixing.input_weights(paths, {"chat.jsonl": 2}) == [2.0, 1.0]
    assert mixing.input_weights(paths, {str(paths[1]): 3}) == [1.0, 3.0]
    with pytest.raises(NestlingError, match="none of the inputs"):
        mixing.input_weights(paths, {"builtin:code": 2})
    for bad in (0, -1, "x", True):
        with pytest.raises(NestlingError, match="positive number"):
            DataSettings(weights={"a": bad})


def test_the_log_gives_each_source_its_conversations_tokens_and_share(tmp_path, smollm2_dir, capsys):
    paths = _inputs(tmp_path)
    plain = prepare_data(paths, smollm2_dir, tmp_path / "plain", DataSettings(workers=1))
    log = capsys.readouterr().err
    lines = re.findall(r"\[data\] source (\S+): (\d+) conversations, ([\d,]+) tokens, ([\d.]+)% of the tokens", log)
    assert [(n, int(c)) for n, c, _, _ in lines] == [("chat.jsonl", 10), ("maths.jsonl", 20)]
    tokens = {n: int(t.replace(",", "")) for n, _, t, _ in lines}
    assert sum(tokens.values()) == plain["splits"]["train"]["tokens"] + plain["splits"]["heldout"]["tokens"]
    assert plain["sources"] == {n: {"conversations": int(c), "tokens": tokens[n]} for n, c, _, _ in lines}
    share = {n: float(s) for n, _, _, s in lines}
    assert abs(sum(share.values()) - 100) < 0.2
    assert abs(share["chat.jsonl"] - 100 * tokens["chat.jsonl"] / sum(tokens.values())) < 0.06

    # weight 2 on chat, 0.5 on maths: twice the chat conversations, half the maths ones, and the shares move
    weighed = prepare_data(
        paths,
        smollm2_dir,
        tmp_path / "weighed",
        DataSettings(workers=1, held_out=0.2, weights={"chat.jsonl": 2, "maths.jsonl": 0.5}),
    )
    log = capsys.readouterr().err
    assert "weight 2 on chat.jsonl: 10 conversations used as 20" in log
    assert "weight 0.5 on maths.jsonl: 20 conversations used as 10" in log
    src = weighed["sources"]
    assert src["chat.jsonl"] == {"conversations": 20, "tokens": 2 * tokens["chat.jsonl"]}
    assert src["maths.jsonl"]["conversations"] == 10
    assert f"source chat.jsonl: 20 conversations, {2 * tokens['chat.jsonl']:,} tokens" in log
    # the copies of a conversation share its split: no held-out prompt trains the draft through its twin
    from nestling.data.dataset import load_samples

    train = {s.sample_id for s in load_samples(tmp_path / "weighed", "train")}
    held = {s.sample_id for s in load_samples(tmp_path / "weighed", "heldout")}
    assert held and not train & held


def test_a_run_config_sets_weights_by_builtin_name(tmp_path):
    from nestling.pipeline.settings import load_run_config
    from nestling.pipeline.stages import STAGES

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "target: builtin:smollm2\ninputs: [builtin:sharegpt, builtin:maths, builtin:code]\nrun_dir: out\n"
        "data:\n  weights: {builtin:maths: 0.5, builtin:code: 2}\n"
    )
    config = load_run_config(cfg, STAGES)
    assert config.inputs == ["builtin:sharegpt", "builtin:maths", "builtin:code"]
    assert config.settings["data"].weights == {"builtin:maths": 0.5, "builtin:code": 2}


def test_regenerated_answers_of_several_inputs_split_by_conversation():
    """Every answer to one conversation (greedy, samples, the sampled pass) shares a split group; the
    conversations at one index of two inputs do not (before, record k of every input shared one)."""
    from nestling.data.workers import split_group

    def row(index: int, rid: str, **extra) -> dict:
        return {"id": rid, "source_index": index, "messages": [], **extra}

    greedy = split_group("0-messages.jsonl:4", row(4, "sharegpt-abc"))
    assert split_group("1-messages.jsonl:9", row(4, "sharegpt-abc", sample=1)) == greedy
    assert split_group("2-messages.jsonl:4", row(4, "maths-4")) != greedy
    assert split_group("plain.jsonl:4", {"messages": []}) == "plain.jsonl:4"  # not regenerated: its own
