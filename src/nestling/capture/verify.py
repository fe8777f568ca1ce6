"""`nestling capture --verify DIR`: re-read every shard and check it against the data stage.

A shard can be damaged after it was written (a full disk, a bad copy, a truncated download), so
training should not be the first to read it. Reads go through memory-mapped slices, chunk by chunk.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nestling.capture.store import CHECKSUMS, file_crc32, read_checksums, read_index
from nestling.data.dataset import load_samples
from nestling.errors import NestlingError
from nestling.manifest import read_manifest
from nestling.progress import Progress, log

CHUNK_TOKENS = 8192


def _check_shard(
    path: Path, n_ids: int, hidden_size: int, dtype: str, expect_ids: torch.Tensor, expect_mask: torch.Tensor
) -> list[str]:
    from safetensors import safe_open

    name = f"{path.parent.name}/{path.name}"
    try:
        f = safe_open(path, "pt")
        keys = set(f.keys())
        fp8 = dtype == "float8"
        expect = {"hidden", "input_ids", "loss_mask"} | ({"hidden_scale"} if fp8 else set())
        if keys != expect:
            return [f"{name}: holds tensors {sorted(keys)}, expected {', '.join(sorted(expect))}"]
        h = f.get_slice("hidden")
        shape = h.get_shape()
        T = int(expect_ids.numel())
        if list(shape) != [T, n_ids, hidden_size]:
            return [f"{name}: hidden has shape {shape}, the index says [{T}, {n_ids}, {hidden_size}]"]
        problems = []
        scale = None
        if fp8:
            scale = f.get_tensor("hidden_scale")
            if list(scale.shape) != [T, n_ids]:
                return [f"{name}: hidden_scale has shape {list(scale.shape)}, expected [{T}, {n_ids}]"]
            if not bool((torch.isfinite(scale) & (scale > 0)).all()):
                problems.append(f"{name}: hidden_scale holds values that are not finite and positive")
        ids = f.get_tensor("input_ids")
        if ids.shape != expect_ids.shape or not torch.equal(ids.long(), expect_ids):
            problems.append(f"{name}: input_ids differ from the data stage's token ids")
        if not torch.equal(f.get_tensor("loss_mask").long(), expect_mask):
            problems.append(f"{name}: loss_mask differs from the data stage's")
        lo = torch.full((n_ids,), float("inf"))
        hi = torch.full((n_ids,), float("-inf"))
        nonfinite = 0
        for a in range(0, T, CHUNK_TOKENS):
            x = h[a : a + CHUNK_TOKENS].float()
            if scale is not None:
                x = x * scale[a : a + CHUNK_TOKENS, :, None]
            nonfinite += int((~torch.isfinite(x)).sum())
            x = torch.nan_to_num(x)
            lo = torch.minimum(lo, x.amin(dim=(0, 2)))
            hi = torch.maximum(hi, x.amax(dim=(0, 2)))
    except NestlingError:
        raise
    except Exception as e:
        return [f"{name}: cannot be read ({type(e).__name__}: {e})"]
    if nonfinite:
        problems.append(f"{name}: {nonfinite} NaN/Inf values in hidden")
    for j in range(n_ids):
        if hi[j] == lo[j]:
            what = "all zero" if hi[j] == 0 else f"constant ({hi[j].item():g})"
            problems.append(f"{name}: layer slot {j} is {what}")
    return problems


def _check_checksum(path: Path, entry: dict | None) -> list[str]:
    """The shard's bytes against the crc32 recorded when it was completed: catches any overwrite,
    including finite values that pass every check on the tensors."""
    name = f"{path.parent.name}/{path.name}"
    if entry is None:
        return [f"{name}: no checksum recorded in {path.parent.name}/{CHECKSUMS}"]
    crc, size = file_crc32(path)
    if size != entry.get("bytes"):
        return [f"{name}: {size} bytes, but {entry.get('bytes')} were written"]
    if crc != entry.get("crc32"):
        return [
            f"{name}: checksum mismatch (crc32 {crc}, recorded {entry.get('crc32')} when it was written): "
            f"its bytes changed since"
        ]
    return []


def verify(capture_dir: str | Path) -> list[str]:
    """All problems found (empty list: the capture is sound)."""
    capture_dir = Path(capture_dir)
    if not capture_dir.exists():
        raise NestlingError(f"capture folder {capture_dir} does not exist")
    m = read_manifest(capture_dir, "capture")
    n_ids, H = len(m["layer_ids"]), int(m["hidden_size"])
    data_dir = Path(m["data_dir"])
    problems: list[str] = []
    for split in m["splits"]:
        index = read_index(capture_dir, split)
        by_id = {s.sample_id: s for s in load_samples(data_dir, split)}
        if set(by_id) != {e["sample_id"] for e in index}:
            problems.append(f"{split}: the index's samples differ from the data stage's {split} split")
        shards: dict[str, list[dict]] = {}
        for e in index:
            shards.setdefault(e["shard"], []).append(e)
        checksums = read_checksums(capture_dir / split)
        if checksums is None:
            log(
                f"[verify] {split}: no {CHECKSUMS} (a store written before nestling recorded checksums): "
                f"checking structure and values only"
            )
        prog = Progress(f"verify {split}", total=len(shards), unit="shards")
        for shard, entries in sorted(shards.items()):
            entries.sort(key=lambda e: e["offset"])
            pos, ids, mask = 0, [], []
            for e in entries:
                s = by_id.get(e["sample_id"])
                if e["offset"] != pos or s is None or len(s.input_ids) != e["length"]:
                    problems.append(f"{split}/{shard}: index entry of {e['sample_id']} does not match the data stage")
                    break
                pos += e["length"]
                ids += s.input_ids
                mask += s.loss_mask
            else:
                path = capture_dir / split / shard
                if not path.exists():
                    problems.append(f"{split}/{shard}: missing")
                else:
                    if checksums is not None:
                        problems += _check_checksum(path, checksums.get(shard))
                    problems += _check_shard(path, n_ids, H, m["dtype"], torch.tensor(ids), torch.tensor(mask))
            prog.update(1)
    log(f"[verify] {capture_dir}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return problems
