"""Draft quality: acceptance length of a SmolLM2-135M-Instruct EAGLE-3 draft vs vLLM's ngram speculation.

    python benchmarks/quality.py --budget small [--device cuda] [--out bench-quality]
    python benchmarks/quality.py --budget full --device cuda

Data: the ShareGPT file from the package index. The last `--heldout` conversations (first user turn
each) are the evaluation prompts and are never trained on. `small` trains on the first 2,000 other
conversations; `full` on as many of them as a 64 GB capture store holds (SmolLM2 stores
4 x 576 x 2 + 5 = 4,613 bytes per token in bf16). Max length 1024, a fixed training budget.

Domains (`--domains`, default all): `chat` = those held-out ShareGPT prompts; `code` = the 164 HumanEval
problems and `maths` = the 270 CHAMP competition problems, both from the package index
(nestling.evaluate.domains), never trained on. Each prompt is one user turn rendered with the target's
chat template. Each domain gets its own rows (and its own folder under OUT, chat at the top).

Reported at each K, greedy, from the reference decoder and vLLM, and vLLM's own ngram speculation on the
same prompts: tokens per target forward (tokens / target forwards, every decode step counted, the
forwards counted per prompt as the engine generates: docs/eval.md, "Counting target forwards") with its
standard error over the prompts (`tokens_per_forward_se`; "-" in results from before it), vLLM's
acceptance length (1 + accepted / drafts, over the steps that drafted) and, for one release, the figure
read off the counters as before, tokens / (tokens - accepted), which counts drafts accepted past the end
of an answer as emitted; plus the wall time of each pipeline stage.
Prints a Markdown table and writes OUT/quality.json. A benchmark, not a test: the lead runs the budgets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from nestling.evaluate.settings import DRAFT_SAMPLE_METHODS

BUDGETS = {
    # conversations for training (None = all not held out, capped by the disk budget), training epochs
    "small": {"conversations": 2000, "epochs": 2.0},
    "full": {"conversations": None, "epochs": 2.0},
}
DISK_BUDGET = 64 * 10**9
BPT = 4 * 576 * 2 + 5  # capture bytes per token of SmolLM2 in bf16 (3 aux layers + final, ids, mask)
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def parse_kv(spec: str) -> dict:
    """`key=value,...` from a benchmark's command line (values read as JSON where they parse: 2e-3, true)."""
    out: dict = {}
    for item in filter(None, spec.split(",")):
        k, _, v = item.partition("=")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def parse_variant(spec: str) -> tuple[str, dict]:
    """`NAME:key=value,...` -> (NAME, settings)."""
    name, _, kv = spec.partition(":")
    return name, parse_kv(kv)


def copy_draft(work: Path, export: str, out: Path, name: str) -> Path:
    """A copy of the draft folder `work/export` as `out/name` (an earlier copy there replaced), so the
    draft sits beside the results JSON; measure it with `benchmarks/quality.py --draft OUT/NAME`. No
    shell: the folders are users' paths."""
    import shutil

    dest = out / name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(work / export, dest)
    return dest


def _user_turns(conv: dict) -> list[str]:
    """The conversation's non-empty user turns, as written (not stripped)."""
    return [
        str(t.get("value", ""))
        for t in conv["conversations"]
        if ROLES.get(str(t.get("from")).lower()) == "user" and str(t.get("value", "")).strip()
    ]


def _root(conv: dict) -> str:
    """ShareGPT's cleaned split cuts long conversations into parts `ID_0`, `ID_1`, ...: one root."""
    return str(conv.get("id", "")).rsplit("_", 1)[0]


def split_sharegpt(
    out: Path, n_heldout: int, n_train: int | None, source: Path | None = None
) -> tuple[Path, Path, int]:
    """train.json (ShareGPT list) and heldout.jsonl (first user turn of each held-out conversation).
    `source`: the ShareGPT file (default: the one from the package index). Training leaves out every
    conversation that is a part of a held-out one (same id root) or asks a held-out prompt verbatim
    ("hi", the sample questions people pasted): the prompts are unseen, not only their records."""
    from nestling.assets import sharegpt_json
    from nestling.data.readers import read_input

    records, _ = read_input(source or sharegpt_json())
    good = [r.data for r in records if r.data and isinstance(r.data.get("conversations"), list)]
    heldout, pool = good[-n_heldout:], good[:-n_heldout]
    firsts = [turns[0] for turns in map(_user_turns, heldout) if turns]
    asked, roots = {f.strip() for f in firsts}, {_root(c) for c in heldout if c.get("id")}
    pool = [
        c
        for c in pool
        if not (c.get("id") and _root(c) in roots) and asked.isdisjoint(t.strip() for t in _user_turns(c))
    ]
    train = pool if n_train is None else pool[:n_train]
    out.mkdir(parents=True, exist_ok=True)
    train_path, prompts_path = out / "train.json", out / "heldout.jsonl"
    if not train_path.exists():
        train_path.write_text(json.dumps(train))
    lines = [json.dumps({"messages": [{"role": "user", "content": first}]}) for first in firsts]
    prompts_path.write_text("\n".join(lines) + "\n")
    return train_path, prompts_path, len(train)


