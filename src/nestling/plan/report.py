"""The plan as a table a person reads (the JSON form is `json.dumps(plan)`)."""

from __future__ import annotations

from nestling.progress import format_bytes, format_duration


def _b(n: float | None) -> str:
    return "-" if n is None else format_bytes(int(n))


def _yes(v: bool | None) -> str:
    return "?" if v is None else "yes" if v else "no"


def table(p: dict) -> str:
    t, d, m, dr, tm = p["target"], p["data"], p["machine"], p["draft"], p["target_memory"]
    moe = f"MoE in {t['moe_layers']} of {t['layers']} layers" if t["moe_layers"] else "dense"
    lines = [
        f"target      {t['path']} ({t['model_type']}, {t['layers']} layers, hidden {t['hidden_size']}, "
        f"vocab {t['vocab_size']:,}; {moe}{', MLA' if t['mla'] else ''})",
        f"parameters  {t['params_total'] / 1e9:,.1f}B total, {t['params_active'] / 1e9:,.1f}B active per token; "
        f"{t['flops_per_token'] / 1e9:,.1f} GFLOP per token forward",
        f"weights     {t['quantization']} ({t['bits_per_weight']:.2f} bits/weight where quantized): "
        f"{_b(t['weight_bytes'])}",
        f"data        {d['tokens']:,} tokens ({d['source']}), training {d['train_tokens']:,} x {d['epochs']:g} epoch(s)",
        f"machine     {m['gpus']} GPUs x {_b(m['gpu_memory_bytes'])} ({_b(m['usable_per_gpu_bytes'])} usable), "
        f"disk {_b(m['disk_bytes'])}, "
        + (f"{m['gpu_tflops']:g} TFLOP/s per GPU" if m["gpu_tflops"] else "GPUs as fast as the measured H200"),
        "",
        f"capture store (layers {','.join(map(str, p['layer_ids']))})",
        f"  {'dtype':<10} {'bytes/token':>12} {'total':>12}  fits disk",
    ]
    for name, st in p["store"].items():
        lines.append(f"  {name:<10} {st['bytes_per_token']:>12,} {_b(st['bytes']):>12}  {_yes(st['fits_disk'])}")
    lines += ["", *_target_lines(tm, t["weight_bytes"])]
    mem = dr["memory"]
    lines += [
        "",
        f"draft       {dr['trainable_params'] / 1e9:,.2f}B trainable params (hidden {dr['hidden_size']}, "
        f"MLP {dr['intermediate_size']}, draft vocab {dr['draft_vocab_size']:,})",
        f"  weights+grads+Adam {_b(mem['weights_grads_adam'])}, frozen embedding+teacher "
        f"{_b(mem['frozen_embedding_teacher'])}, activations {_b(mem['activations'])} = "
        f"{_b(dr['per_gpu_bytes'])} per GPU (FSDP: {_b(dr['per_gpu_bytes_fsdp'])}) -> "
        f"{dr['parallel'] or 'does not fit'}",
    ]
    tt = p["time"]
    lines += ["", f"time at measured rates ({tt['results']})"]
    for stage in ("capture", "train"):
        if stage in tt:
            x = tt[stage]
            n = x.get("busy_gpus", m["gpus"])
            moe = f", x{x['efficiency']:g} for a MoE" if x.get("efficiency", 1.0) != 1.0 else ""
            lines.append(
                f"  {stage:<8} {x['tokens_per_s_per_gpu']:>10,.0f} tok/s per GPU x {n} -> "
                f"{format_duration(x['seconds']):>10}  (scaled from {x['measured']}{moe})"
            )
        else:
            lines.append(f"  {stage:<8} no {stage}_*.json result found there")
    if "capture" in tt and "train" in tt:
        lines.append(
            f"  {'offline':<8} capture + train {'':>29}-> "
            f"{format_duration(tt['capture']['seconds'] + tt['train']['seconds']):>10}; training reads the "
            + ", ".join(f"{k} store at {_b(v)}/s" for k, v in tt["train"]["store_read_per_s"].items())
        )
        lines.append(
            f"  {'':<8} capture writes the "
            + ", ".join(f"{k} store at {_b(v)}/s" for k, v in tt["capture"]["store_write_per_s"].items())
        )
    if "online" in tt and any(mo["fits"] for mo in p["modes"] if mo["mode"] == "online"):
        lines.append(
            f"  {'online':<8} target + draft every step {'':>19}-> {format_duration(tt['online']['seconds']):>10}"
        )
    lines.append("  (llama8b's measured utilisation, a MoE's at moe_efficiency of it: docs/plan.md)")
    lines += ["", "modes"]
    for mo in p["modes"]:
        lines.append(f"  [{'fits' if mo['fits'] else 'no':>4}] {mo['mode']}: {mo['why']}")
    lines += ["", f"recommended: {p['recommendation']}", "", _vllm_line(p["vllm"])]
    return "\n".join(lines)


