"""The transformers engine (no vLLM, no server): a fast static-cache decode loop, or `generate`.

Fast path (`hf_fast`, default): `decode.Decoder`, B slots over a static KV cache with continuous
refill and CUDA-graph steps on a GPU; greedy output equals `generate(do_sample=False)`, sampling is
seeded per request (repeatable, independent of batching). Models it cannot run (not Llama-family)
use the old path, with a log line: `generate` on left-padded, length-sorted batches, where sampled
output is seeded per batch and so depends on batching.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nestling.devices import resolve_device
from nestling.progress import log
from nestling.regenerate.decode import WINDOW_STEP, Decoder, Job, Sampling, Stats, cache_length
from nestling.regenerate.engine import Completion, Follow, Request, waves
from nestling.regenerate.settings import RegenerateSettings
from nestling.regenerate.static_model import resolve_attention


def plan_batches(prompt_lens: list[int], max_new: list[int], max_size: int, max_tokens: int) -> list[list[int]]:
    """Request indices grouped into batches, shortest prompts first (results go back in request order).

    A batch holds at most `max_size` requests and at most `max_tokens` padded tokens: requests x
    (longest prompt + most new tokens). Left padding makes every row as long as the longest prompt,
    and the prefill's attention costs rows x width^2, so long prompts go in small batches instead of
    dragging a fixed-size batch through a quadratic prefill over padding. A request longer than the
    budget still runs, alone."""
    order = sorted(range(len(prompt_lens)), key=lambda i: prompt_lens[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    width = new = 0
    for i in order:
        w, n = max(width, prompt_lens[i]), max(new, max_new[i])
        if cur and (len(cur) >= max(1, max_size) or (len(cur) + 1) * (w + n) > max_tokens):
            batches.append(cur)
            cur, w, n = [], prompt_lens[i], max_new[i]
        cur.append(i)
        width, new = w, n
    if cur:
        batches.append(cur)
    return batches


CPU_BATCH, CPU_BATCH_TOKENS, GPU_BATCH = 8, 262144, 1024


def kv_bytes_per_token(config, element_size: int) -> int:
    """Bytes of KV cache one token costs the target (keys and values of every layer)."""
    cfg = getattr(config, "text_config", None) or config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * element_size


def batch_limits(s: RegenerateSettings, on_cuda: bool, kv_bytes: int, free_bytes: int) -> tuple[int, int]:
    """(requests, padded tokens) per batch: the settings, or where they are 0, sized for the device.

    A decode step of `generate` costs about the same for 8 rows or 1,024 on a GPU (it is bound by
    Python and kernel launches: docs/regenerate.md), so on CUDA batches are as large as a third of
    the free memory allows, counting the KV cache twice (transformers' cache grows by copying)."""
    size = s.hf_batch_size or (GPU_BATCH if on_cuda else CPU_BATCH)
    tokens = s.hf_batch_tokens or (max(4096, free_bytes // 3 // (2 * kv_bytes)) if on_cuda else CPU_BATCH_TOKENS)
    return size, tokens


FAST_CACHE_SHARE = 0.55  # of the free GPU memory (after the weights) for the fast path's KV cache


def fast_limits(s: RegenerateSettings, on_cuda: bool, kv_bytes: int, free_bytes: int) -> tuple[int, int]:
    """(slots, KV-cache tokens = slots x cache length) of the fast path: the settings, or for the device.

    On CUDA the cache takes FAST_CACHE_SHARE of the free memory (it is allocated once, not grown by
    copying), leaving room for the graphs' logits and the prefill."""
    size = s.hf_batch_size or (GPU_BATCH if on_cuda else CPU_BATCH)
    tokens = s.hf_batch_tokens or (
        max(4096, int(free_bytes * FAST_CACHE_SHARE) // kv_bytes) if on_cuda else CPU_BATCH_TOKENS
    )
    return size, tokens


def short_length(slots: int, cache_tokens: int) -> int:
    """The longest cache length (a power of two times WINDOW_STEP) that `slots` slots fit in `cache_tokens`."""
    return max(WINDOW_STEP, cache_length(max(1, cache_tokens // max(1, slots)) + 1) // 2)


def slot_count(requests: int, slots: int, cache_tokens: int, length: int) -> int:
    """Slots for `requests` at this cache length: a power of two (so calls reuse a decoder and its CUDA
    graphs), at most `slots` and what `cache_tokens` hold, at least one."""
    return max(1, min(1 << (requests - 1).bit_length(), slots, cache_tokens // length))


def fast_groups(needs: list[int], slots: int, cache_tokens: int) -> list[tuple[list[int], int, int]]:
    """Requests split into at most two runs, (indices, slots, cache length) each: those that fit the
    cache at full slot count, then the longer ones with fewer slots (the cache is slots x length).
    Slots and lengths are powers of two, so successive calls (turns) mostly reuse one decoder and
    its CUDA graphs instead of capturing new ones.

    When one cache at the longest need gives every request a slot at once, they run as one group:
    a run lasts as long as its slowest answer, so two runs one after the other cost two of those.
    That is the tail of a multi-turn regeneration (a few hundred conversations, long histories)."""
    whole = cache_length(max(needs, default=1))
    together = slot_count(len(needs), slots, cache_tokens, whole)
    if together >= len(needs):
        return [(list(range(len(needs))), together, whole)] if needs else []
    short_len = short_length(slots, cache_tokens)
    parts = [[i for i, n in enumerate(needs) if n <= short_len], [i for i, n in enumerate(needs) if n > short_len]]
    out = []
    for idx in parts:
        if idx:
            length = cache_length(max(needs[i] for i in idx))
            out.append((idx, slot_count(len(idx), slots, cache_tokens, length), length))
    return out


class HFEngine:
    name = "hf"

    def __init__(self, target: Path, s: RegenerateSettings):
        import torch
        from transformers import AutoTokenizer

        from nestling.regenerate.static_model import unsupported_reason
        from nestling.targets.load import load_model

        self.s = s = dataclasses.replace(s, device=resolve_device(s.device))
        dtype = "float32" if s.dtype == "auto" and s.device == "cpu" else ("bfloat16" if s.dtype == "auto" else s.dtype)
        if s.device == "cpu" and torch.cuda.is_available():
            log("[regenerate] hf engine: running on the CPU although torch sees a GPU (device cpu was asked for)")
        self.model = load_model(target, dtype=dtype, device=s.device)
        self.tok = AutoTokenizer.from_pretrained(target)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.tok.eos_token_id is not None and self.tok.eos_token_id not in eos:
            eos.append(self.tok.eos_token_id)
        self.eos = eos
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos[0]
        self.max_model_len = getattr(self.model.config, "max_position_embeddings", None)
        self.torch = torch
        self.on_cuda = str(s.device).startswith("cuda")
        free = torch.cuda.mem_get_info(self.model.device)[0] if self.on_cuda else 0
        kv = kv_bytes_per_token(self.model.config, next(self.model.parameters()).element_size())
        self.batch_size, self.batch_tokens = batch_limits(s, self.on_cuda, kv, free)
        self.slots, self.cache_tokens = fast_limits(s, self.on_cuda, kv, free)
        self.decoder: Decoder | None = None
        self.stats = Stats()  # summed over decoders, logged at close
        self.graphs = self.on_cuda
        self.fast = s.hf_fast
        why = unsupported_reason(self.model) if self.fast else None
        if why:
            log(
                f"[regenerate] hf engine: the fast decode loop cannot run this target ({why}); "
                "using transformers generate (slower)"
            )
            self.fast = False
        elif self.fast:
            p = next(self.model.parameters())
            attention, not_flash = resolve_attention(s.hf_attention, p.dtype, p.device)
            log(
                f"[regenerate] hf engine: fast decode loop, up to {self.slots} slots, "
                f"{self.cache_tokens} KV-cache tokens, "
                + ("CUDA graphs" if self.graphs else "eager steps (CUDA graphs need a GPU)")
                + f", {attention} attention"
                + (f" (not flash: {not_flash})" if not_flash else "")
            )

    def _decoder(self, slots: int, length: int) -> Decoder:
        """The decoder for this shape (kept between calls so its CUDA graphs are reused)."""
        d = self.decoder
        if d is None or (d.sm.slots, d.sm.length) != (slots, length):
            self.decoder = d = None
            if self.on_cuda:
                self.torch.cuda.empty_cache()
            d = Decoder(
                self.model,
                self.eos,
                self.pad,
                Sampling(self.s.temperature, self.s.top_p, self.s.top_k),
                slots,
                length,
                self.s.max_new_tokens,
                16 if self.on_cuda else 4,
                self.graphs,
                self.stats,
                self.s.hf_attention,
            )
            self.decoder = d
        self.graphs = d.use_graphs  # a failed capture is not retried
        return d

    def _fast(self, reqs: list[Request]) -> list[Completion]:
        out: list[Completion | None] = [None] * len(reqs)
        needs = [len(r.prompt_ids) + r.max_tokens for r in reqs]
        prefill_tokens = 65536 if self.on_cuda else 8192
        for idx, slots, length in fast_groups(needs, self.slots, self.cache_tokens):
            jobs = [Job(reqs[i].prompt_ids, reqs[i].max_tokens, reqs[i].seed) for i in idx]
            with self.torch.inference_mode():
                gens = self._decoder(slots, length).run(jobs, prefill_tokens)
            for i, gen in zip(idx, gens):
                out[i] = self._completion(gen, reqs[i].max_tokens)
        return out  # type: ignore[return-value]

    def stream(self, first: list[tuple[int, Request]], follow: Follow) -> None:
        """Run a chain of requests (conversations' turns): a request that `follow` returns joins the
        running slots at once. Phases of growing cache length: all that fit the full slot count
        first; what outgrows it is parked and runs after, with a longer cache and fewer slots.
        Off by default (`hf_stream`): on ShareGPT it was slower than turn-by-turn waves (docs/regenerate.md)."""
        if not (self.fast and self.s.hf_stream):
            waves(self, first, follow)
            return
        open_keys = {k for k, _ in first}
        pending, length = list(first), short_length(self.slots, self.cache_tokens)
        try:
            while pending:
                need = max(len(r.prompt_ids) + r.max_tokens for _, r in pending)
                if all(len(r.prompt_ids) + r.max_tokens > length for _, r in pending):
                    length = cache_length(need)  # only long ones left: a longer cache, fewer slots
                    log(
                        f"[regenerate] hf engine: {len(pending)} requests need up to {need} tokens; "
                        f"running them with a {length}-token cache"
                    )
                pending = self._phase(pending, length, follow, open_keys)
        except Exception as e:  # e.g. out of memory: fail what is still open, not the run
            self.decoder = None
            failed = [(k, Completion(error="engine_error", detail=f"{type(e).__name__}: {e}"[:500])) for k in open_keys]
            open_keys.clear()
            follow(failed)

    def _phase(
        self, reqs: list[tuple[int, Request]], length: int, follow: Follow, open_keys: set[int]
    ) -> list[tuple[int, Request]]:
        """Stream the requests that fit `length` (and their follow-ups that fit); return the parked rest."""
        parked: list[tuple[int, Request]] = []
        keys: list[int] = []
        limits: list[int] = []

        def admit(batch: list[tuple[int, Request]]) -> list[Job]:
            jobs = []
            for k, r in batch:
                open_keys.add(k)
                if len(r.prompt_ids) + r.max_tokens > length:
                    parked.append((k, r))
                    continue
                keys.append(k)
                limits.append(r.max_tokens)
                jobs.append(Job(r.prompt_ids, r.max_tokens, r.seed))
            return jobs

        def on_done(done: list[tuple[int, list[int]]]) -> list[Job]:
            for i, _ in done:
                open_keys.discard(keys[i])
            return admit(follow([(keys[i], self._completion(gen, limits[i])) for i, gen in done]))

        jobs = admit(reqs)
        slots = slot_count(len(jobs), self.slots, self.cache_tokens, length)
        with self.torch.inference_mode():
            self._decoder(slots, length).stream(jobs, 65536 if self.on_cuda else 8192, on_done)
        return parked

    def _completion(self, gen: list[int], max_tokens: int) -> Completion:
        gen = gen[:max_tokens]
        stop = next((j for j, t in enumerate(gen) if t in self.eos), None)
        tokens = gen[: stop + 1] if stop is not None else gen
        text_ids = gen[:stop] if stop is not None else gen
        return Completion(
            text=self.tok.decode(text_ids, skip_special_tokens=True),
            token_ids=tokens,
            num_tokens=len(tokens),
            finish_reason="stop" if stop is not None else "length",
        )

    def _batch(self, reqs: list[Request]) -> list[Completion]:
        """The old path: one left-padded `generate` call."""
        torch = self.torch
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        sampled = self.s.temperature > 0
        kw = dict(
            do_sample=sampled,
            max_new_tokens=max(r.max_tokens for r in reqs),
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        if sampled:
            torch.manual_seed(reqs[0].seed)
            kw.update(temperature=self.s.temperature, top_p=self.s.top_p, top_k=self.s.top_k or None)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.s.device), attention_mask=mask.to(self.s.device), **kw)
        return [self._completion(out[i, width:].tolist(), r.max_tokens) for i, r in enumerate(reqs)]

    def generate(self, requests: list[Request]) -> list[Completion]:
        if not requests:
            return []
        if self.fast:
            try:
                return self._fast(requests)
            except Exception as e:  # e.g. out of memory: fail these requests, not the run
                self.decoder = None
                return [Completion(error="engine_error", detail=f"{type(e).__name__}: {e}"[:500]) for _ in requests]
        out: list[Completion | None] = [None] * len(requests)
        for idx in plan_batches(
            [len(r.prompt_ids) for r in requests], [r.max_tokens for r in requests], self.batch_size, self.batch_tokens
        ):
            try:
                comps = self._batch([requests[i] for i in idx])
            except Exception as e:  # e.g. out of memory: fail these requests, not the run
                comps = [Completion(error="engine_error", detail=f"{type(e).__name__}: {e}"[:500]) for _ in idx]
            for i, c in zip(idx, comps):
                out[i] = c
        return out  # type: ignore[return-value]

    def close(self) -> None:
        st = self.stats
        if st.steps:
            d = st.as_dict(self.slots)
            log(
                f"[regenerate] hf engine: {st.tokens} tokens; prefill {d['prefill_s']:.1f} s ({st.prefills} batches), "
                f"decode steps {d['step_s']:.1f} s ({st.steps} steps, {d['ms_per_step']:.2f} ms each), "
                f"host {d['host_s']:.1f} s"
            )
        self.decoder = None
        del self.model
