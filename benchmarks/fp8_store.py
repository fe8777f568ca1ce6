"""Does a float8 capture store cost draft quality? Drafts trained from a full-precision store and from
a float8 store of the same data, on the same budget, against the noise of a second seed.

    python benchmarks/fp8_store.py [--conversations 160 --max-length 384 --steps 100 --batch-tokens 1024]
                                   [--device cpu|cuda] [--out bench-fp8]

Target SmolLM2-135M-Instruct and ShareGPT from the package index. The data stage holds out a share of
the conversations; the target writes two stores of the rest and of the held-out split: `dtype=auto`
(float32 on a CPU, bfloat16 on a GPU) and `dtype=float8` (per-vector scale, docs/capture.md). Three
drafts train with identical settings: full precision with seeds 0 and 1, float8 with seed 0. Reported
per draft: the store's bytes per token, held-out loss, per-position accuracy and the simulated
acceptance length at K = 3 (1 + acc_0 + acc_0 acc_1 + ...); then |float8 - seed 0| against |seed 1 -
seed 0|, the noise a different seed alone makes. Prints a Markdown table; writes OUT/fp8_store.json.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from quality import split_sharegpt

K = 3


def store_bytes_per_token(cap: Path) -> float:
    """Disk bytes of the train split's shards per stored token."""
    m = json.loads((cap / "manifest.json").read_text())
    tokens = m["splits"]["train"]["tokens"]
    return sum(f.stat().st_size for f in (cap / "train").glob("shard-*.safetensors")) / max(tokens, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=160, help="ShareGPT conversations (before held-out)")
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--held-out", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("bench-fp8"))
    args = ap.parse_args()

    from nestling.assets import smollm2_dir
    from nestling.capture.run import capture
    from nestling.capture.settings import CaptureSettings
    from nestling.data.run import prepare_data
    from nestling.data.settings import DataSettings
    from nestling.train.run import train
    from nestling.train.settings import TrainSettings

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    target = smollm2_dir()
    seconds: dict[str, float] = {}

    def timed(name: str, fn, *a):
        t0 = time.monotonic()
        r = fn(*a)
        seconds[name] = round(time.monotonic() - t0, 1)
        print(f"[fp8] {name}: {seconds[name]} s", flush=True)
        return r

    train_json, _, _ = split_sharegpt(out / "split", 100, args.conversations)
    data = out / "data"
    ds = DataSettings(max_length=args.max_length, held_out=args.held_out)
    timed("data", prepare_data, [train_json], target, data, ds)
    caps = {}
    for store in ("auto", "float8"):
        caps[store] = out / f"capture-{store}"
        cs = CaptureSettings(device=args.device, dtype=store, token_budget=4096)
        timed(f"capture {store}", capture, data, target, caps[store], cs)

    runs = [("full", "auto", 0), ("full", "auto", 1), ("float8", "float8", 0)]
    rows = []
    for label, store, seed in runs:
        ts = TrainSettings(
            device=args.device,
            steps=args.steps,
            batch_tokens=args.batch_tokens,
            ttt_steps=K,
            draft_vocab_size=4096,
            lr=args.lr,
            seed=seed,
            eval_every=args.steps,
            eval_batches=1000,
            checkpoint_every=args.steps,
        )
        m = timed(f"train {label} seed {seed}", train, caps[store], out / f"train-{label}-{seed}", ts)
        ev = m["final_eval"]
        rows.append(
            {
                "store": label,
                "seed": seed,
                "bytes_per_token": round(store_bytes_per_token(caps[store]), 1),
                "heldout_loss": ev["loss"],
                "acc": [ev[f"acc_{j}"] for j in range(K)],
                "sim_k3": ev["sim_accept_len"],
                "heldout_tokens": ev["tokens"],
            }
        )
    ref, seed1, fp8 = rows
    noise = {k: abs(seed1[k] - ref[k]) for k in ("heldout_loss", "sim_k3")}
    diff = {k: abs(fp8[k] - ref[k]) for k in ("heldout_loss", "sim_k3")}
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "seed_noise": noise, "fp8_diff": diff}
    result["seconds"] = seconds
    (out / "fp8_store.json").write_text(json.dumps(result, indent=1))
    print("\n| store | seed | bytes/token | held-out loss | acc per position | simulated K = 3 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        acc = ", ".join(f"{a:.3f}" for a in r["acc"])
        print(
            f"| {r['store']} | {r['seed']} | {r['bytes_per_token']} | {r['heldout_loss']:.4f} | {acc} | {r['sim_k3']:.4f} |"
        )
    print(
        f"\n|float8 - seed 0|: loss {diff['heldout_loss']:.4f}, simulated K = 3 {diff['sim_k3']:.4f}; "
        f"|seed 1 - seed 0| (noise): loss {noise['heldout_loss']:.4f}, simulated K = 3 {noise['sim_k3']:.4f}"
    )


if __name__ == "__main__":
    main()
