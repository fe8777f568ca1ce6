"""`nestling run`: chain the stages in one run folder, skipping what is done and resuming what is not.

Each stage's key is a fingerprint of its settings, of the run-level inputs it reads (target weights,
input files, eval prompts) and of the previous stage's key. So:
- a stage marked complete with the same key is skipped;
- a stage that was interrupted (state `running`/`failed`, same key) is called again on its folder,
  and resumes there by its own means (capture keeps finished shards, train its checkpoints);
- a changed setting changes that stage's key and, through the chain, every later key: those stages
  start again from an empty folder.
`force` redoes the named stages from scratch; `from_stage` redoes that stage and all after it.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from nestling.config import to_dict
from nestling.errors import NestlingError
from nestling.manifest import FORMAT_VERSION, atomic_write_json, hash_bytes, hash_files, hash_json
from nestling.outdir import (
    RUN_FILE,
    check_apart,
    check_links,
    check_ours,
    lock,
    mark,
    only_stage_names,
    owner,
    remove_owned,
)
from nestling.pipeline.settings import RunConfig, load_run_config, resolve_builtin
from nestling.pipeline.stages import STAGES, Stage, StageContext, check_engines, train_mode
from nestling.pipeline.state import (
    RUN_LOG,
    progress_path,
    read_progress,
    read_state,
    state_path,
    tee_stderr,
    write_state,
)
from nestling.progress import PROGRESS_ENV, format_duration, log

# Settings that change how fast or how loudly a stage runs, never what it produces.
NOT_IN_KEY = frozenset(
    {"progress_interval", "ignore_disk_check", "queue_size", "log_interval", "log_every", "num_workers", "workers"}
)


@dataclass
class StageOutcome:
    name: str
    action: str  # "skipped" | "ran" | "resumed"
    key: str
    out: Path
    wall_s: float = 0.0
    result: Any = None


def enabled_stages(config: RunConfig, stages: Sequence[Stage]) -> list[Stage]:
    return [s for s in stages if config.settings.get(s.name) is not None]


def check_stage_names(names: Sequence[str], stages: Sequence[Stage], flag: str) -> None:
    valid = [s.name for s in stages]
    for n in names:
        if n not in valid:
            raise NestlingError(f"{flag} {n!r} is not a stage; stages: {', '.join(valid)}")


def resolve_paths(config: RunConfig) -> tuple[str, list[str], str | None]:
    """Local paths of the target, inputs and prompts (built-in assets fetched), checked to exist."""
    from nestling.targets.load import resolve_target

    target = str(resolve_target(resolve_builtin(config.target)))
    inputs = [resolve_builtin(p) for p in config.inputs]
    for p in inputs:
        if not Path(p).exists():
            raise NestlingError(f"input file {p} does not exist (inputs: in the run config)")
    prompts = resolve_builtin(config.prompts) if config.prompts else None
    if prompts and not Path(prompts).exists():
        raise NestlingError(f"prompts file {prompts} does not exist")
    return target, inputs, prompts


def run_fingerprints(target: str, inputs: list[str], prompts: str | None) -> dict[str, str]:
    from nestling.targets.load import target_fingerprint, tokenizer_files_fingerprint

    files = [Path(p) for p in inputs]
    listed = [f for p in files for f in (sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p])]
    return {
        "target": target_fingerprint(target),
        "tokenizer": tokenizer_files_fingerprint(target),
        "inputs": hash_bytes(*(f"{p}:{hash_files([p])}".encode() for p in listed)),
        "prompts": hash_files([Path(prompts)]) if prompts and Path(prompts).is_file() else str(prompts),
    }


def stage_key(stage: Stage, settings: Any, previous: str, fingerprints: dict[str, str]) -> str:
    s = {k: v for k, v in to_dict(settings).items() if k not in NOT_IN_KEY}
    return hash_json(
        {
            "stage": stage.name,
            "format": FORMAT_VERSION,
            "settings": s,
            "previous": previous,
            "uses": {u: fingerprints[u] for u in stage.uses},
        }
    )


FOREIGN_FIX = "move those files elsewhere, or set run_dir to a new folder"


def clear_stage(run_dir: Path, stage: Stage) -> None:
    """Delete what `stage` wrote in its folder of `run_dir` (only that: see outdir.py). A folder this run
    ran the stage in (it has a state file) is the stage's even when an older nestling left no marker."""
    out = run_dir / stage.name
    # (a folder the user filled or replaced since keeps its files: clearing it is then refused)
    if out.is_dir() and read_state(run_dir, stage.name) is not None and owner(out) is None:
        if only_stage_names(out, stage.name, stage.owns):
            mark(out, stage.name)
    remove_owned(out, stage.name, stage.owns, flag=f"the {stage.name} folder of run_dir", fix=FOREIGN_FIX)
    progress_path(run_dir, stage.name).unlink(missing_ok=True)


