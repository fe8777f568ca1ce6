"""The training loop: capture shards -> trained EAGLE-3 draft, resumable, data-parallel.

One optimizer step consumes `world x grad_accum` packed microbatches, numbered globally so that a
step's data does not depend on how it is split across ranks (1 process x 2 accumulation steps
trains exactly what 2 processes x 1 do). Every input is checked before the first step (inputs.py).

`train` reads as the run's outline: `plan_run` decides what the run is (vocabulary, steps, lr, the
key a checkpoint must match), `build_run` builds the model and optimizer or resumes them,
`train_step` is one optimizer step, `evaluate` the held-out pass, `save_checkpoint` a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from nestling.config import to_dict
from nestling.draft.model import NORM_OPTIONS, DraftConfig, Eagle3Draft
from nestling.draft.vocab import draft_ids_to_target, save_vocab
from nestling.errors import NestlingError
from nestling.manifest import MANIFEST, hash_bytes, hash_json, read_manifest, write_manifest
from nestling.progress import Progress, log
from nestling.train import checkpoint as ckpt
from nestling.train import dist, features
from nestling.train.data import Prefetcher, Stream, collate
from nestling.train.guard import NonFiniteGuard, check_due, describe_non_finite
from nestling.train.head import read_head, teacher_rows
from nestling.train.inputs import Inputs, load_inputs, make_vocab
from nestling.train.loss import simulated_acceptance_length, supervised_counts, teacher, ttt_loss
from nestling.train.metrics import MetricsLog, plot, ttt_metrics
from nestling.train.noise import add_uniform_noise, microbatch_seed
from nestling.train.optim import Optimizers, build_optimizer
from nestling.train.settings import NORM_SETTING_PREFIX, TrainSettings, draft_norms, resolve_lr
from nestling.train.timing import Stopwatch
from nestling.train.ttt import PackedBatch, attention_backend, ttt_hidden


class TTTObjective(nn.Module):
    """The draft plus its TTT loss behind one `forward`, the entry point DDP and FSDP hook into."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float, backend: str, hidden_noise: float = 0.0):
        super().__init__()
        self.draft, self.steps, self.decay, self.backend = draft, steps, decay, backend
        self.hidden_noise = hidden_noise

    def forward(self, batch: PackedBatch, t, denom: torch.Tensor, noise_seed: int | None = None):
        """`noise_seed`: the training microbatch's seed for `hidden_noise` (train/noise.py); evaluation
        passes none, and a module in eval mode adds no noise either."""
        if self.hidden_noise > 0 and self.training and noise_seed is not None:
            batch = dataclasses.replace(batch, aux=add_uniform_noise(batch.aux, self.hidden_noise, noise_seed))
        try:
            hiddens = ttt_hidden(self.draft, batch, self.steps, self.backend)
        except Exception as e:  # flex needs a working compiler toolchain; the mask path always works
            if self.backend != "flex":
                raise
            log(f"[train] flex attention failed ({type(e).__name__}: {str(e)[:200]}); falling back to attention=mask")
            self.backend = "mask"
            hiddens = ttt_hidden(self.draft, batch, self.steps, self.backend)
        loss, st = ttt_loss(self.draft, hiddens, t, batch, denom, self.decay)
        return loss, st.loss_sum, st.correct, st.count


# ---- building the run: what it is, then the model and optimizer --------------------------------------

def build_draft(cfg: DraftConfig, head, d2t: torch.Tensor, t2d: torch.Tensor, lm_head_init: str,
                freeze_lm_head: bool = False) -> Eagle3Draft:
    """A fresh draft: the target's (frozen) embedding, the vocabulary, and the lm_head either from
    the target's rows of the draft vocabulary or left at its random init; `freeze_lm_head` keeps it
    out of training (as speculators does: the target's own output rows)."""
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(head.embed.float())
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        if lm_head_init == "target":
            draft.lm_head.weight.copy_(head.lm_head[draft_ids_to_target(d2t)].float())
    draft.lm_head.weight.requires_grad_(not freeze_lm_head)
    return draft


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to `min_ratio` of the peak lr."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _amp(device: torch.device, s: TrainSettings) -> torch.dtype:
    if s.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, s.dtype)


