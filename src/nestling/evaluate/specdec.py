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

from collections.abc import Callable

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nestling.draft.model import Eagle3Draft, SlotCache
from nestling.errors import NestlingError
from nestling.evaluate.settings import DRAFT_SAMPLE_METHODS


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


class BatchTarget:
    """The target through transformers over a batch of prompts, with its KV cache and a key mask.

    Prompts are left-padded, so every row's last prompt token is the last column. Each later forward
    appends the same number of columns to every row; `keep` then marks which of them stay part of the
    row's sequence (a rejected draft's column stays in the cache as a masked hole: rows accept different
    counts, and the cache is one tensor). Positions are each row's own, so a hole shifts nothing.
    A target with sliding-window layers (Gemma-3, gpt-oss, Mistral) measures its window in columns, which
    holes would shrink, and its cache would drop columns still inside the window: for such a target the
    cache keeps every column and the masks are built here, by position (`_masks`).
    The aux states are the inputs of the aux layers (HF `hidden_states[i]`), caught by forward hooks."""

    def __init__(self, model, aux_layer_ids: list[int]):
        from nestling.capture.hf import base_model

        layers = base_model(model).layers
        bad = [i for i in aux_layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise NestlingError(
                f"aux layer ids {bad} do not fit a target with {len(layers)} layers (valid: 0..{len(layers) - 1})"
            )
        self.model, self.ids = model, list(aux_layer_ids)
        self.layers: Any = layers
        self.device = model.device
        self.cache: Any = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # each column's position
        self.window, self.per_type = sliding_window(model.config)

    @torch.no_grad()
    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, logits_to_keep: int = 0, aux: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers import DynamicCache

        if self.cache is None:  # a sliding window's cache drops columns: every layer keeps them all here
            self.cache = DynamicCache() if self.window else DynamicCache(config=self.model.config)
        self.positions = torch.cat([self.positions, pos], dim=1)
        got: dict[int, torch.Tensor] = {}
        hooks = [
            self.layers[i].register_forward_pre_hook(
                lambda _m, args, kwargs, i=i: got.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
                with_kwargs=True,
            )
            for i in (self.ids if aux else [])
        ]
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=self._masks(pos) if self.window else self.mask,
                position_ids=pos,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        finally:
            for h in hooks:
                h.remove()
        self.cache = out.past_key_values
        states = torch.cat([got[i] for i in self.ids], dim=-1) if aux else None
        return out.logits.float(), states

    def prefill(self, prompts: list[list[int]], aux: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-padded prompts -> logits of each last prompt token [B, V] and aux [B, P, n_aux*H]."""
        P = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), P, dtype=torch.long)
        pos = torch.zeros(len(prompts), P, dtype=torch.long)
        mask = torch.zeros(len(prompts), P, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, P - len(p) :] = torch.tensor(p)
            pos[b, P - len(p) :] = torch.arange(len(p))
            mask[b, P - len(p) :] = 1
        self.cache, self.mask = None, mask.to(self.device)
        self.positions = pos[:, :0].to(self.device)
        logits, states = self._forward(ids.to(self.device), pos.to(self.device), 1, aux)
        return logits[:, -1], states

    def step(self, ids: torch.Tensor, pos: torch.Tensor, aux: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append T columns per row (ids, positions [B, T]) -> logits [B, T, V] (fp32), aux [B, T, n_aux*H]."""
        self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=1)
        return self._forward(ids, pos, 0, aux)

    def keep(self, valid: torch.Tensor) -> None:
        """Which of the last T columns stay in each row's sequence ([B, T] bool)."""
        T = valid.shape[1]
        self.mask[:, -T:] = valid.to(self.mask.dtype)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the batch."""
        self.cache.batch_select_indices(rows)
        self.mask, self.positions = self.mask[rows], self.positions[rows]

    def _masks(self, pos: torch.Tensor) -> Any:
        """The queries' ([B, T] positions) 4-D masks over every column, by position: causal over the
        row's kept columns, and within the window for sliding layers; a query that sees no column (a
        padding row) sees them all instead, as transformers does, so no NaN enters the cache."""
        assert self.window is not None
        q, k = pos[:, None, :, None], self.positions[:, None, None, :]
        full = self.mask.bool()[:, None, None, :] & (k <= q)
        sliding = full & (k > q - self.window)
        full, sliding = (m | ~m.any(-1, keepdim=True) for m in (full, sliding))
        return {"full_attention": full, "sliding_attention": sliding} if self.per_type else sliding


def sliding_window(config: Any) -> tuple[int | None, bool]:
    """(the window, whether the masks go per layer type), or (None, False) for a target without one.
    Per type where `layer_types` names sliding layers (Gemma-3, gpt-oss; such models take a dict of
    masks); a `sliding_window` without layer types (Mistral) slides every layer."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return None, False
    if types is not None:
        return (window, True) if "sliding_attention" in types else (None, False)
    return window, False


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


