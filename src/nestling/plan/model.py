"""What a target costs, from its config.json alone: parameters (total and active per token), FLOPs per
token, and weight bytes at the checkpoint's quantization.

Pure arithmetic over the config dict, so a 1T-parameter target is planned on a laptop before a byte
of it is downloaded. Covers dense Llama-style targets and DeepSeek-V3-style ones (MLA attention,
MoE with shared experts and leading dense layers: DeepSeek-V3, Kimi-K2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from nestling.errors import NestlingError

# Parameter groups, each named by a representative module path as transformers/vLLM spell it, so a
# quantization_config's `ignore` patterns can be matched against it.
GROUP_MODULES = {
    "attention": "model.layers.{i}.self_attn.o_proj",
    "dense_mlp": "model.layers.{i}.mlp.down_proj",
    "shared_experts": "model.layers.{i}.mlp.shared_experts.down_proj",
    "routed_experts": "model.layers.{i}.mlp.experts.0.down_proj",
    "router": None,  # a plain parameter (MoEGate), never a quantized Linear
    "embed_tokens": None,  # an Embedding, not a Linear: compressed-tensors and fp8 leave it in bf16
    "lm_head": "lm_head",
    "norms": None,
}


def read_config(path: str | Path) -> dict:
    """config.json of a model folder (or the file itself), as a dict; the text part of a multimodal one
    keeps the top level's quantization_config."""
    return read_configs(path)[1]


def read_configs(path: str | Path) -> tuple[dict, dict]:
    """config.json as the file holds it (vLLM names a multimodal wrapper's architecture at its top) and
    its checked text part (`read_config`), from one read."""
    from nestling.inputs import read_json, refuse_remote

    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        refuse_remote(path, "target", kind="target")  # a URL or hub id: say so, never fetch
        raise NestlingError(f"{path}: no config.json there; give a model folder or the path of its config.json")
    whole = read_json(f, "config", hint="give the model's own config.json")
    cfg = text_config(whole)
    check_config(cfg, f)
    return whole, cfg


def text_config(cfg: dict) -> dict:
    """The language model's config (Kimi-K2.5 and other multimodal wrappers nest it in text_config)."""
    text = cfg.get("text_config")
    if isinstance(text, dict):
        return {**text, "quantization_config": text.get("quantization_config") or cfg.get("quantization_config")}
    if text is not None:
        raise NestlingError(f"the config's text_config is a {type(text).__name__}, not a mapping of settings")
    return cfg


# The sizes every plan reads, and the ones it reads where present; each a whole number in [1, MAX_DIM]
# (0 where ZERO_OK), so a config of zeros, nulls, NaN or strings is named here, not met as a
# ZeroDivisionError or a plan that "fits" a model of no heads. MAX_DIM: 16M, past any real dimension.
REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
OPTIONAL = (
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "q_lora_rank",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_layer_freq",
    "n_shared_experts",
    "first_k_dense_replace",
)
ZERO_OK = ("n_shared_experts", "first_k_dense_replace", "n_routed_experts", "q_lora_rank")
MAX_DIM = 2**24
MAX_PARAMS = 10**15  # a thousand times the largest model released: a config past it is wrong


def check_config(cfg: dict, where: str | Path) -> None:
    """Every size the plan reads is a whole number in range, and the heads divide as attention needs."""
    for key in REQUIRED + OPTIONAL:
        v = cfg.get(key)
        if v is None:
            if key in REQUIRED:
                raise NestlingError(f"{where} has no {key}; nestling plan needs it to count parameters")
            continue
        low = 0 if key in ZERO_OK else 1
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and float(v).is_integer()
        if not ok or not low <= v <= MAX_DIM:
            raise NestlingError(
                f"{where}: {key} is {v!r}; it must be a whole number from {low} to {MAX_DIM:,}: check the config"
            )
        cfg[key] = int(v)
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv:
        raise NestlingError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}: check the config"
        )
    if not cfg.get("head_dim") and cfg["hidden_size"] < heads:
        raise NestlingError(
            f"{where}: hidden_size {cfg['hidden_size']} is smaller than num_attention_heads {heads} (no head_dim "
            "given): check the config"
        )


