"""`nestling run CONFIG --dry-run`: the real pipeline on two samples, then what the full run will need.

An import check proves nothing; this runs every stage with the real backends (the target is loaded,
one capture batch is written, one training step is taken, the draft is exported and, with vLLM
installed, loaded by the engine) in a scratch folder, so any incompatibility fails in minutes. From
the rates it just measured it then estimates tokens, disk bytes and time per stage of the full run,
and fails when the run folder's disk cannot hold them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from nestling.errors import NestlingError
from nestling.manifest import MANIFEST, atomic_write_json
from nestling.outdir import free_bytes, mark
from nestling.pipeline.settings import RunConfig
from nestling.pipeline.run import claim_run_dir, clear_run, enabled_stages, resolve_paths, run_config
from nestling.pipeline.stages import DRY_ANSWER_TOKENS, STAGES, Stage, check_engines, train_mode
from nestling.pipeline.state import read_progress, read_state
from nestling.progress import format_bytes, format_duration, log

SCRATCH = "dry-run"
DRY_PROMPTS = ["Explain in two sentences what a compiler does.", "Write a short poem about the sea."]


@dataclass
class Measured:
    """What one stage cost in the dry run."""

    wall_s: float
    disk_bytes: int
    tokens: int  # tokens the stage processed (its Progress count), 0 if it reports none
    work_s: float  # seconds covered by its Progress (the rest is fixed cost: loading, writing)
    manifest: dict
    dir: Path | None = None


@dataclass
class Estimate:
    stage: str
    tokens: int
    disk_bytes: int
    seconds: float
    note: str = ""
    timed: bool = True  # False: `seconds` is the dry run's own, not an estimate (left out of the total)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if Path(path).exists() else 0


def preflight(config: RunConfig, target: str) -> None:
    """Checks that need only the config and the target's config.json: fail before any weights load."""
    check_engines(config.settings)  # the full run's engines (the dry run's own fall back to reference)
    data, ev = config.settings.get("data"), config.settings.get("eval")
    if ev is not None and config.prompts is None and data is not None and not _get(data, "held_out", default=0.0):
        raise NestlingError(
            "eval has no prompts: the data stage holds none out (data.held_out is 0). Set "
            "data.held_out (e.g. 0.02) or give a prompts: file (JSONL with 'messages' or 'prompt')."
        )
    cap = config.settings.get("capture")
    layers = getattr(cap, "layers", None) if cap is not None else None
    if layers:
        from nestling.targets.layers import num_layers, validate_layer_ids
        from nestling.targets.load import load_config

        validate_layer_ids(list(layers), num_layers(load_config(target)))


def _measure(run_dir: Path, stage: str) -> Measured:
    state = read_state(run_dir, stage) or {}
    prog = read_progress(run_dir, stage) or {}
    manifest_path = run_dir / stage / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    return Measured(
        float(state.get("wall_s", 0.0)),
        folder_bytes(run_dir / stage),
        int(prog.get("tokens") or 0),
        float(prog.get("elapsed_s") or 0.0),
        manifest,
        run_dir / stage,
    )


def _scaled_time(m: Measured, tokens: float, dry_tokens: float) -> float:
    """Fixed cost plus the work scaled by the measured token rate (the wall time when no rate is known)."""
    if m.tokens > 0 and m.work_s > 0:
        fixed = max(m.wall_s - m.work_s, 0.0)
        return fixed + tokens * m.work_s / m.tokens
    if dry_tokens > 0:
        return m.wall_s * max(tokens / dry_tokens, 1.0)
    return m.wall_s


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(obj, n, None) if not isinstance(obj, dict) else obj.get(n)
        if v is not None:
            return v
    return default


