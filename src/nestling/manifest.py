"""Manifests, fingerprints and atomic writes: every stage's output carries where it came from.

A stage folder is complete when its `manifest.json` exists; it is written last, atomically,
so a crash never leaves a folder that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from nestling import __version__
from nestling.errors import NestlingError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def hash_bytes(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()[:16]


def hash_json(obj: Any) -> str:
    return hash_bytes(json.dumps(obj, sort_keys=True, default=str).encode())


def hash_file(path: Path, sample_bytes: int = 1 << 20) -> str:
    """Fingerprint a file by size plus its first and last MiB (fast on multi-GB weights)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(sample_bytes))
        if size > 2 * sample_bytes:
            f.seek(size - sample_bytes)
            h.update(f.read(sample_bytes))
    return h.hexdigest()[:16]


def hash_files(paths: list[Path]) -> str:
    return hash_bytes(*(f"{Path(p).name}:{hash_file(p)}".encode() for p in sorted(paths)))


def write_manifest(out_dir: Path, stage: str, settings: dict, inputs: dict, **extra: Any) -> dict:
    """Write `out_dir/manifest.json` (atomically, last) and return it."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "nestling_version": __version__,
        "stage": stage,
        "settings": settings,
        "inputs": inputs,
        **extra,
    }
    atomic_write_json(Path(out_dir) / MANIFEST, manifest)
    return manifest


def read_manifest(stage_dir: Path, stage: str | None = None) -> dict:
    """Read a stage folder's manifest, with an error that says which stage to run when it is missing."""
    path = Path(stage_dir) / MANIFEST
    if not path.exists():
        what = f"a complete '{stage}' output" if stage else "a nestling output folder"
        raise NestlingError(
            f"{stage_dir} is not {what}: {MANIFEST} is missing (was the stage interrupted? run it again)."
        )
    from nestling.inputs import read_json

    redo = f"run `nestling {stage}` again into a new folder" if stage else "run the stage that wrote it again"
    manifest = read_json(path, "manifest", hint=f"the folder was damaged or edited: {redo}")
    if stage and manifest.get("stage") != stage:
        raise NestlingError(f"{stage_dir} holds output of stage '{manifest.get('stage')}', expected '{stage}'.")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise NestlingError(
            f"{stage_dir} was written by a newer nestling (format {manifest['format_version']}); upgrade nestling."
        )
    return manifest
