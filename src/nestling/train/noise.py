"""Noise on the target's hidden states during training (`hidden_noise`), reproducible without saved state.

What speculators does (`speculators/train/noise_transforms.py: AddUniformNoise`, applied by its
training dataloader only, never to the validation split, in its main branch as read; the 0.9.0 release
no longer has it): `x + 2 * (rand_like(x) - 0.5) * std` on the concatenated aux states, the input of
`fc`, with std 0.05. Despite the name that is uniform noise in [-std, std], not scaled by anything.
(EAGLE-1/2's trainer, `eagle/train/main.py`, added `(rand - 0.5) * std * 512 / sequence length` to the
target state; the official EAGLE-3 trainer, `eagle/traineagle3`, and SpecForge add none.) nestling does the
same: uniform in [-hidden_noise, hidden_noise] on `batch.aux`, before `fc`, in training forwards only.

The noise of a microbatch is drawn from a generator seeded by (seed, global microbatch number), the
same number that names the microbatch's data. So it needs no saved RNG state: a resumed run draws
the same noise as an uninterrupted one, and 2 processes x 1 microbatch draw what 1 process x 2 do.
"""

from __future__ import annotations

import hashlib

import torch


def microbatch_seed(seed: int, microbatch: int) -> int:
    """A 63-bit generator seed that depends only on the run's seed and the global microbatch number."""
    digest = hashlib.blake2b(f"hidden_noise:{seed}:{microbatch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def add_uniform_noise(x: torch.Tensor, half_width: float, seed: int) -> torch.Tensor:
    """x + U(-half_width, half_width), drawn in fp32 from a generator seeded with `seed` on x's device."""
    g = torch.Generator(device=x.device)
    g.manual_seed(seed)
    u = torch.rand(x.shape, generator=g, device=x.device, dtype=torch.float32)
    return (x.float() + (2 * u - 1) * half_width).to(x.dtype)