def _config_key(cfg: DraftConfig, d2t: torch.Tensor, inp: Inputs, s: TrainSettings, total: int, world: int,
                device: torch.device, lr: float) -> str:
    """What decides the trajectory; a checkpoint resumes only under the same key (`lr`: the one used,
    given or derived)."""
    return hash_json({"draft": cfg.key_fields(), "vocab": hash_bytes(d2t.numpy().tobytes()), "target": inp.target_fp,
                      "capture": hash_json(inp.manifest), "settings": trajectory_settings(s, lr), "total_steps": total,
                      "global_microbatches": world * s.grad_accum, **features.key_extra(inp, s, device)})


def trajectory_settings(s: TrainSettings, lr: float) -> dict:
    """The settings that decide the trajectory (the key's part). Draft norm settings that are off are
    left out, so that runs and checkpoints from before those settings existed keep their key."""
    norm_settings = {NORM_SETTING_PREFIX + k for k in NORM_OPTIONS}
    return {k: v for k, v in {**to_dict(s), "lr": lr}.items() if k not in (
        "checkpoint_every", "keep_checkpoints", "eval_every", "eval_batches", "log_every", "progress_interval",
        "device", "attention", "compile", "parallel", "teacher_chunk", "target", "vocab", "grad_accum", "steps",
        "epochs", "online", "target_dtype", "heldout_data") and not (k in norm_settings and not v)}


@dataclass
class Plan:
    """What the run is, decided from the inputs before anything is built: a finished run or a
    checkpoint is recognised by `key` alone."""

    cfg: DraftConfig
    d2t: torch.Tensor
    t2d: torch.Tensor
    vocab_size: int
    hidden_size: int
    microbatches: int  # per optimizer step, over all ranks (world x grad_accum)
    train_stream: Stream
    total: int  # optimizer steps
    lr: float
    lr_why: str
    key: str


def plan_run(inp: Inputs, s: TrainSettings, out: Path, d: dist.Dist, device: torch.device) -> Plan:
    """The vocabulary, the draft's config, the number of steps and the lr: everything the key covers."""
    text = getattr(inp.hf_config, "text_config", None) or inp.hf_config
    V, H = int(text.vocab_size), int(text.hidden_size)
    d2t, t2d = make_vocab(inp, s, out, V)
    cfg = DraftConfig.from_target(inp.hf_config, int(d2t.numel()), inp.aux_layer_ids, target=str(inp.target),
                                  target_fingerprint=inp.target_fp, num_hidden_layers=s.draft_layers,
                                  **draft_norms(s))
    if s.intermediate_size:
        cfg.intermediate_size = s.intermediate_size
    G = d.world * s.grad_accum
    train_stream = Stream([e["length"] for e in inp.train_index], s.batch_tokens, s.seed)
    total = s.steps if s.steps is not None else max(1, math.ceil(s.epochs * train_stream.per_epoch() / G))
    lr, lr_why = resolve_lr(s, H, total)
    key = _config_key(cfg, d2t, inp, s, total, d.world, device, lr)
    return Plan(cfg, d2t, t2d, V, H, G, train_stream, total, lr, lr_why, key)


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
            raise NestlingError(f"{out} already holds checkpoints; pass --resume to continue from the latest, or use a fresh --out")
        return None
    cks = ckpt.list_checkpoints(root)
    start = Path(resume) if isinstance(resume, (str, Path)) and str(resume) not in ("latest", "True") else (
        cks[-1] if cks else None)
    if start is None:
        log(f"[train] --resume: no checkpoint in {root}; starting from step 0")
    return start


@dataclass
class Run:
    """One training run, built: the draft inside its TTT objective (wrapped for DDP / FSDP), the
    optimizer, the teacher's rows and the step it starts at. The step, evaluation and checkpoint
    functions below read it."""

    s: TrainSettings
    d: dist.Dist
    device: torch.device
    out: Path
    plan: Plan
    model: nn.Module
    fwd: Callable  # `model`, or torch.compile of it
    optimizer: Optimizers
    params: list[nn.Parameter]  # the trainable ones
    amp: torch.dtype
    backend: str  # attention backend
    w_draft: torch.Tensor  # lm_head rows of the draft vocabulary (the teacher)
    w_rest: torch.Tensor  # all other rows
    step: int  # where it starts: 0, or the checkpoint's step

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"


