"""The data stage end to end: malformed input, counts, splits, idempotence, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nestling.data.run import prepare_data
from nestling.data.readers import error_reason, read_input
from nestling.data.settings import DataSettings
from nestling.errors import NestlingError


def conv(*pairs: tuple[str, str]) -> dict:
    return {"conversations": [{"from": f, "value": v} for f, v in pairs]}


GOOD = conv(("human", "Hi there"), ("gpt", "Hello! How can I help?"), ("human", "2+2?"), ("gpt", "4."))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run(tmp_path, rows, smollm2_dir, **kw) -> dict:
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    return prepare_data([src], smollm2_dir, tmp_path / "out", DataSettings(workers=1, **kw))


def test_malformed_records_are_counted_with_examples(tmp_path, smollm2_dir):
    rows = [
        GOOD,
        "{not json",
        conv(),
        conv(("human", "hi"), ("narrator", "once upon")),
        conv(("gpt", "leading"), ("human", "q"), ("gpt", "a")),
        conv(("human", "only a question")),
        {"text": "no conversation"},
        conv(("human", "q"), ("gpt", ""), ("human", "q2"), ("gpt", "a2")),
        conv(("human", "a"), ("human", "b"), ("gpt", "c"), ("gpt", "d")),
    ]
    m = run(tmp_path, rows, smollm2_dir)
    c = m["counts"]
    assert c["read"] == 9 and c["kept"] == 3
    assert c["dropped"] == {
        "malformed_json": 1,
        "empty_conversation": 1,
        "unknown_role": 1,
        "no_assistant_turn": 2,
        "malformed_record": 1,
    }
    assert c["read"] == c["kept"] + sum(c["dropped"].values())
    assert c["altered"]["leading_assistant_dropped"] == 1
    assert c["altered"]["merged_consecutive_turns"] == 1
    assert c["altered"]["truncated_at_empty_message"] == 1
    assert "in.jsonl:2: malformed JSON" in m["examples"]["malformed_json"][0]
    assert "'narrator'" in m["examples"]["unknown_role"][0]
    # a role can be mapped instead of dropped
    m = prepare_data(
        [tmp_path / "in.jsonl"],
        smollm2_dir,
        tmp_path / "out2",
        DataSettings(workers=1, role_map={"narrator": "assistant"}),
    )
    assert "unknown_role" not in m["counts"]["dropped"]


def test_length_limit_truncates_or_drops(tmp_path, smollm2_dir):
    long = conv(("human", "Tell me a story."), ("gpt", "word " * 300))
    m = run(tmp_path, [GOOD, long], smollm2_dir, max_length=64, overflow="drop")
    assert m["counts"]["dropped"] == {"too_long": 1} and m["counts"]["kept"] == 1
    m = run(tmp_path, [GOOD, long], smollm2_dir, max_length=64)
    assert m["counts"]["kept"] == 2 and m["counts"]["altered"]["truncated_to_max_length"] == 1
    from nestling.data.dataset import load_samples

    assert max(len(s.input_ids) for s in load_samples(tmp_path / "out", "train")) == 64
    short = conv(("human", "word " * 100), ("gpt", "ok"))
    m = run(tmp_path, [GOOD, short], smollm2_dir, max_length=64)
    assert m["counts"]["dropped"] == {"no_supervised_tokens_after_truncation": 1}


def test_truncated_json_list_recovers_complete_records(tmp_path, smollm2_dir):
    text = json.dumps([GOOD, GOOD, GOOD], indent=1)
    src = tmp_path / "cut.json"
    src.write_text(text[: len(text) - 40])  # cut inside the third record
    records, report = read_input(src)
    assert [r.data is not None for r in records] == [True, True, False]  # 2 complete + the cut-off one
    assert error_reason(records[2]) == "truncated_file"
    assert "record 2" in report.stopped and "cut off" in report.stopped
    m = prepare_data([src], smollm2_dir, tmp_path / "out", DataSettings(workers=1))
    assert m["counts"]["kept"] == 2 and m["counts"]["dropped"] == {"truncated_file": 1}
    assert m["inputs"]["data"][0]["stopped"] == report.stopped


def test_sharegpt_file_from_package_index_is_cut_off(sharegpt_path):
    records, report = read_input(sharegpt_path)
    assert sum(r.data is not None for r in records) == 17671 and records[-1].data is None
    assert report.stopped and "Unterminated string" in report.stopped


def test_missing_input_and_wrong_parquet_columns(tmp_path, smollm2_dir):
    with pytest.raises(NestlingError, match="does not exist"):
        prepare_data([tmp_path / "nope.jsonl"], smollm2_dir, tmp_path / "out")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a"], "response": ["b"]}), tmp_path / "bad.parquet")
    with pytest.raises(NestlingError, match=r"columns \['prompt', 'response'\].*'conversations'.*'messages'"):
        prepare_data([tmp_path / "bad.parquet"], smollm2_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_messages_jsonl_and_parquet_inputs(tmp_path, smollm2_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
        ]
    }
    write_jsonl(tmp_path / "m.jsonl", [msgs])
    pq.write_table(pa.Table.from_pylist([GOOD]), tmp_path / "c.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"messages": msgs["messages"][1:2] + [{"role": "assistant", "content": "Yo."}]}]),
        tmp_path / "m.parquet",
    )
    m = prepare_data(
        [tmp_path / "m.jsonl", tmp_path / "c.parquet", tmp_path / "m.parquet"],
        smollm2_dir,
        tmp_path / "out",
        DataSettings(workers=1, system_prompt="Override."),
    )
    assert m["counts"]["kept"] == 3
    from transformers import AutoTokenizer

    from nestling.data.dataset import load_samples

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    samples = load_samples(tmp_path / "out", "train")
    assert [s.sample_id for s in samples] == ["m.jsonl:0", "c.parquet:0", "m.parquet:0"]
    text = tok.decode(samples[0].input_ids)
    assert "Override." in text and "Be brief." not in text
    sup = tok.decode([i for i, k in zip(samples[0].input_ids, samples[0].loss_mask) if k])
    assert sup == "Hello.<|im_end|>"


def test_output_loads_with_datasets_and_split_is_deterministic(tmp_path, smollm2_dir):
    import datasets

    rows = [conv(("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(60)]
    m = run(tmp_path, rows, smollm2_dir, held_out=0.25, seed=3, shard_samples=16)
    assert m["target"] == str(Path(smollm2_dir).resolve()) and m["stage"] == "data"
    out = tmp_path / "out"
    assert len(m["splits"]["train"]["files"]) >= 2
    ds = datasets.load_dataset(
        "parquet", data_files={s: [str(out / f) for f in m["splits"][s]["files"]] for s in ("train", "heldout")}
    )
    assert set(ds["train"].column_names) == {"input_ids", "loss_mask", "sample_id", "source_index"}
    assert len(ds["train"]) + len(ds["heldout"]) == 60 and 5 <= len(ds["heldout"]) <= 25
    assert sum(map(sum, ds["train"]["loss_mask"])) == m["splits"]["train"]["supervised_tokens"]
    heldout = sorted(ds["heldout"]["sample_id"])
    m2 = prepare_data(
        [tmp_path / "in.jsonl"], smollm2_dir, tmp_path / "again", DataSettings(held_out=0.25, seed=3, workers=2)
    )  # other workers, same split
    ds2 = datasets.load_dataset(
        "parquet", data_files=[str(tmp_path / "again" / f) for f in m2["splits"]["heldout"]["files"]]
    )
    assert sorted(ds2["train"]["sample_id"]) == heldout
    assert m2["fingerprint"] == m["fingerprint"]
    m3 = prepare_data(
        [tmp_path / "in.jsonl"], smollm2_dir, tmp_path / "seed4", DataSettings(held_out=0.25, seed=4, workers=1)
    )
    assert m3["fingerprint"] != m["fingerprint"]


def test_rerun_is_a_noop_and_incomplete_folder_is_redone(tmp_path, smollm2_dir, capsys):
    m = run(tmp_path, [GOOD] * 3, smollm2_dir)
    shard = tmp_path / "out" / m["splits"]["train"]["files"][0]
    mtime = shard.stat().st_mtime_ns
    m2 = run(tmp_path, [GOOD] * 3, smollm2_dir)
    assert "nothing to do" in capsys.readouterr().err
    assert shard.stat().st_mtime_ns == mtime and m2 == m
    (tmp_path / "out" / "manifest.json").unlink()
    (tmp_path / "out" / "train-00007.parquet").write_bytes(b"stale")
    run(tmp_path, [GOOD] * 3, smollm2_dir)
    assert "incomplete" in capsys.readouterr().err
    # the stale shard went: this is a data folder (its marker says so), whose shards are all nestling's
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".nestling-stage.json",
        "manifest.json",
        "train-00000.parquet",
    ]


def test_cli_help_prepare_inspect_and_errors(tmp_path, smollm2_dir, sharegpt_path, capsys):
    from nestling.cli import main

    with pytest.raises(SystemExit) as e:
        main(["data", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for opt in ("--target", "--out", "--max-length", "--held-out", "--chat-template", "--last-turn-only", "inspect"):
        assert opt in help_text
    out = tmp_path / "sg"
    assert (
        main(
            [
                "data",
                str(sharegpt_path),
                "--target",
                str(smollm2_dir),
                "--out",
                str(out),
                "--limit",
                "40",
                "--held-out",
                "0.1",
                "workers=1",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["counts"]["read"] == 40
    assert main(["data", "inspect", str(out), "--index", "1", "--no-color"]) == 0
    shown = capsys.readouterr().out
    assert "[[" in shown and "<|im_end|>]]" in shown and "\x1b[" not in shown
    assert main(["data", "inspect", str(out), "--index", "1", "--color"]) == 0
    assert "\x1b[30;42m" in capsys.readouterr().out
    assert main(["data", "inspect", str(out), "--index", "999"]) == 1
    assert "--index must be in" in capsys.readouterr().err
    assert (
        main(["data", str(tmp_path / "missing.jsonl"), "--target", str(smollm2_dir), "--out", str(tmp_path / "x")]) == 1
    )
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    assert (
        main(["data", str(sharegpt_path), "--target", str(smollm2_dir), "--out", str(tmp_path / "x"), "max_lenght=3"])
        == 1
    )
    assert "unknown setting 'max_lenght'" in capsys.readouterr().err
