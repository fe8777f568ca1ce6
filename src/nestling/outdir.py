"""Output folders: which folder a stage may write into, what it may delete there, one writer at a time.

Every stage (and `nestling run`) goes through here before it writes, so the rules hold everywhere:

- A stage writes into `--out` only when it is new, empty, or already a folder of the *same* stage
  (it carries that stage's marker `.nestling-stage.json`, written when the folder is claimed, or
  that stage's `manifest.json`). Anything else is refused: nestling never writes over, nor deletes,
  files it did not write.
- `--out` may not be an input of the stage, lie inside one, or contain one (the data files, the
  target, the folder of the previous stage): writing there could overwrite or delete the input.
- Deleting is limited to the names the stage writes (`OWNS`), in a folder that is the stage's.
- One process writes a folder at a time (`lock`): a second gets a clear error, not a mixed folder.
See docs/safety.md for the guarantees this gives the user.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Union

from nestling.errors import NestlingError
from nestling.manifest import MANIFEST, atomic_write_json

MARKER = ".nestling-stage.json"
LOCK = ".lock"
Inputs = Union[Mapping[str, "str | Path | None"], Iterable[tuple[str, "str | Path | None"]]]
RUN_FILE = "run.json"  # a `nestling run` folder is recognised by it (see pipeline/run.py)

# What each stage writes into its folder (glob patterns relative to it). Only these names are ever
# deleted, and only in a folder that carries the stage's marker or manifest. Every stage also owns
# COMMON: its manifest, marker and lock, progress.json, and the temporary names of atomic writes.
COMMON = (MANIFEST, MARKER, LOCK, "progress.json", f".{MANIFEST}.*.tmp", f".{MARKER}.*.tmp")
OWNS: dict[str, tuple[str, ...]] = {
    "regenerate": tuple(
        f"{sub}{name}"
        # sampled/: the `sampled` pass (regenerate/settings.py SAMPLED); */: one input's regeneration in a
        # run of several inputs (pipeline/stages.py regenerate_dirs), a regenerate folder of its own
        for sub in ("", "sampled/", "*/", "*/sampled/")
        # text.jsonl: the text mode's continuations (regenerate/text.py)
        for name in ("messages.jsonl", "text.jsonl", "failed.jsonl", "partial.jsonl", "state.json", ".state.json.*.tmp")
        + ((MANIFEST, f".{MANIFEST}.*.tmp") if sub else ())
        + ((MARKER, LOCK, "progress.json", f".{MARKER}.*.tmp") if sub == "*/" else ())
    ),
    "data": ("train-*.parquet", "heldout-*.parquet", ".train-*.parquet.tmp", ".heldout-*.parquet.tmp"),
    "capture": tuple(
        f"{split}/{name}"
        for split in ("train", "heldout")
        for name in (
            "shard-*.safetensors",
            ".shard-*.safetensors.tmp",
            "index.json",
            ".index.json.*.tmp",
            "checksums.jsonl",
            ".checksums.jsonl.*.tmp",
        )
    ),
    "train": (
        "draft_config.json",
        "vocab.safetensors",
        ".vocab.safetensors.tmp",
        "model.safetensors",
        ".model.safetensors.tmp",
        "metrics.jsonl",
        "plot.png",
        ".plot.png.tmp.png",
        "checkpoints/step-*",
        "checkpoints/.tmp-step-*",
        "tensorboard/events.out.tfevents.*",
    ),
    "export": ("config.json", "model.safetensors", ".export-build-*"),
    "eval": ("report.json", ".report.json.*.tmp", "report.md", "acceptance.png"),
    "doctor": ("conversations.json",),  # `nestling doctor --scratch DIR`: its dry run's input
    # the run folder's own files (its stage folders are each their stage's); the dry run's scratch too
    "run": (
        RUN_FILE,
        f".{RUN_FILE}.*.tmp",
        "run.log",
        "state/*.json",
        "state/.*.tmp",
        "prompts.jsonl",
        "estimate.json",
        ".estimate.json.*.tmp",
    ),
}


# ---- where --out may be ------------------------------------------------------------------------


def check_apart(out: Path, inputs: Inputs, flag: str = "--out") -> None:
    """Refuse an output folder that is an input, lies inside one or contains one.

    `inputs` names what each input is ("data folder", "target") and its path; None paths are skipped."""
    o = Path(out).resolve()
    for what, path in inputs.items() if isinstance(inputs, Mapping) else inputs:
        if path is None or not Path(path).exists():
            continue
        p = Path(path).resolve()
        relation = "is" if o == p else "lies inside" if p in o.parents else "contains" if o in p.parents else None
        if relation:
            raise NestlingError(
                f"{flag} {out} {relation} the {what} {path}: writing there could overwrite or delete an input. "
                f"Choose an {flag} folder apart from the stage's inputs (e.g. a new folder beside them)."
            )


def owner(folder: Path) -> str | None:
    """The stage whose folder this is (by marker, else by manifest; "run" for a run folder), or None."""
    folder = Path(folder)
    if (folder / RUN_FILE).is_file() and not (folder / MARKER).exists():
        return "run"
    for name in (MARKER, MANIFEST):
        try:
            stage = json.loads((folder / name).read_text()).get("stage")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(stage, str):
            return stage
    return None


def check_ours(out: Path, stage: str, flag: str = "--out", fix: str | None = None) -> None:
    """Refuse a path that is a file, or a non-empty folder that is not this stage's. `fix` says what to do."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NestlingError(f"{flag} {out} exists and is not a folder; give a folder path")
    # empty, or only what a claim in progress writes first (another process is about to hold the lock)
    if not out.exists() or all(_claiming(p.name) for p in out.iterdir()):
        return
    found = owner(out)
    if found == stage:
        return
    names = sorted(p.name for p in out.iterdir())
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    what = (
        f"holds the output of `nestling {found}`, not of `nestling {stage}`"
        if found
        else "is not empty and was not written by nestling"
    )
    raise NestlingError(
        f"{flag} {out} {what} (it holds {shown}). nestling never writes over or deletes files it "
        f"did not write: {fix or f'give an empty or new {flag} folder'}."
    )


