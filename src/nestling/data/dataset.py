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
    """All samples of one split of a complete data-stage folder, in stored order."""
    import pyarrow.parquet as pq

    from nestling.manifest import read_manifest

    read_manifest(data_dir, "data")
    if split not in SPLITS:
        raise NestlingError(f"unknown split {split!r}; splits are {', '.join(SPLITS)}")
    out: list[Sample] = []
    for f in split_files(data_dir, split):
        t = pq.read_table(f).to_pydict()
        out += [
            Sample(sid, int(si), ids, mask)
            for ids, mask, sid, si in zip(t["input_ids"], t["loss_mask"], t["sample_id"], t["source_index"])
        ]
    return out
