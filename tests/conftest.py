"""Shared fixtures: real assets from the package index (cached) and tiny random-weight targets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("NESTLING_CACHE", str(Path.home() / ".cache" / "nestling"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The same floats on every x86-64 machine: torch's own kernels, MKL and oneDNN pick their code path by
# the CPU (AVX2 or AVX-512), and the paths sum in different orders (~1e-5 apart, enough to flip an
# argmax in tests/test_golden.py). Pinned to AVX2, which every supported machine has, before torch loads.
for _var, _isa in (
    ("ATEN_CPU_CAPABILITY", "avx2"),
    ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
    ("ONEDNN_MAX_CPU_ISA", "AVX2"),
):
    os.environ.setdefault(_var, _isa)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as a bf16 safetensors folder."""
    from nestling.assets import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def sharegpt_path() -> Path:
    from nestling.assets import sharegpt_json

    return sharegpt_json()


@pytest.fixture(scope="session")
def tiny_target(smollm2_dir):
    """Factory: tiny_target('llama') -> folder of a random-weight target (built once per cache)."""
    from nestling.assets import cache_dir
    from nestling.targets.tiny import build_tiny_target

    def make(arch: str = "llama", seed: int = 0) -> Path:
        return build_tiny_target(arch, cache_dir() / "tiny" / f"{arch}-s{seed}", tokenizer_dir=smollm2_dir, seed=seed)

    return make


@pytest.fixture(scope="session")
def llama_kv2(smollm2_dir):
    """The tiny Llama with 2 KV heads: the stock one has 1, which TP=2 cannot split and where cache
    layouts that differ only in where the kv-head axis sits are the same bytes."""
    from nestling.assets import cache_dir
    from nestling.targets.tiny import build_tiny_target

    return build_tiny_target(
        "llama", cache_dir() / "tiny" / "llama-kv2-s0", tokenizer_dir=smollm2_dir, overrides={"num_key_value_heads": 2}
    )
