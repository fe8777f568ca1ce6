"""Seconds spent in parts of a step (the target forward, the draft step), summed per logged interval.

On CUDA the time is taken with events, read once per interval: timing every step with a host clock
would need a synchronize per step and slow the very loop it measures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


class Stopwatch:
    """`with sw:` adds the block's time; `take()` returns the sum since the last take and resets."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: list[tuple] = []
        self._t0 = 0.0
        self._sum = 0.0

    def __enter__(self) -> "Stopwatch":
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start,))
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1] = (self._events[-1][0], end)
        else:
            self._sum += time.perf_counter() - self._t0

    def take(self) -> float:
        total, self._sum = self._sum, 0.0
        if self._events:
            self._events[-1][1].synchronize()
            total += sum(a.elapsed_time(b) for a, b in self._events) / 1000
            self._events = []
        return total


@dataclass
class Clocks:
    """Seconds in the target forward (online) and in the draft's steps, reported per log interval."""

    target: Stopwatch
    draft: Stopwatch
    online: bool

    def take(self) -> dict:
        t_s, d_s = self.target.take(), self.draft.take()
        return {
            "draft_s": d_s,
            **({"target_s": t_s, "target_share": t_s / max(t_s + d_s, 1e-9)} if self.online else {}),
        }
