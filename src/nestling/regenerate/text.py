"""Regeneration for base targets (`mode=text`): continue a prefix instead of answering a turn.

Each text record (a `text` field, or a chat record flattened as the data stage's text mode does) is
tokenized as the target sees a document (`nestling.data.text`: the tokenizer's special tokens, e.g.
BOS, added); its first `prefix_tokens` tokens (or `prefix_fraction` of them) go to the engine, which
writes on up to `max_new_tokens` or the target's EOS, greedy or sampled as the settings say. The row
written is the record's own text up to the end of the prefix, followed by the continuation, under
`text`: a text record the data stage's text mode reads. The chunks, journal, engines, seeds and
accounting are the chat mode's (run.py); a record is one request instead of a chain of turns.
"""

from __future__ import annotations

from dataclasses import dataclass

from nestling.faults import EngineDeadError, engine_died
from nestling.progress import Progress
from nestling.regenerate.engine import Completion, Request, run_chain
from nestling.regenerate.journal import Journal, Key
from nestling.regenerate.readers import Record
from nestling.regenerate.settings import RegenerateSettings

TEXT = "text.jsonl"  # what a text-mode run writes instead of messages.jsonl


@dataclass
class Prefix:
    ids: list[int]  # what the engine continues
    text: str  # the record's own text up to the end of those tokens


def prefix_length(n_tokens: int, s: RegenerateSettings) -> int:
    """How many of a document's `n_tokens` tokens form its prefix (at least 1, at most all)."""
    n = max(1, round(n_tokens * s.prefix_fraction)) if s.prefix_fraction > 0 else s.prefix_tokens
    return max(1, min(n, n_tokens))


def prefixes(tokenizer, texts: list[str], s: RegenerateSettings) -> list[Prefix]:
    """Each text's prefix: its first tokens (special tokens added as the target sees a prompt) and the
    characters they cover. A prefix never ends inside a character that spans several byte tokens."""
    out = []
    for text, enc in zip(texts, tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=True)):
        ids, offsets = enc.ids, enc.offsets
        n = prefix_length(len(ids), s)
        while n < len(ids) and offsets[n][0] < offsets[n - 1][1]:  # token n is more of the same character
            n += 1
        end = max((b for _, b in offsets[:n]), default=0)
        out.append(Prefix(list(ids[:n]), text[:end]))
    return out


def continuation(tokenizer, prefix_ids: list[int], completion: Completion) -> str:
    """The continuation's text as it follows the prefix: decoded together with the prefix (tokenizers
    that drop a word's leading space when it starts the text keep it here), special tokens left out."""
    gen = completion.token_ids
    if gen is None:
        return completion.text
    before = tokenizer.decode(prefix_ids, skip_special_tokens=True)
    whole = tokenizer.decode(prefix_ids + list(gen), skip_special_tokens=True)
    return whole[len(before) :] if whole.startswith(before) else tokenizer.decode(gen, skip_special_tokens=True)


@dataclass
class Job:
    rec: Record
    sample: int
    prefix: Prefix | None = None
    failed: tuple[str, str] | None = None
    text: str = ""
    token_ids: list[int] | None = None
    output_tokens: int = 0
    truncated: bool = False
    journaled: dict | None = None


def run_text_chunk(
    records: list[Record],
    engine,
    tokenizer,
    s: RegenerateSettings,
    max_len: int,
    progress: Progress | None = None,
    journal: Journal | None = None,
    done: dict[Key, dict] | None = None,
):
    """The text mode's `run.run_chunk`: each record's prefix continued (n samples each), rows in input order."""
    from collections import Counter

    from nestling.data.text import special_token_in, text_format
    from nestling.regenerate.run import ChunkResult, _ident, _seed

    done = done or {}
    fmt = text_format(tokenizer)
    res = ChunkResult([], [], Counter())
    n = max(1, s.n)
    jobs: list[Job] = []
    for rec, k in ((r, k) for r in records for k in range(n)):
        skip, detail = rec.skip, rec.detail
        tok = special_token_in(fmt, rec.text) if rec.text is not None else None
        if skip is None and tok is not None:
            skip, detail = "special_token_in_content", f"the text contains the control token {tok!r} as text"
        if skip:
            res.dropped.append({**_ident(rec, k, n), "status": "skipped", "reason": skip, "detail": detail})
            res.counts[f"skipped:{skip}"] += 1
            continue
        for a in sorted(set(rec.altered)):
            res.counts[f"altered:{a}"] += 1
        jobs.append(Job(rec, k, journaled=done.get((rec.source_index, k))))

    def row(j: Job) -> tuple[str, dict]:
        if j.failed:
            reason, detail = j.failed
            return "failed", {**_ident(j.rec, j.sample, n), "status": "failed", "reason": reason, "detail": detail}
        r = {**_ident(j.rec, j.sample, n), "text": j.text, "prefix_chars": len(j.prefix.text if j.prefix else "")}
        if s.save_token_ids:
            r["completion_token_ids"] = j.token_ids or []
        return "kept", r

    def finish(j: Job) -> None:
        if journal is not None:
            status, r = row(j)
            journal.add(
                {
                    "key": [j.rec.source_index, j.sample],
                    "status": status,
                    "row": r,
                    "output_tokens": j.output_tokens,
                    "turns": int(status == "kept"),
                    "truncated_turns": int(j.truncated),
                }
            )

    live = [j for j in jobs if j.journaled is None]
    pre = prefixes(tokenizer, [j.rec.text or "" for j in live], s)
    first = []
    for key, (j, p) in enumerate(zip(live, pre)):
        j.prefix = p
        if len(p.ids) >= max_len:
            j.failed = ("context_overflow", f"prefix is {len(p.ids)} tokens, max_model_len is {max_len}")
            finish(j)
            continue
        first.append((key, Request(p.ids, min(s.max_new_tokens, max_len - len(p.ids)), _seed(s, j.rec, 0, j.sample))))

    def follow(finished: list[tuple[int, Completion]]) -> list[tuple[int, Request]]:
        for key, out in finished:
            j, p = live[key], pre[key]
            if out.error and engine_died(out.detail):  # not this record's fault: stop, keep what finished
                raise EngineDeadError(out.detail)
            if out.error:
                j.failed = (out.error, out.detail)
            else:
                j.text = p.text + continuation(tokenizer, p.ids, out)
                j.token_ids, j.output_tokens = out.token_ids, out.num_tokens
                j.truncated = out.finish_reason == "length"
            finish(j)
        if progress is not None:
            progress.update(len(finished), tokens=sum(o.num_tokens for _, o in finished))
        return []

    if first:
        run_chain(engine, first, follow)
    for j in jobs:
        if j.journaled is not None:
            status, r = j.journaled["status"], j.journaled["row"]
            j.output_tokens, j.truncated = int(j.journaled["output_tokens"]), bool(j.journaled["truncated_turns"])
        else:
            status, r = row(j)
        res.output_tokens += j.output_tokens
        res.turns += int(status == "kept")
        res.truncated_turns += int(j.truncated)
        (res.kept if status == "kept" else res.dropped).append(r)
        res.counts["kept" if status == "kept" else f"failed:{r['reason']}"] += 1
    return res
