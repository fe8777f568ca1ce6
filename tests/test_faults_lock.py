"""Two processes on one folder (issue 57, case 3): two `nestling run`, or two `nestling capture`, started
together on the same folder: one wins, the other stops at once naming the holder (pid, host, command); a
lock left by a killed process is taken over with a line saying so; a lock still held by a process that
outlived the one named in it (a worker it started) is refused naming that process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import Child, strays
from hostile_helpers import chat_line, cli, fails_cleanly

from nestling import outdir

WINNER_STOPS = r"^\[run\] data: starting"


@pytest.fixture(scope="module")
def target(tiny_target) -> Path:
    return tiny_target("llama")


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(chat_line(f"Answer {i}, in a few words.") for i in range(8)))
    return path


def run_config(tmp: Path, target: Path, chat: Path, run_dir: Path) -> Path:
    cfg = tmp / "run.yaml"
    cfg.write_text(
        f"target: {target}\ninputs: [{chat}]\nrun_dir: {run_dir}\n"
        "data: {max_length: 64, held_out: 0, workers: 1}\n"
        "capture: {dtype: float32}\ntrain: {steps: 1, online: false}\nexport: {}\n"
    )
    return cfg


def start_both(args: list, stop_at: str) -> tuple[Child, Child]:
    """Two children of the same command started together; each stops itself once it holds the folder."""
    a, b = Child(args, stop_at=stop_at), Child(args, stop_at=stop_at)
    return a, b


def winner_and_loser(a: Child, b: Child, timeout: float = 120) -> tuple[Child, Child]:
    """The child that stopped holding the folder and the one that exited; fails unless exactly that."""
    t0 = time.monotonic()
    while True:
        done = [c for c in (a, b) if c.proc.poll() is not None]
        if done:
            loser = done[0]
            winner = b if loser is a else a
            winner.wait_stopped(timeout)
            return winner, loser
        assert time.monotonic() - t0 < timeout, a.text + "\n----\n" + b.text
        time.sleep(0.02)


def test_two_runs_on_one_folder_started_together_then_the_winner_killed(target, chat, tmp_path):
    run_dir = tmp_path / "run"
    cfg = run_config(tmp_path, target, chat, run_dir)
    args = ["run", cfg, "--until", "data"]
    a, b = start_both(args, WINNER_STOPS)
    try:
        winner, loser = winner_and_loser(a, b)
        assert loser.finish(30) == 1, loser.text
        msg = loser.lines[-1]
        # the holder by pid, host and command, what to do; no traceback
        assert msg.startswith(f"nestling run: error: another nestling run is using {run_dir} (pid {winner.pid} on "), (
            msg
        )
        assert socket.gethostname() in msg and f"nestling run {cfg} --until data)" in msg, msg
        assert "nestling status" in msg and "Traceback" not in loser.text
        holder = (run_dir / ".lock").read_text()
        assert holder.startswith(f"pid {winner.pid} on {socket.gethostname()} since ")
        # the winner is killed (kill -9: nothing of it runs again): its lock is left behind, not held
        winner.signal(signal.SIGKILL, group=True)
        assert winner.finish(30) == -signal.SIGKILL
        assert strays(winner) == []
    finally:
        for c in (a, b):
            c.kill()
    assert f"pid {winner.pid} on" in (run_dir / ".lock").read_text()
    third = Child(args)
    assert third.finish(120) == 0, third.text
    assert (
        f"[lock] {run_dir}: took over the lock of a process that ended without releasing it (pid {winner.pid} on"
        in (third.text)
    )
    assert json.loads((run_dir / "state" / "data.json").read_text())["status"] == "complete"
    assert not (run_dir / ".lock").exists()  # released on the way out


def test_two_captures_on_one_folder_started_together(target, chat, tmp_path, capsys):
    data = tmp_path / "data"
    rc, err = cli(capsys, "data", chat, "--target", target, "--out", data, "workers=1", "held_out=0")
    assert rc == 0, err
    out = tmp_path / "capture"
    args = ["capture", data, "--target", target, "--out", out, "--dtype", "float32", "progress_interval=0"]
    a, b = start_both(args, r"^\[capture train\] ")
    try:
        winner, loser = winner_and_loser(a, b)
        assert loser.finish(30) == 1, loser.text
        msg = loser.lines[-1]
        assert msg.startswith(
            f"nestling capture: error: another `nestling capture` is using {out} (pid {winner.pid} on"
        )
        assert f": nestling capture {data} --target {target} --out {out}" in msg, msg
        assert "write to another --out folder" in msg
        winner.resume()
        assert winner.finish(120) == 0, winner.text
        assert (out / "manifest.json").is_file() and not (out / ".lock").exists()
    finally:
        for c in (a, b):
            c.kill()


ORPHAN = """
import os, sys, time
sys.path.insert(0, {src!r})
from nestling import outdir
with outdir.lock(__import__("pathlib").Path({folder!r}), "x", "y"):
    if os.fork() == 0:          # a worker that inherits the locked file and outlives its parent
        os.setsid()
        print(os.getpid(), flush=True)
        time.sleep(120)
        os._exit(0)
    time.sleep(0.5)
    os._exit(0)                 # the parent dies without releasing anything
"""


def test_a_lock_held_by_a_process_that_outlived_its_parent_names_it(target, chat, tmp_path, capsys):
    """The holder named in the lock file is gone but the lock is still held: by a worker it forked. The
    refusal names that worker, by pid and command, and says to stop it (it is not killed for the user)."""
    out = tmp_path / "data"
    out.mkdir()
    outdir.mark(out, "data")
    src = str(Path(outdir.__file__).resolve().parents[1])
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN.format(src=src, folder=str(out))], stdout=subprocess.PIPE, text=True
    )
    orphan = int(parent.stdout.readline())
    parent.wait(30)
    try:
        msg = fails_cleanly(capsys, "data", chat, "--target", target, "--out", out, "workers=1")
        assert f"another `nestling data` is using {out} (pid {parent.pid} on" in msg
        assert f"that process is gone, but pid {orphan} (" in msg and f"`kill {orphan}`" in msg, msg
    finally:
        os.kill(orphan, signal.SIGKILL)
    time.sleep(0.2)
    rc, err = cli(capsys, "data", chat, "--target", target, "--out", out, "workers=1")
    assert rc == 0, err
    assert f"took over the lock of a process that ended without releasing it (pid {parent.pid} on" in err


HOLDER = """
import sys, time
sys.path.insert(0, {src!r})
from pathlib import Path
from nestling import outdir
with outdir.lock(Path({folder!r}), "x", "y"):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_folder_being_claimed_is_refused_naming_its_holder(target, chat, tmp_path, capsys):
    """The moment between a claim's lock and its marker (the lock file and the marker's temporary file
    are all the folder holds): a second stage started then is told who holds the folder, not that the
    folder is foreign."""
    out = tmp_path / "data"
    out.mkdir()
    src = str(Path(outdir.__file__).resolve().parents[1])
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(src=src, folder=str(out))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        (out / f".{outdir.MARKER}.abc123.tmp").write_text("{")  # atomic_write_json's name for it
        msg = fails_cleanly(capsys, "data", chat, "--target", target, "--out", out, "workers=1")
        assert f"another `nestling data` is using {out} (pid {holder.pid} on" in msg, msg
    finally:
        holder.kill()
        holder.wait()
