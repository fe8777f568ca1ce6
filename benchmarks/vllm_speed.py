"""What a draft buys in vLLM on a GPU: output tokens/s with the draft, with ngram and without speculation.

    python benchmarks/vllm_speed.py --target DIR --draft DRAFT_DIR --prompts DATA_OR_JSONL --out speed.json \
        [--k 3] [--concurrency 1,16] [--prompts-n 32] [--max-new-tokens 256]

Each (method, concurrency) runs in a fresh engine in its own process, CUDA graphs on (vLLM's default),
bf16, greedy, on the same prompts (the held-out split of a `nestling data` folder, or a JSONL that
`nestling eval --prompts` reads). Concurrency C: C requests in flight (`max_num_seqs` = C, the prompts
sent at once). Reported per case: output tokens/s (after one warm-up pass), target forwards (decode steps
counted per prompt as the engine emits, as `nestling eval` counts them), tokens per target forward, and
milliseconds per engine step: the step's time with a draft minus without is what the draft costs, the
one-step profile that says where the time goes. Needs a CUDA GPU and vLLM; about 5 minutes on an H100
for a 135M target. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))


def one_case(spec: dict) -> dict:
    """Runs in a child process: one engine, one method, one concurrency."""
    from vllm import LLM, SamplingParams

    from nestling.evaluate.vllm_worker import generate_counted

    method, conc = spec["method"], spec["concurrency"]
    kw: dict = dict(
        model=spec["target"],
        dtype="bfloat16",
        max_model_len=spec["max_model_len"],
        seed=0,
        max_num_seqs=conc,
        gpu_memory_utilization=0.8,
        disable_log_stats=False,
    )
    if method == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec["k"], "prompt_lookup_max": 3}
    elif method == "draft":
        kw["speculative_config"] = {"method": "eagle3", "model": spec["draft"], "num_speculative_tokens": spec["k"]}
    llm = LLM(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
    prompts = spec["prompts"]
    generate_counted(llm, prompts[:conc], params)  # warm-up: graphs, allocator
    t0 = time.perf_counter()
    outputs, forwards = [], []
    for i in range(0, len(prompts), conc):  # C in flight; the next wave once the last finished
        g = generate_counted(llm, prompts[i : i + conc], params)
        outputs += g.outputs
        forwards += g.forwards
    seconds = time.perf_counter() - t0
    tokens = sum(map(len, outputs))
    waves = [max(forwards[i : i + conc]) for i in range(0, len(forwards), conc)]
    return {
        "method": method,
        "concurrency": conc,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "target_forwards": sum(forwards),
        "tokens_per_target_forward": tokens / max(sum(forwards), 1),
        "engine_steps": sum(waves),
        "ms_per_step": 1000 * seconds / max(sum(waves), 1),
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target folder (HF layout)")
    ap.add_argument("--draft", required=True, help="folder written by `nestling export`")
    ap.add_argument("--prompts", required=True, help="`nestling data` folder (its held-out split) or JSONL")
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--methods", default="none,ngram,draft")
    ap.add_argument("--prompts-n", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child's spec file
    args = ap.parse_args()
    if args.case:
        spec = json.loads(Path(args.case).read_text())
        Path(spec["result"]).write_text(json.dumps(one_case(spec)))
        return

    from nestling.evaluate.prompts import fit_context, load_prompts
    from nestling.targets.load import load_tokenizer

    tok = load_tokenizer(Path(args.target))
    prompts = load_prompts(args.prompts, tok, args.prompts_n)
    prompts = fit_context(prompts, args.max_model_len, args.max_new_tokens + args.k + 1)
    results = []
    for conc in [int(c) for c in args.concurrency.split(",")]:
        for method in args.methods.split(","):
            case = args.out.with_suffix(f".{method}.c{conc}.json")
            spec = dict(
                method=method,
                concurrency=conc,
                target=str(args.target),
                draft=str(args.draft),
                k=args.k,
                prompts=prompts,
                max_new_tokens=args.max_new_tokens,
                max_model_len=args.max_model_len,
                result=str(case),
            )
            spec_file = case.with_suffix(".spec")
            spec_file.write_text(json.dumps(spec))
            t0 = time.time()
            rc = subprocess.run([sys.executable, __file__, "--case", str(spec_file), *sys.argv[1:]]).returncode
            if rc != 0 or not case.exists():
                results.append({"method": method, "concurrency": conc, "error": f"exit {rc}"})
                continue
            r = json.loads(case.read_text())
            r["wall_s"] = time.time() - t0
            results.append(r)
            print(
                f"[speed] {method:6} c={conc:<3} {r['tokens_per_s']:9.1f} tok/s  "
                f"{r['tokens_per_target_forward']:.3f} tok/fwd  {r['ms_per_step']:.2f} ms/step",
                flush=True,
            )
    base = {r["concurrency"]: r for r in results if r.get("method") == "none" and "error" not in r}
    for r in results:
        b = base.get(r.get("concurrency"))
        if b is not None and "error" not in r:
            r["speedup"] = r["tokens_per_s"] / b["tokens_per_s"]
            r["greedy_identical_share"] = sum(a == c for a, c in zip(r["outputs"], b["outputs"])) / len(b["outputs"])
    args.out.write_text(json.dumps({"k": args.k, "prompts": len(prompts), "results": results}, indent=1))
    print(f"{'method':7} {'conc':>4} {'tok/s':>9} {'speed-up':>8} {'tok/fwd':>8} {'ms/step':>8} {'identical':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['method']:7} {r['concurrency']:>4} {r['error']}")
            continue
        print(
            f"{r['method']:7} {r['concurrency']:>4} {r['tokens_per_s']:9.1f} {r.get('speedup', 0):8.2f} "
            f"{r['tokens_per_target_forward']:8.3f} {r['ms_per_step']:8.2f} {r.get('greedy_identical_share', 0):9.2f}"
        )


if __name__ == "__main__":
    main()
