"""A draft for an MLA + MoE target, end to end through vLLM (CPU build): data, vllm capture, train,
export, eval. The tiny DeepSeek-V3 (tests/test_capture_vllm_mla.py) stands in for DeepSeek-V3 / Kimi-K2.

vLLM's CPU build serves an EAGLE-3 draft beside an MLA target only in bf16 on CPUs with AMX tiles
(targets/vllm_rules.py, `eagle3_serving_limit`); elsewhere eval measures with the reference decoder and
says why. Both paths are run here where the CPU allows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from capture_data import random_conversations

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SRC = Path(__file__).resolve().parents[1] / "src"


def _env(pins: bool = True) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    if not pins:  # vLLM's bf16 AMX kernels need oneDNN's AMX path, which the suite's AVX2 pins switch off
        for var in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
            env.pop(var, None)
    return env


def _nestling(*args: str, pins: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "nestling", *args], env=_env(pins), capture_output=True, text=True, timeout=1500
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_mla_draft_trains_exports_and_is_measured(tiny_target, tmp_path):
    target = tiny_target("deepseek_v3")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": c}) + "\n" for c in random_conversations(60, 1, 5, 40)))
    config = {
        "target": str(target),
        "inputs": [str(chat)],
        "run_dir": str(tmp_path / "run"),
        "data": {"max_length": 256, "held_out": 0.1},
        "capture": {"backend": "vllm", "device": "cpu", "dtype": "float32", "token_budget": 1024},
        "train": {"device": "cpu", "steps": 40, "batch_tokens": 512, "ttt_steps": 3, "draft_vocab_size": 2048},
        "export": {},
        "eval": {"k": 3, "engine": "both", "max_prompts": 3, "max_new_tokens": 16, "device": "cpu"},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    r = _nestling("run", str(tmp_path / "run.yaml"))
    run = tmp_path / "run"
    cap = json.loads((run / "capture" / "manifest.json").read_text())
    assert cap["settings"]["backend"] == "vllm" and cap["final_state"] == "post_norm"
    # float32 on the CPU build: vLLM cannot serve the draft beside MLA, so eval says so and falls back
    assert "the reference decoder measures this draft instead of vLLM" in r.stdout + r.stderr
    assert "No common block size" in r.stdout + r.stderr
    report = json.loads((run / "eval" / "report.json").read_text())
    assert set(report["engines"]) == {"reference"} and report["engines"]["reference"]["num_drafts"] > 0

    from nestling.targets.vllm_rules import has_amx

    if not has_amx():
        return  # vLLM serves it in bf16 on AMX CPUs only
    _nestling(
        "eval",
        str(run / "export"),
        "--target",
        str(target),
        "--prompts",
        str(run / "data"),
        "--engine",
        "both",
        "--out",
        str(tmp_path / "eval_bf16"),
        "dtype=bfloat16",
        "max_prompts=3",
        "max_new_tokens=16",
        "device=cpu",
        pins=False,
    )
    engines = json.loads((tmp_path / "eval_bf16" / "report.json").read_text())["engines"]
    vllm, ref = engines["vllm"], engines["reference"]
    # the draft loads beside the MLA target, is fed its aux states and drafts; bf16 rounding differs
    # between the engines (and with the batch shape inside vLLM), so counts agree to a margin, not exactly
    assert vllm["num_drafts"] > 0 and "identical_share" in vllm
    assert abs(vllm["acceptance_length"] - ref["acceptance_length"]) <= 0.15, (vllm, ref)
