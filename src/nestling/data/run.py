"""The data stage: chat files in, tokenized loss-masked parquet shards plus a manifest out.

`prepare_data` reads every input, normalizes each record (`normalize`), renders and masks it with
the target's chat template (`chat`), applies the length limit, assigns the held-out split and
writes shards (`shards`). Rendering and tokenizing run in worker processes over chunks of records
(`workers`); results come back in input order, so the output does not depend on the number of
workers, and they may start before this process has loaded transformers (`headstart`). Every
record that is not kept as-is is counted by reason in the manifest.

Read top to bottom: `prepare_data` checks the inputs and claims `out`; `_prepare` is the outline
(chat format, a finished result, the records, tokenizing into shards, the manifest), one function a step.
"""

from __future__ import annotations

from typing import Any

import os
import time
from collections.abc import Iterator
from pathlib import Path

from nestling.config import to_dict
from nestling.data import headstart
from nestling.data import workers as work
from nestling.data.dataset import SPLITS, split_files
from nestling.data.readers import check_input, read_inputs
from nestling.data.settings import DataSettings
from nestling.data.shards import Shards
from nestling.data.text import is_text
from nestling import outdir
from nestling.errors import NestlingError
from nestling.inputs import refuse_remote
from nestling.manifest import MANIFEST, hash_bytes, hash_file, hash_json, write_manifest
from nestling.progress import Progress, format_duration, log
from nestling.targets.load import TOKENIZER_FINGERPRINT_VERSION


def prepare_data(
    inputs: list[str | Path] | str | Path, target: str | Path, out: str | Path, settings: DataSettings | None = None
) -> dict:
    """Tokenize chat data for `target` into `out`; returns the manifest (see docs/data.md)."""
    from nestling.data.chat import read_template
    from nestling.targets.load import resolve_target

    settings = settings or DataSettings()
    paths = _input_paths(inputs)
    out = Path(out)
    target_dir = resolve_target(target)
    template = read_template(settings.chat_template) if settings.chat_template else None
    inputs_named = [("input file", p) for p in paths] + [
        ("target", target_dir),
        ("target", target),
        ("chat template", settings.chat_template),
    ]
    with outdir.claim(out, "data", inputs_named):
        return _prepare_claimed(paths, target_dir, template, out, settings)


def _input_paths(inputs: list[str | Path] | str | Path) -> list[Path]:
    """The input files as paths, checked before anything is written: none, a missing one or a folder is refused."""
    items = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    for p in items:
        refuse_remote(p, "input")  # a URL: never fetched (before Path() folds its "//")
    paths = [Path(p) for p in items]
    if not paths:
        raise NestlingError("no input files given")
    return [check_input(p) for p in paths]


def _prepare_claimed(
    inputs: list[Path], target_dir: Path, template: str | None, out: Path, settings: DataSettings
) -> dict:
    """`_prepare` with the head start begun first (workers tokenize while transformers loads); its
    workers and the shared worker state are gone afterwards, however the run ends."""
    t0 = time.monotonic()
    workers = settings.workers or os.cpu_count() or 1
    # while transformers loads; not with weights, which change the records it would tokenize
    # (the head start guesses a chat format: not in text mode)
    early = (
        None
        if settings.weights or settings.mode == "text"
        else headstart.start(inputs, target_dir, template, settings, workers, out)
    )
    try:
        return _prepare(inputs, target_dir, template, out, settings, workers, t0, early)
    finally:
        if early is not None:
            early.stop()
        work.STATE.clear()


