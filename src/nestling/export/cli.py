"""`nestling export TRAIN_DIR --out DIR [--format eagle3|speculators]`."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a trained draft as a folder vLLM / SGLang load",
        description="Write the draft in TRAIN_DIR as a native EAGLE-3 folder (config.json + model.safetensors, "
        "for vLLM's speculative_config and SGLang's --speculative-draft-model-path) or in the "
        "speculators layout (for `vllm serve DRAFT`), then reload it and check it against the contract. "
        "Refuses a checkpoint whose target (by fingerprint) is not the one it names.",
    )
    p.add_argument("train_dir", type=Path, help="output folder of `nestling train`")
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="draft folder to write: new, empty, or an earlier export (its files are replaced once the new "
        "ones are verified; files you added stay). Any other folder, or one at TRAIN_DIR, is refused",
    )
    p.add_argument(
        "--format",
        choices=["eagle3", "speculators"],
        default=None,
        help="eagle3 (default): native EAGLE-3 folder; speculators: also names the target (vllm serve DRAFT)",
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="dtype of the float weights (default bfloat16)",
    )
    p.add_argument(
        "--k",
        dest="num_speculative_tokens",
        type=int,
        default=None,
        help="speculative tokens written into the speculators layout (default 3)",
    )
    p.add_argument(
        "--target", default=None, help="the target's current path if it moved since training (fingerprint-checked)"
    )
    p.add_argument("--config", type=Path, default=None, help="YAML file with export settings")
    p.add_argument(
        "overrides", nargs="*", help="key=value settings (format, dtype, num_speculative_tokens, target, checkpoint)"
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from nestling.config import settings_from_args
    from nestling.export.run import export
    from nestling.export.settings import ExportSettings

    flags = ("format", "dtype", "num_speculative_tokens", "target")
    settings = settings_from_args(ExportSettings, args, flags)
    out = export(args.train_dir, args.out, settings)
    print(out)
    return 0
