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


SMALL_MOE_MLA = dict(
    hidden_size=32,
    num_hidden_layers=3,
    vocab_size=100,
    num_attention_heads=4,
    intermediate_size=64,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=64,
    q_lora_rank=16,
    kv_lora_rank=8,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=8,
)


def test_compressed_tensors_targets_name_the_quantized_modules():
    """Each config group's `targets` pick the Linear layers it quantizes ("Linear": all of them), `ignore`
    keeps some bf16; embeddings, router and norms are never Linear layers."""

    def w4(targets, ignore=()):
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"g": {"targets": targets, "weights": W4A16["config_groups"]["group_0"]["weights"]}},
            "ignore": list(ignore),
        }

    # by group (heads 4): MLA per layer q 32*16 + 16*4*12 = 1280, kv 32*12 + 8*4*16 = 896, o 4*8*32 = 1024
    attn, dense, expert = 3 * 3200, 3 * 32 * 64, 3 * 32 * 64
    routed, shared, router, embed, lm_head = 2 * 4 * expert, 2 * expert, 2 * 4 * 32, 3200, 3200
    norms = 7 * 32 + 3 * (8 + 16)
    p = M.count_params(SMALL_MOE_MLA)
    assert p.n_total == attn + dense + routed + shared + router + embed + lm_head + norms
    experts_only = dict(SMALL_MOE_MLA, quantization_config=w4(["re:.*mlp\\.experts\\..*"]))
    assert sum(M.weight_bytes(experts_only).values()) == routed * 0.5625 + 2 * (p.n_total - routed)
    every_linear = dict(SMALL_MOE_MLA, quantization_config=w4(["Linear"]))
    linear = attn + dense + routed + shared + lm_head
    assert sum(M.weight_bytes(every_linear).values()) == linear * 0.5625 + 2 * (p.n_total - linear)
    # two schemes: 8-bit attention (per channel: no group scales), 4-bit experts
    two = w4(["re:.*mlp\\.experts\\..*"])
    two["config_groups"]["attn"] = {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "strategy": "channel"}}
    mixed = dict(SMALL_MOE_MLA, quantization_config=two)
    assert sum(M.weight_bytes(mixed).values()) == routed * 0.5625 + attn * 1 + 2 * (p.n_total - routed - attn)


def test_vllm_split_rules_and_caches_by_hand():
    """vLLM's split of a small MoE + MLA target: heads must divide over the ranks; experts whose slice
    would break a quantization group need expert parallelism; MLA's latent cache is whole on every
    rank, a GQA cache splits by kv heads."""
    from nestling.plan import vllm as V
    from nestling.plan.run import capture_command

    cfg = dict(SMALL_MOE_MLA, quantization_config=W4A16)
    assert V.tp_problem(cfg, 2) is None and V.experts_note(cfg, 2).startswith("sliced 2 ways")  # 64 / 2 = 32
    assert V.tp_problem(cfg, 4) is None and V.experts_note(cfg, 4).startswith("needs enable_expert_parallel")
    assert V.tp_problem(cfg, 8) == "4 attention heads do not split over 8 ranks"
    target = {
        "backend": "vllm",
        "tp": 4,
        "dp": 1,
        "token_budget": 16384,
        "experts": V.experts_note(cfg, 4),
        "refused": None,
    }
    assert capture_command(target, PlanSettings()) == (
        "capture backend=vllm tensor_parallel_size=4 data_parallel_size=1 enable_expert_parallel=true"
    )
    # per token at TP 2: MLA latent 3 layers x (8 + 4) x 2 B; 2 captured rows of 32; MoE workspaces
    # 2 x top-k 2 x max(32, 64) (the gate_up slice 2 x 64 / 2 is the wider) ...
    t = V.per_token_bytes(cfg, 2, 2)
    assert t["kv_cache"] == 3 * 12 * 2 and t["hidden_state_cache"] == 2 * 2 * 32
    assert t["activations"] == 2 * (4 * 32 + 2 * 32 + 2 * (32 + 64) + 2 * 4)
    gqa = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    assert V.per_token_bytes(gqa, 1, 1)["kv_cache"] == 2 * 2 * 2 * 8 * 2
    assert V.per_token_bytes(gqa, 4, 1)["kv_cache"] == 2 * 2 * 1 * 8 * 2  # 1 kv head per rank, 2 of 4 ranks share it
    # weights at TP 2: MLA's down-projections, the router and the norms whole, the rest halved, plus
    # MLA's W_UK / W_UV (bf16 copies of kv_b_proj's share)
    down = 3 * 32 * (16 + 8 + 4)
    p = M.count_params(cfg)
    whole = down + p.total["router"] + p.total["norms"]
    rest = p.n_total - whole - p.total["routed_experts"]
    expect = 2 * whole + (2 * rest + p.total["routed_experts"] * 0.5625) / 2 + 2 * 3 * 8 * 4 * 16 / 2
    assert sum(V.weights_per_gpu(cfg, 2).values()) == pytest.approx(expect, rel=1e-12)


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
    p = plan(
        write_config(tmp_path, cfg),
        PlanSettings(vllm_check=False, tokens=1000, gpus=2, gpu_memory="16GB", disk="300KB"),
    )
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


