"""`nestling plan`: the arithmetic on real public configs (DeepSeek-V3, Kimi-K2) and on small configs
whose answers are computed by hand here, the measured rates it scales, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nestling.errors import NestlingError
from nestling.plan import model as M
from nestling.plan.run import plan
from nestling.plan.settings import PlanSettings

SRC = str(Path(__file__).resolve().parents[1] / "src")

# config.json values of the public checkpoints (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct).
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    hidden_size=7168,
    num_hidden_layers=61,
    vocab_size=129280,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    moe_intermediate_size=2048,
    intermediate_size=18432,
    first_k_dense_replace=3,
    moe_layer_freq=1,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    num_attention_heads=128,
    num_key_value_heads=128,
    tie_word_embeddings=False,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    quantization_config={
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
)
KIMI_K2 = dict(
    DEEPSEEK_V3,
    vocab_size=163840,
    num_attention_heads=64,
    num_key_value_heads=64,
    n_routed_experts=384,
    first_k_dense_replace=1,
    quantization_config=None,
)
# Kimi-K2-Thinking / K2.5: routed experts in INT4 (compressed-tensors pack-quantized, symmetric groups
# of 32 with a bf16 scale), attention, shared experts, the dense layer and lm_head in bf16.
W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
KIMI_K25 = {
    "model_type": "kimi_k25",
    "text_config": {**KIMI_K2, "quantization_config": None},
    "quantization_config": W4A16,
}


def write_config(tmp_path: Path, cfg: dict, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# ---- parameters, weights, FLOPs -------------------------------------------------------------------------


def test_deepseek_v3_matches_its_published_sizes():
    p = M.count_params(DEEPSEEK_V3)
    assert abs(p.n_total - 671e9) / 671e9 < 0.005  # "671B total" (the MTP module is not counted)
    assert abs(p.n_active - 37e9) / 37e9 < 0.03  # "37B activated"
    assert M.n_moe_layers(DEEPSEEK_V3) == 58
    # fp8 with one fp32 scale per 128x128 block; embedding and lm_head stay bf16
    assert M.quantization(DEEPSEEK_V3).bits == 8 + 32 / 128**2
    w = sum(M.weight_bytes(DEEPSEEK_V3).values())
    assert 665e9 < w < 680e9  # the checkpoint's 163 files hold ~690 GB with the 14B MTP module


def test_kimi_k2_matches_its_published_sizes():
    p = M.count_params(KIMI_K2)
    assert abs(p.n_total - 1.04e12) / 1.04e12 < 0.02  # "1T total" (1.04T in the tech report)
    assert abs(p.n_active - 32e9) / 32e9 < 0.04  # "32B activated"
    assert M.n_moe_layers(KIMI_K2) == 60
    assert sum(M.weight_bytes(KIMI_K2).values()) == 2 * p.n_total  # no quantization_config: bf16


def test_kimi_k25_w4a16_quantizes_the_routed_experts_only():
    cfg = M.text_config(KIMI_K25)
    q = M.quantization(cfg)
    assert q.bits == 4 + 16 / 32
    w = M.weight_bytes(cfg)
    p = M.count_params(cfg)
    assert w["routed_experts"] == p.total["routed_experts"] * 4.5 / 8
    for group in ("attention", "shared_experts", "dense_mlp", "lm_head", "embed_tokens", "router"):
        assert w[group] == 2 * p.total[group], group
    assert 585e9 < sum(w.values()) < 600e9  # Kimi-K2-Thinking's INT4 checkpoint: ~594 GB


def test_small_dense_config_by_hand():
    cfg = dict(
        hidden_size=64,
        num_hidden_layers=4,
        vocab_size=1000,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    )
    # per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288; MLP 3*64*128 = 24576
    layers = 4 * (12288 + 24576)
    total = layers + 1000 * 64 * 2 + (2 * 4 + 1) * 64  # + embed + lm_head + norms
    p = M.count_params(cfg)
    assert p.n_total == p.n_active == total == 276032
    assert sum(M.weight_bytes(cfg).values()) == 2 * 276032
    assert M.flops_per_token(cfg, 100) == 2 * layers + 2 * 4 * 4 * (16 + 16) * 50


def test_small_moe_mla_config_by_hand():
    cfg = dict(
        hidden_size=32,
        num_hidden_layers=3,
        vocab_size=100,
        num_attention_heads=2,
        intermediate_size=64,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=16,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        quantization_config=W4A16,
    )
    # MLA per layer: q 32*16 + 16*2*12 = 896, kv 32*(8+4) + 8*2*(8+8) = 640, o 2*8*32 = 512 -> 2048
    attn, dense, expert = 3 * 2048, 1 * 3 * 32 * 64, 3 * 32 * 16
    routed, shared, router = 2 * 4 * expert, 2 * 1 * expert, 2 * 4 * 32
    embed = lm_head = 100 * 32
    norms = (2 * 3 + 1) * 32 + 3 * (8 + 16)
    p = M.count_params(cfg)
    assert p.n_total == attn + dense + routed + shared + router + embed + lm_head + norms == 34600
    assert p.n_active == 34600 - 2 * 2 * expert  # 2 of 4 routed experts per token
    assert sum(M.weight_bytes(cfg).values()) == routed * 4.5 / 8 + (34600 - routed) * 2 == 51536


def test_unknown_quantization_is_refused():
    with pytest.raises(NestlingError, match="quant_method 'gptq'"):
        M.quantization({"quantization_config": {"quant_method": "gptq"}})


# ---- the draft's size: the formula equals the module ------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 2])
def test_draft_trainable_params_equal_the_built_module(layers):
    from types import SimpleNamespace

    from nestling.draft.model import DraftConfig, Eagle3Draft

    cfg = SimpleNamespace(
        hidden_size=48,
        intermediate_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        num_hidden_layers=6,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=128,
        hidden_act="silu",
        model_type="llama",
    )
    c = DraftConfig.from_target(cfg, 100, [1, 3, 4], num_hidden_layers=layers)
    draft = Eagle3Draft(c)
    assert c.trainable_params() == sum(p.numel() for p in draft.parameters() if p.requires_grad)


# ---- the whole plan --------------------------------------------------------------------------------------


def test_small_plan_store_and_memory_by_hand(tmp_path):
    cfg = dict(
        hidden_size=64,
        num_hidden_layers=4,
        vocab_size=1000,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    )
    p = plan(write_config(tmp_path, cfg), PlanSettings(tokens=1000, gpus=2, gpu_memory="16GB", disk="300KB"))
    assert p["layer_ids"] == [1, 2, 4]  # default aux [2, L//2, L-3] = {2, 1} + final 4
    # bf16: 3 slots x 64 x 2 B + int32 id + uint8 mask; float8: 3 x 64 x 1 B + 3 float32 scales + 5
    assert p["store"]["bfloat16"]["bytes_per_token"] == 3 * 64 * 2 + 5 == 389
    assert p["store"]["float8"]["bytes_per_token"] == 3 * 64 + 3 * 4 + 5 == 209
    assert p["store"]["bfloat16"]["bytes"] == 389_000 and p["store"]["float8"]["bytes"] == 209_000
    assert p["store"]["bfloat16"]["fits_disk"] is False and p["store"]["float8"]["fits_disk"] is True
    assert p["target"]["params_total"] == 276032 and p["target"]["weight_bytes"] == 552064
    assert p["target_memory"]["tp"] == 1 and p["target_memory"]["dp"] == 2
    by = {m["mode"]: m for m in p["modes"]}
    assert not by["offline, bfloat16 store"]["fits"] and by["offline, float8 store"]["fits"]
    assert by["online"]["fits"] and p["recommendation"].startswith("online")


def test_kimi_k25_on_8x96gb_with_4tb(tmp_path):
    """The project's real job: Kimi-K2.5 (W4A16), 8 x 96 GB, 4 TB, 100M tokens."""
    s = PlanSettings(tokens=100_000_000, gpus=8, gpu_memory="96GB", disk="4TB")
    p = plan(write_config(tmp_path, KIMI_K25) / "config.json", s)
    assert p["layer_ids"] == [2, 30, 58, 61]
    assert p["store"]["bfloat16"]["bytes_per_token"] == 4 * 7168 * 2 + 5  # 57 KB
    assert p["store"]["float8"]["bytes_per_token"] == 4 * 7168 + 16 + 5  # half
    # MLA: nestling's vllm capture path refuses it, so the hf backend runs it, and holds what transformers
    # loads: the INT4 experts dequantized to bf16 (targets/load.py), 1.9 TiB, 245 GiB per GPU over all 8
    assert p["target_memory"]["backend"] == "hf" and "MLA" in p["target_memory"]["backend_why"]
    assert p["target_memory"]["weight_bytes"] == 2 * p["target"]["params_total"] > 3 * p["target"]["weight_bytes"]
    assert [o["fits"] for o in p["target_memory"]["options"]] == [False, False, False, False]
    assert p["target_memory"]["tp"] is None
    by = {m["mode"]: m for m in p["modes"]}
    assert not by["offline, bfloat16 store"]["fits"] and "5.2 TiB" in by["offline, bfloat16 store"]["why"]
    assert not by["offline, float8 store"]["fits"] and "does not fit on 8 GPUs" in by["offline, float8 store"]["why"]
    assert not by["online"]["fits"] and p["recommendation"].startswith("nothing fits")
    assert p["draft"]["parallel"] == "ddp"
    # 16 GPUs of 192 GB hold the dequantized target (device_map: one GPU computes at a time); with 8 TB
    # the bf16 store fits and is preferred
    p16 = plan(
        write_config(tmp_path, KIMI_K25, "k16"),
        PlanSettings(tokens=100_000_000, gpus=16, gpu_memory="192GB", disk="8TB"),
    )
    assert p16["target_memory"]["tp"] == 16
    assert (
        p16["recommendation"].startswith("offline, bfloat16 store")
        and "backend=hf device_map=auto" in p16["recommendation"]
    )
    cap = p16["time"]["capture"]
    assert cap["busy_gpus"] == 1 and cap["seconds"] == pytest.approx(1e8 / cap["tokens_per_s_per_gpu"])
    # why not tensor parallel: capture/tp.py's refusal of compressed-tensors checkpoints, named
    assert p16["target_memory"]["hf_split"] == "device_map" and "compressed-tensors" in p16["recommendation"]