@dataclass
class _Rows:
    """Per-prompt state of a batched decode, all on the device (no host read per token)."""

    out: torch.Tensor  # [B, max_new + K + 2] tokens generated (the last column takes discarded writes)
    length: torch.Tensor  # [B] tokens in `out`
    done: torch.Tensor  # [B] bool: ended (EOS or budget)
    counts: torch.Tensor  # [B, 5 + K]: drafts, draft tokens, accepted, target forwards, rounds, per position

    @classmethod
    def start(cls, first: torch.Tensor, max_new: int, k: int, eos: torch.Tensor) -> "_Rows":
        B = first.shape[0]
        out = torch.zeros(B, max_new + k + 2, dtype=torch.long, device=first.device)
        out[:, 0] = first
        counts = torch.zeros(B, 5 + k, dtype=torch.long, device=first.device)
        counts[:, 3] = 1  # the prefill
        done = torch.isin(first, eos) | (max_new <= 1)
        return cls(out, torch.ones(B, dtype=torch.long, device=first.device), done, counts)

    def emit(self, cand: torch.Tensor, n_new: torch.Tensor, active: torch.Tensor, eos: torch.Tensor, max_new: int):
        """Append each active row's first `n_new` of `cand` [B, T], stopping after an EOS or at the budget."""
        T = cand.shape[1]
        j = torch.arange(T, device=cand.device)[None]
        is_eos = torch.isin(cand, eos) & (j < n_new[:, None])
        first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), T)
        take = torch.minimum(torch.minimum(n_new, first_eos + 1), max_new - self.length) * active
        dump = self.out.shape[1] - 1
        idx = torch.where(j < take[:, None], self.length[:, None] + j, dump)
        self.out.scatter_(1, idx, cand)
        self.length += take
        self.done |= active & ((self.length >= max_new) | (first_eos < take))

    def select(self, rows: torch.Tensor) -> None:
        for f in ("out", "length", "done", "counts"):
            setattr(self, f, getattr(self, f)[rows])


