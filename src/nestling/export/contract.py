"""The export contract: the one place that lists what an exported draft folder holds.

Engines load the folder untouched, so every name, shape and dtype here is what vLLM's
`llama_eagle3.py` and SGLang's `llama_eagle3.py` read. Both the writer (`run.py`) and the
checker after writing use these functions; so do the tests that stand in for SGLang.

Layer ids. The config carries the aux ids in both engines' spellings: vLLM's top-level
`eagle_aux_hidden_state_layer_ids` (nestling's ids) and SGLang's
`eagle_config.eagle_aux_hidden_state_layer_ids` (one lower); the translation table is
`nestling.targets.layers` (`vllm_layer_ids`, `sglang_layer_ids`).

Vocabulary map. vLLM 0.32 (`Eagle3LlamaForCausalLM.__init__`) creates `draft_id_to_target_id` (what
`d2t` loads into) only when `draft_vocab_size` differs from the target's vocabulary; with equal sizes
the draft's logits *are* target logits, row i = token i, and a `d2t` in the file fails the load
("no parameter draft_id_to_target_id"). So a full-vocabulary draft is written without `d2t`/`t2d`,
its `lm_head` rows in target-id order (`engine_tensors`). SGLang needs nothing either: without `d2t`
it sets no `hot_token_id` and reads draft ids as target ids; `t2d` it ignores anyway.

Draft depth. vLLM 0.32 builds `num_hidden_layers` decoder layers (`llama_eagle3.py`, `LlamaModel`):
layer 0 reads concat(input_layernorm(embed), hidden_norm(g)), 2H wide; layers 1..N-1 are plain
pre-norm Llama layers of width H; its loader maps `midlayer.` to `layers.0.` and loads `layers.N.*`
as they are. A 1-layer draft keeps the historical `midlayer.*` names (what every EAGLE-3 engine
reads); a deeper one is written as `layers.0.*` ... `layers.N-1.*`, vLLM's own names
(`layer_names_for_engine`). SGLang cannot serve it equivalently (docs/export.md).

Draft norms. `fc_norm`, `norm_output` and `norm_before_residual` (model.NORM_OPTIONS) are written as
config.json keys of those names, always, True or False. vLLM 0.32 reads them (`llama_eagle3.py`;
in the speculators layout `update_eagle3` copies them from the top level), and loads fc_norm's
weights `fc_norm.{i}.weight` as `model.fc_norm.{i}` (its loader prefixes `model.`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from nestling.draft.model import NORM_OPTIONS, DraftConfig, full_attention_rope
from nestling.errors import NestlingError
from nestling.targets.layers import sglang_layer_ids, vllm_layer_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def full_vocab(c: DraftConfig) -> bool:
    """The draft predicts over the whole target vocabulary: the folder holds no d2t / t2d."""
    return c.draft_vocab_size == c.vocab_size


LAYER0 = "midlayer."  # nestling's name of layer 0, and the folder's when the draft has one layer


def layer_prefix(c: DraftConfig, i: int) -> str:
    """Prefix of layer i's tensors in an exported folder."""
    return LAYER0 if i == 0 and c.num_hidden_layers == 1 else f"layers.{i}."


def layer_names_for_engine(tensors: dict[str, torch.Tensor], c: DraftConfig) -> dict[str, torch.Tensor]:
    """nestling names -> the folder's: layer 0 becomes `layers.0.` when the draft has more layers."""
    new = layer_prefix(c, 0)
    return {(new + k[len(LAYER0) :] if k.startswith(LAYER0) else k): v for k, v in tensors.items()}


def layer_names_for_nestling(tensors: dict[str, torch.Tensor], c: DraftConfig) -> dict[str, torch.Tensor]:
    """The folder's names -> nestling's (the inverse of `layer_names_for_engine`)."""
    old = layer_prefix(c, 0)
    return {(LAYER0 + k[len(old) :] if k.startswith(old) else k): v for k, v in tensors.items()}