def clear_run(run_dir: Path, stages: Sequence[Stage]) -> None:
    """Delete what a run wrote in `run_dir` (each stage's files, then the run's own), nothing else."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    check_ours(run_dir, "run", flag="run folder", fix=FOREIGN_FIX)
    for stage in stages:
        clear_stage(run_dir, stage)
    remove_owned(run_dir, "run", flag="run folder", fix=FOREIGN_FIX)


def check_run_dir(run_dir: Path, stages: Sequence[Stage], target: str, inputs: list[str], prompts: str | None) -> None:
    """Refuse a run folder whose stage folders would hold, or lie inside, the target or an input."""
    named = [("target", target), ("prompts file", prompts), *(("input", p) for p in inputs)]
    for stage in stages:
        check_apart(run_dir / stage.name, named, flag=f"the {stage.name} folder of run_dir")


def run(
    config: RunConfig | str | Path,
    overrides: Sequence[str] = (),
    *,
    stages: Sequence[Stage] = STAGES,
    dry_run: bool = False,
    **kw: Any,
) -> list[StageOutcome] | dict:
    """`nestling run` as a function: a RunConfig or a YAML path (+ `key=value` overrides). `dry_run`:
    two samples through every stage, then the full run's estimate (pipeline/dryrun.py); `kw` go to
    `run_config` (from_stage, force, until, header)."""
    if not isinstance(config, RunConfig):
        config = load_run_config(Path(config), stages, list(overrides))
    if dry_run:
        from nestling.pipeline.dryrun import dry_run as _dry

        return _dry(config, stages=stages)
    return run_config(config, stages=stages, **kw)


def run_config(
    config: RunConfig,
    *,
    stages: Sequence[Stage] = STAGES,
    from_stage: str | None = None,
    force: Sequence[str] = (),
    until: str | None = None,
    dry_run: bool = False,
    header: str = "nestling run",
    after_stage: Callable[[StageOutcome], None] | None = None,
) -> list[StageOutcome]:
    """Run (or continue) the pipeline of `config` in `config.run_dir`; returns what each stage did.

    `after_stage` is called after each stage (the dry run checks the disk as soon as capture is measured).
    """
    check_stage_names([from_stage] if from_stage else [], stages, "--from")
    check_stage_names(list(force), stages, "--force")
    check_stage_names([until] if until else [], stages, "--until")
    enabled = [s.name for s in enabled_stages(config, stages)]
    upto = enabled[: enabled.index(until) + 1] if until in enabled else enabled
    check_engines({n: config.settings[n] for n in upto})  # before any asset is fetched; --until eval-less runs pass
    target, inputs, prompts = resolve_paths(config)
    config, mode_note = train_mode(config, target)
    active = enabled_stages(config, stages)
    names = [s.name for s in active]
    for flag, n in (("--from", from_stage), ("--until", until), *(("--force", f) for f in force)):
        if n and n not in names:
            raise NestlingError(
                f"{flag} {n}: that stage is disabled in this config (add a '{n}:' section"
                + (", or set train.online: false)" if n == "capture" else ")")
            )
    run_dir = Path(config.run_dir)
    check_run_dir(run_dir, active, target, inputs, prompts)
    redo = set(force) | (set(names[names.index(from_stage) :]) if from_stage else set())
    plan = RunPlan(
        config=config,
        active=active,
        run_dir=run_dir,
        target=target,
        inputs=inputs,
        prompts=prompts,
        fingerprints=run_fingerprints(target, inputs, prompts),
        redo=frozenset(redo),
        until=until,
        dry_run=dry_run,
        header=header,
        mode_note=mode_note,
    )
    claim_run_dir(run_dir)
    with run_lock(run_dir):
        return _run(plan, after_stage)


@dataclass(frozen=True)
class RunPlan:
    """What a `nestling run` call resolved before any stage runs: what the stages read and which to redo."""

    config: RunConfig
    active: list[Stage]  # the enabled stages, in order
    run_dir: Path
    target: str
    inputs: list[str]
    prompts: str | None
    fingerprints: dict[str, str]
    redo: frozenset[str]  # stages redone from an empty folder (--force, and --from onwards)
    until: str | None
    dry_run: bool
    header: str
    mode_note: str | None  # why train runs online or offline

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.active]


def claim_run_dir(run_dir: Path) -> None:
    """The run folder is checked like a stage's --out before anything is written into it (its lock,
    run.json, state/): new, empty or a run folder; a folder of someone else's files is refused."""
    check_ours(run_dir, "run", flag="run_dir", fix="set run_dir to a new or empty folder (e.g. runs/NAME)")
    check_links(run_dir, flag="run_dir")  # a stage folder or state/ linked elsewhere would be written through
    run_dir.mkdir(parents=True, exist_ok=True)
    mark(run_dir, "run")


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """One `nestling run` per run folder: two would write the same stage folders."""
    with lock(run_dir, "nestling run", f"wait for it, or watch it with `nestling status {run_dir}`"):
        yield


