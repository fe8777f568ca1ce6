"""The data stage's text mode, for targets without a chat template (base models).

A base model is served plain text: a prompt is tokenized the way the tokenizer adds special tokens
(BOS where it adds one) and the model writes on until its EOS. So each document becomes
`tokenizer(text)` (special tokens added) followed by the EOS token, every token supervised, and
documents are laid end to end into rows of at most `max_length` tokens (`Packer`, used by the
shards in the main process, so the rows do not depend on the number of workers).

Decisions (docs/data.md, "Base models: the text mode"):
- A document is never split between rows: one that does not fit in what is left of a row starts the
  next row, so every row starts at a document's start, as the target sees a prompt. A document
  longer than `max_length` is cut (`overflow=truncate`) or dropped (`overflow=drop`), as a chat
  sample is.
- Inside a row, attention crosses document boundaries and positions run on: the capture and the
  training treat a row as one sequence, exactly as a chat sample, so the target's states and the
  draft's inputs agree. The separator tokens (EOS, and BOS where the tokenizer adds one) are what
  the target reads as "a new document starts here", as in the usual pretraining layout.
- Records: `{"text": ...}`; chat records (`conversations`/`messages`) are normalised like the chat
  mode does and flattened to their messages' text joined by a blank line (`chat_flattened_to_text`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nestling.errors import NestlingError

MODES = ("auto", "chat", "text")
MASK_METHOD = "text_every_token"
FLATTEN_SEPARATOR = "\n\n"


@dataclass
class TextFormat:
    """A tokenizer used without a chat template: documents in, token ids (special tokens added, EOS
    appended) out. `template` is empty: what the fingerprint and the manifest hash in its place."""

    tokenizer: object
    eos_id: int | None
    special_re: re.Pattern
    template: str = ""
    mask_method: str = MASK_METHOD
    mode: str = "text"


def has_chat_template(tokenizer) -> bool:
    t = getattr(tokenizer, "chat_template", None)
    return bool(t.get("default") if isinstance(t, dict) else t)


def resolve_mode(mode: str, tokenizer, template: str | None) -> str:
    """`chat` or `text`: `auto` is text when neither the settings nor the tokenizer give a chat template."""
    if mode not in MODES:
        raise NestlingError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    return "chat" if template is not None or has_chat_template(tokenizer) else "text"


def text_format(tokenizer) -> TextFormat:
    """The text mode's format for a fast tokenizer; refused when nothing would separate documents."""
    if not getattr(tokenizer, "is_fast", False):
        raise NestlingError(
            "the target's tokenizer has no fast (Rust) implementation; nestling needs one (save it with tokenizer.json)"
        )
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None and getattr(tokenizer, "bos_token_id", None) is None:
        raise NestlingError(
            "the target's tokenizer has neither an EOS nor a BOS token: documents packed into one row would run "
            "together; give the tokenizer an eos_token (tokenizer_config.json)"
        )
    special = sorted(
        {str(t.content) for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True
    )
    special_re = re.compile("|".join(map(re.escape, special))) if special else re.compile(r"(?!x)x")
    return TextFormat(tokenizer, eos, special_re)


def data_format(tokenizer, template: str | None, mode: str):
    """The format the data stage tokenizes with: a ChatFormat (chat mode) or a TextFormat (text mode)."""
    from nestling.data.chat import chat_format

    if resolve_mode(mode, tokenizer, template) == "text":
        return text_format(tokenizer)
    return chat_format(tokenizer, template)


def is_text(fmt) -> bool:
    return getattr(fmt, "mode", "chat") == "text"


@dataclass
class Document:
    """One record as text, or the reason it cannot be used."""

    text: str | None = None
    drop: str | None = None
    detail: str = ""
    altered: tuple[str, ...] = ()


def record_text(data: dict, role_map: dict | None = None, system_prompt: str | None = None) -> Document:
    """A record's text: its `text` field, or a chat record's normalised messages joined by a blank line."""
    from nestling.data.normalize import _SURROGATE, normalize_record

    if "text" in data:
        text = data["text"]
        if not isinstance(text, str):
            return Document(drop="malformed_record", detail=f"'text' is a {type(text).__name__}, not a string")
        if _SURROGATE.search(text):
            return Document(drop="invalid_utf8", detail="'text' holds a lone surrogate (an escape of half a character)")
        if not text.strip():
            return Document(drop="empty_text")
        return Document(text)
    if "conversations" not in data and "messages" not in data:
        return Document(drop="malformed_record", detail="record has no 'text', 'conversations' or 'messages'")
    norm = normalize_record(data, role_map, system_prompt)
    if norm.messages is None:
        return Document(drop=norm.drop, detail=norm.detail, altered=tuple(norm.altered))
    text = FLATTEN_SEPARATOR.join(m["content"] for m in norm.messages if m["content"].strip())
    return Document(text, altered=(*norm.altered, "chat_flattened_to_text"))


def encode_texts(fmt: TextFormat, texts: list[str]) -> list[list[int]]:
    """Token ids of each document as the target sees it (the tokenizer's special tokens added, e.g. BOS),
    then the EOS token (the target ends a document with it), in one batched tokenizer call."""
    backend = fmt.tokenizer.backend_tokenizer  # type: ignore[attr-defined]
    out = []
    for enc in backend.encode_batch_fast(texts, add_special_tokens=True):
        ids = list(enc.ids)
        if fmt.eos_id is not None and (not ids or ids[-1] != fmt.eos_id):
            ids.append(fmt.eos_id)
        out.append(ids)
    return out


def special_token_in(fmt: TextFormat, text: str) -> str | None:
    """The first special token's text inside `text` (it would tokenize as the control token), else None."""
    m = fmt.special_re.search(text)
    return None if m is None else m.group(0)


class Packer:
    """Documents of one split laid end to end into rows of at most `max_length` tokens, in the order
    they come; a document that does not fit in the open row closes it and starts the next one.

    A row's id is its first document's sample id, plus `+N` when N more documents follow it in the row;
    its `source_index` is its first document's."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.docs: list = []  # the open row's documents (workers.Row)
        self.length = 0

    def add(self, doc, source_index: int) -> list[tuple[str, int, list[int], list[int]]]:
        """Add one document (`len <= max_length`); returns the rows it closed (sample_id, source_index, ids, mask)."""
        closed = []
        if self.docs and self.length + len(doc.input_ids) > self.max_length:
            closed.append(self.close())
        self.docs.append((doc, source_index))
        self.length += len(doc.input_ids)
        return closed

    def close(self) -> tuple[str, int, list[int], list[int]]:
        import numpy as np

        (first, source_index), n = self.docs[0], len(self.docs)
        ids = np.concatenate([d.input_ids for d, _ in self.docs])
        mask = np.concatenate([d.loss_mask for d, _ in self.docs])
        self.docs, self.length = [], 0
        return (first.sample_id + (f"+{n - 1}" if n > 1 else ""), source_index, ids, mask)

    def flush(self) -> list[tuple[str, int, list[int], list[int]]]:
        return [self.close()] if self.docs else []
