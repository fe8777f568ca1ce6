"""One decode step of a Llama-family transformers model over a static KV cache, one position per row.

transformers' own StaticCache writes every row at the same position, but continuous refill needs
each slot at its own position (a slot that finished takes the next request, from position 0), so
the step is written here over the model's own modules (norms, projections, rotary embedding, MLP):
the same weights and the same math as the model, with a `[slots, kv_heads, length, head_dim]`
cache per layer and attention masked per row. The step has fixed shapes for a given attention
window and no host work, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION = ("matmul", "sdpa")  # matmul: scores in float32, as written below; sdpa: torch's fused kernel


def unsupported_reason(model) -> str | None:
    """Why the static step cannot run this model (None when it can)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        return f"model type {cfg.model_type!r} is not one of {', '.join(SUPPORTED)}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "the model uses sliding-window attention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", "default") == "dynamic":
        return "dynamic RoPE scaling changes with the length"
    return None


class StaticModel:
    """The model's decoder layers run one token per row against a static per-layer KV cache."""

    def __init__(self, model, slots: int, length: int, attention: str = "matmul"):
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: one of {', '.join(ATTENTION)}")
        self.attention = attention
        inner = model.model
        cfg = model.config
        self.model, self.inner, self.layers = model, inner, list(inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.scaling = attn.scaling
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        p = next(model.parameters())
        shape = (len(self.layers), slots, self.kv_heads, length, self.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.rows = torch.arange(slots, device=p.device)
        self.slots, self.length = slots, length

    def _attention(self, i: int, h: torch.Tensor, pos: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        a = self.layers[i].self_attn
        b, d = h.shape[0], self.head_dim
        q = a.q_proj(h).view(b, 1, self.heads, d)
        k = a.k_proj(h).view(b, 1, self.kv_heads, d)
        v = a.v_proj(h).view(b, 1, self.kv_heads, d).transpose(1, 2)
        if hasattr(a, "q_norm"):  # Qwen3 normalises q and k per head before the rotary embedding
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        self.k[i][self.rows, :, pos] = k[:, :, 0]
        self.v[i][self.rows, :, pos] = v[:, :, 0]
        w = mask.shape[-1]
        keys, values = self.k[i][:, :, :w], self.v[i][:, :, :w]
        groups = self.heads // self.kv_heads
        qg = q.reshape(b, self.kv_heads, groups, d)  # head j reads kv head j // groups (repeat_kv)
        if self.attention == "sdpa":  # the groups act as the query length: no repeat of the cache
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask[:, None, None, :], scale=self.scaling)
            return a.o_proj(out.reshape(b, self.heads * d))
        scores = (qg @ keys.transpose(-1, -2)).float() * self.scaling
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        out = scores.softmax(-1).to(values.dtype) @ values  # [b, kv_heads, groups, d]
        return a.o_proj(out.reshape(b, self.heads * d))

    def logits(self, tokens: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
        """Logits [rows, vocab] (float32) of the next token after `tokens` at positions `pos`,
        attending to cache positions < `window` that are <= each row's position."""
        x = self.inner.embed_tokens(
            tokens
        )  # [rows, hidden]: 2-D, which CPU matmuls run much faster than [rows, 1, hidden]
        cos, sin = self.inner.rotary_emb(x, pos[:, None])
        mask = torch.arange(window, device=pos.device)[None, :] <= pos[:, None]
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer.input_layernorm(x), pos, cos, sin, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.inner.norm(x)).float()

    def prefill(self, prompts: list[list[int]], slots: list[int], pad: int) -> torch.Tensor:
        """Run prompts through the model (right-padded: causal attention never sees the padding),
        store their keys and values in `slots`, and return the last position's logits [n, vocab]."""
        from transformers import DynamicCache

        dev = self.k.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = torch.tensor(p)
        cache = DynamicCache()
        out = self.inner(input_ids=ids.to(dev), past_key_values=cache, use_cache=True)
        idx = torch.tensor(slots, device=dev)
        for i, layer in enumerate(cache.layers):
            self.k[i][idx, :, :width] = layer.keys
            self.v[i][idx, :, :width] = layer.values
        last = torch.tensor([len(p) - 1 for p in prompts], device=dev)
        hidden = out.last_hidden_state[torch.arange(len(prompts), device=dev), last]
        return self.model.lm_head(hidden).float()