def test_hf_tensor_parallel_where_transformers_splits_the_target(tmp_path):
    """DeepSeek-V3 (MLA: the hf backend) has a transformers tensor-parallel plan, so over 16 GPUs the
    plan captures with TP 16, every GPU computing: 16x the device_map rate."""
    p = plan(
        write_config(tmp_path, DEEPSEEK_V3),
        PlanSettings(tokens=100_000_000, gpus=16, gpu_memory="192GB", disk="8TB"),
    )
    t = p["target_memory"]
    assert (t["backend"], t["hf_split"], t["tp"], t["busy_gpus"]) == ("hf", "tensor_parallel", 16, 16)
    assert "backend=hf tensor_parallel_size=16 under torchrun" in p["recommendation"]
    cap = p["time"]["capture"]
    assert cap["busy_gpus"] == 16 and cap["seconds"] == pytest.approx(1e8 / (16 * cap["tokens_per_s_per_gpu"]))
    # 24 GPUs: the degrees are powers of two that divide 24, so TP 8 (every 8 of them), not a crash
    p24 = plan(
        write_config(tmp_path, DEEPSEEK_V3, "ds24"),
        PlanSettings(tokens=100_000_000, gpus=24, gpu_memory="192GB", disk="8TB"),
    )
    t = p24["target_memory"]
    assert (t["hf_split"], t["tp"], t["busy_gpus"]) == ("tensor_parallel", 8, 8)