def build_run(inp: Inputs, plan: Plan, s: TrainSettings, out: Path, d: dist.Dist, device: torch.device,
              start: Path | None) -> Run:
    """The model and optimizer, from the same seed on every rank (identical initial weights), then the
    checkpoint's weights, optimizer, schedule and RNG when resuming (its key is checked first)."""
    state = None
    if start is not None:
        weights, optim_state, state = ckpt.load(start, plan.key)  # checks the configuration first
    torch.manual_seed(s.seed)
    head = read_head(inp.target, plan.vocab_size, plan.hidden_size)
    draft = build_draft(plan.cfg, head, plan.d2t, plan.t2d, s.lm_head_init, s.freeze_lm_head)
    amp = _amp(device, s)
    draft.to(device)
    if amp != torch.float32:
        draft.embed_tokens.to(amp)  # frozen: no fp32 master copy needed
    w_draft, w_rest = (w.to(device, amp) for w in teacher_rows(head, plan.d2t, plan.t2d))
    del head
    backend = attention_backend(s.attention, device)
    if backend == "flex" and device.type != "cuda":
        raise NestlingError("attention=flex trains on CUDA only (PyTorch has no flex-attention backward on CPU); "
                            "use attention=auto or attention=mask")
    objective = TTTObjective(draft, s.ttt_steps, s.ttt_decay, backend, s.hidden_noise)
    model = dist.wrap(objective, d, s.parallel, device)
    params = [p for p in model.parameters() if p.requires_grad]
    total = plan.total
    warmup = s.warmup_steps if s.warmup_steps is not None else int(s.warmup_ratio * total)
    optimizer = build_optimizer(model, s, plan.lr, lambda st: lr_factor(st, total, warmup, s.min_lr_ratio), device)
    step = 0
    if state is not None:
        dist.load_full_state(model, optimizer, weights, optim_state, d, s.parallel)
        optimizer.load_scheduler_state(state["scheduler"])
        ckpt.restore_rng(state)
        step = int(state["step"])
        log(f"[train] resumed from {start} at step {step}/{total}")
    fwd = torch.compile(model) if s.compile else model
    return Run(s, d, device, out, plan, model, fwd, optimizer, params, amp, backend, w_draft, w_rest, step)


def start_out(run: Run) -> None:
    """Rank 0 writes the draft config and vocabulary into `out` and drops a half-written checkpoint."""
    if run.d.main:
        run.out.mkdir(parents=True, exist_ok=True)
        ckpt.clean_partial(run.checkpoints)
        run.plan.cfg.save(run.out / "draft_config.json")
        if not (run.out / "vocab.safetensors").exists():
            save_vocab(run.out / "vocab.safetensors", run.plan.d2t, run.plan.t2d)


# ---- the data: microbatches in, the draft's inputs and the teacher on the device ----------------------

@dataclass
class Feed:
    """Where microbatches come from: the streams over both splits, their items, and (online) the
    target that computes the hidden states right before the draft step."""

    train_ds: object
    held_ds: object | None
    train_stream: Stream
    held_stream: Stream
    target_fwd: features.TargetStates | None
    pad: int | None  # pad every batch to the token budget (static shapes on CUDA)


def open_feed(inp: Inputs, s: TrainSettings, device: torch.device, train_stream: Stream) -> Feed:
    """Opened after the model is built: online, the target loads onto the device here."""
    train_ds = features.dataset(inp, "train")
    held_ds = features.dataset(inp, "heldout") if inp.heldout_index else None
    target_fwd = features.target_states(inp, s, device)  # online: the target, run right before each draft step
    held_stream = Stream([e["length"] for e in inp.heldout_index], s.batch_tokens, s.seed, shuffle=False)
    pad = s.batch_tokens if (s.pad_to_budget if s.pad_to_budget is not None else device.type == "cuda") else None
    return Feed(train_ds, held_ds, train_stream, held_stream, target_fwd, pad)


def load_batch(run: Run, feed: Feed, mb: list[int], ds) -> PackedBatch:
    """Items `mb` of `ds` packed into one microbatch of at most `batch_tokens` tokens."""
    return collate([ds[i] for i in mb], run.s.batch_tokens, feed.pad)