def _run(plan: RunPlan, after_stage: Callable[[StageOutcome], None] | None) -> list[StageOutcome]:
    run_dir = plan.run_dir
    atomic_write_json(
        run_dir / RUN_FILE,
        {
            "stages": plan.names,
            "config": plan.config.to_dict(),
            "target": plan.target,
            "inputs": plan.inputs,
            "fingerprints": plan.fingerprints,
        },
    )
    outcomes: list[StageOutcome] = []
    previous = ""
    with tee_stderr(run_dir / RUN_LOG, f"{plan.header} {run_dir}"):
        t_run = time.monotonic()
        if plan.mode_note:
            log(f"[run] train: {plan.mode_note}")
        current = None
        try:
            for stage in plan.active:
                current = stage
                key = stage_key(stage, plan.config.settings[stage.name], previous, plan.fingerprints)
                previous = key
                outcomes.append(_do_stage(plan, stage, key))
                current = None
                if after_stage is not None:
                    after_stage(outcomes[-1])
                if stage.name == plan.until:
                    log(f"[run] stopping after {plan.until} (--until)")
                    break
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM (nestling.interrupt): what the rerun keeps
            _note_interrupt(e, plan, outcomes, current)
            raise
        log(
            f"[run] done in {format_duration(time.monotonic() - t_run)}: "
            + ", ".join(f"{o.name} {o.action}" for o in outcomes)
        )
    return outcomes


