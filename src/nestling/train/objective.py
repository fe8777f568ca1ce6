"""The training forward: the draft and its TTT loss behind one `forward`, the module DDP and FSDP wrap.

`hidden_noise` is added here, in training forwards only (noise.py); when flex attention fails (it needs a
working compiler toolchain) the objective falls back to the mask path, once, for the rest of the run.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from nestling.draft.model import Eagle3Draft
from nestling.progress import log
from nestling.train.loss import ttt_loss
from nestling.train.noise import add_uniform_noise
from nestling.train.ttt import PackedBatch, ttt_hidden


class TTTObjective(nn.Module):
    """The draft plus its TTT loss behind one `forward`, the entry point DDP and FSDP hook into."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float, backend: str, hidden_noise: float = 0.0):
        super().__init__()
        self.draft, self.steps, self.decay, self.backend = draft, steps, decay, backend
        self.hidden_noise = hidden_noise

    def forward(self, batch: PackedBatch, t, denom: torch.Tensor, noise_seed: int | None = None):
        """`noise_seed`: the training microbatch's seed for `hidden_noise` (train/noise.py); evaluation
        passes none, and a module in eval mode adds no noise either."""
        if self.hidden_noise > 0 and self.training and noise_seed is not None:
            batch = dataclasses.replace(batch, aux=add_uniform_noise(batch.aux, self.hidden_noise, noise_seed))
        try:
            hiddens = ttt_hidden(self.draft, batch, self.steps, self.backend)
        except Exception as e:  # flex needs a working compiler toolchain; the mask path always works
            if self.backend != "flex":
                raise
            log(f"[train] flex attention failed ({type(e).__name__}: {str(e)[:200]}); falling back to attention=mask")
            self.backend = "mask"
            hiddens = ttt_hidden(self.draft, batch, self.steps, self.backend)
        loss, st = ttt_loss(self.draft, hiddens, t, batch, denom, self.decay)
        return loss, st.loss_sum, st.correct, st.count
