"""Online training (the target in the loop) trains what offline training on a capture of the same data does.

One data-stage folder of target-continued samples, and the capture `nestling capture` makes of it
(hf backend, fp32, CPU): the states an online batch feeds the draft equal the store's, a short run
has the same losses, kill -9 + --resume and 2-process DDP behave as offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from capture_fixture import assert_same_weights, make_samples, one_thread, run_cli, threads, train_killed_at  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file

from nestling.cli import main

ARGS = [
    "--ttt-steps",
    "3",
    "batch_tokens=48",
    "draft_vocab_size=100",
    "lr=3e-3",
    "log_every=1",
    "progress_interval=100",
]


def make_data(out: Path, target: Path, n_train: int = 12, n_heldout: int = 4, prompt_len: int = 4) -> Path:
    """A data-stage folder (docs/formats.md) whose answers the target itself continued greedily, so
    the teacher's tokens fall inside a small draft vocabulary and the losses are not trivially 0."""
    from nestling.data.dataset import Sample, write_shard
    from nestling.manifest import write_manifest
    from nestling.targets.load import load_model, load_tokenizer, tokenizer_fingerprint

    model = load_model(target, dtype="float32")
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, n, seed in (("train", n_train, 0), ("heldout", n_heldout, 1000)):
        ss = [
            Sample(sid, i, ids.tolist(), mask.int().tolist())
            for i, (sid, ids, mask) in enumerate(make_samples(n, seed, model, prompt_len=prompt_len))
        ]
        write_shard(out / f"{split}-00000.parquet", ss)
        splits[split] = {"samples": n, "tokens": sum(len(s.input_ids) for s in ss), "files": [f"{split}-00000.parquet"]}
    write_manifest(
        out,
        "data",
        {},
        {"tokenizer": tokenizer_fingerprint(load_tokenizer(target)), "data": ["test"]},
        target=str(target),
        splits=splits,
    )
    return out


@pytest.fixture(scope="module")
def target(tiny_target) -> Path:
    return tiny_target("llama")


@pytest.fixture(scope="module")
def data(target, tmp_path_factory) -> Path:
    with threads(1):
        return make_data(tmp_path_factory.mktemp("online") / "data", target)


@pytest.fixture(scope="module")
def capture_dir(data, target, tmp_path_factory) -> Path:
    from nestling.capture.run import capture
    from nestling.capture.settings import CaptureSettings

    out = tmp_path_factory.mktemp("online") / "capture"
    with threads(1):
        capture(
            data,
            target,
            out,
            CaptureSettings(
                device="cpu",
                dtype="float32",
                token_budget=1,  # a forward per sample
                progress_interval=60,
            ),
        )
    return out


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out: Path) -> list[tuple]:
    return [(r["step"], r["split"], r["loss"]) for r in _records(out)]


def test_online_states_equal_the_capture_store(data, capture_dir, target):
    """Same samples, same packing (truncation and padding included): the aux and final states an
    online batch hands the draft are the capture store's. The capture runs one sample per forward
    (token_budget=1), so a sample the budget does not cut runs the same forward online: bitwise."""
    from nestling.train import features
    from nestling.train.data import Stream, capture_dataset, collate
    from nestling.train.settings import TrainSettings

    s = TrainSettings(online=True, target=str(target), batch_tokens=20)
    inp = features.online_inputs(data, s)
    cap = capture_dataset(capture_dir, "train")
    tok = features.dataset(inp, "train")
    assert inp.online.layer_ids == json.loads((capture_dir / "manifest.json").read_text())["layer_ids"]
    states = features.target_states(inp, s, torch.device("cpu"))
    assert states.backend.dtype == torch.float32  # capture's rule on a CPU
    stream = Stream(tok.lengths(), s.batch_tokens, seed=0)
    assert any(n > s.batch_tokens for n in tok.lengths())  # some samples are cut to the budget
    for k in range(stream.per_epoch()):
        mb = stream[k]
        off = collate([cap[i] for i in mb], s.batch_tokens, pad_to=s.batch_tokens)
        on = states.fill(collate([tok[i] for i in mb], s.batch_tokens, pad_to=s.batch_tokens))
        assert torch.equal(on.input_ids, off.input_ids) and torch.equal(on.doc, off.doc)
        assert on.aux.dtype == off.aux.dtype and on.aux.shape == off.aux.shape
        for d, i in enumerate(mb):  # a sample run at its stored length: the very same forward
            rows = on.doc[0] == d
            same = tok.lengths()[i] <= s.batch_tokens
            for a, b in ((on.aux[0, rows], off.aux[0, rows]), (on.final[0, rows], off.final[0, rows])):
                # cut to the budget, the forward is shorter: GEMMs of another shape round a few ulps
                # differently (observed <= 1.2e-6 on states of RMS 1; fp32 eps is 1.2e-7)
                assert torch.equal(a, b) if same else ((a - b).abs() / b.abs().clamp_min(1)).max() <= 2e-6, (k, d)
        pad = on.doc[0] == len(mb)  # zeros, as collate pads
        assert not on.aux[0, pad].any() and not on.final[0, pad].any()
        assert not on.aux.is_inference()  # the draft's autograd may save it
    states.close()


