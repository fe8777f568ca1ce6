"""Why vLLM's CPU build accepts almost no draft token at temperature > 0: a minimal reproduction.

    python benchmarks/vllm_cpu_sampling.py [--vocab 49152] [--requests 256] [--k 3] [--temperature 0.7]
    python benchmarks/vllm_cpu_sampling.py --engine      # also vLLM's ngram on SmolLM2 (minutes on CPU)
    python benchmarks/vllm_cpu_sampling.py --eagle DRAFT --prompts FILE   # a draft, both draft_sample_methods
        [--methods probabilistic] [--seed S]   # one method; every request seeded with S (default 0)

No model: vLLM's own rejection-sampling path (`apply_sampling_constraints`, then `rejection_sample`,
as `RejectionSampler.forward` calls them) on random target logits, with the kernels the CPU platform
registers. Two drafts whose acceptance is known exactly:
- an ideal draft, q = p (draft probabilities equal the target's at the same temperature): every
  token must be accepted (p / q = 1 >= u);
- an ngram-like draft (no draft probabilities) proposing the target's argmax: position j is
  accepted with probability prod_{i <= j} p_T(argmax_i), averaged over the requests.
Each runs twice: with the CPU build's `expand_kernel` replacement as shipped, and with that one
kernel replaced by a correct expansion (`repeat_interleave`). If acceptance is right only in the
second run, the shipped replacement is the whole cause. Prints JSON.

`--eagle DRAFT --prompts FILE` measures an EAGLE-3 draft in the engine with that one kernel corrected,
at `--temperature` and `--k`, with each of vLLM's draft_sample_methods (greedy: the draft's argmax, accepted with
p; probabilistic: sampled, accepted with min(1, p/q)), each in its own process as below: the per-position
acceptance and tokens per target forward (with its standard error over the prompts) to set beside nestling's reference decoder on the same prompts
(`nestling eval --engine reference --temperature T --draft-sample-method M`).

`--engine` confirms it in the engine: vLLM's ngram speculation (K = `--k`) on SmolLM2-135M-Instruct over
6 chat prompts, 96 tokens, at temperature 0.7 as shipped and with the corrected kernel, and greedy as
shipped; each in its own process with the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the
replaced `_expand_kernel_impl` is the one the CPU platform registers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

ENGINE_PROMPTS = [
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that adds two numbers, then the same function with type hints.",
    "List the days of the week, then list them again in reverse order.",
    "Count from one to twenty in words.",
    "Explain what a linked list is, then explain it again in simpler words.",
    "Write the alphabet in capital letters separated by commas.",
]


def correct_expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """What the Triton `expand_kernel` does: x[i] repeated per token, replace_from -> replace_to."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(counts.sum())] = x.repeat_interleave(counts)


def metadata(n: int, temperature: float):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((n,), temperature),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def accepted_per_position(out: torch.Tensor, drafts: torch.Tensor) -> list[float]:
    """vLLM's counting: position j counts when drafts 0..j all survive in the output."""
    ok = (out[:, : drafts.shape[1]] == drafts.to(out.dtype)).long().cumprod(dim=1)
    return ok.float().mean(dim=0).tolist()


def run(vocab: int, n: int, k: int, temperature: float, seed: int) -> dict:
    from vllm.v1.sample import rejection_sampler as rs

    torch.manual_seed(seed)  # vLLM draws its uniforms and exponentials from the global generator
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n * k, vocab, generator=g) * 4  # a peaked target, like a model's
    cu = (torch.arange(1, n + 1) * k).to(torch.int32)
    bonus = torch.zeros(n, 1, dtype=torch.int64)
    meta = metadata(n, temperature)
    p = torch.softmax(logits / temperature, dim=-1)
    ideal = torch.multinomial(p, 1, generator=g).squeeze(1).to(torch.int32)
    argmax = logits.argmax(dim=-1).to(torch.int32)
    res: dict = {"expanded_temperature": rs.expand_batch_to_tokens(meta.temperature, cu, n * k, 0, 1)[:k].tolist()}
    for name, drafts, q in (("ideal draft (q = p)", ideal, p), ("ngram-like (argmax, no q)", argmax, None)):
        target = rs.apply_sampling_constraints(logits.clone(), cu, meta)  # divides by the expanded temperature
        out = rs.rejection_sample(drafts, [k] * n, k, cu, q, target, bonus, meta)
        res[name] = {"accepted_per_position": accepted_per_position(out, drafts.view(n, k))}
    res["ideal draft (q = p)"]["expected"] = [1.0] * k
    res["ngram-like (argmax, no q)"]["expected"] = p.max(dim=-1).values.view(n, k).cumprod(dim=1).mean(dim=0).tolist()
    return res


