"""Regeneration through the real vLLM CPU engine on the real SmolLM2 (each run in a subprocess), and on a
tiny random-weight Llama where only the engine's scheduling is under test.

Equality choice: vLLM and transformers both run in float32 (bf16 kernels differ between the two
engines and can flip near-tied argmaxes), and vLLM's greedy answers must equal transformers'
greedy `generate` token by token on the same rendered histories.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import nestling
from nestling.regenerate.run import regenerate
from nestling.regenerate.settings import RegenerateSettings
from nestling.regenerate.chat import plan, render_prompt
from nestling.regenerate.readers import read_records

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SRC = str(Path(nestling.__file__).resolve().parents[1])
N_CONV, MAX_NEW, MAX_LEN, CHUNK, TURNS = 6, 16, 1024, 2, 2
ARGS = [
    "--engine",
    "vllm",
    "--dtype",
    "float32",
    "--max-new-tokens",
    str(MAX_NEW),
    "--max-model-len",
    str(MAX_LEN),
    "--max-turns",
    str(TURNS),
    f"chunk_size={CHUNK}",
    "save_token_ids=true",
    "vllm.enforce_eager=true",
]


def _env() -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def _cmd(data: Path, target: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "nestling",
        "regenerate",
        str(data),
        "--target",
        str(target),
        "--out",
        str(out),
        *ARGS,
    ]


@pytest.fixture(scope="module")
def conversations(sharegpt_path, tmp_path_factory) -> Path:
    """The first few short ShareGPT conversations (short prompts keep CPU generation quick)."""
    rows = []
    for rec in read_records(sharegpt_path):
        if rec.skip:
            continue
        msgs, _ = plan(rec.messages, TURNS)
        if msgs and sum(len(m["content"]) for m in msgs) < 1500:
            rows.append(
                {
                    "id": rec.id,
                    "conversations": [
                        {"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
                        for m in rec.messages
                    ],
                }
            )
        if len(rows) == N_CONV:
            break
    path = tmp_path_factory.mktemp("regen") / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def uninterrupted(conversations, smollm2_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("regen") / "full"
    res = subprocess.run(
        _cmd(conversations, smollm2_dir, out), env=_env(), capture_output=True, text=True, timeout=1200
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return out


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "messages.jsonl").read_text().splitlines()]


def test_vllm_greedy_equals_transformers_greedy(uninterrupted, smollm2_dir):
    import torch
    from transformers import AutoTokenizer

    from nestling.targets.load import load_model

    manifest = json.loads((uninterrupted / "manifest.json").read_text())
    assert manifest["counts"]["kept"] == N_CONV and manifest["settings"]["engine"] == "vllm"
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = load_model(smollm2_dir, dtype="float32")
    compared = 0
    for row in _rows(uninterrupted):
        msgs = row["messages"]
        positions = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        assert len(positions) == len(row["completion_token_ids"]) >= 1
        for pos, got in zip(positions, row["completion_token_ids"]):
            ids = render_prompt(tok, msgs[:pos])  # the regenerated history, as the engine saw it
            with torch.inference_mode():
                ref = model.generate(
                    torch.tensor([ids]),
                    do_sample=False,
                    max_new_tokens=MAX_NEW,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                )[0, len(ids) :].tolist()
            if 2 in ref:  # <|im_end|>: the end of the answer (vLLM returns it too)
                ref = ref[: ref.index(2) + 1]
            assert got == ref, f"{row['id']} turn at {pos}: vLLM {got} != transformers {ref}"
            assert msgs[pos]["content"] == tok.decode(ref, skip_special_tokens=True)
            compared += 1
    assert compared > N_CONV  # several conversations answered two turns


def test_kill_9_then_resume_equals_uninterrupted(uninterrupted, conversations, smollm2_dir, tmp_path):
    out = tmp_path / "killed"
    p = subprocess.Popen(
        _cmd(conversations, smollm2_dir, out),
        env=_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state = out / "state.json"
    deadline = time.monotonic() + 1200
    try:
        while time.monotonic() < deadline and p.poll() is None:
            if state.exists() and json.loads(state.read_text())["chunks_done"] >= 1:
                break
            time.sleep(0.01)  # a chunk of 2 short answers can take ~0.1 s on a fast idle CPU: poll finer
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the CLI and vLLM's engine + worker processes
        p.wait()
    done = json.loads(state.read_text())["chunks_done"]
    assert 1 <= done < N_CONV // CHUNK and not (out / "manifest.json").exists()
    with open(out / "messages.jsonl", "ab") as f:  # as if killed in the middle of appending a chunk
        f.write(b'{"id": "half-writ')
    res = subprocess.run(
        _cmd(conversations, smollm2_dir, out), env=_env(), capture_output=True, text=True, timeout=1200
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resuming: " in res.stderr
    for name in ("messages.jsonl", "failed.jsonl"):
        assert (out / name).read_bytes() == (uninterrupted / name).read_bytes()
    assert (
        json.loads((out / "manifest.json").read_text())["counts"]
        == json.loads((uninterrupted / "manifest.json").read_text())["counts"]
    )


def test_openai_server_equals_in_process(uninterrupted, conversations, smollm2_dir, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(smollm2_dir),
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_LEN),
            "--enforce-eager",
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1200
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "server did not start"
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5).read()
                break
            except OSError:
                time.sleep(1)
        s = RegenerateSettings(
            engine="openai",
            urls=[url],
            max_new_tokens=MAX_NEW,
            max_model_len=MAX_LEN,
            max_turns=TURNS,
            chunk_size=CHUNK,
            save_token_ids=True,
            concurrency=4,
        )
        m = regenerate(conversations, smollm2_dir, tmp_path / "served", s)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    assert m["counts"] == json.loads((uninterrupted / "manifest.json").read_text())["counts"]
    assert _rows(tmp_path / "served") == _rows(uninterrupted)


SEEDED_CHUNKED = """
import json, sys
from pathlib import Path
from nestling.regenerate.engine import Request
from nestling.regenerate.settings import RegenerateSettings
from nestling.regenerate.vllm_engine import VLLMEngine
from nestling.targets.tiny import build_tiny_target

