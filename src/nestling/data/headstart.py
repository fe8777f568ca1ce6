"""The data stage's head start: workers tokenize while the main process loads transformers.

Importing transformers (it imports torch) and loading AutoTokenizer takes ~8 s. With several workers
and no previous result that could make the run a no-op, the inputs are read and the workers forked
first, on a tokenizer read straight from the target's files (`chat.FileTokenizer`). Their results
are used only if AutoTokenizer's tokenizer and template turn out identical (`chat.format_key`);
otherwise the workers stop and the run starts over with AutoTokenizer's.

Once a run has verified that identity, it is remembered (in the asset cache, keyed by every
non-weight file of the target and the library versions), and later runs skip AutoTokenizer: its
import would take ~8 CPU-s from the workers.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.pool import Pool
from pathlib import Path

from nestling.data import workers as work
from nestling.data.readers import read_inputs
from nestling.data.settings import DataSettings
from nestling.manifest import MANIFEST, hash_bytes, hash_file, hash_json
from nestling.progress import log
from nestling.targets.load import TOKENIZER_FINGERPRINT_VERSION

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx")
MATCH_FORMAT = 3  # bump when FileTokenizer, chat_format, format_key or tokenizer_fingerprint change meaning


@dataclass
class HeadStart:
    """Workers started on a tokenizer read from the target's files, before AutoTokenizer was loaded."""

    guess: object  # the ChatFormat they use
    records: list
    reports: list
    pool: Pool
    results: Iterator[list[work.Outcome]]
    target_dir: Path
    template: str | None
    started: float = field(default_factory=time.monotonic)
    guess_key: tuple | None = None  # format_key(guess), set by `recall`
    record: Path | None = None  # where a verified match is remembered, set by `recall`
    verified: str | None = None  # the remembered tokenizer fingerprint, set by `recall`

    def recall(self) -> str | None:
        """The tokenizer fingerprint an earlier run verified for this very guess; None: AutoTokenizer decides."""
        from nestling.data.chat import format_key

        self.guess_key = format_key(self.guess)  # type: ignore[arg-type]
        self.record = match_record(self.target_dir, self.template)
        self.verified = _read_match(self.record, self.guess_key)
        return self.verified

    def take(self, fmt, tok_fp: str) -> Iterator[list[work.Outcome]] | None:
        """The workers' results when AutoTokenizer's `fmt` is the guess (remembered for the next run);
        otherwise None, and the workers are stopped."""
        from nestling.data.chat import format_key

        if self.verified is not None or self.guess_key == format_key(fmt):
            if self.verified is None and self.record is not None:
                _remember_match(self.record, self.guess_key, tok_fp, self.target_dir)  # type: ignore[arg-type]
            return self.results
        log(
            "[data] AutoTokenizer's tokenizer or template differs from the one read from the target's files; "
            "the workers start over with AutoTokenizer's"
        )
        self.stop()
        return None

    def stop(self) -> None:
        self.pool.terminate()
        self.pool.join()


def start(
    inputs: list[Path], target_dir: Path, template: str | None, settings: DataSettings, workers: int, out: Path
) -> HeadStart | None:
    """Read the inputs and fork the workers on `FileTokenizer(target)` (no transformers import needed);
    None when it cannot help: one worker, no fork, or a finished result in `out` (maybe a no-op)."""
    if workers <= 1 or "fork" not in mp.get_all_start_methods() or (out / MANIFEST).exists():
        return None
    from nestling.data.chat import FileTokenizer, chat_format

    try:
        guess = chat_format(FileTokenizer(target_dir), template)
    except Exception:  # noqa: BLE001 - only a head start: anything unusual means "wait for AutoTokenizer"
        return None
    records, reports = read_inputs(inputs, settings.limit)
    ranges = work.spans(len(records))
    workers = min(workers, len(ranges))
    if workers < 2:
        return None
    work.share(guess, settings, records)
    pool, results = work.start_pool(workers, target_dir, template, settings, records, ranges)
    return HeadStart(guess, records, reports, pool, results, target_dir, template)


def match_record(target_dir: Path, template: str | None) -> Path | None:
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
        key = hash_json(
            {
                "files": content,
                "template": template,
                "format": MATCH_FORMAT,
                "fingerprint": TOKENIZER_FINGERPRINT_VERSION,
                "versions": [nestling.__version__, version("transformers"), version("tokenizers")],
            }
        )
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
        atomic_write_json(
            record, {"tokenizer_fingerprint": tok_fp, "format_hash": hash_json(guess_key), "target": str(target_dir)}
        )
    except OSError as e:  # only a speed-up: the next run verifies again
        log(f"[data] could not remember the tokenizer check in {record} ({e}); the next run checks again")
