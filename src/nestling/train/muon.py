"""Muon with the Newton-Schulz iterations in a chosen dtype.

torch.optim.Muon always orthogonalizes in bf16. A CPU without bf16 units (most AVX2-only laptops)
computes those matmuls on a slow path: a 576 x 576 x 1,536 bf16 product took 352 ms against 4.6 ms in
fp32, and the CPU demo trained at 61 tok/s against ~770 on a CPU with bf16 units. `Muon` here is
torch's with one knob, `ns_dtype`: bf16 wherever bf16 is fast (then it computes what torch's does,
bit for bit, for nestling's float32 parameters), fp32 elsewhere. The state dict is torch's (a
`momentum_buffer` per matrix), so checkpoints move between the two.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch's (Keller Jordan's quintic): steepest slope at 0


def orthogonalize(
    g: Tensor, steps: int, dtype: torch.dtype, eps: float = 1e-7, coefficients: tuple = NS_COEFFICIENTS
) -> Tensor:
    """~U V^T of g = U S V^T by `steps` quintic Newton-Schulz iterations computed in `dtype`
    (the singular values land in ~[0.5, 1.5], which Muon is known to tolerate)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T  # iterate on the wide side: the Gram matrix is the smaller one
    x = x.div(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rule: str | None, shape: torch.Size) -> float:
    """torch's `adjust_lr_fn`: "match_rms_adamw" gives an orthogonalized update AdamW's RMS
    (Moonlight's rule, nestling's choice: one lr serves both optimizers); "original" (or None) scales by
    sqrt(max(1, rows / cols)) (Keller Jordan's). Same rounding order as torch."""
    a, b = shape[0], shape[1]
    ratio = 0.2 * math.sqrt(max(a, b)) if rule == "match_rms_adamw" else math.sqrt(max(1, a / b))
    return lr * ratio


class Muon(torch.optim.Muon):
    """torch.optim.Muon (nesterov momentum, decoupled weight decay, `match_rms_adamw`) whose
    Newton-Schulz iterations run in `ns_dtype`."""

    def __init__(
        self, params, *, ns_dtype: torch.dtype = torch.bfloat16, adjust_lr_fn: str | None = "match_rms_adamw", **kwargs
    ) -> None:
        super().__init__(params, adjust_lr_fn=adjust_lr_fn, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = float(group["lr"]), group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:  # torch's key: checkpoints move between the two
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_steps"], self.ns_dtype, group["eps"], group["ns_coefficients"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