def engine_worker(variant: str, temperature: float, k: int) -> dict:
    """vLLM's ngram (K = k) on SmolLM2 in this process; `variant` "corrected" replaces the CPU expand first."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if variant == "corrected":
        import vllm.utils.cpu_triton_utils as cpu_tl

        cpu_tl._expand_kernel_impl = correct_expand  # before the worker registers the overrides
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from nestling.assets import smollm2_dir
    from nestling.evaluate.vllm_worker import _metrics

    target = str(smollm2_dir())
    llm = LLM(
        model=target,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 5,
            "prompt_lookup_min": 2,
        },
    )
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [
        {
            "prompt_token_ids": tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        }
        for q in ENGINE_PROMPTS
    ]
    llm.generate(prompts, SamplingParams(max_tokens=96, temperature=temperature, seed=0), use_tqdm=False)
    m = _metrics(llm)
    d = m.get("num_drafts", 0.0)
    return {"num_drafts": d, "per_position": [x / max(d, 1) for x in m.get("num_accepted_tokens_per_pos", [])]}


def eagle_worker(
    draft: str, prompts: str, method: str, temperature: float, n: int, max_new: int, k: int, seed: int = 0
) -> dict:
    """vLLM with an EAGLE-3 draft (K = k) on SmolLM2 in this process, the CPU expand corrected; prompts
    prefilled whole, as seeded sampling on the CPU build needs (targets/vllm_rules.whole_prefill)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm.utils.cpu_triton_utils as cpu_tl

    cpu_tl._expand_kernel_impl = correct_expand  # before the worker registers the overrides
    from pathlib import Path

    from nestling.assets import smollm2_dir
    from nestling.evaluate.prompts import load_prompts
    from nestling.evaluate.vllm_worker import run as run_worker
    from nestling.targets.load import load_tokenizer
    from nestling.targets.vllm_rules import engine_options, whole_prefill

    target = smollm2_dir()
    ids = load_prompts(prompts, load_tokenizer(target), n)
    max_len = max(map(len, ids)) + max_new + 8
    spec = dict(
        target=str(target), drafts=[draft], k=k, prompts=ids, max_new_tokens=max_new, temperature=temperature,
        dtype="float32", max_model_len=max_len, seed=seed, baseline=False,
        draft_sample_method=method, engine_options={**engine_options(Path(target), "float32"), **whole_prefill(max_len)},
    )  # fmt: skip
    return eagle_result(run_worker(spec)["drafts"][0], k)


def eagle_result(d: dict, k: int) -> dict:
    """One method's result from the worker's pass with the draft: vLLM's counters, and tokens per target
    forward with its standard error over the prompts, as benchmarks/quality.py reports them."""
    from nestling.evaluate.vllm_engine import summarize_run
    from quality import per_forward, per_forward_from_counters  # this script's folder

    r = {**summarize_run(d, k), "k": k, "tokens": d["tokens"]}  # summarize_run gives tokens_per_forward_se
    return {**r, "tokens_per_forward": per_forward(r), "tokens_per_forward_from_counters": per_forward_from_counters(r)}


def eagle_runs(
    draft: str, prompts: str, temperature: float, n: int, max_new: int, k: int, seed: int, methods: list[str]
) -> dict:
    """`eagle_worker` for each draft_sample_method, each in a fresh process (the kernel is replaced
    before vLLM registers its overrides, once per process). The seed is every request's: sampled
    figures from one seed per prompt move by a tenth or more, so comparing two drafts wants several."""
    out = {}
    for method in methods:
        cmd = [
            sys.executable,
            __file__,
            "--eagle-worker",
            draft,
            prompts,
            method,
            str(temperature),
            str(n),
            str(max_new),
            str(k),
            str(seed),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        out[f"draft_sample_method {method}"] = json.loads(lines[-1]) if lines else {"error": r.stderr[-2000:]}
    return out


def engine_runs(temperature: float, k: int) -> dict:
    out = {}
    for variant, t in (("as shipped", temperature), ("corrected", temperature), ("as shipped", 0.0)):
        cmd = [sys.executable, __file__, "--engine-worker", variant, str(t), str(k)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        out[f"{variant}, temperature {t}"] = json.loads(lines[-1]) if lines else {"error": r.stderr[-2000:]}
    return out


def main() -> None:
    from nestling.evaluate.settings import DRAFT_SAMPLE_METHODS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step, in every mode")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0, help="the kernel runs' seed; with --eagle, every request's")
    ap.add_argument(
        "--methods",
        nargs="+",
        choices=DRAFT_SAMPLE_METHODS,
        default=list(DRAFT_SAMPLE_METHODS),
        help="with --eagle: the draft_sample_methods to run (default: all)",
    )
    ap.add_argument("--engine", action="store_true", help="also vLLM's ngram on SmolLM2, shipped vs corrected")
    ap.add_argument("--eagle", metavar="DRAFT", help="an exported EAGLE-3 draft of SmolLM2 in the corrected engine")
    ap.add_argument("--prompts", help="with --eagle: a prompts file (JSONL with 'messages' or 'prompt')")
    ap.add_argument("--max-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--engine-worker", nargs=3, metavar=("VARIANT", "T", "K"), help=argparse.SUPPRESS)
    ap.add_argument("--eagle-worker", nargs=8, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine_worker:
        variant, t, k = a.engine_worker
        print(json.dumps(engine_worker(variant, float(t), int(k))))
        return
    if a.eagle_worker:
        d, p, m, t, n, new, k, seed = a.eagle_worker
        print(json.dumps(eagle_worker(d, p, m, float(t), int(n), int(new), int(k), int(seed))))
        return
    if a.eagle:
        if not a.prompts:
            ap.error("--eagle needs --prompts FILE")
        res = eagle_runs(a.eagle, a.prompts, a.temperature, a.max_prompts, a.max_new_tokens, a.k, a.seed, a.methods)
        report = {"draft": a.eagle, "prompts": a.prompts, "temperature": a.temperature, "k": a.k, "seed": a.seed, **res}
        print(json.dumps(report, indent=1))
        return

    import vllm
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import register_kernels

    current_platform.register_triton_kernel_overrides()  # what every vLLM worker does first
    report = {"vllm": vllm.__version__, "platform": str(current_platform.device_name)}
    report["as shipped"] = run(a.vocab, a.requests, a.k, a.temperature, a.seed)
    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": correct_expand})
    report["expand_kernel corrected"] = run(a.vocab, a.requests, a.k, a.temperature, a.seed)
    if a.engine:
        report[f"engine: ngram on SmolLM2, K = {a.k}"] = engine_runs(a.temperature, a.k)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
