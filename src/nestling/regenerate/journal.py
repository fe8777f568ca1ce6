"""The chunk in flight's finished conversations, on disk as they finish.

Why: a chunk is committed whole (run.py), and the fastest way to regenerate on a GPU is one large
chunk (every conversation's turn k in one engine call keeps the slots full), so before this a crash
lost the whole chunk: minutes to hours of work. Now each conversation, once its last turn is in (or
it failed), goes to `partial.jsonl` with its output row and its token counts, appended and fsynced
at most every `EVERY_S` seconds. A rerun reads the journal of the chunk it resumes, regenerates only
the conversations not in it, and writes the chunk in its usual order, so the files equal an
uninterrupted run's (each conversation's answers depend only on its own seeds and history). The
journal names its chunk; one left over from a chunk that was committed is dropped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from nestling.errors import NestlingError
from nestling.progress import log

JOURNAL = "partial.jsonl"
EVERY_S = 10.0  # how much finished work a crash may lose, at most, besides the conversations in flight

Key = tuple[int, int]  # (source index, sample)


@dataclass
class Journal:
    path: Path
    chunk: int  # the index of the chunk these conversations belong to
    every: float = EVERY_S
    pending: list[dict] = field(default_factory=list)
    last: float = field(default_factory=time.monotonic)

    def add(self, entry: dict) -> None:
        """Record one finished conversation ({key, status, row, turns, output_tokens, truncated_turns})."""
        self.pending.append(entry)
        if time.monotonic() - self.last >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            with open(self.path, "ab") as f:
                for e in self.pending:
                    f.write((json.dumps({"chunk": self.chunk, **e}, ensure_ascii=False) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            self.pending = []
        self.last = time.monotonic()


def read_journal(path: Path, chunk: int) -> dict[Key, dict]:
    """The conversations a killed run journaled for `chunk`, by key. A half-written last line (the
    kill) is cut off; a journal of another chunk (committed before the kill) is deleted."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    try:
        entries = [json.loads(line) for line in data[:end].splitlines()]
    except json.JSONDecodeError as e:  # only the last line can be half-written; this is damage
        raise NestlingError(
            f"{path} is damaged ({e}); delete it to regenerate the whole chunk in flight, then rerun"
        ) from None
    if not entries or entries[0].get("chunk") != chunk:
        path.unlink()
        return {}
    done = {(int(e["key"][0]), int(e["key"][1])): e for e in entries}
    log(f"[regenerate] resuming chunk {chunk + 1}: {len(done)} conversations already finished ({path.name})")
    return done
