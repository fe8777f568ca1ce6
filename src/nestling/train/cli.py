"""`nestling train CAPTURE_DIR --out DIR [--epochs E | --steps N] [--ttt-steps K]`, or online:
`nestling train DATA_DIR --online --target MODEL --out DIR` (the target runs in the loop, nothing is stored)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nestling.config import settings_from_args
from nestling.train.settings import TrainSettings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train an EAGLE-3 draft on captured hidden states",
        description=(
            "Train an EAGLE-3 draft with training-time test (TTT) on a capture folder, or online on a data\n"
            "folder (--online --target MODEL: the target computes the states batch by batch, nothing is stored).\n"
            "Writes draft_config.json, vocab.safetensors, checkpoints/, model.safetensors, metrics.jsonl,\n"
            "plot.png and manifest.json (last) to --out. Scale out with torchrun --nproc-per-node N -m nestling train ...\n"
            "Any setting of TrainSettings can be given as key=value (e.g. lr=3e-4 batch_tokens=8192)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "capture_dir",
        type=Path,
        metavar="DIR",
        help="output folder of `nestling capture` (offline) or of `nestling data` (with --online)",
    )
    p.add_argument(
        "--online",
        action="store_true",
        default=None,
        help="DIR is a data folder: run the target on the training device for every batch",
    )
    p.add_argument("--target", help="the target model folder (online: required unless the data manifest names it)")
    p.add_argument("--out", type=Path, required=True, help="training folder to write")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--epochs", type=float, help="passes over the training split (default 1)")
    g.add_argument("--steps", type=int, help="optimizer steps (overrides epochs)")
    p.add_argument(
        "--ttt-steps", type=int, help=f"draft steps trained per position, K (default {TrainSettings.ttt_steps})"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --out (takes no value; settings stay key=value)",
    )
    p.add_argument(
        "--resume-from",
        type=Path,
        metavar="CHECKPOINT",
        help="continue from this checkpoint folder (e.g. OUT/checkpoints/step-00001000)",
    )
    p.add_argument("--config", type=Path, help="YAML file of train settings")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="setting overrides, e.g. lr=3e-4")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nestling.train.run import train

    s = settings_from_args(TrainSettings, args, ("epochs", "steps", "ttt_steps", "online", "target"))
    resume = args.resume_from if args.resume_from is not None else args.resume
    m = train(args.capture_dir, args.out, s, resume=resume)
    import os

    if m and os.environ.get("RANK", "0") == "0":
        ev = m.get("final_eval") or {}
        print(
            f"trained {m['steps']} steps into {args.out}"
            + (f"; held-out simulated acceptance length {ev['sim_accept_len']:.3f}" if ev else "")
        )
    return 0
