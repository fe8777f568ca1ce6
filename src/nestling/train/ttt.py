"""Training-time test (TTT): all K draft steps for every anchor of a packed batch at once.

What the engine does at anchor t (vLLM `llm_base_proposer.py`): the first draft pass over the
verified prefix feeds, at index i <= t, the token i+1 (input ids rotated left by one) with
combine(aux_i) (fc, after fc_norm when on) at rotary position i; each further step j feeds the
chain's next token, the draft's own h from step j-1 (pre-norm; normed with norm_output), at
position t+j, attending to the step-0 keys 0..t plus the chain's own keys. Batched, that is K passes over the whole row where step j's query at index t may see

    step-0 keys at indices i <= t of the same sample        (causal, packed samples isolated)
    step-m keys (1 <= m <= j) at index t only                (the chain's diagonal)

With several draft layers, each layer attends to its own keys under that same mask, and the last
layer's pre-norm h (`next_hidden` of it) is what step j+1 feeds back.

`reference_logits` drafts the same thing anchor by anchor with `Eagle3Draft.step` and a KVCache;
the tests hold the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nestling.draft.model import Eagle3Draft, KVCache, repeat_kv


@dataclass
class PackedBatch:
    """Samples concatenated along a row; `doc` tells them apart (padding is its own doc)."""

    input_ids: torch.Tensor  # [B, L] long
    loss_mask: torch.Tensor  # [B, L] bool (False on padding)
    doc: torch.Tensor  # [B, L] long, sample number within the row
    pos: torch.Tensor  # [B, L] long, position within the sample
    aux: torch.Tensor  # [B, L, n_aux*H]
    final: torch.Tensor | None = None  # [B, L, H] post-norm target state (teacher input)
    num_tokens: int = 0  # real (unpadded) tokens

    def pin(self) -> "PackedBatch":
        f = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return PackedBatch(
            f(self.input_ids), f(self.loss_mask), f(self.doc), f(self.pos), f(self.aux), f(self.final), self.num_tokens
        )

    def to(self, device, dtype=None) -> "PackedBatch":
        def f(t):
            return (
                None if t is None else t.to(device, dtype=dtype if t.is_floating_point() else None, non_blocking=True)
            )

        return PackedBatch(
            self.input_ids.to(device),
            self.loss_mask.to(device),
            self.doc.to(device),
            self.pos.to(device),
            f(self.aux),
            f(self.final),
            self.num_tokens,
        )


def shift_in_doc(x: torch.Tensor, doc: torch.Tensor, s: int, fill: int = 0) -> torch.Tensor:
    """x[t+s] where index t+s lies in the same sample as t, else `fill` ([B, L] tensors)."""
    B, L = x.shape
    out = torch.full_like(x, fill)
    if s < L:
        same = doc[:, s:] == doc[:, : L - s]
        out[:, : L - s] = torch.where(same, x[:, s:], torch.full_like(x[:, s:], fill))
    return out


# ---- attention over [step-0 keys | chain keys] ------------------------------------------------------


def ttt_mask(doc: torch.Tensor, j: int) -> torch.Tensor:
    """Boolean mask [B, 1, L, (j+1)L] over [step-0 keys | chain keys 1..j] (True = may attend).
    Used by the 'concat' backend, the plainest statement of the TTT mask."""
    causal = doc_causal_mask(doc)
    B, L = doc.shape
    eye = torch.eye(L, dtype=torch.bool, device=doc.device).expand(B, L, L)
    return torch.cat([causal] + [eye] * j, dim=-1)[:, None]


def doc_causal_mask(doc: torch.Tensor) -> torch.Tensor:
    """[B, L, L]: key i <= query t and of the same sample."""
    idx = torch.arange(doc.shape[1], device=doc.device)
    return (idx[None, :, None] >= idx[None, None, :]) & (doc[:, :, None] == doc[:, None, :])


_compiled_flex = None


def _flex_attention():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        if torch.cuda.is_available():
            import torch._dynamo.config as dc

            for name in ("recompile_limit", "cache_size_limit"):  # train, eval and row shapes
                if hasattr(dc, name):
                    setattr(dc, name, max(getattr(dc, name), 32))
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        else:
            _compiled_flex = flex_attention
    return _compiled_flex


def flex_block_mask(doc: torch.Tensor):
    """The step-0 part of the mask (causal within a sample) as a flex block mask; fully masked blocks
    are skipped, so packed rows cost less than a dense causal pass.

    The indices are clamped into the row before `doc` is read: flex kernels evaluate the mask on the
    padded tail of the last 128-wide block too, before discarding it, and an unguarded read there
    lands past the end of `doc` when the row length is not a multiple of 128 (CUDA pads rows to
    batch_tokens; benchmarks/flex_mask_bounds.py). Clamped, those lanes read the row's last id;
    kv <= q still keeps every padded key away from a real query."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, L = doc.shape

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (doc[b, kv.clamp(max=L - 1)] == doc[b, q.clamp(max=L - 1)])

    return create_block_mask(mask_mod, B, None, L, L, device=doc.device)


