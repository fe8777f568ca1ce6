"""Readers for chat data: ShareGPT JSON (a list), JSONL, and parquet.

Every reader yields raw records with their index in the file; it never decides what a
conversation means (that is `normalize`). Broken input is reported, never silently lost:
a malformed JSONL line becomes a record carrying an error (counted by the caller), and a
JSON list cut off mid-record (the ShareGPT file on the package index is) yields every
complete record plus a note of where and why reading stopped. A record with bytes that are not
UTF-8 is dropped (`invalid_utf8`), never decoded to U+FFFD behind the user's back; one nested too
deeply for the JSON parser is dropped (`too_deeply_nested`) and reading goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nestling.errors import NestlingError
from nestling.inputs import parse_json_int, json_loads
from nestling.progress import log

FORMATS = ("json", "jsonl", "parquet")
CHAT_COLUMNS = ("conversations", "messages")


@dataclass
class RawRecord:
    index: int  # position in the file: list index (JSON), line number - 1 (JSONL), row (parquet)
    data: dict | None
    error: str | None = None  # why `data` is missing: the record could not be parsed
    reason: str | None = None  # the counted drop reason, when not `malformed_json`


# Files are decoded with surrogateescape: each byte that is not UTF-8 becomes one lone surrogate
# U+DC80..U+DCFF, which valid text never holds, so a record's raw text shows whether it had any.
# utf-8-sig drops a byte-order mark at the start (Windows editors write one), which would otherwise
# make the first record malformed JSON.
ENCODING = dict(encoding="utf-8-sig", errors="surrogateescape")
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def _utf8_problem(text: str) -> str | None:
    """Where the first byte that is not UTF-8 sits in `text` (None when all of it is UTF-8)."""
    m = _NOT_UTF8.search(text)
    return None if m is None else f"byte 0x{ord(m.group(0)) - 0xDC00:02x} at character {m.start()} is not UTF-8"


@dataclass
class InputReport:
    path: str
    format: str
    records: int = 0  # records read (including ones with errors)
    stopped: str | None = None  # where and why reading stopped early, for a truncated file
    extra: dict[str, Any] = field(default_factory=dict)


def error_reason(rec: RawRecord) -> str:
    """The counted drop reason of a record that could not be parsed."""
    if rec.reason:
        return rec.reason
    return "truncated_file" if rec.error and rec.error.startswith("truncated:") else "malformed_json"


def detect_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".json":
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            head = f.read(4096).lstrip()
        return "json" if head.startswith("[") else "jsonl"
    raise NestlingError(f"{path}: unknown input format {suffix!r}; give .json (ShareGPT list), .jsonl or .parquet")


def read_input(path: Path, limit: int | None = None) -> tuple[list[RawRecord], InputReport]:
    """All records of one input file (the first `limit` when given)."""
    path = check_input(path)
    fmt = detect_format(path)
    reader = {"json": _read_json_list, "jsonl": _read_jsonl, "parquet": _read_parquet}[fmt]
    report = InputReport(str(path), fmt)
    records = reader(path, limit, report)
    if report.stopped:  # the cut-off tail is one record too: counted as `truncated_file`, never lost
        records.append(RawRecord(len(records), None, f"truncated: {path.name}: {report.stopped}"))
    report.records = len(records)
    if not records:
        raise NestlingError(
            f"input file {path} holds no records (it is empty, blank or an empty list): give a file of "
            "conversations, or leave this one out"
        )
    return records, report


def check_input(path: str | Path) -> Path:
    """An input file, checked before anything is read or written: it exists, is a regular file (a folder,
    or a named pipe that would block the reader forever, is refused) and is not empty."""
    from nestling.inputs import regular_file

    p = Path(path)
    if p.is_dir():
        raise NestlingError(f"input {p} is a folder; give the data files themselves (e.g. {p}/*.jsonl)")
    p = regular_file(p, "input file")
    if p.stat().st_size == 0:
        raise NestlingError(f"input file {p} is empty (0 bytes): give a file of conversations, or leave it out")
    return p


def read_inputs(inputs: list[Path], limit: int | None) -> tuple[list[tuple[str, RawRecord]], list[InputReport]]:
    """Every input's records, each with its sample id (`file:index`; a file name given twice is
    prefixed with its position), and one report per input."""
    records: list[tuple[str, RawRecord]] = []
    reports: list[InputReport] = []
    for p, name in zip(inputs, sample_names(inputs)):
        recs, report = read_input(p, limit)
        if report.stopped:
            log(
                f"[data] warning: {p}: reading stopped early at {report.stopped}; kept the {len(recs) - 1} complete records before it"
            )
        reports.append(report)
        records += [(f"{name}:{r.index}", r) for r in recs]
    return records, reports


def sample_names(inputs: list[Path]) -> list[str]:
    """Each input's name in its records' sample ids (`NAME:index`): its file name, prefixed with its
    position where two inputs share one."""
    names = [p.name for p in inputs]
    return [n if names.count(n) == 1 else f"{k}-{n}" for k, n in enumerate(names)]


def _read_json_list(path: Path, limit: int | None, report: InputReport) -> list[RawRecord]:
    """A JSON list read item by item, so that a file cut off mid-record still yields its complete records."""
    text = path.read_text(**ENCODING)
    decoder = json.JSONDecoder(parse_int=parse_json_int)
    n = len(text)
    pos = text.index("[") + 1
    out: list[RawRecord] = []
    ws = " \t\r\n"
    while limit is None or len(out) < limit:
        while pos < n and text[pos] in ws:
            pos += 1
        if pos < n and text[pos] == "]":
            break
        if pos >= n:
            report.stopped = f"file ends at character {n} before the list is closed (after record {len(out) - 1})"
            break
        start, deep = pos, False
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            report.stopped = (
                f"record {len(out)} (line {e.lineno}, column {e.colno}, character {e.pos}) "
                f"cannot be parsed: {e.msg}; the file looks cut off or corrupt there"
            )
            break
        except RecursionError:
            end = skip_json_value(text, pos)
            if end is None:
                report.stopped = f"record {len(out)} (character {pos}) is nested too deeply and never closed"
                break
            out.append(
                RawRecord(
                    len(out), None, f"{path.name}: record {len(out)} is nested too deeply to parse", "too_deeply_nested"
                )
            )
            pos, item, deep = end, None, True
        bad = None if deep else _utf8_problem(text[start:pos])
        if deep:
            pass
        elif bad:
            out.append(RawRecord(len(out), None, f"{path.name}: record {len(out)}: {bad}", "invalid_utf8"))
        elif isinstance(item, dict):
            out.append(RawRecord(len(out), item))
        else:
            out.append(
                RawRecord(len(out), None, f"{path.name}: record {len(out)} is a {type(item).__name__}, not an object")
            )
        while pos < n and text[pos] in ws:
            pos += 1
        if pos < n and text[pos] == ",":
            pos += 1
        elif pos < n and text[pos] == "]":
            break
        elif pos < n:
            report.stopped = f"record {len(out)}: expected ',' or ']' at character {pos}, found {text[pos]!r}"
            break
    return out


def _read_jsonl(path: Path, limit: int | None, report: InputReport) -> list[RawRecord]:
    out: list[RawRecord] = []
    with open(path, **ENCODING) as f:
        for lineno, line in enumerate(f):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            bad = _utf8_problem(line)
            if bad:
                out.append(RawRecord(lineno, None, f"{path.name}:{lineno + 1}: {bad}", "invalid_utf8"))
                continue
            try:
                item = json_loads(line)
            except json.JSONDecodeError as e:
                out.append(
                    RawRecord(lineno, None, f"{path.name}:{lineno + 1}: malformed JSON ({e.msg} at column {e.colno})")
                )
                continue
            except RecursionError:
                out.append(
                    RawRecord(
                        lineno, None, f"{path.name}:{lineno + 1}: nested too deeply to parse", "too_deeply_nested"
                    )
                )
                continue
            if not isinstance(item, dict):
                out.append(RawRecord(lineno, None, f"{path.name}:{lineno + 1}: a {type(item).__name__}, not an object"))
                continue
            out.append(RawRecord(lineno, item))
    return out


def skip_json_value(text: str, pos: int) -> int | None:
    """The end of the JSON array or object starting at `pos`, found by counting brackets outside
    strings (no recursion); None when it never closes. Lets a list reader step over one record too
    deep for the parser and go on with the next."""
    depth, i, n, in_str = 0, pos, len(text), False
    while i < n:
        c = text[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _read_parquet(path: Path, limit: int | None, report: InputReport) -> list[RawRecord]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a broken file
        raise NestlingError(f"{path} is not a readable parquet file: {e}") from None
    names = pf.schema_arrow.names
    column = next((c for c in (*CHAT_COLUMNS, "text") if c in names), None)
    if column is None:
        raise NestlingError(
            f"{path} has columns {names}; a chat parquet needs a 'conversations' column (ShareGPT: list of "
            f"{{from, value}}) or a 'messages' column (list of {{role, content}}), a text parquet a 'text' column"
        )
    keep = [c for c in (column, "id") if c in names]
    table = pf.read(columns=keep)
    if limit is not None:
        table = table.slice(0, limit)
    return [RawRecord(i, row) for i, row in enumerate(table.to_pylist())]