def engine_tensors(tensors: dict[str, torch.Tensor], c: DraftConfig) -> dict[str, torch.Tensor]:
    """Trained tensors (always with d2t / t2d) -> the tensors an engine loads.

    Layer 0 is renamed for a deeper draft (`layer_names_for_engine`). A reduced vocabulary keeps its map. A full one drops it, after putting `lm_head` row i at target
    id `i + d2t[i]` (a pure reordering, so the draft computes the same function); nestling's own
    vocabularies are in ascending target order already (`draft/vocab.py`), making this the identity.
    """
    tensors = layer_names_for_engine(tensors, c)
    if not full_vocab(c):
        return tensors
    out = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    d2t = tensors.get("d2t")
    if d2t is None:  # without it the order of the head rows is unknown
        raise NestlingError(
            "the trained draft has no d2t (vocab.safetensors): its lm_head rows cannot be put "
            "in target order; export the folder `nestling train` wrote"
        )
    if "lm_head.weight" not in tensors:
        return out  # check_tensors names what is missing
    ids = torch.arange(d2t.numel()) + d2t
    if d2t.numel() != c.vocab_size or not torch.equal(torch.sort(ids).values, torch.arange(c.vocab_size)):
        raise NestlingError(
            f"the draft vocabulary covers all {c.vocab_size} target tokens, but d2t is not a "
            f"permutation of them (some token appears twice or is out of range); rebuild the "
            f"vocabulary (`nestling train` writes vocab.safetensors)"
        )
    head = tensors["lm_head.weight"]
    if not torch.equal(ids, torch.arange(c.vocab_size)):
        reordered = torch.empty_like(head)
        reordered[ids] = head
        head = reordered
    out["lm_head.weight"] = head
    return out


def nestling_tensors(tensors: dict[str, torch.Tensor], c: DraftConfig) -> dict[str, torch.Tensor]:
    """An exported folder's tensors -> nestling's draft: nestling's layer names, and d2t / t2d (which
    the draft always carries) as the identity for a full-vocabulary folder that, as the engines
    need, holds none."""
    tensors = layer_names_for_nestling(tensors, c)
    if not full_vocab(c) or "d2t" in tensors:
        return tensors
    return {
        **tensors,
        "d2t": torch.zeros(c.vocab_size, dtype=torch.int64),
        "t2d": torch.ones(c.vocab_size, dtype=torch.bool),
    }


