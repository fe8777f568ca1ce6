"""A training input that mixes chat with maths and code: ShareGPT conversations, generated maths
questions and code requests built from documented Python functions.

    python benchmarks/mix_source.py --out mix.jsonl [--chat 5000] [--maths 10000] [--heldout 100]
    python benchmarks/mix_source.py --maths-only --out maths.jsonl   (in the maths environment)
    python benchmarks/mix_source.py --code-only --out code.jsonl [--code 5000]
    python benchmarks/mix_source.py --out mix.jsonl --maths-from maths.jsonl [--code-from code.jsonl]
    python benchmarks/mix_source.py --out more.jsonl --chat-start 5000 --chat 6000 --maths 0

Chat: the first `--chat` ShareGPT conversations of the package index's file, less every conversation
that shares a part or a prompt with the quality benchmark's held-out chat prompts (quality.py's
`split_sharegpt`), so `benchmarks/quality.py --domains chat` stays unseen; `--chat-start S` skips the
first S of them, so a later slice adds conversations no earlier mix of S holds (`--maths 0`: chat alone). Maths: questions from
DeepMind's mathematics_dataset generator (`pip install mathematics-dataset==1.0.1`, on the package
index; it needs sympy < 1.6, older than torch's, so it runs in an environment of its own named by
`--maths-python`), round-robin over its training modules at every difficulty, seeded; its short reference answer
stands in as the assistant turn, which `nestling regenerate` rewrites in the target's words anyway.
These are synthetic school-maths drills, not the competition problems (CHAMP) the maths domain is
measured on. Code: the index ships no code training set, so the requests are built from the
signatures and docstrings of the documented public functions of Python's standard library and a few
pure-Python packages (`CODE_PACKAGES`), each asked in one of several wordings (`CODE_ASKS`), its `def`
line the stand-in answer (the target writes the real one); no HumanEval function (the code domain's
prompts) is among them.

Writes one ShareGPT-style JSONL (regenerate reads one input file): chat, then maths, then code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import random
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))


def maths_modules() -> list[tuple[str, object]]:
    """mathematics_dataset's training modules, flattened and sorted by name (a fixed order)."""
    from mathematics_dataset.modules import modules

    def flat(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for key, value in tree.items():
            name = f"{prefix}__{key}" if prefix else key
            out += flat(value, name) if isinstance(value, dict) else [(name, value)]
        return out

    return sorted(flat(modules.train(lambda r: r)), key=lambda kv: kv[0])


def maths_questions(n: int, seed: int = 0, max_chars: int = 160, mods: list | None = None) -> list[dict]:
    """`n` distinct questions as ShareGPT conversations, round-robin over the modules (`mods`: (name,
    problem maker) pairs; default mathematics_dataset's). The package is
    old: a few modules fail under today's numpy/sympy; a module that fails 20 times is dropped (named
    on stderr)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    mods = list(mods) if mods is not None else maths_modules()
    seen: set[str] = set()
    out: list[dict] = []
    fails: dict[str, int] = {}
    while len(out) < n and mods:
        for name, make in list(mods):
            if len(out) >= n:
                break
            try:
                problem = make()
            except Exception as e:  # the package's own rot, not our input
                fails[name] = fails.get(name, 0) + 1
                if fails[name] >= 20:
                    print(f"[mix] dropped maths module {name}: {type(e).__name__}: {e}", file=sys.stderr)
                    mods.remove((name, make))
                continue
            q, a = str(problem.question), str(problem.answer)
            if len(q) > max_chars or q in seen:
                continue
            seen.add(q)
            conv = [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
            out.append({"id": f"maths-{len(out)}", "module": name, "conversations": conv})
    return out


# Pure-Python packages whose documented functions make code requests, beside the standard library.
CODE_PACKAGES = ("networkx", "sympy")
# Standard-library modules left out: GUIs, demos, tests, installers and modules that act on import.
STDLIB_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3"}
STDLIB_SKIP |= {"ensurepip", "venv", "pydoc_data", "__main__", "pip", "setuptools"}
# Several wordings, so the draft learns how the target writes code rather than one instruction.
CODE_ASKS = (
    "Complete the following Python function.\n\n```python\n{stub}\n```",
    "Implement this Python function. Reply with the whole function in a code block.\n\n```python\n{stub}\n```",
    "Write the body of this function:\n\n```python\n{stub}\n```",
    "Write a Python function `{name}{sig}`. {summary}",
    "How would you implement `{name}` in Python? Its documentation says:\n\n{doc}",
)


def _import_quietly(name: str) -> ModuleType | None:
    """The module, or None where importing it fails or prints (some stdlib modules act on import)."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            with contextlib.redirect_stderr(io.StringIO()):
                return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - SystemExit and friends from modules that are not libraries
        return None


def code_modules(packages: tuple[str, ...] = CODE_PACKAGES) -> list[ModuleType]:
    """The public standard-library modules and the public submodules of `packages`, by name."""
    names = [m for m in sys.stdlib_module_names if not m.startswith("_") and m not in STDLIB_SKIP]
    out: dict[str, ModuleType] = {}
    for name in sorted(names) + sorted(packages):
        mod = _import_quietly(name)
        if mod is None:
            continue
        out[name] = mod
        for info in pkgutil.walk_packages(getattr(mod, "__path__", []) or [], name + ".", onerror=lambda _: None):
            parts = info.name.split(".")
            if any(p.startswith("_") or p in ("tests", "test", "testing", "benchmarks") for p in parts[1:]):
                continue
            sub = _import_quietly(info.name)
            if sub is not None:
                out[info.name] = sub
    return [out[k] for k in sorted(out)]


def _documented(mod: ModuleType) -> list[tuple[str, object]]:
    """(qualified name, function) for the public functions and methods `mod` itself defines."""
    found: list[tuple[str, object]] = []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            found.append((name, obj))
        elif inspect.isclass(obj):
            found += [
                (f"{name}.{a}", f)
                for a, f in sorted(vars(obj).items())
                if not a.startswith("_") and inspect.isfunction(f)
            ]
    return found


def code_request(name: str, fn: object, rng: random.Random, max_doc: int = 800) -> tuple[str, str] | None:
    """(request, stand-in answer: the `def` line) for one documented function, or None where it has
    no usable signature, docstring or source (a stub is its `def` line and docstring, cut at a paragraph)."""
    doc = inspect.getdoc(fn)
    try:
        sig, source = str(inspect.signature(fn)), inspect.getsource(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError, OSError):
        return None
    if not doc or len(doc) < 40 or len(source) > 4000 or '"""' in doc or "<" in sig:  # "<": a default's repr
        return None
    while len(doc) > max_doc and "\n\n" in doc:
        doc = doc.rsplit("\n\n", 1)[0]
    if len(doc) > max_doc:
        return None
    short = name.rsplit(".", 1)[-1]
    body = "\n".join("    " + line if line else "" for line in doc.splitlines())
    stub = f'def {short}{sig}:\n    """\n{body}\n    """'
    ask = rng.choice(CODE_ASKS)
    summary = doc.split("\n\n", 1)[0].replace("\n", " ")
    return ask.format(stub=stub, name=short, sig=sig, summary=summary, doc=doc), f"def {short}{sig}:"


def code_questions(
    n: int, seed: int = 0, modules: list[ModuleType] | None = None, exclude: frozenset[str] = frozenset()
) -> list[dict]:
    """Up to `n` code requests as ShareGPT conversations, one per documented function, drawn
    round-robin from the standard library and each package (so no one large package dominates), each
    group in a seeded shuffle; `exclude`: function names never asked (the held-out code prompts' own)."""
    rng = random.Random(seed)
    groups: dict[str, list[dict]] = {}
    seen: set[str] = set()
    for mod in modules if modules is not None else code_modules():
        top = mod.__name__.split(".")[0]
        group = groups.setdefault("stdlib" if top in sys.stdlib_module_names else top, [])
        for name, fn in _documented(mod):
            short = name.rsplit(".", 1)[-1]
            made = None if short in exclude else code_request(name, fn, rng)
            if made is None or made[0] in seen:
                continue
            seen.add(made[0])
            conv = [{"from": "human", "value": made[0]}, {"from": "gpt", "value": made[1]}]
            group.append({"id": f"code-{mod.__name__}.{name}", "module": mod.__name__, "conversations": conv})
    queues = [groups[k] for k in sorted(groups) if groups[k]]
    for q in queues:
        rng.shuffle(q)
    out: list[dict] = []
    while len(out) < n and queues:
        out += [q.pop() for q in queues][: n - len(out)]
        queues = [q for q in queues if q]
    return out


def heldout_code_names() -> set[str]:
    """The function names of the code domain's held-out prompts (HumanEval's entry points)."""
    import gzip

    from nestling.assets import humaneval_jsonl

    with gzip.open(humaneval_jsonl(), "rt", encoding="utf-8") as f:
        return {json.loads(line)["entry_point"] for line in f if line.strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--chat", type=int, default=5000, help="ShareGPT conversations (the first N, held-out parts left out)"
    )
    ap.add_argument(
        "--chat-start", type=int, default=0, help="skip the first S of those conversations (a slice after a mix of S)"
    )
    ap.add_argument("--maths", type=int, default=10000, help="generated maths questions (0: none)")
    ap.add_argument("--heldout", type=int, default=100, help="as quality.py's --heldout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--maths-python", default=sys.executable, help="a Python with mathematics-dataset and sympy<1.6")
    ap.add_argument("--maths-only", action="store_true", help="write the maths questions alone")
    ap.add_argument("--maths-from", type=Path, help="the maths questions of an earlier --maths-only run")
    ap.add_argument("--code", type=int, default=5000, help="code requests (with --code-only)")
    ap.add_argument("--code-only", action="store_true", help="write the code requests alone")
    ap.add_argument(
        "--code-from", type=Path, help="the code requests of an earlier --code-only run (no code part without)"
    )
    args = ap.parse_args()
    if args.maths_only:
        write_jsonl(args.out, maths_questions(args.maths, args.seed))
        return
    if args.code_only:
        rows = code_questions(args.code, args.seed, exclude=frozenset(heldout_code_names()))
        write_jsonl(args.out, rows)
        print(f"[mix] {args.out}: {len(rows)} code requests from {len({r['module'] for r in rows})} modules")
        return
    maths: list[dict] = []
    if args.maths:
        if not args.maths_from:
            args.maths_from = args.out.with_name(args.out.stem + "-maths.jsonl")
            cmd = [args.maths_python, __file__, "--maths-only", "--out", str(args.maths_from)]
            subprocess.run(cmd + ["--maths", str(args.maths), "--seed", str(args.seed)], check=True)
        maths = [json.loads(line) for line in args.maths_from.read_text().splitlines() if line.strip()]
    from quality import split_sharegpt

    train, _, n = split_sharegpt(args.out.parent / (args.out.stem + "-split"), args.heldout, None)
    chat = json.loads(train.read_text())[args.chat_start : args.chat_start + args.chat]
    code = (
        [json.loads(line) for line in args.code_from.read_text().splitlines() if line.strip()] if args.code_from else []
    )
    write_jsonl(args.out, chat + maths + code)
    print(
        f"[mix] {args.out}: {len(chat)} chat conversations (of {n} outside the held-out parts) + {len(maths)} maths"
        f" + {len(code)} code"
    )


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
