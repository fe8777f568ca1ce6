"""Load a target: a local Hugging Face folder or a `.gguf` file (converted once to safetensors).

Every stage that runs the target (capture's hf backend, online training, the hf regeneration
engine, the reference evaluator) gets it from `load_model`, so quantized checkpoints load the same
way everywhere: a compressed-tensors folder (`quantization_config.quant_method` "compressed-tensors":
W4A16 pack-quantized, W8A16 / W8A8 int or FP8) is dequantized to dense weights at load
(`quantized_load_kwargs`).

Stages that need only a few tensors (the trainer needs the embedding and lm_head; the vllm capture
backend the final norm) read them straight from the safetensors files, never the whole model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nestling.errors import NestlingError
from nestling.inputs import is_url, refuse_remote
from nestling.manifest import hash_bytes, hash_files, hash_json
from nestling.progress import log


def is_gguf(model: str | Path) -> bool:
    return str(model).endswith(".gguf")


def convert_gguf(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Dequantize a GGUF checkpoint into a safetensors folder with its tokenizer (done once, cached)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = Path(gguf)
    if not gguf.exists():
        raise NestlingError(f"GGUF file {gguf} does not exist")
    check_gguf_header(gguf)
    log(f"[target] converting {gguf.name} to a {dtype} safetensors folder at {out} (once) ...")
    kw: dict[str, Any] = {"gguf_file": gguf.name}
    try:
        kw["quantization_config"] = GgufConfig(dequantize=True)
    except TypeError:
        pass
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=getattr(torch, dtype), **kw)
        bos = {"add_bos_token": True} if gguf_adds_bos(gguf) else {}
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, **bos)
    except Exception as e:  # noqa: BLE001 - the GGUF reader fails on a damaged file with struct.error, ValueError, ...
        raise _damaged_gguf(gguf, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None
    check_tokenizer_splits_words(tok, gguf)
    tmp = Path(str(out) + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else None
    return out


# Plain English that every real LLM vocabulary (32k tokens and more: Llama, Qwen, Phi-3, GPT-2, SmolLM2,
# Gemma) splits into 1.1-1.25 tokens per word.
WORD_PROBE = "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times."
MAX_TOKENS_PER_WORD = 1.4


def check_tokenizer_splits_words(tok: Any, source: Path) -> None:
    """Refuse a tokenizer rebuilt without its merges. transformers 5.16-5.17 rebuild Gemma-3's GGUF
    vocabulary that way: every word falls into pieces of one or two characters, so the target reads
    text it was never trained on and its answers, and a draft trained on them, are worthless; nothing
    else fails. Vocabularies under 16k tokens are not judged."""
    if len(tok) < 16_000:
        return
    n = len(tok(WORD_PROBE, add_special_tokens=False)["input_ids"])
    words = len(WORD_PROBE.split())
    if n > MAX_TOKENS_PER_WORD * words:
        import transformers

        raise NestlingError(
            f"the tokenizer transformers {transformers.__version__} rebuilt from {source.name} splits {words} "
            f"English words into {n} tokens (a working one: about {words * 1.2:.0f}): it lost the vocabulary's "
            "merges, and the target would read text it never saw. transformers 5.16 and 5.17 do this to "
            "some GGUF vocabularies (Gemma-3's); install transformers>=5.18, or give --target the model's "
            "folder with its own tokenizer.json"
        )


def gguf_adds_bos(gguf: Path) -> bool:
    """Whether the GGUF's tokenizer starts every text with BOS (`tokenizer.ggml.add_bos_token`, set for
    Gemma and Llama-2). transformers' GGUF tokenizer drops the flag, and a target prompted without the BOS
    it was trained with (a base Gemma above all) is not the model it is; the conversion sets it back."""
    try:
        return _gguf_bool(gguf, "tokenizer.ggml.add_bos_token")
    except Exception:  # noqa: BLE001 - a damaged file: the conversion itself says so
        return False


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes


def _gguf_bool(gguf: Path, key: str) -> bool:
    """A boolean metadata value of a GGUF file (False when absent), read by walking the header's key-value
    list: the gguf package's reader parses every vocabulary entry first (30 s for Gemma's 262k)."""
    import mmap
    import struct

    with open(gguf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        n_kv, pos = struct.unpack_from("<Q", m, 16)[0], 24

        def skip(vtype: int, pos: int) -> int:
            if vtype == 8:  # string: u64 length, bytes
                return pos + 8 + struct.unpack_from("<Q", m, pos)[0]
            if vtype == 9:  # array: u32 element type, u64 count, elements
                etype, count = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if etype in _GGUF_SIZES:
                    return pos + count * _GGUF_SIZES[etype]
                for _ in range(count):
                    pos = skip(etype, pos)
                return pos
            return pos + _GGUF_SIZES[vtype]

        for _ in range(n_kv):
            klen = struct.unpack_from("<Q", m, pos)[0]
            name = m[pos + 8 : pos + 8 + klen].decode()
            vtype = struct.unpack_from("<I", m, pos + 8 + klen)[0]
            pos += 12 + klen
            if name == key:
                return vtype == 7 and m[pos] != 0
            pos = skip(vtype, pos)
    return False


def _damaged_gguf(gguf: Path, why: str) -> NestlingError:
    return NestlingError(
        f"GGUF file {gguf} cannot be read ({why}): it is cut off or damaged; download it again "
        "(or give the model's Hugging Face folder)"
    )


GGUF_MAGIC = b"GGUF"


def check_gguf_header(gguf: Path) -> None:
    """The GGUF header against the file: the magic, and tensor and metadata counts the file's bytes can
    hold (each entry takes at least 8 bytes), so an empty, random or overflowing file is named before the
    reader meets it (as struct.error or an allocation of exabytes)."""
    import struct

    from nestling.inputs import regular_file

    size = regular_file(gguf, "GGUF file").stat().st_size
    with open(gguf, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise _damaged_gguf(gguf, f"{size} bytes without the GGUF header" if head[:4] != GGUF_MAGIC else "too short")
    _version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if (n_tensors + n_kv) * 8 > size:
        raise _damaged_gguf(
            gguf, f"its header claims {n_tensors:,} tensors and {n_kv:,} metadata entries in {size:,} bytes"
        )


def resolve_target(model: str | Path) -> Path:
    """A local folder with config.json and safetensors; a GGUF is converted once into the cache."""
    from nestling.assets import build_once, cache_dir

    if is_url(model):  # before Path() folds its "//"
        refuse_remote(model, "target", kind="target")
    p = Path(model)
    if is_gguf(model):
        if not p.exists():
            raise NestlingError(f"target {model} does not exist")
        # "-bos": converted with the BOS flag kept (gguf_adds_bos); "-words": its tokenizer passed
        # check_tokenizer_splits_words. A folder converted before either is redone.
        out = cache_dir() / "models" / f"{p.stem}-{hash_files([p])}{'-bos' if gguf_adds_bos(p) else ''}-words"
        return build_once(out, lambda tmp: convert_gguf(p, tmp))
    if p.is_dir():
        if not (p / "config.json").exists():
            raise NestlingError(
                f"target folder {p} has no config.json; point --target at a Hugging Face model folder or a .gguf file"
            )
        return p
    if p.exists():
        raise NestlingError(f"target {p} is a file but not a .gguf; give a model folder or a .gguf file")
    refuse_remote(model, "target", kind="target")  # a URL or a model hub id: never fetched
    raise NestlingError(f"target {model} does not exist")


# Weight files transformers would unpickle (arbitrary code): nestling never lets it load them.
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def require_safetensors(target_dir: Path) -> None:
    """Refuse a target whose weights are not safetensors, before transformers (or vLLM) touches them:
    a pickled `pytorch_model.bin` runs whatever code it carries when loaded. Each safetensors file's
    header is checked against the file (`inputs.safetensors_header`): one cut off, or whose header
    claims more than the file holds, is named here, not met inside transformers or vLLM."""
    from nestling.inputs import safetensors_header

    weights = sorted(target_dir.glob("*.safetensors"))
    for f in weights:
        safetensors_header(f, "target weights", "download or copy the model folder again")
    if weights:
        return
    pickled = sorted(f.name for pat in PICKLE_WEIGHTS for f in target_dir.glob(pat))
    if pickled:
        raise NestlingError(
            f"target folder {target_dir} holds weights as {', '.join(pickled[:3])} (pickle, which can run "
            "arbitrary code when loaded): nestling loads only .safetensors; convert them (e.g. "
            "`model.save_pretrained(DIR, safe_serialization=True)` on a machine you trust) or use a .gguf"
        )
    raise NestlingError(
        f"target folder {target_dir} holds no .safetensors weights (only {_listing(target_dir)}); "
        "point --target at a complete Hugging Face model folder or a .gguf file"
    )


def _listing(folder: Path, n: int = 5) -> str:
    names = sorted(f.name for f in folder.iterdir())
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "") if names else "nothing"


class _Report(logging.Handler):
    """transformers' load report (its table of missing, unexpected and mismatched tensors), held back
    while a model loads: passed on as it was when the load succeeds, summed up in nestling's one-line
    error when it fails (the table would otherwise precede the error with dozens of lines)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def mismatch(self) -> str | None:
        """The report's first mismatched tensor, as one line."""
        for r in self.records:
            line = next((ln for ln in r.getMessage().splitlines() if "MISMATCH" in ln), None)
            if line:
                return " ".join(line.replace("|", " ").split())[:300]
        return None


