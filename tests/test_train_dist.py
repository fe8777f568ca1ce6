"""torchrun with two CPU processes (gloo) trains what one process does with the same global batch."""

from __future__ import annotations

import pytest
import torch
from capture_fixture import cached_capture, one_thread, run_cli  # noqa: F401
from safetensors.torch import load_file

ARGS = ["--steps", "4", "--ttt-steps", "3", "batch_tokens=48", "draft_vocab_size=100", "lr=3e-3",
        "eval_every=2", "eval_batches=3", "log_every=1", "progress_interval=100"]


@pytest.fixture(scope="module")
def capture(tiny_target):
    return cached_capture(tiny_target("llama"))


@pytest.fixture(scope="module")
def one_process(capture, tmp_path_factory):
    from nestling.cli import main

    one = tmp_path_factory.mktemp("one") / "train"
    assert main(["train", str(capture), "--out", str(one), *ARGS, "grad_accum=2"]) == 0
    return one


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_equal_one_with_accumulation(capture, one_process, tmp_path, parallel):
    one, two = one_process, tmp_path / "two"
    r = run_cli(["train", str(capture), "--out", str(two), *ARGS, "grad_accum=1", f"parallel={parallel}"], torchrun=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("trained 4 steps") == 1  # rank 0 speaks for the job
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    start = load_file(str(one / "checkpoints" / "step-00000004" / "model.safetensors"))
    assert a.keys() == b.keys() == start.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4, msg=k)
    import json

    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    assert m2["world_size"] == 2 and m1["world_size"] == 1
    torch.testing.assert_close(m1["final_eval"]["loss"], m2["final_eval"]["loss"], atol=1e-5, rtol=1e-5)
