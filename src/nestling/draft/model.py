"""The EAGLE-3 draft, exactly as docs/architecture.md ("The draft, exactly") defines it, with tensor
names equal to the export contract.

    g      = fc(concat(a1, a2, a3))                          (first step only)
    x      = concat(input_layernorm(embed(tok)), hidden_norm(g))   -> attention (q/k/v take 2H)
    r      = g + o_proj(attn(x))
    h_0    = r + mlp(post_attention_layernorm(r))            (layer 0's output, pre-norm)
    r_i    = h_{i-1} + o_proj(attn(input_layernorm(h_{i-1})))  (layers i = 1..N-1: plain pre-norm
    h_i    = r_i + mlp(post_attention_layernorm(r_i))            Llama layers of width H)
    logits = lm_head(norm(h_{N-1}))                          (over the draft vocabulary)

The last layer's pre-norm h feeds the next draft step (vLLM 0.32 `llama_eagle3.py`: `num_hidden_layers`
layers, only layer 0 reads the embedding, the model returns the pre-norm sum). Layer 0 is `midlayer`,
later layers `layers.1` ... `layers.N-1` (the export renames `midlayer` to `layers.0` when N > 1).

Optional norms (off in a DraftConfig that does not name them: older checkpoints; training turns the
two EAGLE-3.1 ones on by default), each a key of the exported config.json that vLLM 0.32 reads
(`llama_eagle3.py`; the names are vLLM's, see NORM_OPTIONS):
    fc_norm               g = fc(concat(fc_norm.0(a1), fc_norm.1(a2), ...))   (one RMSNorm per aux state)
    norm_output           the next step reads norm(h_{N-1}) instead of h_{N-1} (post-norm feedback)
    norm_before_residual  layer 0's residual is hidden_norm(g) instead of g: r = hidden_norm(g) + o_proj(...)
fc_norm and norm_output together are EAGLE-3.1 (docs/train.md, "EAGLE-3.1 norms").

Each layer is split into `qkv` (projections + rotary) and `finish` (o_proj, residuals, MLP) so that
the batched training-time test and the step-by-step KV-cache decoder share every weight-touching
line and differ only in which keys a query may attend to.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nestling.errors import NestlingError


# The optional draft norms, under vLLM 0.32's config.json names (DraftConfig fields of the same name).
NORM_OPTIONS = ("fc_norm", "norm_output", "norm_before_residual")


def without_off_norms(fields: dict, prefix: str = "") -> dict:
    """`fields` less the norm options (named `prefix` + option) that are off: what a run key hashes, so
    that runs and checkpoints from before the options existed keep their key."""
    names = {prefix + k for k in NORM_OPTIONS}
    return {k: v for k, v in fields.items() if not (k in names and not v)}


@dataclass
class DraftConfig:
    """Shapes of the draft (copied from the target) plus its vocabulary and aux layers."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]  # nestling convention (HF hidden_states indices)
    num_target_layers: int
    num_hidden_layers: int = 1  # draft decoder layers (train setting draft_layers)
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    target: str = ""
    target_fingerprint: str = ""
    target_model_type: str = "llama"
    # optional norms (NORM_OPTIONS; the module docstring gives their math); False = plain EAGLE-3
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if int(self.num_hidden_layers) < 1:
            raise NestlingError(
                f"the draft needs at least one decoder layer (draft_layers / num_hidden_layers), "
                f"got {self.num_hidden_layers}"
            )

    @classmethod
    def from_target(cls, hf_config, draft_vocab_size: int, aux_layer_ids: list[int], **kw) -> "DraftConfig":
        cfg = getattr(hf_config, "text_config", None) or hf_config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        # MLA targets (DeepSeek-V3) have no plain head_dim; the draft is a Llama layer regardless.
        if getattr(cfg, "qk_rope_head_dim", None) is not None or head_dim * heads < cfg.hidden_size // 4:
            head_dim = cfg.hidden_size // heads
        rope = full_attention_rope(dict(getattr(cfg, "rope_parameters", None) or {}))
        if not rope:
            rope = {"rope_type": "default", "rope_theta": float(getattr(cfg, "rope_theta", 10000.0))}
        if rope.get("rope_type") not in ("default", "llama3", "linear", "dynamic", "yarn", None):
            rope = {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 10000.0))}
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=list(aux_layer_ids),
            num_target_layers=cfg.num_hidden_layers,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
            # the draft is a Llama layer whatever the target: vLLM's EAGLE-3 Llama layer runs SiLU only
            # ("Unsupported activation" for Gemma's gelu_pytorch_tanh), and no target weight enters its MLP
            hidden_act="silu",
            target_model_type=getattr(cfg, "model_type", "llama"),
            **kw,
        )

    def save(self, path: Path) -> None:
        from nestling.manifest import atomic_write_json

        atomic_write_json(Path(path), asdict(self))

    @classmethod
    def load(cls, path: Path) -> "DraftConfig":
        from nestling.inputs import read_json

        path = Path(path)
        if not path.exists():
            raise NestlingError(f"{path} is missing: not a nestling training folder")
        fields = read_json(path, "draft config", hint="train again into a new --out")
        try:
            return cls(**fields)
        except TypeError as e:  # an unknown or missing key: an edited or foreign file
            raise NestlingError(f"draft config {path} does not describe a draft ({e}); train again") from None

    def trainable_params(self) -> int:
        """Parameters training updates (fc, the decoder layers, norm, lm_head; not the frozen embedding),
        counted from the shapes alone: `nestling plan` sizes a 1T target's draft without building it."""
        H, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd

        def layer(width: int, norms: int) -> int:
            return width * (q + 2 * kv) + q * H + 3 * H * self.intermediate_size + norms * H

        n_aux = len(self.aux_layer_ids)
        return (
            n_aux * H * H
            + (n_aux * H if self.fc_norm else 0)
            + layer(2 * H, 3)
            + (self.num_hidden_layers - 1) * layer(H, 2)
            + H
            + self.draft_vocab_size * H
        )

    def key_fields(self) -> dict:
        """The fields that identify a training run: all of them, less the norm options that are off, so
        that runs (and checkpoints) from before the options existed keep their key."""
        return without_off_norms(asdict(self))

    def llama_config(self):
        """The equivalent transformers LlamaConfig (for rotary init and for export)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=self.num_hidden_layers,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
        )


def full_attention_rope(rope: dict) -> dict:
    """A target's rope parameters as one flat dict. Targets with sliding-window and full attention layers
    (Gemma-3) key them by layer type, each with its own theta; the draft attends over the whole context,
    as the full-attention layers do, so it takes theirs. A flat dict is returned as it is."""
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return dict(rope.get("full_attention") or next(iter(rope.values())))
    return dict(rope)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    """RMSNorm computed the way transformers does: statistics in fp32, then
    - Llama / Qwen / DeepSeek (`plus_one` False): `weight * normed.to(x.dtype)`, the weight as given (an fp32
      master weight under autocast gives an fp32 result, as transformers' LlamaRMSNorm does);
    - Gemma (`plus_one`): `(1 + weight) * normed`, all in fp32, cast back to x's dtype.
    The one implementation: the draft's norms and the vllm capture connector's final norm use it (this
    module imports only torch, so vLLM's worker processes can load it)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (y * (1.0 + weight.float())).to(x.dtype)
    return weight * y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: DraftConfig, width: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One draft decoder layer. The first (`midlayer.*`) reads the embedding and the hidden state, each
    normed, concatenated (2H); later ones (`layers.N.*`) are plain pre-norm Llama layers of width H and
    have no `hidden_norm` (vLLM builds one there but never uses it)."""

    def __init__(self, c: DraftConfig, first: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, 2 * c.hidden_size if first else c.hidden_size)
        self.mlp = MLP(c)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class Eagle3Draft(nn.Module):
    """Draft module; `embed_tokens` is the target's (frozen, never exported)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = c
        n_aux = len(c.aux_layer_ids)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(n_aux * c.hidden_size, c.hidden_size, bias=False)
        if c.fc_norm:  # vLLM's `fc_norm.{i}`: one RMSNorm per aux state, before fc
            self.fc_norm = nn.ModuleList([RMSNorm(c.hidden_size, c.rms_norm_eps) for _ in range(n_aux)])
        self.midlayer = DecoderLayer(c, first=True)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(c, first=False) for i in range(1, c.num_hidden_layers)})
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(c.llama_config())
        # d2t[i] = target_id(i) - i ; t2d[t] = token t is in the draft vocabulary
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    # ---- each layer, in two halves shared by TTT and the KV-cache decoder --------------------------

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def layer(self, i: int) -> DecoderLayer:
        return self.midlayer if i == 0 else self.layers[str(i)]

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n_aux*H] target states -> g [..., H], the first step's hidden input (vLLM's
        `combine_hidden_states`: with fc_norm each aux state is normed on its own before fc)."""
        if self.config.fc_norm:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def next_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads from this one's pre-norm h: h itself, or with norm_output the
        normed h that lm_head reads too (vLLM's `aux_output`)."""
        return self.norm(h) if self.config.norm_output else h

    def qkv(self, i: int, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor):
        """Layer i: [B,T] ids, [B,T,H] input, [B,T] positions -> q [B,nh,T,D], k, v [B,nkv,T,D] (rotated).

        Layer 0's input is fc(aux) or the previous step's h, and it reads the token embedding; a later
        layer's input is the previous layer's output, and it ignores `input_ids`."""
        layer = self.layer(i)
        if i == 0:
            emb = self.embed_tokens(input_ids).to(hidden.dtype)
            x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        else:
            x = layer.input_layernorm(hidden)
        a = layer.self_attn
        B, T, _ = x.shape
        q = a.q_proj(x).view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, position_ids)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """SDPA with an explicit boolean mask (True = may attend), GQA by repeating k/v."""
        rep = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), attn_mask=mask)
        B, _, T, _ = out.shape
        return out.transpose(1, 2).reshape(B, T, -1)

    def finish(self, i: int, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Layer i: o_proj + residual from the layer's input (layer 0 with norm_before_residual: from
        hidden_norm of it), then MLP + residual: returns pre-norm h."""
        layer = self.layer(i)
        if i == 0 and self.config.norm_before_residual:
            hidden = layer.hidden_norm(hidden)
        r = hidden + layer.self_attn.o_proj(attn)
        return r + layer.mlp(layer.post_attention_layernorm(r))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    # ---- step-by-step decoding with a KV cache (the engine's way) --------------------------------

    def step(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, cache: "KVCache | SlotCache"
    ) -> torch.Tensor:
        """One draft forward over new tokens, attending to the cache plus causally to themselves.

        Returns the last layer's pre-norm h [B,T,H]; every layer's cache grows by T. `hidden` is
        combine(aux) for target features or next_hidden(previous step's h) for the draft's own chain.
        """
        for i in range(self.num_layers):
            q, k, v = self.qkv(i, input_ids, hidden, position_ids)
            k_all, v_all, mask = cache.update(i, k, v, position_ids)
            hidden = self.finish(i, self.attend(q, k_all, v_all, mask), hidden)
        return hidden

    # ---- weights -----------------------------------------------------------------------------------

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under the export contract's names (no embedding, no rotary buffers)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "rotary."))}

    def load_export_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.load_state_dict(tensors, strict=False)
        missing = [m for m in missing if not m.startswith(("embed_tokens.", "rotary."))]
        if missing or unexpected:
            raise NestlingError(f"draft weights do not match the model: missing {missing}, unexpected {unexpected}")

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


class KVCache:
    """Keys and values of every layer, grown along the sequence axis; `truncate` drops rejected
    draft entries from all layers at once."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return 0 if 0 not in self.k else self.k[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.k:
            k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def truncate(self, length: int) -> None:
        for i in self.k:
            self.k[i], self.v[i] = self.k[i][:, :, :length], self.v[i][:, :, :length]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append; the new tokens attend to the whole cache and causally to themselves -> k, v, mask."""
        k_all, v_all = self.append(layer, k, v)
        T, S = k.shape[2], k_all.shape[2]
        return k_all, v_all, torch.ones(T, S, dtype=torch.bool, device=k.device).tril(S - T)


class SlotCache:
    """Keys and values in fixed slots, one per position and row (a batch of prompts of their own
    lengths): a token at position p writes slot p of its row and attends to slots <= p. Nothing is
    ever dropped: an entry of a rejected draft lies above the row's verified prefix, so no later
    query reads it before a token at that position overwrites it (vLLM's way with its KV slots)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, H, T, D = k.shape
        if layer not in self.k:
            self.k[layer] = k.new_zeros(B, H, self.capacity, D)
            self.v[layer] = v.new_zeros(B, H, self.capacity, D)
        idx = position_ids[:, None, :, None].expand(B, H, T, D)
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)
        slots = torch.arange(self.capacity, device=k.device)
        mask = slots[None, None, None, :] <= position_ids[:, None, :, None]  # [B, 1, T, S]
        return self.k[layer], self.v[layer], mask

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (finished prompts leave the batch)."""
        for i in self.k:
            self.k[i], self.v[i] = self.k[i][rows], self.v[i][rows]
