"""`nestling plan`: disk, GPU memory and time of a draft for a target, from config.json alone.

It reads the target's config.json (never its weights), the data size, the machine (GPUs, memory per
GPU, disk) and the speeds nestling has measured, and answers: how big the capture store is (bf16 and
float8), how much GPU memory the target takes at its quantization for each tensor-parallel degree,
how much the draft's training takes, how long capture and training would run, and which mode fits.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from nestling.capture.settings import parse_size
from nestling.capture.store import bytes_per_token
from nestling.errors import NestlingError
from nestling.plan import model as M
from nestling.plan.rates import capture_rate, default_results_dir, train_rate
from nestling.plan.settings import PlanSettings
from nestling.plan.target import target_plan
from nestling.targets.layers import default_capture_layers, validate_layer_ids

STORE_DTYPES = {"bfloat16": torch.bfloat16, "float8": torch.float8_e4m3fn}


def data_tokens(s: PlanSettings) -> tuple[int, int, str]:
    """(tokens to capture, tokens trained per epoch, where the count came from)."""
    if s.tokens is not None:
        return s.tokens, s.tokens, "--tokens"
    if not s.data:
        raise NestlingError("give the data size: --tokens N, or --data DATA_DIR (a `nestling data` folder)")
    path = Path(s.data) / "manifest.json"
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        raise NestlingError(
            f"{s.data} is no finished `nestling data` folder ({path} is missing or unreadable); pass --tokens N instead"
        ) from None
    splits = m.get("splits") or {}
    if m.get("stage") != "data" or "train" not in splits:
        raise NestlingError(
            f"{s.data} was written by `nestling {m.get('stage')}`, not `nestling data`; "
            f"pass a data folder or --tokens N"
        )
    total = sum(int(v.get("tokens", 0)) for v in splits.values())
    return total, int(splits["train"]["tokens"]), f"{s.data} (manifest)"


def store_plan(n_ids: int, hidden: int, tokens: int, disk: int | None) -> dict:
    """Bytes per token and the whole store in each stored dtype, and whether the disk holds it."""
    out = {}
    for name, dtype in STORE_DTYPES.items():
        bpt = bytes_per_token(n_ids, hidden, dtype)
        out[name] = {
            "bytes_per_token": bpt,
            "bytes": bpt * tokens,
            "fits_disk": None if disk is None else bpt * tokens <= disk,
        }
    return out


def draft_plan(cfg: dict, layer_ids: list[int], s: PlanSettings, usable: float) -> dict:
    """The draft's trainable parameters and training memory per GPU; DDP when it fits, else FSDP."""
    from nestling.draft.model import DraftConfig
    from nestling.draft.vocab import AUTO_MIN
    from nestling.train.features import draft_memory

    c = DraftConfig.from_target(
        SimpleNamespace(**cfg),
        min(s.draft_vocab_size or AUTO_MIN, int(cfg["vocab_size"])),  # auto: priced at its floor
        layer_ids[:-1],
        num_hidden_layers=s.draft_layers,
    )
    if s.intermediate_size:
        c.intermediate_size = s.intermediate_size
    n = c.trainable_params()
    parts = draft_memory(
        n,
        c.hidden_size,
        c.vocab_size,
        c.intermediate_size,
        len(layer_ids) - 1,
        c.draft_vocab_size,
        s.ttt_steps,
        s.batch_tokens,
    )
    ddp = sum(parts.values())
    fsdp = ddp - parts["weights_grads_adam"] * (1 - 1 / s.gpus)
    parallel = "ddp" if ddp <= usable else "fsdp" if fsdp <= usable else None
    return {
        "trainable_params": n,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "draft_vocab_size": c.draft_vocab_size,
        "memory": parts,
        "per_gpu_bytes": ddp,
        "per_gpu_bytes_fsdp": fsdp,
        "parallel": parallel,
    }


