"""Quantized tiny targets, made by the compressed-tensors library itself (no llm-compressor, no hub).

The dense tiny target's safetensors are quantized tensor by tensor, the way a released checkpoint
(Kimi-K2.5's routed experts, say) stores them: every Linear projection of the decoder, MoE experts one
by one, becomes `weight_packed` (int4 packed into int32) + `weight_scale` (one per group of 32 inputs)
+ `weight_shape`, through compressed-tensors' own `calculate_qparams` and `PackedQuantizationCompressor`;
`config.json` gets the `quantization_config` compressed-tensors writes. What is quantized is the
`ignore` list of that config (`SCOPES`), matched by compressed-tensors' own `match_name`: scope "all"
ignores only `lm_head` (embeddings, norms and the MoE router are not Linear layers and stay dense);
scope "experts" is Kimi-K2.5's list, which leaves attention, the shared expert and the dense layers' MLP
unquantized, so only the routed experts are int4. The folders are built once into the nestling cache,
keyed on the dense weights and this file. W8A8 checkpoints (FP8 or int8 weights with a
scale per output channel, activations quantized per token at run time) are made the same way.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

GROUP = 32
# The decoder's Linear projections in Llama and DeepSeek-V3 (MLA: q_a/q_b, kv_a_proj_with_mqa, kv_b; MoE: experts.N.*).
LINEAR = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|q_b_proj|"
    r"kv_a_proj_with_mqa|kv_b_proj)\.weight$"
)
# What a checkpoint leaves unquantized (its quantization_config's `ignore`), by scope. "experts" is
# Kimi-K2.5's (and Kimi-K2-Thinking's) list: only the routed experts (`mlp.experts.N.*`) remain.
SCOPES = {
    "all": ["lm_head"],
    "experts": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
}


def w4a16_scheme(group: int = GROUP):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def quantized(name: str, ignore: list[str]) -> bool:
    """Whether the tensor `name` is a decoder Linear weight that `ignore` does not exempt (module names
    matched as compressed-tensors and vLLM match them: exact, or `re:` + a regex from the start)."""
    from compressed_tensors.utils.match import match_name

    module = name[: -len(".weight")]
    return bool(LINEAR.search(name)) and not any(match_name(module, t) for t in ignore)


def write_quantized(src: Path, out: Path, compress, scheme, fmt: str, ignore: list[str]) -> None:
    """Copy the dense folder `src` to `out` with every decoder Linear weight not in `ignore` replaced by
    `compress(weight)` (the compressed tensors by suffix) and the quantization_config compressed-tensors
    writes for `scheme` in `fmt`."""
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out, dirs_exist_ok=True)
    for f in sorted(Path(out).glob("*.safetensors")):
        packed = {}
        for name, w in load_file(str(f)).items():
            if not quantized(name, ignore):
                packed[name] = w
                continue
            for k, v in compress(w).items():
                packed[name[: -len("weight")] + k] = v.contiguous()
        save_file(packed, str(f), metadata={"format": "pt"})
    qcfg = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=list(ignore), format=fmt, quantization_status="compressed"
    )
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", **qcfg.model_dump(exclude={"quant_method"})}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def quantize_w4a16(src: Path, out: Path, scope: str = "all", group: int = GROUP) -> None:
    """Write `src` (a dense HF folder) to `out` as a W4A16 pack-quantized compressed-tensors checkpoint
    (what is quantized: `SCOPES[scope]`; int4 symmetric, one scale per `group` inputs)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = w4a16_scheme(group)

    def compress(w: torch.Tensor) -> dict:
        groups = w.unflatten(-1, (-1, group))
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        return PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme
        )

    write_quantized(src, out, compress, scheme, "pack-quantized", SCOPES[scope])


def dequantize_folder(src: Path, out: Path, group: int = GROUP) -> None:
    """The W4A16 folder `src` decompressed by compressed-tensors into a dense float32 folder: the
    weights the quantized target really computes with, loaded without any quantizer."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from safetensors.torch import load_file, save_file

    scheme = w4a16_scheme(group)
    shutil.copytree(src, out, dirs_exist_ok=True)
    for f in sorted(Path(out).glob("*.safetensors")):
        sd = load_file(str(f))
        dense = {k: v for k, v in sd.items() if not k.endswith(("weight_packed", "weight_scale", "weight_shape"))}
        for k in (k for k in sd if k.endswith("weight_packed")):
            m = k[: -len("weight_packed")]
            part = {n: sd[m + n] for n in ("weight_packed", "weight_scale", "weight_shape")}
            dense[m + "weight"] = PackedQuantizationCompressor.decompress(part, scheme)["weight"].to(torch.float32)
        save_file(dense, str(f), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def quantize_w8a8(src: Path, out: Path, preset: str) -> None:
    """`src` as a W8A8 checkpoint: "FP8_DYNAMIC" (float-quantized: FP8 weights with a scale per output
    channel, activations FP8 per token at run time) or "W8A8" (int-quantized: the same in int8)."""
    from compressed_tensors.compressors.naive_quantized.base import (
        FloatQuantizationCompressor,
        IntQuantizationCompressor,
    )
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    fmt, compressor = {
        "FP8_DYNAMIC": ("float-quantized", FloatQuantizationCompressor),
        "W8A8": ("int-quantized", IntQuantizationCompressor),
    }[preset]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.format = fmt

    def compress(w: torch.Tensor) -> dict:
        scale, zero = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), scheme.weights)
        return compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)

    write_quantized(src, out, compress, scheme, fmt, SCOPES["all"])


def quantized_target(dense: Path, kind: str = "w4a16", scope: str = "all", group: int = GROUP) -> Path:
    """`dense` quantized W4A16 (kind "w4a16"), that checkpoint decompressed back to dense float32
    ("dequantized"), or W8A8 ("FP8_DYNAMIC", "W8A8"); W4A16 quantizes what `scope` says (`SCOPES`:
    "all" Linear layers, or the routed "experts" only, as Kimi-K2.5 ships) in groups of `group` inputs.
    Built once into the nestling cache."""
    from nestling.assets import build_once, cache_dir
    from nestling.manifest import hash_files

    key = hash_files(sorted(Path(dense).glob("*.safetensors")) + [Path(__file__)])
    name = Path(dense).name
    if kind in ("FP8_DYNAMIC", "W8A8"):
        return build_once(
            cache_dir() / "tiny" / f"{name}-{kind.lower()}-{key}", lambda tmp: quantize_w8a8(dense, tmp, kind)
        )
    tag = f"w4a16-g{group}" + ("" if scope == "all" else f"-{scope}")
    w4 = build_once(cache_dir() / "tiny" / f"{name}-{tag}-{key}", lambda tmp: quantize_w4a16(dense, tmp, scope, group))
    if kind == "w4a16":
        return w4
    assert kind == "dequantized", kind
    return build_once(cache_dir() / "tiny" / f"{name}-{tag}-dense-{key}", lambda tmp: dequantize_folder(w4, tmp, group))
