"""Tensor parallelism in the hf backend: transformers' own plan under torchrun, on the CPU (gloo).

TP=2 runs as a real `torchrun --nproc-per-node 2 -m nestling capture` (two processes, gloo); its store
must equal a TP=1 capture of the same data. Not bitwise: a row-parallel layer (o_proj, down_proj, the
experts' down_proj) sums two half-width matmuls with an all-reduce instead of one full-width matmul, a
different summation order, so fp32 results differ in the last bits and the difference compounds over
the layers. Measured max abs diff 2.6e-6 (DeepSeek-V3) and 2.9e-6 (Llama) on states of magnitude ~4;
bound 1e-5 absolute + 1e-5 relative.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from capture_data import make_data_dir
from nestling.capture import tp
from nestling.capture.run import capture
from nestling.capture.settings import CaptureSettings
from nestling.capture.store import CaptureDataset
from nestling.capture.verify import verify
from nestling.errors import NestlingError
from nestling.targets.load import load_config

SRC = Path(__file__).resolve().parents[1] / "src"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _torchrun(data: Path, target: Path, out: Path, n: int = 2, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        str(n),
        "-m",
        "nestling",
        "capture",
        str(data),
        "--target",
        str(target),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        *extra,
        "progress_interval=60",
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "llama"])
def test_tp2_states_equal_tp1(arch, tiny_target, llama_kv2, tmp_path):
    target = llama_kv2 if arch == "llama" else tiny_target("deepseek_v3")
    data = make_data_dir(
        tmp_path / "data", AutoTokenizer.from_pretrained(target), target, n_train=6, n_heldout=2, seed=3
    )
    r = _torchrun(data, target, tmp_path / "tp2", 2, "--tensor-parallel-size", "2", "token_budget=512")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "tensor parallel over 2 ranks" in r.stderr
    assert r.stdout.count("capture written to") == 1  # rank 0 reports, the follower stays quiet
    one = capture(
        data,
        target,
        tmp_path / "tp1",
        CaptureSettings(device="cpu", dtype="float32", token_budget=512, progress_interval=60),
    )
    m2 = json.loads((tmp_path / "tp2" / "manifest.json").read_text())
    assert m2["settings"]["tensor_parallel_size"] == 2 and m2["run_key"] == one["run_key"]
    assert verify(tmp_path / "tp2") == []
    # one writer: exactly the files a TP=1 capture writes, no leftover temporaries
    files = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert files(tmp_path / "tp2") == files(tmp_path / "tp1")
    worst = 0.0
    for split in ("train", "heldout"):
        a, b = CaptureDataset(tmp_path / "tp1", split), CaptureDataset(tmp_path / "tp2", split)
        assert len(a) == len(b) > 0
        for i in range(len(a)):
            for k in ("aux", "final"):
                torch.testing.assert_close(b[i][k], a[i][k], atol=1e-5, rtol=1e-5)
                worst = max(worst, (b[i][k] - a[i][k]).abs().max().item())
    assert worst > 0  # really split: the all-reduced sums round differently from one matmul


@pytest.mark.slow
def test_tp_refused_target_stops_every_rank(tiny_target, tmp_path):
    """The stock tiny Llama has 1 KV head: refused from its config on rank 0, and the follower exits too."""
    target = tiny_target("llama")
    data = make_data_dir(tmp_path / "data", AutoTokenizer.from_pretrained(target), target, n_train=2, n_heldout=0)
    r = _torchrun(data, target, tmp_path / "cap", 2, "--tensor-parallel-size", "2")
    assert r.returncode != 0
    assert "num_key_value_heads=1" in r.stderr and "rank 0 failed" in r.stderr
    assert not (tmp_path / "cap" / "manifest.json").exists()


def test_tp_without_torchrun_names_the_command(tiny_target, tmp_path):
    with pytest.raises(NestlingError, match=r"needs 2 processes started by torchrun.*torchrun --nproc-per-node 2"):
        capture(
            tmp_path / "data",
            tiny_target("llama"),
            tmp_path / "cap",
            CaptureSettings(device="cpu", tensor_parallel_size=2),
        )
    assert not (tmp_path / "cap").exists()


def test_torchrun_without_tp_is_refused(monkeypatch, tiny_target, tmp_path):
    """Several processes and tensor_parallel_size 1 would each write the same store."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(NestlingError, match=r"--tensor-parallel-size 2"):
        capture(tmp_path / "data", tiny_target("llama"), tmp_path / "cap", CaptureSettings(device="cpu"))
    with pytest.raises(NestlingError, match=r"vllm backend starts its own workers"):
        capture(
            tmp_path / "data", tiny_target("llama"), tmp_path / "cap", CaptureSettings(backend="vllm", device="cpu")
        )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(device_map="auto"), "exclude each other"),
        (dict(device="cuda:1"), "cuda:LOCAL_RANK"),
    ],
)
def test_tp_settings_refused(monkeypatch, kw, match):
    monkeypatch.setenv("WORLD_SIZE", "2")
    s = CaptureSettings(tensor_parallel_size=2, **kw)
    with pytest.raises(NestlingError, match=match):
        tp.check_settings(s)


def test_tp_target_checks(tiny_target, llama_kv2):
    with pytest.raises(NestlingError, match=r"num_key_value_heads=1.*tensor_parallel_size=2"):
        tp.check_target(load_config(tiny_target("llama")), 2)
    tp.check_target(load_config(llama_kv2), 2)
    tp.check_target(load_config(tiny_target("deepseek_v3")), 2)  # its plan splits MLPs and experts, not MLA
    with pytest.raises(NestlingError, match=r"num_attention_heads=2.*tensor_parallel_size=4"):
        tp.check_target(load_config(llama_kv2), 4)
    cfg = load_config(llama_kv2)
    cfg.quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized"}  # Kimi-K2.5's kind
    with pytest.raises(
        NestlingError, match=r"cannot load a compressed-tensors checkpoint tensor-parallel.*--device-map"
    ):
        tp.check_target(cfg, 2)
    cfg = load_config(llama_kv2)
    cfg.base_model_tp_plan = {}
    with pytest.raises(NestlingError, match=r"no tensor-parallel plan.*--device-map auto"):
        tp.check_target(cfg, 2)