def time_plan(
    cfg: dict, draft_params: int, tokens: int, train_tokens: int, s: PlanSettings, store: dict, busy_gpus: int
) -> dict:
    """Seconds for capture and for training at the measured rates, all GPUs busy; a MoE target captures
    at `moe_efficiency` of the dense rate its active FLOPs would give (docs/plan.md)."""
    results = Path(s.results) if s.results else default_results_dir()
    cap, tr = capture_rate(results), train_rate(results, s.ttt_steps)
    flops = M.flops_per_token(cfg, s.seq_len)
    out: dict = {"results": str(results), "target_flops_per_token": flops}
    if cap:
        efficiency = s.moe_efficiency if M.n_moe_layers(cfg) else 1.0
        r = cap.scaled(flops, s.gpu_tflops) * efficiency
        out["capture"] = {
            "tokens_per_s_per_gpu": r,
            "busy_gpus": busy_gpus,
            "efficiency": efficiency,
            "measured": cap.source,
            "seconds": tokens / (r * busy_gpus) if busy_gpus else float("inf"),
            "store_write_per_s": {k: v["bytes_per_token"] * r * busy_gpus for k, v in store.items()},
        }
    if tr:
        r = tr.scaled(draft_params, s.ttt_steps, s.gpu_tflops)
        out["train"] = {
            "tokens_per_s_per_gpu": r,
            "seconds": s.epochs * train_tokens / (r * s.gpus),
            "measured": tr.source,
            "store_read_per_s": {k: v["bytes_per_token"] * r * s.gpus for k, v in store.items()},
        }
    if cap and tr:  # online: every epoch runs the target again, on the training GPUs
        per_tok = 1 / out["capture"]["tokens_per_s_per_gpu"] + 1 / out["train"]["tokens_per_s_per_gpu"]
        out["online"] = {"seconds": s.epochs * train_tokens * per_tok / s.gpus}
    return out


def capture_command(target: dict, s: PlanSettings) -> str:
    """The capture settings the plan priced, as `nestling capture` takes them, and how the GPUs work."""
    if target["backend"] == "vllm":
        cap = f"capture backend=vllm tensor_parallel_size={target['tp']} data_parallel_size={target['dp']}"
        if target["token_budget"] != s.token_budget:
            cap += f" token_budget={target['token_budget']}"
        if (target["experts"] or "").startswith("needs"):
            cap += " enable_expert_parallel=true"
        if target["refused"]:
            cap += f" [not runnable yet: {target['refused']}]"
        return cap
    return {
        "tensor_parallel": f"capture backend=hf tensor_parallel_size={target['tp']} under torchrun "
        f"(all {target['tp']} GPUs computing)",
        "device_map": f"capture backend=hf device_map=auto (weights over {target['tp']} GPU(s), computing "
        f"one at a time: {str(target['hf_tp_why_not']).split(':')[0]})",
    }.get(target["hf_split"] or "", "capture backend=hf on one GPU")


def modes(store: dict, target: dict, draft: dict, online_per_gpu: float, usable: float, s: PlanSettings) -> list[dict]:
    """Each way to train, whether it fits this machine and why."""
    out = []
    for name in STORE_DTYPES:
        why = []
        if target["tp"] is None:
            last = target["options"][-1]
            why.append(
                f"the target does not fit on {s.gpus} GPUs even at TP {last['tp']} "
                f"({_size(last['per_gpu_bytes'])} per GPU with the {target['backend']} backend)"
            )
        if store[name]["fits_disk"] is False:
            why.append(f"the {name} store needs {_size(store[name]['bytes'])} of disk, more than {s.disk}")
        if draft["parallel"] is None:
            why.append("the draft's training does not fit on a GPU even with FSDP")
        cap = capture_command(target, s)
        how = f"{cap}, dtype={name}; train {draft['parallel']} on {s.gpus} GPUs" if not why else ""
        out.append({"mode": f"offline, {name} store", "fits": not why, "why": "; ".join(why) or how})
    fits = online_per_gpu <= usable
    out.append(
        {
            "mode": "online",
            "fits": fits,
            "why": (
                f"the whole target and the draft fit on each GPU ({_size(online_per_gpu)} of {_size(usable)})"
                if fits
                else f"online training holds the whole target on every training GPU (no tensor parallelism): "
                f"{_size(online_per_gpu)} per GPU, {_size(usable)} usable"
            ),
        }
    )
    return out


def recommend(modes_: list[dict], s: PlanSettings) -> str:
    """Online when it fits (no store to write), else the widest store that fits the disk."""
    by = {m["mode"]: m for m in modes_}
    if by["online"]["fits"]:
        return "online: " + by["online"]["why"]
    for m in modes_:
        if m["fits"]:
            return f"{m['mode']}: {m['why']}"
    return (
        "nothing fits this machine as described: "
        + by["offline, float8 store"]["why"]
        + ". Use more or larger GPUs, more disk or fewer tokens."
    )


