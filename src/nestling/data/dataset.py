"""The data stage's on-disk samples: parquet shards that `datasets` opens, read back by later stages."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nestling.errors import NestlingError

SPLITS = ("train", "heldout")


@dataclass
class Sample:
    """One tokenized conversation: loss_mask[i] = 1 where token i is assistant-generated."""

    sample_id: str
    source_index: int
    input_ids: list[int]
    loss_mask: list[int]


def split_files(data_dir: Path, split: str) -> list[Path]:
    return sorted(Path(data_dir).glob(f"{split}-*.parquet"))


def write_shard(path: Path, samples: list[Sample]) -> None:
    """Write one parquet shard atomically (temporary name, then rename)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "input_ids": pa.array([s.input_ids for s in samples], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([s.loss_mask for s in samples], type=pa.list_(pa.int8())),
            "sample_id": pa.array([s.sample_id for s in samples], type=pa.string()),
            "source_index": pa.array([s.source_index for s in samples], type=pa.int64()),
        }
    )
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def load_samples(data_dir: Path, split: str = "train") -> list[Sample]:
    """All samples of one split of a complete data-stage folder, in stored order; the shards must read
    and hold what the manifest promises (its sample count), so a folder whose shards were cut off,
    added, removed or edited is refused instead of used."""
    import pyarrow.parquet as pq

    from nestling.manifest import read_manifest

    manifest = read_manifest(data_dir, "data")
    if split not in SPLITS:
        raise NestlingError(f"unknown split {split!r}; splits are {', '.join(SPLITS)}")
    redo = "run the same `nestling data` command into a new --out folder"
    out: list[Sample] = []
    for f in split_files(data_dir, split):
        try:
            t = pq.read_table(f, columns=list(COLUMNS)).to_pydict()
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a broken file
            raise NestlingError(
                f"data shard {f} cannot be read ({type(e).__name__}: {str(e)[:200]}): it is cut off or damaged; {redo}"
            ) from None
        out += [
            Sample(sid, int(si), ids, mask)
            for ids, mask, sid, si in zip(t["input_ids"], t["loss_mask"], t["sample_id"], t["source_index"])
        ]
    promised = ((manifest.get("splits") or {}).get(split) or {}).get("samples")
    if promised is not None and promised != len(out):
        raise NestlingError(
            f"{data_dir} holds {len(out)} {split} samples, its manifest promises {promised}: its shards were "
            f"added, removed or edited after `nestling data` wrote them; {redo}"
        )
    return out


COLUMNS = ("input_ids", "loss_mask", "sample_id", "source_index")