def attention_backend(requested: str, device: torch.device) -> str:
    """'flex' on CUDA when available, else the explicit-mask path ('mask')."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        try:
            import torch.nn.attention.flex_attention  # noqa: F401

            return "flex"
        except ImportError:
            pass
    return "mask"


def _prefix_attention(q, k0, v0, doc, backend: str, block_mask=None):
    """Attention of q over the step-0 keys with its log-sum-exp: (out [B,h,L,D], lse [B,h,L] fp32)."""
    rep = q.shape[1] // k0.shape[1]
    if backend == "flex":
        q, k0 = q.to(v0.dtype), k0.to(v0.dtype)  # flex is outside autocast: rotary may have left fp32
        try:
            from torch.nn.attention.flex_attention import AuxRequest
        except ImportError:  # torch < 2.9
            out, lse = _flex_attention()(q, k0, v0, block_mask=block_mask, enable_gqa=rep != 1, return_lse=True)
            return out, lse.float()
        out, aux = _flex_attention()(
            q, k0, v0, block_mask=block_mask, enable_gqa=rep != 1, return_aux=AuxRequest(lse=True)
        )
        return out, aux.lse.float()
    scale = q.shape[-1] ** -0.5
    k0, v0 = repeat_kv(k0, rep), repeat_kv(v0, rep)
    scores = (q.float() @ k0.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~doc_causal_mask(doc)[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v0.float()
    return out.to(v0.dtype), lse


def chain_attention(q, ks: list[torch.Tensor], vs: list[torch.Tensor], doc, backend: str, block_mask=None):
    """Step j's attention = softmax over [step-0 keys (causal) | chain keys 1..j at the same index],
    computed as the prefix attention plus j diagonal terms merged through their log-sum-exp, so a
    step costs one causal pass plus O(j L) and memory stays linear in K (no concatenated KV)."""
    out0, lse0 = _prefix_attention(q, ks[0], vs[0], doc, backend, block_mask)
    B, h, L, D = q.shape
    if len(ks) == 1:
        return out0.transpose(1, 2).reshape(B, L, -1)
    kv = ks[0].shape[1]
    qg = q.float().view(B, kv, h // kv, L, D)
    scale = D**-0.5
    diag = torch.stack([(qg * k.float().unsqueeze(2)).sum(-1).view(B, h, L) * scale for k in ks[1:]])  # [j,B,h,L]
    lse = torch.logsumexp(torch.cat([lse0[None], diag]), dim=0)
    out = torch.exp(lse0 - lse)[..., None] * out0.float()
    for m, v in enumerate(vs[1:]):
        w = torch.exp(diag[m] - lse).view(B, kv, h // kv, L, 1)
        out = out + (w * v.float().unsqueeze(2)).view(B, h, L, D)
    return out.to(vs[0].dtype).transpose(1, 2).reshape(B, L, -1)


def ttt_hidden(model: Eagle3Draft, batch: PackedBatch, steps: int, backend: str = "mask") -> list[torch.Tensor]:
    """Pre-norm h [B, L, H] of the last layer at every TTT step j = 0..steps-1 (the draft's chain,
    batched); it feeds layer 0 of step j+1.

    backend: 'mask' (explicit boolean mask), 'flex' (flex attention; CUDA for training) or
    'concat' (one SDPA over the concatenated keys with the full TTT mask; a plain cross-check).
    """
    hidden = model.combine(batch.aux)
    ks: list[list[torch.Tensor]] = [[] for _ in range(model.num_layers)]  # per layer, per step
    vs: list[list[torch.Tensor]] = [[] for _ in range(model.num_layers)]
    out = []
    block_mask = flex_block_mask(batch.doc) if backend == "flex" else None
    for j in range(steps):
        ids = shift_in_doc(batch.input_ids, batch.doc, 1 + j)  # token t+1+j feeds anchor t at step j
        for i in range(model.num_layers):  # every layer attends to its own keys under the same mask
            q, k, v = model.qkv(i, ids, hidden, batch.pos + j)
            ks[i].append(k)
            vs[i].append(v)
            if backend == "concat":
                attn = model.attend(q, torch.cat(ks[i], dim=2), torch.cat(vs[i], dim=2), ttt_mask(batch.doc, j))
            else:
                attn = chain_attention(q, ks[i], vs[i], batch.doc, backend, block_mask)
            hidden = model.finish(i, attn, hidden)
        out.append(hidden)
        hidden = model.next_hidden(hidden)
    return out


# ---- the step-by-step reference (the engine's way) --------------------------------------------------


@torch.no_grad()
def reference_logits(model: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, steps: int) -> torch.Tensor:
    """Draft chains anchor by anchor for ONE sample ([T] ids, [T, n_aux*H] aux).

    Returns [T, steps, draft_vocab] logits; NaN where the chain's input token lies past the sample.
    """
    T = input_ids.shape[0]
    out = torch.full((T, steps, model.config.draft_vocab_size), float("nan"))
    for t in range(T - 1):  # anchor t needs token t+1
        cache = KVCache()
        g = model.combine(aux[None, : t + 1])
        h = model.step(input_ids[None, 1 : t + 2], g, torch.arange(t + 1)[None], cache)[:, -1:]
        out[t, 0] = model.logits(h)[0, 0].float()
        for j in range(1, steps):
            if t + 1 + j > T - 1:
                break
            h = model.step(input_ids[None, t + 1 + j : t + 2 + j], model.next_hidden(h), torch.tensor([[t + j]]), cache)
            out[t, j] = model.logits(h)[0, 0].float()
    return out
