"""Greedy outputs "unchanged" on any CPU: two greedy decodes of one target agree, or part at a near-tie.

Two engines (or one engine with forwards of other shapes: verification runs K+1 tokens, plain decoding
one) sum the same products in other orders, and fp32 keeps ~7 digits: where the target's two best
logits lie closer than that rounding, either token may win, and after it the continuations part
legitimately. What rounding can do is bounded: tests/test_capture_parity.py bounds an fp32 hidden
state's deviation between kernel orders by FP32_STATE_TOL x the token's RMS in every element (derived
there), so a logit w_t . h moves by at most ||w_t|| x sqrt(H) x FP32_STATE_TOL x RMS(h) (Cauchy-Schwarz),
and a flip needs the two tokens' gap below twice that. A wrong draft, cache or position gives tokens the
target never ranked near the top, and fails this.
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def tie_gap(model, prompt: list[int], got: list[int], want: list[int]) -> str | None:
    """None when `got` equals `want`, or when they agree up to their first difference and there the
    target's logits of the two tokens lie within the rounding bound; else what is wrong."""
    if got == want:
        return None
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return f"one output is a prefix of the other (lengths {len(got)} and {len(want)}): no tie ends a decode early"
    from test_capture_parity import FP32_STATE_TOL

    out = model(torch.tensor([prompt + want[:i]]), output_hidden_states=True, logits_to_keep=1)
    h = out.hidden_states[-1][0, -1].float()  # the final norm's output, which the head reads
    logits = out.logits[0, -1].float()
    w = model.get_output_embeddings().weight.float()
    rounding = float(h.pow(2).mean().sqrt()) * h.numel() ** 0.5 * FP32_STATE_TOL
    bound = rounding * float(w[got[i]].norm() + w[want[i]].norm())
    gap = float(logits[want[i]] - logits[got[i]])
    if abs(gap) <= bound and float(logits.max() - logits[want[i]]) <= bound:
        return None
    return (
        f"outputs part at token {i} ({got[i]} against {want[i]}) with a logit gap {gap:.4g}, beyond the "
        f"fp32 rounding bound {bound:.4g}: not a near-tie"
    )