@contextlib.contextmanager
def _load_report() -> Iterator[_Report]:
    logger = logging.getLogger("transformers.modeling_utils")
    report, propagate = _Report(), logger.propagate
    logger.addHandler(report)
    logger.propagate = False
    try:
        yield report
    finally:
        logger.removeHandler(report)
        logger.propagate = propagate
        if not report.failed:
            for r in report.records:
                logger.handle(r)


def _first_line(e: BaseException) -> str:
    """The first non-blank line of an error's message, for a one-line report (transformers' run long);
    a "size mismatch" line where there is one (the line that names the tensor)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    line = next((ln for ln in lines if "size mismatch" in ln), lines[0] if lines else type(e).__name__)
    return line[:300]


def _transformers_error(what: str, folder: Path, e: Exception) -> NestlingError:
    """transformers' error when it cannot read a folder, as one line that names the folder."""
    first = _first_line(e)
    return NestlingError(
        f"cannot read the {what} of {folder} ({type(e).__name__}: {first}); check that it is a "
        "complete Hugging Face model folder whose model_type this transformers version knows"
    )


def load_config(target: Path):
    from transformers import AutoConfig

    path = resolve_target(target)
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError, TypeError) as e:  # unknown model_type, broken config.json
        raise _transformers_error("config", path, e) from None


