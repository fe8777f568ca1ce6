"""`nestling capture`: run the target prefill-only over a data folder and store the states it needs.

Order of work, chosen so that mistakes cost seconds: check the data folder, the tokenizer
fingerprint, the layer ids (config only) and the disk before loading any weights; then plan the
shards (a pure function of inputs and settings), skip those already complete, and stream the rest.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import torch

from nestling.capture import tp
from nestling.capture.backend import make_backend
from nestling.capture.settings import CaptureSettings, compute_dtype, parse_size, resolve
from nestling.capture.store import (
    FP8,
    OutOfSpace,
    ShardPlan,
    ShardWriter,
    batches,
    bytes_per_token,
    finish_checksums,
    plan_shards,
    quantize_fp8,
    shard_key,
    shard_name,
    store_dtype,
    write_index,
)
from nestling.config import to_dict
from nestling.data.dataset import SPLITS, Sample, load_samples, split_files
from nestling import outdir
from nestling.errors import NestlingError
from nestling.manifest import MANIFEST, hash_json, read_manifest, write_manifest
from nestling.progress import Progress, format_bytes, log
from nestling.targets.layers import default_capture_layers, num_layers, validate_layer_ids
from nestling.targets.load import (
    TOKENIZER_FINGERPRINT_VERSION,
    load_config,
    load_tokenizer,
    require_safetensors,
    resolve_target,
    target_fingerprint,
    tokenizer_fingerprint,
)

# Settings that change the bytes of the store (device does not: it changes speed, not meaning).
# How each backend arrives at the one stored meaning of the final state (HF hidden_states[L]).
FINAL_STATE_SOURCE = {
    "hf": "transformers: output of the target's final norm (HF hidden_states[L])",
    "vllm": "vLLM extract_hidden_states id L (last layer output before the final norm) with the target's "
    "final norm (model.norm.weight) applied by nestling's KV connector",
}
RESULT_KEYS = ("backend", "layers", "dtype", "token_budget", "shard_size")


_copy_stream = None


class _PinnedPool:
    """Reusable pinned host buffers. Allocating pinned memory per batch (cudaHostAlloc of ~0.5 GB
    for an 8B target) costs about as much as the copy and serialises with the GPU; the writer
    hands each buffer back once its bytes are on disk."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


_pinned = _PinnedPool()


def _to_host(h: torch.Tensor):
    """Start the device-to-host copy on a side stream and return at once; the writer thread waits on
    the event. On the compute stream the copy would stall the next batch's forward."""
    global _copy_stream
    if h.device.type != "cuda":
        return h, None, None
    if _copy_stream is None:
        _copy_stream = torch.cuda.Stream(device=h.device)
    _copy_stream.wait_stream(torch.cuda.current_stream(h.device))
    nbytes = h.numel() * h.element_size()
    buf = _pinned.take(nbytes)
    host = buf[:nbytes].view(h.dtype).view(h.shape)
    with torch.cuda.stream(_copy_stream):
        host.copy_(h, non_blocking=True)
        h.record_stream(_copy_stream)
        event = torch.cuda.Event()
        event.record(_copy_stream)
    return host, event, lambda: _pinned.give(buf)


def check_data_tokenizer(data_dir: Path, manifest: dict, tok_fp: str) -> None:
    """The data's token ids mean the target's text only when the target's tokenizer made them."""
    data_tok = (manifest.get("inputs") or {}).get("tokenizer")
    if data_tok != tok_fp:
        older = int(manifest.get("tokenizer_fingerprint_version") or 1) < TOKENIZER_FINGERPRINT_VERSION
        raise NestlingError(
            f"{data_dir} was tokenized with another tokenizer (fingerprint {data_tok}) than the target's ({tok_fp}); "
            f"its token ids would mean different text. Run `nestling data` again with this --target."
            + (
                " (It was made by an older nestling whose tokenizer fingerprint covered the vocabulary only; "
                "`nestling data` redoes it.)"
                if older
                else ""
            )
        )


