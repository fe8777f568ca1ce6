"""What the installed vLLM can run for a target, and the engine settings it needs: one place for the
rules that capture, eval and regenerate share when they start vLLM (docs/capture-vllm.md, "MLA targets").
"""

from __future__ import annotations

from pathlib import Path

from nestling.errors import NestlingError

# Versions the vllm capture backend was tested against ([low, high)); docs/capture-vllm.md says the same.
TESTED_VLLM = ("0.32.0", "0.33.0")
HF_HINT = (
    "use `--backend hf` instead (for a target spread over several GPUs: tensor parallel, `torchrun "
    "--nproc-per-node N -m nestling capture ... --tensor-parallel-size N`, or `device_map=auto`)"
)
# model types built on vLLM's MLA attention (a config with kv_lora_rank counts as MLA too)
MLA_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_k2", "kimi_k25"}
# kv_lora_rank + qk_rope_head_dim sizes vLLM 0.32's CPU MLA kernels are built for (mla_attention.py)
CPU_MLA_LATENTS = {320, 512, 576}


def _text(config: dict) -> tuple[dict, str]:
    text = config.get("text_config") or config
    return text, str(text.get("model_type", config.get("model_type", "?")))


def model_type(config: dict) -> str:
    """The text model's type (a multimodal wrapper's text_config first)."""
    return _text(config)[1]


def is_mla(config: dict) -> bool:
    """MLA attention (the deepseek_v2 backbone: DeepSeek-V2/V3, Kimi-K2 and K2.5), by type or by config."""
    text, kind = _text(config)
    return bool(text.get("kv_lora_rank")) or kind in MLA_TYPES


def check_cpu_target(config: dict) -> None:
    """The limits of vLLM's CPU build for MLA targets (a GPU build has neither).

    - Its MLA kernels (CPU_MLA, AMX_MLA) are built for latents of kv_lora_rank + qk_rope_head_dim in
      CPU_MLA_LATENTS only ("Head dimension N is not supported by MLA" at load).
    - Its rotary kernel (`_C.rotary_embedding`, csrc/cpu/pos_encoding.cpp) reads a [tokens, heads, dim]
      query as one head per token row and ignores the strides of a sliced view; MLA hands it exactly
      that (the rope part of q and of the latent), so plain rope comes out wrong from the second token
      on (docs/capture-vllm.md). Scaled rope (yarn, as every released DeepSeek-V3 / Kimi checkpoint
      sets it) runs vLLM's PyTorch rope and is exact.
    """
    if not is_mla(config):
        return
    text, kind = _text(config)
    latent = int(text.get("kv_lora_rank") or 0) + int(text.get("qk_rope_head_dim") or 0)
    if latent not in CPU_MLA_LATENTS:
        raise NestlingError(
            f"vLLM's CPU build runs MLA only with kv_lora_rank + qk_rope_head_dim in {sorted(CPU_MLA_LATENTS)} "
            f"(DeepSeek-V3 and Kimi-K2 have 512 + 64 = 576); this {kind} target has {latent}. Capture it on a GPU "
            f"with vLLM, or {HF_HINT}."
        )
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) in (None, "default"):
        raise NestlingError(
            f"vLLM {TESTED_VLLM[0]}'s CPU build computes plain rope wrongly for MLA targets (its CPU rotary kernel "
            f"takes the [tokens, heads, dim] query of MLA as one head per row; states differ from the second token "
            f"on, docs/capture-vllm.md). This {kind} target sets no rope scaling; released DeepSeek-V3 and Kimi "
            f"checkpoints use yarn, which vLLM computes exactly. Capture it on a GPU with vLLM, or {HF_HINT}."
        )


def attention_backend(config: dict, dtype: str, on_cpu: bool) -> str | None:
    """The attention backend to ask vLLM for, or None for its own choice. float32 MLA on a CPU needs
    CPU_MLA: vLLM picks AMX_MLA on CPUs with AMX tiles, which takes bf16 weights only (it fails at load)."""
    if on_cpu and dtype == "float32" and is_mla(config):
        return "CPU_MLA"
    return None


def engine_options(target: Path, dtype: str) -> dict:
    """`vllm.LLM` keyword arguments this target needs where eval and regenerate start vLLM; on a CPU,
    an MLA target the CPU build cannot compute is refused first. A folder without a readable config
    (a hub id) gets none: vLLM reports its own errors."""
    import json

    import torch

    try:
        config = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        check_cpu_target(config)
    backend = attention_backend(config, dtype, on_cpu)
    return {"attention_config": {"backend": backend}} if backend else {}


def eagle3_serving_limit(config: dict, dtype: str, on_cpu: bool, amx: bool) -> str | None:
    """Why vLLM cannot run an EAGLE-3 draft beside this target here, or None where it can.

    The CPU build's two MLA backends take KV blocks of other sizes than the draft's attention (CPU_ATTN,
    multiples of 32) only in one case: AMX_MLA (vLLM #52616) takes multiples of 32 but runs bf16 on CPUs
    with AMX tiles only; CPU_MLA (#49453), for float32 and every other CPU, takes blocks of 16 ("No common
    block size" at load). GPU builds have no such limit."""
    if not (on_cpu and is_mla(config)) or (dtype == "bfloat16" and amx):
        return None
    return (
        f"vLLM {TESTED_VLLM[0]}'s CPU build serves an EAGLE-3 draft beside an MLA target only in bfloat16 on a CPU "
        "with AMX tiles (AMX_MLA); its CPU_MLA backend (float32, CPUs without AMX) takes KV blocks of 16 and the "
        "draft's attention multiples of 32 (vLLM: 'No common block size')"
    )