def load_tokenizer(target: str | Path):
    from transformers import AutoTokenizer

    path = resolve_target(target)
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise NestlingError(
            f"target folder {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}; it holds "
            f"{_listing(path)}); point --target at a complete Hugging Face model folder"
        )
    try:
        return AutoTokenizer.from_pretrained(path)
    except (ValueError, KeyError, OSError, TypeError, AttributeError) as e:
        raise _transformers_error("tokenizer", path, e) from None


def quantization_config(target: str | Path) -> dict | None:
    """The checkpoint's `quantization_config` (top level, or the text config's in a multimodal folder)."""
    cfg = json.loads((resolve_target(target) / "config.json").read_text())
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    return q if isinstance(q, dict) else None


COMPRESSED_TENSORS = "compressed-tensors"


def quantized_load_kwargs(target: str | Path) -> dict[str, Any]:
    """from_pretrained arguments for a quantized checkpoint ({} for a dense one).

    compressed-tensors: always dequantized at load (`CompressedTensorsConfig(dequantize=True)`, the old
    `run_compressed=False`), on the CPU and on CUDA alike. transformers 5.19 has no packed-int4 kernel
    (left compressed, it decompresses the whole model in a pre-hook on the first forward of the
    *CausalLM* module, which capture never calls: it runs the decoder stack alone), and its FP8 kernel
    path is opt-in and inference only. So the target runs as dense `dtype` weights, compressed-tensors'
    own dequantization of the checkpoint: the memory of an unquantized model of the same shape.
    Other `quant_method`s go to transformers' own quantizer unchanged."""
    q = quantization_config(target)
    if not q or q.get("quant_method") != COMPRESSED_TENSORS:
        return {}
    try:
        import compressed_tensors  # noqa: F401
        from transformers import CompressedTensorsConfig
    except ImportError as e:
        raise NestlingError(
            f"target {target} is a compressed-tensors checkpoint (quantization format "
            f"{q.get('format')!r}) and loading it needs the `compressed-tensors` package ({e}); "
            "`pip install 'compressed-tensors>=0.15,<0.18'`"
        ) from None
    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


# Tensors a quantized checkpoint stores besides its weights; gone (or unused) once dequantized.
QUANT_AUX_SUFFIXES = (
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
    "weight_g_idx",
    "weight_global_scale",
    "input_scale",
    "input_zero_point",
    "input_global_scale",
)