def _load_data(
    data_dir: Path, tok_fp: str, vocab_size: int, max_pos: int | None
) -> tuple[dict, dict[str, list[Sample]]]:
    if not data_dir.exists():
        raise NestlingError(
            f"data folder {data_dir} does not exist; create it with `nestling data INPUT --target MODEL --out {data_dir}`"
        )
    manifest = read_manifest(data_dir, "data")
    check_data_tokenizer(data_dir, manifest, tok_fp)
    out: dict[str, list[Sample]] = {}
    for split in SPLITS:
        if not split_files(data_dir, split):
            continue
        samples = load_samples(data_dir, split)
        for s in samples:
            if not s.input_ids or len(s.input_ids) != len(s.loss_mask):
                raise NestlingError(
                    f"{data_dir}: sample {s.sample_id} is empty or its loss_mask length differs from its input_ids"
                )
            if max(s.input_ids) >= vocab_size or min(s.input_ids) < 0:
                raise NestlingError(
                    f"{data_dir}: sample {s.sample_id} holds token ids outside the target's vocabulary (size {vocab_size})"
                )
            if max_pos and len(s.input_ids) > max_pos:
                raise NestlingError(
                    f"{data_dir}: sample {s.sample_id} has {len(s.input_ids)} tokens, more than the target's "
                    f"max_position_embeddings {max_pos}; run `nestling data` with --max-length {max_pos}"
                )
        if samples:
            out[split] = samples
    if not out:
        raise NestlingError(f"{data_dir} holds no samples in any split ({', '.join(SPLITS)})")
    return manifest, out


def capture(data_dir: str | Path, target: str | Path, out: str | Path, settings: CaptureSettings | None = None) -> dict:
    """Capture every split of `data_dir` into `out`; returns the manifest. Resumes an interrupted run.
    Under torchrun with `tensor_parallel_size` N (hf backend), rank 0 does all of this and the other
    ranks only run the forwards it sends them (`capture/tp.py`)."""
    settings = resolve(settings or CaptureSettings())
    tp.check_settings(settings)
    if not tp.enabled(settings):
        return _capture_here(data_dir, target, out, settings)
    tp.init()
    try:
        if tp.world()[0] != 0:
            return tp.follow()
        with tp.leading() as result:
            result["manifest"] = _capture_here(data_dir, target, out, settings)
        return result["manifest"]
    finally:
        tp.finish()


def _capture_here(data_dir: str | Path, target: str | Path, out: str | Path, settings: CaptureSettings) -> dict:
    data_dir, out = Path(data_dir), Path(out)
    if not data_dir.exists():  # cheapest check first: before the target is even resolved
        raise NestlingError(
            f"data folder {data_dir} does not exist; create it with `nestling data INPUT --target MODEL --out {data_dir}`"
        )
    target_dir = resolve_target(target)
    require_safetensors(target_dir)  # before transformers or vLLM could unpickle a .bin
    inputs = [("data folder", data_dir), ("target", target_dir), ("target", target)]
    with outdir.claim(out, "capture", inputs):
        return _capture(data_dir, target_dir, out, settings)


