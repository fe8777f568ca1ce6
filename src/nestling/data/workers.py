"""The data stage's worker side: records in, `Outcome`s out, in chunks, in worker processes.

A worker normalizes, renders, tokenizes and length-limits a span of CHUNK records of the shared
record list (`STATE`). Results come back in input order, so the output does not depend on the
number of workers. Both the ordinary run (run.py) and the head start (headstart.py) use it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.pool import Pool

import numpy as np

from nestling.data.readers import RawRecord, error_reason
from nestling.errors import NestlingError
from nestling.data.settings import DataSettings

CHUNK = 64  # conversations per worker task: large enough for batched tokenization, small for balance


@dataclass
class Row:
    """One sample written to a shard: a whole conversation, or (rows=turn) the prefix through one turn."""

    sample_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray


@dataclass
class Outcome:
    """What became of one input record: its rows, or the reason it was dropped."""

    sample_id: str
    source_index: int
    rows: list[Row] = field(default_factory=list)
    drop: str | None = None
    detail: str = ""
    altered: list[str] = field(default_factory=list)
    rows_dropped: list[str] = field(default_factory=list)  # rows=turn: why a turn's row was left out
    supervised_cut: int = 0  # supervised tokens past max_length: cut off, or left out with their row
    group: str = ""  # what the held-out split hashes (split_group); "" = sample_id


def split_group(sample_id: str, data: dict | None) -> str:
    """The key the train/held-out split hashes. A row `nestling regenerate` wrote names the input
    conversation it answers (`source_index`); every answer to that conversation (greedy, the n samples,
    the `sampled` pass's file) must land in one split, or a held-out prompt trains the draft through
    its twin and inflates held-out acceptance. The conversation's id (its own, else the input file's name
    and index) keeps apart the conversations of several inputs that share an index. Any other record is
    its own group."""
    if isinstance(data, dict) and isinstance(data.get("source_index"), int) and ("messages" in data or "text" in data):
        return f"regenerated:{data['source_index']}:{data.get('id', '')}"
    return sample_id


# Worker state: set in the parent before the pool forks (or by the initializer under spawn).
STATE: dict = {}


def share(fmt, settings: DataSettings, records: list) -> None:
    """Set what the workers read: set in the parent right before a fork, so the children inherit it."""
    STATE.clear()
    STATE.update(fmt=fmt, settings=settings, records=records)


def _init_worker(target_dir: str, template: str | None, settings: DataSettings, records=None) -> None:
    from nestling.interrupt import worker_defaults

    worker_defaults()  # Ctrl-C reaches the whole process group: the parent stops the pool, not each worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if "fmt" not in STATE:
        from transformers import AutoTokenizer

        from nestling.data.text import data_format

        STATE["fmt"] = data_format(AutoTokenizer.from_pretrained(target_dir), template, settings.mode)
    STATE["settings"] = settings
    if records is not None:
        STATE["records"] = records


def _outcome(sid: str, rec: RawRecord) -> Outcome:
    """A record's outcome, its split group set, dropped already where the record could not be read."""
    o = Outcome(sid, rec.index, group=split_group(sid, rec.data))
    if rec.data is None:
        o.drop, o.detail = error_reason(rec), rec.error or ""
    return o


def process(span: tuple[int, int]) -> list[Outcome]:
    """Normalize, render, tokenize and length-limit records [start, end) of the shared record list."""
    from nestling.data.chat import encode_conversations
    from nestling.data.normalize import normalize_record

    from nestling.data.text import is_text

    settings: DataSettings = STATE["settings"]
    records: list[tuple[str, RawRecord]] = STATE["records"][span[0] : span[1]]
    if is_text(STATE["fmt"]):
        return process_texts(records, STATE["fmt"], settings)
    outcomes: list[Outcome] = []
    todo: list[tuple[Outcome, list[dict]]] = []
    for sid, rec in records:
        o = _outcome(sid, rec)
        outcomes.append(o)
        if rec.data is None:
            continue
        norm = normalize_record(rec.data, settings.role_map, settings.system_prompt)
        o.altered = list(norm.altered)
        if norm.messages is None:
            o.drop, o.detail = norm.drop, norm.detail
            continue
        todo.append((o, norm.messages))
    if todo:
        encoded = encode_conversations(
            STATE["fmt"], [m for _, m in todo], settings.last_turn_only, template_timeout=settings.template_timeout
        )
        for (o, _), enc in zip(todo, encoded):
            o.altered += enc.altered
            if enc.drop is not None:
                o.drop, o.detail = enc.drop, enc.detail
                continue
            _add_rows(o, enc, settings)
    for o in outcomes:
        o.altered = sorted(set(o.altered))
    return outcomes


def process_texts(records: list[tuple[str, RawRecord]], fmt, settings: DataSettings) -> list[Outcome]:
    """The text mode (text.py): each record one document, every token supervised, length-limited;
    the shards pack the documents into rows."""
    from nestling.data.text import encode_texts, record_text, special_token_in

    outcomes: list[Outcome] = []
    todo: list[tuple[Outcome, str]] = []
    for sid, rec in records:
        o = _outcome(sid, rec)
        outcomes.append(o)
        if rec.data is None:
            continue
        doc = record_text(rec.data, settings.role_map, settings.system_prompt)
        o.altered = list(doc.altered)
        tok = special_token_in(fmt, doc.text) if doc.text is not None else None
        if doc.text is None:
            o.drop, o.detail = doc.drop, doc.detail
        elif tok is not None:
            o.drop, o.detail = "special_token_in_content", f"the text contains the control token {tok!r} as text"
        else:
            todo.append((o, doc.text))
    for (o, _), ids in zip(todo, encode_texts(fmt, [t for _, t in todo])):
        if len(ids) > settings.max_length:
            if settings.overflow == "drop":
                o.drop, o.detail = "too_long", f"{len(ids)} tokens > max_length {settings.max_length}"
                o.supervised_cut = len(ids)
                continue
            o.supervised_cut, ids = len(ids) - settings.max_length, ids[: settings.max_length]
            o.altered.append("truncated_to_max_length")
        o.rows.append(Row(o.sample_id, np.fromiter(ids, dtype=np.int32, count=len(ids)), np.ones(len(ids), np.int8)))
    for o in outcomes:
        o.altered = sorted(set(o.altered))
    return outcomes


