"""Faults outside nestling's own code that still deserve one clear line: a worker process of the engine
that died (killed, out of memory), reported by the engine as an exception of its own.

vLLM runs the model in processes of its own (`VLLM::EngineCore`, `VLLM::Worker`); when one dies, the
engine raises `EngineDeadError` in nestling's process, whose message only says to look at a stack trace
above. The exception does not say which process died, so `Roster` watches this process's descendants
(a daemon thread, Linux only) and `describe` names the ones that vanished, first to go first. A killed
worker's engine shuts down within milliseconds, faster than any scan of /proc, so the order of deaths
comes from the kernel: a pidfd per descendant becomes readable the moment that process ends.
"""

from __future__ import annotations

import os
import select
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
    """This process's descendants as last seen (pid -> title), and the order in which they ended."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self.seen: dict[int, str] = {}
        self.gone_at: dict[int, tuple[float, int]] = {}  # pid -> (when noticed, order of its end)
        self._ends = 0
        self._fds: dict[int, int] = {}  # fd -> pid: one pidfd per live descendant, where the kernel has them
        self._poll = select.poll() if hasattr(select, "poll") and hasattr(os, "pidfd_open") else None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nestling-roster", daemon=True)
        self._thread.start()

    def _ended(self, pid: int, now: float) -> None:
        if pid not in self.gone_at:
            self._ends += 1
            self.gone_at[pid] = (now, self._ends)

    def _follow(self, pid: int) -> None:
        """Open a pidfd on a descendant just found, so its end is noticed the moment it happens."""
        if self._poll is None or pid in self._fds.values():
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # ended already, or a kernel without pidfds: the scan notices it
            return
        self._fds[fd] = pid
        self._poll.register(fd, select.POLLIN)

    def _unfollow(self, fd: int) -> None:
        del self._fds[fd]
        if self._poll is not None:
            self._poll.unregister(fd)
        os.close(fd)

    def _scan(self, follow: bool = True) -> None:
        """Find every descendant: the new ones' titles (and pidfds, from the watcher's thread only), and the
        ends of those the kernel does not report."""
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
                self.gone_at.pop(pid, None)
                if follow:
                    self._follow(pid)
            followed = set(self._fds.values())
            for pid in self.seen:
                if pid not in alive and pid not in followed:
                    self._ended(pid, now)

    def _wait(self) -> None:
        """Sleep one interval, noting at once (in the order the kernel reports them) every end."""
        if self._poll is None:
            time.sleep(self.interval)
            return
        for fd, _ in self._poll.poll(self.interval * 1000):
            with self._lock:
                if fd in self._fds:  # else forgotten meanwhile
                    self._ended(self._fds[fd], time.monotonic())
                    self._unfollow(fd)

    def _pending(self) -> bool:
        """Some followed process has ended and the watcher has yet to note it (poll, not select: an engine's
        process holds many descriptors, and select takes none numbered past 1023)."""
        with self._lock:
            fds = list(self._fds)
        if not fds:
            return False
        ready = select.poll()
        for fd in fds:
            ready.register(fd, select.POLLIN)
        return any(ev & select.POLLIN for _, ev in ready.poll(0))  # a descriptor closed meanwhile: POLLNVAL

    def _watch(self) -> None:
        while not self._closed.is_set():
            try:
                self._scan()
                self._wait()
            except Exception:  # noqa: BLE001 - a watcher must never take the command down
                time.sleep(self.interval)

    def close(self) -> None:
        """Stop watching and close every pidfd (a program, or a test, done with this roster)."""
        self._closed.set()
        self._thread.join()
        self.forget()

    def forget(self) -> None:
        with self._lock:
            for fd in list(self._fds):
                self._unfollow(fd)
            self.seen.clear()
            self.gone_at.clear()

    def gone(self, within: float = 30.0) -> list[tuple[int, str]]:
        """(pid, title) of descendants that ended in the last `within` seconds, the first to end first (a
        helper process that ended long before, such as a probe at start-up, is not among them)."""
        deadline = time.monotonic() + 1.0
        while self._pending() and time.monotonic() < deadline:  # ends the watcher has yet to note
            time.sleep(0.01)
        self._scan(follow=False)
        now = time.monotonic()
        with self._lock:
            recent = [p for p, (t, _) in self.gone_at.items() if now - t <= within]
            return [(p, self.seen.get(p, "?")) for p in sorted(recent, key=lambda p: self.gone_at[p][1])]


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


def who_died() -> str | None:
    """Which engine processes this command started ended in the last seconds, the first to end first:
    "its process VLLM::Worker (pid 12) died, then VLLM::EngineCore (pid 11) stopped"; None when the roster
    saw none end (or does not run here)."""
    gone = [(p, n) for p, n in _roster[0].gone() if p not in _before] if _roster else []
    engine = [(p, n) for p, n in gone if n.startswith("VLLM::")] or gone  # vLLM titles its processes
    if not engine:
        return None
    (pid, name), rest = engine[0], engine[1:]
    return f"its process {name} (pid {pid}) died" + (
        f", then {', '.join(f'{n} (pid {p})' for p, n in rest)} stopped" if rest else ""
    )


def describe(e: BaseException) -> str | None:
    """One message for a known fault outside nestling's code (an engine process that died), else None."""
    names = {c.__name__ for c in type(e).__mro__}
    if not names & set(ENGINE_DEAD):
        return None
    who = who_died() or "one of its processes died"
    kept = getattr(e, "kept", None)
    return (
        f"the vLLM engine stopped: {who} (killed, or out of memory: check `dmesg`; vLLM's log above has "
        f"the details)" + (f"; kept {kept}" if kept else "; finished work is kept") + ": run the same command again"
    )