def _capture(data_dir: Path, target_dir: Path, out: Path, settings: CaptureSettings) -> dict:
    config = load_config(target_dir)
    text_cfg = getattr(config, "text_config", None) or config
    L = num_layers(config)
    if tp.enabled(settings):
        tp.check_target(config, settings.tensor_parallel_size)
    layer_ids = validate_layer_ids(list(settings.layers) if settings.layers else default_capture_layers(L), L)
    hidden_size, vocab_size = int(text_cfg.hidden_size), int(text_cfg.vocab_size)
    tok_fp = tokenizer_fingerprint(load_tokenizer(target_dir))
    data_manifest, splits = _load_data(data_dir, tok_fp, vocab_size, getattr(text_cfg, "max_position_embeddings", None))

    dtype = store_dtype(settings.dtype)
    bpt = bytes_per_token(len(layer_ids), hidden_size, dtype)
    inputs = {"target": target_fingerprint(target_dir), "tokenizer": tok_fp, "data": hash_json(data_manifest)}
    result = {k: getattr(settings, k) for k in RESULT_KEYS} | {"layers": layer_ids}
    if dtype == FP8:  # what was quantized: fp32 (CPU) and bf16 (GPU) states round to different fp8 bytes
        result["compute_dtype"] = compute_dtype(settings)
    run_key = hash_json({"inputs": inputs, "result": result, "format": 1})

    plans, todo = _plan_shards(splits, out, bpt, parse_size(settings.shard_size), run_key)

    if (out / MANIFEST).exists():
        old = read_manifest(out, "capture")
        if old.get("run_key") == run_key and not any(todo.values()):
            log(f"[capture] {out} already holds this capture (same target, data and settings); nothing to do")
            return old
        log(f"[capture] {out} holds an incomplete capture or one of other inputs or settings; redoing what differs")
        (out / MANIFEST).unlink()

    todo_tok = sum(p.tokens for ps in todo.values() for p in ps)
    head = f"[capture] layers {layer_ids} of {L}, {settings.dtype}, hidden {hidden_size}: {format_bytes(bpt)}/token"
    _check_disk(head, splits, todo_tok, bpt, out, settings.ignore_disk_check)
    if todo_tok:
        try:
            _run(todo, target_dir, layer_ids, hidden_size, dtype, out, settings, run_key)
        except OutOfSpace as e:
            raise NestlingError(f"{e} {still_needed(todo, out, bpt)}") from None
    stats = {}
    for split, samples in splits.items():
        finish_checksums(out / split, plans[split])
        write_index(out / split, samples, plans[split])
        stats[split] = {
            "samples": len(samples),
            "tokens": sum(len(s.input_ids) for s in samples),
            "supervised_tokens": sum(sum(s.loss_mask) for s in samples),
            "shards": len(plans[split]),
        }
    return write_manifest(
        out,
        "capture",
        to_dict(settings),
        inputs,
        run_key=run_key,
        layer_ids=layer_ids,
        aux_layer_ids=layer_ids[:-1],
        final_state="post_norm",
        final_state_source=FINAL_STATE_SOURCE[settings.backend],
        dtype=settings.dtype,
        compute_dtype=compute_dtype(settings),
        hidden_size=hidden_size,
        num_layers=L,
        vocab_size=vocab_size,
        bytes_per_token=bpt,
        target=str(target_dir),
        data_dir=str(data_dir.resolve()),
        splits=stats,
    )


def _plan_shards(
    splits: dict, out: Path, bpt: int, shard_bytes: int, run_key: str
) -> tuple[dict[str, list[ShardPlan]], dict[str, list[ShardPlan]]]:
    """(every split's shard plan, the shards still to write): shards of an earlier run with this run's
    key stay; a dead run's temporary shard and shards past the new plan's end go."""
    plans: dict[str, list[ShardPlan]] = {}
    todo: dict[str, list[ShardPlan]] = {}
    for split, samples in splits.items():
        sdir = out / split
        sdir.mkdir(parents=True, exist_ok=True)
        plans[split] = plan_shards(samples, bpt, shard_bytes, run_key)
        for stale in sdir.glob(".shard-*.tmp"):
            stale.unlink()  # the shard in flight when a previous run died
        for f in sdir.glob("shard-*.safetensors"):
            if int(f.name[6:11]) >= len(plans[split]):
                f.unlink()
        todo[split] = [p for p in plans[split] if shard_key(sdir / shard_name(p.index)) != p.key]
    return plans, todo


def still_needed(todo: dict[str, list[ShardPlan]], out: Path, bpt: int) -> str:
    """What the capture needs to finish, said when a write ran out of space: the unfinished shards' bytes,
    the largest one (what a file-size limit must allow), what is free, what is kept."""
    left = [p for split, plans in todo.items() for p in plans if shard_key(out / split / shard_name(p.index)) != p.key]
    done = sum(len(plans) for plans in todo.values()) - len(left)
    need = sum(p.tokens for p in left) * bpt
    largest = max((p.tokens for p in left), default=0) * bpt
    return (
        f"The capture still needs {format_bytes(need)} for {len(left)} unfinished shard(s) (the largest "
        f"{format_bytes(largest)}); {format_bytes(outdir.free_bytes(out))} is free on {out} now; "
        f"{done} shard(s) finished in this run are kept."
    )