def kimi_by_hand() -> dict:
    """Kimi-K2.5's bytes, from the shapes alone: stored, and on each of 8 tensor-parallel ranks in vLLM."""
    H, L, heads, V, E, k, I, inter = 7168, 61, 64, 163840, 384, 8, 2048, 18432
    q_lora, kv_lora, rope, nope, v = 1536, 512, 64, 128, 128
    down = H * q_lora + H * (kv_lora + rope)  # q_a_proj, kv_a_proj_with_mqa: replicated in vLLM
    up = q_lora * heads * (rope + nope) + kv_lora * heads * (nope + v) + heads * v * H  # q_b, kv_b, o
    routed = 60 * E * 3 * H * I  # INT4: 4 bits + a bf16 scale per 32 weights = 0.5625 bytes
    bf16 = {
        "down": L * down,
        "up": L * up,
        "dense": 3 * H * inter,
        "shared": 60 * 3 * H * I,
        "router": 60 * E * H,
        "embed_head": 2 * V * H,
        "norms": (2 * L + 1) * H + L * (kv_lora + q_lora),
    }
    stored = routed * 0.5625 + 2 * sum(bf16.values())
    tp = 8
    per_gpu = (
        routed * 0.5625 / tp
        + 2 * (bf16["down"] + bf16["router"] + bf16["norms"])  # whole on every rank
        + 2 * (bf16["up"] + bf16["dense"] + bf16["shared"] + bf16["embed_head"]) / tp
        + 2 * L * kv_lora * heads * (nope + v) / tp  # MLA's W_UK / W_UV, made from kv_b_proj at load
    )
    per_token = {
        "kv_cache": L * (kv_lora + rope) * 2,  # 576 bf16 values per layer, on every rank
        "hidden_state_cache": 4 * H * 2,  # 4 captured layers
        # residual stream 4 x H, the 4 captured rows, two Marlin MoE workspaces of top-k x H, fp32 router logits
        "activations": 2 * (4 * H + 4 * H + 2 * k * H + 2 * E),
    }
    return {"stored": stored, "weights_per_gpu": per_gpu, "per_token": per_token, "params": routed + sum(bf16.values())}


