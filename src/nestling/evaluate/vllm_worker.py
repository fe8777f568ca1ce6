"""Runs in its own process (`python -m nestling.evaluate.vllm_worker SPEC.json RESULT.json`).

vLLM spawns worker processes and keeps global state (Prometheus registry, distributed env), so
the engine never runs inside the caller. The spec holds token ids already rendered with the
chat template, so the reference decoder and vLLM see the very same prompts.
One process runs the target alone (baseline) and then target + each draft in turn (startup is
the cost, so tests share one process); the spec-decode counters come from `LLM.get_metrics()`, the
target forwards are counted per prompt while the engine generates (`generate_counted`).
"""

from __future__ import annotations

import gc
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path


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


@dataclass
class Generation:
    """What one pass over the prompts gave: each prompt's tokens, the target forwards that emitted them,
    and the wall time."""

    outputs: list[list[int]]
    forwards: list[int]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(map(len, self.outputs))


_request_ids = itertools.count()


def generate_counted(llm, prompts: list[list[int]], params, label: str | None = None) -> Generation:
    """`LLM.generate` with the target forwards counted per prompt: the engine is stepped here with delta
    outputs, and each step that brings a prompt new tokens is one target forward for it (vLLM's engine
    core runs one forward per step and its output processor passes that forward's tokens on at once;
    a prefill chunk that emits nothing counts none). vLLM's counters cannot give this: a draft token
    accepted past max_tokens or an end of answer counts as accepted but is never emitted."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    interval = getattr(engine.vllm_config.scheduler_config, "stream_interval", 1)
    if interval != 1:  # the output processor would merge the tokens of several forwards into one output
        raise RuntimeError(f"stream_interval {interval}: target forwards can be counted only at 1")
    delta = params.clone()
    delta.output_kind = RequestOutputKind.DELTA
    t0 = time.perf_counter()
    index = {f"nestling-{next(_request_ids)}": i for i in range(len(prompts))}  # outputs carry these ids
    for request_id, i in index.items():
        engine.add_request(request_id, {"prompt_token_ids": prompts[i]}, delta)
    outputs: list[list[int]] = [[] for _ in prompts]
    forwards = [0] * len(prompts)
    bar = line_progress(label)(total=len(prompts), postfix="") if label else None
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = index[out.request_id]
            new = out.outputs[0].token_ids
            forwards[i] += bool(new)
            outputs[i].extend(new)
            if out.finished and bar is not None:
                speed = sum(map(len, outputs)) / (time.perf_counter() - t0)
                bar.postfix = f"est. speed output: {speed:.2f} toks/s"  # no redraw here: update() prints it
                bar.update(1)
    if bar is not None:
        bar.close()
    return Generation(outputs, forwards, time.perf_counter() - t0)


def speculative_config(spec: dict, draft: str) -> dict:
    """vLLM's speculative_config for one draft. draft_sample_method is named only where it is not
    vLLM's default (greedy), so an engine that predates the option still loads the default."""
    config = {"method": "eagle3", "model": draft, "num_speculative_tokens": spec["k"]}
    if spec.get("draft_sample_method", "greedy") != "greedy":
        config["draft_sample_method"] = spec["draft_sample_method"]
    return config


def eagle3_unsupported(target: str | dict) -> str | None:
    """Why this vLLM cannot run an EAGLE-3 draft beside `target` (its folder, or its config.json as a
    dict: `nestling plan` asks before anything loads), or None. vLLM reads the draft's aux
    hidden states through its model class's `SupportsEagle3` interface; a class without it (Gemma-3 in
    vLLM 0.32) fails at load ("Model does not support EAGLE3 interface"). Asked of vLLM's own registry
    after its plugins load, as the engine loads them: nestling's plugin (export/vllm_plugin.py) gives
    Gemma-3 the interface unless VLLM_PLUGINS leaves it out, and a later vLLM that adds the interface
    passes; a registry this code cannot read passes too (vLLM then says itself)."""
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_eagle3
        from vllm.plugins import load_general_plugins

        load_general_plugins()

        config = target if isinstance(target, dict) else json.loads((Path(target) / "config.json").read_text())
        archs = config.get("architectures") or []
        classes = [c for c in map(ModelRegistry._try_load_model_cls, archs) if c is not None]
    except Exception:  # noqa: BLE001 -- a registry or config this code cannot read: vLLM decides at load
        return None
    if not classes or any(supports_eagle3(c) for c in classes):
        return None
    import vllm

    from nestling.export.vllm_plugin import CLASSES, PLUGIN

    names = ", ".join(c.__name__ for c in classes)
    why = f"vLLM {vllm.__version__}'s {names} does not implement SupportsEagle3: it cannot serve an EAGLE-3 draft"
    if set(archs) & set(CLASSES):
        why += (
            f" (nestling's vLLM plugin adds the interface, but vLLM did not load it here: VLLM_PLUGINS leaves "
            f"out `{PLUGIN}`, or nestling is not installed as a package: pip install -e .)"
        )
    return why


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    if spec.get("drafts") or spec.get("draft"):
        why = eagle3_unsupported(spec["target"])
        if why:
            return {"cannot_serve": why}

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
        generate_counted(llm, spec["prompts"][:1], params)  # warm-up: first call compiles / allocates
        g = generate_counted(llm, spec["prompts"], params, "target alone")
        result["baseline"] = {"outputs": g.outputs, "seconds": g.seconds, "tokens": g.tokens}
        del llm
        gc.collect()
    result["drafts"] = []
    for draft in spec.get("drafts") or [spec["draft"]]:  # one engine per draft
        llm = LLM(**common, speculative_config=speculative_config(spec, draft))
        generate_counted(llm, spec["prompts"][:1], params)
        g, metrics = measured(llm, spec["prompts"], params, f"with draft, k={spec['k']}")
        result["drafts"].append({"draft": draft, **as_result(g), "metrics": metrics})
        del llm
        gc.collect()
    return result


def measured(llm, prompts: list[list[int]], params, label: str | None = None) -> tuple[Generation, dict]:
    """`generate_counted` and vLLM's spec-decode counters of that pass alone (the metrics registry is
    per process and counts the warm-up too: read before and after, and diffed)."""
    before = _metrics(llm)
    g = generate_counted(llm, prompts, params, label)
    after = _metrics(llm)
    diff = {
        k: [a - b for a, b in zip(v, before.get(k, [0.0] * len(v)))] if isinstance(v, list) else v - before.get(k, 0.0)
        for k, v in after.items()
    }
    return g, diff


def as_result(g: Generation) -> dict:
    """A pass as the result file holds it: outputs, target forwards per prompt and in all, seconds, tokens."""
    return {
        "outputs": g.outputs,
        "forwards": g.forwards,
        "target_forwards": sum(g.forwards),
        "seconds": g.seconds,
        "tokens": g.tokens,
    }


if __name__ == "__main__":
    spec = json.loads(open(sys.argv[1]).read())
    res = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(res, f)