def _prepare(
    inputs: list[Path],
    target_dir: Path,
    template: str | None,
    out: Path,
    settings: DataSettings,
    workers: int,
    t0: float,
    early: headstart.HeadStart | None,
) -> dict:
    """The stage's outline, once `out` is claimed: format, a finished result (then nothing to do), the
    records, tokenizing into shards, the manifest last."""
    fmt, tok_fp, verified = _chat_format(target_dir, template, early, settings.mode)
    input_fps = [hash_file(p) for p in inputs]
    fingerprint = fingerprint_of(tok_fp, fmt.template, settings, input_fps)
    done = _finished_result(out, fingerprint)
    if done is not None:
        return done

    records, reports, results = _read_records(inputs, settings, early, fmt, tok_fp)
    log(
        f"[data] read {len(records)} records from {len(inputs)} file(s); tokenizer and records ready after {time.monotonic() - t0:.1f}s; "
        f"loss mask by {fmt.mask_method}"
        + (
            "; documents packed into rows of max_length (text mode: the target has no chat template)"
            if is_text(fmt)
            else ""
        )
        + ("; tokenizer read from the target's files (verified earlier, cached)" if verified is not None else "")
    )
    _clear(out)  # our own files only: `out` is a data folder (claimed in prepare_data)
    shards = _tokenize(records, results, fmt, out, settings, workers, target_dir, template, early)
    if shards.rows == 0:  # later stages would run on nothing: no manifest says this folder is a result
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(shards.counts.items()))
        raise NestlingError(
            f"no conversation of {', '.join(map(str, inputs))} could be used: all {len(records)} records were "
            f"dropped ({reasons}); check the files' format (docs/data.md) or the settings"
        )

    elapsed = time.monotonic() - t0
    manifest = write_manifest(
        out,
        "data",
        to_dict(settings),
        inputs={
            "tokenizer": tok_fp,
            "chat_template": hash_bytes(fmt.template.encode()),
            "data": [
                {
                    "path": str(p.resolve()),
                    "fingerprint": fp,
                    "format": r.format,
                    "records": r.records,
                    "stopped": r.stopped,
                }
                for p, fp, r in zip(inputs, input_fps, reports)
            ],
        },
        target=str(target_dir.resolve()),
        tokenizer_fingerprint_version=TOKENIZER_FINGERPRINT_VERSION,
        fingerprint=fingerprint,
        mask_method=fmt.mask_method,
        mode="text" if is_text(fmt) else "chat",
        counts=shards.manifest_counts(len(records)),
        examples=shards.examples,
        splits=shards.stats,
        sources=shards.by_source,
        elapsed_s=round(elapsed, 2),
    )
    _log_summary(shards, len(records), settings, elapsed, out)
    return manifest


def _chat_format(
    target_dir: Path, template: str | None, early: headstart.HeadStart | None, mode: str = "auto"
) -> tuple[Any, str, str | None]:
    """(format, tokenizer fingerprint, remembered fingerprint or None): the head start's own format
    when an earlier run verified it equals AutoTokenizer's (no transformers import), else AutoTokenizer's
    (a chat format, or the text mode's: `text.data_format`)."""
    verified = early.recall() if early is not None else None
    if verified is not None:
        return early.guess, verified, verified  # type: ignore[union-attr]
    fmt, tok_fp = _load_format(target_dir, template, mode)
    return fmt, tok_fp, None


def _load_format(target_dir: Path, template: str | None, mode: str = "auto") -> tuple[Any, str]:
    """AutoTokenizer's format and tokenizer fingerprint (imports transformers, hence torch)."""
    from nestling.data.text import data_format
    from nestling.targets.load import load_tokenizer, tokenizer_fingerprint

    tokenizer = load_tokenizer(target_dir)
    fmt = data_format(tokenizer, template, mode)
    # text mode: the tokenizer as later stages load it (its own template, if any, unused)
    return fmt, tokenizer_fingerprint(tokenizer, None if is_text(fmt) else fmt.template)


def fingerprint_of(tokenizer_fp: str, template: str, settings: DataSettings, input_fps: list[str]) -> str:
    """What the result depends on: tokenizer, template, inputs and settings, less those that do not
    change the samples (workers, shard size)."""
    relevant = {k: v for k, v in to_dict(settings).items() if k not in ("workers", "shard_samples")}
    if relevant.get("mode") == "auto":  # added later: auto's choice follows from the tokenizer and template hashed here
        del relevant["mode"]
    return hash_json(
        {
            "tokenizer": tokenizer_fp,
            "template": hash_bytes(template.encode()),
            "settings": relevant,
            "inputs": input_fps,
        }
    )


def _finished_result(out: Path, fingerprint: str) -> dict | None:
    """The manifest of a complete result in `out` for this very fingerprint (the run is a no-op), else None;
    says why an existing result is redone."""
    from nestling.manifest import read_manifest

    if (out / MANIFEST).exists():
        try:
            old = read_manifest(out, "data")
        except NestlingError:
            old = {}
        if old.get("fingerprint") == fingerprint and all(
            len(split_files(out, s)) == len(old.get("splits", {}).get(s, {}).get("files", [])) for s in SPLITS
        ):
            log(f"[data] {out} is already complete for these inputs, tokenizer, template and settings; nothing to do.")
            return old
        log(f"[data] {out} holds a result for other inputs or settings; redoing it.")
    elif out.exists() and any(out.glob("*.parquet")):
        log(f"[data] {out} holds an incomplete result (no {MANIFEST}); redoing it.")
    return None


def _clear(out: Path) -> None:
    """Remove a previous (incomplete or outdated) result: the manifest first, so a crash stays incomplete."""
    (out / MANIFEST).unlink(missing_ok=True)
    for split in SPLITS:
        for f in split_files(out, split):
            f.unlink()
    for f in out.glob(".*.parquet.tmp"):
        f.unlink()


