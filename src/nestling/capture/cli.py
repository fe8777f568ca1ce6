"""`nestling capture`: the command line over `nestling.capture.run.capture` and `verify`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nestling.cli import add_intermixed_parser
from nestling.errors import NestlingError

HELP = """Run the target prefill-only over a data folder and store, per token, the aux layers and the final
state (after the final norm) as safetensors shards with an index. Re-running resumes an interrupted
capture (complete shards are kept). `nestling capture --verify CAPTURE_DIR` (or `nestling capture
verify CAPTURE_DIR`) re-reads every shard and checks it against the data stage."""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_intermixed_parser(
        sub,
        "capture",
        help="store the target's hidden states for training",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("data_dir", nargs="?", help="output folder of `nestling data` (or: verify CAPTURE_DIR)")
    p.add_argument("extra", nargs="*", help="key=value setting overrides (e.g. token_budget=8192)")
    p.add_argument("--target", help="the target: a local Hugging Face model folder or a .gguf file")
    p.add_argument("--out", help="folder to write the capture to (resumed when it holds a partial capture)")
    p.add_argument("--backend", choices=["hf", "vllm"], help="engine that runs the target (default hf: transformers)")
    p.add_argument(
        "--layers",
        help="comma-separated layer ids in HF hidden_states indexing, the last being the "
        "final state L (default: 2, L//2, L-3, L)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32", "float8"],
        help="model and stored dtype (default auto: bfloat16 on GPU, float32 on CPU); float8: run as auto, "
        "store float8_e4m3fn with a scale per token and layer (half of bf16)",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (default auto: cuda when available)")
    p.add_argument(
        "--device-map", dest="device_map", help="transformers device_map, e.g. auto to spread over several GPUs"
    )
    p.add_argument(
        "--token-budget",
        dest="token_budget",
        type=int,
        help="padded tokens per forward: batch size x longest sample (default 16384)",
    )
    p.add_argument("--shard-size", dest="shard_size", help="bytes per shard, e.g. 1GB (default), 256MiB")
    p.add_argument(
        "--tensor-parallel-size",
        dest="tensor_parallel_size",
        type=int,
        help="GPUs that split every layer (default 1). vllm: per engine; hf: transformers' "
        "tensor-parallel plan, run under `torchrun --nproc-per-node N -m nestling capture ...`",
    )
    p.add_argument(
        "--data-parallel-size",
        dest="data_parallel_size",
        type=int,
        help="vllm backend: engine replicas that split the samples (default 1)",
    )
    p.add_argument(
        "--ignore-disk-check",
        dest="ignore_disk_check",
        action="store_true",
        default=None,
        help="start even when the free disk space is smaller than the capture",
    )
    p.add_argument("--config", type=Path, help="YAML file of capture settings (flags and key=value override it)")
    p.add_argument("--verify", metavar="CAPTURE_DIR", help="check a finished capture instead of capturing")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.verify or args.data_dir == "verify":
        target = args.verify or (args.extra[0] if args.extra else None)
        if not target:
            raise NestlingError("usage: nestling capture verify CAPTURE_DIR")
        from nestling.capture.verify import verify

        problems = verify(Path(target))
        for p in problems:
            print(f"PROBLEM {p}", flush=True)
        if problems:
            raise NestlingError(
                f"{target} failed verification: {len(problems)} problem(s), listed above; "
                f"delete the bad shards and run the same capture command again to redo them"
            )
        print(f"{target}: every shard verified", flush=True)
        return 0
    if not args.data_dir or not args.target or not args.out:
        raise NestlingError("usage: nestling capture DATA_DIR --target MODEL --out DIR (see --help)")
    from nestling.capture.run import capture
    from nestling.capture.settings import CaptureSettings
    from nestling.config import settings_from_args

    flags: tuple[str, ...] = (
        "backend",
        "dtype",
        "device",
        "device_map",
        "token_budget",
        "shard_size",
        "ignore_disk_check",
        "tensor_parallel_size",
        "data_parallel_size",
    )
    flags += ("layers",) if args.layers else ()  # an empty list is not a choice
    settings = settings_from_args(CaptureSettings, args, flags, args.extra)
    m = capture(args.data_dir, args.target, args.out, settings)
    from nestling.capture.tp import world

    if world()[0] != 0:  # a tensor-parallel follower: rank 0 reports
        return 0
    print(
        f"capture written to {args.out}: "
        + ", ".join(f"{k} {v['samples']} samples / {v['tokens']} tokens" for k, v in m["splits"].items()),
        file=sys.stdout,
    )
    return 0
