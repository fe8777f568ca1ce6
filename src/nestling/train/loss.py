"""Teacher distribution and the TTT loss.

The teacher at position p is the target's next-token distribution lm_head_target(final_p) restricted
to the draft vocabulary and renormalised. It is computed in token chunks on the draft-vocab rows
only; the remaining rows are used chunk by chunk just for their maximum, to know whether the
target's own argmax lies in the draft vocabulary. No full-vocabulary logits tensor of the batch
is ever formed.

Step j at anchor t predicts token t+2+j; its teacher is the target at t+1+j. A position counts
(is "supervised") when that predicted token lies in the same sample and has loss_mask = 1.
Positions whose target argmax is outside the draft vocabulary add nothing to the loss (and count
as misses for accuracy) but stay in the denominator, which is the number of supervised positions
of step j over the whole global batch; this makes gradient accumulation and data parallelism
give exactly the gradient of one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nestling.train.ttt import PackedBatch


@dataclass
class Teacher:
    probs: torch.Tensor  # [B, L, Vd] fp32, target distribution over the draft vocab
    argmax: torch.Tensor  # [B, L] long, draft id of the target's argmax within the draft vocab
    in_vocab: torch.Tensor  # [B, L] bool, the target's full-vocab argmax is in the draft vocab


@torch.no_grad()
def teacher(final: torch.Tensor, w_draft: torch.Tensor, w_rest: torch.Tensor | None, chunk: int = 1024) -> Teacher:
    """final [B, L, H] post-norm states; w_draft [Vd, H] target lm_head rows of the draft vocab;
    w_rest [V-Vd, H] the other rows (None when the draft vocab is the whole vocab)."""
    B, L, H = final.shape
    x = final.reshape(B * L, H)
    probs = torch.empty(B * L, w_draft.shape[0], dtype=torch.float32, device=final.device)
    in_vocab = torch.ones(B * L, dtype=torch.bool, device=final.device)
    for s in range(0, B * L, chunk):
        xc = x[s : s + chunk].to(w_draft.dtype)
        ld = (xc @ w_draft.T).float()
        probs[s : s + chunk] = torch.softmax(ld, dim=-1)
        if w_rest is not None and w_rest.shape[0]:
            in_vocab[s : s + chunk] = ld.max(-1).values >= (xc @ w_rest.T).float().max(-1).values
    return Teacher(probs.view(B, L, -1), probs.argmax(-1).view(B, L), in_vocab.view(B, L))


def supervised(batch: PackedBatch, j: int) -> torch.Tensor:
    """[B, L-2-j] bool: anchor t at step j predicts a supervised token t+2+j of its own sample."""
    s = 2 + j
    L = batch.input_ids.shape[1]
    if s >= L:
        return batch.loss_mask[:, :0]
    return batch.loss_mask[:, s:] & (batch.doc[:, s:] == batch.doc[:, : L - s])


def supervised_counts(batch: PackedBatch, steps: int) -> torch.Tensor:
    """Number of supervised positions of each step [steps] (float64, for the global denominators)."""
    return torch.tensor([float(supervised(batch, j).sum()) for j in range(steps)], dtype=torch.float64)


@dataclass
class StepStats:
    """Sums over a batch for step j (reduced across ranks, then divided)."""

    loss_sum: torch.Tensor  # [steps]
    correct: torch.Tensor  # [steps]
    count: torch.Tensor  # [steps]


def ttt_loss(
    model, hiddens: list[torch.Tensor], t: Teacher, batch: PackedBatch, denom: torch.Tensor, decay: float = 0.8
) -> tuple[torch.Tensor, StepStats]:
    """Σ_j decay^j · (Σ soft-CE over supervised positions of step j) / denom[j]."""
    dev = hiddens[0].device
    loss = torch.zeros((), device=dev)
    zero = torch.zeros((), device=dev, dtype=torch.float64)
    sums, correct, count = [], [], []
    for j, h in enumerate(hiddens):
        m = supervised(batch, j)
        n = m.shape[1]
        if n == 0:
            sums.append(zero)
            correct.append(zero)
            count.append(zero)
            continue
        keep = m & t.in_vocab[:, 1 + j : 1 + j + n]
        logits = model.logits(h[:, :n]).float()
        logp = F.log_softmax(logits, dim=-1)
        ce = -(t.probs[:, 1 + j : 1 + j + n] * logp).sum(-1)
        s = (ce * keep).sum()
        loss = loss + (decay**j) * s / max(float(denom[j]), 1.0)
        with torch.no_grad():  # stays on the device: no sync per step
            hit = (logits.argmax(-1) == t.argmax[:, 1 + j : 1 + j + n]) & keep
            sums.append(s.detach().double())
            correct.append(hit.sum().double())
            count.append(m.sum().double())
    return loss, StepStats(torch.stack(sums), torch.stack(correct), torch.stack(count))


def simulated_acceptance_length(acc: list[float]) -> float:
    """1 + Σ_k Π_{j<=k} acc_j: expected tokens per target forward for a K-step chain (the bonus
    token from the target's own verification plus each draft token accepted when all before it were),
    treating the per-step accuracies as independent."""
    total, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        total += prod
    return total
