"""Line-buffered progress for long loops: one flushed line per update, with rate and ETA.

Long jobs are watched with `tail -f` on remote machines, so we never use carriage returns
or bars; every line is complete and self-describing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO


def format_duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def log(msg: str, stream: TextIO | None = None) -> None:
    """Print one flushed line (stderr by default, so stdout stays for results)."""
    stream = stream or sys.stderr
    print(msg, file=stream, flush=True)
    if STOP_AT_ENV in os.environ:
        _stop_at(msg)


# Fault injection for the test harness (tests/fault_helpers.py): a process whose log line matches this
# regular expression stops itself (SIGSTOP) right after printing it, the first time only, so a test that
# reads the line can send its signal (or kill a worker) while the stage is at exactly that point, then
# let it go on (SIGCONT). Unset, it costs one dictionary lookup per line.
STOP_AT_ENV = "NESTLING_STOP_AT"
_stopped_once: list[bool] = []


def _stop_at(msg: str) -> None:
    import re
    import signal

    if not _stopped_once and re.search(os.environ[STOP_AT_ENV], msg):
        _stopped_once.append(True)
        os.kill(os.getpid(), signal.SIGSTOP)


PROGRESS_ENV = "NESTLING_PROGRESS_FILE"
INTERVAL_ENV = "NESTLING_PROGRESS_INTERVAL"


@dataclass
class Progress:
    """Counts work done against a total and reports rate and ETA at most every `interval` s.

    `state_file`, when given, receives the latest numbers as JSON so that `nestling status`
    can show them from another process. When not given it defaults to `$NESTLING_PROGRESS_FILE`:
    `nestling run` sets that per stage (RUN_DIR/state/<stage>.progress.json), so stages need no
    knowledge of the run folder.
    """

    desc: str
    total: int | None = None
    unit: str = "it"
    interval: float = 5.0
    state_file: Path | None = None
    stream: TextIO | None = None
    done: int = 0
    tokens: int = 0
    extra: dict = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)  # monotonic clock; rates and ETA count from here
    _last: float = 0.0

    def __post_init__(self) -> None:
        if os.environ.get(INTERVAL_ENV):  # every loop's interval at once (e.g. 0: a line per update)
            self.interval = float(os.environ[INTERVAL_ENV])
        if self.state_file is None and os.environ.get(PROGRESS_ENV):
            self.state_file = Path(os.environ[PROGRESS_ENV])

    def update(self, n: int = 1, tokens: int = 0, force: bool = False, **extra: object) -> None:
        self.done += n
        self.tokens += tokens
        self.extra.update(extra)
        now = time.monotonic()
        if force or now - self._last >= self.interval or (self.total and self.done >= self.total):
            self._last = now
            self._emit(now)

    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.started, 1e-9)

    def token_rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)

    def eta(self) -> float:
        if not self.total:
            return float("nan")
        r = self.rate()
        return (self.total - self.done) / r if r > 0 else float("inf")

    def _emit(self, now: float) -> None:
        elapsed = now - self.started
        parts = [f"[{self.desc}]"]
        parts.append(f"{self.done}/{self.total} {self.unit}" if self.total else f"{self.done} {self.unit}")
        if self.total:
            parts.append(f"({100.0 * self.done / self.total:.1f}%)")
        parts.append(f"{self.rate():.2f} {self.unit}/s")
        if self.tokens:
            parts.append(f"{self.token_rate():,.0f} tok/s")
        for k, v in self.extra.items():
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
        parts.append(f"elapsed {format_duration(elapsed)}")
        if self.total:
            parts.append(f"ETA {format_duration(self.eta())}")
        log(" ".join(parts), self.stream)
        if self.state_file is not None:
            state = {
                "stage": self.desc,
                "done": self.done,
                "total": self.total,
                "unit": self.unit,
                "rate": self.rate(),
                "tokens": self.tokens,
                "tokens_per_s": self.token_rate(),
                "elapsed_s": elapsed,
                "eta_s": None if not self.total else self.eta(),
                "updated": time.time(),
                **{k: v for k, v in self.extra.items() if isinstance(v, (int, float, str))},
            }
            self.state_file = Path(self.state_file)
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(self.state_file)

    def close(self) -> None:
        self._emit(time.monotonic())
