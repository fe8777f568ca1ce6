"""Conversations to regenerate, read and normalised by the data stage's own reader.

Regeneration must see the same conversations, with the same role mapping and the same counted
drop reasons, as `nestling data` will when it tokenizes the output, so this only adapts
`nestling.data.readers` + `nestling.data.normalize` to the record shape the engines consume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from nestling.data.normalize import normalize_record
from nestling.data.readers import error_reason, read_input


@dataclass
class Record:
    """One input record: `messages` when usable, else `skip` names why not (counted, never lost)."""

    source_index: int
    id: str
    messages: list[dict] | None = None
    skip: str | None = None
    detail: str = ""
    altered: list[str] = field(default_factory=list)
    text: str | None = None  # the text mode's document (`nestling.data.text.record_text`)


def read_records(path: Path, text: bool = False) -> Iterator[Record]:
    """Every record of a ShareGPT JSON/JSONL, messages JSONL or parquet file, in file order; with
    `text`, each as the data stage's text mode reads it (a `text` field, or a chat record flattened)."""
    path = Path(path)
    records, _ = read_input(path)
    for raw in records:
        rid = f"{path.stem}-{raw.index}"
        if raw.data is None:
            yield Record(raw.index, rid, skip=error_reason(raw), detail=(raw.error or "")[:200])
            continue
        if isinstance(raw.data.get("id"), (str, int)):
            rid = str(raw.data["id"])
        if text:
            from nestling.data.text import record_text

            doc = record_text(raw.data)
            yield Record(raw.index, rid, skip=doc.drop, detail=doc.detail, altered=list(doc.altered), text=doc.text)
            continue
        norm = normalize_record(raw.data)
        yield Record(
            raw.index, rid, messages=norm.messages, skip=norm.drop, detail=norm.detail, altered=list(norm.altered)
        )
