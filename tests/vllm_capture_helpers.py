"""Helpers of the vllm capture backend's tests (tests/test_capture_vllm*.py): the CLI in a subprocess
(vLLM spawns workers, so `LLM` is never created inside pytest's process), the hf backend's store to
compare with, and the tiny MLA + MoE targets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from capture_data import make_data_dir
from nestling.capture.run import capture
from nestling.capture.settings import CaptureSettings
from nestling.capture.store import CaptureDataset

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = "0,2,5,6"  # the tiny llama has 6 layers: embeddings, two aux, and the final state


def _hf_capture(data: Path, target: Path, out: Path, layers: str = LAYERS, **kw) -> dict:
    """The hf backend's fp32 store of the same layers and budget: what the vllm backend is held to.
    `kw`: further capture settings (token_budget 256 unless given)."""
    ids = [int(x) for x in layers.split(",")]
    settings = CaptureSettings(
        **{"backend": "hf", "device": "cpu", "dtype": "float32", "layers": ids, "token_budget": 256, **kw},
        progress_interval=60,
    )
    return capture(data, target, out, settings)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    # VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND are left to the backend (vllm_kv_cache_gib, and
    # the thread binding of tensor-parallel CPU workers), so its own settings are exercised
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return env


def _cli(data: Path, target: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "nestling",
        "capture",
        str(data),
        *extra,
        "--target",
        str(target),
        "--out",
        str(out),
        "--backend",
        "vllm",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--layers",
        LAYERS,
    ]


def _data(tmp_path: Path, target: Path, n_train: int, n_heldout: int, **kw) -> Path:
    return make_data_dir(
        tmp_path / "data",
        AutoTokenizer.from_pretrained(target),
        target,
        n_train=n_train,
        n_heldout=n_heldout,
        seed=3,
        **kw,
    )


def _mla_target(tiny_target, q_lora: bool = True) -> Path:
    """The tiny DeepSeek-V3 (MLA + MoE, real latent 512 + 64, sigmoid routing with the correction bias, yarn
    rope), with `q_lora_rank` set (DeepSeek-V3, Kimi-K2) or unset (q_proj straight from the hidden state)."""
    if q_lora:
        return tiny_target("deepseek_v3")
    from nestling.assets import cache_dir
    from nestling.targets.tiny import build_tiny_target

    return build_tiny_target(
        "deepseek_v3",
        cache_dir() / "tiny" / "deepseek_v3-noq-s0",
        tokenizer_dir=tiny_target("llama"),
        overrides={"q_lora_rank": None},
    )


def _separated_router_target(tiny_target) -> Path:
    """The tiny DeepSeek-V3 with a router whose choice no rounding can flip: each MoE layer's
    `e_score_correction_bias` (added to the sigmoid scores, in (0, 1), for the top-k choice only) is 2 for
    two experts and 0 for the others, so the same two experts win by a margin of at least 1. The routing
    weights still come from the token's own scores. With random gates, near ties flip under bf16
    rounding in one engine and not the other (docs/capture-vllm.md)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from nestling.assets import build_once, cache_dir

    src = _mla_target(tiny_target)

    def build(out: Path) -> None:
        shutil.copytree(src, out, dirs_exist_ok=True)
        for f in out.glob("*.safetensors"):
            tensors = load_file(str(f))
            for name, t in tensors.items():
                if name.endswith("mlp.gate.e_score_correction_bias"):
                    tensors[name] = torch.tensor([0.0, 0.0, 2.0, 2.0], dtype=t.dtype)
            save_file(tensors, str(f), metadata={"format": "pt"})

    return build_once(cache_dir() / "tiny" / "deepseek_v3-separated-s0", build)


def _states(root: Path, split: str = "train") -> list[torch.Tensor]:
    """Every sample's stored states as one float32 [T, n_ids, H] tensor (aux ids then the final state)."""
    ds = CaptureDataset(root, split)
    out = []
    for i in range(len(ds)):
        s = ds[i]
        T, H = len(s["input_ids"]), s["final"].shape[-1]
        out.append(torch.cat([s["aux"].reshape(T, -1, H), s["final"].reshape(T, 1, H)], 1).float())
    return out


def _vllm_capture(
    data: Path, target: Path, out: Path, dtype: str, layers: str, *opts: str, pins: bool = True, device: str = "cpu"
) -> None:
    """`pins=False` runs the engine without the suite's AVX2 pins (tests/conftest.py), as on a user's
    machine: on a CPU with AMX tiles vLLM's bf16 kernels take oneDNN's AMX path, which the pins switch
    off under them (the worker aborts: "BFloat16 Brgemm VNNI format is only supported ... when amx is
    supported")."""
    cmd = _cli(data, target, out, "token_budget=512", "progress_interval=60", *opts)
    cmd[cmd.index("--dtype") + 1], cmd[cmd.index("--layers") + 1] = dtype, layers
    cmd[cmd.index("--device") + 1] = device
    env = _env()
    if not pins:
        for var in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
            env.pop(var, None)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _err_over_rms(a: Path, b: Path, split: str = "train") -> torch.Tensor:
    """The largest |a - b| of each stored id over all tokens, in units of each token's RMS in `b`."""
    out = []
    for v, h in zip(_states(a, split), _states(b, split), strict=True):
        assert v.shape == h.shape
        out.append(((v - h).abs() / h.pow(2).mean(-1, keepdim=True).sqrt()).amax(-1))  # [T, n_ids]
    return torch.cat(out).amax(0)


def _p99_rel(a: Path, b: Path) -> torch.Tensor:
    """The 99th percentile over tokens of each state's relative L2 error ||a - b|| / ||b||, per stored id."""
    v, h = torch.cat(_states(a)), torch.cat(_states(b))
    return torch.quantile((v - h).norm(dim=-1) / h.norm(dim=-1), 0.99, dim=0)


def _amx() -> bool:
    from nestling.targets.vllm_rules import has_amx

    return has_amx()
