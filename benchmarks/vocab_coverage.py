"""How much of the served text a draft vocabulary covers, and a full-vocabulary copy of a frozen-head draft.

A token outside the draft vocabulary is never drafted, so every such token in the target's output ends
a drafted chain. Two uses (docs/train.md, "Draft vocabulary"):

  coverage: python benchmarks/vocab_coverage.py coverage --count DATA_DIR --measure DATA_DIR_OR_REPORT \
                [--sizes 4096,32000] [--shards-from N] [--out FILE.json]
      the draft vocabulary nestling builds from DATA_DIR's supervised tokens (draft/vocab.py) at each
      size, and the share of the measured tokens inside it: another data folder's supervised tokens
      (the target's own answers), or the outputs of an eval report.json (what vLLM generated)
  extend:   python benchmarks/vocab_coverage.py extend --draft DRAFT --target TARGET --out DIR
      a copy of DRAFT whose lm_head holds every target row (no d2t / t2d): the same draft with nothing
      left out. Only for a frozen head (train's default): its rows are the target's, so the
      added rows are what training would have seen; a trained head is refused (its rows moved away
      from the target's, and mixing the two measured 0.36 tokens per target forward worse).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from nestling.draft.vocab import build_vocab, draft_ids_to_target  # noqa: E402
from nestling.errors import NestlingError  # noqa: E402

FROZEN_TOLERANCE = 0.02  # bf16 export rounding of the target's rows (measured 0.004); a trained head moves ~0.6


def supervised_counts(
    data_dir: Path, vocab_size: int, shards_from: int = 0, shards_to: int | None = None
) -> torch.Tensor:
    """Histogram of a data folder's supervised tokens, every split, shards [shards_from, shards_to)."""
    import pyarrow.parquet as pq

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for f in sorted(Path(data_dir).glob("*-*.parquet"))[shards_from:shards_to]:
        t = pq.read_table(f, columns=["input_ids", "loss_mask"])
        ids = torch.tensor(t.column("input_ids").combine_chunks().flatten().to_numpy(), dtype=torch.long)
        mask = torch.tensor(t.column("loss_mask").combine_chunks().flatten().to_numpy(), dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def measured_counts(source: Path, vocab_size: int, shards_from: int) -> torch.Tensor:
    if source.suffix == ".json":  # an eval report: the tokens each engine generated
        rep = json.loads(source.read_text())
        outs = [t for e in rep["engines"].values() for o in e.get("outputs", []) for t in o]
        return torch.bincount(torch.tensor(outs, dtype=torch.long), minlength=vocab_size)
    return supervised_counts(source, vocab_size, shards_from)


def coverage(args) -> dict:
    V = int(json.loads((Path(args.target) / "config.json").read_text())["vocab_size"]) if args.target else 49152
    counted = sum(supervised_counts(Path(d), V, 0, args.count_shards) for d in args.count)
    measured = measured_counts(Path(args.measure), V, args.shards_from)
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        t2d = build_vocab(counted, n)[1]
        rows.append({"size": min(n, V), "coverage": round(float(measured[t2d].sum() / measured.sum()), 5)})
    res = {
        "count": args.count,
        "count_shards": args.count_shards,
        "shards_from": args.shards_from,
        "measure": args.measure,
        "distinct_counted": int((counted > 0).sum()),
        "counted_tokens": int(counted.sum()),
        "measured_tokens": int(measured.sum()),
        "rows": rows,
    }
    print(
        f"vocabulary from {int(counted.sum()):,} supervised tokens ({res['distinct_counted']:,} distinct); "
        f"coverage of {int(measured.sum()):,} measured tokens:"
    )
    print("| draft vocabulary | coverage |\n|---|---|")
    for r in rows:
        print(f"| {r['size']:,} | {100 * r['coverage']:.2f}% |")
    return res


def extend(args) -> dict:
    from safetensors.torch import load_file, save_file

    from nestling.targets.load import load_config
    from nestling.train.head import read_head

    draft, out = Path(args.draft), Path(args.out)
    w = load_file(str(draft / "model.safetensors"))
    if "d2t" not in w:
        raise NestlingError(f"{draft} already predicts the whole vocabulary (no d2t)")
    ids = draft_ids_to_target(w["d2t"])
    cfg = load_config(Path(args.target))
    text = getattr(cfg, "text_config", None) or cfg
    full = read_head(Path(args.target), int(text.vocab_size), int(text.hidden_size)).lm_head.to(torch.bfloat16)
    moved = float((w["lm_head.weight"].float() - full[ids].float()).abs().max())
    if moved > FROZEN_TOLERANCE:
        raise NestlingError(
            f"{draft}'s lm_head differs from the target's rows by up to {moved:.3g}: it was trained, and a trained "
            "head mixed with untrained target rows drafts worse; train with draft_vocab_size set to the whole "
            "vocabulary instead"
        )
    if out.exists():
        raise NestlingError(f"{out} exists; pass a new folder")
    shutil.copytree(draft, out)
    full[ids] = w["lm_head.weight"]
    w["lm_head.weight"] = full.contiguous()
    del w["d2t"], w["t2d"]  # with equal sizes vLLM builds no d2t parameter (export/contract.py)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads((out / "config.json").read_text())
    conf["draft_vocab_size"] = int(full.shape[0])
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    print(
        f"{out}: {ids.numel():,} -> {full.shape[0]:,} lm_head rows (the head differed from the target's by {moved:.2g})"
    )
    return {"draft": str(draft), "out": str(out), "rows_before": int(ids.numel()), "rows": int(full.shape[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("coverage", help="coverage of measured tokens by vocabularies counted on data")
    c.add_argument("--count", action="append", required=True, help="data folder to count (repeatable)")
    c.add_argument("--measure", required=True, help="data folder or eval report.json to measure")
    c.add_argument("--target", help="target folder (its vocab_size; default 49152, SmolLM2)")
    c.add_argument("--sizes", default="4096,8192,16384,32000,49152")
    c.add_argument("--count-shards", type=int, help="count only a folder's first N shards (default: all)")
    c.add_argument("--shards-from", type=int, default=0, help="measure a data folder from this shard on")
    c.add_argument("--out", help="write the result as JSON here")
    e = sub.add_parser("extend", help="a full-vocabulary copy of a frozen-head draft")
    e.add_argument("--draft", required=True)
    e.add_argument("--target", required=True)
    e.add_argument("--out", required=True)
    args = ap.parse_args()
    res = coverage(args) if args.cmd == "coverage" else extend(args)
    if getattr(args, "out", None) and args.cmd == "coverage":
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