def dense_parameter_count(target: str | Path) -> int:
    """The target's parameters once dequantized, from the safetensors headers (no weights read but the
    tiny `weight_shape` tensors): a packed weight counts at its `weight_shape`, scales and zero points
    not at all. What `load_model` holds in memory, at the run's dtype, for a quantized checkpoint."""
    import math

    from safetensors import safe_open

    d = resolve_target(target)
    wmap = _weight_map(d)
    n = 0
    for f in sorted(set(wmap.values())):
        with safe_open(d / f, "pt") as sf:
            for k in sf.keys():
                if k.endswith("weight_packed"):
                    shape = k[: -len("packed")] + "shape"
                    with safe_open(d / wmap[shape], "pt") as sh:
                        n += math.prod(int(x) for x in sh.get_tensor(shape).tolist())
                elif not k.endswith(QUANT_AUX_SUFFIXES):
                    n += math.prod(sf.get_slice(k).get_shape())
    return n


def _finish_dequantize(model, dtype) -> None:
    """Decompress whatever transformers left compressed, then give the dequantized weights `dtype` as
    a dense load would: compressed-tensors dequantizes into the scales' dtype (bf16 scales under a
    float32 run left the MoE experts bf16), so every floating parameter but transformers'
    keep-in-fp32 ones is cast, exactly as `from_pretrained(dtype=...)` does for a dense folder."""
    quantizer = getattr(model, "hf_quantizer", None)  # None once dequantized: transformers drops it then
    if hasattr(model, "ct_decompress_hook") and quantizer is not None:  # left compressed: decompress now, not
        quantizer.compressor.decompress_model(model)  # on a forward capture never makes
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | set(
        getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    )
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != dtype and not keep.intersection(name.split(".")):
            p.data = p.data.to(dtype)


def load_model(
    target: str | Path, dtype: str = "bfloat16", device: str = "cpu", device_map: str | None = None, tp_size: int = 1
):
    """The target as an eval-mode transformers model with SDPA attention; a quantized checkpoint
    comes back with dense weights (`quantized_load_kwargs`). `tp_size` > 1 (under torchrun, one process
    per rank): this rank's slice of transformers' tensor-parallel plan, on cuda:LOCAL_RANK or the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_target(target)
    require_safetensors(path)
    kw: dict[str, Any] = {"dtype": getattr(torch, dtype), "attn_implementation": "sdpa", "use_safetensors": True}
    quantized = quantized_load_kwargs(path)
    kw.update(quantized)
    if device_map:
        kw["device_map"] = device_map
    if tp_size > 1:
        from transformers.distributed import DistributedConfig

        kw["distributed_config"] = DistributedConfig(tp_size=tp_size)
    with warnings.catch_warnings():  # "you passed quantization_config ... the model's will be used": meant so
        warnings.filterwarnings("ignore", message=".*already has a `quantization_config` attribute.*")
        with _load_report() as report:
            try:
                model = AutoModelForCausalLM.from_pretrained(path, **kw)
            except (RuntimeError, ValueError, KeyError, TypeError, OSError) as e:  # weights unlike the config, ...
                report.failed = True
                why = report.mismatch() or f"{type(e).__name__}: {_first_line(e)}"
                raise NestlingError(
                    f"cannot load the target {path} ({why}): its config.json does not match its weights, or the "
                    "folder is damaged; download or copy the model folder again"
                ) from None
    if quantized:
        _finish_dequantize(model, getattr(torch, dtype))
    if not device_map and tp_size == 1:
        model = model.to(device)
    return model.eval()


def _weight_map(target_dir: Path) -> dict[str, str]:
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        from nestling.inputs import read_json

        wmap = read_json(index, "weight index", hint="download or copy the model folder again").get("weight_map")
        if not isinstance(wmap, dict):
            raise NestlingError(f"weight index {index} has no weight_map; download or copy the model folder again")
        return wmap
    files = sorted(target_dir.glob("*.safetensors"))
    require_safetensors(target_dir)
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(f, "pt") as sf:
            out.update({k: f.name for k in sf.keys()})
    return out


def tensor_file(target: str | Path, name: str) -> Path:
    """The safetensors file of the target that holds tensor `name`."""
    target_dir = resolve_target(target)
    wmap = _weight_map(target_dir)
    if name not in wmap:
        raise NestlingError(f"target {target_dir} has no tensor {name}")
    return target_dir / wmap[name]


def read_tensors(target: str | Path, names: list[str]) -> dict:
    """Read only the named tensors from the target's safetensors files (memory-mapped)."""
    from safetensors import safe_open

    target_dir = resolve_target(target)
    wmap = _weight_map(target_dir)
    missing = [n for n in names if n not in wmap]
    if missing:
        raise NestlingError(f"target {target_dir} has no tensors {missing}")
    out = {}
    for n in names:
        with safe_open(target_dir / wmap[n], "pt") as sf:
            out[n] = sf.get_tensor(n)
    return out


