"""One optimizer step: this rank's microbatches forward and backward, the gradient clipped, the
optimizer (and lr schedule) stepped.

The loss is divided by the step's supervised tokens over all ranks, so splitting a step over ranks
and accumulation steps changes nothing; 1 process x 2 accumulation steps trains exactly what 2
processes x 1 do.
"""

from __future__ import annotations

import contextlib

import torch

from nestling.train import dist
from nestling.train.build import Run
from nestling.train.feed import Feed, on_device
from nestling.train.guard import NonFiniteGuard
from nestling.train.loss import supervised_counts
from nestling.train.noise import microbatch_seed
from nestling.train.settings import TrainSettings
from nestling.train.timing import Clocks
from nestling.train.ttt import PackedBatch


def autocast(run: Run) -> contextlib.AbstractContextManager:
    """Compute in the amp dtype (bf16 on CUDA) over fp32 weights; no autocast when training in fp32."""
    return torch.autocast(run.device.type, dtype=run.amp) if run.amp != torch.float32 else contextlib.nullcontext()


def noise_seed(s: TrainSettings, microbatch: int) -> int | None:
    """The microbatch's `hidden_noise` seed; None without noise, so nothing changes per call (compile)."""
    return microbatch_seed(s.seed, microbatch) if s.hidden_noise > 0 else None


def train_step(
    run: Run,
    feed: Feed,
    batches: list[PackedBatch],
    step: int,
    guard: NonFiniteGuard,
    clocks: Clocks,
    sums: torch.Tensor,
) -> tuple[torch.Tensor | None, int]:
    """One optimizer step over this rank's microbatches; adds their [loss, correct, count] x K into
    `sums`; returns (the clipped gradient norm, tokens over all ranks). The loss is divided by the
    step's supervised tokens over all ranks (`denom`), so splitting a step changes nothing."""
    s, d, K, G, model = run.s, run.d, run.s.ttt_steps, run.plan.microbatches, run.model
    denom = dist.all_sum(sum(supervised_counts(b, K) for b in batches), d)
    tokens = int(dist.all_sum(torch.tensor([float(sum(b.num_tokens for b in batches))]), d))
    for a, cpu_batch in enumerate(batches):
        b, t = on_device(run, feed, cpu_batch, clocks.target)
        last = a == s.grad_accum - 1
        sync = contextlib.nullcontext()
        if d.enabled and s.parallel == "ddp" and not last:
            sync = model.no_sync()
        elif d.enabled and s.parallel == "fsdp":
            model.set_requires_gradient_sync(last)
        microbatch = step * G + a * d.world + d.rank
        with sync, clocks.draft:
            with autocast(run):
                loss, loss_sum, correct, count = run.fwd(b, t, denom, noise_seed(s, microbatch))
            guard.note_loss(loss, microbatch)
            (loss * d.world).backward()
        sums += torch.stack([loss_sum, correct, count])
    with clocks.draft:
        gnorm = torch.nn.utils.clip_grad_norm_(run.params, s.grad_clip) if s.grad_clip > 0 else None
        guard.note_grad(
            gnorm
            if gnorm is not None
            else torch.nn.utils.get_total_norm([p.grad for p in run.params if p.grad is not None]),
            step,
        )
        run.optimizer.step()  # and the lr schedule
    run.optimizer.zero_grad(set_to_none=True)
    return gnorm, tokens
