"""The transformers backend: hooks on the decoder layers of the base model, no LM head.

Why hooks rather than `output_hidden_states`: we keep only the requested ids (not L+1 tensors
per batch), gather the real (unpadded) tokens straight into one packed buffer, and can stop the
forward after the last needed layer. Right padding with an attention mask keeps every sample's
states equal to a batch-of-one forward: causal attention never looks right, so padding is invisible.
On a GPU, targets whose attention allows it run packed instead (no padding at all: packed.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from nestling.capture.backend import Backend
from nestling.capture.settings import CaptureSettings
from nestling.errors import NestlingError
from nestling.progress import log


class _Stop(Exception):
    """Raised from a hook once the last needed state is captured: the remaining layers never run."""


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack without the LM head (LlamaModel inside LlamaForCausalLM, etc.)."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers"):
        base = model.get_decoder() if hasattr(model, "get_decoder") else None
    if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise NestlingError(f"the hf backend cannot find decoder layers and a final norm in {type(model).__name__}")
    return base


class HFBackend(Backend):
    """`packed`: None = where packable (CUDA, bf16/fp16, a plain-attention family: packed.py), checked
    once against the padded forward; True = packed wherever the architecture allows (CPU tests);
    False = padded batches always."""

    def __init__(
        self, target: Path, layer_ids: list[int], settings: CaptureSettings, model=None, packed: bool | None = None
    ):
        from nestling.capture.settings import compute_dtype, resolve
        from nestling.targets.load import load_model

        settings = resolve(settings)
        self.layer_ids = list(layer_ids)
        dtype = compute_dtype(settings)  # float8 is a storage format: the target runs at full width
        self.dtype = getattr(torch, dtype)
        if model is None:
            device = settings.device if not settings.device_map else "cpu"
            model = load_model(
                target,
                dtype=dtype,
                device=device,
                device_map=settings.device_map,
                tp_size=settings.tensor_parallel_size,
            )
        self.model = model
        self.base = base_model(model)
        self.hidden_size = int(self.base.config.hidden_size)
        self.n_layers = len(self.base.layers)
        self.device = self.base.get_input_embeddings().weight.device
        self._out: torch.Tensor | None = None
        self._idx: torch.Tensor | None = None
        self._handles = []
        self._init_packing(packed)
        for j, lid in enumerate(self.layer_ids):
            stop = lid == self.layer_ids[-1] and lid < self.n_layers
            if lid < self.n_layers:  # id k = input of decoder layer k
                h = self.base.layers[lid].register_forward_pre_hook(self._pre_hook(j, stop), with_kwargs=True)
            else:  # id L = output of the final norm
                h = self.base.norm.register_forward_hook(self._post_hook(j))
            self._handles.append(h)

    def _init_packing(self, packed: bool | None) -> None:
        from nestling.capture import packed as pk

        why = "turned off" if packed is False else pk.packable(self.base.config, self.dtype, self.device, bool(packed))
        self.packed, self.packed_why = why is None, why
        self.packed_check_pending = packed is None  # auto: the first packed batch is compared with a padded one
        if self.packed:
            pk.register()
        elif packed is None and self.device.type == "cuda":
            log(f"[capture] hf backend: padded batches, not packed ({why})")

    def _store(self, j: int, hidden: torch.Tensor) -> None:
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self._idx is not None:  # padded: keep the real tokens; packed: every token is real
            flat = flat.index_select(0, self._idx.to(flat.device))
        self._out[:, j] = flat.to(self._out.device)

    def _pre_hook(self, j: int, stop: bool):
        def hook(module, args, kwargs):
            self._store(j, args[0] if args else kwargs["hidden_states"])
            if stop:
                raise _Stop

        return hook

    def _post_hook(self, j: int):
        def hook(module, args, output):
            self._store(j, output[0] if isinstance(output, tuple) else output)

        return hook

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        """Through pinned memory without waiting: a blocking copy would stall the host until the GPU
        finished all queued work (online training queues the draft's step right before)."""
        if self.device.type != "cuda":
            return x.to(self.device)
        return x.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def capture(self, seqs: list[list[int]]) -> torch.Tensor:
        if min(len(s) for s in seqs) < 1:
            raise NestlingError("cannot capture an empty sample")
        if not self.packed:
            return self._padded(seqs)
        if not self.packed_check_pending:
            return self._packed(seqs)
        # auto mode, first batch: the packed states must agree with the padded path's (packed.py's
        # TOLERANCE: bf16 drift passes, a packing bug does not), or this target stays padded, with
        # the reason logged
        from nestling.capture import packed as pk
        from nestling.numerics import disagreement

        self.packed_check_pending = False
        try:
            got = self._packed(seqs)
        except Exception as e:  # e.g. a transformers version that does not pass the kwargs through
            got, self.packed_why = None, f"{type(e).__name__}: {str(e)[:200]}"
        ref = self._padded(seqs)
        err = float("inf") if got is None else disagreement(got, ref, [len(s) for s in seqs])
        if got is not None and err < pk.TOLERANCE:  # NaN fails too
            log(f"[capture] hf backend: packed batches (no padding; varlen flash attention), checked: {err:.1e}")
            return got
        self.packed, self.packed_why = False, self.packed_why or f"packed states differ from padded ones by {err:.3g}"
        log(f"[capture] hf backend: packed batches failed their check ({self.packed_why}); padded batches")
        return ref

    def _packed(self, seqs: list[list[int]]) -> torch.Tensor:
        """One row of all samples end to end, positions restarting per sample, attention per sample."""
        from nestling.capture.packed import NAME, packed_inputs

        ids, pos, kw = packed_inputs(seqs)
        kw["nestling_cu"] = self.to_device(kw["nestling_cu"])
        self._idx = None
        self._out = torch.empty(
            ids.shape[1], len(self.layer_ids), self.hidden_size, dtype=self.dtype, device=self.device
        )
        cfg = self.base.config
        before, cfg._attn_implementation = cfg._attn_implementation, NAME
        try:
            self.base(input_ids=self.to_device(ids), position_ids=self.to_device(pos), use_cache=False, **kw)
        except _Stop:
            pass
        finally:
            cfg._attn_implementation = before
        out, self._out = self._out, None
        return out

    def _padded(self, seqs: list[list[int]]) -> torch.Tensor:
        lengths = [len(s) for s in seqs]
        B, T = len(seqs), max(lengths)
        ids = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        ids, idx, dev_mask = (self.to_device(x) for x in (ids, mask.flatten().nonzero().squeeze(1), mask))
        self._idx = idx
        self._out = torch.empty(
            sum(lengths), len(self.layer_ids), self.hidden_size, dtype=self.dtype, device=self.device
        )
        attn = None if min(lengths) == T else dev_mask
        try:
            self.base(input_ids=ids, attention_mask=attn, use_cache=False)
        except _Stop:
            pass
        out, self._out, self._idx = self._out, None, None
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.model = self.base = None
