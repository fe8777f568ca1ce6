"""The roster names the engine process that died first, even when its parent follows it within
milliseconds (a killed vLLM worker takes its engine core down faster than any scan of /proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from nestling.faults import Roster

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="the roster reads Linux /proc")

# A parent that starts a child and ends the moment the child does; the child ends the moment the
# parent does (it reads the parent's pipe until end of file). Whichever is killed, the other follows.
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
print(child.pid, flush=True)
child.wait()
"""


def pair() -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


def watched(roster: Roster, *pids: int) -> None:
    deadline = time.monotonic() + 30
    while not all(p in roster.seen and roster.seen[p] != "?" for p in pids):
        assert time.monotonic() < deadline, roster.seen
        time.sleep(0.02)
    time.sleep(2 * roster.interval)  # and followed by the watcher


@pytest.mark.parametrize("killed", ["child", "parent"])
def test_the_first_to_die_is_named_first(killed):
    roster = Roster()
    parent, child = pair()
    try:
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
    finally:
        for p in (child, parent.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        parent.wait(10)
