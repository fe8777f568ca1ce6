"""`nestling run --dry-run` and `nestling doctor` with the real stages on a tiny target.

Bad configs must fail with one clear line, before anything expensive runs; a good one must run
every stage for real and print the full run's needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nestling.cli import main


def write_config(tmp: Path, target: Path, inputs: Path, extra: str = "") -> Path:
    cfg = tmp / "run.yaml"
    cfg.write_text(
        f"target: {target}\ninputs: [{inputs}]\nrun_dir: {tmp / 'run'}\n"
        "data: {max_length: 256, held_out: 0.1}\ncapture: {dtype: float32}\ntrain: {batch_tokens: 512, online: false}\n"
        "eval: {engine: reference}\n" + extra
    )
    return cfg


def nestling(capsys, *args: str) -> tuple[int, str]:
    rc = main(list(map(str, args)))
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.fixture
def cfg(tmp_path, tiny_target, sharegpt_path):
    return write_config(tmp_path, tiny_target("llama"), sharegpt_path)


def test_unknown_key_fails_with_the_valid_ones(cfg, capsys):
    rc, out = nestling(capsys, "run", cfg, "--dry-run", "capture.layerz=[2,3,6]")
    assert rc == 1
    assert "unknown setting 'capture.layerz'; valid settings of capture:" in out and "layers" in out
    assert "Traceback" not in out
    rc, out = nestling(capsys, "run", cfg, "--dry-run", "evals.k=3")
    assert rc == 1 and "unknown setting 'evals'" in out and "eval" in out


def test_missing_target_fails(cfg, tmp_path, capsys):
    rc, out = nestling(capsys, "run", cfg, "--dry-run", f"target={tmp_path / 'no-such-model'}")
    assert rc == 1 and "no-such-model does not exist" in out
    assert not (tmp_path / "run" / "dry-run").exists()


def test_impossible_layer_id_fails_before_any_stage(cfg, tmp_path, capsys):
    rc, out = nestling(capsys, "run", cfg, "--dry-run", "capture.layers=[2,3,99]")
    assert rc == 1
    assert "layer ids [99] do not fit this target: it has 6 decoder layers" in out
    assert not (tmp_path / "run" / "dry-run" / "data").exists()


def test_eval_without_prompts_fails(cfg, tmp_path, capsys):
    rc, out = nestling(capsys, "run", cfg, "--dry-run", "data.held_out=0")
    assert rc == 1 and "eval has no prompts" in out and "data.held_out" in out


def test_too_little_disk_fails_before_training(cfg, tmp_path, capsys, monkeypatch):
    from nestling.pipeline import dryrun

    monkeypatch.setattr(dryrun, "free_bytes", lambda path: 50 * 2**20)
    rc, out = nestling(capsys, "run", cfg, "--dry-run")
    assert rc == 1
    assert "not enough disk for the full run" in out and "only 50.0 MiB is free" in out and "capture" in out
    scratch = tmp_path / "run" / "dry-run"
    assert (scratch / "capture" / "manifest.json").exists()  # capture really ran on the two samples
    assert not (scratch / "train").exists()  # and training did not start


@pytest.mark.slow
def test_doctor_runs_every_stage_for_real(tmp_path, capsys, monkeypatch):
    # vLLM loading the exported draft is the same eval code path the demo test runs with vLLM;
    # here the reference decoder alone keeps the suite short.
    from nestling import engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: False)
    rc, out = nestling(capsys, "doctor", "--scratch", tmp_path)
    assert rc == 0, out
    assert "torch" in out and "transformers" in out and "vllm" in out and "all checks passed" in out
    report = json.loads((tmp_path / "run" / "dry-run" / "estimate.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["data", "capture", "train", "export", "eval"]
    capture = next(s for s in report["stages"] if s["stage"] == "capture")
    manifest = json.loads((tmp_path / "run" / "dry-run" / "capture" / "manifest.json").read_text())
    # tiny Llama: captured ids x hidden 128 x 4 bytes (fp32) + input id + mask, per token of the full run
    assert capture["disk_bytes"] == capture["tokens"] * (len(manifest["layer_ids"]) * 128 * 4 + 5) > 0
    assert all(s["seconds"] > 0 for s in report["stages"])
    for stage in report["stages"]:
        state = json.loads((tmp_path / "run" / "dry-run" / "state" / f"{stage['stage']}.json").read_text())
        assert state["status"] == "complete"
    draft = json.loads((tmp_path / "run" / "dry-run" / "export" / "config.json").read_text())
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "full run" in out and "total" in out


def test_doctor_keeps_a_users_scratch_folder(tmp_path, capsys):
    """`nestling doctor --scratch .` in a folder of the user's: its conversations.json is not replaced."""
    mine = tmp_path / "conversations.json"
    mine.write_text('[{"my": "data"}]')
    rc, out = nestling(capsys, "doctor", "--scratch", tmp_path)
    assert rc == 1 and "[FAIL] dry run" in out and "is not empty and was not written by nestling" in out
    assert mine.read_text() == '[{"my": "data"}]' and sorted(p.name for p in tmp_path.iterdir()) == [mine.name]