def expected_tensors(c: DraftConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor in model.safetensors; nothing more, nothing less.
    A full-vocabulary draft has no d2t / t2d (see the module docstring: vLLM refuses them)."""
    H, I = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    n_aux = len(c.aux_layer_ids)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"fc.weight": ((H, n_aux * H), dtype)}
    if c.fc_norm:  # vLLM loads them as model.fc_norm.{i} (one RMSNorm per aux state)
        out.update({f"fc_norm.{i}.weight": ((H,), dtype) for i in range(n_aux)})
    for i in range(c.num_hidden_layers):
        m, width = layer_prefix(c, i), 2 * H if i == 0 else H  # layer 0: embedding half first, then hidden
        out[m + "input_layernorm.weight"] = ((H,), dtype)
        if i == 0:
            out[m + "hidden_norm.weight"] = ((H,), dtype)
        out.update(
            {
                m + "post_attention_layernorm.weight": ((H,), dtype),
                m + "self_attn.q_proj.weight": ((q, width), dtype),
                m + "self_attn.k_proj.weight": ((kv, width), dtype),
                m + "self_attn.v_proj.weight": ((kv, width), dtype),
                m + "self_attn.o_proj.weight": ((H, q), dtype),
                m + "mlp.gate_proj.weight": ((I, H), dtype),
                m + "mlp.up_proj.weight": ((I, H), dtype),
                m + "mlp.down_proj.weight": ((H, I), dtype),
            }
        )
    out["norm.weight"] = ((H,), dtype)
    out["lm_head.weight"] = ((c.draft_vocab_size, H), dtype)
    if not full_vocab(c):
        out["d2t"] = ((c.draft_vocab_size,), torch.int64)
        out["t2d"] = ((c.vocab_size,), torch.bool)
    return out


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """One line per floating tensor holding NaN or inf: such a draft loads, drafts garbage and is
    accepted nowhere, so it breaks the contract like a wrong shape does."""
    out = []
    for n, t in tensors.items():
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                out.append(f"{n} holds {bad} non-finite value(s) (NaN/inf; training diverged or its inputs held NaN)")
    return out


def first_problems(problems: list[str]) -> str:
    """The first three problems of a list, for one error line ("; ..." where there are more)."""
    return "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse draft weights that hold NaN or inf (eval, before any engine starts)."""
    problems = non_finite(tensors)
    if problems:
        raise NestlingError(f"{where} is unusable: {first_problems(problems)}; train it again (see docs/safety.md)")


def check_tensors(tensors: dict[str, torch.Tensor], c: DraftConfig, dtype: torch.dtype, where: str = "") -> None:
    """Raise NestlingError naming every tensor whose name, shape or dtype breaks the contract."""
    want = expected_tensors(c, dtype)
    problems = [f"missing {n}" for n in want if n not in tensors]
    problems += [f"unexpected {n}" for n in tensors if n not in want]
    for n, (shape, dt) in want.items():
        if n in tensors:
            t = tensors[n]
            if tuple(t.shape) != shape or t.dtype != dt:
                problems.append(f"{n}: {tuple(t.shape)} {t.dtype}, contract says {shape} {dt}")
    problems += non_finite(tensors)
    if "d2t" in tensors and "t2d" in tensors and not problems:
        target_ids = torch.arange(c.draft_vocab_size) + tensors["d2t"]
        if int(tensors["t2d"].sum()) != c.draft_vocab_size or not bool(tensors["t2d"][target_ids].all()):
            problems.append("d2t and t2d disagree: t2d must be True exactly at arange(draft_vocab)+d2t")
    if problems:
        raise NestlingError(f"{where or 'draft weights'} break the export contract: " + "; ".join(problems))


def native_config(c: DraftConfig, target_config: dict, dtype: str) -> dict:
    """config.json of the native EAGLE-3 folder (what vLLM and SGLang read)."""
    rope = full_attention_rope(target_config.get("rope_parameters") or {}) or dict(c.rope_parameters)
    rope_theta = target_config.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_scaling = target_config.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_parameters": rope,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(target_config.get("max_position_embeddings", c.max_position_embeddings)),
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,
        # the draft norms (model.NORM_OPTIONS), always written: a speculators-layout config without
        # norm_before_residual means True to vLLM, ours defaults to False
        **norm_keys(c),
        "dtype": dtype,
        "torch_dtype": dtype,
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(c.aux_layer_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(c.aux_layer_ids),
            "use_aux_hidden_state": True,
            "layer_id_convention": "sglang (HF hidden_states index - 1); top-level ids are vLLM's (= HF)",
        },
        "nestling": {
            "aux_layer_ids": list(c.aux_layer_ids),
            "layer_id_convention": "hf_hidden_states",
            "num_target_layers": c.num_target_layers,
            "target_fingerprint": c.target_fingerprint,
            "target_model_type": c.target_model_type,
        },
    }


def norm_keys(c: DraftConfig) -> dict[str, bool]:
    """The config.json keys of the draft norms (vLLM 0.32's names, `llama_eagle3.py`)."""
    return {k: bool(getattr(c, k)) for k in NORM_OPTIONS}


