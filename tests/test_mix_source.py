"""benchmarks/mix_source.py: the chat + maths training input of the mix measurement. The maths
generator needs an old sympy, so its round-robin logic is tested on stand-in problem makers; the
mix itself on the real ShareGPT file and the quality benchmark's held-out split."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


@dataclass
class Problem:
    question: str
    answer: str


def test_maths_questions_round_robin_drop_broken_and_skip_repeats(capsys):
    import mix_source

    counter = iter(range(10**6))

    def broken():
        raise AttributeError("the package's rot")

    mods = [
        ("a", lambda: Problem(f"What is {next(counter)} + 1?", "x")),
        ("b", broken),
        ("c", lambda: Problem("Always the same question?", "y")),
        ("d", lambda: Problem("x" * 500, "too long")),
    ]
    out = mix_source.maths_questions(30, mods=mods)  # b fails on each of the first 20 rounds, then is dropped
    assert len(out) == 30
    questions = [c["conversations"][0]["value"] for c in out]
    assert len(set(questions)) == 30 and all(len(q) <= 160 for q in questions)
    assert [c["module"] for c in out[:2]] == ["a", "c"]  # round-robin; a repeat and an overlong one skipped
    assert all(c["conversations"][0]["from"] == "human" and c["conversations"][1]["from"] == "gpt" for c in out)
    assert "dropped maths module b" in capsys.readouterr().err
    # every module broken: it stops instead of spinning
    assert mix_source.maths_questions(3, mods=[("b", broken)]) == []


@pytest.mark.slow
def test_mix_is_chat_outside_the_held_out_prompts_then_maths(tmp_path):
    import quality

    maths = [
        {
            "id": f"maths-{i}",
            "conversations": [{"from": "human", "value": f"Solve {i}*x = {i} for x."}, {"from": "gpt", "value": "1"}],
        }
        for i in range(3)
    ]
    (tmp_path / "maths.jsonl").write_text("".join(json.dumps(m) + "\n" for m in maths))
    out = tmp_path / "mix.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "mix_source.py"),
            "--out",
            str(out),
            "--chat",
            "40",
            "--maths-from",
            str(tmp_path / "maths.jsonl"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 43 and rows[40:] == maths
    _, heldout, _ = quality.split_sharegpt(tmp_path / "q", 100, None)
    asked = {json.loads(line)["messages"][0]["content"].strip() for line in heldout.read_text().splitlines()}
    user = {t["value"].strip() for c in rows[:40] for t in c["conversations"] if t["from"] in ("human", "user")}
    assert asked and not asked & user
