"""Regeneration bookkeeping on a tiny random-weight target (hf engine): every record is accounted
for by reason, context overflow fails the conversation (never drops it), reruns resume or refuse."""

from __future__ import annotations

import json

import pytest

from nestling.errors import NestlingError
from nestling.regenerate.run import regenerate
from nestling.regenerate.settings import RegenerateSettings
from nestling.regenerate.chat import plan, postprocess
from nestling.regenerate.readers import read_records


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [
    {
        "id": "ok1",
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "old"},
            {"from": "human", "value": "More?"},
            {"from": "gpt", "value": "old2"},
        ],
    },
    {"id": "long", "messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "x"}]},
    {
        "id": "late_long",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "word " * 400},
            {"role": "assistant", "content": "y"},
        ],
    },
    {"id": "no_answer", "messages": [{"role": "user", "content": "Hi"}]},
    {"id": "bad_role", "messages": [{"role": "wizard", "content": "Hi"}]},
    "{not json",
    {"id": "empty", "messages": []},
    {
        "id": "ok2",
        "messages": [
            {"role": "assistant", "content": "lead"},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "old"},
            {"role": "user", "content": "trailing"},
        ],
    },
]


def test_reader_normalises_roles_and_tolerates_a_cut_off_json_array(tmp_path):
    p = tmp_path / "cut.json"
    p.write_text(json.dumps([ROWS[0], ROWS[7]])[:-1] + ', {"id": "cut", "conversations": [{"from": "hu')
    recs = list(read_records(p))
    assert [r.id for r in recs] == ["ok1", "ok2", "cut-2"]
    assert [m["role"] for m in recs[0].messages] == ["user", "assistant", "user", "assistant"]
    assert recs[2].skip == "truncated_file"
    with pytest.raises(NestlingError, match="does not exist"):
        list(read_records(tmp_path / "missing.jsonl"))


def test_reader_drops_unanswerable_turns_and_strip_removes_thinking(tmp_path):
    p = _write_jsonl(
        tmp_path / "t.jsonl",
        [
            {
                "messages": [
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "q2"},
                    {"role": "assistant", "content": "c"},
                    {"role": "user", "content": "q3"},
                ]
            }
        ],
    )
    (rec,) = read_records(p)
    assert [m["role"] for m in rec.messages] == ["user", "assistant", "user", "assistant"]
    assert rec.altered == ["leading_assistant_dropped", "trailing_turns_dropped"]
    msgs, altered = plan(rec.messages, max_turns=1)
    assert [m["content"] for m in msgs] == ["q", "b"] and altered == ["turns_beyond_max_turns_dropped"]
    assert postprocess("<think>\nplan\n</think>\n\nAnswer", "strip") == "Answer"
    assert postprocess("plan</think>Answer", "strip") == "Answer"  # template opened <think> itself
    assert postprocess("<think>x</think>A", "keep") == "<think>x</think>A"


def test_overflow_fails_with_reason_and_counts_add_up(tmp_path, tiny_target, capsys):
    target = tiny_target("llama")
    data = _write_jsonl(tmp_path / "in.jsonl", ROWS)
    s = RegenerateSettings(engine="hf", max_new_tokens=4, max_model_len=256, chunk_size=3, save_token_ids=True)
    m = regenerate(data, target, tmp_path / "out", s)
    c = m["counts"]
    assert c["read"] == len(ROWS) == c["kept"] + sum(c["failed"].values()) + sum(c["skipped"].values())
    assert c["kept"] == 2 and c["failed"] == {"context_overflow": 2}
    assert c["skipped"] == {"empty_conversation": 1, "malformed_json": 1, "no_assistant_turn": 1, "unknown_role": 1}
    assert c["altered"] == {"leading_assistant_dropped": 1, "trailing_turns_dropped": 1}
    kept = [json.loads(line) for line in (tmp_path / "out" / "messages.jsonl").read_text().splitlines()]
    dropped = {
        json.loads(line)["id"]: json.loads(line)
        for line in (tmp_path / "out" / "failed.jsonl").read_text().splitlines()
    }
    assert [k["id"] for k in kept] == ["ok1", "ok2"] and [k["source_index"] for k in kept] == [0, 7]
    assert dropped["late_long"]["status"] == "failed" and "assistant turn 1" in dropped["late_long"]["detail"]
    assert len(dropped) + len(kept) == len(ROWS)
    # every assistant turn was regenerated (random weights: no old text survives) with <= 4 new tokens
    for k in kept:
        answers = [x["content"] for x in k["messages"] if x["role"] == "assistant"]
        assert len(answers) == len(k["completion_token_ids"]) and all(a not in ("old", "old2") for a in answers)
        assert all(1 <= len(t) <= 4 for t in k["completion_token_ids"])
    assert m["generation"]["turns"] == 4  # 3 kept answers + late_long's first, generated before it overflowed
    # progress counts planned turns: the ones an overflow cancelled are counted when their chunk is written
    done = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("[regenerate] ") and " turn (" in line
    ]
    total = int(done[-1].split()[1].split("/")[1])
    assert total > m["generation"]["turns"] and f"{total}/{total} turn (100.0%)" in done[-1]


