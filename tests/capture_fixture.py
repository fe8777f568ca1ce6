"""Build capture folders in the documented format (docs/formats.md) by running a tiny target.

The trainer's tests must not depend on the capture stage's code, only on its on-disk format, so
this writes exactly what the format says: safetensors shards, index.json, manifest.json.

It also holds what the train tests share: `run_cli` (the CLI in a subprocess), `train_killed_at`
(kill -9 mid-training) and `assert_same_weights` (two runs' weights, bit for bit).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch


# Training settings for a tiny draft on a tiny capture: a few fast steps that still log every one.
TINY_TRAIN = [
    "batch_tokens=64",
    "draft_vocab_size=100",
    "ttt_steps=2",
    "lr=3e-3",
    "progress_interval=100",
    "eval_every=0",
    "log_every=1",
]


@contextlib.contextmanager
def threads(n: int = 1):
    """Tiny shapes on a shared 2-core machine: one thread is ~10-40x faster than two contended ones."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def one_thread():
    with threads(1):
        yield


def make_samples(
    n: int, seed: int, model=None, min_len: int = 8, max_len: int = 32, n_tokens: int = 120, prompt_len: int = 4
):
    """Random prompts from a small set of ids, continued greedily by the target (the supervised part),
    like regenerated data: the target's argmax at supervised positions is the next data token.
    The prompts depend only on the sample number, so held-out samples continue training prompts."""
    g = torch.Generator().manual_seed(7)
    ids_pool = torch.randperm(49152, generator=torch.Generator().manual_seed(1234))[:n_tokens]
    prompts = ids_pool[torch.randint(0, n_tokens, (n, prompt_len), generator=g)]
    if model is not None and n:
        with torch.no_grad():
            seqs = model.generate(
                prompts,
                max_new_tokens=max_len - prompt_len,
                min_new_tokens=max_len - prompt_len,
                do_sample=False,
                pad_token_id=0,
            )
    else:
        seqs = ids_pool[torch.randint(0, n_tokens, (n, max_len), generator=g)]
    lens = torch.randint(min_len, max_len + 1, (n,), generator=torch.Generator().manual_seed(seed))
    out = []
    for i in range(n):
        T = int(lens[i])
        mask = torch.zeros(T, dtype=torch.bool)
        mask[prompt_len:] = True
        out.append((f"s{seed}-{i}", seqs[i, :T].clone(), mask))
    return out


def make_capture(
    out: Path,
    target: Path,
    layer_ids=(1, 3, 5, 6),
    n_train: int = 12,
    n_heldout: int = 4,
    seed: int = 0,
    shard_samples: int = 5,
    dtype: torch.dtype = torch.float32,
    target_fingerprint: str | None = None,
) -> Path:
    from safetensors.torch import save_file

    from nestling.manifest import write_manifest
    from nestling.targets.load import load_config, load_model
    from nestling.targets.load import target_fingerprint as fingerprint

    out = Path(out)
    model = load_model(target, dtype="float32")
    cfg = load_config(target)
    layer_ids = list(layer_ids)
    splits = {}
    for split, n, s in (("train", n_train, seed), ("heldout", n_heldout, seed + 1000)):
        sdir = out / split
        sdir.mkdir(parents=True, exist_ok=True)
        samples = make_samples(n, s, model)
        index = []
        for shard_i, start in enumerate(range(0, max(n, 1), shard_samples)):
            chunk = samples[start : start + shard_samples]
            if not chunk:
                break
            ids_l, mask_l, hid_l = [], [], []
            offset = 0
            for sid, ids, mask in chunk:
                with torch.no_grad():
                    hs = model(ids[None], output_hidden_states=True).hidden_states
                hid_l.append(torch.stack([hs[i][0] for i in layer_ids], dim=1).to(dtype))
                ids_l.append(ids.to(torch.int32))
                mask_l.append(mask.to(torch.uint8))
                index.append(
                    {
                        "sample_id": sid,
                        "shard": f"shard-{shard_i:05d}.safetensors",
                        "offset": offset,
                        "length": len(ids),
                    }
                )
                offset += len(ids)
            save_file(
                {"input_ids": torch.cat(ids_l), "loss_mask": torch.cat(mask_l), "hidden": torch.cat(hid_l)},
                str(sdir / f"shard-{shard_i:05d}.safetensors"),
                metadata={"layer_ids": ",".join(map(str, layer_ids)), "dtype": str(dtype).split(".")[-1]},
            )
        (sdir / "index.json").write_text(json.dumps(index))
        splits[split] = {
            "samples": n,
            "tokens": sum(len(x[1]) for x in samples),
            "supervised_tokens": int(sum(int(x[2].sum()) for x in samples)),
        }
    write_manifest(
        out,
        "capture",
        {},
        {"target": target_fingerprint or fingerprint(target), "tokenizer": "", "data": ""},
        layer_ids=layer_ids,
        aux_layer_ids=layer_ids[:-1],
        final_state="post_norm",
        dtype=str(dtype).split(".")[-1],
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        vocab_size=cfg.vocab_size,
        target=str(target),
        splits=splits,
    )
    return out


def cached_capture(target: Path) -> Path:
    """The standard test capture of `target`, built once into the nestling cache (shared by test files
    and by the subprocesses they start)."""
    from nestling.assets import build_once, cache_dir
    from nestling.manifest import hash_files

    def build(folder: Path) -> None:
        with threads(1):
            make_capture(folder, target)

    key = hash_files(sorted(Path(target).glob("*.safetensors")) + [Path(__file__)])
    return build_once(cache_dir() / "tiny" / f"train-capture-{Path(target).name}-{key}", build, marker="manifest.json")


def run_cli(args: list[str], env_extra: dict | None = None, torchrun: int = 0, popen: bool = False):
    """`python -m nestling ARGS` (or under torchrun) with this worktree's code, one thread per process
    and no dynamic thread adjustment (MKL and OpenMP may otherwise use fewer threads on a loaded
    machine): the thread count decides how CPU GEMMs reduce, so processes that must agree bitwise
    pin it."""
    import os
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[1] / "src")
    pinned = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}
    env = {**os.environ, "PYTHONPATH": src, **pinned, **(env_extra or {})}
    if torchrun:
        torchrun_bin = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun_bin, "--standalone", f"--nproc-per-node={torchrun}", "-m", "nestling", *args]
    else:
        cmd = [sys.executable, "-m", "nestling", *args]
    if popen:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def train_killed_at(data: Path, out: Path, args: list[str], step: int) -> None:
    """`nestling train DATA --out OUT ARGS` in a subprocess, killed -9 as soon as its step-STEP checkpoint
    is whole: a crash mid-run that `--resume` must recover from."""
    import os
    import signal
    import time

    proc = run_cli(["train", str(data), "--out", str(out), *args], popen=True)
    first = out / "checkpoints" / f"step-{step:08d}" / "state.json"
    deadline = time.time() + 240
    while not first.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()  # it really died mid-run


def assert_same_weights(a: Path, b: Path) -> None:
    """The two training folders' model.safetensors hold the same tensors, bit for bit."""
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module", name="tiny")
def tiny_llama(tiny_target) -> Path:
    """A tiny random-weight Llama target, shared by a test file's tests."""
    return tiny_target("llama")


@pytest.fixture(scope="module", name="capture")
def tiny_llama_capture(tiny) -> Path:
    """The standard test capture of the tiny Llama (see cached_capture)."""
    return cached_capture(tiny)


class RunsAShellCommand:
    """A pickled object that runs `touch MARKER` when unpickled: the hostile-input tests plant it in a
    checkpoint or weights file and assert the marker never appears."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))
