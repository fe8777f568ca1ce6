"""Runs in its own process (`python -m nestling.evaluate.vllm_worker SPEC.json RESULT.json`).

vLLM spawns worker processes and keeps global state (Prometheus registry, distributed env), so
the engine never runs inside the caller. The spec holds token ids already rendered with the
chat template, so the reference decoder and vLLM see the very same prompts.
One process runs the target alone (baseline) and then target + each draft in turn (startup is
the cost, so tests share one process); the spec-decode counters come from `LLM.get_metrics()`.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def _metrics(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        name = m.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        if hasattr(m, "values"):
            out[name] = [float(v) for v in m.values]
        elif hasattr(m, "value"):
            out[name] = float(m.value)
    return out


PROGRESS = "[eval vllm]"  # lines with this prefix are forwarded to the caller's log


def line_progress(label: str):
    """A tqdm class for `LLM.generate(use_tqdm=...)` that prints whole lines, at most every 10 s.

    The caller forwards them to its log, where `tail -f` sees them; tqdm's own carriage-return
    redraws would show nothing until the end."""
    from tqdm.auto import tqdm

    class LineTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            # vLLM also shows a bar while it adds the requests (no speed postfix): only generation counts
            kwargs.update(
                file=sys.stdout,
                mininterval=10.0,
                dynamic_ncols=False,
                desc=f"{PROGRESS} {label}",
                disable=kwargs.get("disable", False) or "postfix" not in kwargs,
                bar_format="{desc}: {n_fmt}/{total_fmt} prompts, elapsed {elapsed}, ETA {remaining}{postfix}",
            )
            self._last = ""
            super().__init__(*args, **kwargs)

        def display(self, msg=None, pos=None):
            line = self.format_meter(**self.format_dict)
            if line != self._last:  # tqdm redraws on refresh and again on close
                print(line, file=sys.stdout, flush=True)
                self._last = line
            return True

    return LineTqdm


def _generate(llm, prompts: list[list[int]], params, label: str | None = None) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    res = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=line_progress(label) if label else False
    )
    dt = time.perf_counter() - t0
    return [list(r.outputs[0].token_ids) for r in res], dt


def speculative_config(spec: dict, draft: str) -> dict:
    """vLLM's speculative_config for one draft. draft_sample_method is named only where it is not
    vLLM's default (greedy), so an engine that predates the option still loads the default."""
    config = {"method": "eagle3", "model": draft, "num_speculative_tokens": spec["k"]}
    if spec.get("draft_sample_method", "greedy") != "greedy":
        config["draft_sample_method"] = spec["draft_sample_method"]
    return config


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=spec["max_new_tokens"],
        temperature=spec["temperature"],
        seed=spec.get("seed", 0),
        ignore_eos=spec.get("ignore_eos", False),
    )
    common = dict(
        model=spec["target"],
        tokenizer=spec["target"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        enforce_eager=True,
        seed=spec.get("seed", 0),
        disable_log_stats=False,
        max_num_seqs=spec.get("max_num_seqs", 8),
    )
    common.update(spec.get("engine_options") or {})  # e.g. float32 MLA on a CPU (targets/vllm_rules.py)
    result: dict = {}
    if spec.get("baseline", True):
        llm = LLM(**common)
        _generate(llm, spec["prompts"][:1], params)  # warm-up: first call compiles / allocates
        outs, dt = _generate(llm, spec["prompts"], params, "target alone")
        result["baseline"] = {"outputs": outs, "seconds": dt, "tokens": sum(map(len, outs))}
        del llm
        gc.collect()
    result["drafts"] = []
    for draft in spec.get("drafts") or [
        spec["draft"]
    ]:  # one engine per draft; the metrics registry is per process: diff it
        llm = LLM(**common, speculative_config=speculative_config(spec, draft))
        _generate(llm, spec["prompts"][:1], params)
        before = _metrics(llm)
        outs, dt = _generate(llm, spec["prompts"], params, f"with draft, k={spec['k']}")
        after = _metrics(llm)
        diff = {
            k: (
                [a - b for a, b in zip(v, before.get(k, [0.0] * len(v)))]
                if isinstance(v, list)
                else v - before.get(k, 0.0)
            )
            for k, v in after.items()
        }
        result["drafts"].append(
            {"draft": draft, "outputs": outs, "seconds": dt, "tokens": sum(map(len, outs)), "metrics": diff}
        )
        del llm
        gc.collect()
    return result


if __name__ == "__main__":
    spec = json.loads(open(sys.argv[1]).read())
    res = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(res, f)