def test_rerun_is_a_no_op_and_other_settings_are_refused(tmp_path, tiny_target):
    target = tiny_target("llama")
    data = _write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    s = RegenerateSettings(engine="hf", max_new_tokens=3, chunk_size=1)
    first = regenerate(data, target, tmp_path / "out", s)
    before = (tmp_path / "out" / "messages.jsonl").read_bytes()
    assert regenerate(data, target, tmp_path / "out", s)["fingerprint"] == first["fingerprint"]
    assert (tmp_path / "out" / "messages.jsonl").read_bytes() == before
    with pytest.raises(NestlingError, match="other inputs or settings"):
        regenerate(data, target, tmp_path / "out", RegenerateSettings(engine="hf", max_new_tokens=5, chunk_size=1))


def test_unreachable_server_is_a_clear_error(tmp_path, tiny_target):
    data = _write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    s = RegenerateSettings(engine="openai", urls=["http://127.0.0.1:9"], retries=0)
    with pytest.raises(NestlingError, match="cannot reach the server"):
        regenerate(data, tiny_target("llama"), tmp_path / "out", s)


def test_hf_batches_respect_the_padded_token_budget():
    from nestling.regenerate.hf_engine import plan_batches

    lens, new = [900, 10, 20, 3000, 30, 15], [100] * 6
    batches = plan_batches(lens, new, max_size=4, max_tokens=4096)
    assert sorted(i for b in batches for i in b) == list(range(6))  # every request once
    for b in batches:
        assert len(b) <= 4
        assert len(b) == 1 or len(b) * (max(lens[i] for i in b) + 100) <= 4096
        assert [lens[i] for i in b] == sorted(lens[i] for i in b)
    assert batches[0] == [1, 5, 2, 4]  # short prompts share a batch (size cap 4)
    assert [3] in batches  # longer than the budget: runs alone, not refused
    assert plan_batches(lens, new, max_size=8, max_tokens=10**9) == [[1, 5, 2, 4, 0, 3]]


def test_tiny_token_budget_still_regenerates_everything(tmp_path, tiny_target):
    target = tiny_target("llama")
    data = _write_jsonl(tmp_path / "in.jsonl", ROWS)
    s = RegenerateSettings(
        engine="hf", max_new_tokens=4, max_model_len=256, chunk_size=3, hf_batch_size=8, hf_batch_tokens=1
    )  # every request in a batch of its own
    c = regenerate(data, target, tmp_path / "out", s)["counts"]
    assert c["kept"] == 2 and c["failed"] == {"context_overflow": 2}


def test_hf_batch_limits_default_per_device():
    """Left at 0, the hf engine's batches are small on a CPU and as large as memory allows on CUDA."""
    from types import SimpleNamespace

    from nestling.regenerate.hf_engine import batch_limits, kv_bytes_per_token

    smollm2 = SimpleNamespace(
        num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9, hidden_size=576, head_dim=64
    )
    kv = kv_bytes_per_token(smollm2, 2)
    assert kv == 2 * 30 * 3 * 64 * 2  # 23 KB per token in bf16
    assert batch_limits(RegenerateSettings(), False, kv, 0) == (8, 262144)
    size, tokens = batch_limits(RegenerateSettings(), True, kv, 140 * 10**9)  # an idle H200
    assert size == 1024 and 900_000 < tokens < 1_100_000  # a third of memory, the cache counted twice
    assert batch_limits(RegenerateSettings(hf_batch_size=16, hf_batch_tokens=999), True, kv, 140 * 10**9) == (16, 999)


def test_chunk_size_auto_is_large_on_a_gpu_and_recorded_resolved(tmp_path, tiny_target, capsys):
    """chunk_size 0 (the default): 2,048 conversations per engine call where the engine runs on a GPU
    (the GPU needs many requests in flight), 64 on a CPU or a remote server; the manifest and the
    fingerprint hold the resolved number, so a rerun with an explicit 64 here is the same run."""
    import torch

    from nestling.regenerate.engine import default_chunk_size, resolve_chunk_size

    assert RegenerateSettings().chunk_size == 0
    assert default_chunk_size("hf", True) == default_chunk_size("vllm", True) == 2048
    assert default_chunk_size("hf", False) == default_chunk_size("vllm", False) == 64
    assert default_chunk_size("openai", True) == 64  # the servers batch; a chunk is only what a crash loses
    # a server's chunk never depends on this machine's device setting (hf's `device` is not read for it)
    assert resolve_chunk_size("openai", RegenerateSettings(engine="openai", device="cuda:7")) == 64
    target, data = tiny_target("llama"), _write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    m = regenerate(data, target, tmp_path / "out", RegenerateSettings(engine="hf", max_new_tokens=3))
    here = 2048 if torch.cuda.is_available() else 64
    assert m["settings"]["chunk_size"] == here
    assert f"{here} conversations per chunk (chunk_size 0 = auto" in capsys.readouterr().err
    again = regenerate(
        data, target, tmp_path / "out", RegenerateSettings(engine="hf", max_new_tokens=3, chunk_size=here)
    )
    assert again["fingerprint"] == m["fingerprint"]
    with pytest.raises(NestlingError, match="chunk_size at least 0"):
        regenerate(data, target, tmp_path / "out2", RegenerateSettings(engine="hf", chunk_size=-1))
