"""One decode step of a Llama-family transformers model over a static KV cache, one position per row.

transformers' own StaticCache writes every row at the same position, but continuous refill needs
each slot at its own position (a slot that finished takes the next request, from position 0), so
the step is written here over the model's own modules (norms, projections, rotary embedding, MLP):
the same weights and the same math as the model, with a `[slots, kv_heads, length, head_dim]`
cache per layer and attention masked per row. The step has fixed shapes for a given attention
window and no host work, so it can be captured in a CUDA graph.

Masked attention reads every row's cache up to the window, the longest busy position: at ShareGPT
scale (1,024 slots, windows up to ~1,500) that was ~35 GB of keys and values per step, most of it
past the rows' own positions. `flash` reads each row's own keys only: the cache is laid out
`[slots, length, kv_heads, head_dim]`, so the slots are variable-length sequences at fixed offsets,
and PyTorch's flash kernel (`aten::_flash_attention_forward`, the varlen form with `seqused_k` =
each row's position + 1) attends over the used part; the shapes stay fixed, so it is graph-safe.
On a CPU the same layout runs the masked matmul (the tests' reference for the plumbing).

In flash's layout the prefill is packed too: a batch's prompts end to end in one row, attention per
prompt (capture/packed.py's varlen flash), each layer's keys and values scattered into the slots, so
no padding is computed or copied. Its first batch is checked against the padded forward.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from nestling.errors import NestlingError
from nestling.numerics import disagreement

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
# matmul: scores in float32, as written below; sdpa: torch's fused kernel; flash: each row reads only
# its used keys (CUDA, bf16/fp16); auto: flash where it runs, checked on the first step, else matmul
ATTENTION = ("auto", "matmul", "sdpa", "flash")
# the first flash step's logits must agree with the matmul's: numerics.disagreement (per row, the
# relative L2 error of the logits; its 99th percentile) below this, the packed capture's bar. bf16
# rounding in another reduction order moves them by a few percent; a row reading another row's keys
# or the wrong length moves them by O(1). Measured on the H200: random-weight SmolLM2 and 8B shapes
# 0.013 and 0.078, the real SmolLM2-135M-Instruct 0.038-0.078
FLASH_TOLERANCE = 0.2
# the packed prefill's check runs on the first batch's first prompts up to this many tokens (at least
# one prompt): enough prompts to see one mixed into another, little memory for the copies it compares
CHECK_TOKENS = 8192


def flash_varlen(*args, **kwargs):
    """PyTorch's flash kernel, varlen form (the seam the CPU tests fill with its contract written out)."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def resolve_attention(attention: str, dtype: torch.dtype, device: torch.device) -> tuple[str, str | None]:
    """(the attention a step runs, why not flash where auto declined it). `flash` asked for on a GPU
    that cannot run it is an error (on a CPU it runs the masked matmul over flash's layout: tests)."""
    from nestling.devices import flash_unavailable

    why = flash_unavailable(dtype, device) if attention in ("auto", "flash") else None
    if attention == "flash" and why and device.type == "cuda":
        raise NestlingError(f"hf_attention=flash cannot run here: {why}; use hf_attention auto or matmul")
    if attention != "auto":
        return attention, None
    return ("matmul", why) if why else ("flash", None)


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
        p = next(model.parameters())
        self.attention, self.flash_why = resolve_attention(attention, p.dtype, p.device)
        self.check_pending = attention == "auto" and self.attention == "flash"  # see check_flash
        inner = model.model
        cfg = model.config
        self.model, self.inner, self.layers = model, inner, list(inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.scaling = attn.scaling
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        shape = (len(self.layers), slots, self.kv_heads, length, self.head_dim)
        if self.flash:  # each slot's keys contiguous: a varlen sequence at offset slot * length
            shape = (len(self.layers), slots, length, self.kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.rows = torch.arange(slots, device=p.device)
        self.cu_q = torch.arange(slots + 1, dtype=torch.int32, device=p.device)  # one query per row
        self.cu_k = self.cu_q * length
        self.slots, self.length = slots, length
        self.reference = False  # flash layout, but the masked matmul (check_flash's other half)
        self.kernel = p.device.type == "cuda"  # flash on a CPU: the same layout, the masked matmul
        # flash's layout holds each slot's keys contiguous, so prompts can be prefilled packed (no
        # padding) and their keys scattered straight in; the first batch is checked against padded
        from nestling.capture.packed import packable

        self.packed_why = None if self.flash else "the cache is not in flash's layout"
        self.packed_why = self.packed_why or packable(cfg, p.dtype, p.device, force=True)
        self.prefill_check_pending = self.packed_why is None

    @property
    def flash(self) -> bool:
        return self.attention == "flash"

    def _cache(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values as [slots, kv_heads, length, head_dim] (a view in flash's layout)."""
        if self.flash:
            return self.k[i].transpose(1, 2), self.v[i].transpose(1, 2)
        return self.k[i], self.v[i]

    def _flash(self, i: int, q: torch.Tensor, used: torch.Tensor, window: int) -> torch.Tensor:
        """[rows, heads, d] queries against the first `used` keys of each row's own slot, on the GPU kernel."""
        b, d = q.shape[0], self.head_dim
        k = self.k[i].view(self.slots * self.length, self.kv_heads, d)
        v = self.v[i].view(self.slots * self.length, self.kv_heads, d)
        out = flash_varlen(
            q, k, v, self.cu_q[: b + 1], self.cu_k[: b + 1], 1, window, 0.0, False, False,
            scale=self.scaling, seqused_k=used,
        )  # fmt: skip
        return out[0]

    def _attention(self, i: int, h: torch.Tensor, pos: torch.Tensor, cos, sin, mask, used) -> torch.Tensor:
        a = self.layers[i].self_attn
        b, d = h.shape[0], self.head_dim
        q = a.q_proj(h).view(b, 1, self.heads, d)
        k = a.k_proj(h).view(b, 1, self.kv_heads, d)
        v = a.v_proj(h).view(b, 1, self.kv_heads, d).transpose(1, 2)
        if hasattr(a, "q_norm"):  # Qwen3 normalises q and k per head before the rotary embedding
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        keys, values = self._cache(i)
        keys[self.rows, :, pos] = k[:, :, 0]
        values[self.rows, :, pos] = v[:, :, 0]
        w = mask.shape[-1]
        if self.flash and self.kernel and not self.reference:
            return a.o_proj(self._flash(i, q[:, :, 0].contiguous(), used, w).reshape(b, self.heads * d))
        keys, values = keys[:, :, :w], values[:, :, :w]
        groups = self.heads // self.kv_heads
        qg = q.reshape(b, self.kv_heads, groups, d)  # head j reads kv head j // groups (repeat_kv)
        if self.attention == "sdpa":  # the groups act as the query length: no repeat of the cache
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask[:, None, None, :], scale=self.scaling)
            return a.o_proj(out.reshape(b, self.heads * d))
        scores = (qg @ keys.transpose(-1, -2)).float() * self.scaling
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        out = scores.softmax(-1).to(values.dtype) @ values  # [b, kv_heads, groups, d]
        return a.o_proj(out.reshape(b, self.heads * d))

    def logits(
        self, tokens: torch.Tensor, pos: torch.Tensor, window: int, live: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [rows, vocab] (float32) of the next token after `tokens` at positions `pos`,
        attending to cache positions < `window` that are <= each row's position. Rows where `live`
        is False are idle slots whose logits are thrown away: flash reads one key for them instead of
        their last occupant's whole history (at ShareGPT scale most slots idle at a wave's end)."""
        x = self.inner.embed_tokens(
            tokens
        )  # [rows, hidden]: 2-D, which CPU matmuls run much faster than [rows, 1, hidden]
        cos, sin = self.inner.rotary_emb(x, pos[:, None])
        mask = torch.arange(window, device=pos.device)[None, :] <= pos[:, None]
        used = (pos + 1).clamp(max=window)  # flash's keys per row (a stale position stays inside)
        if live is not None:
            used = torch.where(live, used, 1)
        used = used.to(torch.int32)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer.input_layernorm(x), pos, cos, sin, mask, used)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.inner.norm(x)).float()

    def prefill(self, prompts: list[list[int]], slots: list[int], pad: int) -> torch.Tensor:
        """Run prompts through the model, store their keys and values in `slots`, and return the last
        position's logits [n, vocab]: packed where it runs (after its first batch passed the check),
        else right-padded."""
        if self.packed_why is None and self.flash:  # not after a failed flash check relaid the cache
            if self.prefill_check_pending:
                return self._check_packed_prefill(prompts, slots, pad)
            return self._prefill_packed(prompts, slots)
        return self._prefill_padded(prompts, slots, pad)

    def _prefill_padded(self, prompts: list[list[int]], slots: list[int], pad: int) -> torch.Tensor:
        """Right-padded batch (causal attention never sees the padding) through transformers' forward."""
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
            keys, values = self._cache(i)
            keys[idx, :, :width] = layer.keys
            values[idx, :, :width] = layer.values
        last = torch.tensor([len(p) - 1 for p in prompts], device=dev)
        hidden = out.last_hidden_state[torch.arange(len(prompts), device=dev), last]
        return self.model.lm_head(hidden).float()

    def _where(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Each prompt token's row in a layer's cache viewed as [slots * length, kv_heads, head_dim]."""
        lengths = torch.tensor([len(p) for p in prompts])
        base = torch.repeat_interleave(torch.tensor(slots) * self.length, lengths)
        return (base + torch.cat([torch.arange(n) for n in lengths.tolist()])).to(self.k.device)

    def _prefill_packed(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """All prompts end to end in one row, attention per prompt (capture/packed.py: varlen flash on
        a GPU), each layer's keys and values scattered into the slots: no padding computed or copied."""
        from transformers import DynamicCache

        from nestling.capture.packed import NAME, packed_inputs, register

        register()
        dev = self.k.device
        ids, pos, kw = packed_inputs(prompts)
        kw["nestling_cu"] = kw["nestling_cu"].to(dev)
        cache, cfg = DynamicCache(), self.inner.config
        before, cfg._attn_implementation = cfg._attn_implementation, NAME
        try:
            out = self.inner(
                input_ids=ids.to(dev), position_ids=pos.to(dev), past_key_values=cache, use_cache=True, **kw
            )
        finally:
            cfg._attn_implementation = before
        where, rows = self._where(prompts, slots), self.slots * self.length
        for i, layer in enumerate(cache.layers):  # [1, kv_heads, tokens, d] -> the slots' rows
            k, v = layer.keys, layer.values
            assert k is not None and v is not None  # the forward filled every layer
            self.k[i].view(rows, self.kv_heads, self.head_dim)[where] = k[0].transpose(0, 1)
            self.v[i].view(rows, self.kv_heads, self.head_dim)[where] = v[0].transpose(0, 1)
        last = torch.tensor(kw["nestling_cu_list"][1:], device=dev) - 1
        return self.model.lm_head(out.last_hidden_state[0, last]).float()

    def _slot_kv(self, prompts: list[list[int]], slots: list[int]) -> list[torch.Tensor]:
        """Every layer's keys, then values, at the prompts' positions, [tokens, kv_heads * head_dim]
        each, read through the layout-independent view (so a wrong scatter cannot read itself back)."""
        out = []
        for i in range(len(self.layers)):
            for c in self._cache(i):
                out.append(torch.cat([c[s, :, : len(p)].transpose(0, 1).flatten(1) for p, s in zip(prompts, slots)]))
        return out

    def _packed_error(self, head: list[list[int]], where: list[int], pad: int) -> tuple[float, torch.Tensor]:
        """(how far packed is from padded, the padded logits): every prompt's last logits ([1] * n: the
        worst prompt counts) and each layer's keys and values per prompt; NaN anywhere gives NaN."""
        got = self._prefill_packed(head, where)
        got_kv = self._slot_kv(head, where)
        ref = self._prefill_padded(head, where, pad)
        errs = [disagreement(got, ref, [1] * len(head))]
        errs += [disagreement(g, r, [len(p) for p in head]) for g, r in zip(got_kv, self._slot_kv(head, where))]
        return (float("nan") if any(e != e for e in errs) else max(errs)), ref

    def _check_packed_prefill(self, prompts: list[list[int]], slots: list[int], pad: int) -> torch.Tensor:
        """The first batch's first prompts (up to CHECK_TOKENS) packed, then padded into the same slots:
        every prompt's last logits and every layer's keys and values, per prompt, must agree
        (numerics.disagreement within the packed capture's bar), or prefill stays padded. The padded
        result is what the cache holds and returns; the batch's other prompts take the chosen path."""
        from nestling.capture.packed import TOLERANCE
        from nestling.progress import log

        self.prefill_check_pending = False
        n, total = 1, len(prompts[0])
        while n < len(prompts) and total + len(prompts[n]) <= CHECK_TOKENS:
            total, n = total + len(prompts[n]), n + 1
        head, where = prompts[:n], slots[:n]
        ref: torch.Tensor | None = None
        try:  # the copies it compares are freed with its frame, before a padded retry below
            err, ref = self._packed_error(head, where, pad)
        except Exception as e:  # a transformers version that does not pass the kwargs through, memory
            err, self.packed_why = float("inf"), f"{type(e).__name__}: {str(e)[:200]}"
        if err <= TOLERANCE:  # NaN fails too
            log(f"[regenerate] hf engine: packed prefill (no padding), checked: {err:.1e}")
        else:
            self.packed_why = self.packed_why or f"its logits or keys differ from the padded ones by {err:.3g}"
            log(f"[regenerate] hf engine: packed prefill failed its check ({self.packed_why}); padded batches")
        if ref is None:
            ref = self._prefill_padded(head, where, pad)
        return ref if n == len(prompts) else torch.cat([ref, self.prefill(prompts[n:], slots[n:], pad)])

    def check_flash(self, tokens: torch.Tensor, pos: torch.Tensor, window: int, rows: torch.Tensor) -> float:
        """Auto mode, before the first step: the flash step's logits against the masked matmul's on
        the same cache (a step writes the same keys at the same positions, so running it twice is
        harmless), over the busy `rows`. On a mismatch the cache is relaid for `matmul` and that is
        used from then on. Returns the error (numerics.disagreement of the busy rows' logits)."""
        self.check_pending = False
        try:
            got = self.logits(tokens, pos, window)[rows]
        except Exception as e:  # a torch build without the kernel or its seqused_k argument
            got, self.flash_why = None, f"{type(e).__name__}: {str(e)[:200]}"
        self.reference = True
        ref = self.logits(tokens, pos, window)[rows]
        self.reference = False
        err = float("inf") if got is None else disagreement(got, ref) if len(rows) else 0.0
        if not err <= FLASH_TOLERANCE:  # NaN fails too
            self.flash_why = self.flash_why or f"its logits differ from the matmul's by {err:.3g} (relative)"
            self.k, self.v = _relaid(self.k), _relaid(self.v)
            self.attention = "matmul"
            self.packed_why = self.packed_why or "the cache was relaid for matmul (flash failed its check)"
        return err


def _relaid(cache: torch.Tensor) -> torch.Tensor:
    """[layers, slots, length, kv_heads, d] -> [layers, slots, kv_heads, length, d] in place, one
    layer's copy at a time (a second whole cache might not fit: it takes most of the free memory)."""
    n, slots, length, kv, d = cache.shape
    for i in range(n):
        layer = cache[i].transpose(1, 2).clone(memory_format=torch.contiguous_format)  # always a copy
        cache[i].view(slots, kv, length, d).copy_(layer)
    return cache.view(n, slots, kv, length, d)
