"""A reference speculative decoder in plain PyTorch: chain drafting, greedy or rejection-sampling
verification. Its output is the target's own output (token-identical for greedy, the same
distribution for sampling); it counts acceptance the way vLLM does.

Draft inputs follow vLLM's drafting loop (v1/spec_decode/llm_base_proposer.py): over the verified
prefix, index t gets (token_{t+1}, combine(aux_t)) at position t; each further chain step advances
the position by one and feeds back the draft's own hidden state (pre-norm; normed with norm_output).
After verification the draft's cache keeps only entries computed from target features; the accepted
tokens are then fed again with their target features (vLLM overwrites the same KV slots).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from nestling.draft.model import Eagle3Draft, KVCache
from nestling.errors import NestlingError


@dataclass
class SpecStats:
    """Counters with vLLM's meaning (num_drafts, num_draft_tokens, num_accepted_tokens[_per_pos])."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    new_tokens: int = 0
    target_forwards: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.k

    def add(self, other: "SpecStats") -> None:
        for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "new_tokens", "target_forwards", "seconds"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos)]

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def per_position(self) -> list[float]:
        return [a / max(self.num_drafts, 1) for a in self.accepted_per_pos]


class TargetRunner:
    """The target through transformers with its KV cache, returning logits and the aux states."""

    def __init__(self, model, aux_layer_ids: list[int]):
        from transformers import DynamicCache

        n_layers = model.config.get_text_config().num_hidden_layers
        bad = [i for i in aux_layer_ids if not 0 <= i < n_layers]
        if bad:
            raise NestlingError(
                f"aux layer ids {bad} do not fit a target with {n_layers} layers (valid: 0..{n_layers - 1})"
            )
        self.model, self.ids = model, list(aux_layer_ids)
        self.cache = DynamicCache(config=model.config)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def __len__(self) -> int:
        return self.cache.get_seq_length()

    @torch.no_grad()
    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `tokens`; -> logits [T, V] (fp32) and aux [T, n_aux*H] (HF hidden_states at the ids)."""
        dev = self.model.device
        start = len(self)
        ids = torch.tensor([tokens], device=dev)
        pos = torch.arange(start, start + len(tokens), device=dev)[None]
        out = self.model(
            input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True, output_hidden_states=True
        )
        self.cache = out.past_key_values
        aux = torch.cat([out.hidden_states[i][0] for i in self.ids], dim=-1)
        return out.logits[0].float(), aux

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (transformers 5: a negative crop removes that many)."""
        extra = len(self) - length
        if extra > 0:
            self.cache.crop(-extra)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: list[int], gen: torch.Generator) -> tuple[int, int]:
    """Standard rejection sampling. p [K+1, V] target probs, q [K, V] draft probs (zero off the
    draft vocab), drafts K target ids -> (accepted count m, next token). Exact: the output token
    at each position is distributed as p."""
    for j, d in enumerate(drafts):
        accept = torch.rand((), generator=gen, device=p.device) * q[j, d] <= p[j, d]  # u < p/q, no division
        if not accept:
            resid = torch.clamp(p[j] - q[j], min=0)
            total = resid.sum()
            resid = p[j] if total <= 0 else resid / total
            return j, int(torch.multinomial(resid, 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


class SpecDecoder:
    """Chain drafting of K tokens per target forward; temperature 0 = greedy."""

    def __init__(
        self,
        target_model,
        draft: Eagle3Draft,
        k: int = 3,
        temperature: float = 0.0,
        eos_token_ids: list[int] | None = None,
        aux_layer_ids: list[int] | None = None,
    ):
        self.target = TargetRunner(target_model, aux_layer_ids or draft.config.aux_layer_ids)
        self.draft, self.k, self.temperature = draft, k, temperature
        self.eos = set(eos_token_ids or [])
        self.draft_targets = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))
        self.vocab = target_model.config.get_text_config().vocab_size

    def _pick(self, logits: torch.Tensor, gen: torch.Generator | None) -> int:
        if self.temperature <= 0:
            return int(logits.argmax())
        return int(torch.multinomial(_probs(logits, self.temperature), 1, generator=gen))

    def _draft_feed(self, tokens: list[int], aux: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        """Target features of `len(tokens)` positions from `start`: (token_{t+1}, combine(aux_t)) -> last h."""
        d = self.draft
        dev = d.d2t.device
        dtype = d.fc.weight.dtype
        ids = torch.tensor([tokens], device=dev)
        pos = torch.arange(start, start + len(tokens), device=dev)[None]
        h = d.step(ids, d.combine(aux.to(dev, dtype)[None]), pos, cache)
        return h[:, -1:]

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, seed: int = 0) -> tuple[list[int], SpecStats]:
        gen = None
        if self.temperature > 0:
            gen = torch.Generator(device=self.target.model.device)
            gen.manual_seed(seed)
        stats = SpecStats(self.k)
        t0 = time.perf_counter()
        self.target.reset()
        logits, aux = self.target.forward(prompt)
        stats.target_forwards += 1
        x = self._pick(logits[-1], gen)
        out = [x]
        dcache = KVCache()
        h = self._draft_feed(list(prompt[1:]) + [x], aux, 0, dcache)
        while len(out) < max_new_tokens and x not in self.eos:
            n = len(self.target)  # positions with target features (= position of x)
            # all K even when fewer tokens remain: vLLM 0.32 does (its counters show K per draft to the
            # last step), and counts what it accepts there; the surplus is cut from the output only
            k = self.k
            drafts, qs = [], []
            hid, pos = h, n - 1
            for j in range(k):
                lg = self.draft.logits(hid)[0, -1].float()
                if self.temperature <= 0:
                    di = int(lg.argmax())
                else:
                    qd = _probs(lg, self.temperature)
                    di = int(torch.multinomial(qd, 1, generator=gen))
                    q = torch.zeros(self.vocab, device=qd.device)
                    q[self.draft_targets] = qd
                    qs.append(q)
                t = int(self.draft_targets[di])
                drafts.append(t)
                if j < k - 1:
                    pos += 1
                    ids = torch.tensor([[t]], device=hid.device)
                    hid = self.draft.step(
                        ids, self.draft.next_hidden(hid), torch.tensor([[pos]], device=hid.device), dcache
                    )
            logits, aux = self.target.forward([x] + drafts)
            stats.target_forwards += 1
            if self.temperature <= 0:
                m = 0
                while m < k and int(logits[m].argmax()) == drafts[m]:
                    m += 1
                y = int(logits[m].argmax())
            else:
                m, y = verify_sampled(_probs(logits, self.temperature), torch.stack(qs), drafts, gen)
            stats.num_drafts += 1
            stats.num_draft_tokens += k
            stats.num_accepted_tokens += m
            for j in range(m):
                stats.accepted_per_pos[j] += 1
            new = drafts[:m] + [y]
            self.target.crop(n + m + 1)  # keep x and the accepted drafts
            dcache.truncate(n)
            h = self._draft_feed(new, aux[: m + 1], n, dcache)
            for t in new:
                out.append(t)
                if t in self.eos or len(out) >= max_new_tokens:
                    break
            x = out[-1]
        stats.new_tokens = len(out)
        stats.seconds = time.perf_counter() - t0
        return out, stats