def test_rates_scale_from_the_measured_llama8b(tmp_path):
    """A Llama-3-8B config gets back exactly the rates measured on it (capture and the K=7 train run),
    DeepSeek-V3 one divided by its FLOPs ratio, and a GPU twice as fast halves the time."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    cap = json.loads((results / "capture_h200_llama8b_192x2048.json").read_text())
    train = json.loads((results / "train_h200_llama8b_compile.json").read_text())
    llama8b = dict(
        hidden_size=4096,
        num_hidden_layers=32,
        vocab_size=128256,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
    )
    p = plan(write_config(tmp_path, llama8b), PlanSettings(tokens=10**6, ttt_steps=7))
    assert p["draft"]["trainable_params"] == train["runs"][0]["trainable_params"]
    assert p["time"]["capture"]["tokens_per_s_per_gpu"] == pytest.approx(
        cap["capture_tok_s"], rel=1e-4
    )  # it counted norms too
    k7 = next(r for r in train["runs"] if r["K"] == 7)
    assert p["time"]["train"]["tokens_per_s_per_gpu"] == pytest.approx(k7["tokens_per_s"], rel=0.03)
    dsv3 = plan(write_config(tmp_path, DEEPSEEK_V3, "dsv3"), PlanSettings(tokens=10**6))
    ratio = dsv3["target"]["flops_per_token"] / p["target"]["flops_per_token"]
    assert dsv3["time"]["capture"]["tokens_per_s_per_gpu"] == pytest.approx(cap["capture_tok_s"] / ratio, rel=1e-4)
    # a dense target captures with vllm: every GPU works (TP 1 x DP 8 here)
    assert p["target_memory"]["backend"] == "vllm" and p["target_memory"]["tp"] == 1 and p["target_memory"]["dp"] == 8
    assert p["time"]["capture"]["seconds"] == pytest.approx(10**6 / (8 * p["time"]["capture"]["tokens_per_s_per_gpu"]))
    fast = plan(write_config(tmp_path, llama8b, "fast"), PlanSettings(tokens=10**6, gpu_tflops=2 * 989))
    assert fast["time"]["capture"]["seconds"] == pytest.approx(p["time"]["capture"]["seconds"] / 2)


def test_tokens_from_a_data_folder(tiny_target, tmp_path):
    from transformers import AutoTokenizer

    from capture_data import make_data_dir

    target = tiny_target("llama")
    data = make_data_dir(tmp_path / "data", AutoTokenizer.from_pretrained(target), target, n_train=3, n_heldout=1)
    m = json.loads((data / "manifest.json").read_text())
    p = plan(target, PlanSettings(data=str(data)))
    assert p["data"]["tokens"] == m["splits"]["train"]["tokens"] + m["splits"]["heldout"]["tokens"]
    assert p["data"]["train_tokens"] == m["splits"]["train"]["tokens"]
    with pytest.raises(NestlingError, match="--tokens N"):
        plan(target, PlanSettings())
    with pytest.raises(NestlingError, match="no finished `nestling data` folder"):
        plan(target, PlanSettings(data=str(tmp_path)))


def test_cli_table_and_json(tmp_path):
    target = write_config(tmp_path, KIMI_K25)
    cmd = [
        sys.executable,
        "-m",
        "nestling",
        "plan",
        str(target),
        "--tokens",
        "100000000",
        "--gpus",
        "16",
        "--gpu-memory",
        "192GB",
        "--disk",
        "4TB",
    ]
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    assert "recommended: offline, float8 store" in out and "57,349" in out and "28,693" in out
    assert "weights 1.9 TiB dequantized to bf16 by transformers" in out
    js = json.loads(
        subprocess.run(cmd + ["--json", "ttt_steps=3"], capture_output=True, text=True, env=env, check=True).stdout
    )
    assert js["store"]["float8"]["bytes_per_token"] == 28693 and js["target_memory"]["tp"] == 16
    bad = subprocess.run(cmd[:5], capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and "--tokens N" in bad.stderr
