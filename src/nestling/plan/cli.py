"""`nestling plan TARGET --tokens N --gpus 8 --gpu-memory 96GB --disk 4TB [--json]`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nestling.cli import add_intermixed_parser

HELP = """Estimate, from the target's config.json alone (no weights are read), what training a draft
costs: the capture store's size (bf16 and float8), the target's GPU memory at its quantization for
each tensor-parallel degree, the draft's training memory, the time of capture and training at the
rates nestling measured (benchmarks/results), and which mode fits the machine you describe. A last
line says whether the vLLM installed here can serve an EAGLE-3 draft beside the target, and if not,
why and what eval does instead."""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_intermixed_parser(
        sub,
        "plan",
        help="estimate disk, GPU memory and time before anything loads",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", help="the target's folder or its config.json")
    p.add_argument("extra", nargs="*", help="key=value settings (e.g. ttt_steps=3 batch_tokens=8192 epochs=2)")
    p.add_argument("--tokens", type=int, help="tokens to capture and train on")
    p.add_argument("--data", help="a `nestling data` folder: its manifest gives the token count")
    p.add_argument("--gpus", type=int, help="GPUs of the machine (default 8)")
    p.add_argument("--gpu-memory", dest="gpu_memory", help="memory per GPU, e.g. 96GB (default 80GB)")
    p.add_argument("--disk", help="free disk for the capture store, e.g. 4TB (default: not checked)")
    p.add_argument(
        "--gpu-tflops",
        dest="gpu_tflops",
        type=float,
        help="dense bf16 TFLOP/s per GPU (default: as fast as the measured H200, 989)",
    )
    p.add_argument(
        "--layers", help="capture layer ids, comma-separated, the last the final state (default 2, L//2, L-3, L)"
    )
    p.add_argument(
        "--vllm-check",
        dest="vllm_check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask the vLLM installed here whether it serves an EAGLE-3 draft beside the target (on by default; "
        "off skips importing vLLM, which takes seconds)",
    )
    p.add_argument("--config", type=Path, help="YAML file of plan settings")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from nestling.config import settings_from_args
    from nestling.plan.report import table
    from nestling.plan.run import plan
    from nestling.plan.settings import PlanSettings

    flags: tuple[str, ...] = ("tokens", "data", "gpus", "gpu_memory", "disk", "gpu_tflops", "vllm_check")
    flags += ("layers",) if args.layers else ()
    result = plan(args.target, settings_from_args(PlanSettings, args, flags, args.extra))
    print(json.dumps(result, indent=2) if args.json else table(result), flush=True)
    return 0
