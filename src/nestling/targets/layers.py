"""Layer ids in nestling's one convention (Hugging Face `hidden_states` indexing), and their
translation into each engine's spelling (docs/architecture.md, "Layer ids").

id 0 is the embedding output, id k (0 < k < L) is the input of decoder layer k, id L is the final
hidden state after the final norm (so lm_head(h_L) are the target's logits).

Engines, for the aux ids (0 < k < L):
- vLLM (`EagleModelMixin._maybe_add_hidden_state`): id 0 is the embedding output, id k>0 is
  `hidden_states + residual` after layer k-1, i.e. HF `hidden_states[k]`: the same ids. Its id L is
  the last layer's output *before* the final norm (the vllm capture backend applies the norm).
  vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` of a draft config first
  (gpu_model_runner, `_get_eagle3_aux_layers_from_config`), and the same key of
  `extract_hidden_states`' draft config.
- SGLang (`set_eagle3_layers_to_capture`): `layers_to_capture = [id + 1 ...]`, captured at the
  *input* of that layer, so SGLang's id k is HF `hidden_states[k + 1]`: ids are one lower. It reads
  `eagle_config.eagle_aux_hidden_state_layer_ids`.
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
        raise NestlingError(
            f"layer ids {list(ids)} name no aux layer: give the aux ids followed by the final state "
            f"{n_layers} (default: {','.join(map(str, default_capture_layers(n_layers)))})"
        )
    if need_final and ids[-1] != n_layers:
        raise NestlingError(
            f"the last captured layer id must be the final state {n_layers} (the teacher for training); got {ids}"
        )
    return [int(i) for i in ids]


def vllm_layer_ids(ids: list[int], n_layers: int | None = None) -> list[int]:
    """nestling ids -> vLLM's `eagle_aux_hidden_state_layer_ids`: the same numbers. With `n_layers`,
    ids outside 0..L are refused (only the meaning of id L differs: see the module doc)."""
    if n_layers is not None:
        bad = [i for i in ids if not 0 <= i <= n_layers]
        if bad:
            raise NestlingError(f"layer ids {bad} are outside 0..{n_layers} for this {n_layers}-layer target")
    return [int(i) for i in ids]


def sglang_layer_ids(ids: list[int]) -> list[int]:
    """nestling ids -> SGLang's ids (SGLang adds one before capturing at a layer's input)."""
    return [int(i) - 1 for i in ids]
