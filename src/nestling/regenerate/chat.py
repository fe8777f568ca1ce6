"""What gets regenerated and how a prompt is rendered: the target's own chat template, our tokens.

We render prompts ourselves (template -> text -> token ids) and hand every engine token ids, so
the in-process engines and a remote server see exactly the same prompt.
"""

from __future__ import annotations

import re
from typing import Any

THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def plan(messages: list[dict], max_turns: int = 0) -> tuple[list[dict], list[str]]:
    """Keep the first `max_turns` assistant turns (all when 0); return (messages, alterations).

    The conversation is already normalised by the data stage's rules (`nestling.data.normalize`:
    leading assistant and trailing turns dropped, roles mapped), so only the turn cap is left here.
    """
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if max_turns and len(assistant) > max_turns:
        return [dict(m) for m in messages[: assistant[max_turns - 1] + 1]], ["turns_beyond_max_turns_dropped"]
    return [dict(m) for m in messages], []


def assistant_positions(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def template_kwargs(reasoning: str) -> dict[str, Any]:
    # Templates with a thinking switch (Qwen3 and kin) read `enable_thinking`; others ignore it.
    return {"enable_thinking": False} if reasoning == "disable" else {}


def render_prompt(tokenizer, history: list[dict], reasoning: str = "keep") -> list[int]:
    """Token ids of `history` followed by the assistant generation prompt, via the target's template."""
    return render_prompts(tokenizer, [history], reasoning)[0]


def render_prompts(tokenizer, histories: list[list[dict]], reasoning: str = "keep") -> list[list[int]]:
    """`render_prompt` of many histories, tokenized in one call (fast tokenizers batch in parallel,
    which matters when a turn of a large chunk renders tens of thousands of prompts)."""
    if not histories:
        return []
    texts = [
        tokenizer.apply_chat_template(h, tokenize=False, add_generation_prompt=True, **template_kwargs(reasoning))
        for h in histories
    ]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def postprocess(text: str, reasoning: str) -> str:
    """The answer as stored: with `strip`, thinking blocks are removed (also one the template opened)."""
    if reasoning != "strip":
        return text
    text = THINK_BLOCK.sub("", text)
    if "</think>" in text:  # the generation prompt already opened <think>
        text = text.split("</think>", 1)[1]
    return text.lstrip()
