"""The data stage: chat files in, tokenized loss-masked parquet shards plus a manifest out.

`prepare_data` reads every input, normalizes each record (`normalize`), renders and masks it with
the target's chat template (`chat`), applies the length limit, assigns the held-out split and
writes shards (`dataset.write_shard`). Rendering and tokenizing run in worker processes over
chunks of records; results come back in input order, so the output does not depend on the
number of workers. Every record that is not kept as-is is counted by reason in the manifest.
"""

from __future__ import annotations

from typing import Any

import hashlib
import multiprocessing as mp
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nestling.config import to_dict
from nestling.data.dataset import SPLITS, Sample, split_files, write_shard
from nestling.data.readers import InputReport, RawRecord, error_reason, read_input
from nestling.data.settings import DataSettings
from nestling import outdir
from nestling.errors import NestlingError
from nestling.manifest import MANIFEST, hash_bytes, hash_file, hash_json, write_manifest
from nestling.progress import Progress, format_duration, log
from nestling.targets.load import TOKENIZER_FINGERPRINT_VERSION

CHUNK = 64  # conversations per worker task: large enough for batched tokenization, small for balance
EXAMPLES_PER_REASON = 3


@dataclass
class Row:
    """One sample written to a shard: a whole conversation, or (rows=turn) the prefix through one turn."""

    sample_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray


@dataclass
class Outcome:
    """What became of one input record: its rows, or the reason it was dropped."""

    sample_id: str
    source_index: int
    rows: list[Row] = field(default_factory=list)
    drop: str | None = None
    detail: str = ""
    altered: list[str] = field(default_factory=list)
    rows_dropped: list[str] = field(default_factory=list)  # rows=turn: why a turn's row was left out


# Worker state: set in the parent before the pool forks (or by the initializer under spawn).
_STATE: dict = {}


