"""Minimal chat-data reader for regeneration: ShareGPT JSON/JSONL and OpenAI `messages` JSONL.

TEMPORARY: the data stage (`nestling.data.readers`) was written in parallel with this stage;
on merge this module should be replaced by the data stage's reader. Keep the interface small:
`read_records(path)` yields `Record`s, each a normalised conversation or a skip reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from nestling.errors import NestlingError

ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
}


@dataclass
class Record:
    """One input record: `messages` when usable, else `skip` names why not (counted, never lost)."""

    source_index: int
    id: str
    messages: list[dict] | None = None
    skip: str | None = None
    detail: str = ""


def _iter_json_array(text: str) -> Iterator[object | Exception]:
    """Elements of a JSON array, tolerant of a file cut off mid-record (the ShareGPT dump is)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            yield e  # the cut-off tail: one malformed record, then stop
            return
        yield obj


def _raw_records(path: Path) -> Iterator[object | Exception]:
    text = path.read_text(encoding="utf-8", errors="replace")
    stripped = text.lstrip()
    if not stripped:
        return
    if stripped[0] == "[":
        yield from _iter_json_array(text)
        return
    if path.suffix == ".json" and stripped[0] == "{":
        try:  # a single object holding a list of conversations
            obj = json.loads(text)
            if isinstance(obj, dict) and len(obj) == 1 and isinstance(next(iter(obj.values())), list):
                yield from next(iter(obj.values()))
                return
        except json.JSONDecodeError:
            pass
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as e:
            yield e


def normalise(obj: object) -> tuple[list[dict] | None, str | None, str]:
    """(messages, None, "") for a usable record, else (None, reason, detail)."""
    if not isinstance(obj, dict):
        return None, "malformed", f"record is {type(obj).__name__}, not an object"
    turns = obj.get("messages", obj.get("conversations", obj.get("conversation")))
    if not isinstance(turns, list):
        return None, "malformed", "no 'messages' or 'conversations' list"
    out = []
    for t in turns:
        if not isinstance(t, dict):
            return None, "malformed", "a turn is not an object"
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(role, str) or not isinstance(content, str):
            return None, "malformed", "a turn lacks a string role or content"
        if role.lower() not in ROLES:
            return None, "unknown_role", f"role {role!r}"
        out.append({"role": ROLES[role.lower()], "content": content})
    if not out:
        return None, "empty", "no turns"
    return out, None, ""


def read_records(path: Path) -> Iterator[Record]:
    """Every record of a ShareGPT JSON/JSONL or messages JSONL file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise NestlingError(f"input {path} does not exist or is not a file (give a .json or .jsonl chat file)")
    for i, obj in enumerate(_raw_records(path)):
        rid = f"{path.stem}-{i}"
        if isinstance(obj, Exception):
            yield Record(i, rid, skip="malformed", detail=f"invalid JSON: {obj}"[:200])
            continue
        if isinstance(obj, dict) and isinstance(obj.get("id"), (str, int)):
            rid = str(obj["id"])
        messages, reason, detail = normalise(obj)
        yield Record(i, rid, messages=messages, skip=reason, detail=detail)
