"""Evaluation prompts: JSONL (`messages` or `prompt`) or a data-stage folder's held-out split,
rendered to token ids with the target's own chat template (one rendering for both engines)."""

from __future__ import annotations

import json
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


def load_prompts(source: str | Path, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Token ids of each prompt, ending with the generation prompt of the chat template."""
    src = Path(source)
    if src.is_dir():
        from nestling.data.dataset import load_samples

        samples = load_samples(src, "heldout")
        prompts = [p for p in (_last_user_turn(list(s.input_ids), list(s.loss_mask)) for s in samples) if p]
    else:
        if not src.exists():
            raise NestlingError(f"prompts file {src} does not exist")
        prompts = []
        try:
            text = src.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise NestlingError(
                f"prompts file {src} is not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                "save it as UTF-8"
            ) from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise NestlingError(
                    f"{src}:{n} is not valid JSON ({e.msg}); each line must be an object with 'messages' or 'prompt'"
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
            else:
                raise NestlingError(
                    f"{src}:{n}: expected an object with a non-empty 'messages' list or 'prompt' string"
                )
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            prompts.append(list(ids["input_ids"]))
    if not prompts:
        raise NestlingError(f"{src} holds no prompts")
    return prompts[:limit] if limit else prompts