def vllm_serving(config: dict, check: bool = True) -> dict:
    """Whether the vLLM installed here can serve an EAGLE-3 draft beside this target, why not, and what
    eval then does: eval learns it only when it starts vLLM, so plan says it first. The rules are eval's
    own (`vllm_worker.eagle3_unsupported`: vLLM's model registry; `targets/vllm_rules.py`: the CPU
    build's MLA and quantized-expert limits), at the dtype eval picks here. `config` is the whole config.json (a multimodal
    wrapper names its architecture at the top). vLLM is imported only where it is installed and `check`
    is on: the import takes seconds."""
    from nestling.engines import vllm_installed
    from nestling.evaluate.settings import EvalSettings, choose

    out: dict = dict(installed=vllm_installed(), version=None, checked=False, dtype=None, serves_eagle3=None, why=None)
    if not out["installed"]:
        return {**out, "eval": "eval measures with nestling's reference decoder (engine auto; docs/eval.md)"}
    from nestling.vllm_compat import installed_version

    out.update(version=installed_version(), checked=check, eval="eval measures in vLLM (engine auto)")
    if not check:
        return out
    from nestling.evaluate.vllm_worker import eagle3_unsupported
    from nestling.targets.vllm_rules import cpu_target_problem, eagle3_serving_limit, has_amx

    cuda = torch.cuda.is_available()
    dtype = choose(EvalSettings(), True, cuda)[0].dtype
    why = eagle3_unsupported(config) or eagle3_serving_limit(config, dtype, not cuda, has_amx())
    then = f"eval falls back to nestling's reference decoder ({dtype}; docs/eval.md)"
    problem = cpu_target_problem(config) if why is None and not cuda else None
    if problem:  # eval refuses these where it starts vLLM (engine_options), it does not fall back
        why = problem[0]
        then = "eval stops there: run it with engine=reference (nestling's reference decoder; docs/eval.md)"
    out.update(dtype=dtype, serves_eagle3=why is None, why=why)
    if why:
        out["eval"] = then
    return out


def plan(target: str | Path, settings: PlanSettings | None = None) -> dict:
    """The cost plan of training a draft for `target` (a model folder or its config.json)."""
    s = settings or PlanSettings()
    whole, cfg = M.read_configs(target)  # cfg: the text part of a multimodal wrapper
    L, H, V = (int(cfg[k]) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    layer_ids = validate_layer_ids(list(s.layers) if s.layers else default_capture_layers(L), L)
    tokens, train_tokens, source = data_tokens(s)
    gpu_mem = parse_size(s.gpu_memory)
    usable = s.memory_utilization * gpu_mem
    disk = parse_size(s.disk) if s.disk else None

    params = M.count_params(cfg)
    if params.n_total > M.MAX_PARAMS:
        raise NestlingError(
            f"{target}: its config describes {params.n_total:.3g} parameters, more than any model ({M.MAX_PARAMS:.0e}): "
            "check the config's sizes"
        )
    quant = M.quantization(cfg)
    weights = sum(M.weight_bytes(cfg, params).values())
    loaded = M.loaded_weight_bytes(cfg, params)  # the hf backend and online training: compressed-tensors dequantized
    store = store_plan(len(layer_ids), H, tokens, disk)
    target_mem = target_plan(cfg, loaded, s, usable, len(layer_ids))
    draft = draft_plan(cfg, layer_ids, s, usable)
    online_per_gpu = loaded + target_mem["hf_work_bytes"] + draft["per_gpu_bytes"]
    ms = modes(store, target_mem, draft, online_per_gpu, usable, s)
    return {
        "target": {
            "path": str(target),
            "model_type": cfg.get("model_type"),
            "layers": L,
            "hidden_size": H,
            "vocab_size": V,
            "moe_layers": M.n_moe_layers(cfg),
            "mla": M.is_mla(cfg),
            "params_total": params.n_total,
            "params_active": params.n_active,
            "flops_per_token": M.flops_per_token(cfg, s.seq_len),
            "quantization": quant.name,
            "bits_per_weight": quant.bits,
            "weight_bytes": weights,
        },
        "data": {"tokens": tokens, "train_tokens": train_tokens, "source": source, "epochs": s.epochs},
        "machine": {
            "gpus": s.gpus,
            "gpu_memory_bytes": gpu_mem,
            "usable_per_gpu_bytes": usable,
            "disk_bytes": disk,
            "gpu_tflops": s.gpu_tflops,
        },
        "layer_ids": layer_ids,
        "store": store,
        "target_memory": target_mem,
        "draft": draft,
        "time": time_plan(cfg, draft["trainable_params"], tokens, train_tokens, s, store, target_mem["busy_gpus"]),
        "online_per_gpu_bytes": online_per_gpu,
        "modes": ms,
        "recommendation": recommend(ms, s),
        "vllm": vllm_serving(whole, s.vllm_check),
    }


def _size(n: float) -> str:
    from nestling.progress import format_bytes

    return format_bytes(int(n))