def _init_worker(target_dir: str, template: str | None, settings: DataSettings, records=None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if "fmt" not in _STATE:
        from transformers import AutoTokenizer

        from nestling.data.chat import chat_format

        _STATE["fmt"] = chat_format(AutoTokenizer.from_pretrained(target_dir), template)
    _STATE["settings"] = settings
    if records is not None:
        _STATE["records"] = records


def _process(span: tuple[int, int]) -> list[Outcome]:
    """Normalize, render, tokenize and length-limit records [start, end) of the shared record list."""
    from nestling.data.chat import encode_conversations
    from nestling.data.normalize import normalize_record

    settings: DataSettings = _STATE["settings"]
    records: list[tuple[str, RawRecord]] = _STATE["records"][span[0]:span[1]]
    outcomes: list[Outcome] = []
    todo: list[tuple[Outcome, list[dict]]] = []
    for sid, rec in records:
        o = Outcome(sid, rec.index)
        outcomes.append(o)
        if rec.data is None:
            o.drop, o.detail = error_reason(rec), rec.error or ""
            continue
        norm = normalize_record(rec.data, settings.role_map, settings.system_prompt)
        o.altered = list(norm.altered)
        if norm.messages is None:
            o.drop, o.detail = norm.drop, norm.detail
            continue
        todo.append((o, norm.messages))
    if todo:
        encoded = encode_conversations(_STATE["fmt"], [m for _, m in todo], settings.last_turn_only,
                                       template_timeout=settings.template_timeout)
        for (o, _), enc in zip(todo, encoded):
            o.altered += enc.altered
            if enc.drop is not None:
                o.drop, o.detail = enc.drop, enc.detail
                continue
            _add_rows(o, enc, settings)
    for o in outcomes:
        o.altered = sorted(set(o.altered))
    return outcomes


def _candidate_rows(o: Outcome, enc, rows: str) -> list[tuple[str, list[int], np.ndarray]]:
    """(sample_id, ids, mask) before the length limit: the conversation, or one row per supervised turn.

    A turn's row is the conversation's tokens through the turn's end-of-turn token (what the engine
    has seen when the turn ends; the formatting after it is never supervised), supervising that turn
    only; its id is the conversation's plus `#k`, k counting the supervised turns from 0."""
    if rows == "conversation":
        return [(o.sample_id, enc.input_ids, enc.loss_mask)]
    out = []
    for k, (first, last) in enumerate(enc.turns):
        mask = np.zeros(last + 1, dtype=np.int8)
        mask[first:] = 1
        out.append((f"{o.sample_id}#{k}", enc.input_ids[: last + 1], mask))
    return out


def _add_rows(o: Outcome, enc, settings: DataSettings) -> None:
    """Length-limit the record's rows into `o.rows`. rows=turn: a row that does not fit is left out
    (counted in `o.rows_dropped`); the record is dropped only when none is left, for the first row's reason."""
    first_drop: tuple[str, str] | None = None
    for sid, ids, mask in _candidate_rows(o, enc, settings.rows):
        if len(ids) > settings.max_length:
            if settings.overflow == "drop":
                first_drop = first_drop or ("too_long", f"{len(ids)} tokens > max_length {settings.max_length}")
                o.rows_dropped.append("too_long")
                continue
            ids, mask = ids[: settings.max_length], mask[: settings.max_length]
            o.altered.append("truncated_to_max_length")
            if not mask.any():
                first_drop = first_drop or ("no_supervised_tokens_after_truncation",
                                            f"the first {settings.max_length} tokens hold no assistant reply")
                o.rows_dropped.append("no_supervised_tokens_after_truncation")
                continue
        if not mask.any():
            first_drop = first_drop or ("no_supervised_tokens", "")
            o.rows_dropped.append("no_supervised_tokens")
            continue
        o.rows.append(Row(sid, np.fromiter(ids, dtype=np.int32, count=len(ids)), mask))  # ~3x faster than asarray for a list
    if not o.rows:
        assert first_drop is not None
        o.drop, o.detail = first_drop
        o.rows_dropped = []  # the record's drop says it
    elif o.rows_dropped:
        o.altered.append("turn_rows_past_max_length_dropped")


def heldout_of(sample_id: str, seed: int, fraction: float) -> bool:
    """Deterministic split: a keyed hash of the sample id, so it never depends on order or workers."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=8).digest(), "big")
    return h / 2**64 < fraction


def _sample_names(inputs: list[Path]) -> list[str]:
    names = [p.name for p in inputs]
    return [n if names.count(n) == 1 else f"{k}-{n}" for k, n in enumerate(names)]


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


def _read_inputs(inputs: list[Path], settings: DataSettings) -> tuple[list[tuple[str, RawRecord]], list[InputReport]]:
    records: list[tuple[str, RawRecord]] = []
    reports: list[InputReport] = []
    for p, name in zip(inputs, _sample_names(inputs)):
        recs, report = read_input(p, settings.limit)
        if report.stopped:
            log(f"[data] warning: {p}: reading stopped early at {report.stopped}; kept the {len(recs) - 1} complete records before it")
        reports.append(report)
        records += [(f"{name}:{r.index}", r) for r in recs]
    return records, reports


def _spans(n: int) -> list[tuple[int, int]]:
    """Record ranges [start, end) of CHUNK records: the unit of work a worker takes."""
    return [(i, min(i + CHUNK, n)) for i in range(0, n, CHUNK)]


def _start_pool(workers: int, target_dir: Path, template: str | None, settings: DataSettings, records, spans):
    """Worker processes over the record spans; returns (pool, iterator of outcome lists in input order)."""
    if "fork" in mp.get_all_start_methods():
        pool = mp.get_context("fork").Pool(workers, _init_worker, (str(target_dir), template, settings))
    else:  # spawn: each worker loads the tokenizer and receives the records
        pool = mp.get_context("spawn").Pool(workers, _init_worker, (str(target_dir), template, settings, records))
    return pool, pool.imap(_process, spans, chunksize=1)


@dataclass
class _HeadStart:
    """Workers started on a tokenizer read from the target's files, before AutoTokenizer was loaded."""

    guess: object  # the ChatFormat they use
    records: list
    reports: list
    pool: object
    results: object
    started: float = field(default_factory=time.monotonic)


def _head_start(inputs: list[Path], target_dir: Path, template: str | None, settings: DataSettings,
                workers: int) -> _HeadStart | None:
    """Read the inputs and fork the workers on `FileTokenizer(target)` (no transformers import needed)."""
    from nestling.data.chat import FileTokenizer, chat_format

    try:
        guess = chat_format(FileTokenizer(target_dir), template)
    except Exception:  # noqa: BLE001 - only a head start: anything unusual means "wait for AutoTokenizer"
        return None
    records, reports = _read_inputs(inputs, settings)
    spans = _spans(len(records))
    workers = min(workers, len(spans))
    if workers < 2:
        return None
    _STATE.clear()
    _STATE.update(fmt=guess, settings=settings, records=records)
    return _HeadStart(guess, records, reports, *_start_pool(workers, target_dir, template, settings, records, spans))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx")
MATCH_FORMAT = 3  # bump when FileTokenizer, chat_format, format_key or tokenizer_fingerprint change meaning


def _match_record(target_dir: Path, template: str | None) -> Path | None:
    """Where a verified "FileTokenizer == AutoTokenizer" result for these exact files is remembered.

    Keyed by the full content of every non-weight file in the target folder (AutoTokenizer reads
    config.json, tokenizer files, templates), the template override, and the nestling, transformers
    and tokenizers versions: any change means verifying again. None when the cache is unusable."""
    from importlib.metadata import version

    import nestling
    from nestling.assets import cache_dir

    try:
        files = sorted(f for f in target_dir.iterdir() if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES))
        content = {f.name: hash_bytes(f.read_bytes()) if f.stat().st_size < 64 << 20 else hash_file(f) for f in files}
        key = hash_json({"files": content, "template": template, "format": MATCH_FORMAT, "fingerprint": TOKENIZER_FINGERPRINT_VERSION,
                         "versions": [nestling.__version__, version("transformers"), version("tokenizers")]})
        return cache_dir() / "tokenizer-match" / f"{key}.json"
    except OSError:
        return None