def test_kimi_k25_on_8x96gb_with_4tb_captures_with_vllm_tp8(tmp_path):
    """The project's real job: Kimi-K2.5 (W4A16), 8 x 96 GB, 4 TB, 100M tokens: vLLM holds the INT4
    experts packed, TP 8, the float8 store; the numbers computed by hand from the shapes."""
    hand = kimi_by_hand()
    s = PlanSettings(vllm_check=False, tokens=100_000_000, gpus=8, gpu_memory="96GB", disk="4TB")
    p = plan(write_config(tmp_path, KIMI_K25) / "config.json", s)
    assert p["target"]["params_total"] == hand["params"]
    assert p["target"]["weight_bytes"] == hand["stored"]
    assert f"{hand['stored'] / 2**30:.1f}" == "553.4"
    assert p["layer_ids"] == [2, 30, 58, 61]
    assert p["store"]["bfloat16"]["bytes_per_token"] == 4 * 7168 * 2 + 5  # 57 KB
    assert p["store"]["float8"]["bytes_per_token"] == 4 * 7168 + 16 + 5  # half: 2.6 TiB for 100M tokens
    t = p["target_memory"]
    assert (t["backend"], t["tp"], t["dp"], t["busy_gpus"]) == ("vllm", 8, 1, 8)
    usable = 0.9 * 96e9
    # at the default 16,384-token batch TP 8 is over by a little; at 8,192 it fits
    engine = 4 * 2**30
    at = {n: hand["weights_per_gpu"] + n * sum(hand["per_token"].values()) + engine for n in (16384, 8192)}
    assert at[16384] > usable > at[8192]
    assert t["token_budget"] == 8192
    m = t["memory"]
    assert m["weights"] == pytest.approx(hand["weights_per_gpu"], rel=1e-12)
    for part, b in hand["per_token"].items():
        assert m[part] == 8192 * b, part
    assert m["engine"] == engine and sum(m.values()) == pytest.approx(at[8192], rel=1e-12)
    assert [o["fits"] for o in t["options"]] == [False, False, False, True]
    assert "48 of 384 experts per GPU" in t["experts"]
    # hf would dequantize the experts: 2 bytes a parameter, 245 GiB per GPU over all 8
    assert t["other"]["backend"] == "hf" and not t["other"]["fits"]
    assert t["other"]["weight_bytes"] == 2 * hand["params"]
    by = {mo["mode"]: mo for mo in p["modes"]}
    assert not by["offline, bfloat16 store"]["fits"] and "5.2 TiB" in by["offline, bfloat16 store"]["why"]
    assert not by["online"]["fits"]
    assert p["recommendation"].startswith(
        "offline, float8 store: capture backend=vllm tensor_parallel_size=8 data_parallel_size=1 token_budget=8192"
    )
    assert p["recommendation"].endswith("dtype=float8; train ddp on 8 GPUs")
    # where nestling's vllm path still refuses the target, the recommendation says so
    refused = t["refused"]
    assert (refused is not None) == ("not runnable yet" in p["recommendation"])
    # time: capture on all 8 GPUs at half the dense rate its active FLOPs give, then DDP training
    cap, train = p["time"]["capture"], p["time"]["train"]
    assert cap["busy_gpus"] == 8 and cap["efficiency"] == 0.5
    assert cap["seconds"] == pytest.approx(1e8 / (8 * cap["tokens_per_s_per_gpu"]))
    assert train["seconds"] == pytest.approx(1e8 / (8 * train["tokens_per_s_per_gpu"]))
    assert p["draft"]["parallel"] == "ddp"


