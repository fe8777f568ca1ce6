"""The vllm capture backend's memory on each GPU, from config.json alone (docs/plan.md).

vLLM holds the weights as the checkpoint stores them (INT4 experts packed with their scales, fp8
blocks as fp8) and splits them over the tensor-parallel ranks, except what its model code keeps whole
on every rank: MLA's down-projections (`fused_qkv_a_proj`, a ReplicatedLinear), the MoE router and
the norms. MLA also keeps, beside kv_b_proj, the W_UK / W_UV copies it derives from it at load (bf16).
Routed experts are split over the ranks either way: sliced (TP) or whole (`enable_expert_parallel`,
E / TP experts per GPU), the same bytes.

Per token of a capture batch (`token_budget` tokens in one forward) each GPU holds the KV cache (MLA:
the kv_lora_rank + qk_rope_head_dim latent, the same on every rank; GQA: its share of the kv heads),
the hidden-state cache extract_hidden_states writes (one bf16 row of `hidden` per captured layer), and
the forward's activations, of which the fused-MoE workspaces are the largest: two buffers of
M x top-k x max(hidden, 2 x moe_intermediate / TP) values (`marlin_moe.py: workspace_shapes`, not
chunked in vLLM 0.32). Beside all that, ENGINE_BYTES.
"""

from __future__ import annotations

from nestling.plan import model as M

GIB = 2**30
# Per GPU, beside weights and batches: the CUDA context and cuBLAS workspaces (~1 GiB), NCCL and
# vLLM's custom all-reduce buffers at TP 8 (~1 GiB), and CUDA graphs (~2 GiB: vLLM 0.32 profiles
# their memory and counts it inside gpu_memory_utilization). Not measured on a GPU: an allowance.
ENGINE_BYTES = 4 * GIB


def weights_per_gpu(cfg: dict, tp: int) -> dict[str, float]:
    """Bytes of each parameter group on one of `tp` ranks, at the stored quantization."""
    params = M.count_params(cfg)
    stored = M.weight_bytes(cfg, params)
    out = {group: b / tp for group, b in stored.items()}
    for whole in ("router", "norms"):
        if whole in stored:
            out[whole] = stored[whole]
    if M.is_mla(cfg):
        L, H, heads = (int(cfg[k]) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads"))
        per_param = stored["attention"] / params.total["attention"]
        down = L * H * (int(cfg.get("q_lora_rank") or 0) + int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"]))
        out["attention"] = down * per_param + (stored["attention"] - down * per_param) / tp
        kv_b = L * int(cfg["kv_lora_rank"]) * heads * (int(cfg["qk_nope_head_dim"]) + int(cfg["v_head_dim"]))
        out["mla_absorbed"] = 2 * kv_b / tp
    return out


def per_token_bytes(cfg: dict, tp: int, n_ids: int) -> dict[str, int]:
    """Bytes one token of the capture batch costs each GPU: KV cache, hidden-state cache, activations."""
    H = int(cfg["hidden_size"])
    if M.is_mla(cfg):
        kv = M.kv_bytes_per_token(cfg)  # the latent is not split over ranks
    else:
        heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        kv = M.kv_bytes_per_token(cfg) * max(1, heads // tp) // heads
    widest = 3 * int(cfg.get("intermediate_size") or 4 * H) // tp  # a dense MLP: gate_up and its product
    if M.n_moe_layers(cfg):
        k, inter, E = int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]), int(cfg["n_routed_experts"])
        moe = k * (max(H, inter // tp) + max(H, 2 * inter // tp)) + 2 * E  # two workspaces + fp32 router logits
        widest = max(widest, moe)
    # the residual stream (hidden, residual, normed, attention out) and the captured layers' rows
    act = 2 * (4 * H + n_ids * H + widest)
    return {"kv_cache": kv, "hidden_state_cache": 2 * n_ids * H, "activations": act}


def _experts_split(cfg: dict, tp: int) -> tuple[bool, bool]:
    """(each expert slices `tp` ways within the quantization groups, whole experts divide over `tp`)."""
    E, inter = int(cfg["n_routed_experts"]), int(cfg["moe_intermediate_size"])
    group = M.quantization(cfg).group_size
    return inter % tp == 0 and (not group or (inter // tp) % group == 0), E % tp == 0


def tp_problem(cfg: dict, tp: int) -> str | None:
    """Why vLLM cannot split the target `tp` ways (None when it can)."""
    heads = int(cfg["num_attention_heads"])
    if heads % tp:
        return f"{heads} attention heads do not split over {tp} ranks"
    if M.n_moe_layers(cfg) and not any(_experts_split(cfg, tp)):
        return f"neither the {cfg['n_routed_experts']} experts nor their intermediate size split over {tp} ranks"
    return None


def experts_note(cfg: dict, tp: int) -> str | None:
    """How the routed experts sit on the ranks; None for a dense target or TP 1."""
    if not M.n_moe_layers(cfg) or tp == 1:
        return None
    sliced, whole = _experts_split(cfg, tp)
    E = int(cfg["n_routed_experts"])
    ep = f"enable_expert_parallel: {E // tp} of {E} experts per GPU"
    if sliced:
        return f"sliced {tp} ways" + (f" (or {ep}, the same memory)" if whole else "")
    return f"needs {ep} (an expert's intermediate size / {tp} is not a multiple of the quantization group)"


def memory(cfg: dict, tp: int, n_ids: int, tokens: int) -> dict[str, float]:
    """Bytes on each of `tp` ranks capturing batches of `tokens` tokens, by part."""
    per_token = per_token_bytes(cfg, tp, n_ids)
    return {
        "weights": sum(weights_per_gpu(cfg, tp).values()),
        **{part: tokens * b for part, b in per_token.items()},
        "engine": ENGINE_BYTES,
    }


def budgets(token_budget: int, floor: int) -> list[int]:
    """`token_budget`, halved while it stays at least `floor` (a batch must hold one whole sample)."""
    out = [token_budget]
    while out[-1] // 2 >= floor:
        out.append(out[-1] // 2)
    return out