def count_records(inputs: list[str], limit: int | None) -> int | None:
    """Conversations the full data stage will read, counted with its own readers (no tokenizing).
    `builtin:` inputs count as the cached files they stand for."""
    from nestling.pipeline.settings import resolve_builtin

    stats = [(f, f.stat()) for f in (Path(resolve_builtin(p)) for p in inputs)]
    try:
        return sum(_count_file(str(f), limit, st.st_mtime_ns, st.st_size) for f, st in stats)
    except ImportError:  # the data stage's readers are missing: no count
        return None


@functools.lru_cache(maxsize=32)
def _count_file(path: str, limit: int | None, mtime_ns: int, size: int) -> int:
    """One file's records, read once per version of the file (a dry run estimates after capture and
    again at the end, and the regenerate and data rows both count the inputs: all of ShareGPT takes
    seconds to read)."""
    from nestling.data.readers import read_input

    return len(read_input(Path(path), limit)[0])


def answer_files(r: Any) -> list[int]:
    """Rows per input conversation in each file regenerate writes: its n answers, then the `sampled`
    pass's (the data stage reads both, each record on its own)."""
    return [int(_get(r, "n", default=1) or 1), int(_get(r, "sampled", default=0) or 0)]


def input_conversations(config: RunConfig, limit: int | None) -> int | None:
    """Records the full data stage reads. With regenerate: its conversations (its own `limit`) times
    the rows in each of its files, each file cut at the data stage's `limit` as any input file is."""
    if not config.inputs:
        return None
    r = config.settings.get("regenerate")
    if r is None:
        return count_records(config.inputs, limit)
    # each input is regenerated on its own (regenerate's limit per input), and each file it writes is
    # cut at the data stage's limit
    per_input = [count_records([p], _get(r, "limit") or None) for p in config.inputs]
    counts = [n for n in per_input if n is not None]
    if len(counts) < len(per_input):
        return None
    return sum(min(k * n, limit) if limit else k * n for n in counts for k in answer_files(r))


def full_data_tokens(config: RunConfig, dry: dict[str, Measured], real_run_dir: Path) -> tuple[dict, str]:
    """Samples and tokens per split of the full data stage: its real manifest when complete, else estimated."""
    real = real_run_dir / "data" / MANIFEST
    state = read_state(real_run_dir, "data") or {}
    if real.exists() and state.get("status") == "complete":
        m = json.loads(real.read_text())
        return {k: dict(v) for k, v in (m.get("splits") or {}).items()}, "from the completed data stage"
    dm = dry["data"].manifest
    splits = dm.get("splits") or {}
    samples = sum(int(v.get("samples", 0)) for v in splits.values()) or 1
    tok = sum(int(v.get("tokens", 0)) for v in splits.values())
    sup = sum(int(v.get("supervised_tokens", 0)) for v in splits.values())
    ds = config.settings.get("data")
    counts = dm.get("counts") or {}
    read = int(counts.get("read") or samples)
    n_read = input_conversations(config, _get(ds, "limit"))
    # conversations kept per conversation read, as in the sample (drops: empty, too long, malformed)
    n = int(round((n_read if n_read is not None else read) * samples / max(read, 1)))
    held = float(_get(ds, "held_out", default=0.0) or 0.0)
    n_held = int(round(n * held))
    per, per_sup = tok / samples, sup / samples
    out = {
        "train": {
            "samples": n - n_held,
            "tokens": int((n - n_held) * per),
            "supervised_tokens": int((n - n_held) * per_sup),
        }
    }
    if n_held:
        out["heldout"] = {"samples": n_held, "tokens": int(n_held * per), "supervised_tokens": int(n_held * per_sup)}
    text = dm.get("mode") == "text"  # a base target: documents packed into rows, one continuation each
    how = f"estimated: {n:,} {'rows of packed documents' if text else 'conversations'} x the {samples} sampled"
    if config.settings.get("regenerate") is not None:  # the dry run's answers are short: tokens undercount
        r = config.settings["regenerate"]
        reach = f"{_get(r, 'max_new_tokens')} tokens" + ("" if text else f" x {_get(r, 'max_turns') or 'all'} turns")
        how += (
            f" (with the dry run's {'continuations' if text else 'answers'}, <= {DRY_ANSWER_TOKENS} tokens"
            f"{'' if text else ' in 1 turn'}, where the full run's reach {reach}: a lower bound until the data "
            "stage has run)"
        )
    return out, how


