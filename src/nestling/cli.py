"""The `nestling` command: thin, one subcommand per stage over the Python API.

Each stage registers its own subcommand in `<stage>/cli.py` (a `register(subparsers)` function),
so this file only wires them together and owns the one error path (`report_error`): nestling's own
errors and the operating system's (a full disk, a path under a file) print one or two lines and exit 1;
a traceback appears only with `--debug` or for a genuine internal bug.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys
import traceback

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
    "nestling.pipeline.cli",
]


class IntermixedParser(argparse.ArgumentParser):
    """Lets `key=value` overrides (positionals) follow the flags: `data IN --out D max_length=512`.
    Plain argparse assigns all positionals at their first occurrence and rejects later ones."""

    _inner = False

    def parse_known_args(self, args=None, namespace=None):
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
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the full traceback of an error (for a bug report) instead of one message",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in STAGE_CLIS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Logs are watched with `tail`: flush every line.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except AttributeError:
            pass
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # global, accepted anywhere on the line: `nestling train ... --debug` too
    argv = [a for a in argv if a != "--debug"]
    from nestling import outdir

    outdir.COMMAND[:] = ["nestling", *argv]  # what a folder's lock says its holder runs
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
    from nestling import faults, interrupt

    interrupt.install()  # SIGTERM and SIGHUP unwind like Ctrl-C: cleanup runs, state is kept, one line says so
    faults.watch()  # which engine process died, when one does
    try:
        from nestling.inputs import check_argv_names

        check_argv_names(args.command, argv)  # a URL or hub id: refused now, before any import or network
        rc = args.func(args)
    except KeyboardInterrupt as e:
        faults.stop_descendants()  # nothing this command started outlives it (a subprocess it waited on)
        print(interrupt.message(args.command, e), file=sys.stderr, flush=True)
        return interrupt.exit_code(e)
    except (NestlingError, OSError) as e:
        faults.stop_descendants()
        return report_error(args.command, e, debug=debug)
    except Exception as e:
        faults.stop_descendants()
        known = faults.describe(e)  # an engine worker that died: one line, not the engine's traceback
        if known is None:
            raise
        if debug:
            traceback.print_exception(e, file=sys.stderr)
        return report_error(args.command, NestlingError(known))
    finally:
        interrupt.uninstall()
    return int(rc or 0)


# What to do about an OSError, by errno; the default names the path and asks to check it.
OS_ADVICE = {
    errno.ENOSPC: "free space on that disk or point --out at a larger one, then run the same command again "
    "(complete work is kept)",
    errno.EDQUOT: "free space within your quota, then run the same command again (complete work is kept)",
    errno.EFBIG: "a file-size limit (`ulimit -f`, or the filesystem's own) stopped the write: raise it or point "
    "--out at another disk, then run the same command again (complete work is kept)",
    errno.ENOTDIR: "a part of that path is a file, not a folder: choose another path",
    errno.EISDIR: "that path is a folder where a file was expected: give the file itself",
    errno.EACCES: "you lack permission there: choose a path you can write, or fix its permissions",
    errno.EROFS: "that filesystem is read-only: choose another path",
    errno.EEXIST: "something is already there: remove it or choose another path",
}


def describe_os_error(e: OSError) -> str:
    """`what (where): what to do` for an error the operating system raised."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    what = e.strerror or str(e)
    advice = OS_ADVICE.get(e.errno or 0, "check that path and run the same command again")
    return f"{what}" + (f": {where}" if where else "") + f"\n  {advice}"


def report_error(command: str, e: BaseException, debug: bool = False) -> int:
    """The one place an error reaches the user: one or two lines, exit 1 (the traceback with --debug)."""
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    msg = str(e) if isinstance(e, NestlingError) else describe_os_error(e)  # type: ignore[arg-type]
    print(f"nestling {command}: error: {msg}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
