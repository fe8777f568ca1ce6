"""The data stage: chat files in, tokenized loss-masked parquet shards plus a manifest out.

`prepare_data` reads every input, normalizes each record (`normalize`), renders and masks it with
the target's chat template (`chat`), applies the length limit, assigns the held-out split and
writes shards (`dataset.write_shard`). Rendering and tokenizing run in worker processes over
chunks of records (`workers`); results come back in input order, so the output does not depend on
the number of workers, and they may start before this process has loaded transformers (`headstart`).
Every record that is not kept as-is is counted by reason in the manifest.
"""

from __future__ import annotations

from typing import Any

import hashlib
import os
import time
from collections import Counter
from pathlib import Path

from nestling.config import to_dict
from nestling.data import headstart
from nestling.data import workers as work
from nestling.data.dataset import SPLITS, Sample, split_files, write_shard
from nestling.data.readers import read_inputs
from nestling.data.settings import DataSettings
from nestling import outdir
from nestling.errors import NestlingError
from nestling.manifest import MANIFEST, hash_bytes, hash_file, hash_json, write_manifest
from nestling.progress import Progress, format_duration, log
from nestling.targets.load import TOKENIZER_FINGERPRINT_VERSION

EXAMPLES_PER_REASON = 3


def heldout_of(sample_id: str, seed: int, fraction: float) -> bool:
    """Deterministic split: a keyed hash of the sample id, so it never depends on order or workers."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=8).digest(), "big")
    return h / 2**64 < fraction


def fingerprint_of(tokenizer_fp: str, template: str, settings: DataSettings, input_fps: list[str]) -> str:
    relevant = {k: v for k, v in to_dict(settings).items() if k not in ("workers", "shard_samples")}
    return hash_json({"tokenizer": tokenizer_fp, "template": hash_bytes(template.encode()),
                      "settings": relevant, "inputs": input_fps})


def _clear(out: Path) -> None:
    """Remove a previous (incomplete or outdated) result: the manifest first, so a crash stays incomplete."""
    (out / MANIFEST).unlink(missing_ok=True)
    for split in SPLITS:
        for f in split_files(out, split):
            f.unlink()
    for f in out.glob(".*.parquet.tmp"):
        f.unlink()


def prepare_data(inputs: list[str | Path] | str | Path, target: str | Path, out: str | Path,
                 settings: DataSettings | None = None) -> dict:
    """Tokenize chat data for `target` into `out`; returns the manifest (see docs/data.md)."""
    from nestling.data.chat import read_template
    from nestling.targets.load import resolve_target

    settings = settings or DataSettings()
    inputs = [Path(p) for p in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    if not inputs:
        raise NestlingError("no input files given")
    for p in inputs:
        if not p.exists():  # type: ignore[union-attr]
            raise NestlingError(f"input file {p} does not exist")
        if p.is_dir():  # type: ignore[union-attr]
            raise NestlingError(f"input {p} is a folder; give the data files themselves (e.g. {p}/*.jsonl)")
    out = Path(out)
    target_dir = resolve_target(target)
    template = read_template(settings.chat_template) if settings.chat_template else None
    inputs_named = [("input file", p) for p in inputs] + [("target", target_dir), ("target", target),
                                                          ("chat template", settings.chat_template)]
    with outdir.claim(out, "data", inputs_named):
        return _prepare_claimed(inputs, target_dir, template, out, settings)  # type: ignore[arg-type]


def _prepare_claimed(inputs: list[Path], target_dir: Path, template: str | None, out: Path,
                     settings: DataSettings) -> dict:
    t0 = time.monotonic()
    workers = settings.workers or os.cpu_count() or 1
    early = headstart.start(inputs, target_dir, template, settings, workers, out)  # while transformers loads
    try:
        return _prepare(inputs, target_dir, template, out, settings, workers, t0, early)
    finally:
        if early is not None:
            early.stop()
        work.STATE.clear()


def _load_format(target_dir: Path, template: str | None) -> tuple[Any, str]:
    """AutoTokenizer's chat format and tokenizer fingerprint (imports transformers, hence torch)."""
    from nestling.data.chat import chat_format
    from nestling.targets.load import load_tokenizer, tokenizer_fingerprint

    tokenizer = load_tokenizer(target_dir)
    fmt = chat_format(tokenizer, template)
    return fmt, tokenizer_fingerprint(tokenizer, fmt.template)


