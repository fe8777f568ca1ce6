"""Evaluation prompts: JSONL (`messages` or `prompt`) or a data-stage folder's held-out split,
rendered to token ids with the target's own chat template (one rendering for both engines). A target
without a chat template (a base model) is prompted with plain text: `prompt` or `text` as it is, a
chat record's messages joined as the data stage's text mode joins them, and a text-mode held-out row's
first document cut to its first half (`_text_prompt`)."""

from __future__ import annotations

from pathlib import Path

from nestling.errors import NestlingError


def _last_user_turn(input_ids: list[int], loss_mask: list[int]) -> list[int]:
    """A held-out sample's prompt: everything before its last supervised (assistant) span."""
    last = max((i for i, m in enumerate(loss_mask) if m), default=None)
    if last is None:
        return list(input_ids)
    start = last
    while start > 0 and loss_mask[start - 1]:
        start -= 1
    return list(input_ids[:start])


def _text_mode(data_dir: Path) -> bool:
    """Whether a data-stage folder holds text-mode rows (documents packed, every token supervised)."""
    from nestling.manifest import read_manifest

    return read_manifest(data_dir, "data").get("mode") == "text"


def _text_prompt(input_ids: list[int], eos: int | None) -> list[int]:
    """A text-mode row's prompt: its first document (up to its EOS) cut to its first half, at least one token."""
    end = input_ids.index(eos) if eos is not None and eos in input_ids else len(input_ids)
    return list(input_ids[: max(1, end // 2)])


def load_prompts(source: str | Path, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Token ids of each prompt, ending with the generation prompt of the chat template."""
    src = Path(source)
    if src.is_dir():
        from nestling.data.dataset import load_samples

        samples = load_samples(src, "heldout")
        if _text_mode(src):
            prompts = [_text_prompt(list(s.input_ids), tokenizer.eos_token_id) for s in samples]
        else:
            prompts = [p for p in (_last_user_turn(list(s.input_ids), list(s.loss_mask)) for s in samples) if p]
    else:
        from nestling.inputs import json_loads, read_text

        from nestling.data.text import FLATTEN_SEPARATOR, has_chat_template

        base = not has_chat_template(tokenizer)
        prompts = []
        text = read_text(src, "prompts file")
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json_loads(line)
            except ValueError as e:
                raise NestlingError(
                    f"{src}:{n} is not valid JSON ({str(e)[:200]}); each line must be an object with 'messages' or 'prompt'"
                ) from None
            except RecursionError:
                raise NestlingError(
                    f"{src}:{n} is nested too deeply to parse; each line must be an object with 'messages' or 'prompt'"
                ) from None
            if isinstance(rec, dict) and isinstance(rec.get("messages"), list) and rec["messages"]:
                msgs = [m for m in rec["messages"] if isinstance(m, dict)]
                while msgs and msgs[-1].get("role") == "assistant":  # evaluate the reply to the last user turn
                    msgs.pop()
                if not msgs:
                    raise NestlingError(f"{src}:{n}: 'messages' has no user turn")
            elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and rec["prompt"].strip():
                msgs = [{"role": "user", "content": rec["prompt"]}]
            elif isinstance(rec, dict) and isinstance(rec.get("text"), str) and rec["text"].strip() and base:
                msgs = [{"role": "user", "content": rec["text"]}]
            else:
                raise NestlingError(
                    f"{src}:{n}: expected an object with a non-empty 'messages' list or 'prompt' string"
                    + (" (or 'text')" if base else "")
                )
            if base:  # no chat template: the text as a base model reads it (special tokens such as BOS added)
                text = FLATTEN_SEPARATOR.join(
                    str(m.get("content") or "") for m in msgs if str(m.get("content") or "").strip()
                )
                prompts.append(list(tokenizer(text)["input_ids"]))
                continue
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            prompts.append(list(ids["input_ids"]))
    if not prompts:
        raise NestlingError(f"{src} holds no prompts")
    return prompts[:limit] if limit else prompts


def fit_context(prompts: list[list[int]], context: int | None, room: int) -> list[list[int]]:
    """Prompts cut to leave `room` tokens (generation and drafting) in the target's `context`
    (max_position_embeddings; None = unknown: unchanged): a longer prompt is cut from the front, keeping
    the end, which holds the last user turn and the generation prompt, with a log line that says so.
    Decoding past the context is garbage (and a 300k-token prompt takes the reference decoder's memory
    for minutes before any output); a context with no room at all is refused before any work."""
    from nestling.progress import log

    if not context:
        return prompts
    keep = context - room
    if keep < 1:
        raise NestlingError(
            f"the target's context is {context} tokens, and max_new_tokens + k need {room}: no room for a prompt; "
            "lower max_new_tokens"
        )
    cut = [i for i, p in enumerate(prompts) if len(p) > keep]
    if cut:
        longest = max(len(prompts[i]) for i in cut)
        log(
            f"[eval] {len(cut)} prompt(s) longer than the target's context allows ({keep} tokens of {context}, "
            f"with max_new_tokens and k; the longest {longest}) were cut to their last {keep} tokens"
        )
    return [p[-keep:] if len(p) > keep else p for p in prompts]