def ngram_worker(spec_path: str, result_path: str) -> None:
    """Subprocess: vLLM's ngram speculation over the prompts; writes its spec-decode counters and the
    target forwards counted per prompt."""
    from vllm import LLM, SamplingParams

    from nestling.evaluate.vllm_worker import as_result, measured

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["target"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": spec["k"],
            "prompt_lookup_max": spec["prompt_lookup_max"],
            "prompt_lookup_min": spec["prompt_lookup_min"],
        },
    )
    params = SamplingParams(max_tokens=spec["max_new_tokens"], temperature=0.0)
    g, metrics = measured(llm, spec["prompts"], params)
    Path(result_path).write_text(json.dumps({**as_result(g), "metrics": metrics}))


def run_ngram(
    target: str,
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
    dtype: str,
    work: Path,
    lookup_max: int,
    lookup_min: int,
) -> dict:
    from nestling.evaluate.vllm_engine import summarize_run

    spec, res = work / f"ngram-k{k}.spec.json", work / f"ngram-k{k}.json"
    spec.write_text(
        json.dumps(
            {
                "target": target,
                "prompts": prompts,
                "k": k,
                "max_new_tokens": max_new_tokens,
                "dtype": dtype,
                "prompt_lookup_max": lookup_max,
                # held-out ShareGPT prompts reach ~2.9k tokens: size the context to fit them
                "max_model_len": max(len(p) for p in prompts) + max_new_tokens + k + 1,
                "prompt_lookup_min": lookup_min,
            }
        )
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    proc = subprocess.run(
        [sys.executable, __file__, "--ngram-worker", str(spec), str(res)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"vLLM ngram run failed:\n{proc.stderr[-4000:]}")
    r = json.loads(res.read_text())
    return {
        **summarize_run(r, k),
        "seconds": r["seconds"],
        "tokens": r["tokens"],
        "tokens_per_s": r["tokens"] / max(r["seconds"], 1e-9),
    }


def temperature_suffix(t: float, draft_sample_method: str = "greedy") -> str:
    """`-t0.7` in result names at a temperature (`-t0.7-probabilistic` for sampled drafts), nothing
    greedy (greedy names stay as they were)."""
    if not t:
        return ""
    return f"-t{t:g}" + ("-probabilistic" if draft_sample_method == "probabilistic" else "")


def per_forward(r: dict) -> float | None:
    """Tokens per target forward over *all* steps, from the forwards each engine counted per prompt.
    vLLM's acceptance length (1 + accepted / drafts) counts only steps that drafted; ngram drafts only
    when the context repeats, so both are shown."""
    return r.get("mean_tokens_per_target_forward")


def per_forward_se(r: dict) -> float | None:
    """The standard error of `per_forward` over the prompts (nestling.evaluate.standard_error): two
    figures closer than about 2 * sqrt(se1^2 + se2^2) are not told apart. None in results from before it."""
    return r.get("tokens_per_forward_se")


def per_forward_from_counters(r: dict) -> float | None:
    """The figure as read off the spec-decode counters before forwards were counted, tokens / (tokens -
    accepted): too high, since a draft token accepted past max_tokens or an end of answer counts as
    accepted but is never emitted. Kept beside `per_forward` for one release, to compare with results
    measured that way."""
    tokens, accepted = r.get("tokens"), r.get("num_accepted_tokens")
    if not tokens or accepted is None:
        return None
    return tokens / max(tokens - accepted, 1)


def measure(
    args,
    draft: Path,
    target: str,
    prompts_path: Path,
    prompts: list[list[int]],
    out: Path,
    engine: str,
    dtype: str,
    baseline: bool,
    ngram: bool,
    domain: str = "chat",
) -> tuple[list[dict], dict]:
    """Rows of the table for each K: the draft in `engine` (reference / vllm / both), then vLLM ngram."""
    from nestling.evaluate.run import evaluate
    from nestling.evaluate.settings import EvalSettings

    rows, stage_s = [], {}
    if domain != "chat":  # chat keeps the folders it had before there were domains
        out = out / domain
        out.mkdir(parents=True, exist_ok=True)
    for k in args.k:
        t = time.monotonic()
        rep = evaluate(
            draft,
            target,
            prompts_path,
            out / f"eval-{draft.name}-k{k}{temperature_suffix(args.temperature, args.draft_sample_method)}",
            EvalSettings(
                k=k,
                temperature=args.temperature,
                draft_sample_method=args.draft_sample_method,
                engine=engine,
                max_new_tokens=args.max_new_tokens,
                baseline=baseline,
                max_prompts=args.max_prompts,
                device=args.device,
                dtype=dtype,
            ),
        )
        stage_s[f"eval {domain} k={k}"] = time.monotonic() - t
        for eng, r in rep["engines"].items():
            rows.append(eagle_row(r, domain, eng, k, args.temperature, args.draft_sample_method))
        if ngram:
            t = time.monotonic()
            r = run_ngram(
                target, prompts, k, args.max_new_tokens, dtype, out, args.prompt_lookup_max, args.prompt_lookup_min
            )
            stage_s[f"ngram {domain} k={k}"] = time.monotonic() - t
            rows.append(ngram_row(r, domain, k))
    return rows, stage_s


def eagle_row(r: dict, domain: str, engine: str, k: int, temperature: float, draft_sample_method: str) -> dict:
    """The table's row for the draft from one engine of an eval report (`report["engines"][engine]`)."""
    return {
        "domain": domain,
        "method": "eagle3",
        "engine": engine,
        "k": k,
        "temperature": temperature,
        "draft_sample_method": draft_sample_method,
        "acceptance_length": r["acceptance_length"],
        "tokens_per_forward": per_forward(r),
        "tokens_per_forward_se": per_forward_se(r),
        "tokens_per_forward_from_counters": per_forward_from_counters(r),
        "per_position": r["per_position"],
        "tokens_per_s": r.get("tokens_per_s"),
        "speedup": r.get("speedup"),
        "num_drafts": r.get("num_drafts"),
        "num_accepted_tokens": r.get("num_accepted_tokens"),
        "tokens": r.get("tokens"),
        "target_forwards": r.get("target_forwards"),
        "draftable_share": r.get("draftable_share"),
    }


def ngram_row(r: dict, domain: str, k: int) -> dict:
    """The table's row for vLLM's ngram speculation (`run_ngram`'s result)."""
    return {
        "domain": domain,
        "method": "ngram",
        "engine": "vllm",
        "k": k,
        "acceptance_length": r["acceptance_length"],
        "tokens_per_forward": per_forward(r),
        "tokens_per_forward_se": per_forward_se(r),
        "tokens_per_forward_from_counters": per_forward_from_counters(r),
        "per_position": r["per_position"],
        "tokens_per_s": r["tokens_per_s"],
        "speedup": None,
        "num_accepted_tokens": r["num_accepted_tokens"],
        "tokens": r["tokens"],
        "target_forwards": r["target_forwards"],
    }


def domain_prompt_files(args, chat: Path, out: Path) -> dict[str, Path]:
    """Prompt file per domain in `--domains`: chat is the held-out ShareGPT file, the others are
    written from the package index's sets (first `--max-prompts`)."""
    from nestling.evaluate.domains import write_domain_prompts

    return {
        d: chat if d == "chat" else write_domain_prompts(d, out / f"heldout-{d}.jsonl", args.max_prompts)
        for d in args.domains
    }


def measure_domains(args, draft: Path, target: str, files: dict[str, Path], out: Path, **kw) -> tuple[list[dict], dict]:
    """`measure` over each domain's prompts; -> all rows, all stage times, prompts per domain in stage_s."""
    from nestling.evaluate.prompts import load_prompts
    from nestling.targets.load import load_tokenizer

    tok = load_tokenizer(target)
    rows, stage_s = [], {}
    for domain, path in files.items():
        prompts = load_prompts(path, tok)[: args.max_prompts]
        r, s = measure(args, draft, target, path, prompts, out, domain=domain, **kw)
        rows += r
        stage_s.update(s)
        stage_s[f"prompts {domain}"] = len(prompts)
    return rows, stage_s


def evaluate_draft(args, draft: Path, target: str, prompts_path: Path, out: Path) -> None:
    """The CPU leg: acceptance of an already trained draft in vLLM / the reference decoder, plus ngram."""
    files = domain_prompt_files(args, prompts_path, out)
    rows, stage_s = measure_domains(
        args, draft, target, files, out, engine=args.engines, dtype="float32", baseline=False, ngram=not args.no_ngram
    )
    name = draft.name
    prompts = {d: stage_s[f"prompts {d}"] for d in files}
    result = {
        "draft": str(draft),
        "skip_prompts": args.skip_prompts,
        "target": target,
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "draft_sample_method": args.draft_sample_method,
        "rows": rows,
        "stage_seconds": stage_s,
    }
    path = out / f"quality-{name}{temperature_suffix(args.temperature, args.draft_sample_method)}.json"
    path.write_text(json.dumps(result, indent=2))
    how = f"temperature {args.temperature:g}, {args.draft_sample_method} drafts" if args.temperature else "greedy"
    print_rows(f"{draft} on held-out prompts {prompts}, {how}, {args.max_new_tokens} new tokens", rows, stage_s)
    print(f"\nwrote {path}")


def print_rows(title: str, rows: list[dict], stage_s: dict) -> None:
    print(f"\n## quality: {title}\n")
    print(
        "| domain | method | engine | K | acceptance length | tokens/forward | ± s.e. | tokens/forward from counters | "
        "per position | tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tpf, old = (
            f"{r[key]:.3f}" if r.get(key) else "-" for key in ("tokens_per_forward", "tokens_per_forward_from_counters")
        )
        se = r.get("tokens_per_forward_se")  # absent from results written before it was reported
        print(
            f"| {r.get('domain', 'chat')} | {r['method']} | {r['engine']} | {r['k']} | {r['acceptance_length']:.3f} | "
            f"{tpf} | {'-' if se is None else f'{se:.3f}'} | {old} | "
            f"{', '.join(f'{p:.2f}' for p in r['per_position'])} | {r.get('tokens_per_s') or 0:.1f} |"
        )
    print("\n| stage | wall time (s) |\n|---|---|")
    for s, v in stage_s.items():
        if not s.startswith("prompts "):
            print(f"| {s} | {v:.1f} |" if v is not None else f"| {s} | - |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=sorted(BUDGETS), default="small")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (capture, training, reference decoder)")
    ap.add_argument("--out", type=Path, default=Path("bench-quality"))
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--heldout", type=int, default=100, help="held-out conversations used as prompts")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--epochs", type=float, default=None, help="override the budget's training epochs")
    ap.add_argument("--steps", type=int, default=None, help="override: optimizer steps instead of epochs")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--no-vllm", action="store_true", help="reference decoder only, no ngram bar")
    ap.add_argument("--prompt-lookup-max", type=int, default=5)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--target", help="target folder (default: SmolLM2-135M-Instruct from the package index)")
    ap.add_argument(
        "--draft",
        type=Path,
        help="evaluate this exported draft (e.g. from benchmarks/quality_gpu.py) instead of training one here",
    )
    ap.add_argument("--max-prompts", type=int, default=None, help="only the first N held-out prompts")
    ap.add_argument(
        "--skip-prompts",
        type=int,
        default=0,
        help="with --draft: leave out the first N held-out prompts (e.g. 36: the other 63, never used for tuning)",
    )
    ap.add_argument("--engines", default="both", choices=["reference", "vllm", "both"])
    ap.add_argument(
        "--domains", nargs="+", default=["chat", "code", "maths"], choices=["chat", "code", "maths"], help="prompt sets"
    )
    ap.add_argument("--no-ngram", action="store_true", help="skip vLLM's ngram bar")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (default); > 0: rejection sampling (vLLM's CPU build is refused there: its sampler is "
        "wrong, docs/eval.md; use --engines reference); the ngram bar is greedy only",
    )
    ap.add_argument(
        "--draft-sample-method",
        choices=DRAFT_SAMPLE_METHODS,
        default="greedy",
        help="at a temperature, how the draft proposes (vLLM's speculative_config.draft_sample_method): greedy "
        "(vLLM's default) or probabilistic",
    )
    ap.add_argument("--ngram-worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ngram_worker:
        ngram_worker(*args.ngram_worker)
        return

    from nestling.assets import smollm2_dir
    from nestling.pipeline.run import run_config
    from nestling.pipeline.settings import load_run_config
    from nestling.pipeline.stages import STAGES
    from nestling.pipeline.state import read_state

    if args.temperature > 0 and not args.no_ngram:
        print("[quality] temperature > 0: the ngram bar is measured greedy only; skipped", flush=True)
        args.no_ngram = True
    budget = BUDGETS[args.budget]
    out = args.out.absolute() / args.budget
    target = args.target or str(smollm2_dir())
    train_path, prompts_path, n_train = split_sharegpt(out, args.heldout, budget["conversations"])
    cuda = args.device.startswith("cuda")
    train = {
        "batch_tokens": args.batch_tokens,
        "device": "cuda" if cuda else "cpu",
        "dtype": "bfloat16" if cuda else "float32",
    }
    train.update({"steps": args.steps} if args.steps else {"epochs": args.epochs or budget["epochs"]})
    data = {
        "target": target,
        "inputs": [str(train_path)],
        "run_dir": str(out / "run"),
        "prompts": str(prompts_path),
        "data": {"max_length": 1024, "held_out": 0.02},
        "capture": {"dtype": "bfloat16", "device": args.device},
        "train": train,
        "eval": {
            "k": args.k[0],
            "engine": "reference",
            "max_new_tokens": args.max_new_tokens,
            "device": args.device,
            "dtype": "float32" if not cuda else "bfloat16",
        },
    }
    config = load_run_config(None, STAGES, base_data=data)
    if args.skip_prompts and not args.draft:
        raise SystemExit("--skip-prompts measures an existing --draft")
    if args.draft:
        if args.skip_prompts:  # a prompt set of its own, so that every engine reads the same file
            out = out / f"from{args.skip_prompts}"  # its results apart from the full set's
            out.mkdir(parents=True, exist_ok=True)
            rest = out / f"heldout_from{args.skip_prompts}.jsonl"
            rest.write_text("".join(prompts_path.read_text().splitlines(keepends=True)[args.skip_prompts :]))
            prompts_path = rest
        return evaluate_draft(args, args.draft, target, prompts_path, out)
    if budget["conversations"] is None:  # full: cap the capture store at the disk budget
        run_config(config, stages=STAGES, until="data")
        m = json.loads((out / "run" / "data" / "manifest.json").read_text())
        tokens = sum(v["tokens"] for v in m["splits"].values())
        if tokens * BPT > DISK_BUDGET:
            keep = int(n_train * DISK_BUDGET / (tokens * BPT) * 0.97)
            print(
                f"[quality] {tokens:,} tokens x {BPT} B = {tokens * BPT / 1e9:.1f} GB > 64 GB: "
                f"training on the first {keep:,} conversations",
                flush=True,
            )
            data["data"]["limit"] = keep
            config = load_run_config(None, STAGES, base_data=data)
    t0 = time.monotonic()
    run_config(config, stages=STAGES, until="export", header="benchmarks/quality.py")
    stage_s = {s: (read_state(out / "run", s) or {}).get("wall_s") for s in ("data", "capture", "train", "export")}

    rows, evals = measure_domains(
        args,
        out / "run" / "export",
        target,
        domain_prompt_files(args, prompts_path, out),
        out,
        engine="reference" if args.no_vllm else "both",
        dtype="float32" if not cuda else "bfloat16",
        baseline=True,
        ngram=not (args.no_vllm or args.no_ngram),
    )
    prompts = {d: evals.pop(f"prompts {d}") for d in args.domains}
    stage_s.update(evals)
    result = {
        "budget": args.budget,
        "device": args.device,
        "train_conversations": n_train,
        "heldout_prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "rows": rows,
        "stage_seconds": stage_s,
        "total_seconds": time.monotonic() - t0,
        "train_manifest": json.loads((out / "run" / "train" / "manifest.json").read_text()).get("final_eval"),
    }
    (out / "quality.json").write_text(json.dumps(result, indent=2))
    print_rows(
        f"{args.budget}: {n_train:,} training conversations, held-out prompts {prompts}, "
        f"greedy, {args.max_new_tokens} new tokens, {args.device}",
        rows,
        stage_s,
    )
    print(f"\nwrote {out / 'quality.json'}")


if __name__ == "__main__":
    main()
