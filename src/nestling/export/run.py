"""`nestling export`: a training folder -> a draft folder vLLM and SGLang load untouched.

Steps: check the checkpoint belongs to the target it names (fingerprint), write config.json +
model.safetensors in the engines' layout (native EAGLE-3 or speculators), read the folder back
and check every tensor and config field against `contract.py`, then write the manifest last.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch

from nestling.config import to_dict
from nestling.draft.model import NORM_OPTIONS, DraftConfig
from nestling.draft.vocab import load_vocab
from nestling.errors import NestlingError
from nestling.export import contract
from nestling.export.settings import ExportSettings
from nestling.inputs import read_json
from nestling.manifest import MANIFEST, hash_files, read_manifest, write_manifest
from nestling.progress import format_bytes, log
from nestling.targets.layers import sglang_layer_ids, vllm_layer_ids

BUILD_PREFIX = ".export-build-"  # outdir.OWNS["export"] names it: a crashed build is removed by the next export


def check_target(train_dir: Path, manifest: dict, cfg: DraftConfig, override: str | None) -> Path:
    """The target named by the training folder, verified by fingerprint."""
    from nestling.targets.load import resolve_target, target_fingerprint

    name = override or manifest.get("target") or cfg.target
    if not name:
        raise NestlingError(f"{train_dir}/manifest.json names no target; pass target=PATH")
    if not Path(str(name)).exists():
        raise NestlingError(
            f"the target this draft was trained on, {name}, is not there; "
            f"pass target=PATH (e.g. `nestling export {train_dir} --out DIR target=PATH`)"
        )
    path = resolve_target(name)
    want = (manifest.get("inputs") or {}).get("target") or cfg.target_fingerprint
    have = target_fingerprint(path)
    if not want:
        raise NestlingError(
            f"{train_dir}/manifest.json has no target fingerprint (inputs.target); cannot verify the checkpoint"
        )
    if have != want:
        raise NestlingError(
            f"the checkpoint in {train_dir} was trained on a target with fingerprint {want}, but {path} has "
            f"fingerprint {have} (different config or weights). Export with the target it was trained on "
            f"(target=PATH), or retrain on this one."
        )
    return path


def load_trained(train_dir: Path, checkpoint: str | None) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    from nestling.inputs import load_safetensors

    cfg = DraftConfig.load(train_dir / "draft_config.json")
    weights = Path(checkpoint) / "model.safetensors" if checkpoint else train_dir / "model.safetensors"
    if not weights.exists():
        raise NestlingError(
            f"{weights} is missing: training has not written a final model (run `nestling train` to the end)"
        )
    tensors = load_safetensors(weights, "trained weights", "train again (or give another checkpoint=)")
    vocab = train_dir / "vocab.safetensors"
    if vocab.exists():  # the vocabulary file is authoritative when both are present
        d2t, t2d = load_vocab(vocab)
        tensors["d2t"], tensors["t2d"] = d2t, t2d
    return cfg, tensors


def export(train_dir: str | Path, out: str | Path, settings: ExportSettings | None = None) -> Path:
    """Export the draft in `train_dir` to `out`; returns `out`."""
    from nestling import outdir

    settings = settings or ExportSettings()
    train_dir, out = Path(train_dir), Path(out)
    manifest = read_manifest(train_dir, "train")
    cfg, tensors = load_trained(train_dir, settings.checkpoint)
    target = check_target(train_dir, manifest, cfg, settings.target)
    inputs = [
        ("training folder", train_dir),
        ("target", target),
        ("target", settings.target),
        ("checkpoint", settings.checkpoint),
    ]
    with outdir.claim(out, "export", inputs):
        return _export(train_dir, out, settings, manifest, cfg, tensors, target)


def _export(
    train_dir: Path,
    out: Path,
    settings: ExportSettings,
    manifest: dict,
    cfg: DraftConfig,
    tensors: dict[str, torch.Tensor],
    target: Path,
) -> Path:
    if not cfg.target_fingerprint:
        cfg.target_fingerprint = manifest["inputs"]["target"]
    dtype = contract.FLOAT_DTYPES[settings.dtype]
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    tensors = contract.engine_tensors(tensors, cfg)  # full vocabulary: no d2t / t2d (vLLM refuses them)
    contract.check_tensors(tensors, cfg, dtype, where=f"{train_dir} weights")

    target_cfg = read_json(target / "config.json", "target config", hint="give the target's own folder (target=PATH)")
    native = contract.native_config(cfg, target_cfg, settings.dtype)
    if settings.format == "speculators":
        from nestling.export.speculators import speculators_config

        config = speculators_config(
            native, str(target.resolve()), target_cfg.get("architectures") or [], settings.num_speculative_tokens
        )
    else:
        config = native

    from nestling.inputs import save_safetensors

    for stale in out.glob(f"{BUILD_PREFIX}*"):  # a build a killed export left (we hold the folder's lock)
        shutil.rmtree(stale)
    build = out / f"{BUILD_PREFIX}{os.getpid()}"  # built and verified here, inside the claimed folder
    try:
        build.mkdir()
        try:
            (build / contract.CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            save_safetensors(tensors, build / contract.WEIGHTS, metadata={"format": "pt"})
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            from nestling.outdir import free_bytes

            need = sum(t.numel() * t.element_size() for t in tensors.values())
            limit = (e.strerror or str(e)) + (
                "; a file-size limit (`ulimit -f`) stopped it" if e.errno == errno.EFBIG else ""
            )
            raise NestlingError(
                f"could not write the draft in {out} ({limit}): it needs {format_bytes(need)}, "
                f"{format_bytes(free_bytes(out))} is free there; nothing in {out} was replaced. Free space "
                "(or raise the limit) and run the same command again."
            ) from None
        log(f"[export] {format_bytes((build / contract.WEIGHTS).stat().st_size)} written; reloading it to check it")
        verify(build, cfg, dtype)
        swap_in(build, out)
    finally:
        if build.exists():
            shutil.rmtree(build)
    caveat = sglang_caveat(cfg)
    write_manifest(
        out,
        "export",
        to_dict(settings),
        inputs={"target": cfg.target_fingerprint, "train": hash_files([train_dir / "manifest.json"])},
        target=str(target),
        format=settings.format,
        aux_layer_ids=list(cfg.aux_layer_ids),
        vllm_layer_ids=vllm_layer_ids(cfg.aux_layer_ids),
        sglang_layer_ids=sglang_layer_ids(cfg.aux_layer_ids),
        sglang_caveat=caveat,  # null: SGLang serves this draft as vLLM does
    )
    log(
        f"[export] wrote {settings.format} draft to {out} (aux layers: nestling/vLLM {cfg.aux_layer_ids}, "
        f"SGLang {sglang_layer_ids(cfg.aux_layer_ids)})"
    )
    if caveat:
        log(f"[export] for vLLM: {caveat}")
    return out


def sglang_caveat(cfg: DraftConfig) -> str | None:
    """What in this draft SGLang may not serve as vLLM does (docs/export.md), or None."""
    norms = [n for n in NORM_OPTIONS if getattr(cfg, n)]
    why = [f"the norms {', '.join(norms)} (SGLang at 03d5a77 ignores them)"] if norms else []
    if cfg.num_hidden_layers > 1:
        why.append(f"{cfg.num_hidden_layers} layers (SGLang builds one)")
    if not why:
        return None
    return (
        f"this draft has {' and '.join(why)}; for such an SGLang train with draft_layers=1 "
        "draft_fc_norm=false draft_norm_output=false draft_norm_before_residual=false"
    )


def swap_in(build: Path, out: Path) -> None:
    """Move a complete, verified export from `build` into `out`, file by file (renames, same disk).
    The old manifest goes first, so a crash in between leaves a folder marked incomplete, never a
    mix that looks complete; no other name in `out` is touched."""
    (out / MANIFEST).unlink(missing_ok=True)
    for f in sorted(build.iterdir()):
        os.replace(f, out / f.name)


def verify(folder: Path, cfg: DraftConfig, dtype: torch.dtype) -> None:
    """Read the written folder back the way the engines will, and hold it to the contract."""
    raw, reread, tensors = contract.read_draft_folder(folder)
    layer = raw.get("transformer_layer_config", raw)
    if "speculators_config" in raw:
        top = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", *NORM_OPTIONS)
        contract.check_native_config(
            {**layer, **{k: raw[k] for k in top if k in raw}, "architectures": [contract.ARCHITECTURE]},
            cfg,
            str(folder / contract.CONFIG),
        )
    else:
        contract.check_native_config(raw, cfg, str(folder / contract.CONFIG))
    if reread.aux_layer_ids != list(cfg.aux_layer_ids):
        raise NestlingError(f"{folder}: aux layers read back as {reread.aux_layer_ids}, wrote {cfg.aux_layer_ids}")
    contract.check_tensors(tensors, cfg, dtype, where=str(folder / contract.WEIGHTS))


def check_draft_matches_target(draft_dir: Path, target: str | Path) -> None:
    """Refuse a draft folder exported for another target, whose weights hold NaN/inf, or whose config and
    weights break the export contract (an edited config.json, transposed or reshaped tensors): eval holds
    a draft folder to the same contract export wrote it by, before any engine loads it (used by eval)."""
    from nestling.targets.load import target_fingerprint

    raw, cfg, tensors = contract.read_draft_folder(draft_dir)
    contract.check_finite(tensors, f"the draft in {draft_dir}")
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.bfloat16)
    try:
        contract.check_tensors(tensors, cfg, dtype, where=f"the weights of the draft in {draft_dir}")
    except NestlingError as e:  # its config.json or weights were edited since export
        raise NestlingError(f"{e}. Export the draft again (`nestling export TRAIN_DIR --out DIR`)") from None
    want = cfg.target_fingerprint
    if not want:
        raise NestlingError(f"{draft_dir} carries no target fingerprint (not exported by nestling?)")
    have = target_fingerprint(target)
    if want != have:
        raise NestlingError(
            f"the draft in {draft_dir} was trained for a target with fingerprint {want}, "
            f"but --target {target} has fingerprint {have}; evaluate it with its own target."
        )
