"""The run folder's own bookkeeping: per-stage state files and the tee'd run log.

    RUN_DIR/run.log                       every stderr line of every `nestling run`, flushed as written
    RUN_DIR/state/<stage>.json            key, status (running | complete | failed), pid, host, times
    RUN_DIR/state/<stage>.progress.json   the stage's latest Progress numbers ($NESTLING_PROGRESS_FILE)

They live beside the stage folders, never inside them, so a stage owns its folder completely.
"""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, TextIO

from nestling.manifest import atomic_write_json

STATE_DIR = "state"
RUN_LOG = "run.log"


def state_path(run_dir: Path, stage: str) -> Path:
    return Path(run_dir) / STATE_DIR / f"{stage}.json"


def progress_path(run_dir: Path, stage: str) -> Path:
    return Path(run_dir) / STATE_DIR / f"{stage}.progress.json"


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):  # ValueError: not JSON, or not UTF-8 (a damaged file)
        return None


def read_state(run_dir: Path, stage: str) -> dict | None:
    return read_json(state_path(run_dir, stage))


def write_state(run_dir: Path, stage: str, **fields: Any) -> dict:
    state = {"stage": stage, "pid": os.getpid(), "host": socket.gethostname(), "updated": time.time(), **fields}
    atomic_write_json(state_path(run_dir, stage), state)
    return state


def read_progress(run_dir: Path, stage: str) -> dict | None:
    """The newest progress numbers of a stage (ours, or a progress.json the stage wrote itself)."""
    found = [
        p
        for p in (read_json(progress_path(run_dir, stage)), read_json(Path(run_dir) / stage / "progress.json"))
        if isinstance(p, dict) and p
    ]
    return max(found, key=lambda p: p.get("updated", 0)) if found else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Tee(io.TextIOBase):
    """Writes to the original stream and to the log file, flushing both on every write."""

    def __init__(self, stream: TextIO, log: TextIO):
        self.stream, self.log = stream, log

    def write(self, s: str) -> int:
        self.stream.write(s)
        self.stream.flush()
        try:
            self.log.write(s)
            self.log.flush()
        except ValueError:  # log closed by a late writer (atexit); the terminal still gets it
            pass
        return len(s)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


@contextmanager
def tee_stderr(log_path: Path, header: str) -> Iterator[None]:
    """Copy every stderr line (progress, warnings, errors) to `log_path`, appending, line by line."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", buffering=1) as log:
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n")
        old = sys.stderr
        sys.stderr = _Tee(old, log)
        try:
            yield
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                from nestling.interrupt import message

                log.write(message("run", e) + "\n")
            elif not isinstance(e, SystemExit):
                log.write(f"failed: {type(e).__name__}: {e}\n")
            raise
        finally:
            sys.stderr = old
