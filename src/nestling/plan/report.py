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
    split = "TP" if tm["backend"] == "vllm" else "GPUs"
    held = tm.get("weight_bytes", t["weight_bytes"])
    dense = " dequantized to bf16 by transformers" if held != t["weight_bytes"] else ""
    lines += [
        "",
        f"target on GPUs (weights {_b(held)}{dense}; per GPU + {_b(tm['work_bytes'])} for a "
        f"forward's KV cache, activations and runtime)",
        f"  capture backend {tm['backend']}: {tm['backend_why']}",
        f"  {split:>4} {'DP':>3} {'per GPU':>12}  fits",
    ]
    for o in tm["options"]:
        lines.append(f"  {o['tp']:>4} {o['dp']:>3} {_b(o['per_gpu_bytes']):>12}  {_yes(o['fits'])}")
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
            lines.append(
                f"  {stage:<8} {x['tokens_per_s_per_gpu']:>10,.0f} tok/s per GPU x {n} -> "
                f"{format_duration(x['seconds']):>10}  (scaled from {x['measured']})"
            )
        else:
            lines.append(f"  {stage:<8} no {stage}_*.json result found there")
    if "capture" in tt and "train" in tt:
        lines.append(
            f"  {'offline':<8} capture + train {'':>29}-> "
            f"{format_duration(tt['capture']['seconds'] + tt['train']['seconds']):>10}; training reads the "
            + ", ".join(f"{k} store at {_b(v)}/s" for k, v in tt["train"]["store_read_per_s"].items())
        )
    if "online" in tt and any(mo["fits"] for mo in p["modes"] if mo["mode"] == "online"):
        lines.append(
            f"  {'online':<8} target + draft every step {'':>19}-> {format_duration(tt['online']['seconds']):>10}"
        )
    lines.append(
        "  (ideal: llama8b's measured utilisation; MoE and INT4 kernels usually reach less, so read "
        "these as lower bounds)"
    )
    lines += ["", "modes"]
    for mo in p["modes"]:
        lines.append(f"  [{'fits' if mo['fits'] else 'no':>4}] {mo['mode']}: {mo['why']}")
    lines += ["", f"recommended: {p['recommendation']}"]
    return "\n".join(lines)
