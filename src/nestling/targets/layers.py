"""Layer ids in nestling's one convention (Hugging Face `hidden_states` indexing).

id 0 is the embedding output, id k (0 < k < L) is the input of decoder layer k, id L is the final
hidden state after the final norm (so lm_head(h_L) are the target's logits).
"""

from __future__ import annotations

from nestling.errors import NestlingError


def num_layers(config) -> int:
    """Decoder layer count of a transformers config (text config for multimodal wrappers)."""
    cfg = getattr(config, "text_config", None) or config
    n = getattr(cfg, "num_hidden_layers", None)
    if n is None:
        raise NestlingError(f"cannot tell the layer count of a {type(config).__name__}: no num_hidden_layers")
    return int(n)


def default_aux_layers(n_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high aux layers: [2, L//2, L-3]."""
    if n_layers < 4:
        raise NestlingError(f"the target has {n_layers} layers; EAGLE-3's default aux layers need at least 4")
    return sorted({2, n_layers // 2, n_layers - 3})


def default_capture_layers(n_layers: int) -> list[int]:
    """Aux layers plus the final state L (the teacher)."""
    return default_aux_layers(n_layers) + [n_layers]


def validate_layer_ids(ids: list[int], n_layers: int, need_final: bool = True) -> list[int]:
    """Check ids against a target with `n_layers` decoder layers, before any model is loaded."""
    bad = [i for i in ids if not 0 <= int(i) <= n_layers]
    if bad:
        raise NestlingError(
            f"layer ids {bad} do not fit this target: it has {n_layers} decoder layers, so valid ids are "
            f"0..{n_layers} (0 = embeddings, {n_layers} = final state after the norm). "
            f"Default for this target: {','.join(map(str, default_capture_layers(n_layers)))}"
        )
    if len(set(ids)) != len(ids) or list(ids) != sorted(ids):
        raise NestlingError(f"layer ids {ids} must be distinct and increasing")
    if need_final and len(ids) < 2:
        raise NestlingError(f"layer ids {list(ids)} name no aux layer: give the aux ids followed by the final state "
                            f"{n_layers} (default: {','.join(map(str, default_capture_layers(n_layers)))})")
    if need_final and ids[-1] != n_layers:
        raise NestlingError(
            f"the last captured layer id must be the final state {n_layers} (the teacher for training); got {ids}"
        )
    return [int(i) for i in ids]