def head_tensor_names(target: str | Path) -> dict[str, str]:
    """Names of the embedding and lm_head in the target's checkpoint (lm_head may be tied): the two
    tensors the trainer reads. The final norm is not among them (every capture stores the post-norm
    final state); the vllm capture backend, which applies it, finds it itself (capture/vllm.py)."""
    wmap = _weight_map(resolve_target(target))

    def pick(*cands: str) -> str | None:
        return next((c for c in cands if c in wmap), None) or next(
            (k for k in wmap for c in cands if k.endswith(c.split("model.", 1)[-1]) and "layers" not in k), None
        )

    embed_names = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
    embed = pick(*embed_names)
    lm_head = pick("lm_head.weight") or embed
    quantized = [k for k in wmap if k.startswith("lm_head.weight_") or (embed and k.startswith(embed + "_"))]
    if quantized:  # read raw, a packed or FP8 head is garbage (or, with lm_head.weight absent, silently the embedding)
        raise NestlingError(
            f"target {target} stores a quantized lm_head or embedding ({quantized[0]}); "
            "the trainer reads those tensors dense: use a checkpoint that leaves them unquantized "
            "(compressed-tensors `ignore: [lm_head]`, as quantized releases do)"
        )
    if embed is None:
        raise NestlingError(
            f"cannot find the embedding tensor in {target} (looked for {', '.join(embed_names)} and "
            "names ending in embed_tokens.weight): the trainer reads the embedding from the target's "
            "safetensors files, so the target must store it under one of these names"
        )
    return {"embed": embed, "lm_head": lm_head}


def target_fingerprint(target: str | Path) -> str:
    """Config + weights: two targets with the same fingerprint produce the same hidden states."""
    d = resolve_target(target)
    cfg = json.loads((d / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("transformers_version", "_name_or_path")}
    return hash_bytes(hash_json(cfg).encode(), hash_files(sorted(d.glob("*.safetensors"))).encode())


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".ckpt")


def tokenizer_files_fingerprint(target: str | Path) -> str:
    """Every file of the target folder but the weights (tokenizer.json, tokenizer_config.json, the chat
    template, ...), from disk without loading anything: `nestling run` keys the data stage on it, so a
    changed tokenizer or template redoes the data (target_fingerprint covers config and weights only)."""
    d = resolve_target(target)
    files = sorted(f for f in d.iterdir() if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES))
    return hash_bytes(*(f"{f.name}:{hash_bytes(f.read_bytes())}".encode() for f in files))  # whole content: small files


# Bump when tokenizer_fingerprint changes what it covers: a data folder whose manifest records an older
# version was fingerprinted differently, and is redone instead of being compared (data/run.py).
TOKENIZER_FINGERPRINT_VERSION = 2


def _backend_state(tokenizer) -> str:
    """The fast tokenizer's whole serialized state (tokenizer.json: vocabulary, merges, normalizer,
    pre-tokenizer, post-processor, decoder, added tokens), without the truncation / padding a caller
    may have switched on for one call; the vocabulary alone for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return hash_json(sorted(tokenizer.get_vocab().items()))
    state = backend.to_str()
    if backend.truncation is not None or backend.padding is not None:
        d = json.loads(state)
        d["truncation"] = d["padding"] = None
        state = json.dumps(d)
    return hash_bytes(state.encode())


def added_tokens_state(tokenizer) -> list[tuple]:
    """Every added token with the flags that change how text around it splits (sorted by id)."""
    return sorted(
        (
            int(i),
            str(t.content),
            bool(t.special),
            bool(t.normalized),
            bool(t.lstrip),
            bool(t.rstrip),
            bool(t.single_word),
        )
        for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
    )


def tokenizer_fingerprint(tokenizer, chat_template: str | None = None) -> str:
    """The whole tokenizer state + added tokens + special tokens + chat template: equal fingerprints
    tokenize and render identically. (Version 1 hashed the vocabulary only: a tokenizer with merges
    removed, or another normalizer or pre-tokenizer, splits text differently under the same vocabulary.)"""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    added = added_tokens_state(tokenizer)
    return hash_json(
        {
            "version": TOKENIZER_FINGERPRINT_VERSION,
            "backend": _backend_state(tokenizer),
            "added": added,
            "special": sorted(map(str, tokenizer.all_special_tokens)),
            "special_map": sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items()),
            "template": template,
            "cls": type(tokenizer).__name__,
        }
    )