def _read_records(
    inputs: list[Path], settings: DataSettings, early: headstart.HeadStart | None, fmt: Any, tok_fp: str
) -> tuple[list, list, Iterator[list[work.Outcome]] | None]:
    """(records, per-file reports, the head start's results or None): the head start already read the
    inputs; its results count only if its format is `fmt` (else its workers are stopped)."""
    if early is not None:
        if is_text(fmt):  # the head start's workers render chats: AutoTokenizer has no template
            early.stop()
            return early.records, early.reports, None
        return early.records, early.reports, early.take(fmt, tok_fp)
    records, reports = read_inputs(inputs, settings.limit)
    if settings.weights:
        records = _weighed(records, inputs, settings)
    return records, reports, None


def _weighed(records: list, inputs: list[Path], settings: DataSettings) -> list:
    """The records repeated or sampled by `settings.weights` (mixing.py), said in one line per weighed input."""
    from nestling.data.mixing import input_weights, source_of, weigh, weighed_count
    from nestling.data.readers import sample_names

    names = sample_names(inputs)
    weights = input_weights(inputs, settings.weights)
    groups: dict[str, list] = {n: [] for n in names}
    for rec in records:
        groups[source_of(rec[0])].append(rec)
    out = weigh([groups[n] for n in names], weights, settings.seed)
    for n, w in zip(names, weights):
        if w != 1.0:
            log(
                f"[data] weight {w:g} on {n}: {len(groups[n]):,} conversations used as {weighed_count(len(groups[n]), w):,}"
            )
    return out


def _tokenize(
    records: list,
    results: Iterator[list[work.Outcome]] | None,
    fmt: Any,
    out: Path,
    settings: DataSettings,
    workers: int,
    target_dir: Path,
    template: str | None,
    early: headstart.HeadStart | None,
) -> Shards:
    """Every record rendered, tokenized and written to shards in input order: from the head start's
    `results` when kept, else in this process (one worker) or a fresh pool of worker processes."""
    ranges = work.spans(len(records))
    workers = max(1, min(workers, len(ranges)))
    work.share(fmt, settings, records)
    shards = Shards(out, settings, pack=is_text(fmt))
    # With the head start's results, rates count from when its workers started.
    started = early.started if results is not None else time.monotonic()  # type: ignore[union-attr]
    progress = Progress("data", total=len(records), unit="conv", started=started)

    def consume(outcomes: list[work.Outcome]) -> None:
        tokens = shards.add(outcomes)
        progress.update(len(outcomes), tokens=tokens, kept=shards.rows)

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
    shards.close()
    progress.close()
    return shards


CUT_HINT = 0.10  # share of the assistant tokens past max_length above which the log suggests a longer one


def cut_hint(cut: int, kept: int, max_length: int, what: str = "assistant tokens") -> str | None:
    """The log line for a run that leaves more than CUT_HINT of its assistant tokens past max_length, else None."""
    share = cut / max(cut + kept, 1)
    if share <= CUT_HINT:
        return None
    return (
        f"[data] {share:.0%} of the {what} ({cut:,}) lie past max_length={max_length} and are not trained "
        "on. A longer max_length keeps them, where the training device's memory allows the longest rows "
        "(measured on SmolLM2 at equal conversations: rows up to 3,072 tokens instead of 1,024 kept 2.4x the "
        "tokens and gave +0.09 to +0.12 tokens per target forward in vLLM; docs/train.md)"
    )


def _log_summary(shards: Shards, read: int, settings: DataSettings, elapsed: float, out: Path) -> None:
    """One line for the user: what was kept and dropped (by reason), rows, tokens, held out, time;
    a second where much of the supervision lies past max_length (`cut_hint`)."""
    counts, stats = shards.counts, shards.stats
    dropped = sum(counts.values())
    kept = sum(stats[s]["supervised_tokens"] for s in SPLITS)
    log(
        f"[data] kept {read - dropped}/{read} {'documents' if shards.pack else 'conversations'} ({dropped} dropped"
        + (": " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) if counts else "")
        + ")"
        + (
            f"; {shards.rows} rows, one per assistant turn ({sum(shards.rows_dropped.values())} turns past max_length left out)"
            if settings.rows == "turn" and not shards.pack
            else f"; {shards.rows} packed rows"
            if shards.pack
            else ""
        )
        + f"; {stats['train']['tokens']:,} train tokens ({stats['train']['supervised_tokens']:,} supervised), "
        + f"{stats['heldout']['samples']} held out; {format_duration(elapsed)} -> {out}"
    )
    if len(shards.by_source) > 1:
        from nestling.data.mixing import share_lines

        for line in share_lines(shards.by_source, "documents" if shards.pack else "conversations"):
            log(line)
    hint = cut_hint(shards.supervised_cut, kept, settings.max_length, "tokens" if shards.pack else "assistant tokens")
    if hint:
        log(hint)


__all__ = ["prepare_data"]