def _need(cfg: dict, *keys: str) -> list[int]:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise NestlingError(
            f"the target's config.json has no {', '.join(missing)}; nestling plan needs them to count parameters"
        )
    return [int(cfg[k]) for k in keys]


def is_mla(cfg: dict) -> bool:
    return cfg.get("kv_lora_rank") is not None


def n_moe_layers(cfg: dict) -> int:
    """Layers whose MLP is a mixture of experts (DeepSeek: all but the first `first_k_dense_replace`)."""
    if not cfg.get("n_routed_experts"):
        return 0
    L = int(cfg["num_hidden_layers"])
    freq = int(cfg.get("moe_layer_freq") or 1)
    first = int(cfg.get("first_k_dense_replace") or 0)
    return sum(1 for i in range(first, L) if (i - first) % freq == 0)


def attention_params(cfg: dict) -> int:
    """One layer's attention projections: MLA's low-rank q/kv factors, or plain q/k/v/o."""
    H, heads = _need(cfg, "hidden_size", "num_attention_heads")
    if is_mla(cfg):
        kv_lora, rope, nope, v = _need(cfg, "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        qk = rope + nope
        q_lora = cfg.get("q_lora_rank")
        q = H * q_lora + q_lora * heads * qk if q_lora else H * heads * qk
        kv = H * (kv_lora + rope) + kv_lora * heads * (nope + v)
        return q + kv + heads * v * H
    hd = int(cfg.get("head_dim") or H // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return H * heads * hd * 2 + H * kv_heads * hd * 2


@dataclass
class ParamCount:
    """Parameters by group: `total` as stored, `active` as one token meets them (top-k experts only)."""

    total: dict[str, int]
    active: dict[str, int]

    @property
    def n_total(self) -> int:
        return sum(self.total.values())

    @property
    def n_active(self) -> int:
        return sum(self.active.values())

    @property
    def decoder_active(self) -> int:
        """Matmul parameters one token's forward uses below the head (what capture runs)."""
        return sum(v for k, v in self.active.items() if k not in ("embed_tokens", "lm_head", "norms"))


def count_params(cfg: dict) -> ParamCount:
    H, L, V = _need(cfg, "hidden_size", "num_hidden_layers", "vocab_size")
    n_moe = n_moe_layers(cfg)
    n_dense = L - n_moe
    inter = int(cfg.get("intermediate_size") or 4 * H)
    total = {
        "attention": L * attention_params(cfg),
        "dense_mlp": n_dense * 3 * H * inter,
        "embed_tokens": V * H,
        "lm_head": 0 if cfg.get("tie_word_embeddings") else V * H,
        "norms": (2 * L + 1) * H,
    }
    active = dict(total)
    if n_moe:
        E, k = _need(cfg, "n_routed_experts", "num_experts_per_tok")
        moe_inter = int(cfg.get("moe_intermediate_size") or inter)
        shared = int(cfg.get("n_shared_experts") or 0)
        expert = 3 * H * moe_inter
        total |= {
            "routed_experts": n_moe * E * expert,
            "shared_experts": n_moe * shared * expert,
            "router": n_moe * E * H,
        }
        active |= {
            "routed_experts": n_moe * k * expert,
            "shared_experts": n_moe * shared * expert,
            "router": n_moe * E * H,
        }
    if is_mla(cfg):  # the q and kv low-rank norms
        extra = L * (int(cfg["kv_lora_rank"]) + int(cfg.get("q_lora_rank") or 0))
        total["norms"] += extra
        active["norms"] += extra
    return ParamCount(total, active)


def flops_per_token(cfg: dict, seq_len: int) -> float:
    """Forward FLOPs of one token of the decoder (no head: capture stops at the final norm): 2 per active
    matmul parameter plus causal attention over an average context of seq_len / 2."""
    H, L, heads = _need(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads")
    if is_mla(cfg):
        qk = int(cfg["qk_rope_head_dim"]) + int(cfg["qk_nope_head_dim"])
        v = int(cfg["v_head_dim"])
    else:
        qk = v = int(cfg.get("head_dim") or H // heads)
    attn = 2 * L * heads * (qk + v) * seq_len / 2
    return 2.0 * count_params(cfg).decoder_active + attn


# ---- quantization -------------------------------------------------------------------------------------


@dataclass
class Quant:
    """Bits per weight (scales included) of the quantized Linear layers.

    `schemes` pairs each compressed-tensors config group's `targets` with its bits ("Linear" names
    every Linear layer, "re:" a regular expression over module names); `ignore` patterns stay bf16.
    `bits` and `group_size` are the first scheme's, for the report and vLLM's split rules."""

    name: str
    bits: float
    ignore: list[str]
    schemes: list[tuple[list[str], float]] = field(default_factory=list)
    group_size: int | None = None

    def bits_of(self, module: str | None) -> float:
        """Bits per weight `module` is stored at (16 where no scheme targets it, or it is ignored)."""
        if module is None or any(_matches(pat, module) for pat in self.ignore):
            return 16.0
        for targets, bits in self.schemes:
            if any(t == "Linear" or _matches(t, module) for t in targets):
                return bits
        return 16.0


def _matches(pattern: str, module: str) -> bool:
    return bool(re.match(pattern[3:], module)) if pattern.startswith("re:") else pattern == module


def quantization(cfg: dict) -> Quant:
    """Read quantization_config: compressed-tensors (W4A16 pack-quantized, W8A8, ...), fp8 blocks, or none."""
    q = cfg.get("quantization_config") or {}
    method = q.get("quant_method")
    if not method:
        return Quant("bf16", 16.0, [])
    if method == "fp8":
        block = q.get("weight_block_size") or [128, 128]
        bits = 8 + 32 / (block[0] * block[1])
        return Quant(
            "fp8 (block scales)", bits, list(q.get("ignored_layers") or ["lm_head"]), [(["Linear"], bits)], block[1]
        )
    if method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        if not groups:
            raise NestlingError("the target's compressed-tensors quantization_config has no config_groups")
        schemes = []
        for g in groups:
            w = g.get("weights") or {}
            bits = int(w.get("num_bits") or 16)
            gs = w.get("group_size") if w.get("strategy") == "group" else None
            scale = 16 / gs if gs else 0.0  # one bf16 scale per group
            zero = scale if w.get("symmetric") is False else 0.0
            schemes.append((list(g.get("targets") or ["Linear"]), bits + scale + zero))
        w = groups[0].get("weights") or {}
        gs = w.get("group_size") if w.get("strategy") == "group" else None
        fmt = q.get("format") or "compressed-tensors"
        name = f"W{int(w.get('num_bits') or 16)}A16 {fmt}" + (f" g{gs}" if gs else "")
        return Quant(name, schemes[0][1], list(q.get("ignore") or []), schemes, gs)
    raise NestlingError(
        f"nestling plan does not know quant_method {method!r}; it reads compressed-tensors, "
        f"fp8 and unquantized (bf16) checkpoints"
    )


def weight_bytes(cfg: dict, params: ParamCount | None = None) -> dict[str, float]:
    """Bytes of each parameter group at the checkpoint's quantization (bf16 where not quantized)."""
    params = params or count_params(cfg)
    q = quantization(cfg)
    first_moe = int(cfg.get("first_k_dense_replace") or 0)
    out = {}
    for group, n in params.total.items():
        module = GROUP_MODULES.get(group)
        if module:
            module = module.format(i=first_moe if "experts" in group else 0)
        out[group] = n * q.bits_of(module) / 8
    return out


def loaded_weight_bytes(cfg: dict, params: ParamCount | None = None) -> float:
    """Bytes the target's weights take once transformers loads it (the hf capture backend, online
    training): `targets.load.load_model` dequantizes a compressed-tensors checkpoint (transformers has no
    packed-int4 kernel, and merges MoE experts dequantized), so every parameter is bf16 there; other
    checkpoints as stored."""
    params = params or count_params(cfg)
    if (cfg.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
        return params.n_total * 2
    return sum(weight_bytes(cfg, params).values())


def kv_bytes_per_token(cfg: dict) -> int:
    """bf16 KV cache of one token over all layers (MLA caches the compressed kv and the rope key)."""
    L, H, heads = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if is_mla(cfg):
        return L * (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * 2
    hd = int(cfg.get("head_dim") or H // heads)
    return L * 2 * int(cfg.get("num_key_value_heads") or heads) * hd * 2
