"""The data feed: microbatches in, the draft's inputs and the teacher's distribution on the device.

Offline the states come from the capture store; online the target computes them right before each
draft step (features.py). A step's microbatches are numbered globally, so its data does not depend
on how it is split over ranks and accumulation steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from nestling.train import features
from nestling.train.build import Run
from nestling.train.data import Stream, collate
from nestling.train.inputs import Inputs
from nestling.train.loss import teacher
from nestling.train.settings import TrainSettings
from nestling.train.timing import Stopwatch
from nestling.train.ttt import PackedBatch


@dataclass
class Feed:
    """Where microbatches come from: the streams over both splits, their items, and (online) the
    target that computes the hidden states right before the draft step."""

    train_ds: object
    held_ds: object | None
    train_stream: Stream
    held_stream: Stream
    target_fwd: features.TargetStates | None
    pad: int | None  # pad every batch to the token budget (static shapes on CUDA)


def open_feed(inp: Inputs, s: TrainSettings, device: torch.device, train_stream: Stream) -> Feed:
    """Opened after the model is built: online, the target loads onto the device here."""
    train_ds = features.dataset(inp, "train")
    held_ds = features.dataset(inp, "heldout") if inp.heldout_index else None
    target_fwd = features.target_states(inp, s, device)  # online: the target, run right before each draft step
    held_stream = Stream([e["length"] for e in inp.heldout_index], s.batch_tokens, s.seed, shuffle=False)
    pad = s.batch_tokens if (s.pad_to_budget if s.pad_to_budget is not None else device.type == "cuda") else None
    return Feed(train_ds, held_ds, train_stream, held_stream, target_fwd, pad)


def load_batch(run: Run, feed: Feed, mb: list[int], ds) -> PackedBatch:
    """Items `mb` of `ds` packed into one microbatch of at most `batch_tokens` tokens."""
    return collate([ds[i] for i in mb], run.s.batch_tokens, feed.pad)


def load_step(run: Run, feed: Feed, at: int) -> list[PackedBatch]:
    """This rank's microbatches of step `at`, numbered globally: the same data whatever the split
    over ranks and accumulation steps. Runs in the prefetch thread."""
    G, d = run.plan.microbatches, run.d
    bs = [
        load_batch(run, feed, feed.train_stream[at * G + a * d.world + d.rank], feed.train_ds)
        for a in range(run.s.grad_accum)
    ]
    return [b.pin() for b in bs] if run.device.type == "cuda" else bs


def on_device(run: Run, feed: Feed, b: PackedBatch, sw: Stopwatch | None = None) -> tuple[PackedBatch, object]:
    """The batch on the device (online: its states from the target first, timed by `sw`) and its
    teacher distribution from the captured post-norm final state."""
    if feed.target_fwd is not None:
        with sw or contextlib.nullcontext():
            b = feed.target_fwd.fill(b)
    b = b.to(run.device, run.amp)
    return b, teacher(b.final, run.w_draft, run.w_rest, run.s.teacher_chunk)