def _check_disk(head: str, splits: dict, todo_tok: int, bpt: int, out: Path, ignore: bool) -> None:
    """Say (after `head`) what the capture writes and what is free; refuse before the first shard when
    it cannot fit."""
    n_tok = sum(len(s.input_ids) for ss in splits.values() for s in ss)
    need, free = todo_tok * bpt, outdir.free_bytes(out)
    log(
        f"{head}; {n_tok:,} tokens in {', '.join(f'{k} {len(v)}' for k, v in splits.items())} samples = "
        f"{format_bytes(n_tok * bpt)}; to write now {format_bytes(need)} ({todo_tok:,} tokens), "
        f"free on {out}: {format_bytes(free)}"
    )
    if need > free:
        msg = (
            f"not enough disk space for the capture: it needs {format_bytes(need)} but {out} has {format_bytes(free)} free. "
            f"Free space, point --out at a larger disk, capture fewer samples or layers, or pass --ignore-disk-check."
        )
        if not ignore:
            raise NestlingError(msg)
        log(f"[capture] warning: {msg} (continuing: --ignore-disk-check)")


def _run(
    todo: dict[str, list[ShardPlan]],
    target_dir: Path,
    layer_ids: list[int],
    hidden_size: int,
    dtype: torch.dtype,
    out: Path,
    settings: CaptureSettings,
    run_key: str,
) -> None:
    if settings.max_model_len is None:  # an engine that sizes itself up front (vllm) needs the longest sample
        longest = max(len(s.input_ids) for plans in todo.values() for p in plans for s in p.samples)
        settings = replace(settings, max_model_len=longest)
    run_settings = replace(settings, dtype=compute_dtype(settings))
    if tp.enabled(settings):
        tp.load_on_followers(target_dir, layer_ids, run_settings)
    backend = make_backend(settings.backend, target_dir, layer_ids, run_settings)
    if tp.enabled(settings):
        backend = tp.Leader(backend)
    try:
        if backend.hidden_size != hidden_size:
            raise NestlingError(f"backend reports hidden size {backend.hidden_size}, config says {hidden_size}")
        log(
            f"[capture] backend {settings.backend} on {backend.device}"
            + (f", tensor parallel over {settings.tensor_parallel_size} ranks" if tp.enabled(settings) else "")
        )
        meta = {"layer_ids": ",".join(map(str, layer_ids)), "dtype": settings.dtype, "run_key": run_key}
        write_shards(todo, backend, out, settings, meta, dtype)
    finally:
        backend.close()


def write_shards(
    todo: dict[str, list[ShardPlan]],
    backend,
    out: Path,
    settings: CaptureSettings,
    meta: dict,
    dtype: torch.dtype | None = None,
) -> int:
    """Run the planned shards through `backend` into `out/{split}/`, stored as `dtype` (default: the
    backend's); returns bytes written. The forward of batch i+1 runs while the writer thread copies and
    writes batch i. float8 is quantized where the states are (the GPU), so half the bytes cross to the host."""
    writer = ShardWriter(settings.queue_size)
    n_ids, H = len(backend.layer_ids), backend.hidden_size
    dtype = dtype or backend.dtype
    fp8 = dtype == FP8
    try:
        for split, plans in todo.items():
            prog = Progress(
                f"capture {split}",
                total=sum(len(p.samples) for p in plans),
                unit="samples",
                interval=settings.progress_interval,
            )
            for plan in plans:
                if getattr(backend, "writes_shards", False) and not fp8:  # the engine fills the shard file (vllm)
                    backend.write_shard(
                        out / split / shard_name(plan.index),
                        plan,
                        meta,
                        settings.token_budget,
                        lambda b, prog=prog: prog.update(len(b), tokens=sum(len(s.input_ids) for s in b)),
                    )
                    continue
                writer.begin(out / split / shard_name(plan.index), plan, n_ids, H, dtype, meta)
                for batch in batches(plan.samples, settings.token_budget):
                    hidden = backend.capture([s.input_ids for s in batch])
                    if fp8:
                        hidden, scale = quantize_fp8(hidden)
                        writer.write_scale(*_to_host(scale))
                    writer.write(*_to_host(hidden))
                    prog.update(
                        len(batch),
                        tokens=sum(len(s.input_ids) for s in batch),
                        written=format_bytes(writer.bytes_written),
                    )
                writer.end()
            prog.close()
        writer.close()
    except BaseException:
        writer.abort()
        for split in todo:  # the shard in flight of an engine that fills it itself (vllm): preallocated, maybe GBs
            for stale in (out / split).glob(".shard-*.tmp"):
                stale.unlink(missing_ok=True)
        raise
    return writer.bytes_written