def test_kimi_k25_with_the_hf_backend(tmp_path):
    """backend=hf prices transformers' way: the INT4 experts dequantized at load (1.9 TiB), which 8 x 96 GB
    cannot hold; 16 GPUs of 192 GB can (device_map: one GPU computes at a time)."""
    s = PlanSettings(vllm_check=False, tokens=100_000_000, gpus=8, gpu_memory="96GB", disk="4TB", backend="hf")
    p = plan(write_config(tmp_path, KIMI_K25), s)
    t = p["target_memory"]
    assert t["backend"] == "hf" and t["backend_why"] == "backend=hf (the setting)"
    assert t["weight_bytes"] == 2 * p["target"]["params_total"] > 3 * p["target"]["weight_bytes"]
    assert [o["fits"] for o in t["options"]] == [False, False, False, False] and t["tp"] is None
    assert (
        p["recommendation"].startswith("nothing fits") and "does not fit on 8 GPUs even at TP 8" in p["recommendation"]
    )
    assert t["other"]["backend"] == "vllm" and t["other"]["fits"]
    # 16 GPUs of 192 GB hold the dequantized target; with 8 TB the bf16 store fits and is preferred
    p16 = plan(
        write_config(tmp_path, KIMI_K25, "k16"),
        PlanSettings(vllm_check=False, tokens=100_000_000, gpus=16, gpu_memory="192GB", disk="8TB", backend="hf"),
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
    with pytest.raises(NestlingError, match="backend is auto, vllm or hf"):
        PlanSettings(backend="sglang")


def test_hf_tensor_parallel_where_transformers_splits_the_target(tmp_path):
    """DeepSeek-V3 (MLA: the hf backend) has a transformers tensor-parallel plan, so over 16 GPUs the
    plan captures with TP 16, every GPU computing: 16x the device_map rate."""
    p = plan(
        write_config(tmp_path, DEEPSEEK_V3),
        PlanSettings(vllm_check=False, tokens=100_000_000, gpus=16, gpu_memory="192GB", disk="8TB", backend="hf"),
    )
    t = p["target_memory"]
    assert (t["backend"], t["hf_split"], t["tp"], t["busy_gpus"]) == ("hf", "tensor_parallel", 16, 16)
    assert "backend=hf tensor_parallel_size=16 under torchrun" in p["recommendation"]
    cap = p["time"]["capture"]
    assert cap["busy_gpus"] == 16 and cap["seconds"] == pytest.approx(1e8 / (16 * cap["tokens_per_s_per_gpu"]))
    # 24 GPUs: the degrees are powers of two that divide 24, so TP 8 (every 8 of them), not a crash
    p24 = plan(
        write_config(tmp_path, DEEPSEEK_V3, "ds24"),
        PlanSettings(vllm_check=False, tokens=100_000_000, gpus=24, gpu_memory="192GB", disk="8TB", backend="hf"),
    )
    t = p24["target_memory"]
    assert (t["hf_split"], t["tp"], t["busy_gpus"]) == ("tensor_parallel", 8, 8)


def test_rates_scale_from_the_measured_llama8b(tmp_path):
    """A Llama-3-8B config gets back exactly the rates measured on it (capture and the K=7 train run),
    DeepSeek-V3 one divided by its FLOPs ratio (its active parameters) and by moe_efficiency, and a GPU
    twice as fast halves the time."""
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
    p = plan(write_config(tmp_path, llama8b), PlanSettings(vllm_check=False, tokens=10**6, ttt_steps=7))
    assert p["draft"]["trainable_params"] == train["runs"][0]["trainable_params"]
    assert p["time"]["capture"]["tokens_per_s_per_gpu"] == pytest.approx(
        cap["capture_tok_s"], rel=1e-4
    )  # it counted norms too
    k7 = next(r for r in train["runs"] if r["K"] == 7)
    assert p["time"]["train"]["tokens_per_s_per_gpu"] == pytest.approx(k7["tokens_per_s"], rel=0.03)
    dsv3 = plan(write_config(tmp_path, DEEPSEEK_V3, "dsv3"), PlanSettings(vllm_check=False, tokens=10**6))
    ratio = dsv3["target"]["flops_per_token"] / p["target"]["flops_per_token"]
    assert dsv3["time"]["capture"]["tokens_per_s_per_gpu"] == pytest.approx(
        cap["capture_tok_s"] / ratio * 0.5, rel=1e-4
    )
    dense_rate = plan(
        write_config(tmp_path, DEEPSEEK_V3, "dsv3b"), PlanSettings(vllm_check=False, tokens=10**6, moe_efficiency=1.0)
    )
    assert dense_rate["time"]["capture"]["tokens_per_s_per_gpu"] == pytest.approx(
        cap["capture_tok_s"] / ratio, rel=1e-4
    )
    # a dense target captures with vllm: every GPU works (TP 1 x DP 8 here)
    assert p["target_memory"]["backend"] == "vllm" and p["target_memory"]["tp"] == 1 and p["target_memory"]["dp"] == 8
    assert p["time"]["capture"]["seconds"] == pytest.approx(10**6 / (8 * p["time"]["capture"]["tokens_per_s_per_gpu"]))
    fast = plan(
        write_config(tmp_path, llama8b, "fast"), PlanSettings(vllm_check=False, tokens=10**6, gpu_tflops=2 * 989)
    )
    assert fast["time"]["capture"]["seconds"] == pytest.approx(p["time"]["capture"]["seconds"] / 2)


def test_tokens_from_a_data_folder(tiny_target, tmp_path):
    from transformers import AutoTokenizer

    from capture_data import make_data_dir

    target = tiny_target("llama")
    data = make_data_dir(tmp_path / "data", AutoTokenizer.from_pretrained(target), target, n_train=3, n_heldout=1)
    m = json.loads((data / "manifest.json").read_text())
    p = plan(target, PlanSettings(vllm_check=False, data=str(data)))
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
        "8",
        "--gpu-memory",
        "96GB",
        "--disk",
        "4TB",
        "--no-vllm-check",  # tests/test_plan_serving.py asks vLLM
    ]
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    assert "57,349" in out and "28,693" in out and "weights     W4A16 pack-quantized g32" in out and "553.4 GiB" in out
    assert "capture backend vllm" in out and "     8   1    8192     78.7 GiB  yes" in out
    assert "the hf backend: weights 1.9 TiB, 245.4 GiB per GPU over 8: does not fit" in out
    assert "recommended: offline, float8 store: capture backend=vllm tensor_parallel_size=8" in out
    assert out.endswith("beside this target (vllm_check off)\n") or "vLLM        not installed here" in out
    js = json.loads(
        subprocess.run(cmd + ["--json", "ttt_steps=3"], capture_output=True, text=True, env=env, check=True).stdout
    )
    assert js["store"]["float8"]["bytes_per_token"] == 28693 and js["target_memory"]["tp"] == 8
    bad = subprocess.run(cmd[:5], capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and "--tokens N" in bad.stderr
