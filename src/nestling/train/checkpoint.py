"""Checkpoints that resume exactly: weights, optimizer, scheduler, RNG and data position.

`checkpoints/step-XXXXXXXX/` is written under a temporary name and renamed when complete, so a
kill at any moment leaves either the previous checkpoints or the new one, never half of one.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from pathlib import Path

import torch

from nestling.errors import NestlingError

PREFIX = "step-"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    root = Path(root)
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").exists())


def _rng_state() -> dict:
    enc = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    state = {"torch": enc(torch.get_rng_state()), "python": repr(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = [enc(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict) -> None:
    dec = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(dec(state["torch"]))
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([dec(s) for s in state["cuda"]])


def save(
    root: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict,
    scheduler_state: dict,
    config_key: str,
    extra: dict,
    keep: int,
) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep`. A write that fails (a full
    disk, a file-size limit) removes the partial checkpoint and keeps the earlier ones."""
    from nestling.inputs import save_safetensors

    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        save_safetensors({k: v.detach().cpu().contiguous() for k, v in weights.items()}, tmp / "model.safetensors")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        state = {
            "step": step,
            "scheduler": scheduler_state,
            "rng": _rng_state(),
            "config_key": config_key,
            "data_position": {"microbatches_done": extra.get("microbatches_done")},
            **extra,
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1, default=str))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except (OSError, RuntimeError) as e:  # a full disk or a size limit (torch.save's is a RuntimeError)
        shutil.rmtree(tmp, ignore_errors=True)
        kept = list_checkpoints(root)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:200]
        from nestling.outdir import free_bytes
        from nestling.progress import format_bytes

        need, largest = _checkpoint_bytes(weights, optimizer_state)
        raise NestlingError(
            f"could not write checkpoint {final.name} in {root} ({why}); the partial checkpoint was "
            f"removed, "
            + (f"{kept[-1].name} is kept" if kept else "no earlier checkpoint exists")
            + f". A checkpoint needs about {format_bytes(need)} (its largest file {format_bytes(largest)}); "
            f"{format_bytes(free_bytes(root))} is free there."
            + "\n  Free space (or fix the folder) and run the same command with --resume to continue."
        ) from e
    except BaseException:  # anything else (an interrupt): the partial checkpoint goes too
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _checkpoint_bytes(weights: dict[str, torch.Tensor], optimizer_state: dict) -> tuple[int, int]:
    """(bytes of a checkpoint, bytes of its largest file): its weights and the optimizer state's tensors."""

    def tensor_bytes(obj) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, dict):
            return sum(tensor_bytes(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(tensor_bytes(v) for v in obj)
        return 0

    w, o = tensor_bytes(weights), tensor_bytes(optimizer_state)
    return w + o, max(w, o)


def clean_partial(root: Path) -> None:
    """Remove checkpoints that a killed run left half-written."""
    root = Path(root)
    if root.exists():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def load(path: Path, config_key: str) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(weights, optimizer state, state.json) of a checkpoint made with the same configuration."""
    from nestling.inputs import load_safetensors, read_json

    path = Path(path)
    state_file = path / "state.json"
    if not state_file.exists():
        raise NestlingError(f"{path} is not a nestling checkpoint (state.json is missing)")
    hint = "resume from another checkpoint, or train into a new --out without resuming"
    state = read_json(state_file, "checkpoint state", hint=hint)
    if state.get("config_key") != config_key:
        raise NestlingError(
            f"checkpoint {path} was made with another configuration (draft shape, vocabulary, target, data or "
            f"batch settings differ: {state.get('config_key')} != {config_key}); resume with the settings it was "
            f"made with, or start a new --out folder without --resume"
        )
    weights = load_safetensors(path / "model.safetensors", "checkpoint weights", hint)
    return weights, load_optimizer_state(path / "optimizer.pt"), state


def check_weights(path: Path, weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """A checkpoint's weights against the draft they resume: the same names and shapes, every value
    finite. Refused otherwise, before any of it is loaded: a NaN checkpoint would train (and write) a
    NaN model, a reshaped one fail inside torch."""
    from nestling.export.contract import first_problems, non_finite

    problems = [f"missing {n}" for n in expected if n not in weights]
    problems += [f"unexpected {n}" for n in weights if n not in expected]
    problems += [
        f"{n}: shape {tuple(weights[n].shape)}, the draft's is {tuple(t.shape)}"
        for n, t in expected.items()
        if n in weights and weights[n].shape != t.shape
    ]
    problems += non_finite(weights)
    if problems:
        raise NestlingError(
            f"checkpoint {path} cannot be resumed: {first_problems(problems)}. "
            "Resume from another checkpoint, or train into a new --out without resuming"
        )


def load_optimizer_state(path: Path) -> dict:
    """The optimizer state of a checkpoint, unpickled with `weights_only=True`: only tensors and plain
    values load, so a crafted file cannot run code (a full unpickle would call whatever it names)."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "GLOBAL" in ln or "nsupported" in ln), lines[-1] if lines else "")
        raise NestlingError(
            f"refusing to load {path}: it holds objects other than tensors and plain values "
            f"({why[:200]}), which can run code when "
            f"loaded. nestling's checkpoints never do: resume from a checkpoint nestling wrote, or train "
            f"into a new --out without resuming"
        ) from None


def restore_rng(state: dict) -> None:
    _set_rng_state(state["rng"])
