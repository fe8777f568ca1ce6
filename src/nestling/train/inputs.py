"""The trainer's inputs, checked before anything is built or trained, and the draft vocabulary.

Every problem a run could meet in its inputs (settings out of range, a capture of another target or
layer set, a missing or damaged shard, a vocabulary of another target) is reported here, before the
first step, as a `NestlingError` that says what to do. The capture always stores the post-norm final
state (`final_state: post_norm`), which the teacher reads as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nestling.draft.vocab import (
    AUTO_COVERAGE,
    AUTO_MIN,
    build_vocab,
    count_tokens,
    draft_ids_to_target,
    load_vocab,
    resolve_size,
)
from nestling.errors import NestlingError
from nestling.capture.store import shard_rows
from nestling.manifest import read_manifest
from nestling.progress import log
from nestling.targets.load import load_config, resolve_target, target_fingerprint
from nestling.train import features
from nestling.train.data import read_index
from nestling.train.settings import TrainSettings


@dataclass
class Inputs:
    """What the run trains on, checked: the folder and its manifest, the target, the split indexes."""

    capture_dir: Path
    manifest: dict
    target: Path
    target_fp: str
    hf_config: object
    aux_layer_ids: list[int]
    train_index: list[dict]
    heldout_index: list[dict]
    online: features.OnlineData | None = None  # set when the target runs in the loop (capture_dir = data dir)


def load_inputs(capture_dir: Path, s: TrainSettings) -> Inputs:
    """The settings that need no input checked first, then a capture folder (offline) or a data folder
    (online, `features.online_inputs`)."""
    if s.ttt_steps < 1 or s.batch_tokens < 4 or s.grad_accum < 1:
        raise NestlingError("ttt_steps and grad_accum must be >= 1 and batch_tokens >= 4")
    if s.intermediate_size < 0:
        raise NestlingError(f"intermediate_size must be 0 (the target's) or positive, got {s.intermediate_size}")
    features.check_mode(capture_dir, features.is_online(s))
    if s.heldout_data and not features.is_online(s):
        raise NestlingError(
            "heldout_data is an online option (a data folder the target runs over); offline, "
            "evaluation uses the capture's held-out split"
        )
    return features.online_inputs(capture_dir, s) if features.is_online(s) else check_inputs(capture_dir, s)


def check_inputs(capture_dir: Path, s: TrainSettings) -> Inputs:
    """A capture folder against its manifest and the target: layers, shapes, every shard readable."""
    from safetensors import safe_open

    capture_dir = Path(capture_dir)
    m = read_manifest(capture_dir, "capture")
    layer_ids, aux = list(m.get("layer_ids") or []), list(m.get("aux_layer_ids") or [])
    if not aux or layer_ids[:-1] != aux:
        raise NestlingError(
            f"capture manifest of {capture_dir} has layer_ids {layer_ids} and aux_layer_ids {aux}: "
            "expected the aux ids followed by the final state; capture again"
        )
    if s.aux_layer_ids is not None and list(s.aux_layer_ids) != aux:
        raise NestlingError(
            f"the capture in {capture_dir} holds aux layers {aux}, but the settings ask for "
            f"{list(s.aux_layer_ids)}: capture again with --layers {','.join(map(str, list(s.aux_layer_ids) + layer_ids[-1:]))} "
            "or drop aux_layer_ids"
        )
    final_state = m.get("final_state", "post_norm")
    if final_state != "post_norm":  # the draft's teacher reads the target's output: the post-norm state
        raise NestlingError(
            f"capture {capture_dir} stores final_state {final_state!r}; nestling trains on the "
            "post-norm final state (what nestling's capture writes): capture again"
        )
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
        raise NestlingError(
            f"the capture in {capture_dir} was made from another target (fingerprint {recorded}) than "
            f"{target} ({fp}): train with the target it was captured from, or capture again"
        )
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
                raise NestlingError(
                    f"capture shard {path} cannot be read ({type(e).__name__}: {str(e)[:200]}): it is "
                    "cut off or damaged; delete it and run the same `nestling capture` command again "
                    "to redo it"
                ) from None
            if meta.get("layer_ids") not in (None, ",".join(map(str, layer_ids))):
                raise NestlingError(
                    f"shard {path} holds layers {meta['layer_ids']}, the capture manifest says "
                    f"{layer_ids}: the folder mixes captures; capture again into a fresh folder"
                )
            rows = shard_rows(entries)[shard]
            if shape[0] != rows:
                raise NestlingError(
                    f"shard {path} holds {shape[0]} token rows, its index.json says {rows}: the index or the shard "
                    "was edited or is damaged; capture again into a new --out folder"
                )
            if list(shape[1:]) != [n_ids, int(text.hidden_size)]:
                raise NestlingError(
                    f"shard {path} holds hidden states of shape [*, {', '.join(map(str, shape[1:]))}], "
                    f"expected [*, {n_ids}, {text.hidden_size}]: from another target or layer set"
                )
    return Inputs(capture_dir, m, target, fp, cfg, aux, index["train"], index["heldout"])


# ---- the draft vocabulary ------------------------------------------------------------------------------


def supervised_token_counts(inp: Inputs, vocab_size: int, split: str = "train") -> torch.Tensor:
    """Histogram of the supervised (loss_mask) tokens of a split, read shard by shard."""
    from safetensors import safe_open

    if inp.online is not None:
        return count_tokens(features.supervised_ids(inp, split), vocab_size)

    def batches():
        index = inp.train_index if split == "train" else inp.heldout_index
        for shard in sorted({e["shard"] for e in index}):
            with safe_open(str(inp.capture_dir / split / shard), "pt") as f:
                ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
            yield ids[mask]

    return count_tokens(batches(), vocab_size)


def vocab_coverage(inp: Inputs, t2d: torch.Tensor, vocab_size: int) -> tuple[float, str]:
    """(share of supervised tokens inside the draft vocabulary, the split it was counted on): the held-out
    split where it has supervised tokens, since the training split's own tokens are all inside whenever it
    shows fewer distinct tokens than the vocabulary holds; else the training split. A token outside is
    never drafted, so this caps acceptance (docs/train.md, "Draft vocabulary")."""
    for split in ("heldout", "train"):
        counts = supervised_token_counts(inp, vocab_size, split)
        if counts.sum():
            return float(counts[t2d].sum()) / float(counts.sum()), split
    return 1.0, "train"  # make_vocab refused a training split without supervised tokens


def make_vocab(inp: Inputs, s: TrainSettings, out: Path, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): a given file, the one a resumed run saved in `out`, or the most frequent supervised
    tokens; checked against the target and the settings, so a draft never trains on another vocabulary."""
    counts = supervised_token_counts(inp, vocab_size)
    if counts.sum() == 0:
        raise NestlingError(
            f"the training split of {inp.capture_dir} has no supervised tokens (loss_mask is all 0); "
            "check the data stage's chat template / loss mask"
        )
    if s.vocab:
        if not Path(s.vocab).exists():
            raise NestlingError(f"vocabulary file {s.vocab} does not exist")
        d2t, t2d = load_vocab(Path(s.vocab))
    elif (out / "vocab.safetensors").exists():
        d2t, t2d = load_vocab(out / "vocab.safetensors")
    else:
        if s.draft_vocab_size > vocab_size:
            log(
                f"[train] draft_vocab_size={s.draft_vocab_size} is larger than the target's vocabulary: the draft "
                f"drafts from all {vocab_size} tokens (draft_vocab_size={vocab_size})"
            )
        d2t, t2d = build_vocab(counts, resolve_size(counts, s.draft_vocab_size))
        if s.draft_vocab_size == 0:
            log(
                f"[train] draft_vocab_size auto: {int(t2d.sum())} tokens, the fewest that cover "
                f"{100 * AUTO_COVERAGE:g}% of the training split's supervised tokens, at least {AUTO_MIN} "
                "(set draft_vocab_size=N to choose)"
            )
    where = s.vocab or out / "vocab.safetensors"
    if t2d.numel() != vocab_size:
        raise NestlingError(
            f"vocabulary {where} covers a target vocabulary of {t2d.numel()} tokens, the target has "
            f"{vocab_size}: it belongs to another target; remove it or pass a matching vocab"
        )
    ids = draft_ids_to_target(d2t)
    if ids.numel() != int(t2d.sum()) or not torch.equal(ids, t2d.nonzero().flatten()):
        raise NestlingError(f"vocabulary {where} is inconsistent: d2t and t2d name different tokens")
    if s.vocab is None and ids.numel() != resolve_size(counts, s.draft_vocab_size):
        asked = s.draft_vocab_size or f"0 (auto: {resolve_size(counts, 0)} for this data)"
        raise NestlingError(
            f"vocabulary {where} has {ids.numel()} tokens, the settings ask for draft_vocab_size "
            f"{asked}: use a fresh --out folder or the matching setting"
        )
    return d2t, t2d
