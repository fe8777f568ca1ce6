"""The whole job from one config: `nestling run`, its dry run, `nestling status`, `nestling doctor`, `nestling demo`.

settings.py the run config (target, inputs, run_dir, one section per stage)
run.py      `run` (the Python function) and the runner: keys, skip / resume / redo, --from / --force
cli.py      `nestling run`, `status`, `doctor`, `demo`
stages.py   the stage table (what is chained and how each stage is called)
dryrun.py   two samples through every real stage, then the full run's tokens, disk and time
state.py    RUN_DIR/state/*.json and RUN_DIR/run.log
status.py   `nestling status RUN_DIR`
doctor.py   `nestling doctor`
demo.py     `nestling demo`: the shipped demo config on the embedded assets
"""
