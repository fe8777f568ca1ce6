"""Turn one raw record (ShareGPT `conversations` or OpenAI `messages`) into clean chat messages.

Decisions (documented in docs/data.md); every alteration and every drop gets a reason that the
caller counts:
- roles are mapped to user / assistant / system / tool (`ROLE_MAP`, extended by settings); an
  unknown role drops the conversation (`unknown_role`): guessing who spoke would corrupt the mask;
- an empty system message is removed; an empty user/assistant/tool message ends the conversation
  there (`truncated_at_empty_message`): what follows answers a turn that is missing;
- a system message that is not first is removed (`system_not_first_dropped`);
- assistant (and tool) turns before the first user turn are removed (`leading_assistant_dropped`):
  ShareGPT splits long chats into parts, and later parts start with the assistant answering a
  question we do not have;
- consecutive user or assistant turns are merged with a blank line (`merged_consecutive_turns`),
  so templates that demand alternation render them; consecutive tool turns stay separate;
- turns after the last assistant turn are removed (`trailing_turns_dropped`): nothing to supervise;
- a conversation with no assistant turn left is dropped (`no_assistant_turn`).
Tool turns are kept (never supervised); assistant `tool_calls` and `reasoning_content` pass through
to the chat template.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ROLE_MAP = {
    **dict.fromkeys(("human", "user", "prompter", "customer"), "user"),
    **dict.fromkeys(
        ("gpt", "assistant", "chatgpt", "bing", "bard", "model", "bot", "gpt4", "claude", "llm"), "assistant"
    ),
    **dict.fromkeys(("system", "developer"), "system"),
    **dict.fromkeys(("tool", "function", "observation", "ipython", "tool_response", "function_response"), "tool"),
}
ROLES = ("user", "assistant", "system", "tool")
_SURROGATE = re.compile("[\ud800-\udfff]")
PASS_THROUGH = ("reasoning_content", "tool_calls", "name", "tool_call_id")


@dataclass
class Normalized:
    messages: list[dict] | None  # None when dropped
    drop: str | None = None  # reason of the drop
    detail: str = ""  # human-readable detail for the drop (role name, ...)
    altered: list[str] = field(default_factory=list)


def _text(content) -> str | None:
    """Message content as text; None when it holds something other than text: images, audio, a
    number, a bare list of strings or any other JSON value (turning those into text would train on
    something nobody wrote). Only a string or OpenAI text parts ({"type": "text", "text": ...}) count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                return None
        return "".join(parts)
    return None


def normalize_record(record: dict, role_map: dict | None = None, system_prompt: str | None = None) -> Normalized:
    roles = {**ROLE_MAP, **{str(k).lower(): v for k, v in (role_map or {}).items()}}
    turns = record.get("conversations", record.get("messages"))
    if turns is None:
        return Normalized(None, "malformed_record", "record has neither 'conversations' nor 'messages'")
    if not isinstance(turns, list):
        return Normalized(
            None, "malformed_record", f"'conversations'/'messages' is a {type(turns).__name__}, not a list"
        )
    if not turns:
        return Normalized(None, "empty_conversation")
    altered: set[str] = set()
    msgs: list[dict] = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            return Normalized(None, "malformed_record", f"turn {i} is a {type(t).__name__}, not an object")
        raw_role = t.get("from", t.get("role"))
        role = roles.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role not in ROLES:
            return Normalized(None, "unknown_role", f"turn {i} has role {raw_role!r}")
        content = _text(t.get("value", t.get("content")))
        if content is None:
            return Normalized(None, "non_text_content", f"turn {i} holds non-text content")
        if _SURROGATE.search(content):  # a \ud800-style escape of half a character: not text, no tokenizer takes it
            return Normalized(None, "invalid_utf8", f"turn {i} holds a lone surrogate (an escape of half a character)")
        m = {"role": role, "content": content}
        m.update({k: t[k] for k in PASS_THROUGH if t.get(k) is not None})
        if not content.strip() and not m.get("tool_calls"):
            if role == "system":
                altered.add("empty_system_dropped")
                continue
            altered.add("truncated_at_empty_message")
            break
        msgs.append(m)

    system = [m for m in msgs[:1] if m["role"] == "system"]
    rest = msgs[len(system) :]
    if any(m["role"] == "system" for m in rest):
        altered.add("system_not_first_dropped")
        rest = [m for m in rest if m["role"] != "system"]
    if system_prompt is not None:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    first_user = next((i for i, m in enumerate(rest) if m["role"] == "user"), len(rest))
    if first_user:
        altered.add("leading_assistant_dropped")
        rest = rest[first_user:]

    merged: list[dict] = []
    for m in rest:
        prev = merged[-1] if merged else None
        if (
            prev is not None
            and prev["role"] == m["role"]
            and m["role"] in ("user", "assistant")
            and not prev.get("tool_calls")
            and not m.get("tool_calls")
        ):
            prev["content"] = prev["content"].rstrip() + "\n\n" + m["content"].lstrip()
            altered.add("merged_consecutive_turns")
        else:
            merged.append(dict(m))
    last_assistant = max((i for i, m in enumerate(merged) if m["role"] == "assistant"), default=-1)
    if last_assistant < 0:
        return Normalized(None, "no_assistant_turn", altered=sorted(altered))
    if last_assistant < len(merged) - 1:
        altered.add("trailing_turns_dropped")
        merged = merged[: last_assistant + 1]
    return Normalized(system + merged, altered=sorted(altered))
