"""What the hostile-input tests share: the CLI in this process, the clean-failure check, a bound on
how long a command may block, and one real folder per stage built once per test file."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import pytest
from capture_fixture import TINY_TRAIN, threads

from nestling.cli import main


def cli(capsys, *args) -> tuple[int, str]:
    """Run `nestling ARGS` in this process; (exit code, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


def fails_cleanly(capsys, *args) -> str:
    """The command exits 1 with one short message and no traceback; returns the message."""
    rc, err = cli(capsys, *args)
    assert rc == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    msg = err[err.index("error:") :]
    assert len(msg.strip().splitlines()) <= 2, msg
    return msg


@contextlib.contextmanager
def within(seconds: int):
    """Fail the test (instead of hanging the suite) if the block takes longer than `seconds`."""

    def fire(signum, frame):
        raise AssertionError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def chat_line(content: str = "Hello.", **extra) -> str:
    return (
        json.dumps(
            {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": content}], **extra}
        )
        + "\n"
    )


# Training settings of the stage folders below (a resumed run must repeat them: they key the checkpoints)
TRAIN = ["--steps", "2", "checkpoint_every=1", *TINY_TRAIN]


@pytest.fixture(scope="module", name="data_dir")
def hostile_data_dir(tiny, tmp_path_factory) -> Path:
    """A complete data folder of the tiny target: 12 conversations, a quarter held out."""
    src = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    src.write_text("".join(chat_line(f"Answer number {i}, with a few words.") for i in range(12)))
    out = tmp_path_factory.mktemp("data") / "data"
    assert main(["data", str(src), "--target", str(tiny), "--out", str(out), "workers=1", "held_out=0.25"]) == 0
    return out


@pytest.fixture(scope="module", name="trained")
def hostile_trained(capture, tmp_path_factory) -> Path:
    """A finished training folder with checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("runs") / "train"
    with threads(1):
        assert main(["train", str(capture), "--out", str(out), *TRAIN]) == 0
    return out


@pytest.fixture(scope="module", name="draft")
def hostile_draft(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "draft"
    assert main(["export", str(trained), "--out", str(out)]) == 0
    return out
