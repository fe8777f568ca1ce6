"""The held-out pass during training: loss, accuracies and simulated acceptance length."""

from __future__ import annotations

import math

import torch

from nestling.train import dist
from nestling.train.build import Run
from nestling.train.feed import Feed, load_batch, on_device
from nestling.train.loss import simulated_acceptance_length
from nestling.train.metrics import ttt_metrics
from nestling.train.step import autocast


def evaluate(run: Run, feed: Feed) -> dict | None:
    """Held-out loss, accuracies and simulated acceptance length over `eval_batches` batches; every
    rank runs the same number of forwards (FSDP needs it), batches past the last count nothing."""
    s, d, K = run.s, run.d, run.s.ttt_steps
    if feed.held_ds is None or s.eval_batches <= 0:
        return None
    n = min(s.eval_batches, feed.held_stream.per_epoch())
    tot = torch.zeros(3, K, dtype=torch.float64, device=run.device)
    run.model.eval()
    with torch.no_grad():
        for k in range(math.ceil(n / d.world)):
            i = k * d.world + d.rank
            b, t = on_device(run, feed, load_batch(run, feed, feed.held_stream[i % n], feed.held_ds))
            with autocast(run):
                _, loss_sum, correct, count = run.fwd(b, t, torch.ones(K, dtype=torch.float64))
            if i < n:
                tot += torch.stack([loss_sum, correct, count])
    run.model.train()
    tot = dist.all_sum(tot, d).cpu()
    m = ttt_metrics(tot, s.ttt_decay)
    return {
        **m,
        "sim_accept_len": simulated_acceptance_length([m[f"acc_{j}"] for j in range(K)]),
        "tokens": int(tot[2, 0]),
    }