def load_step(run: Run, feed: Feed, at: int) -> list[PackedBatch]:
    """This rank's microbatches of step `at`, numbered globally: the same data whatever the split
    over ranks and accumulation steps. Runs in the prefetch thread."""
    G, d = run.plan.microbatches, run.d
    bs = [load_batch(run, feed, feed.train_stream[at * G + a * d.world + d.rank], feed.train_ds)
          for a in range(run.s.grad_accum)]
    return [b.pin() for b in bs] if run.device.type == "cuda" else bs


def on_device(run: Run, feed: Feed, b: PackedBatch, sw: Stopwatch | None = None) -> tuple[PackedBatch, object]:
    """The batch on the device (online: its states from the target first, timed by `sw`) and its
    teacher distribution from the captured post-norm final state."""
    if feed.target_fwd is not None:
        with sw or contextlib.nullcontext():
            b = feed.target_fwd.fill(b)
    b = b.to(run.device, run.amp)
    return b, teacher(b.final, run.w_draft, run.w_rest, run.s.teacher_chunk)


def autocast(run: Run) -> contextlib.AbstractContextManager:
    """Compute in the amp dtype (bf16 on CUDA) over fp32 weights; no autocast when training in fp32."""
    return torch.autocast(run.device.type, dtype=run.amp) if run.amp != torch.float32 else contextlib.nullcontext()


# ---- one step, the metrics, evaluation, checkpoints -------------------------------------------------

def noise_seed(s: TrainSettings, microbatch: int) -> int | None:
    """The microbatch's `hidden_noise` seed; None without noise, so nothing changes per call (compile)."""
    return microbatch_seed(s.seed, microbatch) if s.hidden_noise > 0 else None


@dataclass
class Clocks:
    """Seconds in the target forward (online) and in the draft's steps, reported per log interval."""

    target: Stopwatch
    draft: Stopwatch
    online: bool

    def take(self) -> dict:
        t_s, d_s = self.target.take(), self.draft.take()
        return {"draft_s": d_s, **({"target_s": t_s, "target_share": t_s / max(t_s + d_s, 1e-9)} if self.online else {})}