def check_links(folder: Path, flag: str = "--out") -> None:
    """Refuse a folder that holds a symbolic link leading out of it (a planted `checkpoints -> ~/work`, a
    run folder copied with its links): nestling writes and deletes through the names it owns, and would
    reach what the link points at. Links that stay inside the folder are fine; `folder` itself may be one."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    root = folder.resolve()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                continue
            target = p.resolve()
            if target != root and root not in target.parents:
                raise NestlingError(
                    f"{flag} {folder} holds {p}, a symbolic link to {os.readlink(p)}, outside it: nestling writes and "
                    "deletes only inside its folders and does not follow links out of them. Replace the link with "
                    "the folder or file itself, or choose another folder."
                )


# ---- claiming, marking, locking ------------------------------------------------------------------


def _claiming(name: str) -> bool:
    """The names `claim` writes before the marker is in place: the lock, the marker's temporary file."""
    return name == LOCK or fnmatch.fnmatch(name, f".{MARKER}.*.tmp")


def mark(out: Path, stage: str) -> None:
    """Record that `out` is `stage`'s folder (after `check_ours`)."""
    if owner(out) != stage or not (Path(out) / MARKER).exists():
        atomic_write_json(Path(out) / MARKER, {"stage": stage})


# What the lock file says about its holder: "pid N on HOST since TIME: COMMAND" (`holder_line`).
COMMAND: list[str] = []  # the command line this process runs (set by cli.main; sys.argv otherwise)
_HOLDER = re.compile(r"pid (\d+) on (\S+?)(?: since [^:]+:\d\d:\d\d)?(?:: (.*))?$")


def holder_line() -> str:
    """Who holds a lock: this process's id, host, start of holding and command line."""
    argv = COMMAND or [Path(sys.argv[0]).name, *sys.argv[1:]]
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"pid {os.getpid()} on {socket.gethostname()} since {since}: {shlex.join(argv)}"