def test_online_losses_equal_offline(data, capture_dir, target, tmp_path, capsys):
    off, on = tmp_path / "off", tmp_path / "on"
    assert main(["train", str(capture_dir), "--out", str(off), "--steps", "6", *ARGS]) == 0
    assert main(["train", str(data), "--online", "--target", str(target), "--out", str(on), "--steps", "6", *ARGS]) == 0
    a, b = _losses(off), _losses(on)
    assert len(a) == 7 and a[0][2] > 0
    for x, y in zip(a, b):
        assert x[:2] == y[:2]
        assert abs(x[2] - y[2]) <= 1e-5 * max(1.0, abs(x[2])), (x, y)
    rec = _records(on)[0]
    assert rec["target_s"] > 0 and rec["draft_s"] > 0 and 0 < rec["target_share"] < 1
    m = json.loads((on / "manifest.json").read_text())
    assert m["online"] is True and m["data_dir"] == str(data.resolve()) and "data" in m["inputs"]
    assert m["layer_ids"] == json.loads((off / "manifest.json").read_text())["layer_ids"]
    # an offline checkpoint never resumes online (the key hashes the data manifest and an online marker)
    (off / "manifest.json").unlink()
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                str(data),
                "--online",
                "--target",
                str(target),
                "--out",
                str(off),
                "--steps",
                "6",
                *ARGS,
                "--resume",
            ]
        )
        == 1
    )
    assert "checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_online_kill_then_resume_equals_straight_run(data, target, tmp_path):
    args = ["--online", "--target", str(target), "--steps", "8", *ARGS, "checkpoint_every=3", "eval_every=4"]
    straight = tmp_path / "straight"
    assert main(["train", str(data), "--out", str(straight), *args]) == 0

    out = tmp_path / "killed"
    train_killed_at(data, out, args, step=3)

    r = run_cli(["train", str(data), "--out", str(out), *args, "--resume"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stderr
    assert_same_weights(straight, out)
    assert _losses(straight) == _losses(out)


@pytest.mark.slow
def test_online_ddp_equals_one_process_with_accumulation(data, target, tmp_path):
    args = ["--online", "--target", str(target), "--steps", "3", *ARGS, "eval_every=3", "eval_batches=3"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", str(data), "--out", str(one), *args, "grad_accum=2"]) == 0
    r = run_cli(["train", str(data), "--out", str(two), *args, "grad_accum=1"], torchrun=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("trained 3 steps") == 1
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4, msg=k)
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    assert m2["world_size"] == 2 and m2["online"] is True
    torch.testing.assert_close(m1["final_eval"]["loss"], m2["final_eval"]["loss"], atol=1e-5, rtol=1e-5)


def test_data_folder_without_online_says_what_to_do(data, capture_dir, tmp_path, capsys):
    assert main(["train", str(data), "--out", str(tmp_path / "x"), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "data-stage folder" in err and "--online" in err and "nestling capture" in err
    assert main(["train", str(capture_dir), "--online", "--out", str(tmp_path / "y"), "--steps", "1"]) == 1
    assert "capture folder" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # data tokenized by another tokenizer: its ids mean other text
    import shutil

    other = tmp_path / "other"
    shutil.copytree(data, other)
    m = json.loads((other / "manifest.json").read_text())
    m["inputs"]["tokenizer"] = "0" * 16
    (other / "manifest.json").write_text(json.dumps(m))
    assert main(["train", str(other), "--online", "--out", str(tmp_path / "z"), "--steps", "1"]) == 1
    assert "another tokenizer" in capsys.readouterr().err and not (tmp_path / "z").exists()


def test_pipeline_auto_picks_a_mode_and_says_why(tiny_target, sharegpt_path, tmp_path, capsys, monkeypatch):
    from nestling import engines
    from nestling.train.features import choose_online
    from nestling.train.settings import TrainSettings

    target = tiny_target("llama")
    # the rule on a CPU: one pass online (nothing stored), more passes reread a capture
    assert choose_online(TrainSettings(device="cpu"), target)[0] is True
    online, why = choose_online(TrainSettings(device="cpu", epochs=3), target)
    assert online is False and "epochs 3 > 1" in why
    assert choose_online(TrainSettings(device="cpu", steps=100), target)[0] is False
    assert choose_online(TrainSettings(device="cpu", steps=100, online=True), target) == (True, "train.online is true")
    # the CUDA rule's two sizes (no GPU here): weights in the target dtype, and the draft's estimate
    from nestling.train.features import draft_bytes_estimate, target_weight_bytes

    files = sum(p.stat().st_size for p in Path(target).glob("*.safetensors"))
    assert target_weight_bytes(target, "float32") == 2 * target_weight_bytes(target, "bfloat16")
    assert files in (target_weight_bytes(target, "float32"), target_weight_bytes(target, "bfloat16"))
    small = draft_bytes_estimate(target, TrainSettings(batch_tokens=1024, ttt_steps=3))
    assert 0 < small < draft_bytes_estimate(target, TrainSettings(batch_tokens=4096, ttt_steps=7))

    monkeypatch.setattr(engines, "vllm_installed", lambda: False)  # the reference decoder keeps it short
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"target: {target}\ninputs: [{sharegpt_path}]\nrun_dir: {tmp_path / 'run'}\n"
        "data: {max_length: 128, held_out: 0.1}\n"
        "train: {device: cpu, batch_tokens: 256, ttt_steps: 2, draft_vocab_size: 256}\n"
        "eval: {engine: reference, device: cpu}\n"
    )
    assert main(["run", str(cfg), "--dry-run"]) == 0, capsys.readouterr()
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert "the full run trains online (on a CPU a single pass" in out and "no capture stage" in out
    scratch = tmp_path / "run" / "dry-run"
    assert not (scratch / "capture").exists()
    assert json.loads((scratch / "train" / "manifest.json").read_text())["online"] is True
    report = json.loads((scratch / "estimate.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["data", "train", "export", "eval"]


@pytest.mark.slow
def test_online_heldout_data_replaces_the_heldout_split(data, target, tmp_path, capsys):
    """heldout_data: the evaluation runs over every sample of another data folder (here the same
    folder, so train + heldout), not the training folder's held-out split; it does not change training."""
    from nestling.train import features
    from nestling.train.settings import TrainSettings

    own, other = tmp_path / "own", tmp_path / "other"
    args = ["--online", "--target", str(target), "--steps", "2", *ARGS, "eval_batches=1000"]
    assert main(["train", str(data), "--out", str(own), *args]) == 0
    assert main(["train", str(data), "--out", str(other), *args, f"heldout_data={data}"]) == 0
    ev_own, ev_other = (next(r for r in reversed(_records(o)) if r["split"] == "heldout") for o in (own, other))
    inp = features.online_inputs(data, TrainSettings(online=True, target=str(target), heldout_data=str(data)))
    assert len(inp.heldout_index) == 12 + 4  # every sample of the folder
    assert ev_other["tokens"] > ev_own["tokens"] > 0
    trains = [[(r["step"], r["loss"]) for r in _records(o) if r["split"] == "train"] for o in (own, other)]
    assert trains[0] == trains[1]
    capsys.readouterr()
    assert (
        main(["train", str(data), "--out", str(tmp_path / "off"), "--steps", "2", *ARGS, f"heldout_data={data}"]) == 1
    )  # offline: refused with a message
    assert "online" in capsys.readouterr().err
