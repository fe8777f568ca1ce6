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
    "nestling.plan.cli",
    "nestling.pipeline_cli",
]


class IntermixedParser(argparse.ArgumentParser):
    """Lets `key=value` overrides (positionals) follow the flags: `data IN --out D max_length=512`.
    Plain argparse assigns all positionals at their first occurrence and rejects later ones."""

    _inner = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._inner:
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def add_intermixed_parser(sub: argparse._SubParsersAction, name: str, **kw) -> argparse.ArgumentParser:
    """A subcommand parser whose positionals may be interleaved with options (see IntermixedParser)."""
    parser_class, sub._parser_class = sub._parser_class, IntermixedParser
    try:
        return sub.add_parser(name, **kw)
    finally:
        sub._parser_class = parser_class


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
    # `key=value` overrides may follow options (`nestling train CAP --out DIR lr=3e-4`), which plain
    # parse_args rejects once an option has ended the positionals: hand the leftovers to the stage.
    args, extra = parser.parse_known_args(argv)
    target = next((n for n in ("overrides", "extra") if isinstance(getattr(args, n, None), list)), None)
    if extra:
        if target is None or not all("=" in e and not e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        getattr(args, target).extend(extra)
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