def _vllm_line(v: dict) -> str:
    """Whether the vLLM installed here serves an EAGLE-3 draft beside the target (run.vllm_serving)."""
    if not v["installed"]:
        return f"vLLM        not installed here: {v['eval']}"
    head = f"vLLM        {v['version']} installed here"
    if not v["checked"]:
        return f"{head}; not asked whether it serves an EAGLE-3 draft beside this target (vllm_check off)"
    if v["serves_eagle3"]:
        return f"{head} serves an EAGLE-3 draft beside this target: {v['eval']}"
    return f"{head} cannot serve an EAGLE-3 draft beside this target: {v['why']}; {v['eval']}"


def _target_lines(tm: dict, stored: float) -> list[str]:
    """The chosen capture backend: per-GPU memory at each TP degree, its parts, and the other backend."""
    if tm["backend"] == "vllm":
        out = [
            f"target on GPUs (weights as stored, {_b(tm['weight_bytes'])}, split over the TP ranks; per GPU + "
            f"the KV and hidden-state caches and activations of a token_budget batch, + the engine)",
            f"  capture backend vllm: {tm['backend_why']}",
            f"  {'TP':>4} {'DP':>3} {'budget':>7} {'per GPU':>12}  fits",
        ]
        for o in tm["options"]:
            note = f"  {o['problem']}" if o["problem"] else ""
            out.append(
                f"  {o['tp']:>4} {o['dp']:>3} {o['token_budget']:>7} {_b(o['per_gpu_bytes']):>12}  {_yes(o['fits'])}{note}"
            )
        if tm["memory"]:
            parts = ", ".join(f"{k.replace('_', ' ')} {_b(v)}" for k, v in tm["memory"].items())
            out.append(f"  at TP {tm['tp']}: {parts}")
        if tm["experts"]:
            out.append(f"  routed experts: {tm['experts']}")
    else:
        dense = " dequantized to bf16 by transformers" if tm["weight_bytes"] != stored else ""
        out = [
            f"target on GPUs (weights {_b(tm['weight_bytes'])}{dense}; per GPU + {_b(tm['work_bytes'])} for a "
            f"forward's KV cache, activations and runtime)",
            f"  capture backend hf: {tm['backend_why']}",
            f"  {'GPUs':>4} {'DP':>3} {'per GPU':>12}  fits",
        ]
        for o in tm["options"]:
            out.append(f"  {o['tp']:>4} {o['dp']:>3} {_b(o['per_gpu_bytes']):>12}  {_yes(o['fits'])}")
    other = tm.get("other")
    if other:
        verdict = "fits" if other["fits"] else "does not fit"
        refused = f" (and {other['refused']})" if other["refused"] else ""
        out.append(
            f"  the {other['backend']} backend: weights {_b(other['weight_bytes'])}, {_b(other['per_gpu_bytes'])} per "
            f"GPU over {other['tp']}: {verdict}{refused}"
        )
    return out
