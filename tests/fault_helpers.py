"""The fault harness: `nestling` in a child process, faults sent at the line the stage prints.

- `Child` runs `python -m nestling ARGS` in its own session (so a test can find every process it
  started, and a terminal's Ctrl-C, sent to the process group, reaches them all), reads its output line
  by line, and waits for a line matching a pattern. With `stop_at=PATTERN` the child stops itself
  (SIGSTOP) right after printing the first line that matches (`nestling.progress.STOP_AT_ENV`): the
  fault (a signal, a killed worker) then lands at exactly that point of the stage, not at a time that
  depends on how loaded the machine is; `resume()` lets it go on.
- `strays(child)`: the processes of its session still alive after it exited (vLLM workers, data workers).
- `temp_files(folder)`: half-written names a stage leaves when it dies mid-write.
- `blackhole()`: a proxy that accepts connections and never answers, with the environment that sends
  every HTTP(S) request there: a command that tries the network hangs (caught by a time bound) and the
  connection is counted.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import nestling

SRC = str(Path(nestling.__file__).resolve().parents[1])
PINNED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}


def default_signals() -> None:
    """In the child before it starts: the stop signals' default actions. A test runner started in the
    background of a script inherits SIGINT ignored, and nestling keeps an ignored signal ignored (nohup):
    Ctrl-C would never reach the child."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


class Child:
    """`python -m nestling ARGS` in a new session, its stdout and stderr read line by line."""

    def __init__(self, args: list, env: dict | None = None, stop_at: str | None = None, log: Path | None = None):
        full = {**os.environ, "PYTHONPATH": SRC, "TOKENIZERS_PARALLELISM": "false", **PINNED, **(env or {})}
        full.pop("NESTLING_STOP_AT", None)
        if stop_at:
            full["NESTLING_STOP_AT"] = stop_at
        self.lines: list[str] = []
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nestling", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full,
            start_new_session=True,
            preexec_fn=default_signals,
        )
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.signalled_at: float | None = None
        self.seen: dict[int, str] = {}  # every process seen under the child (`snapshot`), by pid

    def snapshot(self) -> list[int]:
        """The child's descendants now (also those in sessions of their own), remembered for `strays`."""
        found = descendants(self.pid)
        for p in found:
            self.seen.setdefault(p, start_time(p))
        return found

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if self.log is not None:
                with open(self.log, "a") as f:
                    f.write(line)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 240) -> str:
        """The first output line matching `pattern` (a regular expression); fails if the child ends first."""
        rx, seen, t0 = re.compile(pattern), 0, time.monotonic()
        while True:
            while seen < len(self.lines):
                if rx.search(self.lines[seen]):
                    return self.lines[seen]
                seen += 1
            if self.proc.poll() is not None:
                self._reader.join(5)
                if any(rx.search(x) for x in self.lines[seen:]):
                    return next(x for x in self.lines[seen:] if rx.search(x))
                raise AssertionError(
                    f"exited ({self.proc.returncode}) before printing /{pattern}/:\n{self.text[-4000:]}"
                )
            assert time.monotonic() - t0 < timeout, f"no line /{pattern}/ within {timeout} s:\n{self.text[-4000:]}"
            time.sleep(0.01)

    def wait_stopped(self, timeout: float = 30) -> None:
        """Wait until the child has stopped itself at its `stop_at` line."""
        t0 = time.monotonic()
        while proc_state(self.pid) != "T":
            assert self.proc.poll() is None, f"exited before stopping:\n{self.text[-4000:]}"
            assert time.monotonic() - t0 < timeout, f"did not stop within {timeout} s:\n{self.text[-4000:]}"
            time.sleep(0.01)
        self.snapshot()

    def signal(self, sig: int, group: bool = False) -> None:
        """Send `sig` to the child (`group`: to its whole process group, as a terminal's Ctrl-C does)."""
        self.signalled_at = time.monotonic()
        if group:
            os.killpg(self.pid, sig)
        else:
            os.kill(self.pid, sig)

    def resume(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)

    def finish(self, timeout: float = 300) -> int:
        """Wait for the exit (fail past `timeout` seconds, killing the session); the exit code."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s (a hang):\n{self.text[-4000:]}") from None
        self._reader.join(10)
        return rc

    def seconds_since_signal(self) -> float:
        assert self.signalled_at is not None
        return time.monotonic() - self.signalled_at

    def kill(self) -> None:
        """SIGKILL every process of the child's session and every one seen under it (cleanup)."""
        for pid in [self.pid, *session_processes(self.pid), *self.alive_seen()]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(10)

    def alive_seen(self) -> list[int]:
        """Processes seen under the child that still run (the same process: same start time)."""
        return [
            p
            for p, t in self.seen.items()
            if t is not None and start_time(p) == t and proc_state(p) not in (None, "Z", "X")
        ]


def start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def descendants(pid: int) -> list[int]:
    """Live processes under `pid` (children, their children, ...)."""
    todo, found = [pid], []
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
            for k in kids:
                if k not in found:
                    found.append(k)
                    todo.append(k)
    return found


def proc_state(pid: int) -> str | None:
    """The one-letter state of a process (R, S, T, Z, ...), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def session_processes(sid: int) -> list[int]:
    """Live processes (not zombies) whose session id is `sid`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(d.name))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def strays(child: Child, grace: float = 10.0) -> list[str]:
    """The processes `child` started that are still alive `grace` seconds after it exited (killed then):
    those of its session and those seen under it (`Child.snapshot`, taken where it stopped)."""
    t0 = time.monotonic()
    while (
        left := sorted(set(session_processes(child.pid)) | set(child.alive_seen()))
    ) and time.monotonic() - t0 < grace:
        time.sleep(0.1)
    found = [f"{pid}: {cmdline(pid)}" for pid in left]
    child.kill()
    return found


TEMP = re.compile(r"(\.tmp$|\.part$|^\.tmp-|^\.export-build-|\.tmp\.)")


def temp_files(folder: Path) -> list[str]:
    """Half-written names (temporary files of atomic writes, partial builds) under `folder`."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if TEMP.search(p.name))


@contextlib.contextmanager
def blackhole() -> Iterator[tuple[dict, list]]:
    """(proxy environment, connections): every HTTP(S) request made under the environment goes to a
    local port that accepts and never answers; `connections` lists each one made."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    connections: list = []
    held: list = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except OSError:
                continue
            connections.append(addr)
            held.append(conn)  # never answered, never closed until the end

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    env = {k: url for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")}
    env.update(NO_PROXY="", no_proxy="")
    try:
        yield env, connections
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        server.close()


@contextlib.contextmanager
def environ(values: dict, drop: tuple[str, ...] = ()) -> Iterator[None]:
    """Set `values` and remove `drop` in os.environ for the block."""
    old = {k: os.environ.get(k) for k in (*values, *drop)}
    os.environ.update(values)
    for k in drop:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
