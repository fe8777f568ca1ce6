"""benchmarks/mix_source.py: the chat + maths + code training input of the mix measurement. The maths
generator needs an old sympy, so its round-robin logic is tested on stand-in problem makers; the code
requests on stand-in modules and on the real standard library against the real HumanEval file; the
mix itself on the real ShareGPT file and the quality benchmark's held-out split."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import types
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
def test_mix_is_chat_outside_the_held_out_prompts_then_maths_then_code(tmp_path):
    import quality

    maths = [
        {
            "id": f"maths-{i}",
            "conversations": [{"from": "human", "value": f"Solve {i}*x = {i} for x."}, {"from": "gpt", "value": "1"}],
        }
        for i in range(3)
    ]
    (tmp_path / "maths.jsonl").write_text("".join(json.dumps(m) + "\n" for m in maths))
    code = [
        {
            "id": "code-x.f",
            "conversations": [{"from": "human", "value": "Write f."}, {"from": "gpt", "value": "def f():"}],
        }
    ]
    (tmp_path / "code.jsonl").write_text(json.dumps(code[0]) + "\n")
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
            "--code-from",
            str(tmp_path / "code.jsonl"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 44 and rows[40:43] == maths and rows[43:] == code
    _, heldout, _ = quality.split_sharegpt(tmp_path / "q", 100, None)
    asked = {json.loads(line)["messages"][0]["content"].strip() for line in heldout.read_text().splitlines()}
    user = {t["value"].strip() for c in rows[:40] for t in c["conversations"] if t["from"] in ("human", "user")}
    assert asked and not asked & user


@pytest.mark.slow
def test_a_later_chat_slice_adds_the_conversations_after_the_first_mix(tmp_path):
    """`--chat-start S --chat N --maths 0` (gpu_recipe.sh grow's new conversations): the N conversations
    that follow a mix of S, no maths, none of the first S."""

    def mix(name: str, *args: str) -> list[dict]:
        out = tmp_path / f"{name}.jsonl"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "mix_source.py"), "--out", str(out), "--maths", "0"]
        r = subprocess.run(cmd + list(args), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return [json.loads(line) for line in out.read_text().splitlines()]

    first, later, both = (
        mix("first", "--chat", "30"),
        mix("later", "--chat-start", "30", "--chat", "12"),
        mix("both", "--chat", "42"),
    )
    assert len(first) == 30 and len(later) == 12
    assert later == both[30:] and not {c["id"] for c in first} & {c["id"] for c in later}
    assert not [c for c in later if "module" in c]  # chat only: maths and code rows name their module


def _module(name: str, source: str) -> types.ModuleType:
    """A module made from `source` in a real file (inspect.getsource needs one)."""
    import importlib.util
    import tempfile

    path = Path(tempfile.mkdtemp()) / f"{name.replace('.', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LIB = """
def clamp(x, lo=0, hi=1):
    \"\"\"Clamp x into the closed interval [lo, hi].

    >>> clamp(5, 0, 3)
    3
    \"\"\"
    return max(lo, min(hi, x))

def terse(x):
    \"\"\"Too short.\"\"\"

def undocumented(x):
    return x

def with_repr_default(x, key=len):
    \"\"\"A default whose repr names an object, which would put a memory address in the prompt.\"\"\"

def _private(x):
    \"\"\"Private functions are not asked about, however well documented they are.\"\"\"

class Stack:
    def push(self, item):
        \"\"\"Put item on top of the stack and return the new depth.\"\"\"
        return 1

def has_close_elements(numbers, threshold):
    \"\"\"A HumanEval entry point's name: never asked when excluded.\"\"\"
"""


def test_code_request_is_the_stub_with_its_docstring_and_the_def_line_as_stand_in():
    import random

    import mix_source

    mod = _module("stdlib_like", LIB)
    request, answer = mix_source.code_request("clamp", mod.clamp, random.Random(0))
    assert answer == "def clamp(x, lo=0, hi=1):"
    assert "clamp" in request and "Clamp x into the closed interval [lo, hi]." in request
    assert "return max" not in request  # the body is the target's to write
    for fn in (mod.terse, mod.undocumented, mod.with_repr_default):
        assert mix_source.code_request(fn.__name__, fn, random.Random(0)) is None
    # a docstring over the limit is cut at a paragraph; one paragraph over it is left out
    long = _module("long_doc", 'def f(x):\n    """' + "word " * 20 + "\n\n" + "more " * 300 + '"""\n')
    cut = mix_source.code_request("f", long.f, random.Random(0))
    assert cut is not None and "word" in cut[0] and "more" not in cut[0]
    one = _module("one_par", 'def g(x):\n    """' + "word " * 300 + '"""\n')
    assert mix_source.code_request("g", one.g, random.Random(0)) is None


def test_code_questions_round_robin_over_groups_exclude_and_repeatable():
    import mix_source

    lib = _module("lib_a", LIB)
    other = _module("lib_b", LIB.replace("clamp", "bound").replace("push", "pop"))
    kw = dict(modules=[lib, other], exclude=frozenset({"has_close_elements"}))
    rows = mix_source.code_questions(10, seed=1, **kw)
    ids = [r["id"] for r in rows]
    # per module: clamp and Stack.push are usable; terse, undocumented, the repr default, the private
    # function and the excluded HumanEval name are not
    assert sorted(ids) == ["code-lib_a.Stack.push", "code-lib_a.clamp", "code-lib_b.Stack.pop", "code-lib_b.bound"]
    assert {r["module"] for r in rows[:2]} == {"lib_a", "lib_b"}  # one from each group before a second
    assert all(c["conversations"][0]["from"] == "human" and c["conversations"][1]["from"] == "gpt" for c in rows)
    assert mix_source.code_questions(10, seed=1, **kw) == rows
    assert len(mix_source.code_questions(3, seed=1, **kw)) == 3
    assert any("has_close_elements" in r["id"] for r in mix_source.code_questions(10, seed=1, modules=[lib]))


@pytest.mark.slow
def test_code_only_file_holds_no_heldout_code_problem(tmp_path):
    """The shipped source on the real standard library and packages: no HumanEval function is asked
    about, by name or by its docstring's opening."""
    from nestling.assets import humaneval_jsonl

    out = tmp_path / "code.jsonl"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "mix_source.py"),
        "--code-only",
        "--code",
        "600",
        "--out",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 600 and len({r["id"] for r in rows}) == 600
    groups = {r["module"].split(".")[0] if r["module"].split(".")[0] in ("sympy", "networkx") else "std" for r in rows}
    assert groups == {"std", "sympy", "networkx"}
    with gzip.open(humaneval_jsonl(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    names = {p["entry_point"] for p in problems}
    asked = {r["conversations"][1]["value"].split("(")[0].removeprefix("def ") for r in rows}
    assert not names & asked
    openings = {p["prompt"].split('"""')[1].strip().split("\n")[0] for p in problems if '"""' in p["prompt"]}
    text = "\n".join(r["conversations"][0]["value"] for r in rows)
    assert len(openings) > 100 and not [o for o in openings if len(o) > 30 and o in text]