def train_step(run: Run, feed: Feed, batches: list[PackedBatch], step: int, guard: NonFiniteGuard, clocks: Clocks,
               sums: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """One optimizer step over this rank's microbatches; adds their [loss, correct, count] x K into
    `sums`; returns (the clipped gradient norm, tokens over all ranks). The loss is divided by the
    step's supervised tokens over all ranks (`denom`), so splitting a step changes nothing."""
    s, d, K, G, model = run.s, run.d, run.s.ttt_steps, run.plan.microbatches, run.model
    denom = dist.all_sum(sum(supervised_counts(b, K) for b in batches), d)
    tokens = int(dist.all_sum(torch.tensor([float(sum(b.num_tokens for b in batches))]), d))
    for a, cpu_batch in enumerate(batches):
        b, t = on_device(run, feed, cpu_batch, clocks.target)
        last = a == s.grad_accum - 1
        sync = contextlib.nullcontext()
        if d.enabled and s.parallel == "ddp" and not last:
            sync = model.no_sync()
        elif d.enabled and s.parallel == "fsdp":
            model.set_requires_gradient_sync(last)
        microbatch = step * G + a * d.world + d.rank
        with sync, clocks.draft:
            with autocast(run):
                loss, loss_sum, correct, count = run.fwd(b, t, denom, noise_seed(s, microbatch))
            guard.note_loss(loss, microbatch)
            (loss * d.world).backward()
        sums += torch.stack([loss_sum, correct, count])
    with clocks.draft:
        gnorm = torch.nn.utils.clip_grad_norm_(run.params, s.grad_clip) if s.grad_clip > 0 else None
        guard.note_grad(gnorm if gnorm is not None else torch.nn.utils.get_total_norm(
            [p.grad for p in run.params if p.grad is not None]), step)
        run.optimizer.step()  # and the lr schedule
    run.optimizer.zero_grad(set_to_none=True)
    return gnorm, tokens


def evaluate(run: Run, feed: Feed) -> dict | None:
    """Held-out loss, accuracies and simulated acceptance length over `eval_batches` batches; every
    rank runs the same number of forwards (FSDP needs it), batches past the last count nothing."""
    s, d, K = run.s, run.d, run.s.ttt_steps
    if feed.held_ds is None or s.eval_batches <= 0:
        return None
    n = min(s.eval_batches, feed.held_stream.per_epoch())
    tot = torch.zeros(3, K, dtype=torch.float64, device=run.device)
    run.model.eval()
    with torch.no_grad():
        for k in range(math.ceil(n / d.world)):
            i = k * d.world + d.rank
            b, t = on_device(run, feed, load_batch(run, feed, feed.held_stream[i % n], feed.held_ds))
            with autocast(run):
                _, loss_sum, correct, count = run.fwd(b, t, torch.ones(K, dtype=torch.float64))
            if i < n:
                tot += torch.stack([loss_sum, correct, count])
    run.model.train()
    tot = dist.all_sum(tot, d).cpu()
    m = ttt_metrics(tot, s.ttt_decay)
    return {**m, "sim_accept_len": simulated_acceptance_length([m[f"acc_{j}"] for j in range(K)]),
            "tokens": int(tot[2, 0])}


def save_checkpoint(run: Run, at: int) -> None:
    """Weights, optimizer, schedule and RNG after step `at`, gathered and written by rank 0; every
    rank waits for it, so no rank runs ahead of a checkpoint it may resume from."""
    weights, optim = dist.full_state(run.model, run.optimizer, run.d, run.s.parallel)
    if run.d.main:
        ckpt.save(run.checkpoints, at, weights, optim, run.optimizer.scheduler_state(), run.plan.key,
                  {"microbatches_done": at * run.plan.microbatches, "total_steps": run.plan.total, "world": run.d.world},
                  run.s.keep_checkpoints)
    dist.barrier(run.d)


# ---- the loop ----------------------------------------------------------------------------------------

def train(capture_dir: str | Path, out: str | Path, settings: TrainSettings | None = None,
          resume: bool | str = False) -> dict:
    """Train a draft on `capture_dir` into `out`; returns the manifest. `resume`: True (latest
    checkpoint in `out`) or a checkpoint folder."""
    s = settings or TrainSettings()
    out = Path(out)
    device = torch.device("cuda" if s.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if s.device == "auto" else s.device))
    d = dist.init(device.type)
    if device.type == "cuda":
        device = torch.device("cuda", d.local_rank)
    try:
        with contextlib.ExitStack() as hold:
            return _train(Path(capture_dir), out, s, resume, device, d, hold)
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
    return outdir.claim(out, "train", [
        ("data folder" if inp.online is not None else "capture folder", inp.capture_dir), ("target", inp.target),
        ("vocabulary file", s.vocab), ("held-out data folder", s.heldout_data), ("checkpoint", ckpt_in)])


def _train(capture_dir: Path, out: Path, s: TrainSettings, resume, device: torch.device, d: dist.Dist,
           hold: contextlib.ExitStack) -> dict:
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
    prog = Progress("train", total=plan.total - run.step, unit="steps", interval=s.progress_interval,
                    state_file=out / "progress.json" if d.main else None) if d.main else None
    _run_steps(run, feed, clocks, metrics, prog, inp)
    if feed.target_fwd is not None:
        feed.target_fwd.close()
    if prog:
        prog.close()
    return _finish(run, inp, metrics)


def _announce(run: Run, inp: Inputs) -> None:
    s, plan, d = run.s, run.plan, run.d
    log(f"[train] {len(inp.train_index)} samples, {plan.train_stream.per_epoch()} microbatches/epoch of <= "
        f"{s.batch_tokens} tokens; {plan.total} steps x {plan.microbatches} microbatches; K={s.ttt_steps}; draft vocab "
        f"{plan.cfg.draft_vocab_size}; {sum(p.numel() for p in run.params):,} trainable params; {run.device} "
        f"{str(run.amp).split('.')[-1]}, attention {run.backend}, {d.world} rank(s)")
    log(f"[train] lr {plan.lr:g} ({plan.lr_why}); optimizer {s.optimizer}"
        + (f", muon_lr {s.muon_lr if s.muon_lr is not None else plan.lr:g}" if s.optimizer == "muon" else "")
        + ("; lm_head frozen at the target's rows" if s.freeze_lm_head else "")
        + (f"; hidden_noise {s.hidden_noise:g}" if s.hidden_noise else ""))