if __name__ == "__main__":
    target = build_tiny_target("llama", Path(sys.argv[1]))
    # a step budget of 64 tokens: without whole prefill, the 150-token prompt is prefilled in chunks
    s = RegenerateSettings(engine="vllm", dtype="float32", temperature=0.7, vllm={"max_num_batched_tokens": 64, "enforce_eager": True})
    engine = VLLMEngine(target, s, 512)
    out = engine.generate([Request(list(range(5, 155)), 8, 7), Request(list(range(9, 49)), 8, 8)])
    print("RESULT " + json.dumps([[c.error, c.num_tokens] for c in out]), flush=True)
    engine.close()
"""


def test_seeded_sampling_on_the_cpu_build_survives_a_long_prompt(tmp_path):
    """Sampled answers are seeded per request; on vLLM's CPU build a seeded prompt prefilled in chunks
    killed the engine ("CPU Generator does not use offset") and every conversation failed. The engine
    now prefills every prompt whole when it samples (targets/vllm_rules.whole_prefill)."""
    script = tmp_path / "seeded.py"
    script.write_text(SEEDED_CHUNKED)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "tiny")], capture_output=True, text=True, env=_env(), timeout=600
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    results = json.loads(lines[0][len("RESULT ") :])
    assert [error for error, _ in results] == [None, None] and all(1 <= n <= 8 for _, n in results), results
    assert "'enable_chunked_prefill': False" in r.stderr + r.stdout


def test_whole_prefill_turns_chunking_off_on_a_cpu_only(monkeypatch):
    """Seeded sampling on vLLM's CPU build: chunked prefill off and a step that holds the longest
    prompt; a larger step already chosen is kept; on a GPU nothing changes."""
    import torch

    from nestling.targets.vllm_rules import whole_prefill

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert whole_prefill(512) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 512}
    assert whole_prefill(512, {"max_num_batched_tokens": 64}) == {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 512,
    }
    assert whole_prefill(512, {"max_num_batched_tokens": 4096})["max_num_batched_tokens"] == 4096
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert whole_prefill(512) == {}