def _fd_holders(path: Path) -> list[int]:
    """Processes on this machine with `path` open (Linux /proc; [] elsewhere): who holds an flock."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            for fd in (d / "fd").iterdir():
                try:
                    s = os.stat(fd)
                except OSError:
                    continue
                if (s.st_ino, s.st_dev) == (st.st_ino, st.st_dev):
                    found.append(int(d.name))
                    break
        except OSError:
            continue
    return [p for p in found if p != os.getpid()]


def _cmdline(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    text = " ".join(text.split())  # one line, whatever the command held
    return text if len(text) <= 120 else text[:117] + "..."


def describe_holder(path: Path, text: str) -> str:
    """The holder named in the lock file, and, when that process is gone although the lock is still held,
    the processes that hold it now (workers it started, which outlived it)."""
    text = text.strip()
    if not text:
        return "a process that has not written its name yet"
    m = _HOLDER.match(text.splitlines()[0])
    if m is None or m.group(2) != socket.gethostname():
        return text.splitlines()[0]
    from nestling.pipeline.state import pid_alive

    if pid_alive(int(m.group(1))):
        return text.splitlines()[0]
    now = [p for p in _fd_holders(path) if pid_alive(p)]
    who = ", ".join(f"pid {p} ({_cmdline(p)})" for p in now) or "a process on another machine"
    return (
        f"{text.splitlines()[0]}; that process is gone, but {who} still holds the lock: a process it started "
        f"that outlived it. Stop {'it' if len(now) < 2 else 'them'} (`kill {' '.join(map(str, now)) or 'PID'}`)"
    )


@contextmanager
def lock(folder: Path, what: str, hint: str) -> Iterator[None]:
    """Hold `folder/.lock` exclusively while the block runs; refuse with `hint` when another process
    holds it, naming the holder (pid, host, since when, command). The OS drops the lock when the process
    dies, however it dies, so a killed run never leaves a stale lock: the next one takes the folder over
    and says so."""
    import fcntl

    path = Path(folder) / LOCK
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = describe_holder(path, f.read())
            f.close()
            raise NestlingError(f"another {what} is using {folder} ({holder}); {hint}") from None
        try:  # the holder before us may have removed the file after we opened it: lock the file that is there
            same = os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    try:
        f.seek(0)
        left = f.read().strip()
        if left:  # a holder that ended normally removes the file: this one was killed
            from nestling.progress import log

            log(
                f"[lock] {folder}: took over the lock of a process that ended without releasing it ({left.splitlines()[0]})"
            )
        f.seek(0)
        f.truncate()
        f.write(holder_line() + "\n")
        f.flush()
        yield
    finally:
        path.unlink(missing_ok=True)
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


@contextmanager
def claim(out: str | Path, stage: str, inputs: Inputs = ()) -> Iterator[Path]:
    """Make `out` this stage's folder for the duration of the block: checked apart from the inputs,
    new / empty / already this stage's, marked, and locked against a second writer. A folder this call
    created and the stage left empty (it failed before writing) is removed again."""
    out = Path(out)
    check_apart(out, inputs)
    check_ours(out, stage)
    check_links(out)
    created, marked = not out.exists(), (out / MARKER).exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with lock(out, f"`nestling {stage}`", "wait for it to finish, or write to another --out folder"):
            check_ours(out, stage)  # again, holding the lock: the folder is this stage's, whoever marked it
            mark(out, stage)
            try:
                yield out
            except (KeyboardInterrupt, Exception) as e:  # Ctrl-C, SIGTERM, a dead engine: what a rerun keeps
                if not hasattr(e, "kept") and not isinstance(e, NestlingError):
                    from nestling.interrupt import kept

                    try:
                        e.kept = kept(stage, out)  # type: ignore[union-attr]
                        if stage == "train":
                            e.resume = "run the same command with --resume to continue"  # type: ignore[union-attr]
                    except AttributeError:  # an exception type without a __dict__
                        pass
                raise
    finally:
        if not marked and out.is_dir() and {p.name for p in out.iterdir()} <= {MARKER}:
            (out / MARKER).unlink(missing_ok=True)
            if created:
                out.rmdir()


# ---- deleting only what a stage wrote ------------------------------------------------------------


def _patterns(stage: str, patterns: tuple[str, ...] | None) -> tuple[str, ...]:
    return COMMON + (OWNS.get(stage, ()) if patterns is None else tuple(patterns))


def owned(folder: Path, stage: str, patterns: tuple[str, ...] | None = None) -> list[Path]:
    """The paths in `folder` that `stage` wrote: none unless the folder is the stage's."""
    folder = Path(folder)
    if not folder.is_dir() or owner(folder) != stage:
        return []
    found = {p for pat in _patterns(stage, patterns) for p in folder.glob(pat)}
    return sorted(p for p in found if not _through_link(folder, p))


def _through_link(folder: Path, p: Path) -> bool:
    """`p` lies under a linked folder inside `folder` (a link itself may be removed: unlinking does not
    follow it; what is behind it is not the stage's)."""
    return any((folder / q).is_symlink() for q in p.relative_to(folder).parents if q != Path("."))


def only_stage_names(folder: Path, stage: str, patterns: tuple[str, ...] | None = None) -> bool:
    """Every file in `folder` has a name `stage` writes (a file inside an owned subfolder counts): an
    unmarked folder may be taken back as the stage's only then."""
    pats = _patterns(stage, patterns)
    rel = [f.relative_to(folder).as_posix() for f in Path(folder).rglob("*") if f.is_file()]
    return all(any(fnmatch.fnmatch(r, pat) for pat in pats) for r in rel)


def remove_owned(
    folder: Path, stage: str, patterns: tuple[str, ...] | None = None, flag: str = "--out", fix: str | None = None
) -> None:
    """Delete what `stage` wrote in `folder` (the manifest first, so a crash leaves it incomplete) and
    the stage's subfolders left empty; the folder itself (marker and lock included) only when nothing
    else is left in it. Refuses a folder that is not the stage's."""
    folder = Path(folder)
    if not folder.exists():
        return
    check_ours(folder, stage, flag, fix)
    paths = [p for p in owned(folder, stage, patterns) if p.name not in (MARKER, LOCK) or p.parent != folder]
    for p in sorted(paths, key=lambda p: p.name != MANIFEST):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    for sub in sorted({p.parent for p in paths if p.parent != folder}, key=lambda p: -len(p.parts)):
        _rmdir_if_empty(sub)
    if {p.name for p in folder.iterdir()} <= {MARKER, LOCK}:
        for name in (MARKER, LOCK):
            (folder / name).unlink(missing_ok=True)
        _rmdir_if_empty(folder)


def _rmdir_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty: what is left is not ours
        pass


def free_bytes(path: str | Path) -> int:
    """Free bytes on the disk that holds `path`, or would hold it: its nearest existing parent."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free
