"""The vllm capture backend against the real vLLM CPU engine (no mocks).

Every engine runs in a `nestling capture` subprocess (vLLM spawns workers, so `LLM` must not be
created inside pytest's process). Parity with the hf backend pins vLLM's layer-id convention,
including id 0 (embeddings) and id L (vLLM gives it before the final norm; the connector applies it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from capture_data import make_data_dir
from nestling.capture.run import capture
from nestling.capture.settings import CaptureSettings
from nestling.capture.store import CaptureDataset, shard_key
from nestling.capture.verify import verify
from nestling.capture.vllm import TESTED_VLLM, check_vllm_version, installed_vllm_version
from nestling.errors import NestlingError

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = "0,2,5,6"  # the tiny llama has 6 layers: embeddings, two aux, and the final state


def _hf_capture(data: Path, target: Path, out: Path, **kw) -> dict:
    """The hf backend's fp32 store of the same layers and budget: what the vllm backend is held to."""
    layers = [int(x) for x in LAYERS.split(",")]
    settings = CaptureSettings(
        backend="hf", device="cpu", dtype="float32", layers=layers, token_budget=256, progress_interval=60, **kw
    )
    return capture(data, target, out, settings)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    # VLLM_CPU_KVCACHE_SPACE is left to the backend (vllm_kv_cache_gib), so its own setting is exercised
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


