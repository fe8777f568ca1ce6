"""Ctrl-C, `kill` and a closed terminal: every command stops the same way, keeps its finished work and
says in one line what it kept and how to go on.

Python turns SIGINT into KeyboardInterrupt, but by default SIGTERM (what `kill`, a job scheduler or a
container stop sends) and SIGHUP end the process on the spot: no `finally` runs, the engine's worker
processes are left behind, the run's state says "running", and nothing is printed. `install()` makes
them raise `Interrupted` (a KeyboardInterrupt) in the main thread instead, so every stage unwinds
through the cleanup it already has for Ctrl-C: the data stage stops its worker pool, vLLM is shut
down with its workers, a half-written shard or checkpoint is removed, the run's state turns
"interrupted". A second signal while that cleanup runs is reported and otherwise ignored (SIGKILL
still ends everything at once). Worker processes forked from the main one get the default handlers
back, so their parent stops them quietly.

`kept(stage, folder)` reads a stage folder and says what a rerun will keep from it; `claim` (outdir)
and `nestling run` attach it to the exception, and the command line prints it (`message`).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType

NAMES: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
EXIT_CODES: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


class Interrupted(KeyboardInterrupt):
    """A stop signal other than SIGINT, raised like Ctrl-C's KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(NAMES.get(signum, f"signal {signum}"))
        self.signum = signum


_state: dict = {}


def _handler(signum: int, frame: FrameType | None) -> None:
    if os.getpid() != _state.get("pid"):  # a forked worker: the default action, as if never installed
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _state.get("stopping"):
        print(
            f"nestling: {NAMES.get(signum, signum)} again: still stopping cleanly (saving state, stopping "
            "workers); `kill -9` stops at once but may leave worker processes",
            file=sys.stderr,
            flush=True,
        )
        return
    _state["stopping"] = signum
    raise KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)


def install() -> None:
    """Route SIGINT, SIGTERM and SIGHUP through `_handler` (main thread of the main process only)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    _state.clear()
    _state["pid"] = os.getpid()
    _state["previous"] = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:  # started under nohup: keep ignoring
                continue
            signal.signal(sig, _handler)
            _state["previous"][sig] = previous
        except (OSError, ValueError):
            pass


def uninstall() -> None:
    """The handlers there were before `install` (a program or test that calls the CLI in its process)."""
    import threading

    if threading.current_thread() is not threading.main_thread() or not _state:
        return
    for sig, previous in _state.get("previous", {}).items():
        if signal.getsignal(sig) is _handler:
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
    _state.clear()


def worker_defaults() -> None:
    """In a worker process (a pool worker, an engine worker): Ctrl-C, which the terminal sends to the whole
    process group, is left to the parent, which stops its workers itself; SIGTERM ends it quietly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def signal_name(e: BaseException) -> str:
    return NAMES[e.signum] if isinstance(e, Interrupted) else "Ctrl-C"


def exit_code(e: BaseException) -> int:
    return EXIT_CODES.get(e.signum, 130) if isinstance(e, Interrupted) else 130


# ---- what a stage folder keeps ----------------------------------------------------------------------------


def _size(paths: list[Path]) -> str:
    from nestling.progress import format_bytes

    return format_bytes(sum(p.stat().st_size for p in paths if p.exists()))


def kept(stage: str, folder: str | Path) -> str:
    """What a rerun keeps of `stage`'s folder, as a phrase ("3 finished shards (1.2 MiB) in OUT")."""
    folder = Path(folder)
    try:
        if (folder / "manifest.json").is_file():
            return f"the complete {stage} output in {folder}"
        if stage == "capture":
            shards = sorted(folder.glob("*/shard-*.safetensors"))
            return (
                f"{len(shards)} finished shard(s) ({_size(shards)}) in {folder}; the rerun captures only the rest"
                if shards
                else f"no finished shard yet in {folder}"
            )
        if stage == "train":
            ckpts = sorted(
                p for p in (folder / "checkpoints").glob("step-*") if p.is_dir() and (p / "state.json").exists()
            )
            if ckpts:
                return f"checkpoint {ckpts[-1].name} in {folder / 'checkpoints'}; the rerun resumes from it"
            return f"no checkpoint yet in {folder}: training starts over"
        if stage == "regenerate":
            return _regenerate_kept(folder)
        if stage == "data":
            return f"no data shards: the data stage starts over in {folder}"
        if stage in ("export", "eval"):
            return f"nothing of {stage} (it is redone, in seconds, into {folder})"
    except OSError:
        pass
    return f"what {stage} finished in {folder}"


def _regenerate_kept(folder: Path) -> str:
    """What a stopped regeneration keeps: the rows its state vouches for plus its journal's, named as
    its mode writes them (conversations in messages.jsonl, documents in text.jsonl)."""
    import json

    n, text = 0, False
    # a run of several inputs regenerates each in a subfolder of its own (pipeline/stages.py regenerate_dirs)
    mains = [folder] + sorted(d for d in folder.iterdir() if d.is_dir() and d.name != "sampled")
    for sub in (x for m in mains for x in (m, m / "sampled")):
        try:
            state = json.loads((sub / "state.json").read_text())
            for name, size in state["bytes"].items():
                if name in ("messages.jsonl", "text.jsonl"):
                    text = text or name == "text.jsonl"
                    with open(sub / name, "rb") as f:
                        n += f.read(int(size)).count(b"\n")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        journal = sub / "partial.jsonl"
        if journal.exists():
            n += journal.read_bytes().count(b"\n")
    what = "continued document(s)" if text else "answered conversation(s)"
    return f"{n} {what} in {folder}; the rerun answers only the rest"


def message(command: str, e: BaseException) -> str:
    """The one line a command prints when a signal stopped it."""
    where = getattr(e, "stage", None)
    what = getattr(e, "kept", None)
    resume = getattr(e, "resume", None) or "run the same command again to continue"
    return (
        f"nestling {command}: interrupted by {signal_name(e)}"
        + (f" during {where}" if where else "")
        + (f"; kept {what}" if what else "")
        + f"; {resume}."
    )
