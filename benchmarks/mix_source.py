"""A training input that mixes chat with maths: ShareGPT conversations plus generated maths questions.

    python benchmarks/mix_source.py --out mix.jsonl [--chat 5000] [--maths 10000] [--heldout 100]
    python benchmarks/mix_source.py --maths-only --out maths.jsonl   (in the maths environment)
    python benchmarks/mix_source.py --out mix.jsonl --maths-from maths.jsonl   (no generator needed)

Chat: the first `--chat` ShareGPT conversations of the package index's file, less every conversation
that shares a part or a prompt with the quality benchmark's held-out chat prompts (quality.py's
`split_sharegpt`), so `benchmarks/quality.py --domains chat` stays unseen. Maths: questions from
DeepMind's mathematics_dataset generator (`pip install mathematics-dataset==1.0.1`, on the package
index; it needs sympy < 1.6, older than torch's, so it runs in an environment of its own named by
`--maths-python`), round-robin over its training modules at every difficulty, seeded; its short reference answer
stands in as the assistant turn, which `nestling regenerate` rewrites in the target's words anyway.
These are synthetic school-maths drills, not the competition problems (CHAMP) the maths domain is
measured on. The index ships no code training set, so there is no code part.

Writes one ShareGPT-style JSONL (regenerate reads one input file), chat first, then maths.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--chat", type=int, default=5000, help="ShareGPT conversations (the first N, held-out parts left out)"
    )
    ap.add_argument("--maths", type=int, default=10000, help="generated maths questions")
    ap.add_argument("--heldout", type=int, default=100, help="as quality.py's --heldout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--maths-python", default=sys.executable, help="a Python with mathematics-dataset and sympy<1.6")
    ap.add_argument("--maths-only", action="store_true", help="write the maths questions alone")
    ap.add_argument("--maths-from", type=Path, help="the maths questions of an earlier --maths-only run")
    args = ap.parse_args()
    if args.maths_only:
        write_jsonl(args.out, maths_questions(args.maths, args.seed))
        return
    if not args.maths_from:
        args.maths_from = args.out.with_name(args.out.stem + "-maths.jsonl")
        cmd = [args.maths_python, __file__, "--maths-only", "--out", str(args.maths_from)]
        subprocess.run(cmd + ["--maths", str(args.maths), "--seed", str(args.seed)], check=True)
    maths = [json.loads(line) for line in args.maths_from.read_text().splitlines() if line.strip()]
    from quality import split_sharegpt

    train, _, n = split_sharegpt(args.out.parent / (args.out.stem + "-split"), args.heldout, None)
    chat = json.loads(train.read_text())[: args.chat]
    write_jsonl(args.out, chat + maths)
    print(f"[mix] {args.out}: {len(chat)} chat conversations (of {n} outside the held-out parts) + {len(maths)} maths")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
