"""Faults outside nestling's own code that still deserve one clear line: a worker process of the engine
that died (killed, out of memory), reported by the engine as an exception of its own.

vLLM runs the model in processes of its own (`VLLM::EngineCore`, `VLLM::Worker`); when one dies, the
engine raises `EngineDeadError` in nestling's process, whose message only says to look at a stack trace
above. The exception does not say which process died, so `Roster` watches this process's descendants
(a daemon thread reading /proc a few times a second, Linux only) and `describe` names the ones that
vanished, first to go first.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

ENGINE_DEAD = ("EngineDeadError",)  # vLLM's: the engine's processes are gone, no request can succeed


class EngineDeadError(Exception):
    """An engine that died, found by nestling in what the engine returned (an answer whose error is vLLM's
    EngineDeadError): raised so the run stops and keeps what finished, instead of failing every request
    left as if each were at fault. `describe` words it like vLLM's own."""


def engine_died(detail: str) -> bool:
    """An engine error's text says the engine itself is gone (not this one request)."""
    return detail.startswith(tuple(f"{n}:" for n in ENGINE_DEAD))


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                found += [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
    except OSError:
        pass
    return found


def _zombie(pid: int) -> bool:
    """Dead, not yet reaped by its parent (a killed worker whose engine has not noticed yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _name(pid: int) -> str:
    """The process's title (vLLM sets `VLLM::Worker`), else its command."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    text = " ".join(raw.decode(errors="replace").replace("\0", " ").split())
    return text if len(text) <= 80 else text[:77] + "..."


class Roster:
    """This process's descendants as last seen (pid -> title) and when each was last seen alive."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self.seen: dict[int, str] = {}
        self.alive_at: dict[int, float] = {}
        self.gone_at: dict[int, float] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="nestling-roster", daemon=True)
        self._thread.start()

    def _scan(self) -> None:
        now, todo, found = time.monotonic(), [os.getpid()], set()
        while todo:
            for c in _children(todo.pop()):
                if c not in found:
                    found.add(c)
                    todo.append(c)
        with self._lock:
            alive = {pid for pid in found if not _zombie(pid)}  # a killed worker stays a zombie a while
            for pid in alive:  # the title as last seen alive (vLLM sets it after the process starts)
                name = _name(pid)
                if name not in ("", "?") or pid not in self.seen:
                    self.seen[pid] = name or "?"
                self.alive_at[pid] = now
                self.gone_at.pop(pid, None)
            for pid in self.seen:
                if pid not in alive and pid not in self.gone_at:
                    self.gone_at[pid] = now

    def _watch(self) -> None:
        while True:
            try:
                self._scan()
            except Exception:  # noqa: BLE001 - a watcher must never take the command down
                pass
            time.sleep(self.interval)

    def forget(self) -> None:
        with self._lock:
            self.seen.clear()
            self.alive_at.clear()
            self.gone_at.clear()

    def gone(self, within: float = 30.0) -> list[tuple[int, str]]:
        """(pid, title) of descendants that ended in the last `within` seconds, the first to end first (a
        helper process that ended long before, such as a probe at start-up, is not among them)."""
        self._scan()
        now = time.monotonic()
        with self._lock:
            recent = [p for p, t in self.gone_at.items() if now - t <= within]
            return sorted(((p, self.seen[p]) for p in recent), key=lambda x: self.gone_at[x[0]])


def descendants() -> list[int]:
    """Every live process this one started, directly or not (Linux /proc; [] elsewhere)."""
    todo, found = [os.getpid()], []
    while todo:
        for c in _children(todo.pop()):
            if c not in found:
                found.append(c)
                todo.append(c)
    return [p for p in found if not _zombie(p)]


_before: set[int] = set()  # descendants that were there when the command started (not its own)


def stop_descendants(grace: float = 5.0) -> list[str]:
    """After a stop or an error: end every process the command started that is still running (an engine's
    workers, a subprocess a stage was waiting on), SIGTERM first, SIGKILL after `grace` seconds. All are
    listed before any is signalled: a worker whose parent ends first is re-parented and would be missed.
    Processes that were running before the command started (`watch`; a host program calling the CLI in
    its own process may have its own) are left alone. Returns the titles of those that needed it."""
    import signal

    procs = {p: _name(p) for p in descendants() if p not in _before}
    for p in procs:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(not _zombie(p) for p in procs):
        time.sleep(0.05)
    for p in procs:
        if not _zombie(p):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    return [f"{n} (pid {p})" for p, n in procs.items()]


_roster: list[Roster] = []


def watch() -> None:
    """At a command's start: note the processes already running under this one, and start the roster
    (once per process; Linux only)."""
    if not Path("/proc/self/task").is_dir():
        return
    _before.clear()
    _before.update(descendants())
    if not _roster:
        _roster.append(Roster())
    else:  # a program calling the CLI again in its process: only what this command starts counts
        _roster[0].forget()


def describe(e: BaseException) -> str | None:
    """One message for a known fault outside nestling's code (an engine process that died), else None."""
    names = {c.__name__ for c in type(e).__mro__}
    if not names & set(ENGINE_DEAD):
        return None
    gone = [(p, n) for p, n in _roster[0].gone() if p not in _before] if _roster else []
    engine = [(p, n) for p, n in gone if n.startswith("VLLM::")] or gone  # vLLM titles its processes
    if engine:
        first, rest = engine[0], engine[1:]
        who = f"its process {first[1]} (pid {first[0]}) died" + (
            f", then {', '.join(f'{n} (pid {p})' for p, n in rest)} stopped" if rest else ""
        )
    else:
        who = "one of its processes died"
    kept = getattr(e, "kept", None)
    return (
        f"the vLLM engine stopped: {who} (killed, or out of memory: check `dmesg`; vLLM's log above has "
        f"the details)" + (f"; kept {kept}" if kept else "; finished work is kept") + ": run the same command again"
    )
