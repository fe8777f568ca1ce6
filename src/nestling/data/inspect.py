"""Show one prepared sample with its supervised tokens highlighted, to check a loss mask by eye."""

from __future__ import annotations

import sys
from pathlib import Path

from nestling.errors import NestlingError

COLOR_ON, COLOR_OFF = "\x1b[30;42m", "\x1b[0m"  # black on green
BRACKET_ON, BRACKET_OFF = "[[", "]]"


def runs(mask: list[int]) -> list[tuple[int, int, bool]]:
    """Maximal runs [start, end) of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or bool(mask[i]) != bool(mask[start]):
            out.append((start, i, bool(mask[start])))
            start = i
    return out


def format_sample(tokenizer, input_ids: list[int], loss_mask: list[int], color: bool) -> str:
    on, off = (COLOR_ON, COLOR_OFF) if color else (BRACKET_ON, BRACKET_OFF)
    parts = []
    for a, z, supervised in runs(list(loss_mask)):
        text = tokenizer.decode(list(input_ids[a:z]), skip_special_tokens=False)
        if supervised and color:  # keep the colour visible across line breaks
            text = text.replace("\n", f"{off}\n{on}")
        parts.append(f"{on}{text}{off}" if supervised else text)
    return "".join(parts)


def inspect_sample(data_dir: Path, index: int = 0, split: str = "train", color: bool | None = None) -> str:
    """The rendered text of sample `index` of `split`, supervised tokens highlighted."""
    from nestling.data.dataset import load_samples
    from nestling.manifest import read_manifest
    from nestling.targets.load import load_tokenizer

    manifest = read_manifest(data_dir, "data")
    samples = load_samples(data_dir, split)
    if not samples:
        raise NestlingError(f"split {split!r} of {data_dir} holds no samples")
    if not 0 <= index < len(samples):
        raise NestlingError(f"split {split!r} has {len(samples)} samples; --index must be in [0, {len(samples)})")
    target = Path(manifest["target"])
    if not target.exists():
        raise NestlingError(f"the target tokenizer {target} recorded in the manifest no longer exists")
    tokenizer = load_tokenizer(target)
    s = samples[index]
    color = sys.stdout.isatty() if color is None else color
    legend = "supervised tokens on green" if color else f"supervised tokens between {BRACKET_ON} {BRACKET_OFF}"
    head = (
        f"sample {index} of {split} ({len(samples)}): id {s.sample_id}, source record {s.source_index}, "
        f"{len(s.input_ids)} tokens, {int(sum(s.loss_mask))} supervised; {legend}"
    )
    return head + "\n" + "-" * 80 + "\n" + format_sample(tokenizer, s.input_ids, s.loss_mask, color) + "\n"
