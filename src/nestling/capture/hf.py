"""The transformers backend: hooks on the decoder layers of the base model, no LM head.

Why hooks rather than `output_hidden_states`: we keep only the requested ids (not L+1 tensors
per batch), gather the real (unpadded) tokens straight into one packed buffer, and can stop the
forward after the last needed layer. Right padding with an attention mask keeps every sample's
states equal to a batch-of-one forward: causal attention never looks right, so padding is invisible.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nestling.capture.backend import Backend
from nestling.capture.settings import CaptureSettings
from nestling.errors import NestlingError


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
    def __init__(self, target: Path, layer_ids: list[int], settings: CaptureSettings, model=None):
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
        for j, lid in enumerate(self.layer_ids):
            stop = lid == self.layer_ids[-1] and lid < self.n_layers
            if lid < self.n_layers:  # id k = input of decoder layer k
                h = self.base.layers[lid].register_forward_pre_hook(self._pre_hook(j, stop), with_kwargs=True)
            else:  # id L = output of the final norm
                h = self.base.norm.register_forward_hook(self._post_hook(j))
            self._handles.append(h)

    def _store(self, j: int, hidden: torch.Tensor) -> None:
        flat = hidden.reshape(-1, hidden.shape[-1])
        self._out[:, j] = flat.index_select(0, self._idx.to(flat.device)).to(self._out.device)

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
        lengths = [len(s) for s in seqs]
        if min(lengths) < 1:
            raise NestlingError("cannot capture an empty sample")
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