def _candidate_rows(o: Outcome, enc, rows: str) -> list[tuple[str, list[int], np.ndarray]]:
    """(sample_id, ids, mask) before the length limit: the conversation, or one row per supervised turn.

    A turn's row is the conversation's tokens through the turn's end-of-turn token (what the engine
    has seen when the turn ends; the formatting after it is never supervised), supervising that turn
    only; its id is the conversation's plus `#k`, k counting the supervised turns from 0."""
    if rows == "conversation":
        return [(o.sample_id, enc.input_ids, enc.loss_mask)]
    out = []
    for k, (first, last) in enumerate(enc.turns):
        mask = np.zeros(last + 1, dtype=np.int8)
        mask[first:] = 1
        out.append((f"{o.sample_id}#{k}", enc.input_ids[: last + 1], mask))
    return out


def _add_rows(o: Outcome, enc, settings: DataSettings) -> None:
    """Length-limit the record's rows into `o.rows`. rows=turn: a row that does not fit is left out
    (counted in `o.rows_dropped`); the record is dropped only when none is left, for the first row's reason."""
    first_drop: tuple[str, str] | None = None
    for sid, ids, mask in _candidate_rows(o, enc, settings.rows):
        if len(ids) > settings.max_length:
            if settings.overflow == "drop":
                first_drop = first_drop or ("too_long", f"{len(ids)} tokens > max_length {settings.max_length}")
                o.rows_dropped.append("too_long")
                o.supervised_cut += int(mask.sum())
                continue
            o.supervised_cut += int(mask[settings.max_length :].sum())
            ids, mask = ids[: settings.max_length], mask[: settings.max_length]
            o.altered.append("truncated_to_max_length")
            if not mask.any():
                first_drop = first_drop or (
                    "no_supervised_tokens_after_truncation",
                    f"the first {settings.max_length} tokens hold no assistant reply",
                )
                o.rows_dropped.append("no_supervised_tokens_after_truncation")
                continue
        if not mask.any():
            first_drop = first_drop or ("no_supervised_tokens", "")
            o.rows_dropped.append("no_supervised_tokens")
            continue
        o.rows.append(
            Row(sid, np.fromiter(ids, dtype=np.int32, count=len(ids)), mask)
        )  # ~3x faster than asarray for a list
    if not o.rows:
        assert first_drop is not None
        o.drop, o.detail = first_drop
        o.rows_dropped = []  # the record's drop says it
    elif o.rows_dropped:
        o.altered.append("turn_rows_past_max_length_dropped")


def spans(n: int) -> list[tuple[int, int]]:
    """Record ranges [start, end) of CHUNK records: the unit of work a worker takes."""
    return [(i, min(i + CHUNK, n)) for i in range(0, n, CHUNK)]


def start_pool(
    workers: int, target_dir, template: str | None, settings: DataSettings, records, ranges: list[tuple[int, int]]
) -> tuple[Pool, Iterator[list[Outcome]]]:
    """Worker processes over the record `ranges` (`spans`); returns (pool, iterator of outcome lists in input order)."""
    if "fork" in mp.get_all_start_methods():
        pool = mp.get_context("fork").Pool(workers, _init_worker, (str(target_dir), template, settings))
    else:  # spawn: each worker loads the tokenizer and receives the records
        pool = mp.get_context("spawn").Pool(workers, _init_worker, (str(target_dir), template, settings, records))
    return pool, watched(pool, pool.imap(process, ranges, chunksize=1))


def watched(pool: Pool, results: Iterator[list[Outcome]], poll: float = 0.5) -> Iterator[list[Outcome]]:
    """The pool's results in input order; a worker that dies (killed, out of memory) is an error that names
    it. multiprocessing.Pool starts a replacement but loses the dead worker's task, so the results would
    otherwise wait for it forever."""
    seen: dict[int, mp.process.BaseProcess] = {}
    while True:
        for p in list(pool._pool):  # type: ignore[attr-defined]  # the workers now (replacements join)
            seen.setdefault(p.pid, p)
        try:
            item = results.next(timeout=poll)  # type: ignore[attr-defined]
        except StopIteration:
            return
        except mp.TimeoutError:
            dead = [p for p in seen.values() if p.exitcode not in (None, 0)]
            if dead:
                raise NestlingError(died(dead[0].pid, dead[0].exitcode)) from None
            continue
        yield item


def died(pid: int | None, code: int | None) -> str:
    """The message for a data worker that ended with exit status `code` (negative: killed by that signal)."""
    import signal

    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        how = f"was killed by {name} while tokenizing" + (
            " (the out-of-memory killer sends SIGKILL: check `dmesg`, or use fewer workers)"
            if -code == signal.SIGKILL
            else ""
        )
    else:
        how = f"ended with exit status {code} while tokenizing"
    return (
        f"data worker process {pid} {how}; no shard was marked complete: run the same command again "
        "(workers=1 tokenizes in the main process)"
    )
