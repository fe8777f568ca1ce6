"""The whole job from one config: `nestling run`, its dry run, `nestling status`, `nestling doctor`.

    config.py   the run config (target, inputs, run_dir, one section per stage)
    stages.py   the stage table (what is chained and how each stage is called)
    runner.py   keys, skip / resume / redo, --from / --force
    dryrun.py   two samples through every real stage, then the full run's tokens, disk and time
    state.py    RUN_DIR/state/*.json and RUN_DIR/run.log
    status.py   `nestling status RUN_DIR`
    doctor.py   `nestling doctor`
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from nestling.pipeline.config import RunConfig, load_run_config
from nestling.pipeline.runner import StageOutcome
from nestling.pipeline.runner import run as run_config
from nestling.pipeline.stages import STAGES, Stage, StageContext


def run(config: RunConfig | str | Path, overrides: Sequence[str] = (), *, stages: Sequence[Stage] = STAGES,
        dry_run: bool = False, **kw) -> list[StageOutcome] | dict:
    """`nestling run` as a function: a RunConfig or a YAML path (+ `key=value` overrides)."""
    if not isinstance(config, RunConfig):
        config = load_run_config(Path(config), stages, list(overrides))
    if dry_run:
        from nestling.pipeline.dryrun import dry_run as _dry

        return _dry(config, stages=stages)
    return run_config(config, stages=stages, **kw)


__all__ = ["run", "run_config", "load_run_config", "RunConfig", "Stage", "StageContext", "StageOutcome", "STAGES"]