def is_text_regeneration(m: Measured) -> bool:
    """The dry run's regenerate continued texts (a base target) rather than answering turns."""
    return m.manifest.get("format") == "text_jsonl"


def estimate(
    config: RunConfig, stages: Sequence[Stage], dry: dict[str, Measured], real_run_dir: Path
) -> list[Estimate]:
    """Per-stage tokens, disk and time of the full run, from the dry run's measured rates."""
    have_data = "data" in dry and dry["data"].manifest
    out: list[Estimate] = []
    splits, how = full_data_tokens(config, dry, real_run_dir) if have_data else ({}, "")
    T = sum(v["tokens"] for v in splits.values())
    T_dry = (
        sum(int(v.get("tokens", 0)) for v in (dry["data"].manifest.get("splits") or {}).values()) if have_data else 0
    )
    for stage in enabled_stages(config, stages):
        m = dry.get(stage.name)
        if m is None:
            continue
        s = config.settings[stage.name]
        if stage.name == "data" and have_data:
            out.append(Estimate("data", T, int(m.disk_bytes * T / max(T_dry, 1)), _scaled_time(m, T, T_dry), how))
        elif stage.name == "capture" and have_data:
            bpt = int(m.manifest.get("bytes_per_token") or m.disk_bytes / max(T_dry, 1))
            out.append(Estimate("capture", T, T * bpt, _scaled_time(m, T, T_dry), f"{format_bytes(bpt)}/token"))
        elif stage.name == "train" and have_data:
            train_tokens = splits.get("train", {}).get("tokens", T)
            epochs = _get(s, "epochs")
            steps = _get(s, "steps")
            dry_steps = max(int(_get(m.manifest, "steps", "step", default=1) or 1), 1)
            if steps:
                per_step = m.tokens / dry_steps if m.tokens else 0
                batch = _get(s, "batch_tokens")
                per_step = float(batch) * int(_get(s, "grad_accum", default=1)) if batch else per_step
                work = int(steps * per_step) if per_step else 0
                secs = _scaled_time(m, work, m.tokens) if per_step else m.wall_s * steps / dry_steps
                note = f"{steps} steps"
            else:
                work = int(float(epochs or 1) * train_tokens)
                secs = _scaled_time(m, work, m.tokens)
                note = f"{epochs or 1} epoch(s) of {train_tokens:,} tokens"
            out.append(Estimate("train", work, _train_disk(m, s, steps, work), secs, note))
        elif stage.name == "eval":
            dry_s = dry_settings_of(stage, s)
            full_n = _get(s, "max_prompts", "num_prompts")
            dry_n = _get(dry_s, "max_prompts", "num_prompts", default=1)
            full_new = _get(s, "max_new_tokens", default=1)
            dry_new = _get(dry_s, "max_new_tokens", default=1)
            if full_n is None:
                full_n = splits.get("heldout", {}).get("samples", dry_n)
            ratio = (float(full_n) * float(full_new)) / max(float(dry_n) * float(dry_new), 1.0)
            work = int(m.tokens * ratio) if m.tokens else int(full_n * full_new)
            secs = _scaled_time(m, work, work / ratio) if m.tokens else m.wall_s * max(ratio, 1.0)
            if _get(s, "baseline") and not _get(dry_s, "baseline"):
                secs *= 2  # the full eval also runs the target alone
            full = eval_choice(s)
            if full.engine in ("reference", "vllm") and _get(dry_s, "engine") == "both":
                secs /= 2  # the dry run ran both engines
            where = f"{full.engine}" + ("" if full.engine == "vllm" else f" on {full.device}, {full.dtype}")
            out.append(
                Estimate(
                    "eval",
                    work,
                    m.disk_bytes,
                    secs,
                    f"{full_n} prompts x {full_new} new tokens, {where} (at the dry run's rate for one prompt; "
                    "batched, the full run takes less)",
                )
            )
        elif stage.name == "regenerate":
            out.append(regenerate_estimate(config, m, s))
        else:
            out.append(Estimate(stage.name, m.tokens, m.disk_bytes, m.wall_s, "as measured"))
    return out


