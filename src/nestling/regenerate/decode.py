"""The fast decode loop: B slots over a static KV cache, continuous refill, host sync every N steps.

Every slot holds one request at its own position. A decode step (the model over all slots, the
token choice, the end-of-answer check, all on the device) runs `sync_every` times in a row with no
host work; on CUDA each step is a replayed CUDA graph (one per attention window), so a step costs
GPU time, not Python time. Then the host reads which slots finished, collects their tokens and
prefills waiting requests into the free slots, so long answers never hold a batch. On a CPU, or
where graph capture fails, the same loop runs eagerly (logged once, with the reason).

A request's output depends only on its prompt, its limit and its seed: greedy decoding equals
`generate(do_sample=False)` (same model, same math), and sampling is seeded per request
(`sampling.py`), so slot assignment and refill order never change a result.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nestling.progress import log
from nestling.regenerate.sampling import pick_tokens
from nestling.regenerate.static_model import StaticModel

WINDOW_STEP = 256  # attention windows are multiples of this (one CUDA graph each)
LOG_EVERY_S = 60.0  # a long call (a turn of a big chunk) says how far it is


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    seed: int


Follow = Callable[[list[tuple[int, list[int]]]], list["Job"]]  # finished (job index, tokens) -> jobs to add


@dataclass
class Stats:
    """Where a decoder's time went (host wall clock; each phase ends at a host sync, so GPU time is
    counted in the phase that queued it): how a benchmark tells prefill from steps from host work."""

    prefill_s: float = 0.0
    step_s: float = 0.0
    host_s: float = 0.0
    prefills: int = 0
    rounds: int = 0
    steps: int = 0
    tokens: int = 0

    def as_dict(self, slots: int) -> dict:
        busy = self.tokens / max(1, self.steps * slots)  # share of slot-steps that wrote a token
        return {
            "prefill_s": round(self.prefill_s, 3),
            "step_s": round(self.step_s, 3),
            "host_s": round(self.host_s, 3),
            "prefills": self.prefills,
            "rounds": self.rounds,
            "steps": self.steps,
            "tokens": self.tokens,
            "slot_use": round(busy, 4),
            "ms_per_step": round(1e3 * self.step_s / max(1, self.steps), 3),
        }


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


def window_for(need: int, length: int) -> int:
    """The attention window covering positions < need: a multiple of WINDOW_STEP, at most length.
    A step reads the keys and values of the whole window, so it is kept tight."""
    return min(-(-need // WINDOW_STEP) * WINDOW_STEP, length)


def cache_length(need: int) -> int:
    """A cache length of at least `need`: a power of two times WINDOW_STEP, so that calls with
    similar needs reuse one cache (and its CUDA graphs)."""
    w = WINDOW_STEP
    while w < need:
        w *= 2
    return w


class Slots:
    """The on-device state of B slots: last token, position, tokens written, limit, seed, live flag."""

    def __init__(self, b: int, max_new: int, device):
        z = dict(dtype=torch.long, device=device)
        self.tok, self.pos, self.count = torch.zeros(b, **z), torch.zeros(b, **z), torch.zeros(b, **z)
        self.limit, self.seed = torch.ones(b, **z), torch.zeros(b, **z)
        self.live = torch.zeros(b, dtype=torch.bool, device=device)
        self.out = torch.zeros(b, max_new, **z)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.tok, self.pos, self.count, self.live)]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip((self.tok, self.pos, self.count, self.live), saved):
            t.copy_(s)


class Decoder:
    """Greedy or seeded decoding of many requests through a fixed set of slots."""

    def __init__(
        self,
        model,
        eos: list[int],
        pad: int,
        sampling: Sampling,
        slots: int,
        length: int,
        max_new: int,
        sync_every: int,
        graphs: bool,
        stats: Stats | None = None,
        attention: str = "matmul",
    ):
        self.sm = StaticModel(model, slots, length, attention)
        dev = self.sm.k.device
        self.state = Slots(slots, max_new, dev)
        self.eos = torch.tensor(eos or [-1], device=dev)
        self.pad, self.sampling, self.sync_every = pad, sampling, sync_every
        self.use_graphs = graphs and dev.type == "cuda"
        if self.use_graphs:
            torch.cuda.set_device(dev)  # streams and graphs belong to the current device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.stats = stats or Stats()  # an engine passes one Stats to all its decoders

    # ---- on the device -------------------------------------------------------------------------
    def _finished(self, tok: torch.Tensor, count: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        return (tok[:, None] == self.eos[None, :]).any(-1) | (count >= limit)

    def _step(self, window: int) -> None:
        s, sp = self.state, self.sampling
        logits = self.sm.logits(s.tok, s.pos, window, s.live)
        nxt = pick_tokens(logits, s.seed, s.count, sp.temperature, sp.top_p, sp.top_k)
        nxt = torch.where(s.live, nxt, s.tok)
        col = s.count.clamp(max=s.out.shape[1] - 1)
        s.out[self.sm.rows, col] = torch.where(s.live, nxt, s.out[self.sm.rows, col])
        count = s.count + s.live.long()
        s.live.copy_(s.live & ~self._finished(nxt, count, s.limit))
        s.pos.copy_(torch.where(s.count < count, s.pos + 1, s.pos).clamp(max=self.sm.length - 1))
        s.count.copy_(count)
        s.tok.copy_(nxt)

    def _graph(self, window: int):
        """The CUDA graph of one step at this window, captured on first use (state restored after warm-up)."""
        g = self.graphs.get(window)
        if g is None:
            saved = self.state.snapshot()
            side, main = torch.cuda.Stream(), torch.cuda.current_stream()
            self.pool = self.pool or torch.cuda.graph_pool_handle()  # one pool: graphs replay one at a time
            g = torch.cuda.CUDAGraph()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self._step(window)  # warm-up outside the graph (lazy inits, workspace allocation)
                self.state.restore(saved)
                # capture_begin/end rather than torch.cuda.graph(), which collects garbage and empties
                # the allocator cache on every capture (slow with a large run's objects alive)
                g.capture_begin(pool=self.pool)
                try:
                    self._step(window)
                finally:
                    g.capture_end()
                self.state.restore(saved)  # capture does not run kernels, but be exact
            main.wait_stream(side)
            self.graphs[window] = g
        return g

    def _check(self, window: int) -> None:
        """Auto attention's first step: flash against the masked matmul (static_model.check_flash)."""
        s = self.state
        err = self.sm.check_flash(s.tok, s.pos, window, s.live.nonzero().squeeze(1))
        if self.sm.flash:
            log(f"[regenerate] hf engine: flash decode attention (each slot reads its own keys), checked: {err:.1e}")
        else:
            log(f"[regenerate] hf engine: flash decode attention failed its check ({self.sm.flash_why}); matmul")

    def _steps(self, window: int) -> None:
        if self.sm.check_pending:
            self._check(window)
        if self.use_graphs:
            try:
                g = self._graph(window)
            except Exception as e:  # capture can fail on some builds/models: keep going eagerly
                log(
                    f"[regenerate] hf engine: CUDA graph capture failed ({type(e).__name__}: {str(e)[:200]}); "
                    "decoding eagerly (same loop, slower)"
                )
                self.use_graphs, self.graphs = False, {}
            else:
                for _ in range(self.sync_every):
                    g.replay()
                return
        for _ in range(self.sync_every):
            self._step(window)

    # ---- on the host ---------------------------------------------------------------------------
    def _fill(self, jobs: list[Job], slots: list[int], prefill_tokens: int) -> None:
        """Prefill `jobs` into `slots` (in batches of at most `prefill_tokens` padded tokens)."""
        s, sp = self.state, self.sampling
        start = 0
        while start < len(jobs):
            end, width = start + 1, len(jobs[start].prompt)
            while end < len(jobs) and (end + 1 - start) * max(width, len(jobs[end].prompt)) <= prefill_tokens:
                width = max(width, len(jobs[end].prompt))
                end += 1
            part, where = jobs[start:end], slots[start:end]
            logits = self.sm.prefill([j.prompt for j in part], where, self.pad)
            self.stats.prefills += 1
            idx = torch.tensor(where, device=logits.device)
            seeds = torch.tensor([j.seed for j in part], device=logits.device)
            limit = torch.tensor([j.max_tokens for j in part], device=logits.device)
            first = pick_tokens(logits, seeds, torch.zeros_like(seeds), sp.temperature, sp.top_p, sp.top_k)
            one = torch.ones_like(seeds)
            s.tok[idx], s.count[idx], s.limit[idx], s.seed[idx] = first, one, limit, seeds
            s.pos[idx] = torch.tensor([len(j.prompt) for j in part], device=logits.device)
            s.out[idx, 0] = first
            s.live[idx] = ~self._finished(first, one, limit)
            start = end

    def run(self, jobs: list[Job], prefill_tokens: int) -> list[list[int]]:
        """Generated tokens of every job (the end-of-answer token included when it came)."""
        results: list[list[int] | None] = [None] * len(jobs)

        def keep(done: list[tuple[int, list[int]]]) -> list[Job]:
            for i, tokens in done:
                results[i] = tokens
            return []

        self.stream(jobs, prefill_tokens, keep)
        return results  # type: ignore[return-value]

    def stream(self, jobs: list[Job], prefill_tokens: int, follow: Follow) -> None:
        """Decode `jobs`; each round, hand the finished ones to `follow` as (job index, tokens) and
        queue the jobs it returns (indexed after all earlier ones). A conversation's next turn thus
        starts as soon as its answer is known, instead of waiting for every other conversation's turn."""
        s, st = self.state, self.stats
        jobs = list(jobs)
        waiting = deque(sorted(range(len(jobs)), key=lambda i: len(jobs[i].prompt)))  # similar lengths together
        owner: dict[int, int] = {}  # slot -> job index
        free = list(range(self.sm.slots))
        start = last_log = time.monotonic()
        tokens = answers = 0
        while waiting or owner:
            t0 = time.monotonic()
            if waiting and free:
                take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                where = [free.pop() for _ in take]
                self._fill([jobs[i] for i in take], where, prefill_tokens)
                owner.update(zip(where, take))
            live, pos = s.live.tolist(), s.pos.tolist()  # the one host sync per round
            t1 = time.monotonic()
            st.prefill_s += t1 - t0
            busy = [b for b in owner if live[b]]
            if busy:
                self._steps(window_for(max(pos[b] for b in busy) + self.sync_every + 1, self.sm.length))
                live, count = s.live.tolist(), s.count.tolist()
                st.rounds += 1
                st.steps += self.sync_every
            else:
                count = s.count.tolist()
            t2 = time.monotonic()
            st.step_s += t2 - t1
            done = [b for b in owner if not live[b]]
            if done:
                rows = s.out[torch.tensor(done, device=s.out.device)].tolist()
                finished = []
                for b, row in zip(done, rows):
                    finished.append((owner.pop(b), row[: count[b]]))
                    tokens += count[b]
                    free.append(b)
                answers += len(finished)
                for job in follow(finished):
                    waiting.append(len(jobs))
                    jobs.append(job)
            st.host_s += time.monotonic() - t2
            if time.monotonic() - last_log > LOG_EVERY_S:
                last_log = time.monotonic()
                log(
                    f"[regenerate] hf engine: {answers} answers, {len(waiting)} waiting, "
                    f"{tokens / (last_log - start):.0f} tok/s ({len(owner)} in {self.sm.slots} slots)"
                )
        st.tokens += tokens
