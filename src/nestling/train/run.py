"""The train stage: a capture folder (or, online, a data folder) in, a trained EAGLE-3 draft out;
resumable, data-parallel.

`train` reads as the run's outline: every input is checked before the first step (inputs.py),
`plan_run` decides what the run is (plan.py), `build_run` builds the model and optimizer or resumes
them (build.py), `run_steps` trains (loop.py), and `_finish` writes the weights and the manifest, last.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from pathlib import Path

import torch

from nestling.config import to_dict
from nestling.devices import resolve_device
from nestling.errors import NestlingError
from nestling.manifest import MANIFEST, read_manifest, write_manifest
from nestling.progress import Progress, log
from nestling.train import checkpoint as ckpt
from nestling.train import dist, features
from nestling.train.build import Run, build_run, start_out
from nestling.train.feed import open_feed
from nestling.train.inputs import Inputs, load_inputs
from nestling.train.loop import run_steps
from nestling.train.metrics import MetricsLog, plot
from nestling.train.muon import Muon
from nestling.train.plan import plan_run
from nestling.train.settings import TrainSettings
from nestling.train.timing import Clocks, Stopwatch

# below this share of supervised tokens in the draft vocabulary the log suggests a larger one: measured on
# SmolLM2 (docs/train.md, "Draft vocabulary"), 98% coverage of the served text cost ~0.06 tokens per forward
VOCAB_COVERAGE_HINT = 0.99
# above this many passes over the same training text the log suggests more text instead: measured on
# SmolLM2 at equal data (docs/results/recipe.md, "The training budget"), passes 5 -> 10 over the target's
# greedy answers added 0.02 simulated K=3, one sampled answer per turn at the same steps 0.14
PASSES_HINT = 6.0


def passes_hint(passes: float) -> str | None:
    """The log line for a run that reads its data more than PASSES_HINT times, else None."""
    if passes <= PASSES_HINT:
        return None
    return (
        f"[train] {passes:.1f} passes over the same training data: past ~5, more passes stopped improving "
        "the draft where more target-written text still did (measured on SmolLM2: 10 passes instead of 5 "
        "+0.02 simulated acceptance, one sampled answer per turn at the same steps +0.14). For more text: "
        "more conversations, or `nestling regenerate ... sampled=1` (docs/regenerate.md)"
    )


def train(
    capture_dir: str | Path, out: str | Path, settings: TrainSettings | None = None, resume: bool | str = False
) -> dict:
    """Train a draft on `capture_dir` into `out`; returns the manifest. `resume`: True (latest
    checkpoint in `out`) or a checkpoint folder."""
    s = settings or TrainSettings()
    out = Path(out)
    device = torch.device(resolve_device(s.device))
    d = dist.init(device.type)
    if device.type == "cuda":
        device = torch.device("cuda", d.local_rank)
    try:
        with contextlib.ExitStack() as hold:
            manifest = _train(Path(capture_dir), out, s, resume, device, d, hold)
        # every rank done before the group goes (dist.shutdown says why it also collects garbage first).
        # Not on an error: the peer may never arrive.
        dist.barrier(d)
        return manifest
    finally:
        dist.shutdown(d)


def claim_out(out: Path, inp: Inputs, s: TrainSettings, resume) -> contextlib.AbstractContextManager:
    """Claim `out` for training (outdir.py): apart from every input, new / empty / a train folder, locked.
    A checkpoint to resume from counts as an input unless it is one of `out`'s own."""
    from nestling import outdir

    own = out.resolve() / "checkpoints"
    ckpt_in = Path(resume) if isinstance(resume, (str, Path)) and str(resume) not in ("latest", "True") else None
    if ckpt_in is not None and own in ckpt_in.resolve().parents:
        ckpt_in = None
    return outdir.claim(
        out,
        "train",
        [
            ("data folder" if inp.online is not None else "capture folder", inp.capture_dir),
            ("target", inp.target),
            ("vocabulary file", s.vocab),
            ("held-out data folder", s.heldout_data),
            ("checkpoint", ckpt_in),
        ],
    )


def _train(
    capture_dir: Path,
    out: Path,
    s: TrainSettings,
    resume,
    device: torch.device,
    d: dist.Dist,
    hold: contextlib.ExitStack,
) -> dict:
    inp = load_inputs(capture_dir, s)
    if d.main:  # the other ranks write nothing of their own into `out`
        hold.enter_context(claim_out(out, inp, s, resume))
    plan = plan_run(inp, s, out, d, device)
    if (out / MANIFEST).exists():
        return finished_run(out, plan.key)
    run = build_run(inp, plan, s, out, d, device, resume_point(out, resume))
    start_out(run)
    metrics = MetricsLog(out, d.main, truncate_after=run.step)
    feed = open_feed(inp, s, device, plan.train_stream)
    clocks = Clocks(Stopwatch(device), Stopwatch(device), online=feed.target_fwd is not None)
    if d.main:
        _announce(run, inp)
    prog = (
        Progress(
            "train",
            total=plan.total - run.step,
            unit="steps",
            interval=s.progress_interval,
            state_file=out / "progress.json" if d.main else None,
        )
        if d.main
        else None
    )
    run_steps(run, feed, clocks, metrics, prog, inp)
    if feed.target_fwd is not None:
        feed.target_fwd.close()
    if prog:
        prog.close()
    return _finish(run, inp, metrics)


