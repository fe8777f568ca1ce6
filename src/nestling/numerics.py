"""How far a fast path's numbers are from the reference path's (the packed capture forward against the
padded one, flash decode against the masked matmul): one measure, so both checks read alike."""

from __future__ import annotations

import torch


def disagreement(got: torch.Tensor, ref: torch.Tensor, lengths: list[int] | None = None) -> float:
    """The 99th percentile of ||got - ref|| / ||ref|| over vectors (last dim; at most 1M of them, the
    cap of torch.quantile), or, with `lengths` (the samples' token counts along dim 0), the worst
    sample's median if larger. A percentile, not the max: a vector of tiny norm has a large relative
    error from rounding alone. The per-sample median catches damage to one short sample, which a
    percentile over all vectors would not see. NaN anywhere gives NaN (compare with `not err <= bar`)."""
    rel = (got.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-6)
    rel = rel.reshape(rel.shape[0], -1)  # [tokens, vectors per token]
    if torch.isnan(rel).any():
        return float("nan")
    err = torch.quantile(rel.flatten()[:1_000_000], 0.99).item()
    at = 0
    for n in lengths or []:
        err = max(err, rel[at : at + n].median().item())
        at += n
    return err