def regenerating_dry_run(tmp_path: Path, capsys, target, inputs, regenerate: str) -> tuple[dict, str]:
    """`nestling run --dry-run` of a small regenerating config on the CPU: the estimate's rows by stage
    and the output. `regenerate`: that section's settings besides `engine: hf`."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"target: {target}\ninputs: [{inputs}]\nrun_dir: {tmp_path / 'run'}\n"
        f"regenerate: {{engine: hf, {regenerate}}}\n"
        "data: {max_length: 256, held_out: 0.2}\ncapture: {dtype: float32}\ntrain: {batch_tokens: 512, online: false}\n"
        "eval: {engine: reference}\n"
    )
    rc, out = nestling(capsys, "run", cfg, "--dry-run")
    assert rc == 0, out
    report = json.loads((tmp_path / "run" / "dry-run" / "estimate.json").read_text())
    return {r["stage"]: r for r in report["stages"]}, out


@pytest.mark.slow
def test_dry_run_of_a_base_target_counts_documents_and_continuations(tmp_path, tiny_target, capsys):
    """A base target (no chat template) regenerates one continuation per document and packs documents
    into rows: the estimate says so, with no turns in its bound."""
    from base_helpers import without_chat_template

    from nestling.assets import cache_dir

    base = without_chat_template(tiny_target("llama"), cache_dir() / "tiny" / "llama-s0-base-bos", with_bos=True)
    texts = tmp_path / "texts.jsonl"
    texts.write_text(
        "".join(json.dumps({"text": f"Document {i}: " + "words and more words " * 20}) + "\n" for i in range(12))
    )
    rows, _ = regenerating_dry_run(
        tmp_path, capsys, base, texts, "max_new_tokens: 32, max_turns: 16, dtype: float32, sampled: 1, prefix_tokens: 8"
    )
    assert rows["regenerate"]["tokens"] == 12 * 2 * 32  # documents x (greedy + sampled) x max_new_tokens
    assert "at most 12 documents x 2 continuation(s) x 32 tokens" in rows["regenerate"]["note"]
    note = rows["data"]["note"]
    assert "rows of packed documents" in note and "continuations" in note and "turn" not in note


@pytest.mark.slow
def test_dry_run_estimates_a_regenerating_run_on_builtin_inputs(tmp_path, tiny_target, sharegpt_path, capsys):
    """A config as examples/gpu.yaml writes it (`builtin:sharegpt`, regenerate with a sampled pass):
    the estimate counts the built-in file's conversations, every answer the data stage will read
    (greedy + sampled), the regeneration's tokens at most, and says the dry answers undercount."""
    rows, out = regenerating_dry_run(
        tmp_path,
        capsys,
        tiny_target("llama"),
        "builtin:sharegpt",
        "limit: 10, max_new_tokens: 64, max_turns: 2, dtype: float32, sampled: 1",
    )
    assert rows["regenerate"]["tokens"] == 10 * 2 * 2 * 64  # conversations x answers x turns x max_new_tokens
    assert "at most 10 conversations x 2 answer(s) x 2 turns x 64 tokens" in rows["regenerate"]["note"]
    assert "not scaled" in rows["regenerate"]["note"]
    # the data stage reads a greedy and a sampled answer per conversation of regenerate's 10
    assert "estimated: 20 conversations" in rows["data"]["note"] and "a lower bound" in rows["data"]["note"]
    assert rows["data"]["tokens"] > 0 and "full run" in out
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert "time without regenerate" in total  # its unscaled seconds are not summed
    # eval's expected time, with the engine, device and dtype the full run will use on this machine
    assert rows["eval"]["seconds"] > 0 and rows["eval"]["tokens"] % 128 == 0  # held-out prompts x max_new_tokens
    assert "reference on cpu, float32" in rows["eval"]["note"]