def _note_interrupt(e: KeyboardInterrupt, plan: RunPlan, outcomes: list[StageOutcome], current: Stage | None) -> None:
    """Attach to the interrupt what the run keeps (the stages complete, what the stage in flight finished)
    for the command line's one line (nestling.interrupt.message)."""
    from nestling.interrupt import kept

    done = [o.name for o in outcomes]
    parts = [f"{', '.join(done)} complete"] if done else []
    if current is not None:
        parts.append(f"{current.name}: {getattr(e, 'kept', None) or kept(current.name, plan.run_dir / current.name)}")
        e.stage = current.name  # type: ignore[attr-defined]
    e.kept = "; ".join(parts) or "nothing yet"  # type: ignore[attr-defined]
    e.resume = "run the same command again to resume (complete stages are skipped)"  # type: ignore[attr-defined]


def _do_stage(plan: RunPlan, stage: Stage, key: str) -> StageOutcome:
    """Skip the stage when it completed with this key, resume it when it was interrupted with this
    key, else run it from an empty folder."""
    out = plan.run_dir / stage.name
    state = read_state(plan.run_dir, stage.name)
    redo = stage.name in plan.redo
    same = state is not None and state.get("key") == key
    if not redo and same and state is not None and state.get("status") == "complete" and out.exists():
        log(f"[run] {stage.name}: complete (key {key}), skipped")
        return StageOutcome(stage.name, "skipped", key, out, state.get("wall_s", 0.0))
    action = "resumed" if same and not redo and out.exists() else "ran"
    if action == "ran":
        why = "forced" if redo else "settings or inputs changed" if state else "first run"
        clear_stage(plan.run_dir, stage)
        log(f"[run] {stage.name}: starting ({why}; key {key})")
    else:
        log(f"[run] {stage.name}: resuming the interrupted run in {out} (key {key})")
    return _run_stage(plan, stage, key, action, state)


def _run_stage(plan: RunPlan, stage: Stage, key: str, action: str, old: dict | None) -> StageOutcome:
    """Call the stage on its folder, with its state (running, then complete or failed) kept on disk."""
    run_dir, out, settings = plan.run_dir, plan.run_dir / stage.name, plan.config.settings[stage.name]
    started = time.time()
    # Wall time accumulates over resumed attempts so estimates and status see the whole cost.
    spent = 0.0
    if old and action == "resumed":
        spent = float(old.get("wall_s", 0.0))
        if old.get("status") == "running" and old.get("started"):  # killed: count up to its last sign of life
            last = max(old.get("updated", 0.0), (read_progress(run_dir, stage.name) or {}).get("updated", 0.0))
            spent += max(last - old["started"], 0.0)
    if old is None:  # a folder this run has not written yet: it must be new, empty or the stage's
        check_ours(out, stage.name, flag=f"the {stage.name} folder of run_dir", fix=FOREIGN_FIX)
    write_state(run_dir, stage.name, key=key, status="running", started=started, wall_s=spent)
    out.mkdir(parents=True, exist_ok=True)
    mark(out, stage.name)  # the stage's from now on: a later redo deletes what it wrote there, nothing else
    ctx = StageContext(
        stage.name, settings, out, run_dir, plan.target, plan.inputs, plan.prompts, tuple(plan.names), plan.dry_run
    )
    previous_env = os.environ.get(PROGRESS_ENV)
    os.environ[PROGRESS_ENV] = str(progress_path(run_dir, stage.name))
    t0 = time.monotonic()
    try:
        result = stage.run(ctx)
    except BaseException as e:
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        write_state(
            run_dir,
            stage.name,
            key=key,
            status=status,
            started=started,
            wall_s=spent + time.monotonic() - t0,
            error=f"{type(e).__name__}: {e}",
        )
        raise
    finally:
        if previous_env is None:
            os.environ.pop(PROGRESS_ENV, None)
        else:
            os.environ[PROGRESS_ENV] = previous_env
    wall = spent + time.monotonic() - t0
    write_state(run_dir, stage.name, key=key, status="complete", started=started, finished=time.time(), wall_s=wall)
    log(f"[run] {stage.name}: {action} in {format_duration(wall)} -> {out}")
    return StageOutcome(stage.name, action, key, out, wall, result)


__all__ = ["run", "StageOutcome", "stage_key", "state_path"]
