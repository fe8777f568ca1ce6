"""vLLM's rejection sampling at temperature > 0: the probe pins the CPU build's behaviour (its
`expand_kernel` replacement returns uninitialized memory as the per-token temperature, docs/eval.md),
and eval refuses a vLLM figure at temperature > 0 where the probe finds it, before anything is loaded.
The probe imports vLLM in a subprocess and runs vLLM's own function; no engine starts."""

from __future__ import annotations

import pytest

from nestling.errors import NestlingError
from nestling.evaluate.run import evaluate
from nestling.evaluate.settings import EvalSettings
from nestling.evaluate.vllm_engine import run_vllm
from nestling.evaluate.vllm_sampling import check_vllm_sampling, run_probe

pytestmark = pytest.mark.vllm


def test_cpu_sampler_unsound_and_eval_refuses(tmp_path):
    p = run_probe()
    if p["platform"] != "cpu":
        pytest.skip("the defect is in vLLM's CPU build")
    assert not p["sound"] and p["expanded"] != p["expected"], (
        f"vLLM's CPU build now expands temperatures correctly ({p}): the eval accepts vLLM at temperature > 0 "
        "again by itself; update docs/eval.md ('Sampling in vLLM's CPU build') and this test"
    )
    args = (tmp_path / "no-draft", tmp_path / "no-target", tmp_path / "p.jsonl", tmp_path / "out")
    for engine in ("vllm", "both"):
        with pytest.raises(NestlingError, match="unsound at temperature > 0") as e:
            evaluate(*args, EvalSettings(engine=engine, temperature=0.7))
        assert "--engine reference" in str(e.value) and "vllm-project/vllm#55005" in str(e.value)
    assert not (tmp_path / "out").exists()  # refused before any folder is written
    with pytest.raises(NestlingError, match="unsound"):  # the engine's entry point too (benchmarks use it)
        run_vllm(tmp_path, tmp_path, [[1, 2]], 3, 4, temperature=0.7)
    check_vllm_sampling(0.0)  # greedy never reads the expanded temperature: not refused
    for engine, t in (("reference", 0.7), ("vllm", 0.0)):  # not refused: they go on to the next check
        with pytest.raises(NestlingError) as e:
            evaluate(*args, EvalSettings(engine=engine, temperature=t))
        assert "does not exist" in str(e.value) and "rejection sampler" not in str(e.value)
