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
DeepMind's mathematics_dataset generator (`mathematics-dataset==1.0.1` on the package index; it needs
sympy < 1.6, older than torch's, so nestling installs it once in an environment of its own in its cache,
or `--maths-python` names one), round-robin over its training modules at every difficulty, seeded; its short reference answer
stands in as the assistant turn, which `nestling regenerate` rewrites in the target's words anyway.
These are synthetic school-maths drills, not the competition problems (CHAMP) the maths domain is
measured on. Code: the index ships no code training set, so the requests are built from the
signatures and docstrings of the documented public functions of Python's standard library and a few
pure-Python packages (`CODE_PACKAGES`), each asked in one of several wordings (`CODE_ASKS`), its `def`
line the stand-in answer (the target writes the real one); no HumanEval function (the code domain's
prompts) is among them.

The maths and code builders are nestling's own (`nestling.data.builtin`: the `builtin:maths` and
`builtin:code` inputs of a run config), which also leave out any request sharing text with the
evaluation sets. Writes one ShareGPT-style JSONL: chat, then maths, then code (`nestling run` takes
them as separate inputs too, as examples/gpu.yaml and gpu_recipe.sh do).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


# The sources themselves are nestling's (`builtin:maths`, `builtin:code`); named here for the tests and scripts
# that use them through this file.
from nestling.data.builtin import (  # noqa: E402,F401
    CODE_ASKS,
    CODE_PACKAGES,
    STDLIB_SKIP,
    build_maths,
    code_modules,
    code_questions,
    code_request,
    heldout_code_names,
    maths_modules,
    maths_questions,
    write_jsonl,
)


def write_maths(args: argparse.Namespace) -> None:
    """`args.maths` questions (seed `args.seed`) at `args.out`: builtin:maths's build of that size (less
    any question sharing text with the evaluation sets) copied there."""
    import shutil

    built = build_maths(args.maths, args.seed, python=Path(args.maths_python) if args.maths_python else None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(built, args.out)


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
    ap.add_argument("--maths-python", help="a Python with mathematics-dataset and sympy<1.6 (default: nestling's own)")
    ap.add_argument("--maths-only", action="store_true", help="write the maths questions alone")
    ap.add_argument("--maths-from", type=Path, help="the maths questions of an earlier --maths-only run")
    ap.add_argument("--code", type=int, default=5000, help="code requests (with --code-only)")
    ap.add_argument("--code-only", action="store_true", help="write the code requests alone")
    ap.add_argument(
        "--code-from", type=Path, help="the code requests of an earlier --code-only run (no code part without)"
    )
    args = ap.parse_args()
    if args.maths_only:
        write_maths(args)
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
            write_maths(argparse.Namespace(**{**vars(args), "out": args.maths_from}))
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


if __name__ == "__main__":
    main()
