"""Data-stage throughput: conversations/s for `nestling data` on the whole ShareGPT file.

    NESTLING_CACHE=/work/cache/nestling PYTHONPATH=src python benchmarks/data_throughput.py --json out.json

Target: the whole file (17,671 conversations) in under 60 s with the SmolLM2 tokenizer on 2 cores.
The data stage is CPU-only (rendering + tokenizing); `--device` is accepted so the same command
line works everywhere, and is recorded but unused.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import shutil
import tempfile
import time
from pathlib import Path


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def cpu_seconds(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", type=Path, help="chat file (default: the ShareGPT file from the package index)")
    ap.add_argument("--target", help="model folder whose tokenizer renders (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--limit", type=int, help="only the first N records (default: all)")
    ap.add_argument("--workers", type=int, default=0, help="worker processes (default: all cores)")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--device", default="cpu", help="recorded only: the data stage runs on CPU")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    from nestling.assets import sharegpt_json, smollm2_dir
    from nestling.data.headstart import match_record
    from nestling.data.run import prepare_data
    from nestling.data.settings import DataSettings
    from nestling.targets.load import resolve_target

    src = args.input or sharegpt_json()
    target = args.target or smollm2_dir()
    record = match_record(resolve_target(target), None)
    # The record is used only by the head start, which needs a second worker process.
    cached = record is not None and record.exists() and (args.workers or os.cpu_count() or 1) > 1
    out = Path(tempfile.mkdtemp(prefix="nestling-data-bench-"))
    load_before, uptime_before = load_average(), uptime()
    cpu0 = cpu_seconds(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    try:
        m = prepare_data(
            [src], target, out, DataSettings(limit=args.limit, workers=args.workers, max_length=args.max_length)
        )
    finally:
        elapsed = time.perf_counter() - t0
        cpu_main = cpu_seconds(resource.RUSAGE_SELF) - cpu0
        cpu_workers = cpu_seconds(resource.RUSAGE_CHILDREN)
        shutil.rmtree(out, ignore_errors=True)
    c, tr = m["counts"], m["splits"]["train"]
    result = {
        "input": str(src),
        "target": str(target),
        "records_read": c["read"],
        "kept": c["kept"],
        "dropped": c["dropped"],
        "tokens": tr["tokens"],
        "supervised_tokens": tr["supervised_tokens"],
        "seconds": round(elapsed, 2),
        "conversations_per_s": round(c["read"] / elapsed, 1),
        "tokens_per_s": round(tr["tokens"] / elapsed),
        "workers": args.workers or os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "uptime_before": uptime_before,
        "uptime_after": uptime(),
        "tokenizer_match_cached": cached,  # an earlier run verified the tokenizer: no AutoTokenizer import
        "cpu_s_main": round(cpu_main, 1),
        "cpu_s_workers": round(cpu_workers, 1),
        "machine": platform.platform(),
        "device": args.device,
        "target_seconds": 60.0,
        "meets_target": elapsed < 60.0 if args.limit is None else None,
    }
    rows = [
        ("records read", f"{c['read']:,}"),
        ("kept", f"{c['kept']:,}"),
        ("tokens", f"{tr['tokens']:,}"),
        ("seconds", f"{elapsed:.1f}"),
        ("conversations/s", f"{result['conversations_per_s']:,}"),
        ("tokens/s", f"{result['tokens_per_s']:,}"),
        ("workers", str(result["workers"])),
        ("CPU s main / workers", f"{cpu_main:.1f} / {cpu_workers:.1f}"),
        ("tokenizer match", "cached (AutoTokenizer not imported)" if cached else "verified in this run"),
        ("load avg before / after", f"{load_before} / {result['load_average_after']}"),
        ("target (whole file)", "< 60 s" + ("" if args.limit else f": {'met' if elapsed < 60 else 'NOT met'}")),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"| {'data stage':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
