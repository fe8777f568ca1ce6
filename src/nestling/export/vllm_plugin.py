"""nestling's vLLM plugin: EAGLE-3 beside target classes whose vLLM lacks the interface.

vLLM serves an EAGLE-3 draft only beside a target class that implements `SupportsEagle3`, which hands
the draft the residual stream after the layers named in the draft's `eagle_aux_hidden_state_layer_ids`.
vLLM 0.32's Gemma3ForCausalLM (Gemma-3's text-only models) does not, and the engine refuses the draft.
vLLM calls every installed `vllm.general_plugins` entry point in each of its processes; nestling's
(pyproject.toml) calls `register`, which points each architecture of `CLASSES` at nestling's class: vLLM's
own class and layers, whose model also returns those states when a draft asks for them, as vLLM's Llama
does (export/vllm_gemma3.py). Where vLLM's own class already implements the interface, nestling's name is
vLLM's class, unchanged. `VLLM_PLUGINS=` (empty) or a list without `nestling` turns the plugin off.
"""

from __future__ import annotations

PLUGIN = "nestling"  # the entry point's name: what VLLM_PLUGINS lists to keep it on
CLASSES = {"Gemma3ForCausalLM": "nestling.export.vllm_gemma3:Gemma3ForCausalLM"}


def register() -> None:
    """Point vLLM's registry at nestling's classes. Lazy (`module:Class`): nothing is imported until vLLM
    builds a model of that architecture, so the plugin costs a vLLM that serves other targets nothing."""
    from vllm import ModelRegistry

    for arch, cls in CLASSES.items():
        ModelRegistry.register_model(arch, cls)
