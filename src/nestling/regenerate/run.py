"""`regenerate(input, target, out, settings)`: the target rewrites every assistant turn.

Turn k of a conversation is generated from the history whose earlier answers were already
regenerated, so the draft later learns the target's own distribution. Conversations are processed
in chunks; inside a chunk, all conversations' turn k form one engine batch. A finished chunk is
appended to the output files and fsynced, then `state.json` records the new file sizes; a rerun
truncates the files to those sizes and continues with the next chunk; inside the chunk in flight,
finished conversations are journaled as they finish (journal.py) and not run again. So a kill -9
costs the conversations that were running, and the result equals an uninterrupted run.

Output (`OUT/`): `messages.jsonl` (kept conversations, `{"id", "source_index", "messages"}`, read by
the data stage as is), `failed.jsonl` (every failed or skipped record with its reason), `manifest.json`;
while a chunk runs, `partial.jsonl` (journal.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from nestling.config import to_dict
from nestling import outdir
from nestling.errors import NestlingError
from nestling.faults import EngineDeadError, engine_died
from nestling.inputs import refuse_remote
from nestling.manifest import MANIFEST, atomic_write_json, hash_file, hash_json, write_manifest
from nestling.progress import Progress, log
from nestling.regenerate.chat import assistant_positions, plan, postprocess, render_prompts
from nestling.regenerate.engine import (
    Completion,
    Engine,
    Request,
    make_engine,
    resolve_chunk_size,
    resolve_engine,
    run_chain,
)
from nestling.regenerate.journal import JOURNAL, Journal, Key, read_journal
from nestling.regenerate.readers import Record, read_records
from nestling.regenerate.settings import SAMPLED, RegenerateSettings, output_settings

MESSAGES = "messages.jsonl"
FAILED = "failed.jsonl"
STATE = "state.json"


@dataclass
class Conv:
    """One conversation in flight: its messages are rewritten in place, answer by answer."""

    rec: Record
    messages: list[dict]
    positions: list[int]
    sample: int = 0
    turn: int = 0  # the next assistant turn to generate
    key: int = 0  # index in its chunk (how engines name its requests)
    token_ids: list[list[int]] = field(default_factory=list)
    failed: tuple[str, str] | None = None
    output_tokens: int = 0  # this conversation's share of the chunk's counts (the journal keeps them)
    turns_done: int = 0
    truncated_turns: int = 0
    journaled: dict | None = None  # finished by an earlier, killed run (journal.py): not run again


@dataclass
class ChunkResult:
    kept: list[dict]
    dropped: list[dict]  # failed + skipped, each with status and reason
    counts: Counter  # "kept", "failed:<reason>", "skipped:<reason>", "altered:<reason>"
    output_tokens: int = 0
    turns: int = 0
    truncated_turns: int = 0


def _seed(s: RegenerateSettings, rec: Record, turn: int, sample: int = 0) -> int:
    # Depends on the record, turn and sample only, so a resumed run samples exactly what it would have.
    return (s.seed * 1_000_003 + rec.source_index * 1_009 + turn + sample * 2_654_435_761) % (2**31 - 1)


def _ident(rec: Record, sample: int, n: int) -> dict:
    """How a row names its conversation: id and source index, and the sample when there are several."""
    return {"id": rec.id, "source_index": rec.source_index, **({"sample": sample} if n > 1 else {})}


@dataclass
class Turns:
    """A chunk's conversations as a chain of requests: each finished answer is written into its
    conversation, whose next turn is then rendered on the history so far and asked for. Engines
    run the chain in waves (turn k of every conversation at once) or, the hf engine, as a stream."""

    convs: list[Conv]
    tokenizer: object
    s: RegenerateSettings
    max_len: int
    progress: Progress | None
    journal: Journal | None = None

    def finish(self, c: Conv) -> None:
        """A conversation is done (all its turns, or failed): journal it, so a crash keeps it."""
        if self.journal is not None:
            status, row = outcome(c, self.s)
            self.journal.add(
                {
                    "key": [c.rec.source_index, c.sample],
                    "status": status,
                    "row": row,
                    "output_tokens": c.output_tokens,
                    "turns": c.turns_done,
                    "truncated_turns": c.truncated_turns,
                }
            )

    def ask(self, convs: list[Conv]) -> list[tuple[int, Request]]:
        """Each conversation's next request (prompts rendered in one batch); a prompt at or over the
        length limit fails its conversation."""
        s, out = self.s, []
        prompts = render_prompts(self.tokenizer, [c.messages[: c.positions[c.turn]] for c in convs], s.reasoning)
        for c, ids in zip(convs, prompts):
            if len(ids) >= self.max_len:
                c.failed = (
                    "context_overflow",
                    f"assistant turn {c.turn}: prompt is {len(ids)} tokens, max_model_len is {self.max_len}",
                )
                self.finish(c)
                continue
            out.append(
                (c.key, Request(ids, min(s.max_new_tokens, self.max_len - len(ids)), _seed(s, c.rec, c.turn, c.sample)))
            )
        return out

    def follow(self, done: list[tuple[int, Completion]]) -> list[tuple[int, Request]]:
        nxt = []
        for key, out in done:
            c = self.convs[key]
            if out.error and engine_died(out.detail):  # not this conversation's fault: stop, keep what finished
                raise EngineDeadError(out.detail)
            if out.error:
                c.failed = (out.error, f"assistant turn {c.turn}: {out.detail}")
                self.finish(c)
                continue
            c.messages[c.positions[c.turn]]["content"] = postprocess(out.text, self.s.reasoning)
            c.token_ids.append(out.token_ids or [])
            c.output_tokens += out.num_tokens
            c.turns_done += 1
            c.truncated_turns += out.finish_reason == "length"
            c.turn += 1
            if c.turn < len(c.positions):
                nxt.append(c)
            else:
                self.finish(c)
        if self.progress is not None:  # a failed answer is a turn done too: the count reaches the plan
            self.progress.update(len(done), tokens=sum(o.num_tokens for _, o in done))
        return self.ask(nxt)


def planned_turns(records: list[Record], s: RegenerateSettings) -> int:
    """The assistant turns a chunk will generate if none fails (what progress counts against); in text
    mode, one continuation per record."""
    if s.mode == "text":
        return max(1, s.n) * sum(1 for r in records if not r.skip)
    return max(1, s.n) * sum(
        len(assistant_positions(plan(r.messages or [], s.max_turns)[0])) for r in records if not r.skip
    )


def outcome(c: Conv, s: RegenerateSettings) -> tuple[str, dict]:
    """("kept", its messages row) or ("failed", its failed.jsonl row) for a finished conversation."""
    n = max(1, s.n)
    if c.failed:
        reason, detail = c.failed
        return "failed", {**_ident(c.rec, c.sample, n), "status": "failed", "reason": reason, "detail": detail}
    row = {**_ident(c.rec, c.sample, n), "messages": c.messages}
    if s.save_token_ids:
        row["completion_token_ids"] = c.token_ids
    return "kept", row


def run_chunk(
    records: list[Record],
    engine: Engine,
    tokenizer,
    s: RegenerateSettings,
    max_len: int,
    progress: Progress | None = None,
    journal: Journal | None = None,
    done: dict[Key, dict] | None = None,
) -> ChunkResult:
    """Regenerate a chunk; conversations in `done` (a killed run's journal) are taken from it, and
    each one finished here goes to `journal` as it finishes. Text mode: text.py."""
    if s.mode == "text":
        from nestling.regenerate.text import run_text_chunk

        return run_text_chunk(records, engine, tokenizer, s, max_len, progress, journal, done)
    done = done or {}
    res = ChunkResult([], [], Counter())
    convs: list[Conv] = []
    n = max(1, s.n)
    for rec, k in ((r, k) for r in records for k in range(n)):  # with n > 1, each sample is a conversation
        if rec.skip:
            res.dropped.append({**_ident(rec, k, n), "status": "skipped", "reason": rec.skip, "detail": rec.detail})
            res.counts[f"skipped:{rec.skip}"] += 1
            continue
        msgs, altered = plan(rec.messages or [], s.max_turns)
        for a in sorted(set(rec.altered) | set(altered)):
            res.counts[f"altered:{a}"] += 1
        if not msgs:
            res.dropped.append(
                {
                    **_ident(rec, k, n),
                    "status": "skipped",
                    "reason": "no_assistant_turn",
                    "detail": "no assistant turn after a user turn",
                }
            )
            res.counts["skipped:no_assistant_turn"] += 1
            continue
        convs.append(Conv(rec, msgs, assistant_positions(msgs), k, key=len(convs)))
        convs[-1].journaled = done.get((rec.source_index, k))
    turns = Turns(convs, tokenizer, s, max_len, progress, journal)
    live = [c for c in convs if c.journaled is None]
    if live:
        run_chain(engine, turns.ask(live), turns.follow)
    for c in convs:  # the chunk's counts are its conversations' (a journaled one's as journaled)
        if c.journaled is not None:
            status, row = c.journaled["status"], c.journaled["row"]
            c.output_tokens, c.turns_done = int(c.journaled["output_tokens"]), int(c.journaled["turns"])
            c.truncated_turns = int(c.journaled["truncated_turns"])
        else:
            status, row = outcome(c, s)
        res.output_tokens += c.output_tokens
        res.turns += c.turns_done
        res.truncated_turns += c.truncated_turns
        (res.kept if status == "kept" else res.dropped).append(row)
        res.counts["kept" if status == "kept" else f"failed:{row['reason']}"] += 1
    return res


def _append(path: Path, rows: list[dict]) -> int:
    """Append rows as JSON lines, fsync, and return the new file size (the commit point)."""
    with open(path, "ab") as f:
        for row in rows:
            f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def _truncate(path: Path, size: int) -> None:
    """Cut a file back to its last committed size (drops a half-written chunk after a crash)."""
    if not path.exists():
        if size:
            raise NestlingError(f"{path} is missing but {STATE} says it held {size} bytes; delete the folder and rerun")
        path.touch()
        return
    if path.stat().st_size < size:
        raise NestlingError(f"{path} is shorter than {STATE} records; the folder is damaged: delete it and rerun")
    with open(path, "r+b") as f:
        f.truncate(size)


def summarize(counts: Counter, n: int = 1) -> dict:
    """Counts by status and reason. With n samples per conversation every count but `read` is in
    conversations x samples, so kept + failed + skipped = read x n."""

    def by(prefix: str) -> dict:
        return dict(sorted((k.split(":", 1)[1], v) for k, v in counts.items() if k.startswith(prefix + ":")))

    failed, skipped = by("failed"), by("skipped")
    total = counts["kept"] + sum(failed.values()) + sum(skipped.values())
    return {
        "read": total // n,
        "samples": n,
        "kept": counts["kept"],
        "failed": failed,
        "skipped": skipped,
        "altered": by("altered"),
    }


def regenerate(
    input: str | Path, target: str | Path, out: str | Path, settings: RegenerateSettings | None = None
) -> dict:
    """Regenerate every assistant turn of `input` with `target`; write `out/`; return the manifest."""
    from nestling.targets.load import resolve_target

    s = settings or RegenerateSettings()
    refuse_remote(input, "input")  # a URL: never fetched
    input, out = Path(input), Path(out)
    if not input.is_file():
        raise NestlingError(f"input {input} does not exist or is not a file (give a .json or .jsonl chat file)")
    if s.max_new_tokens < 1 or s.chunk_size < 0 or s.n < 1:
        raise NestlingError("max_new_tokens and n must be at least 1, chunk_size at least 0 (0 = auto)")
    if s.n > 1 and s.temperature <= 0:
        raise NestlingError(
            f"n={s.n} samples per conversation need sampling: set temperature > 0 "
            "(greedy answers would all be the same)"
        )
    if s.sampled < 0 or (s.sampled and s.sampled_temperature <= 0):
        raise NestlingError(
            f"sampled={s.sampled}, sampled_temperature={s.sampled_temperature}: sampled is 0 (off) or the number "
            "of extra sampled answers per conversation, and needs sampled_temperature > 0"
        )
    shard_of(s.shard)  # a bad shard fails before the target loads
    target_dir = resolve_target(target)
    with outdir.claim(out, "regenerate", [("input file", input), ("target", target_dir), ("target", target)]):
        manifest = _regenerate(input, target_dir, out, s)
        if s.sampled:  # a pass of its own: it resumes, and is fingerprinted, apart from the main one
            log(f"[regenerate] {s.sampled} sampled answer(s) per conversation at temperature {s.sampled_temperature}")
            (out / SAMPLED).mkdir(exist_ok=True)
            manifest["sampled"] = _regenerate(input, target_dir, out / SAMPLED, sampled_pass(s))
        return manifest


def shard_of(shard: str) -> tuple[int, int]:
    """(I, N) of a `shard` setting "I/N" ((0, 1) for ""), checked."""
    if not shard:
        return 0, 1
    i, _, n = shard.partition("/")
    if not (i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
        raise NestlingError(f"shard={shard!r}: give I/N with 0 <= I < N (e.g. shard=0/8 ... shard=7/8), or none")
    return int(i), int(n)


def sampled_pass(s: RegenerateSettings) -> RegenerateSettings:
    """The settings of the `sampled` pass: n = sampled answers at sampled_temperature, seeded apart
    from the main pass (so a sampled main pass is not repeated token for token)."""
    return dataclasses.replace(s, n=s.sampled, temperature=s.sampled_temperature, seed=s.seed + 1, sampled=0)


def _regenerate(input: Path, target_dir: Path, out: Path, s: RegenerateSettings) -> dict:
    from nestling.targets.load import load_config, load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    s = _resolve_mode(s, tokenizer, target_dir)
    engine_name = resolve_engine(s)
    if not s.chunk_size:  # recorded resolved: the fingerprint and the manifest name the chunks used
        s = dataclasses.replace(s, chunk_size=resolve_chunk_size(engine_name, s))
        log(
            f"[regenerate] {s.chunk_size} conversations per chunk (chunk_size 0 = auto, for the {engine_name} engine here)"
        )
    cfg_len = getattr(load_config(target_dir), "max_position_embeddings", None) or 4096
    max_len = s.max_model_len or cfg_len
    inputs = _inputs(input, target_dir, tokenizer)
    fingerprint = hash_json({"inputs": inputs, "settings": output_settings(s)})
    if (out / MANIFEST).exists():
        return _finished(out, fingerprint)
    state = _open_state(out, fingerprint, output_file(s))

    records = list(read_records(input, text=s.mode == "text"))
    if s.limit:
        records = records[: s.limit]
    part, parts = shard_of(s.shard)
    records = records[part::parts]
    chunks = [records[i : i + s.chunk_size] for i in range(0, len(records), s.chunk_size)]
    todo = chunks[state["chunks_done"] :]
    if state["chunks_done"]:
        log(f"[regenerate] resuming: {state['chunks_done']}/{len(chunks)} chunks already done")
    start = time.monotonic()
    if todo:
        max_len = _run_chunks(todo, engine_name, target_dir, tokenizer, s, max_len, out, state)
    return _write_manifest(out, s, engine_name, max_len, inputs, fingerprint, state, len(records), start, target_dir)


def _resolve_mode(s: RegenerateSettings, tokenizer, target_dir: Path) -> RegenerateSettings:
    """The settings with `mode` resolved (auto: text when the target has no chat template), checked."""
    from nestling.data.text import resolve_mode

    mode = resolve_mode(s.mode, tokenizer, None)
    if mode == "chat" and not getattr(tokenizer, "chat_template", None):
        raise NestlingError(
            f"target {target_dir} has no chat template; regeneration renders prompts with it "
            "(mode=text continues text records instead: docs/regenerate.md)"
        )
    if mode == "text" and (s.prefix_tokens < 1 or not 0 <= s.prefix_fraction < 1):
        raise NestlingError(
            f"prefix_tokens={s.prefix_tokens}, prefix_fraction={s.prefix_fraction}: prefix_tokens is at least 1, "
            "prefix_fraction a share in [0, 1) (0 = use prefix_tokens)"
        )
    if mode != s.mode:
        log(f"[regenerate] mode {mode} (auto: the target {'has no' if mode == 'text' else 'has a'} chat template)")
    return dataclasses.replace(s, mode=mode)


def output_file(s: RegenerateSettings) -> str:
    """The file of kept rows: conversations (chat mode) or text records (text mode), read by the data stage."""
    from nestling.regenerate.text import TEXT

    return TEXT if s.mode == "text" else MESSAGES


def _inputs(input: Path, target_dir: Path, tokenizer) -> dict:
    """What the output depends on besides the settings: the data file, the target and its tokenizer."""
    from nestling.targets.load import target_fingerprint, tokenizer_fingerprint

    return {
        "data": {"path": str(input.resolve()), "fingerprint": hash_file(input)},
        "target": target_fingerprint(target_dir),
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }


def _finished(out: Path, fingerprint: str) -> dict:
    """A finished folder: its manifest when it is for these inputs and settings, else an error."""
    manifest = json.loads((out / MANIFEST).read_text())
    if manifest.get("fingerprint") == fingerprint:
        log(f"[regenerate] {out} is already complete for these inputs and settings; nothing to do")
        return manifest
    raise NestlingError(
        f"{out} holds a finished regeneration of other inputs or settings; use another --out or delete it"
    )


def _open_state(out: Path, fingerprint: str, kept: str = MESSAGES) -> dict:
    """The resume state (a fresh one when there is none), the output files cut back to what it committed."""
    state_path = out / STATE
    state = json.loads(state_path.read_text()) if state_path.exists() else None
    if state and state.get("fingerprint") != fingerprint:
        raise NestlingError(
            f"{out} holds an unfinished regeneration of other inputs or settings; "
            "rerun with the same ones to continue, or use another --out"
        )
    state = state or {
        "fingerprint": fingerprint,
        "chunks_done": 0,
        "bytes": {kept: 0, FAILED: 0},
        "counts": {},
        "output_tokens": 0,
        "turns": 0,
        "truncated_turns": 0,
        "seconds": 0.0,
    }
    for name in (kept, FAILED):
        _truncate(out / name, state["bytes"][name])
    atomic_write_json(state_path, state)  # at once: its fingerprint vouches for a journal written next
    return state


def _run_chunks(
    todo: list[list[Record]],
    engine_name: str,
    target_dir: Path,
    tokenizer,
    s: RegenerateSettings,
    max_len: int,
    out: Path,
    state: dict,
) -> int:
    """Generate the chunks left, committing `state` after each; returns the sequence limit used."""
    engine = make_engine(engine_name, target_dir, s, max_len)
    if engine.max_model_len and engine.max_model_len < max_len:
        log(f"[regenerate] the engine allows {engine.max_model_len} tokens per sequence; using that limit")
        max_len = engine.max_model_len
    # Counted in turns, as answers come in (a chunk may be all of the input: conversations are only
    # counted when it is written); turns lost to a failed conversation are counted at its chunk's end.
    # The first chunk's turns that a killed run journaled are not planned again.
    done = read_journal(out / JOURNAL, state["chunks_done"])
    planned = [planned_turns(chunk, s) for chunk in todo]
    planned[0] -= sum(int(e["turns"]) for e in done.values() if e["status"] == "kept")
    progress = Progress("regenerate", total=sum(planned), unit="text" if s.mode == "text" else "turn")
    counts = Counter(state["counts"])
    try:
        written = 0  # conversations of this run written so far
        for chunk, turns in zip(todo, planned):
            t0, before = time.monotonic(), progress.done
            journal = Journal(out / JOURNAL, state["chunks_done"], s.journal_every_s)
            try:
                res = run_chunk(chunk, engine, tokenizer, s, max_len, progress, journal, done)
            except BaseException:
                journal.flush()  # an error or Ctrl-C: what finished before it is kept for the rerun
                raise
            done = {}
            state["bytes"][output_file(s)] = _append(out / output_file(s), res.kept)
            state["bytes"][FAILED] = _append(out / FAILED, res.dropped)
            counts.update(res.counts)
            state["counts"] = dict(counts)
            state["chunks_done"] += 1
            for k in ("output_tokens", "turns", "truncated_turns"):
                state[k] += getattr(res, k)
            state["seconds"] += time.monotonic() - t0
            atomic_write_json(out / STATE, state)  # the commit: files up to these sizes are final
            (out / JOURNAL).unlink(missing_ok=True)  # superseded (a kill before this: read_journal drops it)
            written += len(chunk)
            progress.update(turns - (progress.done - before), conv=f"{written}/{sum(map(len, todo))}")
    finally:
        engine.close()
    progress.close()
    return max_len


def _write_manifest(
    out: Path,
    s: RegenerateSettings,
    engine_name: str,
    max_len: int,
    inputs: dict,
    fingerprint: str,
    state: dict,
    n_records: int,
    start: float,
    target_dir: Path,
) -> dict:
    """Check the accounting, write the manifest and the closing log line."""
    summary = summarize(Counter(state["counts"]), s.n)
    if summary["kept"] + sum(summary["failed"].values()) + sum(summary["skipped"].values()) != n_records * s.n:
        raise NestlingError(
            f"internal accounting error: {summary['read']} records accounted, {n_records} read (x {s.n} samples)"
        )
    secs = max(state["seconds"], 1e-9)
    cap_share = state["truncated_turns"] / max(1, state["turns"])
    manifest = write_manifest(
        out,
        "regenerate",
        {**to_dict(s), "engine": engine_name, "max_model_len": max_len},
        inputs,
        fingerprint=fingerprint,
        target=str(target_dir),
        counts=summary,
        files={"messages": output_file(s), "failed": FAILED},  # "messages": the file the data stage reads
        format="text_jsonl" if s.mode == "text" else "messages_jsonl",
        generation={
            "turns": state["turns"],
            "output_tokens": state["output_tokens"],
            "truncated_turns": state["truncated_turns"],
            "truncated_share": round(cap_share, 4),
            "seconds": round(state["seconds"], 3),
            "conversations_per_s": round(n_records / secs, 4),
            "output_tokens_per_s": round(state["output_tokens"] / secs, 2),
        },
    )
    log(
        f"[regenerate] done: {summary['kept']} kept, {sum(summary['failed'].values())} failed "
        f"{summary['failed']}, {sum(summary['skipped'].values())} skipped {summary['skipped']}; "
        f"{state['turns']} turns, {state['output_tokens']} tokens, {cap_share:.1%} of turns hit the "
        f"{s.max_new_tokens}-token cap -> {out / output_file(s)} ({time.monotonic() - start:.1f} s)"
    )
    return manifest
