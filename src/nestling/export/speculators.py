"""The speculators layout: the same tensors, a config that also names the target (`verifier`).

vLLM detects it by `speculators_config` (transformers_utils/config.py,
`maybe_override_with_speculators`), takes the target from `speculators_config.verifier.name_or_path`
and the speculative method / token count from `proposal_methods[0]`, so `vllm serve DRAFT` runs
target + draft with no other flag. The Llama layer lives in `transformer_layer_config`; eagle3
fields (`draft_vocab_size`, the draft norms `norm_before_residual`, `fc_norm`, `norm_output`,
`eagle_aux_hidden_state_layer_ids`, ...) sit at the top level (configs/speculators/algos.py,
`update_eagle3`). Note vLLM's default there for `norm_before_residual` is True, ours is False: the
norms are always written.
"""

from __future__ import annotations

from nestling import __version__
from nestling.draft.model import NORM_OPTIONS


def speculators_config(native: dict, target: str, target_architectures: list[str], num_speculative_tokens: int) -> dict:
    layer = {
        k: v
        for k, v in native.items()
        if k
        not in (
            "architectures",
            "eagle_aux_hidden_state_layer_ids",
            "draft_vocab_size",
            "target_hidden_size",
            "nestling",
            *NORM_OPTIONS,
        )
    }
    layer["architectures"] = ["LlamaForCausalLM"]
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "draft_vocab_size": native["draft_vocab_size"],
        "target_hidden_size": native["target_hidden_size"],
        **{k: native[k] for k in NORM_OPTIONS},  # vLLM's update_eagle3 reads them here
        "eagle_aux_hidden_state_layer_ids": native["eagle_aux_hidden_state_layer_ids"],
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(num_speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": str(target), "architectures": list(target_architectures)},
        },
        # kept at the top level too so one reader (contract.read_draft_folder) serves both layouts
        "nestling": {**native["nestling"], "exported_by": f"nestling {__version__}"},
    }