def finished_run(out: Path, key: str) -> dict:
    """`out` holds a manifest: this very run, done (its manifest), or another one (an error)."""
    old = read_manifest(out, "train")
    if old.get("config_key") == key:
        log(f"[train] {out} already holds this training run; nothing to do")
        return old
    raise NestlingError(f"{out} holds a finished training run of other inputs or settings; use a fresh --out")


def resume_point(out: Path, resume: bool | str | Path) -> Path | None:
    """The checkpoint to start from: the one given, the latest in `out`, or none. Checkpoints in
    `out` without `resume` are an error: a fresh start would delete them."""
    root = out / "checkpoints"
    if not resume:
        if ckpt.list_checkpoints(root):
            raise NestlingError(
                f"{out} already holds checkpoints; pass --resume to continue from the latest, or use a fresh --out"
            )
        return None
    cks = ckpt.list_checkpoints(root)
    start = (
        Path(resume)
        if isinstance(resume, (str, Path)) and str(resume) not in ("latest", "True")
        else (cks[-1] if cks else None)
    )
    if start is None:
        log(f"[train] --resume: no checkpoint in {root}; starting from step 0")
        return None
    newer = [c.name for c in cks if c.name > start.name]
    if newer:  # rotation keeps the highest steps: the run's own new checkpoints would be deleted, step
        # `newer[0]` replaced, and a later --resume would continue from the stale one
        raise NestlingError(
            f"{out} holds checkpoints newer than {start} ({', '.join(newer)}); continuing from {start.name} there "
            f"would delete or replace them. Resume into a fresh --out, or move the newer checkpoints away first."
        )
    return start


def _announce(run: Run, inp: Inputs) -> None:
    s, plan, d = run.s, run.plan, run.d
    log(
        f"[train] {len(inp.train_index)} samples, {plan.train_stream.per_epoch()} microbatches/epoch of <= "
        f"{s.batch_tokens} tokens; {plan.total} steps x {plan.microbatches} microbatches; K={s.ttt_steps}; draft vocab "
        f"{plan.cfg.draft_vocab_size} ({100 * plan.vocab_coverage:.2f}% of the {plan.vocab_coverage_split} "
        "split's supervised tokens); "
        f"{sum(p.numel() for p in run.params):,} trainable params; {run.device} "
        f"{str(run.amp).split('.')[-1]}, attention {run.backend}, {d.world} rank(s)"
    )
    log(
        f"[train] lr {plan.lr:g} ({plan.lr_why}); optimizer {s.optimizer}"
        + (f", muon_lr {s.muon_lr if s.muon_lr is not None else plan.lr:g}" if s.optimizer == "muon" else "")
        + ("; lm_head frozen at the target's rows" if s.head_frozen else "")
        + (f"; hidden_noise {s.hidden_noise:g}" if s.hidden_noise else "")
    )
    hint = passes_hint(plan.total * plan.microbatches / max(1, plan.train_stream.per_epoch()))
    if hint:
        log(hint)
    muon = run.optimizer.parts.get("muon")
    if isinstance(muon, Muon) and muon.ns_dtype != torch.bfloat16:
        log("[train] Muon's Newton-Schulz iterations run in float32: this CPU has no bf16 matmul units (train/muon.py)")
    if plan.vocab_coverage < VOCAB_COVERAGE_HINT and plan.cfg.draft_vocab_size < plan.vocab_size:
        log(
            f"[train] the draft vocabulary leaves {100 * (1 - plan.vocab_coverage):.1f}% of the "
            f"{plan.vocab_coverage_split} split's supervised tokens out: a token outside it is never drafted. A larger "
            f"draft_vocab_size (up to {plan.vocab_size}, the whole vocabulary) raises acceptance at some cost "
            'per draft step (docs/train.md, "Draft vocabulary")'
        )


def _finish(run: Run, inp: Inputs, metrics: MetricsLog) -> dict:
    """The trained weights, the plot and the manifest (rank 0), written last: a folder with a
    manifest is a finished run."""
    d, s, plan, out = run.d, run.s, run.plan, run.out
    weights, _ = dist.full_state(run.model, run.optimizer, d, s.parallel)
    manifest: dict = {}
    if d.main:
        from nestling.inputs import save_safetensors

        tmp = out / ".model.safetensors.tmp"
        try:
            save_safetensors({k: v.contiguous() for k, v in weights.items()}, tmp, metadata={"format": "pt"})
        except BaseException:  # a full disk or a size limit: no half-written file stays behind
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(out / "model.safetensors")
        metrics.close()
        plot(out / "metrics.jsonl", out / "plot.png")
        last_eval = metrics.last("heldout")
        extra = features.manifest_extra(inp, s, run.device)
        manifest = write_manifest(
            out,
            "train",
            to_dict(s),
            {**extra.pop("inputs"), "target": inp.target_fp},
            config_key=plan.key,
            lr=plan.lr,
            lr_reason=plan.lr_why,
            vocab_coverage={"share": round(plan.vocab_coverage, 6), "split": plan.vocab_coverage_split},
            target=str(inp.target),
            target_fingerprint=inp.target_fp,
            aux_layer_ids=inp.aux_layer_ids,
            layer_ids=inp.online.layer_ids if inp.online else inp.manifest.get("layer_ids"),
            **extra,
            draft_config=asdict(plan.cfg),
            steps=plan.total,
            world_size=d.world,
            final_eval=last_eval,
            final_train=metrics.last("train"),
        )
    dist.barrier(d)
    return manifest if d.main else read_manifest(out, "train")
