"""Run the real vLLM engine in this process and record what it hands the EAGLE-3 draft.

`python tests/vllm_layer_probe.py SPEC.json RESULT.json STATES.safetensors` (SPEC as for
`nestling.evaluate.vllm_worker`: the target alone, then target + each draft, greedy).

With VLLM_ENABLE_V1_MULTIPROCESSING=0 the CPU build keeps the "uni" executor (platforms/cpu.py), so
engine core, worker and model all run here, and a method wrapped on the draft's class is the one the
engine calls. The hook: vLLM 0.32's drafting loop (`v1/spec_decode/llm_base_proposer.py`, `propose`)
passes the target's aux hidden states, concatenated in `eagle_aux_hidden_state_layer_ids` order, to
`Eagle3LlamaForCausalLM.combine_hidden_states` (which applies `fc`). The wrapper copies its input and
calls the original, so the engine still decodes: instrumentation, not a mock.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: envs are read lazily, but be sure


def main(spec_path: str, result_path: str, states_path: str) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    from nestling.evaluate.vllm_worker import run

    calls: list[torch.Tensor] = []
    original = Eagle3LlamaForCausalLM.combine_hidden_states

    def recording(self, hidden_states: torch.Tensor) -> torch.Tensor:
        calls.append(hidden_states.detach().to("cpu", torch.float32, copy=True))
        return original(self, hidden_states)

    Eagle3LlamaForCausalLM.combine_hidden_states = recording
    spec = json.loads(open(spec_path).read())
    res = run(spec)
    # vllm_worker.run warms each draft engine up on prompt 0 alone: its first call with len(prompt 0)
    # rows is that prompt's prefill, before any prefix-cache hit can shorten it.
    n = len(spec["prompts"][0])
    prefill = next((c for c in calls if c.shape[0] == n), None)
    res["combine_calls"] = [list(c.shape) for c in calls]
    if prefill is not None:
        save_file({"prefill": prefill.contiguous()}, states_path)
    with open(result_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
