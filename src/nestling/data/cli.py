"""`nestling data INPUT... --target MODEL --out DIR` and `nestling data inspect DATA_DIR`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nestling.cli import add_intermixed_parser
from nestling.errors import NestlingError

DESCRIPTION = """\
Tokenize chat data with the target's own chat template and mark the assistant tokens.

  nestling data INPUT... --target MODEL --out DIR [--max-length N] [--held-out FRACTION] [key=value ...]
  nestling data inspect DATA_DIR [--index N] [--split train|heldout]

INPUT: ShareGPT JSON (a list) or JSONL ({"conversations": [{"from", "value"}]}), OpenAI-style
JSONL ({"messages": [{"role", "content"}]}), or parquet with a `conversations` or `messages` column.
A target without a chat template (a base model) gets the text mode (mode=auto; mode=text forces it):
records {"text": ...} (chat records are flattened to their messages' text), every token supervised,
documents packed into rows of max_length.
Output: DIR/{train,heldout}-NNNNN.parquet (input_ids, loss_mask, sample_id, source_index) and
DIR/manifest.json with counts by reason. Settings: --config FILE (YAML) and key=value overrides
(e.g. role_map.narrator=assistant, shard_samples=1000). See docs/data.md.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_intermixed_parser(
        sub,
        "data",
        help="tokenize chat data into loss-masked samples (or `data inspect DIR`)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="chat data files, then optional key=value setting overrides; or `inspect DATA_DIR`",
    )
    p.add_argument(
        "--target",
        help="target model: a Hugging Face folder or a .gguf file (its tokenizer and chat template are used)",
    )
    p.add_argument("--out", help="output folder (nothing is written outside it)")
    p.add_argument("--config", type=Path, help="YAML file of data settings (keys of DataSettings)")
    p.add_argument("--max-length", type=int, help="maximum tokens per sample (default 2048)")
    p.add_argument("--overflow", choices=["truncate", "drop"], help="what to do with longer samples (default truncate)")
    p.add_argument(
        "--held-out", type=float, metavar="FRACTION", help="fraction of samples for the heldout split (default 0)"
    )
    p.add_argument("--seed", type=int, help="seed of the held-out assignment (default 0)")
    p.add_argument("--last-turn-only", action="store_true", default=None, help="supervise only the last assistant turn")
    p.add_argument("--system-prompt", help="system message for every conversation (replaces the data's; '' removes it)")
    p.add_argument("--chat-template", metavar="FILE", help="Jinja chat template file to use instead of the tokenizer's")
    p.add_argument("--limit", type=int, help="read only the first N records of each input")
    p.add_argument("--workers", type=int, help="worker processes (default: all cores)")
    p.add_argument("--index", type=int, default=0, help="inspect: which sample to show (default 0)")
    p.add_argument(
        "--split", default="train", choices=["train", "heldout"], help="inspect: which split (default train)"
    )
    p.add_argument(
        "--color",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="inspect: highlight with colour (default: when writing to a terminal; else [[brackets]])",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.inputs[0] == "inspect":
        return run_inspect(args)
    from nestling.config import settings_from_args
    from nestling.data.run import prepare_data
    from nestling.data.settings import DataSettings

    inputs = [a for a in args.inputs if not ("=" in a and not Path(a).exists())]
    overrides = [a for a in args.inputs if a not in inputs]
    if not args.target or not args.out:
        raise NestlingError("give --target MODEL and --out DIR (see `nestling data --help`)")
    if not inputs:
        raise NestlingError("give at least one INPUT file")
    flags: tuple[str, ...] = (
        "max_length",
        "overflow",
        "held_out",
        "seed",
        "last_turn_only",
        "system_prompt",
        "chat_template",
        "limit",
        "workers",
    )
    settings = settings_from_args(DataSettings, args, flags, overrides)
    manifest = prepare_data(inputs, args.target, args.out, settings)
    print(
        json.dumps(
            {
                "out": args.out,
                "counts": manifest["counts"],
                "splits": {
                    k: {kk: v[kk] for kk in ("samples", "tokens", "supervised_tokens")}
                    for k, v in manifest["splits"].items()
                },
            },
            indent=2,
        )
    )
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from nestling.data.inspect import inspect_sample

    if len(args.inputs) != 2:
        raise NestlingError("usage: nestling data inspect DATA_DIR [--index N] [--split train|heldout]")
    print(inspect_sample(Path(args.inputs[1]), args.index, args.split, args.color), end="")
    return 0
