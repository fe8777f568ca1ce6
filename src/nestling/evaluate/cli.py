"""`nestling eval DRAFT_DIR --target MODEL --prompts FILE [--k 3] [--engine auto|reference|vllm|both] --out DIR`."""

from __future__ import annotations

import argparse
from pathlib import Path

from nestling.evaluate.settings import DRAFT_SAMPLE_METHODS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="measure a draft's acceptance length (reference decoder or real vLLM)",
        description="Decode PROMPTS with the target and the exported draft and report acceptance length "
        "(1 + accepted/drafts), per-position acceptance and tokens/s with and without the draft. "
        "engine=reference: a batched PyTorch speculative decoder (output equals the target's own); "
        "engine=vllm: the real vLLM engine in a subprocess, read from its spec-decode metrics; "
        "engine=auto (default): vllm where it is installed, else reference (the log says which).",
    )
    p.add_argument("draft_dir", type=Path, help="folder written by `nestling export`")
    p.add_argument("--target", required=True, help="the target: HF folder or .gguf (must be the draft's own target)")
    p.add_argument(
        "--prompts",
        required=True,
        help="JSONL with 'messages' or 'prompt' per line, or a `nestling data` folder (its held-out split)",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for report.json, report.md, acceptance.png")
    p.add_argument("--k", type=int, default=None, help="draft tokens per target forward (default 3)")
    p.add_argument(
        "--engine",
        choices=["auto", "reference", "vllm", "both"],
        default=None,
        help="default auto: vllm where installed, else reference",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate per prompt (default 128)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default); >0 rejection sampling")
    p.add_argument(
        "--draft-sample-method",
        choices=DRAFT_SAMPLE_METHODS,
        default=None,
        help="at temperature > 0, how the draft proposes, as vLLM's speculative_config names it: greedy (default, "
        "vLLM's default: the draft's argmax, accepted with the target's p) or probabilistic (sampled from the "
        "draft, accepted with min(1, p/q))",
    )
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument(
        "--device",
        default=None,
        help="reference decoder device: auto (default: cuda where torch sees a GPU, else cpu), cpu, cuda",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="prompts the reference decoder runs at once (default 0: all)"
    )
    p.add_argument("--config", type=Path, default=None, help="YAML file with eval settings")
    p.add_argument("overrides", nargs="*", help="key=value settings (dtype, seed, max_model_len, baseline, ...)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from nestling.config import settings_from_args
    from nestling.evaluate.run import evaluate
    from nestling.evaluate.settings import EvalSettings

    flags = (
        "k",
        "engine",
        "max_new_tokens",
        "temperature",
        "draft_sample_method",
        "max_prompts",
        "device",
        "batch_size",
    )
    s = settings_from_args(EvalSettings, args, flags)
    evaluate(args.draft_dir, args.target, args.prompts, args.out, s)
    print(args.out / "report.md")
    return 0