@torch.no_grad()
def target_generate(
    target_model,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: list[int] | None = None,
    seed: int = 0,
) -> tuple[list[int], float]:
    """The target decoding alone, one token per forward (the baseline and the ground truth)."""
    runner = TargetRunner(target_model, [0])
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=target_model.device)
        gen.manual_seed(seed)
    eos = set(eos_token_ids or [])
    t0 = time.perf_counter()
    logits, _ = runner.forward(prompt)
    out: list[int] = []
    while True:
        lg = logits[-1]
        t = int(lg.argmax()) if temperature <= 0 else int(torch.multinomial(_probs(lg, temperature), 1, generator=gen))
        out.append(t)
        if t in eos or len(out) >= max_new_tokens:
            break
        logits, _ = runner.forward([t])
    return out, time.perf_counter() - t0


def load_draft(draft_dir, target_model, dtype: torch.dtype = torch.float32) -> Eagle3Draft:
    """The exported draft as an Eagle3Draft, with the target's (frozen) embedding."""
    from nestling.export.contract import nestling_tensors, read_draft_folder

    _, cfg, tensors = read_draft_folder(draft_dir)
    tensors = nestling_tensors(tensors, cfg)  # layer names; a full-vocabulary folder has no d2t / t2d: identity
    draft = Eagle3Draft(cfg)
    draft.load_export_state_dict({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()})
    emb = target_model.get_input_embeddings().weight
    if tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise NestlingError(
            f"the target's embedding is {tuple(emb.shape)}, the draft expects "
            f"({cfg.vocab_size}, {cfg.hidden_size}): this draft is for another target"
        )
    draft.embed_tokens.weight.data.copy_(emb.detach().to(dtype).cpu())
    return draft.to(device=target_model.device, dtype=dtype).eval()