def norms_from_config(cfg: dict) -> dict[str, bool]:
    """The draft norms a config.json asks for, read as vLLM 0.32 does: absent = False, except
    norm_before_residual in the speculators layout (vLLM's `update_eagle3` defaults it to True)."""
    speculators = "speculators_config" in cfg
    return {k: bool(cfg.get(k, speculators and k == "norm_before_residual")) for k in NORM_OPTIONS}


def check_native_config(cfg: dict, c: DraftConfig, where: str = "config.json") -> None:
    """The config fields the engines read, checked against the draft they describe."""
    want = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(c.aux_layer_ids),
        **norm_keys(c),
    }
    bad = [f"{k}={cfg.get(k)!r} (want {v!r})" for k, v in want.items() if cfg.get(k) != v]
    sg = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if sg != sglang_layer_ids(c.aux_layer_ids):
        bad.append(f"eagle_config.eagle_aux_hidden_state_layer_ids={sg!r} (want {sglang_layer_ids(c.aux_layer_ids)!r})")
    if bad:
        raise NestlingError(f"{where} breaks the export contract: " + "; ".join(bad))


# The config's sizes the draft is built from: each a positive int (an edited "wide" or 0 would be met
# later as a TypeError or an empty tensor).
SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")


def draft_config_from_native(cfg: dict) -> DraftConfig:
    """Rebuild the DraftConfig of an exported folder (for eval and for the reload check)."""
    n = cfg.get("nestling") or {}
    if "aux_layer_ids" in n:
        aux = list(n["aux_layer_ids"])
    elif "eagle_aux_hidden_state_layer_ids" in cfg:
        aux = list(cfg["eagle_aux_hidden_state_layer_ids"])  # vLLM ids = HF ids
    else:
        raise NestlingError("the draft config names no aux layer ids (eagle_aux_hidden_state_layer_ids)")
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))}
    norms = norms_from_config(cfg)
    for key in SIZES:
        v = cfg.get(key, 1)
        if type(v) is not int or v < 1:  # type() also refuses a bool, which is an int
            raise ValueError(f"{key} is {v!r}, not a positive whole number")
    return DraftConfig(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"],
        draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
        aux_layer_ids=aux,
        num_target_layers=int(n.get("num_target_layers", 0)),
        num_hidden_layers=int(cfg.get("num_hidden_layers", 1)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        hidden_act=cfg.get("hidden_act", "silu"),
        target_fingerprint=n.get("target_fingerprint", ""),
        target_model_type=n.get("target_model_type", "llama"),
        fc_norm=norms["fc_norm"],
        norm_output=norms["norm_output"],
        norm_before_residual=norms["norm_before_residual"],
    )


def read_draft_folder(folder: Path) -> tuple[dict, DraftConfig, dict[str, torch.Tensor]]:
    """(engine config dict, DraftConfig, tensors) of a native or speculators export folder."""
    from nestling.inputs import load_safetensors, read_json

    folder = Path(folder)
    if not (folder / CONFIG).exists() or not (folder / WEIGHTS).exists():
        raise NestlingError(
            f"{folder} is not an exported draft: it needs {CONFIG} and {WEIGHTS} (run `nestling export`)"
        )
    redo = "export the draft again (`nestling export TRAIN_DIR --out DIR`)"
    cfg = read_json(folder / CONFIG, "draft config", hint=redo)
    layer_cfg = cfg
    if "speculators_config" in cfg:  # speculators layout: the Llama layer config is nested
        layer_cfg = {
            **cfg["transformer_layer_config"],
            **{k: v for k, v in cfg.items() if k != "transformer_layer_config"},
        }
    try:
        draft = draft_config_from_native(layer_cfg)
    except (KeyError, TypeError, ValueError) as e:  # a field missing or of the wrong type: an edited file
        raise NestlingError(
            f"draft config {folder / CONFIG} is damaged or edited ({type(e).__name__}: {e}); {redo}"
        ) from None
    return cfg, draft, load_safetensors(folder / WEIGHTS, "draft weights", redo)
