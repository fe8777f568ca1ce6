"""The vllm capture backend against the real vLLM CPU engine (no mocks).

Every engine runs in a `nestling capture` subprocess (vLLM spawns workers, so `LLM` must not be
created inside pytest's process). Parity with the hf backend pins vLLM's layer-id convention,
including id 0 (embeddings) and id L (vLLM gives it before the final norm; the connector applies it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from nestling.capture.store import CaptureDataset, shard_key
from nestling.capture.verify import verify

from vllm_capture_helpers import LAYERS, _cli, _data, _env, _hf_capture  # noqa: F401


@pytest.mark.vllm
def test_vllm_shards_equal_hf_shards(tiny_target, tmp_path):
    target = tiny_target("llama")
    data = _data(tmp_path, target, n_train=10, n_heldout=3, min_words=1, max_words=60)
    # small shards and budget: several shards per split, several engine batches per shard
    opts = ("token_budget=256", "shard_size=200KB", "progress_interval=60")
    r = subprocess.run(
        _cli(data, target, tmp_path / "vllm", *opts), env=_env(), capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    hf = _hf_capture(data, target, tmp_path / "hf", shard_size="200KB")
    vm = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert vm["final_state"] == "post_norm" and "final norm" in vm["final_state_source"]
    assert vm["layer_ids"] == hf["layer_ids"] == [0, 2, 5, 6]
    assert verify(tmp_path / "vllm") == []
    n_shards = 0
    for split in ("train", "heldout"):
        v, h = CaptureDataset(tmp_path / "vllm", split), CaptureDataset(tmp_path / "hf", split)
        assert [e["sample_id"] for e in v.index] == [e["sample_id"] for e in h.index]
        n_shards += len({e["shard"] for e in v.index})
        lengths = set()
        for i in range(len(v)):
            a, b = v[i], h[i]
            assert a["sample_id"] == b["sample_id"]
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
            torch.testing.assert_close(a["aux"], b["aux"], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(a["final"], b["final"], atol=1e-4, rtol=1e-4)
            lengths.add(len(a["input_ids"]))
        assert len(lengths) > 2  # varied lengths, really
    assert n_shards >= 4


@pytest.mark.vllm
def test_vllm_float8_store_reads_back_within_fp8_of_hf(tiny_target, tmp_path):
    """dtype=float8 with vllm: the engine's fp32 rows pass through the scratch file and are quantized by
    the runner; what reads back is within fp8's bound of the hf backend's fp32 store."""
    target = tiny_target("llama")
    data = _data(tmp_path, target, n_train=4, n_heldout=1, min_words=5, max_words=30)
    r = subprocess.run(
        _cli(data, target, tmp_path / "vllm", "dtype=float8", "token_budget=256", "progress_interval=60"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _hf_capture(data, target, tmp_path / "hf")
    m = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert m["dtype"] == "float8" and m["compute_dtype"] == "float32"
    assert verify(tmp_path / "vllm") == []
    v, h = CaptureDataset(tmp_path / "vllm", "train"), CaptureDataset(tmp_path / "hf", "train")
    for i in range(len(v)):
        a, b = v[i], h[i]
        for key in ("aux", "final"):
            H = b["final"].shape[-1]
            x, y = b[key].reshape(len(b[key]), -1, H), a[key].reshape(len(b[key]), -1, H)
            bound = x.abs() / 16 + x.abs().amax(-1, keepdim=True) / 448 * 2.0**-10 + 1e-3 * x.abs() + 1e-4
            assert bool(((y - x).abs() <= bound).all()), key


@pytest.mark.vllm
def test_kill_during_vllm_capture_then_resume(tiny_target, tmp_path):
    target = tiny_target("llama")
    data = _data(tmp_path, target, n_train=40, n_heldout=0)
    out = tmp_path / "cap"
    # ~one sample per shard: many shards, so the kill lands with some complete and one in flight
    opts = ("token_budget=256", "shard_size=40KB", "progress_interval=60")
    log = open(tmp_path / "first.log", "w")
    p = subprocess.Popen(
        _cli(data, target, out, *opts), env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    first = out / "train" / "shard-00000.safetensors"
    deadline = time.time() + 900
    while not first.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.killpg(p.pid, signal.SIGKILL)  # the CLI, its engine core and its worker: a machine crash
    p.wait()
    log.close()
    assert first.exists(), (tmp_path / "first.log").read_text()[-3000:]
    kept = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in (out / "train").glob("shard-*.safetensors")}
    n_total = 40  # upper bound on shards; the first run must have stopped short of the end
    assert not (out / "manifest.json").exists()
    assert len(kept) < n_total

    r = subprocess.run(_cli(data, target, out, *opts), env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert verify(out) == []
    shards = sorted((out / "train").glob("shard-*.safetensors"))
    assert len(shards) > len(kept)  # the rerun wrote what the kill cut off
    assert not list((out / "train").glob(".shard-*.tmp"))
    for f in shards:
        if f.name in kept:  # complete shards were kept, not rewritten
            assert (f.stat().st_ino, f.stat().st_mtime_ns) == kept[f.name]
        assert shard_key(f) is not None
    ds = CaptureDataset(out, "train")
    assert len(ds) == 40 and all(ds[i]["final"].abs().sum() > 0 for i in range(len(ds)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_connector_final_norm_matches_transformers(dtype):
    """The norm the connector applies to vLLM's pre-norm id L is transformers' own, bit for bit in bf16."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from nestling.capture.vllm_connector import apply_final_norm
    from nestling.draft.model import rms_norm

    torch.manual_seed(0)
    x = (torch.randn(7, 64) * 3).to(dtype)
    llama, gemma = LlamaRMSNorm(64, eps=1e-5).to(dtype), Gemma3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        llama.weight.normal_(1.0, 0.2)
        gemma.weight.normal_(0.0, 0.2)
        assert torch.equal(apply_final_norm(x, llama.weight.float(), 1e-5, False), llama(x))
        assert torch.equal(apply_final_norm(x, gemma.weight.float(), 1e-6, True), gemma(x))
        assert torch.equal(rms_norm(x, llama.weight, 1e-5), llama(x))  # the draft's norm is transformers' too


# ---- INT4 routed experts as Kimi-K2.5 ships them (compressed-tensors W4A16 pack-quantized, groups of 32) ----
