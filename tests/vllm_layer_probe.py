"""Run the real vLLM engine in this process and record what it hands the EAGLE-3 draft.

`python tests/vllm_layer_probe.py SPEC.json RESULT.json STATES.safetensors` (SPEC as for
`nestling.evaluate.vllm_worker`: the target alone, then target + each draft, greedy).

With VLLM_ENABLE_V1_MULTIPROCESSING=0 the CPU build keeps the "uni" executor (platforms/cpu.py), so
engine core, worker and model all run here, and a method wrapped on the draft's class is the one the
engine calls. The hook: vLLM 0.32's drafting loop (`v1/spec_decode/llm_base_proposer.py`, `propose`)
passes the target's aux hidden states, concatenated in `eagle_aux_hidden_state_layer_ids` order, to
`Eagle3LlamaForCausalLM.combine_hidden_states` (which applies `fc`). The wrapper copies its input and
calls the original, so the engine still decodes: instrumentation, not a mock.

For each draft engine (in the order of `drafts`) it also keeps prompt 0's prefill through the draft:
`combine_hidden_states`' input and output, and the next `forward` of the same draft's inputs (ids,
positions, hidden states) and outputs (the normed hidden state for the logits, and the one fed to the
next step), saved as `draft{k}.NAME` (the tests recompute them with nestling's draft).
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

    spec = json.loads(open(spec_path).read())
    # vllm_worker.run warms each draft engine up on prompt 0 alone: its first call with len(prompt 0)
    # rows is that prompt's prefill, before any prefix-cache hit can shorten it.
    n = len(spec["prompts"][0])
    calls: list[torch.Tensor] = []
    drafts: list[dict[str, torch.Tensor]] = []  # per draft engine: its prefill of prompt 0
    original = Eagle3LlamaForCausalLM.combine_hidden_states
    original_forward = Eagle3LlamaForCausalLM.forward

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype, copy=True).contiguous()

    def recording(self, hidden_states: torch.Tensor) -> torch.Tensor:
        calls.append(keep(hidden_states))
        out = original(self, hidden_states)
        if hidden_states.shape[0] == n and not hasattr(self, "_nestling_prefill"):
            self._nestling_prefill = {"combine_in": calls[-1], "combine_out": keep(out)}
            drafts.append(self._nestling_prefill)
        return out

    def recording_forward(self, *args, **kwargs):
        out = original_forward(self, *args, **kwargs)
        rec = getattr(self, "_nestling_prefill", None)
        if rec is not None and "hidden_in" not in rec:  # the forward right after the prefill's combine
            named = dict(zip(("input_ids", "positions", "hidden_states"), args), **kwargs)
            rec.update(
                ids=keep(named["input_ids"][:n]),
                positions=keep(named["positions"][..., :n]),
                hidden_in=keep(named["hidden_states"][:n]),
                hidden_out=keep(out[0][:n]),
                aux_out=keep(out[1][:n]),
            )
        return out

    Eagle3LlamaForCausalLM.combine_hidden_states = recording
    Eagle3LlamaForCausalLM.forward = recording_forward
    res = run(spec)
    prefill = next((c for c in calls if c.shape[0] == n), None)
    res["combine_calls"] = [list(c.shape) for c in calls]
    if prefill is not None:
        save_file(
            {
                "prefill": prefill.clone(),  # a copy: draft 0's combine_in is the same tensor
                **{f"draft{k}.{name}": t for k, rec in enumerate(drafts) for name, t in rec.items()},
            },
            states_path,
        )
    with open(result_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