def eval_choice(s: Any) -> Any:
    """The full run's eval settings with `auto` resolved for this machine (engine, device, dtype)."""
    from nestling.evaluate.settings import EvalSettings, resolve

    return resolve(s)[0] if isinstance(s, EvalSettings) else s


def regenerate_estimate(config: RunConfig, m: Measured, s: Any) -> Estimate:
    """The regeneration's answer tokens at most (conversations x answers x turns x max_new_tokens).
    Its time is the dry run's, unscaled: two conversations leave a batched decoder nearly idle, where
    the full pass keeps hundreds in flight, so their rate says nothing of its time."""
    n = count_records(config.inputs, _get(s, "limit") or None) if config.inputs else None
    if n is None:
        return Estimate("regenerate", m.tokens, m.disk_bytes, m.wall_s, "as measured (the inputs are not countable)")
    answers, turns, cap = (
        sum(answer_files(s)),
        int(_get(s, "max_turns") or 0),
        int(_get(s, "max_new_tokens")),
    )
    if is_text_regeneration(m):  # one continuation per document and answer: turns do not apply
        most, what = n * answers * cap, f"at most {n:,} documents x {answers} continuation(s)"
    elif turns:  # max_turns 0 (every turn): no bound without counting each conversation's turns
        most, what = n * answers * turns * cap, f"at most {n:,} conversations x {answers} answer(s) x {turns} turns"
    else:
        most, what = 0, f"{n:,} conversations x {answers} answer(s) x every turn (no bound)"
    note = f"{what} x {cap} tokens; time: the dry run's, not scaled (the full pass is batched)"
    return Estimate("regenerate", most, m.disk_bytes, m.wall_s, note, timed=False)


