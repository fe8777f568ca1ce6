"""Gemma-3's vLLM text model, with the aux hidden states an EAGLE-3 draft reads (imports vLLM: only
vLLM loads this module, through nestling's plugin, export/vllm_plugin.py).

Layer id L is the residual stream entering layer L (0: the scaled embeddings, the last id: the stream
before the final norm), as in vLLM's Llama and nestling's capture. Everything else is vLLM's own class.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from typing import Any

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.models import gemma3
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3, supports_eagle3
from vllm.sequence import IntermediateTensors


class Gemma3Model(gemma3.Gemma3Model, EagleModelMixin):
    """vLLM's Gemma-3 model; with aux layers set (by the EAGLE-3 proposer), forward returns
    (hidden states, [the stream at each aux layer]). Pipeline parallelism beside a draft stays refused by
    vLLM (`supports_aux_hidden_states_over_pp` is left False): the aux states do not cross stages here."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        pp = get_pp_group()
        residual: torch.Tensor | None = None
        if pp.is_first_rank and inputs_embeds is not None:
            hidden = inputs_embeds
        elif pp.is_first_rank:
            assert input_ids is not None
            hidden = self.embed_input_ids(input_ids)
        else:
            assert intermediate_tensors is not None
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        aux: list[torch.Tensor] = []
        if pp.is_first_rank:
            self._maybe_add_hidden_state(aux, self.start_layer, hidden, residual)
        for i, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
            hidden, residual = layer(positions, hidden, residual, **kwargs)
            self._maybe_add_hidden_state(aux, i + 1, hidden, residual)
        assert residual is not None  # every stage runs at least one layer
        if not pp.is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm(hidden, residual)
        return (hidden, aux) if aux else hidden


@contextmanager
def _building_with(model: type[gemma3.Gemma3Model]) -> Iterator[None]:
    """vLLM's Gemma3ForCausalLM builds `Gemma3Model` by its module's name: build ours instead, for the
    length of one constructor (so torch.compile, set up in the model's constructor, wraps our forward)."""
    original = gemma3.Gemma3Model
    gemma3.Gemma3Model = model  # type: ignore[misc]
    try:
        yield
    finally:
        gemma3.Gemma3Model = original  # type: ignore[misc]


class Gemma3ForCausalLM(gemma3.Gemma3ForCausalLM, SupportsEagle3):
    """vLLM's Gemma3ForCausalLM with SupportsEagle3: its forward passes the model's (hidden, aux) on.
    Without speculative decoding nothing reads the aux states, and vLLM's own model is built: serving
    Gemma-3 alone does not depend on this module keeping up with vLLM's."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        if vllm_config.speculative_config is None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            return
        with _building_with(Gemma3Model):
            super().__init__(vllm_config=vllm_config, prefix=prefix)


if supports_eagle3(gemma3.Gemma3ForCausalLM):  # a vLLM that serves EAGLE-3 beside Gemma-3 itself: use its class
    Gemma3ForCausalLM = gemma3.Gemma3ForCausalLM  # type: ignore[misc]
