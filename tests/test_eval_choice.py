"""Eval's `auto` settings: the engine, device and dtype a machine gets, as a function of what it has
(vLLM installed, a GPU), and the log line that says which and why."""

from __future__ import annotations

import pytest

from nestling.errors import NestlingError
from nestling.evaluate.settings import EvalSettings, choose


def test_auto_picks_vllm_and_the_gpu_where_both_are_present():
    s, notes = choose(EvalSettings(), vllm=True, cuda=True)
    assert (s.engine, s.device, s.dtype) == ("vllm", "cuda", "bfloat16")
    assert any(n.startswith("engine auto: vLLM") for n in notes)


def test_auto_falls_back_to_the_reference_decoder_on_the_gpu_without_vllm():
    """The GPU host without vLLM: the reference decoder, on the GPU in bf16 (not the CPU at 1 token/s)."""
    s, notes = choose(EvalSettings(), vllm=False, cuda=True)
    assert (s.engine, s.device, s.dtype) == ("reference", "cuda", "bfloat16")
    engine_note = next(n for n in notes if n.startswith("engine auto"))
    assert "reference decoder" in engine_note and "vLLM is not installed" in engine_note
    assert "device auto: cuda (torch sees a GPU)" in notes


def test_auto_on_a_cpu_machine_is_float32():
    s, notes = choose(EvalSettings(), vllm=False, cuda=False)
    assert (s.engine, s.device, s.dtype) == ("reference", "cpu", "float32")
    assert "device auto: cpu (torch sees no GPU)" in notes
    s, _ = choose(EvalSettings(), vllm=True, cuda=False)  # vLLM's CPU build: float32 too
    assert (s.engine, s.dtype) == ("vllm", "float32")


def test_settings_given_are_kept_and_not_logged():
    given = EvalSettings(engine="both", device="cpu", dtype="float32")
    s, notes = choose(given, vllm=True, cuda=True)
    assert s == given and notes == []


def test_cuda_asked_for_without_a_gpu_is_an_error_that_says_what_to_do():
    with pytest.raises(NestlingError, match="torch sees no CUDA GPU; use device cpu"):
        choose(EvalSettings(device="cuda"), vllm=False, cuda=False)


def test_an_auto_engine_never_fails_the_preflight_check_for_lack_of_vllm(monkeypatch):
    from nestling import engines
    from nestling.pipeline.stages import check_engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: False)
    check_engines({"eval": EvalSettings()})  # auto: the reference decoder here, no error
    with pytest.raises(NestlingError, match="eval.engine=vllm needs vLLM"):
        check_engines({"eval": EvalSettings(engine="vllm")})
