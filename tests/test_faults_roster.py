"""The roster names the engine process that died first, even when its parent follows it within
milliseconds (a killed vLLM worker takes its engine core down faster than any scan of /proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from nestling.faults import Roster, _roster

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="the roster reads Linux /proc")


@pytest.fixture(autouse=True)
def alone():
    """The command line's own roster, where an earlier test in this process started one, is stopped:
    its pidfds would come and go among this test's descriptors."""
    for r in _roster:
        r.close()
    _roster.clear()


# A parent that starts a child and ends the moment the child does; the child ends the moment the
# parent does (it reads the parent's pipe until end of file). Whichever is killed, the other follows.
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
print(child.pid, flush=True)
child.wait()
"""


@pytest.fixture
def roster():
    r = Roster()
    yield r
    r.close()


@contextmanager
def pair() -> Iterator[tuple[subprocess.Popen, int]]:
    """The parent and its child's pid; both killed and reaped, and the pipe closed, on the way out."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        yield parent, child
    finally:
        for p in (child, parent.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        parent.wait(10)
        parent.stdout.close()


def watched(roster: Roster, *pids: int) -> None:
    deadline = time.monotonic() + 30
    while not all(p in roster.seen and roster.seen[p] != "?" for p in pids):
        assert time.monotonic() < deadline, roster.seen
        time.sleep(0.02)
    time.sleep(2 * roster.interval)  # and followed by the watcher


@pytest.mark.parametrize("killed", ["child", "parent"])
def test_the_first_to_die_is_named_first(roster, killed):
    with pair() as (parent, child):
        watched(roster, parent.pid, child)
        first, then = (child, parent.pid) if killed == "child" else (parent.pid, child)
        os.kill(first, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while then not in dict(roster.gone()):
            assert time.monotonic() < deadline, roster.gone()
            time.sleep(0.01)
        assert [p for p, _ in roster.gone()] == [first, then]
        assert "sys.stdin.read()" in dict(roster.gone())[child]  # the title as last seen alive


def open_fds() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # listdir's own descriptor, closed by now
            pass
    return {f for f in found if ":/proc/" not in f}  # the watcher's scan of /proc, open for a moment


def test_no_descriptor_outlives_what_it_follows(roster):
    """A pidfd per followed process, closed when the process ends or the roster forgets it (a command
    run again in the same process): none is left open, and no other descriptor is touched."""
    before = open_fds()
    for end in ("killed", "forgotten"):
        with pair() as (parent, child):
            watched(roster, parent.pid, child)
            if end == "killed":
                os.kill(child, signal.SIGKILL)
                parent.wait(10)
                deadline = time.monotonic() + 10
                while roster._fds:
                    assert time.monotonic() < deadline, roster._fds
                    time.sleep(0.01)
            else:
                roster.forget()
                assert roster._fds == {} and roster.gone() == []
        assert open_fds() == before, (end, open_fds() ^ before)
