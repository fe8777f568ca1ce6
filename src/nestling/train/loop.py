"""The training loop: capture shards -> trained EAGLE-3 draft, resumable, data-parallel.

One optimizer step consumes `world x grad_accum` packed microbatches, numbered globally so that a
step's data does not depend on how it is split across ranks (1 process x 2 accumulation steps
trains exactly what 2 processes x 1 do). Every input is checked before the first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from nestling.config import to_dict
from nestling.draft.model import DraftConfig, Eagle3Draft
from nestling.draft.vocab import (build_vocab, count_tokens, draft_ids_to_target, load_vocab, save_vocab)
from nestling.errors import NestlingError
from nestling.manifest import MANIFEST, hash_bytes, hash_json, read_manifest, write_manifest
from nestling.progress import Progress, log
from nestling.targets.load import load_config, resolve_target, target_fingerprint
from nestling.train import checkpoint as ckpt
from nestling.train import dist, features
from nestling.train.data import Prefetcher, Stream, collate, read_index
from nestling.train.guard import NonFiniteGuard, check_due, describe_non_finite
from nestling.train.head import read_head, teacher_rows
from nestling.train.loss import simulated_acceptance_length, supervised_counts, teacher, ttt_loss
from nestling.train.metrics import MetricsLog, plot, ttt_metrics
from nestling.train.noise import add_uniform_noise, microbatch_seed
from nestling.train.optim import build_optimizer
from nestling.train.settings import TrainSettings, resolve_lr
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


# ---- inputs, checked before anything is trained -----------------------------------------------------

@dataclass
class Inputs:
    capture_dir: Path
    manifest: dict
    target: Path
    target_fp: str
    hf_config: object
    aux_layer_ids: list[int]
    final_state: str
    train_index: list[dict]
    heldout_index: list[dict]
    online: features.OnlineData | None = None  # set when the target runs in the loop (capture_dir = data dir)


def check_inputs(capture_dir: Path, s: TrainSettings) -> Inputs:
    from safetensors import safe_open

    capture_dir = Path(capture_dir)
    m = read_manifest(capture_dir, "capture")
    layer_ids, aux = list(m.get("layer_ids") or []), list(m.get("aux_layer_ids") or [])
    if not aux or layer_ids[:-1] != aux:
        raise NestlingError(f"capture manifest of {capture_dir} has layer_ids {layer_ids} and aux_layer_ids {aux}: "
                            "expected the aux ids followed by the final state; capture again")
    if s.aux_layer_ids is not None and list(s.aux_layer_ids) != aux:
        raise NestlingError(f"the capture in {capture_dir} holds aux layers {aux}, but the settings ask for "
                            f"{list(s.aux_layer_ids)}: capture again with --layers {','.join(map(str, list(s.aux_layer_ids) + layer_ids[-1:]))} "
                            "or drop aux_layer_ids")
    final_state = m.get("final_state", "post_norm")
    if final_state != "post_norm":  # the draft's teacher reads the target's output: the post-norm state
        raise NestlingError(f"capture {capture_dir} stores final_state {final_state!r}; nestling trains on the "
                            "post-norm final state (what nestling's capture writes): capture again")
    recorded = (m.get("inputs") or {}).get("target")
    tgt = s.target or m.get("target")
    if not tgt:
        raise NestlingError("the capture manifest names no target; pass target=PATH")
    try:
        target = resolve_target(tgt)
    except NestlingError as e:
        raise NestlingError(f"{e} (the target the capture was made from; pass target=PATH if it moved)") from None
    fp = target_fingerprint(target)
    if recorded and fp != recorded:
        raise NestlingError(f"the capture in {capture_dir} was made from another target (fingerprint {recorded}) than "
                            f"{target} ({fp}): train with the target it was captured from, or capture again")
    cfg = load_config(target)
    text = getattr(cfg, "text_config", None) or cfg
    for key, want in (("hidden_size", text.hidden_size), ("vocab_size", text.vocab_size)):
        if m.get(key) is not None and int(m[key]) != int(want):
            raise NestlingError(f"capture {key} {m[key]} differs from the target's {want}: another target's capture")
    n_ids = len(layer_ids)
    index = {split: read_index(capture_dir, split) for split in ("train", "heldout")}
    if not index["train"]:
        raise NestlingError(f"the capture in {capture_dir} holds no training samples; check the data stage's output")
    for split, entries in index.items():
        for shard in sorted({e["shard"] for e in entries}):
            path = capture_dir / split / shard
            if not path.exists():
                raise NestlingError(f"capture shard {path} is missing; run `nestling capture` again to complete it")
            try:
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata() or {}
                    shape = f.get_slice("hidden").get_shape()
            except Exception as e:  # noqa: BLE001 - safetensors' error types vary: a damaged file, whatever the cause
                raise NestlingError(f"capture shard {path} cannot be read ({type(e).__name__}: {str(e)[:200]}): it is "
                                    "cut off or damaged; delete it and run the same `nestling capture` command again "
                                    "to redo it") from None
            if meta.get("layer_ids") not in (None, ",".join(map(str, layer_ids))):
                raise NestlingError(f"shard {path} holds layers {meta['layer_ids']}, the capture manifest says "
                                    f"{layer_ids}: the folder mixes captures; capture again into a fresh folder")
            if list(shape[1:]) != [n_ids, int(text.hidden_size)]:
                raise NestlingError(f"shard {path} holds hidden states of shape [*, {', '.join(map(str, shape[1:]))}], "
                                    f"expected [*, {n_ids}, {text.hidden_size}]: from another target or layer set")
    return Inputs(capture_dir, m, target, fp, cfg, aux, final_state, index["train"], index["heldout"])


def supervised_token_counts(inp: Inputs, vocab_size: int) -> torch.Tensor:
    """Histogram of the supervised (loss_mask) tokens of the training split, read shard by shard."""
    from safetensors import safe_open

    if inp.online is not None:
        return count_tokens(features.supervised_ids(inp), vocab_size)

    def batches():
        for shard in sorted({e["shard"] for e in inp.train_index}):
            with safe_open(str(inp.capture_dir / "train" / shard), "pt") as f:
                ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
            yield ids[mask]

    return count_tokens(batches(), vocab_size)


def make_vocab(inp: Inputs, s: TrainSettings, out: Path, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = supervised_token_counts(inp, vocab_size)
    if counts.sum() == 0:
        raise NestlingError(f"the training split of {inp.capture_dir} has no supervised tokens (loss_mask is all 0); "
                            "check the data stage's chat template / loss mask")
    if s.vocab:
        if not Path(s.vocab).exists():
            raise NestlingError(f"vocabulary file {s.vocab} does not exist")
        d2t, t2d = load_vocab(Path(s.vocab))
    elif (out / "vocab.safetensors").exists():
        d2t, t2d = load_vocab(out / "vocab.safetensors")
    else:
        d2t, t2d = build_vocab(counts, min(s.draft_vocab_size, vocab_size))
    where = s.vocab or out / "vocab.safetensors"
    if t2d.numel() != vocab_size:
        raise NestlingError(f"vocabulary {where} covers a target vocabulary of {t2d.numel()} tokens, the target has "
                            f"{vocab_size}: it belongs to another target; remove it or pass a matching vocab")
    ids = draft_ids_to_target(d2t)
    if ids.numel() != int(t2d.sum()) or not torch.equal(ids, t2d.nonzero().flatten()):
        raise NestlingError(f"vocabulary {where} is inconsistent: d2t and t2d name different tokens")
    if s.vocab is None and ids.numel() != min(s.draft_vocab_size, vocab_size):
        raise NestlingError(f"vocabulary {where} has {ids.numel()} tokens, the settings ask for draft_vocab_size "
                            f"{s.draft_vocab_size}: use a fresh --out folder or the matching setting")
    return d2t, t2d


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


# ---- schedule ----------------------------------------------------------------------------------------

def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
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
    traj = {k: v for k, v in {**to_dict(s), "lr": lr}.items() if k not in (
        "checkpoint_every", "keep_checkpoints", "eval_every", "eval_batches", "log_every", "progress_interval",
        "device", "attention", "compile", "parallel", "teacher_chunk", "target", "vocab", "grad_accum", "steps",
        "epochs", "online", "target_dtype", "heldout_data")}
    return hash_json({"draft": asdict(cfg), "vocab": hash_bytes(d2t.numpy().tobytes()), "target": inp.target_fp,
                      "capture": hash_json(inp.manifest), "settings": traj, "total_steps": total,
                      "global_microbatches": world * s.grad_accum, **features.key_extra(inp, s, device)})


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
    if s.ttt_steps < 1 or s.batch_tokens < 4 or s.grad_accum < 1:
        raise NestlingError("ttt_steps and grad_accum must be >= 1 and batch_tokens >= 4")
    if s.intermediate_size < 0:
        raise NestlingError(f"intermediate_size must be 0 (the target's) or positive, got {s.intermediate_size}")
    features.check_mode(capture_dir, features.is_online(s))
    if s.heldout_data and not features.is_online(s):
        raise NestlingError("heldout_data is an online option (a data folder the target runs over); offline, "
                            "evaluation uses the capture's held-out split")
    inp = features.online_inputs(capture_dir, s) if features.is_online(s) else check_inputs(capture_dir, s)
    if d.main:  # the other ranks write nothing of their own into `out`
        hold.enter_context(claim_out(out, inp, s, resume))
    text = getattr(inp.hf_config, "text_config", None) or inp.hf_config
    V, H = int(text.vocab_size), int(text.hidden_size)
    d2t, t2d = make_vocab(inp, s, out, V)
    cfg = DraftConfig.from_target(inp.hf_config, int(d2t.numel()), inp.aux_layer_ids, target=str(inp.target),
                                  target_fingerprint=inp.target_fp, num_hidden_layers=s.draft_layers)
    if s.intermediate_size:
        cfg.intermediate_size = s.intermediate_size
    G = d.world * s.grad_accum
    train_stream = Stream([e["length"] for e in inp.train_index], s.batch_tokens, s.seed)
    total = s.steps if s.steps is not None else max(1, math.ceil(s.epochs * train_stream.per_epoch() / G))
    lr, lr_why = resolve_lr(s, H, total)
    key = _config_key(cfg, d2t, inp, s, total, d.world, device, lr)

    if (out / MANIFEST).exists():
        old = read_manifest(out, "train")
        if old.get("config_key") == key:
            log(f"[train] {out} already holds this training run; nothing to do")
            return old
        raise NestlingError(f"{out} holds a finished training run of other inputs or settings; use a fresh --out")
    root = out / "checkpoints"
    start_ckpt = None
    if resume:
        cks = ckpt.list_checkpoints(root)
        start_ckpt = Path(resume) if isinstance(resume, (str, Path)) and str(resume) not in ("latest", "True") else (
            cks[-1] if cks else None)
        if start_ckpt is None:
            log(f"[train] --resume: no checkpoint in {root}; starting from step 0")
    elif ckpt.list_checkpoints(root):
        raise NestlingError(f"{out} already holds checkpoints; pass --resume to continue from the latest, or use a fresh --out")
    state = None
    if start_ckpt is not None:
        weights, optim_state, state = ckpt.load(start_ckpt, key)  # checks the configuration first

    # ---- build (same seed on every rank: identical initial weights) ----
    torch.manual_seed(s.seed)
    head = read_head(inp.target, V, H)
    draft = build_draft(cfg, head, d2t, t2d, s.lm_head_init, s.freeze_lm_head)
    amp = _amp(device, s)
    draft.to(device)
    if amp != torch.float32:
        draft.embed_tokens.to(amp)  # frozen: no fp32 master copy needed
    w_draft, w_rest = (w.to(device, amp) for w in teacher_rows(head, d2t, t2d))
    del head
    backend = attention_backend(s.attention, device)
    if backend == "flex" and device.type != "cuda":
        raise NestlingError("attention=flex trains on CUDA only (PyTorch has no flex-attention backward on CPU); "
                            "use attention=auto or attention=mask")
    objective = TTTObjective(draft, s.ttt_steps, s.ttt_decay, backend, s.hidden_noise)
    model = dist.wrap(objective, d, s.parallel, device)
    params = [p for p in model.parameters() if p.requires_grad]
    warmup = s.warmup_steps if s.warmup_steps is not None else int(s.warmup_ratio * total)
    optimizer = build_optimizer(model, s, lr, lambda st: lr_factor(st, total, warmup, s.min_lr_ratio), device)
    step = 0
    if state is not None:
        dist.load_full_state(model, optimizer, weights, optim_state, d, s.parallel)
        optimizer.load_scheduler_state(state["scheduler"])
        ckpt.restore_rng(state)
        step = int(state["step"])
        log(f"[train] resumed from {start_ckpt} at step {step}/{total}")
    fwd = torch.compile(model) if s.compile else model

    # ---- output folder ----
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.clean_partial(root)
        cfg.save(out / "draft_config.json")
        if not (out / "vocab.safetensors").exists():
            save_vocab(out / "vocab.safetensors", d2t, t2d)
    metrics = MetricsLog(out, d.main, truncate_after=step)
    train_ds = features.dataset(inp, "train")
    held_ds = features.dataset(inp, "heldout") if inp.heldout_index else None
    target_fwd = features.target_states(inp, s, device)  # online: the target, run right before each draft step
    target_sw, draft_sw = Stopwatch(device), Stopwatch(device)
    held_stream = Stream([e["length"] for e in inp.heldout_index], s.batch_tokens, s.seed, shuffle=False)
    pad = s.batch_tokens if (s.pad_to_budget if s.pad_to_budget is not None else device.type == "cuda") else None
    K = s.ttt_steps

    def load(mb: list[int], ds) -> PackedBatch:
        return collate([ds[i] for i in mb], s.batch_tokens, pad)

    def prepare(b: PackedBatch, sw: Stopwatch | None = None):
        if target_fwd is not None:
            with sw or contextlib.nullcontext():
                b = target_fwd.fill(b)
        b = b.to(device, amp)
        return b, teacher(b.final, w_draft, w_rest, s.teacher_chunk)

    def autocast():
        return torch.autocast(device.type, dtype=amp) if amp != torch.float32 else contextlib.nullcontext()

    def evaluate() -> dict | None:
        if held_ds is None or s.eval_batches <= 0:
            return None
        n = min(s.eval_batches, held_stream.per_epoch())
        tot = torch.zeros(3, K, dtype=torch.float64, device=device)
        model.eval()
        with torch.no_grad():
            for k in range(math.ceil(n / d.world)):  # the same number of forwards on every rank (FSDP)
                i = k * d.world + d.rank
                b, t = prepare(load(held_stream[i % n], held_ds))
                with autocast():
                    _, sums, correct, count = fwd(b, t, torch.ones(K, dtype=torch.float64))
                if i < n:
                    tot += torch.stack([sums, correct, count])
        model.train()
        tot = dist.all_sum(tot, d).cpu()
        m = ttt_metrics(tot, s.ttt_decay)
        return {**m, "sim_accept_len": simulated_acceptance_length([m[f"acc_{j}"] for j in range(K)]),
                "tokens": int(tot[2, 0])}

    def save_checkpoint(at: int) -> None:
        weights_, optim_ = dist.full_state(model, optimizer, d, s.parallel)
        if d.main:
            ckpt.save(root, at, weights_, optim_, optimizer.scheduler_state(), key,
                      {"microbatches_done": at * G, "total_steps": total, "world": d.world}, s.keep_checkpoints)
        dist.barrier(d)

    if d.main:
        log(f"[train] {len(inp.train_index)} samples, {train_stream.per_epoch()} microbatches/epoch of <= "
            f"{s.batch_tokens} tokens; {total} steps x {G} microbatches; K={K}; draft vocab {cfg.draft_vocab_size}; "
            f"{sum(p.numel() for p in params):,} trainable params; {device} {str(amp).split('.')[-1]}, attention "
            f"{backend}, {d.world} rank(s)")
        log(f"[train] lr {lr:g} ({lr_why}); optimizer {s.optimizer}"
            + (f", muon_lr {s.muon_lr if s.muon_lr is not None else lr:g}" if s.optimizer == "muon" else "")
            + ("; lm_head frozen at the target's rows" if s.freeze_lm_head else "")
            + (f"; hidden_noise {s.hidden_noise:g}" if s.hidden_noise else ""))
    prog = Progress("train", total=total - step, unit="steps", interval=s.progress_interval,
                    state_file=out / "progress.json" if d.main else None) if d.main else None
    interval = torch.zeros(3, K, dtype=torch.float64, device=device)
    interval_tokens, t_last = 0, time.monotonic()
    model.train()
    def load_step(at: int) -> list[PackedBatch]:
        mbs = [train_stream[at * G + a * d.world + d.rank] for a in range(s.grad_accum)]
        bs = [load(mb, train_ds) for mb in mbs]
        return [b.pin() for b in bs] if device.type == "cuda" else bs

    def noise_seed(microbatch: int) -> int | None:  # None without noise: nothing changes per call (compile)
        return microbatch_seed(s.seed, microbatch) if s.hidden_noise > 0 else None

    def step_times() -> dict:
        """This interval's seconds in the target forward (online) and in the draft's steps."""
        t_s, d_s = target_sw.take(), draft_sw.take()
        return {"draft_s": d_s, **({"target_s": t_s, "target_share": t_s / max(t_s + d_s, 1e-9)} if target_fwd else {})}

    guard = NonFiniteGuard(device)

    def samples_of(microbatch: int) -> list[str]:
        return [str(inp.train_index[i].get("sample_id", i)) for i in train_stream[microbatch]]

    def stop_if_non_finite(at: int) -> None:
        if check_due(at, total, (s.log_every, s.eval_every, s.checkpoint_every)):
            try:
                guard.check(d, lambda kind, n: describe_non_finite(kind, n, G, d.world, samples_of, str(capture_dir)))
            except NestlingError:
                prefetch.close()
                raise

    prefetch = Prefetcher(load_step, step, total)
    while step < total:
        batches = prefetch.get()
        denom = dist.all_sum(sum(supervised_counts(b, K) for b in batches), d)
        tokens = int(dist.all_sum(torch.tensor([float(sum(b.num_tokens for b in batches))]), d))
        for a, cpu_batch in enumerate(batches):
            b, t = prepare(cpu_batch, target_sw)
            last = a == s.grad_accum - 1
            sync = contextlib.nullcontext()
            if d.enabled and s.parallel == "ddp" and not last:
                sync = model.no_sync()
            elif d.enabled and s.parallel == "fsdp":
                model.set_requires_gradient_sync(last)
            with sync, draft_sw:
                with autocast():
                    loss, sums, correct, count = fwd(b, t, denom, noise_seed(step * G + a * d.world + d.rank))
                guard.note_loss(loss, step * G + a * d.world + d.rank)
                (loss * d.world).backward()
            interval += torch.stack([sums, correct, count])
        with draft_sw:
            gnorm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip) if s.grad_clip > 0 else None
            guard.note_grad(gnorm if gnorm is not None else torch.nn.utils.get_total_norm(
                [p.grad for p in params if p.grad is not None]), step)
            optimizer.step()  # and the lr schedule
        optimizer.zero_grad(set_to_none=True)
        step += 1
        interval_tokens += tokens
        stop_if_non_finite(step)  # before anything is logged, evaluated or saved from this step's weights
        if step % s.log_every == 0 or step == total:
            now = time.monotonic()
            rec = {"step": step, "split": "train", "lr": optimizer.last_lr(),
                   **ttt_metrics(dist.all_sum(interval, d).cpu(), s.ttt_decay),
                   "grad_norm": float(gnorm) if gnorm is not None else None,
                   "tokens_per_s": interval_tokens / max(now - t_last, 1e-9), **step_times()}
            metrics.write(rec)
            interval.zero_()
            interval_tokens, t_last = 0, now
            if prog:
                prog.extra.update(step=step, loss=rec["loss"], acc_0=rec["acc_0"],
                                  **({"target_share": round(rec["target_share"], 3)} if target_fwd else {}))
        if prog:
            prog.update(1, tokens=tokens)
        if (s.eval_every > 0 and step % s.eval_every == 0) or step == total:
            ev = evaluate()
            if ev is not None:
                metrics.write({"step": step, "split": "heldout", **ev})
                if d.main:
                    log(f"[train] step {step} held-out: loss {ev['loss']:.4f} acc_0 {ev['acc_0']:.3f} "
                        f"simulated acceptance length {ev['sim_accept_len']:.3f}")
        if step % s.checkpoint_every == 0 or step == total:
            save_checkpoint(step)
    prefetch.close()
    if target_fwd is not None:
        target_fwd.close()
    if prog:
        prog.close()

    weights_, _ = dist.full_state(model, optimizer, d, s.parallel)
    manifest: dict = {}
    if d.main:
        from safetensors.torch import save_file

        tmp = out / ".model.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in weights_.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / "model.safetensors")
        metrics.close()
        plot(out / "metrics.jsonl", out / "plot.png")
        last_eval = metrics.last("heldout")
        extra = features.manifest_extra(inp, s, device)
        manifest = write_manifest(
            out, "train", to_dict(s),
            {**extra.pop("inputs"), "target": inp.target_fp},
            config_key=key, lr=lr, lr_reason=lr_why, target=str(inp.target), target_fingerprint=inp.target_fp,
            aux_layer_ids=inp.aux_layer_ids, layer_ids=inp.online.layer_ids if inp.online else inp.manifest.get("layer_ids"),
            **extra, draft_config=asdict(cfg), steps=total,
            world_size=d.world, final_eval=last_eval, final_train=metrics.last("train"))
    dist.barrier(d)
    return manifest if d.main else read_manifest(out, "train")