def _train_disk(m: Measured, s: Any, steps: int | None, work: int) -> int:
    """The final draft plus the checkpoints kept (the dry run wrote one)."""
    ckpts = [p for p in (m.dir / "checkpoints").glob("step-*") if p.is_dir()] if m.dir else []
    if not ckpts:
        return m.disk_bytes
    per = folder_bytes(ckpts[-1])
    rest = m.disk_bytes - sum(folder_bytes(p) for p in ckpts)
    every = int(_get(s, "checkpoint_every", default=1) or 1)
    n_steps = steps or max(1, work // max(int(_get(s, "batch_tokens", default=1) or 1), 1))
    keep = int(_get(s, "keep_checkpoints", default=1) or 1)
    return rest + per * max(1, min(keep, n_steps // every + 1))


def dry_settings_of(stage: Stage, settings: Any) -> Any:
    return stage.dry(settings) if stage.dry else settings


def format_estimates(ests: list[Estimate], free: int, where: Path) -> str:
    lines = [f"{'stage':<11}{'tokens':>14}{'disk':>12}{'time':>11}  how"]
    for e in ests:
        lines.append(
            f"{e.stage:<11}{e.tokens:>14,}{format_bytes(e.disk_bytes):>12}{format_duration(e.seconds):>11}  {e.note}"
        )
    total_disk = sum(e.disk_bytes for e in ests)
    total_s = sum(e.seconds for e in ests if e.timed)
    untimed = [e.stage for e in ests if not e.timed]
    lines.append(
        f"{'total':<11}{'':>14}{format_bytes(total_disk):>12}{format_duration(total_s):>11}  "
        f"(free on {where}: {format_bytes(free)})" + (f"; time without {', '.join(untimed)}" if untimed else "")
    )
    return "\n".join(lines)


def dry_run(config: RunConfig, *, stages: Sequence[Stage] = STAGES, scratch: Path | None = None) -> dict:
    """Run every stage on two samples in a scratch folder, then estimate and check the full run."""
    t0 = time.monotonic()
    target, _, _ = resolve_paths(config)  # a missing target or input fails here
    preflight(config, target)
    config, mode_note = train_mode(config, target)  # decided on the full run's settings, not the dry ones
    if mode_note:
        log(f"[dry-run] the full run trains {mode_note}")
    real_run_dir = Path(config.run_dir)
    if not scratch:  # the scratch lies in the run folder: claim it first, as the run itself would
        claim_run_dir(real_run_dir)
    scratch = Path(scratch) if scratch else real_run_dir / SCRATCH
    clear_run(scratch, stages)  # measured from scratch every time: a cached stage measures nothing
    active = enabled_stages(config, stages)
    settings = {
        s.name: (None if config.settings.get(s.name) is None else dry_settings_of(s, config.settings[s.name]))
        for s in stages
    }
    prompts = config.prompts
    if prompts is None and "eval" in settings:  # the dry data stage has no held-out split
        scratch.mkdir(parents=True, exist_ok=True)
        mark(scratch, "run")  # a run folder before run.json is written: the next dry run may clear it
        prompts = str(scratch / "prompts.jsonl")
        Path(prompts).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in DRY_PROMPTS))
    dry_config = dataclasses.replace(config, run_dir=scratch, settings=settings, prompts=prompts)
    log(f"[dry-run] running {' -> '.join(s.name for s in active)} on two samples in {scratch}")
    free = free_bytes(real_run_dir)
    done = {s.name for s in active if (read_state(real_run_dir, s.name) or {}).get("status") == "complete"}

    def check_disk(ests: list[Estimate]) -> int:
        # What complete stages of the real run already hold is on disk: only the rest needs free space.
        need = sum(e.disk_bytes for e in ests if e.stage not in done)
        if need > free:
            table = format_estimates(ests, free, real_run_dir)
            raise NestlingError(
                f"not enough disk for the full run: it needs about {format_bytes(need)} in {real_run_dir} but only "
                f"{format_bytes(free)} is free (capture alone: "
                f"{format_bytes(next((e.disk_bytes for e in ests if e.stage == 'capture'), 0))}). Free space, set "
                f"run_dir to a larger disk, or capture fewer conversations (data.limit) or layers.\n{table}"
            )
        return need

    def after(outcome) -> None:
        if outcome.name == "capture":  # the big one: fail before training and evaluation run
            ran = [s for s in active if s.name in ("data", "capture")]
            check_disk(estimate(config, ran, {s.name: _measure(scratch, s.name) for s in ran}, real_run_dir))

    run_config(dry_config, stages=stages, dry_run=True, header="nestling run --dry-run", after_stage=after)
    measured = {s.name: _measure(scratch, s.name) for s in active}
    ests = estimate(config, stages, measured, real_run_dir)
    table = format_estimates(ests, free, real_run_dir)
    report = {
        "dry_run_s": time.monotonic() - t0,
        "scratch": str(scratch),
        "free_bytes": free,
        "need_bytes": 0,
        "stages": [dataclasses.asdict(e) for e in ests],
        "measured": {
            k: {f: v for f, v in dataclasses.asdict(m).items() if f not in ("manifest", "dir")}
            for k, m in measured.items()
        },
    }
    log(
        f"[dry-run] every stage ran on two samples in {format_duration(report['dry_run_s'])}. "
        f"The full run (rates just measured):\n{table}"
    )
    report["need_bytes"] = check_disk(ests)
    atomic_write_json(scratch / "estimate.json", report)
    report["table"] = table
    return report
