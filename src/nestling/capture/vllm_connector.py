"""nestling's KV connector for vLLM: writes each prompt's hidden states straight into a shard file.

vLLM loads this module in its worker processes through `kv_transfer_config.kv_connector_module_path`
(see `nestling.capture.vllm`). With the speculative method `extract_hidden_states`, vLLM's drafter
stores the aux states of every computed token in a cache-only "KV cache" layer whose heads are the
layer ids and whose head size is the hidden size. We read that cache at the request's slots and write
the rows into the shard file at the byte offset the main process chose for the sample.

Why this shape:
- The main process (the capture runner) owns the shard file: it creates it under a temporary name
  with header, `input_ids` and `loss_mask`, and renames it when every sample in it is written. The
  worker only fills byte ranges with `pwrite`, so there are no per-request files and no lock files,
  and a crash loses at most the shard in flight (its temporary file is never renamed).
- The write happens in `wait_for_save`, which vLLM calls once per step *after* the target and draft
  forwards, with the step's metadata still bound, and before the step's output goes back to the
  scheduler. So when the main process sees a request finish, its rows are already in the file (page
  cache) and no block has to outlive its request (`request_finished` never delays freeing).
- Only tensor-parallel rank 0 writes (every rank holds the same replicated hidden-state cache).
- The final id arrives as the last layer's output before the final norm (vLLM's convention); when
  the main process passes the norm weight, we apply it here so the shard holds HF `hidden_states[L]`.
- Id 0 (the embeddings) is one vLLM's deepseek_v2 backbone cannot return; for such targets the main
  process leaves it out of the engine's ids and passes the embedding tensor's file (`embed`), and the
  rows of id 0 are the embedding rows of the request's tokens, looked up here.

Only vLLM's connector base class and its documented hooks are used; nothing from the scheduler,
request or worker classes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from nestling.draft.model import rms_norm
from nestling.vllm_compat import hidden_cache_is_token_major, hidden_cache_view, layer_cache_spec

# Keys of `SamplingParams.extra_args["kv_transfer_params"]` that address one sample's rows.
PATH, OFFSET, SAMPLE = "nestling_path", "nestling_offset", "nestling_sample"


@dataclass
class Save:
    """One finished prefill: read `num_tokens` slots of `block_ids`, write them at `offset` in `path`."""

    req_id: str
    sample_id: str
    path: str
    offset: int
    num_tokens: int
    block_ids: list[int]
    token_ids: list[int] | None = None  # only where the connector writes id 0 from the embedding


@dataclass
class NestlingConnectorMetadata(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)


def apply_final_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
    """The target's final RMSNorm on rows in the model's dtype, from its fp32 weight (it travels as JSON):
    Llama / Qwen / DeepSeek scale by the weight in the rows' dtype, as the loaded model holds it; Gemma
    scales by 1 + weight in fp32."""
    return rms_norm(x, weight.float() if plus_one else weight.to(x.dtype), eps, plus_one)


class NestlingHiddenStatesConnector(KVConnectorBase_V1):
    """Store-only connector: hidden states of finished prefills -> byte ranges of nestling shards."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._group = self._hidden_state_group(kv_cache_config)
        self._out_dtype = getattr(torch, extra.get("dtype", "bfloat16"))
        norm = extra.get("final_norm")
        self._norm = None
        if norm is not None:
            self._norm = (
                torch.tensor(norm["weight"], dtype=torch.float32),
                float(norm["eps"]),
                bool(norm.get("plus_one", False)),
            )
        self._embed_source = extra.get("embed")
        self._embed: torch.Tensor | None = None
        self._pending: list[Save] = []
        self._cache: torch.Tensor | None = None
        self._writer = True
        self._fds: dict[str, int] = {}

    @staticmethod
    def _hidden_state_group(kv_cache_config: Any) -> int:
        """Index of the KV cache group that holds the cache-only hidden-state layer."""
        if kv_cache_config is None:
            return 0
        groups = kv_cache_config.kv_cache_groups
        hits = [g for g, grp in enumerate(groups) if type(grp.kv_cache_spec).__name__ == "HiddenStateCacheSpec"]
        if len(hits) == 1:
            return hits[0]
        if not hits and len(groups) == 1:
            return 0
        raise RuntimeError(f"nestling connector: cannot find the one hidden-state cache group among {len(groups)}")

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # store-only: nothing is ever loaded

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """A request is new and fully prefilled in the same step: the backend turns chunked prefill and
        prefix caching off, so each prompt is computed whole, from token 0, in the step it is scheduled."""
        meta = NestlingConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            params = (req.sampling_params.extra_args or {}).get("kv_transfer_params") if req.sampling_params else None
            if not params or PATH not in params:
                continue  # a request not sent by nestling (e.g. vLLM's warm-up): nothing to store
            n = len(req.prompt_token_ids or [])
            done = req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req.req_id, 0)
            if req.num_computed_tokens != 0 or done < n:
                raise RuntimeError(
                    f"nestling connector: sample {params.get(SAMPLE)} was not prefilled in one step "
                    f"(computed {req.num_computed_tokens}, scheduled up to {done} of {n}); chunked prefill and "
                    f"prefix caching must be off"
                )
            meta.saves.append(
                Save(
                    req.req_id,
                    str(params.get(SAMPLE)),
                    params[PATH],
                    int(params[OFFSET]),
                    n,
                    list(req.block_ids[self._group]),
                    list(req.prompt_token_ids) if self._embed_source else None,
                )
            )
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None  # rows were written in the step that computed them; free blocks now

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._writer = get_tensor_model_parallel_rank() == 0
        names = [n for n in kv_caches if "cache_only_layers" in n]
        if len(names) != 1:
            raise RuntimeError(
                f"nestling connector: expected one hidden-state cache layer, found {names}; "
                "is the speculative method extract_hidden_states?"
            )
        cache = kv_caches[names[0]]
        if self._kv_cache_config is None:  # no spec to read: the heads-major layout of vLLM 0.29 on
            self._cache = cache
            return
        spec = layer_cache_spec(self._kv_cache_config, self._group, names[0])
        self._cache = hidden_cache_view(cache, spec.num_kv_heads, spec.block_size, hidden_cache_is_token_major())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # the drafter has not cached this step's states yet; we read them in wait_for_save

    def wait_for_save(self) -> None:
        """Runs after the target and draft forwards of the step: the rows are in the cache now."""
        if not self._writer or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, NestlingConnectorMetadata) or not meta.saves:
            return
        assert self._cache is not None
        bs = self._cache.shape[2]
        for s in meta.saves:
            blocks = torch.tensor(s.block_ids, dtype=torch.long)
            slots = (blocks[:, None] * bs + torch.arange(bs)[None, :]).flatten()[: s.num_tokens]
            slots = slots.to(self._cache.device)
            rows = self._cache[slots // bs, :, slots % bs]  # [T, n_ids, hidden]
            if self._embed_source is not None:
                rows = torch.cat([self._embedding_rows(s.token_ids or []).to(rows)[:, None], rows], 1)
            if self._norm is not None:
                w, eps, plus_one = self._norm
                rows = rows.clone()
                rows[:, -1] = apply_final_norm(rows[:, -1], w.to(rows.device), eps, plus_one)
            data = rows.to(self._out_dtype).cpu().contiguous().view(torch.uint8).numpy()
            self._pwrite(s.path, s.offset, memoryview(data).cast("B"))

    def _embedding_rows(self, token_ids: list[int]) -> torch.Tensor:
        """The embedding output of `token_ids` ([T, hidden]): rows of the checkpoint's embedding tensor,
        in the engine's dtype (what vLLM's embedding layer returns), read once on first use."""
        if self._embed is None:
            from safetensors import safe_open

            assert self._cache is not None and self._embed_source is not None  # wait_for_save checks both
            src = self._embed_source
            with safe_open(src["file"], "pt") as f:
                self._embed = f.get_tensor(src["name"]).to(self._cache.dtype)
        return self._embed[torch.tensor(token_ids, dtype=torch.long)]

    def _pwrite(self, path: str, offset: int, data: memoryview) -> None:
        fd = self._fds.get(path)
        if fd is None:
            for old in list(self._fds):  # the runner fills one shard at a time; keep few fds open
                os.close(self._fds.pop(old))
            fd = self._fds[path] = os.open(path, os.O_WRONLY)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)

    def shutdown(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
