"""float8 capture stores (`dtype=float8`): half the disk, read back within fp8's stated bound, verified,
resumed byte for byte (tests/test_capture_resume.py), and trained from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from capture_fixture import one_thread  # noqa: F401 (autouse fixture)
from transformers import AutoTokenizer

from capture_data import make_data_dir
from nestling.capture.run import capture
from nestling.capture.settings import CaptureSettings
from nestling.capture.store import FP8, CaptureDataset, bytes_per_token, dequantize_fp8, quantize_fp8
from nestling.cli import main

OPTS = dict(device="cpu", shard_size="40KB", progress_interval=60)


def within_fp8_bound(y: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> bool:
    """e4m3 keeps 3 mantissa bits: round to nearest is off by at most 1/16 of the value for normal
    numbers and half the subnormal step (2^-10 of the scale) below them; 1e-6 for fp32 arithmetic."""
    bound = x.abs() / 16 + scale[..., None] * 2.0**-10 + 1e-6 * x.abs()
    return bool(((y - x).abs() <= bound).all())


def test_quantize_bound_and_zero_vector():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 96, generator=g) * torch.logspace(-4, 4, 64)[:, None, None]
    x[3, 1] = 0  # an all-zero vector: scale 1, zeros back
    x[5, 2, 7] = 1e9  # one outlier sets its vector's scale; the vector's small entries fall to subnormals
    q, scale = quantize_fp8(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (64, 4)
    assert scale[3, 1] == 1 and bool((q[3, 1].float() == 0).all())
    assert bool((q.float().abs().amax(-1)[scale != 1] == 448).all())  # every vector's amax hits fp8's max
    assert within_fp8_bound(dequantize_fp8(q, scale, torch.float32), x, scale)
    q2, scale2 = quantize_fp8(x, chunk=5)  # chunked as on a GPU batch: the same bytes
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)


@pytest.fixture(scope="module")
def stores(tiny_target, tmp_path_factory):
    """The same data captured as float32 and as float8 (the target runs in float32 on the CPU for both)."""
    target = tiny_target("llama")
    tmp = tmp_path_factory.mktemp("fp8")
    data = make_data_dir(
        tmp / "data",
        AutoTokenizer.from_pretrained(target),
        target,
        n_train=8,
        n_heldout=2,
        seed=5,
        min_words=10,
        max_words=30,
    )
    ref = tmp / "f32"
    capture(data, target, ref, CaptureSettings(dtype="float32", **OPTS))
    fp8 = tmp / "fp8"
    capture(data, target, fp8, CaptureSettings(dtype="float8", **OPTS))
    return target, data, ref, fp8


def test_round_trip_within_fp8_bound(stores):
    _, _, ref, fp8 = stores
    m = json.loads((fp8 / "manifest.json").read_text())
    assert m["dtype"] == "float8" and m["compute_dtype"] == "float32"
    n, H = len(m["layer_ids"]), m["hidden_size"]
    assert m["bytes_per_token"] == bytes_per_token(n, H, FP8) == n * H + 4 * n + 5
    a, b = CaptureDataset(ref, "train"), CaptureDataset(fp8, "train")
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for key in ("aux", "final"):
            assert y[key].dtype == torch.float32  # dequantized to the dtype the target ran in
        hx = torch.cat([x["aux"].view(len(x["aux"]), n - 1, H), x["final"][:, None]], 1)
        hy = torch.cat([y["aux"].view(len(y["aux"]), n - 1, H), y["final"][:, None]], 1)
        scale = hx.abs().amax(-1) / 448
        assert within_fp8_bound(hy, hx, scale)
        assert not torch.equal(hx, hy)  # it really is quantized
    size = lambda d: sum(p.stat().st_size for p in (d / "train").glob("shard-*.safetensors"))  # noqa: E731
    tokens = m["splits"]["train"]["tokens"]
    assert size(fp8) - tokens * m["bytes_per_token"] < size(ref) - tokens * (4 * n * H + 5) + 4096  # headers only
    assert size(fp8) < 0.3 * size(ref)  # a quarter of fp32 (half of bf16) plus the scales


def test_verify_passes_good_fp8_store_and_catches_bad_scales_and_nans(stores, tmp_path, capsys):
    import shutil

    _, _, _, fp8 = stores
    assert main(["capture", "--verify", str(fp8)]) == 0
    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    shards = sorted((bad / "train").glob("shard-*.safetensors"))
    for shard, what in ((shards[0], "scale"), (shards[1], "nan")):
        raw = bytearray(shard.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        head = json.loads(raw[8 : 8 + n])
        if what == "scale":
            off = head["hidden_scale"]["data_offsets"][0]
            raw[8 + n + off : 8 + n + off + 4] = bytes(4)  # a zero scale
        else:
            raw[8 + n + 10] = 0x7F  # float8_e4m3fn NaN
        shard.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["capture", "--verify", str(bad)]) == 1
    o = capsys.readouterr().out
    assert f"train/{shards[0].name}: hidden_scale holds values that are not finite and positive" in o
    assert f"train/{shards[1].name}: 1 NaN/Inf values in hidden" in o
    assert f"train/{shards[0].name}: checksum mismatch" in o and f"train/{shards[1].name}: checksum mismatch" in o


def test_train_runs_from_fp8_store(stores, tmp_path):
    from nestling.train.run import train
    from nestling.train.settings import TrainSettings

    _, _, _, fp8 = stores
    s = TrainSettings(
        steps=3,
        batch_tokens=64,
        draft_vocab_size=100,
        ttt_steps=2,
        lr=3e-3,
        eval_batches=1,
        progress_interval=100.0,
        device="cpu",
    )
    m = train(fp8, tmp_path / "train", s)
    losses = [
        json.loads(x)["loss"]
        for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
        if json.loads(x).get("split") == "train"
    ]
    assert m["stage"] == "train" and losses and all(torch.isfinite(torch.tensor(losses)))


def test_fp8_and_bf16_stores_are_different_runs(stores, tmp_path):
    """dtype is part of the run key: a float8 capture never resumes into a float32 folder's shards."""
    target, data, ref, fp8 = stores
    assert (
        json.loads((ref / "manifest.json").read_text())["run_key"]
        != json.loads((fp8 / "manifest.json").read_text())["run_key"]
    )
    assert Path(fp8 / "train" / "checksums.jsonl").exists()