def _read_match(record: Path | None, guess_key: tuple) -> str | None:
    """The remembered tokenizer fingerprint, if the record is whole and was made for this very guess
    (`guess_key`: the head start's `format_key`)."""
    import json

    if record is None or not record.exists():
        return None
    try:
        d = json.loads(record.read_text())
        if d.get("format_hash") == hash_json(guess_key) and isinstance(d.get("tokenizer_fingerprint"), str):
            return d["tokenizer_fingerprint"]
    except (OSError, ValueError, AttributeError):
        pass
    return None  # damaged or stale: verify again (and rewrite it)


def _remember_match(record: Path, guess_key: tuple, tok_fp: str, target_dir: Path) -> None:
    from nestling.manifest import atomic_write_json

    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(record, {"tokenizer_fingerprint": tok_fp, "format_hash": hash_json(guess_key),
                                   "target": str(target_dir)})
    except OSError as e:  # only a speed-up: the next run verifies again
        log(f"[data] could not remember the tokenizer check in {record} ({e}); the next run checks again")


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

    # Head start: with several workers and no previous result that could make this run a no-op, read
    # the inputs and start the workers on a tokenizer read from the target's files while this process
    # imports transformers (~8 s: it imports torch) and loads AutoTokenizer. Their results are used
    # only if AutoTokenizer's tokenizer and template are identical (format_key); otherwise redone.
    t0 = time.monotonic()
    workers = settings.workers or os.cpu_count() or 1
    early = None
    if workers > 1 and "fork" in mp.get_all_start_methods() and not (out / MANIFEST).exists():
        early = _head_start(inputs, target_dir, template, settings, workers)
    try:
        return _prepare(inputs, target_dir, template, out, settings, workers, t0, early)
    finally:
        if early is not None:
            early.pool.terminate()  # type: ignore[attr-defined]
            early.pool.join()  # type: ignore[attr-defined]
        _STATE.clear()


def _prepare(inputs: list[Path], target_dir: Path, template: str | None, out: Path, settings: DataSettings,
             workers: int, t0: float, early: _HeadStart | None) -> dict:
    from nestling.data.chat import chat_format, format_key
    from nestling.manifest import read_manifest

    # When an earlier run verified that AutoTokenizer builds exactly what the head start read from
    # these files, skip AutoTokenizer: importing it (torch) takes ~8 CPU-s from the workers.
    guess_key = format_key(early.guess) if early is not None else None  # type: ignore[arg-type]
    record = _match_record(target_dir, template) if early is not None else None
    verified = _read_match(record, guess_key) if guess_key is not None else None
    if verified is not None:
        fmt, tok_fp = early.guess, verified  # type: ignore[union-attr]
    else:
        from nestling.targets.load import load_tokenizer, tokenizer_fingerprint

        tokenizer = load_tokenizer(target_dir)
        fmt = chat_format(tokenizer, template)
        tok_fp = tokenizer_fingerprint(tokenizer, fmt.template)
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

    results = None
    if early is not None:
        records, reports = early.records, early.reports
        if verified is not None or guess_key == format_key(fmt):  # type: ignore[arg-type]
            results = early.results
            if verified is None and record is not None:
                _remember_match(record, guess_key, tok_fp, target_dir)  # type: ignore[arg-type]
        else:
            log("[data] AutoTokenizer's tokenizer or template differs from the one read from the target's files; "
                "the workers start over with AutoTokenizer's")
            early.pool.terminate()  # type: ignore[attr-defined]
            early.pool.join()  # type: ignore[attr-defined]
    else:
        records, reports = _read_inputs(inputs, settings)
    log(f"[data] read {len(records)} records from {len(inputs)} file(s); tokenizer and records ready after {time.monotonic() - t0:.1f}s; "
        f"loss mask by {fmt.mask_method}" + ("; tokenizer read from the target's files (verified earlier, cached)"  # type: ignore[union-attr]
                                            if verified is not None else ""))
    _clear(out)  # our own files only: `out` is a data folder (claimed in prepare_data)

    spans = _spans(len(records))
    workers = max(1, min(workers, len(spans)))
    _STATE.clear()
    _STATE.update(fmt=fmt, settings=settings, records=records)

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

    def consume(outcomes: list[Outcome]) -> None:
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
        for outcomes in results:  # type: ignore[attr-defined]
            consume(outcomes)
    elif workers == 1:
        for span in spans:
            consume(_process(span))
    else:
        pool, results = _start_pool(workers, target_dir, template, settings, records, spans)
        try:
            for outcomes in results:
                consume(outcomes)
        finally:
            pool.terminate()
            pool.join()
    _STATE.clear()
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


__all__ = ["prepare_data", "DataSettings", "heldout_of"]
