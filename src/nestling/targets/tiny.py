"""Tiny random-weight targets in real architectures, built from configs (tests, `nestling doctor`).

They share the SmolLM2 tokenizer (a real tokenizer with a real ChatML template) so every stage
runs on them exactly as on a real model; only the weights are random.
"""

from __future__ import annotations

from pathlib import Path

from nestling.errors import NestlingError

VOCAB = 49152  # the SmolLM2 tokenizer's vocabulary

# Shapes are small but keep head_dim = 64, which every attention backend (vLLM's CPU one too) supports.
ARCH_CONFIGS: dict[str, dict] = {
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    "qwen3": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        norm_topk_prob=True,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=64,
        # MLA's latent as DeepSeek-V3 / Kimi-K2 ship it (512 + 64 = 576): vLLM's CPU MLA kernels are built
        # for that size only (also 320 and 512), so a smaller latent is a model no engine serves.
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=163840,
        tie_word_embeddings=False,
        rope_interleave=True,
        # routing and rope as the real checkpoints set them: sigmoid scores with the correction bias
        # (without these keys vLLM routes by softmax and builds no bias), yarn-scaled rope
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        sliding_window=16,
        tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=64,
    ),
}


def build_tiny_target(
    arch: str,
    out: Path,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    num_layers: int | None = None,
    overrides: dict | None = None,
) -> Path:
    """Write a random-weight model of `arch` plus a tokenizer to `out` (a normal HF folder, built once).
    `overrides` replaces config values (e.g. num_key_value_heads=2, which a TP=2 plan can split)."""
    from nestling.assets import build_once

    if arch not in ARCH_CONFIGS:
        raise NestlingError(f"unknown tiny architecture {arch!r}; known: {', '.join(ARCH_CONFIGS)}")
    return build_once(Path(out), lambda tmp: _build(arch, tmp, tokenizer_dir, seed, num_layers, overrides))


def _build(
    arch: str, out: Path, tokenizer_dir: Path | None, seed: int, num_layers: int | None, overrides: dict | None = None
) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if tokenizer_dir is None:
        from nestling.assets import smollm2_dir

        tokenizer_dir = smollm2_dir()
    cfg_kw = dict(ARCH_CONFIGS[arch]) | dict(overrides or {})
    if num_layers is not None:
        cfg_kw["num_hidden_layers"] = num_layers
        if "layer_types" in cfg_kw:
            cfg_kw["layer_types"] = (cfg_kw["layer_types"] * num_layers)[:num_layers]
    model_type = cfg_kw.pop("model_type")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **cfg_kw,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init with a larger scale so layers differ visibly
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out)
    tok.save_pretrained(out)