def _prepare(inputs: list[Path], target_dir: Path, template: str | None, out: Path, settings: DataSettings,
             workers: int, t0: float, early: headstart.HeadStart | None) -> dict:
    from nestling.manifest import read_manifest

    verified = early.recall() if early is not None else None  # an earlier run checked the head start's tokenizer
    if verified is not None:
        fmt, tok_fp = early.guess, verified  # type: ignore[union-attr]
    else:
        fmt, tok_fp = _load_format(target_dir, template)
    input_fps = [hash_file(p) for p in inputs]
    fingerprint = fingerprint_of(tok_fp, fmt.template, settings, input_fps)  # type: ignore[union-attr]

    if (out / MANIFEST).exists():
        try:
            old = read_manifest(out, "data")
        except NestlingError:
            old = {}
        if old.get("fingerprint") == fingerprint and all(
                len(split_files(out, s)) == len(old.get("splits", {}).get(s, {}).get("files", [])) for s in SPLITS):
            log(f"[data] {out} is already complete for these inputs, tokenizer, template and settings; nothing to do.")
            return old
        log(f"[data] {out} holds a result for other inputs or settings; redoing it.")
    elif out.exists() and any(out.glob("*.parquet")):
        log(f"[data] {out} holds an incomplete result (no {MANIFEST}); redoing it.")

    if early is not None:
        records, reports, results = early.records, early.reports, early.take(fmt, tok_fp)
    else:
        records, reports, results = *read_inputs(inputs, settings.limit), None
    log(f"[data] read {len(records)} records from {len(inputs)} file(s); tokenizer and records ready after {time.monotonic() - t0:.1f}s; "
        f"loss mask by {fmt.mask_method}" + ("; tokenizer read from the target's files (verified earlier, cached)"  # type: ignore[union-attr]
                                            if verified is not None else ""))
    _clear(out)  # our own files only: `out` is a data folder (claimed in prepare_data)

    ranges = work.spans(len(records))
    workers = max(1, min(workers, len(ranges)))
    work.share(fmt, settings, records)

    counts: Counter = Counter()
    altered: Counter = Counter()
    rows_dropped: Counter = Counter()
    examples: dict[str, list[str]] = {}
    buffers: dict[str, list[Sample]] = {s: [] for s in SPLITS}
    stats: dict[str, dict[str, Any]] = {s: {"samples": 0, "tokens": 0, "supervised_tokens": 0, "files": []} for s in SPLITS}
    # With the head start's results, rates count from when its workers started.
    progress = Progress("data", total=len(records), unit="conv",
                        started=early.started if results is not None else time.monotonic())  # type: ignore[union-attr]

    def flush(split: str) -> None:
        if buffers[split]:
            path = out / f"{split}-{len(stats[split]['files']):05d}.parquet"
            write_shard(path, buffers[split])
            stats[split]["files"].append(path.name)
            buffers[split] = []

    def consume(outcomes: list[work.Outcome]) -> None:
        tokens = 0
        for o in outcomes:
            for a in o.altered:
                altered[a] += 1
            if o.drop is not None:
                counts[o.drop] += 1
                ex = examples.setdefault(o.drop, [])
                if len(ex) < EXAMPLES_PER_REASON:
                    ex.append(f"{o.sample_id}: {o.detail}" if o.detail else o.sample_id)
                continue
            rows_dropped.update(o.rows_dropped)
            # by the conversation's id: every row of a conversation lands in the same split
            split = "heldout" if heldout_of(o.sample_id, settings.seed, settings.held_out) else "train"
            st = stats[split]
            for r in o.rows:
                buffers[split].append(Sample(r.sample_id, o.source_index, r.input_ids, r.loss_mask))  # type: ignore[arg-type]
                st["samples"] += 1
                st["tokens"] += len(r.input_ids)
                st["supervised_tokens"] += int(r.loss_mask.sum())
                tokens += len(r.input_ids)
                if len(buffers[split]) >= settings.shard_samples:
                    flush(split)
        progress.update(len(outcomes), tokens=tokens, kept=stats["train"]["samples"] + stats["heldout"]["samples"])

    if results is not None:
        for outcomes in results:
            consume(outcomes)
    elif workers == 1:
        for span in ranges:
            consume(work.process(span))
    else:
        pool, results = work.start_pool(workers, target_dir, template, settings, records, ranges)
        try:
            for outcomes in results:
                consume(outcomes)
        finally:
            pool.terminate()
            pool.join()
    work.STATE.clear()
    for split in SPLITS:
        flush(split)
    progress.close()

    kept = stats["train"]["samples"] + stats["heldout"]["samples"]  # rows
    kept_records = len(records) - sum(counts.values())
    elapsed = time.monotonic() - t0
    manifest = write_manifest(
        out, "data", to_dict(settings),
        inputs={
            "tokenizer": tok_fp,
            "chat_template": hash_bytes(fmt.template.encode()),  # type: ignore[union-attr]
            "data": [{"path": str(p.resolve()), "fingerprint": fp, "format": r.format, "records": r.records,
                      "stopped": r.stopped} for p, fp, r in zip(inputs, input_fps, reports)],
        },
        target=str(target_dir.resolve()),
        tokenizer_fingerprint_version=TOKENIZER_FINGERPRINT_VERSION,
        fingerprint=fingerprint,
        mask_method=fmt.mask_method,  # type: ignore[union-attr]
        counts={"read": len(records), "kept": kept_records, "dropped": dict(sorted(counts.items())),
                "altered": dict(sorted(altered.items())), "rows": kept,
                "rows_dropped": dict(sorted(rows_dropped.items()))},
        examples=examples,
        splits=stats,
        elapsed_s=round(elapsed, 2),
    )
    dropped = sum(counts.values())
    log(f"[data] kept {kept_records}/{len(records)} conversations ({dropped} dropped"
        + (": " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) if counts else "") + ")"
        + (f"; {kept} rows, one per assistant turn ({sum(rows_dropped.values())} turns past max_length left out)"
           if settings.rows == "turn" else "")
        + f"; {stats['train']['tokens']:,} train tokens ({stats['train']['supervised_tokens']:,} supervised), "
        + f"{stats['heldout']['samples']} held out; {format_duration(elapsed)} -> {out}")
    return manifest


__all__ = ["prepare_data", "heldout_of"]
