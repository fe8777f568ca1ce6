"""The step loop: every step from the run's start to the last, and after each the non-finite check,
the log line, the held-out pass and the checkpoint when due.

The next step's microbatches load in a thread (`data.Prefetcher`) while this one trains.
"""

from __future__ import annotations

import math
import time

import torch

from nestling.errors import NestlingError
from nestling.progress import Progress, log
from nestling.train import checkpoint as ckpt
from nestling.train import dist
from nestling.train.build import Run
from nestling.train.data import Prefetcher
from nestling.train.feed import Feed, load_step
from nestling.train.guard import NonFiniteGuard, check_due, describe_non_finite
from nestling.train.heldout import evaluate
from nestling.train.inputs import Inputs
from nestling.train.metrics import MetricsLog, ttt_metrics
from nestling.train.step import train_step
from nestling.train.timing import Clocks


def save_checkpoint(run: Run, at: int) -> None:
    """Weights, optimizer, schedule and RNG after step `at`, gathered and written by rank 0; every
    rank waits for it, so no rank runs ahead of a checkpoint it may resume from."""
    weights, optim = dist.full_state(run.model, run.optimizer, run.d, run.s.parallel)
    if run.d.main:
        ckpt.save(
            run.checkpoints,
            at,
            weights,
            optim,
            run.optimizer.scheduler_state(),
            run.plan.key,
            {"microbatches_done": at * run.plan.microbatches, "total_steps": run.plan.total, "world": run.d.world},
            run.s.keep_checkpoints,
        )
    dist.barrier(run.d)


def heldout_non_finite(step: int, where: str) -> str:
    """The message when the held-out loss is NaN or inf while training's is finite (the guard passed):
    the held-out split's inputs hold NaN/inf, and a report of `loss nan` would pass for a result."""
    return (
        f"training stopped: the held-out loss is not finite (NaN or inf) at step {step} of {where}, while the "
        "training loss is.\n  The held-out split holds NaN/inf values: check the capture with `nestling capture "
        f"--verify DIR` and capture it again; checkpoints before step {step} are kept."
    )


def run_steps(run: Run, feed: Feed, clocks: Clocks, metrics: MetricsLog, prog: Progress | None, inp: Inputs) -> None:
    """Steps from `run.step` to the last; after each, the non-finite check first (nothing is logged,
    evaluated or saved from bad weights), then the log line, evaluation and checkpoint when due."""
    s, d, total, G = run.s, run.d, run.plan.total, run.plan.microbatches
    sums = torch.zeros(3, s.ttt_steps, dtype=torch.float64, device=run.device)  # since the last log line
    interval_tokens, t_last = 0, time.monotonic()
    run.model.train()
    guard = NonFiniteGuard(run.device)

    def samples_of(microbatch: int) -> list[str]:
        return [str(inp.train_index[i].get("sample_id", i)) for i in feed.train_stream[microbatch]]

    step = run.step
    prefetch = Prefetcher(lambda at: load_step(run, feed, at), step, total)
    while step < total:
        gnorm, tokens = train_step(run, feed, prefetch.get(), step, guard, clocks, sums)
        step += 1
        interval_tokens += tokens
        if check_due(step, total, (s.log_every, s.eval_every, s.checkpoint_every)):
            try:
                guard.check(
                    d, lambda kind, n: describe_non_finite(kind, n, G, d.world, samples_of, str(inp.capture_dir))
                )
            except NestlingError:
                prefetch.close()
                raise
        if step % s.log_every == 0 or step == total:
            now = time.monotonic()
            rec = {
                "step": step,
                "split": "train",
                "lr": run.optimizer.last_lr(),
                **ttt_metrics(dist.all_sum(sums, d).cpu(), s.ttt_decay),
                "grad_norm": float(gnorm) if gnorm is not None else None,
                "tokens_per_s": interval_tokens / max(now - t_last, 1e-9),
                **clocks.take(),
            }
            metrics.write(rec)
            sums.zero_()
            interval_tokens, t_last = 0, now
            if prog:
                prog.extra.update(
                    step=step,
                    loss=rec["loss"],
                    acc_0=rec["acc_0"],
                    **({"target_share": round(rec["target_share"], 3)} if clocks.online else {}),
                )
        if prog:
            prog.update(1, tokens=tokens)
        if (s.eval_every > 0 and step % s.eval_every == 0) or step == total:
            ev = evaluate(run, feed)
            if ev is not None and not math.isfinite(ev["loss"]):
                prefetch.close()
                raise NestlingError(heldout_non_finite(step, str(inp.capture_dir)))
            if ev is not None:
                metrics.write({"step": step, "split": "heldout", **ev})
                if d.main:
                    log(
                        f"[train] step {step} held-out: loss {ev['loss']:.4f} acc_0 {ev['acc_0']:.3f} "
                        f"simulated acceptance length {ev['sim_accept_len']:.3f}"
                    )
        if step % s.checkpoint_every == 0 or step == total:
            save_checkpoint(run, step)
    prefetch.close()
