"""The test side of tests/vllm_layer_probe.py: run the real vLLM engine on a target and drafts in a process
of its own, and compare what it fed the drafts with nestling's hf capture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def run_probe(target: Path, drafts: list[Path], prompts: list[list[int]], root: Path, k: int, new: int) -> dict:
    """The target alone, then with each draft, greedy, fp32, `new` tokens per prompt (no EOS) -> the
    probe's result; the prefill states it recorded are in root/states.safetensors."""
    import nestling

    spec = dict(
        target=str(target),
        drafts=[str(d) for d in drafts],
        k=k,
        prompts=prompts,
        max_new_tokens=new,
        temperature=0.0,
        dtype="float32",
        max_model_len=512,
        seed=0,
        baseline=True,
        ignore_eos=True,
    )
    (root / "spec.json").write_text(json.dumps(spec))
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(Path(nestling.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    script = Path(__file__).with_name("vllm_layer_probe.py")
    args = [sys.executable, str(script), *(str(root / f) for f in ("spec.json", "result.json", "states.safetensors"))]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((root / "result.json").read_text())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def capture_at(target: Path, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """nestling's hf capture of one prompt at layer ids -> [T, len(ids), H] (fp32)."""
    from nestling.capture.hf import HFBackend
    from nestling.capture.settings import CaptureSettings

    b = HFBackend(target, ids, CaptureSettings(dtype="float32", device="cpu"))
    try:
        return b.capture([prompt]).float()
    finally:
        b.close()


def layer_id_errors(target: Path, prompt: list[int], fed: torch.Tensor, ids: list[int]) -> list[float]:
    """Relative error of each slot of `fed` ([T, len(ids), H], what vLLM fed the draft) against the
    capture at `ids`, slot by slot."""
    return [rel(fed[:, j], c) for j, c in enumerate(capture_at(target, prompt, ids).unbind(1))]