def test_a_vllm_engine_without_vllm_fails_before_any_stage(cfg, tmp_path, capsys, monkeypatch):
    """examples/gpu.yaml evaluates in vLLM, its last stage: on a machine without vLLM the run must say
    so before regenerating and training for half an hour, and so must its dry run (whose own eval
    falls back to the reference decoder)."""
    from nestling import engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: False)  # a machine where vllm is not importable
    for args in (["--dry-run"], []):
        rc, out = nestling(capsys, "run", cfg, *args, "eval.engine=vllm")
        assert rc == 1 and "eval.engine=vllm needs vLLM, which is not installed here" in out, out
        assert "eval.engine=reference" in out and "regenerate.engine" not in out and "Traceback" not in out
        assert not (tmp_path / "run" / "data").exists() and not (tmp_path / "run" / "dry-run" / "data").exists()
    rc, out = nestling(capsys, "run", cfg, "--until", "data", "eval.engine=vllm")
    assert rc == 0 and (tmp_path / "run" / "data" / "manifest.json").exists()  # eval does not run: no vLLM needed


def test_data_estimate_counts_every_answer_file_up_to_the_data_limit(tmp_path, tiny_target):
    """With regenerate the data stage reads its greedy file (n rows per conversation) and its sampled
    file, each cut at data.limit, so the estimate counts min(n x C, limit) + min(sampled x C, limit)."""
    from nestling.pipeline.dryrun import input_conversations
    from nestling.pipeline.settings import load_run_config
    from nestling.pipeline.stages import STAGES

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(7)))
    cfg = write_config(tmp_path, tiny_target("llama"), chats)

    def count(*overrides: str) -> int | None:
        return input_conversations(load_run_config(cfg, STAGES, list(overrides)), None)

    assert count() == 7
    assert count("regenerate.sampled=1") == 14
    assert count("regenerate.sampled=1", "regenerate.limit=5") == 10
    assert count("regenerate.sampled=1", "regenerate.n=3", "regenerate.temperature=0.7") == 28
    c = load_run_config(cfg, STAGES, ["regenerate.sampled=1", "data.limit=5"])
    assert input_conversations(c, 5) == 5 + 5  # the greedy file's 7 and the sampled file's 7, each cut at 5
    # several inputs: each is regenerated on its own (regenerate.limit per input), each file cut at data.limit
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"o{i}"}]}) + "\n" for i in range(3)))
    assert count(f"inputs={chats},{other}", "regenerate.sampled=1", "regenerate.limit=5") == 5 + 5 + 3 + 3
    c = load_run_config(cfg, STAGES, [f"inputs={chats},{other}", "regenerate.sampled=1", "data.limit=4"])
    assert input_conversations(c, 4) == 4 + 4 + 3 + 3
    c = load_run_config(cfg, STAGES, ["regenerate.sampled=1", "regenerate.n=2", "regenerate.temperature=0.7"])
    assert input_conversations(c, 9) == 9 + 7  # 14 greedy rows cut at 9
