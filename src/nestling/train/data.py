"""Capture shards in, packed microbatches out: a token budget per microbatch, samples isolated.

The order of microbatches is a pure function of (seed, epoch), and the stream over epochs is
indexed by a global microbatch number, so a resumed run needs nothing but its step count to
continue exactly where it stopped, on any number of ranks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nestling.train.ttt import PackedBatch

from nestling.capture.store import INDEX, CaptureDataset
from nestling.capture.store import read_index as _store_read_index


def read_index(capture_dir: Path, split: str) -> list[dict]:
    """The split's index, or [] when the capture has no such split (a run without held-out data)."""
    if not (Path(capture_dir) / split / INDEX).exists():
        return []
    return _store_read_index(capture_dir, split)


def capture_dataset(capture_dir: Path, split: str) -> CaptureDataset:
    return CaptureDataset(capture_dir, split)


# ---- packing --------------------------------------------------------------------------------------


def pack(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Greedy, in order: start a new microbatch when the next sample does not fit the budget."""
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = min(lengths[i], budget)
        if cur and used + n > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


def collate(items: list[dict], budget: int, pad_to: int | None = None) -> PackedBatch:
    """Concatenate samples (each cut to `budget`) into one row; padding is one extra doc. Items
    without states (online training: token ids only) give a batch whose aux and final are None."""
    ids, mask, doc, pos, aux, final = [], [], [], [], [], []
    states = "aux" in items[0]
    for d, it in enumerate(items):
        n = min(len(it["input_ids"]), budget)
        ids.append(it["input_ids"][:n])
        mask.append(it["loss_mask"][:n])
        doc.append(torch.full((n,), d, dtype=torch.long))
        pos.append(torch.arange(n))
        if states:
            aux.append(it["aux"][:n])
            final.append(it["final"][:n])
    real = sum(len(x) for x in ids)
    pad = max(0, (pad_to or 0) - real)
    if pad:
        ids.append(torch.zeros(pad, dtype=torch.long))
        mask.append(torch.zeros(pad, dtype=torch.bool))
        doc.append(torch.full((pad,), len(items), dtype=torch.long))
        pos.append(torch.arange(pad))
        if states:
            aux.append(aux[0].new_zeros(pad, aux[0].shape[1]))
            final.append(final[0].new_zeros(pad, final[0].shape[1]))
    cat = lambda xs: torch.cat(xs)[None] if xs else None  # noqa: E731
    return PackedBatch(cat(ids), cat(mask), cat(doc), cat(pos), cat(aux), cat(final), num_tokens=real)


@dataclass
class Stream:
    """Microbatch number -> sample indices, epoch after epoch, shuffled per epoch by the seed."""

    lengths: list[int]
    budget: int
    seed: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        self._plans: list[list[list[int]]] = []
        self._starts: list[int] = []

    def plan(self, epoch: int) -> list[list[int]]:
        while len(self._plans) <= epoch:
            e = len(self._plans)
            n = len(self.lengths)
            order = (
                torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000003 + e)).tolist()
                if self.shuffle
                else list(range(n))
            )
            self._starts.append(self._starts[-1] + len(self._plans[-1]) if self._plans else 0)
            self._plans.append(pack(order, self.lengths, self.budget))
        return self._plans[epoch]

    def per_epoch(self) -> int:
        return len(self.plan(0))

    def __getitem__(self, k: int) -> list[int]:
        e = 0
        while True:
            p = self.plan(e)
            if k < self._starts[e] + len(p):
                return p[k - self._starts[e]]
            e += 1


class Prefetcher:
    """Loads the microbatches of the next steps in a background thread (reading shards and packing
    overlap the GPU's work); items come out in step order, errors re-raise in the caller."""

    def __init__(self, load_step: Callable[[int], object], start: int, stop: int, depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(load_step, start, stop), daemon=True)
        self._t.start()

    def _run(self, load_step, start: int, stop: int) -> None:
        for step in range(start, stop):
            try:
                item = load_step(step)
            except BaseException as e:  # handed to the consumer
                item = e
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item, BaseException):
                return

    def get(self):
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)
