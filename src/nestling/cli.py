"""The `nestling` command: thin, one subcommand per stage over the Python API.

Each stage registers its own subcommand in `<stage>/cli.py` (a `register(subparsers)` function),
so this file only wires them together and turns NestlingError into a clean message.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from nestling import __version__
from nestling.errors import NestlingError

# (subcommand module, in the order `nestling --help` lists them)
STAGE_CLIS = [
    "nestling.data.cli",
    "nestling.capture.cli",
    "nestling.train.cli",
    "nestling.export.cli",
    "nestling.evaluate.cli",
    "nestling.regenerate.cli",
    "nestling.pipeline_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nestling",
        description=(
            "Train EAGLE-3 speculative-decoding drafts for a target LLM and ship them to vLLM/SGLang.\n"
            "Stages: data -> capture -> train -> export -> eval; `nestling run CONFIG.yaml` chains them."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nestling {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in STAGE_CLIS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # stage not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Logs are watched with `tail`: flush every line.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
        except AttributeError:
            pass
    parser = build_parser()
    # argparse cannot match trailing `key=value` positionals after options that follow another
    # positional (INPUT --out DIR k=v); collect them here for subcommands that take overrides.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if isinstance(getattr(args, "overrides", None), list) and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides += extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except NestlingError as e:
        print(f"nestling {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"nestling {args.command}: interrupted; run the same command again to continue.", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