class SpecDecoder:
    """Chain drafting of K tokens per target forward over a batch of prompts; temperature 0 = greedy.

    At temperature > 0 the draft proposes as vLLM's `draft_sample_method` says: "greedy" (vLLM's
    default) drafts its argmax and verification treats q as one-hot there (accept with p(d)),
    "probabilistic" samples the draft at the same temperature and accepts with min(1, p/q). Both keep
    the target's distribution; they differ in how much they accept.

    Greedy runs on the device from the first forward to the end of the batch: drafting, verification
    and bookkeeping are tensor operations, and the host reads one flag per round (is every prompt
    done?). Sampling draws each prompt's tokens from its own generator, in the order the one-prompt
    decoder does, so a prompt's output does not depend on the batch it runs in."""

    def __init__(
        self,
        target_model,
        draft: Eagle3Draft,
        k: int = 3,
        temperature: float = 0.0,
        eos_token_ids: list[int] | None = None,
        aux_layer_ids: list[int] | None = None,
        draft_sample_method: str = "greedy",
    ):
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, got {draft_sample_method!r}")
        self.draft_sample_method = draft_sample_method
        self.target_model, self.aux_ids = target_model, aux_layer_ids or draft.config.aux_layer_ids
        BatchTarget(target_model, self.aux_ids)  # fail early on layer ids the target lacks
        self.draft, self.k, self.temperature = draft, k, temperature
        self.eos = list(eos_token_ids or [])
        self.draft_targets = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))
        self.vocab = target_model.config.get_text_config().vocab_size

    def _pick(self, logits: torch.Tensor, gens: list[torch.Generator] | None) -> torch.Tensor:
        """[B, V] -> [B] tokens: argmax, or one draw per row from its own generator."""
        if gens is None:
            return logits.argmax(-1)
        probs = _probs(logits, self.temperature)
        return torch.stack([torch.multinomial(probs[b], 1, generator=g)[0] for b, g in enumerate(gens)])

    def _chain(self, h: torch.Tensor, n: torch.Tensor, cache: SlotCache, gens) -> tuple[torch.Tensor, list]:
        """K draft tokens per row from h (the draft's state at position n - 1) -> target ids [B, K] and,
        when sampling, each step's draft probabilities over the target vocabulary [B, V]."""
        drafts, qs = [], []
        hid, pos = h, n - 1
        probabilistic = gens is not None and self.draft_sample_method == "probabilistic"
        for j in range(self.k):
            lg = self.draft.logits(hid)[:, -1].float()
            di = self._pick(lg, gens if probabilistic else None)
            t = self.draft_targets.to(di.device)[di]
            if gens is not None:  # q over the target vocabulary: the draft's law, or one-hot at its argmax
                q = torch.zeros(lg.shape[0], self.vocab, device=lg.device)
                if probabilistic:
                    q[:, self.draft_targets.to(lg.device)] = _probs(lg, self.temperature)
                else:
                    q.scatter_(1, t[:, None], 1.0)
                qs.append(q)
            drafts.append(t)
            if j < self.k - 1:
                pos = pos + 1
                hid = self.draft.step(t[:, None], self.draft.next_hidden(hid), pos[:, None], cache)
        return torch.stack(drafts, 1), qs

    def _verify(self, logits: torch.Tensor, drafts: torch.Tensor, qs: list, gens, active: torch.Tensor):
        """-> accepted count m [B] and the target's token after them y [B]."""
        if gens is None:
            pred = logits.argmax(-1)  # [B, K+1]
            m = (pred[:, : self.k] == drafts).long().cumprod(1).sum(1)
            return m, pred.gather(1, m[:, None])[:, 0]
        p, q = _probs(logits, self.temperature), torch.stack(qs, 1)
        ms, ys = [], []
        for b, g in enumerate(gens):
            mb, yb = verify_sampled(p[b], q[b], drafts[b].tolist(), g) if active[b] else (0, 0)
            ms.append(mb)
            ys.append(yb)
        return torch.tensor(ms, device=logits.device), torch.tensor(ys, device=logits.device)

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, seed: int = 0) -> tuple[list[int], SpecStats]:
        outs, stats, seconds = self.generate_batch([prompt], max_new_tokens, [seed])
        stats[0].seconds = seconds
        return outs[0], stats[0]

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        seeds: list[int] | None = None,
        on_progress: Callable[[int], None] | None = None,
        progress_every_s: float = 5.0,
    ) -> tuple[list[list[int]], list[SpecStats], float]:
        """Decode every prompt at once -> outputs, each prompt's counters, wall seconds of the batch.
        `on_progress(spent)`, at most every `progress_every_s` (one extra host read then): the token
        budget spent so far, a finished prompt counting its whole `max_new_tokens`, so that a rate over
        it gives a true ETA for the batch."""
        t0 = last_report = time.perf_counter()
        K, dev = self.k, self.target_model.device
        gens = None
        if self.temperature > 0:
            gens = [torch.Generator(device=dev).manual_seed(s) for s in (seeds or [0] * len(prompts))]
        eos = torch.tensor(self.eos, dtype=torch.long, device=dev)
        target = BatchTarget(self.target_model, self.aux_ids)
        last, states = target.prefill(prompts)
        assert states is not None
        aux: torch.Tensor = states
        x = self._pick(last, gens)
        rows = _Rows.start(x, max_new_tokens, K, eos)
        ids = torch.arange(len(prompts), device=dev)  # which prompt each row is
        results: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        P = aux.shape[1]
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        cache = SlotCache(P + max_new_tokens + 2 * K + 2)
        # the draft reads (token t+1, aux t) at position t: the prompt shifted by one, then x
        col = torch.arange(P, device=dev)[None]
        pad = P - lengths[:, None]
        pos = torch.where(col >= pad, col - pad, lengths[:, None] + col)  # pads write slots above the prompt
        toks = torch.cat([torch.zeros(len(prompts), P - 1, dtype=torch.long, device=dev), x[:, None]], 1)
        for b, p in enumerate(prompts):
            toks[b, P - len(p) : P - 1] = torch.tensor(p[1:], dtype=torch.long)
        h = self._feed(toks, aux, pos, cache)
        n = lengths.clone()  # positions with target features = the position of x
        cols = torch.arange(K + 1, device=dev)[None]
        while True:
            n_done = int(rows.done.sum())  # the one host read of a round
            if n_done == len(ids):
                break
            if on_progress is not None and time.perf_counter() - last_report >= progress_every_s:
                last_report = time.perf_counter()
                live = int(rows.length[~rows.done].sum())
                on_progress(max_new_tokens * (len(results) + n_done) + live)
            if 2 * n_done >= len(ids):  # half the rows idle: the finished ones leave the batch
                keep = (~rows.done).nonzero()[:, 0]
                for r in rows.done.nonzero()[:, 0].tolist():
                    results[int(ids[r])] = (rows.out[r], rows.length[r], rows.counts[r])
                ids, x, n, h = ids[keep], x[keep], n[keep], h[keep]
                gens = None if gens is None else [gens[r] for r in keep.tolist()]
                rows.select(keep)
                target.select(keep)
                cache.select(keep)
            active = ~rows.done
            drafts, qs = self._chain(h, n, cache, gens)
            logits, states = target.step(torch.cat([x[:, None], drafts], 1), n[:, None] + cols)
            assert states is not None
            aux = states
            m, y = self._verify(logits, drafts, qs, gens, active)
            m = m * active
            target.keep((cols <= m[:, None]) & active[:, None])
            cand = torch.where(cols < m[:, None], torch.cat([drafts, drafts[:, :1]], 1), y[:, None])
            a = active.long()
            rows.counts[:, :5] += torch.stack([a, K * a, m, a, a], 1)
            rows.counts[:, 5:] += (cols[:, :K] < m[:, None]).long() * a[:, None]
            rows.emit(cand, m + 1, active, eos, max_new_tokens)
            x = torch.where(active, y, x)
            # the accepted tokens again, with their target features, right-aligned so that the last
            # column is each row's newest state; the columns left of a row's tokens write slots above
            shift = (K - m)[:, None]
            j = cols - shift
            jj = j.clamp(min=0)
            fpos = torch.where(j >= 0, n[:, None] + j, n[:, None] + m[:, None] + 1 + cols)
            h = self._feed(cand.gather(1, jj), aux.gather(1, jj[..., None].expand(-1, -1, aux.shape[-1])), fpos, cache)
            n = n + (m + 1) * a
        for r in range(len(ids)):
            results[int(ids[r])] = (rows.out[r], rows.length[r], rows.counts[r])
        outs, stats = [], []
        for b in range(len(prompts)):
            out, length, counts = results[b]
            c = counts.tolist()
            outs.append(out[: int(length)].tolist())
            st = SpecStats(K, c[0], c[1], c[2], c[5:], int(length), c[3])
            stats.append(st)
        return outs, stats, time.perf_counter() - t0

    def _feed(self, tokens: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """Target features into the draft: (token_{t+1}, combine(aux_t)) at position t -> the last column's h."""
        d = self.draft
        dev = d.d2t.device
        h = d.step(tokens.to(dev), d.combine(aux.to(dev, d.fc.weight.dtype)), pos.to(dev), cache)
        return h[:, -1:]


@torch.no_grad()
def target_generate_batch(
    target_model,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: list[int] | None = None,
    seeds: list[int] | None = None,
) -> tuple[list[list[int]], float]:
    """The target decoding alone, one token per forward, every prompt at once (the baseline and the
    ground truth) -> outputs and wall seconds. Sampling draws each prompt from its own generator."""
    t0 = time.perf_counter()
    dev = target_model.device
    gens = None
    if temperature > 0:
        gens = [torch.Generator(device=dev).manual_seed(s) for s in (seeds or [0] * len(prompts))]
    eos = torch.tensor(list(eos_token_ids or []), dtype=torch.long, device=dev)
    target = BatchTarget(target_model, [])
    last, _ = target.prefill(prompts, aux=False)

    def pick(lg: torch.Tensor) -> torch.Tensor:
        if gens is None:
            return lg.argmax(-1)
        probs = _probs(lg, temperature)
        return torch.stack([torch.multinomial(probs[b], 1, generator=g)[0] for b, g in enumerate(gens)])

    x = pick(last)
    rows = _Rows.start(x, max_new_tokens, 0, eos)
    n = torch.tensor([len(p) for p in prompts], device=dev)
    one = torch.ones(len(prompts), dtype=torch.long, device=dev)
    while not bool(rows.done.all()):
        active = ~rows.done
        logits, _ = target.step(x[:, None], n[:, None], aux=False)
        target.keep(active[:, None])
        x = torch.where(active, pick(logits[:, -1]), x)
        rows.emit(x[:, None], one, active, eos, max_new_tokens)
        n = n + active.long()
    outs = [rows.out[b, : int(rows.length[b])].tolist() for b in range(len(prompts))]
    return outs, time.perf_counter() - t0


def target_generate(
    target_model,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: list[int] | None = None,
    seed: int = 0,
) -> tuple[list[int], float]:
    """One prompt through `target_generate_batch`."""
    outs, seconds = target_generate_batch(target_model, [prompt], max_new_tokens, temperature, eos_token_ids, [seed])
    return outs[0], seconds


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