def _run_steps(run: Run, feed: Feed, clocks: Clocks, metrics: MetricsLog, prog: Progress | None, inp: Inputs) -> None:
    """Steps from `run.step` to the last; after each, the non-finite check first (nothing is logged,
    evaluated or saved from bad weights), then the log line, evaluation and checkpoint when due."""
    s, d, total, G = run.s, run.d, run.plan.total, run.plan.microbatches
    sums = torch.zeros(3, s.ttt_steps, dtype=torch.float64, device=run.device)  # since the last log line
    interval_tokens, t_last = 0, time.monotonic()
    run.model.train()
    guard = NonFiniteGuard(run.device)

    def samples_of(microbatch: int) -> list[str]:
        return [str(inp.train_index[i].get("sample_id", i)) for i in feed.train_stream[microbatch]]

    step = run.step
    prefetch = Prefetcher(lambda at: load_step(run, feed, at), step, total)
    while step < total:
        gnorm, tokens = train_step(run, feed, prefetch.get(), step, guard, clocks, sums)
        step += 1
        interval_tokens += tokens
        if check_due(step, total, (s.log_every, s.eval_every, s.checkpoint_every)):
            try:
                guard.check(d, lambda kind, n: describe_non_finite(kind, n, G, d.world, samples_of, str(inp.capture_dir)))
            except NestlingError:
                prefetch.close()
                raise
        if step % s.log_every == 0 or step == total:
            now = time.monotonic()
            rec = {"step": step, "split": "train", "lr": run.optimizer.last_lr(),
                   **ttt_metrics(dist.all_sum(sums, d).cpu(), s.ttt_decay),
                   "grad_norm": float(gnorm) if gnorm is not None else None,
                   "tokens_per_s": interval_tokens / max(now - t_last, 1e-9), **clocks.take()}
            metrics.write(rec)
            sums.zero_()
            interval_tokens, t_last = 0, now
            if prog:
                prog.extra.update(step=step, loss=rec["loss"], acc_0=rec["acc_0"],
                                  **({"target_share": round(rec["target_share"], 3)} if clocks.online else {}))
        if prog:
            prog.update(1, tokens=tokens)
        if (s.eval_every > 0 and step % s.eval_every == 0) or step == total:
            ev = evaluate(run, feed)
            if ev is not None:
                metrics.write({"step": step, "split": "heldout", **ev})
                if d.main:
                    log(f"[train] step {step} held-out: loss {ev['loss']:.4f} acc_0 {ev['acc_0']:.3f} "
                        f"simulated acceptance length {ev['sim_accept_len']:.3f}")
        if step % s.checkpoint_every == 0 or step == total:
            save_checkpoint(run, step)
    prefetch.close()


def _finish(run: Run, inp: Inputs, metrics: MetricsLog) -> dict:
    """The trained weights, the plot and the manifest (rank 0), written last: a folder with a
    manifest is a finished run."""
    d, s, plan, out = run.d, run.s, run.plan, run.out
    weights, _ = dist.full_state(run.model, run.optimizer, d, s.parallel)
    manifest: dict = {}
    if d.main:
        from safetensors.torch import save_file

        tmp = out / ".model.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / "model.safetensors")
        metrics.close()
        plot(out / "metrics.jsonl", out / "plot.png")
        last_eval = metrics.last("heldout")
        extra = features.manifest_extra(inp, s, run.device)
        manifest = write_manifest(
            out, "train", to_dict(s),
            {**extra.pop("inputs"), "target": inp.target_fp},
            config_key=plan.key, lr=plan.lr, lr_reason=plan.lr_why, target=str(inp.target),
            target_fingerprint=inp.target_fp, aux_layer_ids=inp.aux_layer_ids,
            layer_ids=inp.online.layer_ids if inp.online else inp.manifest.get("layer_ids"),
            **extra, draft_config=asdict(plan.cfg), steps=plan.total,
            world_size=d.world, final_eval=last_eval, final_train=metrics.last("train"))
    dist.barrier(d)
    return manifest if d.main else read_manifest(out, "train")

