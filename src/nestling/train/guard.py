"""Stop training at the first loss or gradient that is not finite, naming the step and the samples.

A NaN in the inputs (or a diverging run) otherwise trains an all-NaN draft that exits 0, exports and
evaluates. The check must not slow the step: `note_*` only folds `isfinite` of the loss and grad norm
the step already computed into a device tensor (no host sync); `check` reads it back, once, at a
point of the loop that syncs anyway (logging, evaluation, a checkpoint, the end), before anything is
written from the weights. So training stops at the next such point, reports the first bad
microbatch exactly, and no checkpoint or model is ever saved from non-finite weights.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from nestling.errors import NestlingError
from nestling.train import dist

NONE = 2**62  # "nothing bad yet": larger than any microbatch or step number


class NonFiniteGuard:
    """The first microbatch (global number) with a non-finite loss and the first step with a
    non-finite gradient norm, kept on the training device."""

    def __init__(self, device: torch.device):
        self.first = torch.full((2,), NONE, dtype=torch.int64, device=device)

    def _note(self, slot: int, value: torch.Tensor, at: int) -> None:
        value = value.full_tensor() if hasattr(value, "full_tensor") else value  # FSDP's DTensor norm
        bad = ~torch.isfinite(value.detach()).all()
        self.first[slot] = torch.minimum(self.first[slot], torch.where(bad, at, NONE))

    def note_loss(self, loss: torch.Tensor, microbatch: int) -> None:
        """Record `microbatch` (the global microbatch number) if `loss` is NaN or inf."""
        self._note(0, loss, microbatch)

    def note_grad(self, grad_norm: torch.Tensor, step: int) -> None:
        """Record optimizer step `step` (0-based) if the gradient norm is NaN or inf."""
        self._note(1, grad_norm, step)

    def check(self, d: dist.Dist, describe: Callable[[str, int], str]) -> None:
        """Raise NestlingError(describe(kind, at)) if anything was recorded on any rank.
        Call only where the loop syncs anyway (this reads one tensor back)."""
        first = self.first.clone()
        if d.enabled:
            import torch.distributed as tdist

            tdist.all_reduce(first, op=tdist.ReduceOp.MIN)
        loss_mb, grad_step = (int(v) for v in first.cpu())
        if loss_mb != NONE:
            raise NestlingError(describe("loss", loss_mb))
        if grad_step != NONE:
            raise NestlingError(describe("grad", grad_step))


def check_due(step: int, total: int, every: Sequence[int]) -> bool:
    """Whether the loop syncs after `step` (1-based): a log, evaluation or checkpoint step, or the end."""
    return step == total or any(n > 0 and step % n == 0 for n in every)


def describe_non_finite(
    kind: str, at: int, microbatches_per_step: int, world: int, samples_of: Callable[[int], list[str]], where: str
) -> str:
    """The user's message: which step, which samples, the likely causes and what to do."""
    if kind == "loss":
        step, a = divmod(at, microbatches_per_step)
        what = (
            f"the loss is not finite (NaN or inf) at step {step + 1}, microbatch {a // world} of rank {a % world}, "
            f"samples {_names(samples_of(at))}"
        )
    else:
        step = at
        ids = [
            i for m in range(step * microbatches_per_step, (step + 1) * microbatches_per_step) for i in samples_of(m)
        ]
        what = f"the gradient norm is not finite (NaN or inf) at step {step + 1} (its samples: {_names(ids)})"
    return (
        f"training stopped: {what} of {where}.\n  The inputs hold NaN/inf values (check the capture with "
        f"`nestling capture --verify DIR`) or training diverged (lower lr); checkpoints saved before step "
        f"{step + 1} are kept and nothing was saved from the broken weights."
    )


def _names(ids: list[str], n: int = 4) -> str:
    return ", ".join(ids[:n]) + (f" and {len(ids) - n} more" if len(ids) > n else "")
