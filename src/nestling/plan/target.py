"""The target on the GPUs: each capture backend's memory per GPU and split, and which one the plan uses.

vllm holds the weights as stored and splits them tensor-parallel (plan/vllm.py), the GPUs left over
running data-parallel engines; hf holds them as transformers loads them (a compressed-tensors
checkpoint dequantized to bf16) over device_map or tensor parallel under torchrun.
"""

from __future__ import annotations

from nestling.errors import NestlingError
from nestling.plan import model as M
from nestling.plan import vllm as V
from nestling.plan.settings import PlanSettings

RUNTIME_BYTES = 2 * V.GIB  # the hf backend's CUDA context, allocator slack: per GPU, beside weights and batches
VLLM_SERVES = "vLLM's extract_hidden_states path serves this architecture"


def capture_work_bytes(cfg: dict, n_ids: int, token_budget: int) -> int:
    """The hf backend's working memory beside the weights: the batch's KV cache, its widest activations
    and the captured states, plus the runtime. Not divided by TP: an upper bound."""
    H = int(cfg["hidden_size"])
    mlp = max(
        int(cfg.get("intermediate_size") or 4 * H),
        int(cfg.get("num_experts_per_tok") or 0) * int(cfg.get("moe_intermediate_size") or 0),
    )
    act = (n_ids + 6) * H + 2 * mlp
    return token_budget * (M.kv_bytes_per_token(cfg) + 2 * act) + RUNTIME_BYTES


def vllm_refusal(cfg: dict) -> str | None:
    """Why nestling's vllm capture path refuses this target (None when it serves it)."""
    from nestling.capture.vllm import check_target

    try:
        check_target(cfg)
    except NestlingError as e:
        return str(e).split(";")[0]
    return None


def hf_tensor_parallel(cfg: dict, tp: int) -> str | None:
    """None when the hf backend can split this target `tp` ways under torchrun, else why not: the rule
    `nestling capture --tensor-parallel-size` applies (capture/tp.py: transformers' plan for the
    architecture, head counts, quantization), on the config's transformers class, no weights."""
    from transformers import AutoConfig

    from nestling.capture import tp as rule

    try:
        conf = AutoConfig.for_model(**cfg)
        rule.check_target(conf, tp)
    except NestlingError as e:
        return str(e)
    except (ValueError, KeyError, TypeError) as e:  # a model type this transformers does not know
        return f"transformers cannot read this config ({type(e).__name__}: {e})"
    return None


def _degrees(gpus: int) -> list[int]:
    """1, 2, 4, ... up to `gpus`, those that divide it."""
    out, tp = [], 1
    while tp <= gpus:
        if gpus % tp == 0:
            out.append(tp)
        tp *= 2
    return out


def hf_plan(cfg: dict, loaded: float, s: PlanSettings, usable: float, n_ids: int) -> dict:
    """hf: the weights as transformers holds them over 1, 2, 4, ... GPUs (one replica); the smallest that
    fits, then tensor parallel at the largest degree that fits and that transformers can split the
    target by (on one node, under torchrun: those GPUs all compute), else device_map (the layers spread,
    one GPU computing at a time)."""
    work = capture_work_bytes(cfg, n_ids, s.token_budget)
    options = [
        {"tp": tp, "dp": 1, "per_gpu_bytes": loaded / tp + work, "fits": loaded / tp + work <= usable}
        for tp in _degrees(s.gpus)
    ]
    fit = next((o for o in options if o["fits"]), None)
    split, tp_why = None, None
    if fit is not None and fit["tp"] > 1:
        split = "device_map"
        for o in sorted((o for o in options if o["fits"]), key=lambda o: -o["tp"]):
            why_not = hf_tensor_parallel(cfg, int(o["tp"]))
            if why_not is None:
                fit, split, tp_why = o, "tensor_parallel", None
                break
            tp_why = tp_why or why_not
    return {
        "backend": "hf",
        "work_bytes": work,
        "weight_bytes": loaded,
        "options": options,
        "tp": fit["tp"] if fit else None,
        "dp": 1 if fit else None,
        "token_budget": s.token_budget,
        "hf_split": split,
        "hf_tp_why_not": tp_why,
        # GPUs computing at once: hf's TP all work; its device_map runs the layers in turn
        "busy_gpus": (fit["tp"] if split == "tensor_parallel" else 1) if fit else 0,
    }