@pytest.mark.vllm
def test_vllm_shards_equal_hf_shards(tiny_target, tmp_path):
    target = tiny_target("llama")
    data = _data(tmp_path, target, n_train=10, n_heldout=3, min_words=1, max_words=60)
    # small shards and budget: several shards per split, several engine batches per shard
    opts = ("token_budget=256", "shard_size=200KB", "progress_interval=60")
    r = subprocess.run(
        _cli(data, target, tmp_path / "vllm", *opts), env=_env(), capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    hf = _hf_capture(data, target, tmp_path / "hf", shard_size="200KB")
    vm = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert vm["final_state"] == "post_norm" and "final norm" in vm["final_state_source"]
    assert vm["layer_ids"] == hf["layer_ids"] == [0, 2, 5, 6]
    assert verify(tmp_path / "vllm") == []
    n_shards = 0
    for split in ("train", "heldout"):
        v, h = CaptureDataset(tmp_path / "vllm", split), CaptureDataset(tmp_path / "hf", split)
        assert [e["sample_id"] for e in v.index] == [e["sample_id"] for e in h.index]
        n_shards += len({e["shard"] for e in v.index})
        lengths = set()
        for i in range(len(v)):
            a, b = v[i], h[i]
            assert a["sample_id"] == b["sample_id"]
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
            torch.testing.assert_close(a["aux"], b["aux"], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(a["final"], b["final"], atol=1e-4, rtol=1e-4)
            lengths.add(len(a["input_ids"]))
        assert len(lengths) > 2  # varied lengths, really
    assert n_shards >= 4


@pytest.mark.vllm
def test_vllm_float8_store_reads_back_within_fp8_of_hf(tiny_target, tmp_path):
    """dtype=float8 with vllm: the engine's fp32 rows pass through the scratch file and are quantized by
    the runner; what reads back is within fp8's bound of the hf backend's fp32 store."""
    target = tiny_target("llama")
    data = _data(tmp_path, target, n_train=4, n_heldout=1, min_words=5, max_words=30)
    r = subprocess.run(
        _cli(data, target, tmp_path / "vllm", "dtype=float8", "token_budget=256", "progress_interval=60"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _hf_capture(data, target, tmp_path / "hf")
    m = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert m["dtype"] == "float8" and m["compute_dtype"] == "float32"
    assert verify(tmp_path / "vllm") == []
    v, h = CaptureDataset(tmp_path / "vllm", "train"), CaptureDataset(tmp_path / "hf", "train")
    for i in range(len(v)):
        a, b = v[i], h[i]
        for key in ("aux", "final"):
            H = b["final"].shape[-1]
            x, y = b[key].reshape(len(b[key]), -1, H), a[key].reshape(len(b[key]), -1, H)
            bound = x.abs() / 16 + x.abs().amax(-1, keepdim=True) / 448 * 2.0**-10 + 1e-3 * x.abs() + 1e-4
            assert bool(((y - x).abs() <= bound).all()), key


@pytest.mark.vllm
def test_kill_during_vllm_capture_then_resume(tiny_target, tmp_path):
    target = tiny_target("llama")
    data = _data(tmp_path, target, n_train=40, n_heldout=0)
    out = tmp_path / "cap"
    # ~one sample per shard: many shards, so the kill lands with some complete and one in flight
    opts = ("token_budget=256", "shard_size=40KB", "progress_interval=60")
    log = open(tmp_path / "first.log", "w")
    p = subprocess.Popen(
        _cli(data, target, out, *opts), env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    first = out / "train" / "shard-00000.safetensors"
    deadline = time.time() + 900
    while not first.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.killpg(p.pid, signal.SIGKILL)  # the CLI, its engine core and its worker: a machine crash
    p.wait()
    log.close()
    assert first.exists(), (tmp_path / "first.log").read_text()[-3000:]
    kept = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in (out / "train").glob("shard-*.safetensors")}
    n_total = 40  # upper bound on shards; the first run must have stopped short of the end
    assert not (out / "manifest.json").exists()
    assert len(kept) < n_total

    r = subprocess.run(_cli(data, target, out, *opts), env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert verify(out) == []
    shards = sorted((out / "train").glob("shard-*.safetensors"))
    assert len(shards) > len(kept)  # the rerun wrote what the kill cut off
    assert not list((out / "train").glob(".shard-*.tmp"))
    for f in shards:
        if f.name in kept:  # complete shards were kept, not rewritten
            assert (f.stat().st_ino, f.stat().st_mtime_ns) == kept[f.name]
        assert shard_key(f) is not None
    ds = CaptureDataset(out, "train")
    assert len(ds) == 40 and all(ds[i]["final"].abs().sum() > 0 for i in range(len(ds)))


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


def _vllm_capture(data: Path, target: Path, out: Path, dtype: str, layers: str, *opts: str, pins: bool = True) -> None:
    """`pins=False` runs the engine without the suite's AVX2 pins (tests/conftest.py), as on a user's
    machine: on a CPU with AMX tiles vLLM's bf16 kernels take oneDNN's AMX path, which the pins switch
    off under them (the worker aborts: "BFloat16 Brgemm VNNI format is only supported ... when amx is
    supported")."""
    cmd = _cli(data, target, out, "token_budget=512", "progress_interval=60", *opts)
    cmd[cmd.index("--dtype") + 1], cmd[cmd.index("--layers") + 1] = dtype, layers
    env = _env()
    if not pins:
        for var in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
            env.pop(var, None)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.vllm
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_mla_target_matches_hf_at_every_layer_float32(tiny_target, tmp_path, q_lora):
    """vLLM's states of an MLA + MoE target are transformers' to float32 rounding at every id: 0 (the
    embeddings, written by the connector since vLLM's deepseek_v2 backbone cannot return it), the dense
    layer's output, each MoE layer's, and the final state. float32 MLA runs on CPU_MLA (AMX_MLA takes bf16
    only); the bar is 1e-3 of each token's RMS (measured: ~3e-6)."""
    target = _mla_target(tiny_target, q_lora)
    data = _data(tmp_path, target, n_train=5, n_heldout=1, min_words=5, max_words=60)
    layers = "0,1,2,3,4,5,6"
    _vllm_capture(data, target, tmp_path / "vllm", "float32", layers)
    ids = [int(x) for x in layers.split(",")]
    capture(
        data,
        target,
        tmp_path / "hf",
        CaptureSettings(
            backend="hf", device="cpu", dtype="float32", layers=ids, token_budget=512, progress_interval=60
        ),
    )
    assert verify(tmp_path / "vllm") == []
    for split in ("train", "heldout"):
        for v, h in zip(_states(tmp_path / "vllm", split), _states(tmp_path / "hf", split), strict=True):
            rms = h.pow(2).mean(-1, keepdim=True).sqrt()
            err = ((v - h).abs() / rms).amax(-1)  # [T, n_ids]
            assert v.shape == h.shape and bool((err <= 1e-3).all()), err.amax(0)


def _amx() -> bool:
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["AMX_MLA", "CPU_MLA"])
def test_mla_target_bf16_within_3_percent(tiny_target, tmp_path, backend):
    """bf16, as MLA targets are served: each state's relative L2 error against transformers' bf16 states
    is at most 3% at the 99th percentile of tokens, on vLLM's AMX kernels (CPUs with AMX tiles) and on
    its portable CPU_MLA (every other CPU). The router is separated (`_separated_router_target`): with
    random gates, bf16 rounding flips near-tied top-k choices differently in each engine, and a flipped
    token moves every later state (measured p99 up to ~10% at the last layers)."""
    if backend == "AMX_MLA" and not _amx():
        pytest.skip("this CPU has no AMX tiles")
    target = _separated_router_target(tiny_target)
    data = _data(tmp_path, target, n_train=6, n_heldout=0, min_words=5, max_words=60)
    _vllm_capture(
        data,
        target,
        tmp_path / "vllm",
        "bfloat16",
        "2,3,5,6",
        f"attention_backend={backend}",
        pins=False,
    )
    capture(
        data,
        target,
        tmp_path / "hf",
        CaptureSettings(
            backend="hf", device="cpu", dtype="bfloat16", layers=[2, 3, 5, 6], token_budget=512, progress_interval=60
        ),
    )
    v, h = torch.cat(_states(tmp_path / "vllm")), torch.cat(_states(tmp_path / "hf"))
    rel = (v - h).norm(dim=-1) / h.norm(dim=-1)  # [tokens, n_ids]
    p99 = torch.quantile(rel, 0.99, dim=0)
    assert bool((p99 <= 0.03).all()), p99


@pytest.mark.parametrize(
    "config,match",
    [
        ({"model_type": "deepseek_v3", "kv_lora_rank": 32, "qk_rope_head_dim": 32}, r"576.*has 64"),
        (
            {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "rope_parameters": {}},
            r"plain rope wrongly.*yarn",
        ),
        (
            {
                "model_type": "kimi_k25",
                "text_config": {"model_type": "kimi_k2", "kv_lora_rank": 512, "qk_rope_head_dim": 64},
            },
            r"plain rope wrongly",
        ),
    ],
)
def test_cpu_build_limits_for_mla_are_refused_with_their_cause(config, match):
    """What vLLM's CPU build cannot compute for an MLA target is refused before loading, saying why and
    where to go (a GPU with vLLM, or the hf backend); a GPU build is not held to it."""
    from nestling.capture.vllm import check_cpu_target, check_target

    check_target(config)  # nothing against it on a GPU
    with pytest.raises(NestlingError, match=match) as e:
        check_cpu_target(config)
    assert "--backend hf" in str(e.value) and "GPU" in str(e.value)
    yarn = {"rope_type": "yarn", "factor": 40.0}
    check_cpu_target(
        {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "rope_parameters": yarn}
    )
    check_cpu_target({"model_type": "llama"})  # not MLA: no such limits


def test_deepseek_v4_is_refused_with_the_upstream_issue():
    from nestling.capture.vllm import check_target

    with pytest.raises(NestlingError, match=r"deepseek_v4.*#53074.*--backend hf"):
        check_target({"model_type": "deepseek_v4"})


def test_vllm_cpu_rotary_kernel_is_wrong_for_mla_shapes():
    """Why plain-rope MLA is refused on the CPU build: its rotary kernel is right for the [tokens, heads x
    dim] layout Llama hands it and wrong for MLA's [tokens, heads, dim] query and sliced key. When a vLLM
    release fixes the kernel, this fails: lift the refusal (check_cpu_target) then."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            64, max_position=2048, rope_parameters={"rope_theta": 1e4, "rope_type": "default"}, is_neox_style=False
        )
    T = 12
    pos, q, latent = torch.arange(T), torch.randn(T, 2, 96), torch.randn(T, 576)
    q_pe, k_pe = q[..., 32:], latent[:, 512:].unsqueeze(1)  # MLA's views: rope part of q and of the latent
    ref_q, ref_k = rope.forward_native(pos, q_pe.clone(), k_pe.clone())
    flat_q, flat_k = rope.forward_cpu(pos, q_pe.reshape(T, -1).clone(), k_pe.reshape(T, -1).clone())
    torch.testing.assert_close(flat_q.view(T, 2, 64), ref_q)  # Llama's layout: right
    torch.testing.assert_close(flat_k.view(T, 1, 64), ref_k)
    got_q, got_k = rope.forward_cpu(pos, q_pe.clone(), k_pe)
    assert (got_q - ref_q).abs().max() > 0.1 and (got_k - ref_k).abs().max() > 0.1  # MLA's: wrong


@pytest.mark.slow
def test_cpu_refusal_cli_without_traceback(tiny_target, tmp_path):
    """A plain-rope MLA target on the CPU build: one clear error, exit 1, nothing written, no weights loaded."""
    from nestling.assets import cache_dir
    from nestling.targets.tiny import build_tiny_target

    target = build_tiny_target(
        "deepseek_v3",
        cache_dir() / "tiny" / "deepseek_v3-plainrope-s0",
        tokenizer_dir=tiny_target("llama"),
        overrides={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 2048},
    )
    data = _data(tmp_path, target, n_train=2, n_heldout=0)
    r = subprocess.run(_cli(data, target, tmp_path / "cap"), env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "plain rope wrongly" in r.stderr and "--backend hf" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "cap" / "manifest.json").exists()


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.32.0", True),
        ("0.32.4", True),
        ("0.31.9", False),
        ("0.33.0", False),
        ("1.0.0", False),
        ("0.32.0+cpu", True),
        ("0.32.0rc1", False),
        ("0.10.1", False),
    ],
)
def test_vllm_version_range(version, ok):
    if ok:
        check_vllm_version(version)
    else:
        with pytest.raises(NestlingError, match=rf"tested with vLLM >= {TESTED_VLLM[0]}.*{version}.*--backend hf"):
            check_vllm_version(version)


def test_installed_vllm_is_in_tested_range():
    check_vllm_version(installed_vllm_version())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_connector_final_norm_matches_transformers(dtype):
    """The norm the connector applies to vLLM's pre-norm id L is transformers' own, bit for bit in bf16."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from nestling.capture.vllm_connector import apply_final_norm
    from nestling.draft.model import rms_norm

    torch.manual_seed(0)
    x = (torch.randn(7, 64) * 3).to(dtype)
    llama, gemma = LlamaRMSNorm(64, eps=1e-5).to(dtype), Gemma3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        llama.weight.normal_(1.0, 0.2)
        gemma.weight.normal_(0.0, 0.2)
        assert torch.equal(apply_final_norm(x, llama.weight.float(), 1e-5, False), llama(x))
        assert torch.equal(apply_final_norm(x, gemma.weight.float(), 1e-6, True), gemma(x))
        assert torch.equal(rms_norm(x, llama.weight, 1e-5), llama(x))  # the draft's norm is transformers' too
