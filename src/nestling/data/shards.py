"""The data stage's main-process side: workers' outcomes in, train / held-out parquet shards out.

Outcomes arrive in input order (`workers`); each kept conversation is assigned a split by a keyed
hash of its id, its rows are buffered and written `shard_samples` at a time (`dataset.write_shard`),
and every record not kept as-is is counted by reason, with a few examples, for the manifest.
"""

from __future__ import annotations

from typing import Any

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from nestling.data.dataset import SPLITS, Sample, write_shard
from nestling.data.mixing import source_of
from nestling.data.settings import DataSettings
from nestling.data.workers import Outcome

EXAMPLES_PER_REASON = 3


def heldout_of(sample_id: str, seed: int, fraction: float) -> bool:
    """Deterministic split: a keyed hash of the sample id, so it never depends on order or workers."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=8).digest(), "big")
    return h / 2**64 < fraction


def _empty_stats() -> dict[str, dict[str, Any]]:
    return {s: {"samples": 0, "tokens": 0, "supervised_tokens": 0, "files": []} for s in SPLITS}


@dataclass
class Shards:
    """The shards being written into `out` and the tallies the manifest reports (`splits`, `counts`, `examples`)."""

    out: Path
    settings: DataSettings
    counts: Counter = field(default_factory=Counter)  # dropped records, by reason
    altered: Counter = field(default_factory=Counter)  # kept or dropped records changed on the way, by how
    rows_dropped: Counter = field(default_factory=Counter)  # rows=turn: turns left out, by reason
    supervised_cut: int = 0  # supervised tokens past max_length, of kept and dropped records alike
    examples: dict[str, list[str]] = field(default_factory=dict)  # a few dropped ids (and details) per reason
    buffers: dict[str, list[Sample]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    stats: dict[str, dict[str, Any]] = field(default_factory=_empty_stats)  # the manifest's `splits`
    # kept conversations and tokens per input (both splits), in input order: the manifest's `sources`
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)
    # text mode: each outcome's row is one document, laid end to end with others of its split (text.Packer)
    pack: bool = False
    packers: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        """Rows kept so far, both splits."""
        return self.stats["train"]["samples"] + self.stats["heldout"]["samples"]

    def add(self, outcomes: list[Outcome]) -> int:
        """Count and buffer one chunk of outcomes (writing every shard that fills); returns the tokens kept."""
        settings = self.settings
        tokens = 0
        for o in outcomes:
            self.supervised_cut += o.supervised_cut
            for a in o.altered:
                self.altered[a] += 1
            if o.drop is not None:
                self.counts[o.drop] += 1
                ex = self.examples.setdefault(o.drop, [])
                if len(ex) < EXAMPLES_PER_REASON:
                    ex.append(f"{o.sample_id}: {o.detail}" if o.detail else o.sample_id)
                continue
            self.rows_dropped.update(o.rows_dropped)
            src = self.by_source.setdefault(source_of(o.sample_id), {"conversations": 0, "tokens": 0})
            src["conversations"] += 1
            src["tokens"] += sum(len(r.input_ids) for r in o.rows)
            # by the conversation (every answer to one regenerated conversation: workers.split_group),
            # so every row of a conversation lands in the same split
            split = "heldout" if heldout_of(o.group or o.sample_id, settings.seed, settings.held_out) else "train"
            st = self.stats[split]
            for r in o.rows:
                st["tokens"] += len(r.input_ids)
                st["supervised_tokens"] += int(r.loss_mask.sum())
                tokens += len(r.input_ids)
                if self.pack:
                    for row in self._packer(split).add(r, o.source_index):
                        self._buffer(split, *row)
                else:
                    self._buffer(split, r.sample_id, o.source_index, r.input_ids, r.loss_mask)
        return tokens

    def _packer(self, split: str):
        if split not in self.packers:
            from nestling.data.text import Packer

            self.packers[split] = Packer(self.settings.max_length)
        return self.packers[split]

    def _buffer(self, split: str, sample_id: str, source_index: int, ids, mask) -> None:
        """One row into its split's buffer (a shard is written when the buffer fills)."""
        self.buffers[split].append(Sample(sample_id, source_index, ids, mask))
        self.stats[split]["samples"] += 1
        if len(self.buffers[split]) >= self.settings.shard_samples:
            self._flush(split)

    def close(self) -> None:
        """Write what is still buffered: the open packed row and the last, partly filled shard of each split."""
        for split in SPLITS:
            if self.pack:
                for row in self._packer(split).flush():
                    self._buffer(split, *row)
            self._flush(split)

    def manifest_counts(self, read: int) -> dict:
        """The manifest's `counts` for `read` input records."""
        return {
            "read": read,
            "kept": read - sum(self.counts.values()),
            "dropped": dict(sorted(self.counts.items())),
            "altered": dict(sorted(self.altered.items())),
            "rows": self.rows,
            "rows_dropped": dict(sorted(self.rows_dropped.items())),
            "supervised_tokens_cut": self.supervised_cut,
        }

    def _flush(self, split: str) -> None:
        if self.buffers[split]:
            path = self.out / f"{split}-{len(self.stats[split]['files']):05d}.parquet"
            write_shard(path, self.buffers[split])
            self.stats[split]["files"].append(path.name)
            self.buffers[split] = []


__all__ = ["Shards", "heldout_of"]