def vllm_plan(cfg: dict, s: PlanSettings, usable: float, n_ids: int) -> dict:
    """vllm: per-GPU memory at each TP degree (the other GPUs run data-parallel engines), each at the
    largest token_budget (the setting, halved down to seq_len) that fits; the smallest TP that fits."""
    options = []
    for tp in _degrees(s.gpus):
        for budget in V.budgets(s.token_budget, s.seq_len):
            parts = V.memory(cfg, tp, n_ids, budget)
            if sum(parts.values()) <= usable:
                break
        problem = V.tp_problem(cfg, tp)
        per_gpu = sum(parts.values())
        options.append(
            {
                "tp": tp,
                "dp": s.gpus // tp,
                "token_budget": budget,
                "per_gpu_bytes": per_gpu,
                "memory": parts,
                "fits": per_gpu <= usable and problem is None,
                "problem": problem,
                "experts": V.experts_note(cfg, tp),
            }
        )
    fit = next((o for o in options if o["fits"]), None)
    refused = vllm_refusal(cfg)
    return {
        "backend": "vllm",
        "refused": refused,
        "weight_bytes": sum(M.weight_bytes(cfg).values()),
        "options": options,
        "tp": fit["tp"] if fit else None,
        "dp": fit["dp"] if fit else None,
        "token_budget": fit["token_budget"] if fit else None,
        "memory": fit["memory"] if fit else None,
        "experts": fit["experts"] if fit else None,
        "busy_gpus": s.gpus if fit else 0,  # TP x DP: every GPU computes
    }


def target_plan(cfg: dict, loaded: float, s: PlanSettings, usable: float, n_ids: int) -> dict:
    """The backend the plan captures with, and a line on the other one.

    `backend=auto` takes the first that fits of: vllm where nestling's vllm path serves the target
    (every GPU computes, the weights stay packed), hf, and vllm where nestling's path still refuses the
    target (the recommendation then names the refusal). `backend=vllm|hf` prices that one alone."""
    hf = hf_plan(cfg, loaded, s, usable, n_ids)
    vllm = None if cfg.get("is_encoder_decoder") else vllm_plan(cfg, s, usable, n_ids)
    if s.backend == "vllm" and vllm is None:
        raise NestlingError("the vllm capture backend handles decoder-only targets; plan this one with backend=hf")
    if s.backend != "auto":
        chosen = vllm if s.backend == "vllm" else hf
        why = f"backend={s.backend} (the setting)"
    else:
        order = [p for p in (vllm, hf) if p and not p.get("refused")] + ([vllm] if vllm and vllm["refused"] else [])
        chosen = next((p for p in order if p["tp"] is not None), order[0])
        why = VLLM_SERVES if chosen is vllm and not vllm["refused"] else ""
    assert chosen is not None
    other = hf if chosen is vllm else vllm
    if not why:  # auto chose hf, or a refused vllm
        reasons = []
        if vllm and vllm["refused"]:
            reasons.append(vllm["refused"])
        if vllm and vllm["tp"] is None:
            reasons.append(f"vllm does not fit {s.gpus} GPUs even at TP {max(_degrees(s.gpus))}")
        if chosen is vllm:
            reasons.append(f"hf does not fit: {_size(hf['options'][-1]['per_gpu_bytes'])} per GPU over {s.gpus}")
        why = "; ".join(reasons) or "the vllm capture backend handles decoder-only targets, not this one"
    return {**chosen, "backend_why": why, "hf_work_bytes": hf["work_bytes"], "other": _summary(other, s)}


def _summary(p: dict | None, s: PlanSettings) -> dict | None:
    """The backend not chosen, in one line: what it holds and whether it fits."""
    if p is None:
        return None
    best = next((o for o in p["options"] if o["fits"]), p["options"][-1])
    return {
        "backend": p["backend"],
        "weight_bytes": p["weight_bytes"],
        "tp": best["tp"],
        "per_gpu_bytes": best["per_gpu_bytes"],
        "fits": p["tp"] is not None,
        "refused": p.get("refused"),
    }


def _size(n: float) -> str:
    from nestling.progress import format_bytes

    return format_bytes(int(n))
