"""The trainer end to end on a tiny target's capture: outputs, metrics, teacher, vocabulary, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from capture_fixture import cached_capture, make_capture, one_thread, threads  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file, save_file

from nestling.errors import NestlingError
from nestling.train.run import train
from nestling.train.settings import TrainSettings

TINY = dict(batch_tokens=64, draft_vocab_size=100, ttt_steps=3, lr=3e-3, progress_interval=100.0)


@pytest.fixture(scope="session")
def capture(tiny_target, tmp_path_factory) -> Path:
    return cached_capture(tiny_target("llama"))


@pytest.fixture(scope="session")
def trained(capture, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "train"
    with threads(1):
        train(
            capture,
            out,
            TrainSettings(
                steps=24, checkpoint_every=8, keep_checkpoints=2, eval_every=8, log_every=4, ttt_decay=0.8, **TINY
            ),
        )  # decay != 1: the test sees the weights
    return out


def test_output_folder(trained, capture, tiny_target):
    m = json.loads((trained / "manifest.json").read_text())
    cap = json.loads((capture / "manifest.json").read_text())
    assert m["stage"] == "train" and m["aux_layer_ids"] == cap["aux_layer_ids"] == [1, 3, 5]
    assert m["target_fingerprint"] == cap["inputs"]["target"] and m["steps"] == 24
    for f in ("draft_config.json", "vocab.safetensors", "model.safetensors", "metrics.jsonl", "plot.png"):
        assert (trained / f).stat().st_size > 0, f
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == ["step-00000016", "step-00000024"]
    ck = trained / "checkpoints" / "step-00000024"
    assert {p.name for p in ck.iterdir()} == {"model.safetensors", "optimizer.pt", "state.json"}
    w = load_file(str(trained / "model.safetensors"))
    assert torch.equal(w["fc.weight"], load_file(str(ck / "model.safetensors"))["fc.weight"])
    assert w["fc.weight"].shape == (128, 3 * 128) and w["lm_head.weight"].shape == (100, 128)
    assert w["midlayer.self_attn.q_proj.weight"].shape == (128, 256)
    assert not any(k.startswith(("embed_tokens", "rotary")) for k in w)
    vocab = load_file(str(trained / "vocab.safetensors"))
    assert torch.equal(w["d2t"], vocab["d2t"]) and torch.equal(w["t2d"], vocab["t2d"])
    # the draft vocabulary is the most frequent supervised tokens
    from nestling.capture.store import CaptureDataset

    sup = torch.cat([it["input_ids"][it["loss_mask"]] for it in CaptureDataset(capture, "train")])
    top = torch.bincount(sup, minlength=49152).argsort(descending=True)[:20]
    assert vocab["t2d"][top].all()
    # the export/eval engineer's loader takes the final weights as they are
    from nestling.draft.model import DraftConfig, Eagle3Draft

    d = Eagle3Draft(DraftConfig.load(trained / "draft_config.json"))
    d.load_export_state_dict(w)


def test_metrics_per_step_and_simulated_acceptance(trained):
    recs = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    tr = [r for r in recs if r["split"] == "train"]
    ev = [r for r in recs if r["split"] == "heldout"]
    assert [r["step"] for r in tr] == list(range(4, 25, 4)) and [r["step"] for r in ev] == [8, 16, 24]
    for r in tr + ev:
        assert {"loss_0", "loss_1", "loss_2", "acc_0", "acc_1", "acc_2"} <= set(r)
        torch.testing.assert_close(r["loss"], sum(0.8**j * r[f"loss_{j}"] for j in range(3)))
    for r in ev:
        a = [r[f"acc_{j}"] for j in range(3)]
        torch.testing.assert_close(r["sim_accept_len"], 1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2])
    assert ev[-1]["acc_0"] > 0.2  # held-out continues training prompts: the draft has learned something
    assert tr[-1]["loss"] < tr[0]["loss"]
    assert all(r["tokens_per_s"] > 0 for r in tr)
    state = json.loads((trained / "progress.json").read_text())
    assert state["done"] == 24


def test_teacher_chunks_equal_full_head():
    from nestling.train.loss import teacher

    torch.manual_seed(0)
    final = torch.randn(2, 7, 16)
    lm = torch.randn(50, 16)
    ids = torch.tensor([1, 4, 9, 10, 33])
    rest = torch.ones(50, dtype=torch.bool)
    rest[ids] = False
    t = teacher(final, lm[ids], lm[rest], chunk=3)
    full = final @ lm.T
    torch.testing.assert_close(t.probs, torch.softmax(full[..., ids], -1))
    assert torch.equal(t.in_vocab, torch.isin(full.argmax(-1), ids))
    assert torch.equal(t.argmax, full[..., ids].argmax(-1))


def test_lm_head_init_target_or_random(capture):
    from nestling.train.head import read_head
    from nestling.train.inputs import check_inputs, make_vocab
    from nestling.train.build import build_draft
    from nestling.draft.model import DraftConfig
    from nestling.draft.vocab import draft_ids_to_target

    s = TrainSettings(**TINY)
    inp = check_inputs(capture, s)
    d2t, t2d = make_vocab(inp, s, capture / "nowhere", 49152)
    head = read_head(inp.target, 49152, 128)
    cfg = DraftConfig.from_target(inp.hf_config, 100, inp.aux_layer_ids)
    rows = head.lm_head[draft_ids_to_target(d2t)].float()
    assert torch.equal(build_draft(cfg, head, d2t, t2d, "target").lm_head.weight.data, rows)
    rnd = build_draft(cfg, head, d2t, t2d, "random")
    assert not torch.allclose(rnd.lm_head.weight.data, rows) and torch.equal(rnd.embed_tokens.weight.data, head.embed)


def test_random_lm_head_run_and_rerun_is_a_no_op(capture, tmp_path):
    s = TrainSettings(steps=2, lm_head_init="random", eval_batches=1, **TINY)
    m = train(capture, tmp_path / "r", s)
    assert m["settings"]["lm_head_init"] == "random"
    stamp = (tmp_path / "r" / "model.safetensors").stat().st_mtime_ns
    assert train(capture, tmp_path / "r", s) == m  # complete: nothing is redone
    assert (tmp_path / "r" / "model.safetensors").stat().st_mtime_ns == stamp


def test_wider_draft_mlp_trains_exports_and_decodes(capture, tiny_target, tmp_path):
    """`intermediate_size` widens the draft layer's MLP (small targets: the draft's capacity); the
    exported config says so and the reference decoder loads and runs it."""
    from nestling.evaluate.specdec import load_draft
    from nestling.export.run import export

    train(capture, tmp_path / "w", TrainSettings(steps=2, intermediate_size=320, eval_batches=1, **TINY))
    out = export(tmp_path / "w", tmp_path / "d")
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 320
    assert load_file(str(out / "model.safetensors"))["midlayer.mlp.up_proj.weight"].shape[0] == 320
    from nestling.targets.load import load_model

    draft = load_draft(out, load_model(tiny_target("llama"), dtype="float32"))
    assert draft.config.intermediate_size == 320
    _fails(capture, tmp_path / "bad", "intermediate_size must be", intermediate_size=-1)


def test_two_layer_draft_trains_exports_and_decodes(capture, tiny_target, tmp_path):
    """`draft_layers` stacks plain Llama layers after the first: it trains, the export writes vLLM's
    `layers.N.*` names and `num_hidden_layers`, and the reference decoder loads and runs it."""
    from nestling.evaluate.specdec import SpecDecoder, load_draft, target_generate
    from nestling.export.run import export
    from nestling.targets.load import load_model

    m = train(capture, tmp_path / "w", TrainSettings(steps=2, draft_layers=2, eval_batches=1, **TINY))
    assert m["settings"]["draft_layers"] == 2
    assert json.loads((tmp_path / "w" / "draft_config.json").read_text())["num_hidden_layers"] == 2
    trained = load_file(str(tmp_path / "w" / "model.safetensors"))
    assert trained["layers.1.self_attn.q_proj.weight"].shape == (128, 128)
    out = export(tmp_path / "w", tmp_path / "d")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert {"layers.0.hidden_norm.weight", "layers.1.mlp.up_proj.weight"} <= set(
        load_file(str(out / "model.safetensors"))
    )
    model = load_model(tiny_target("llama"), dtype="float32")
    draft = load_draft(out, model)
    assert draft.num_layers == 2
    out_ids, _ = SpecDecoder(model, draft, k=3).generate([5, 6, 7, 8], 12)
    assert out_ids == target_generate(model, [5, 6, 7, 8], 12)[0]
    _fails(capture, tmp_path / "bad", "at least one decoder layer", draft_layers=0)


EAGLE31_RECIPE = ["draft_fc_norm=true", "draft_norm_output=true", "draft_norm_before_residual=true"]


def test_draft_norms_from_a_recipe_string_train_export_and_decode(capture, tiny_target, tmp_path):
    """The draft norm settings, given as `key=value` (the learning-curve recipes' way): the draft
    trains with them, the export writes vLLM's config keys and `fc_norm.{i}` weights, and the
    reference decoder reloads the folder with the same options and still outputs the target's tokens."""
    from nestling.cli import main
    from nestling.evaluate.specdec import SpecDecoder, load_draft, target_generate
    from nestling.export.run import export
    from nestling.targets.load import load_model

    args = ["--steps", "2", "batch_tokens=64", "draft_vocab_size=100", "eval_batches=1", "progress_interval=100"]
    assert main(["train", str(capture), "--out", str(tmp_path / "w"), *args, *EAGLE31_RECIPE]) == 0
    m = json.loads((tmp_path / "w" / "manifest.json").read_text())
    norms = {"fc_norm": True, "norm_output": True, "norm_before_residual": True}
    assert {k: m["draft_config"][k] for k in norms} == norms
    trained = load_file(str(tmp_path / "w" / "model.safetensors"))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(trained)
    assert not torch.equal(trained["fc_norm.0.weight"], torch.ones(128))  # trained, not left at init
    out = export(tmp_path / "w", tmp_path / "d")
    assert {k: json.loads((out / "config.json").read_text())[k] for k in norms} == norms
    model = load_model(tiny_target("llama"), dtype="float32")
    draft = load_draft(out, model)
    assert all(getattr(draft.config, k) for k in norms)
    out_ids, _ = SpecDecoder(model, draft, k=3).generate([5, 6, 7, 8], 12)
    assert out_ids == target_generate(model, [5, 6, 7, 8], 12)[0]


def test_draft_norms_that_are_off_stay_out_of_the_run_key():
    """A run from before the norm settings existed (norms off) keeps its key (and so its checkpoints
    resume); the EAGLE-3.1 norms (on by default) enter it."""
    from nestling.train.plan import trajectory_settings

    off = dict(draft_fc_norm=False, draft_norm_output=False)
    plain = trajectory_settings(TrainSettings(**off), 1e-3)
    assert not any(k.startswith("draft_") and "norm" in k for k in plain)
    on = trajectory_settings(TrainSettings(**{**off, "draft_fc_norm": True}), 1e-3)
    assert on.pop("draft_fc_norm") is True and on == plain
    default = trajectory_settings(TrainSettings(), 1e-3)
    assert (default.pop("draft_fc_norm"), default.pop("draft_norm_output")) == (True, True) and default == plain


# ---- bad input: one clear error before any training step ---------------------------------------------


def _fails(capture, out, match, resume=False, **kw):
    with pytest.raises(NestlingError, match=match):
        train(capture, out, TrainSettings(**{**TINY, "steps": 2, **kw}), resume=resume)
    assert not (Path(out) / "checkpoints").exists() or not any((Path(out) / "checkpoints").iterdir())
    assert not (Path(out) / "model.safetensors").exists()


def test_capture_of_another_target(capture, tiny_target, tmp_path):
    _fails(capture, tmp_path / "o", "another target", target=str(tiny_target("llama", seed=1)))


def test_other_aux_layer_ids(capture, tmp_path):
    _fails(capture, tmp_path / "o", r"holds aux layers \[1, 3, 5\].*\[2, 3, 4\]", aux_layer_ids=[2, 3, 4])


def test_shard_with_other_layer_ids(capture, tmp_path):
    bad = tmp_path / "cap"
    shutil.copytree(capture, bad)
    shard = bad / "train" / "shard-00001.safetensors"
    t = load_file(str(shard))
    save_file(t, str(shard), metadata={"layer_ids": "1,2,3,6"})
    _fails(bad, tmp_path / "o", "mixes captures")


def test_vocabulary_mismatch(capture, tmp_path):
    save_file(
        {"d2t": torch.zeros(10, dtype=torch.long), "t2d": torch.zeros(32000, dtype=torch.bool)},
        str(tmp_path / "v.safetensors"),
    )
    _fails(capture, tmp_path / "o", "another target", vocab=str(tmp_path / "v.safetensors"))


def test_empty_data(tiny_target, tmp_path):
    empty = make_capture(tmp_path / "cap", tiny_target("llama"), n_train=0, n_heldout=0)
    _fails(empty, tmp_path / "o", "no training samples")


def test_no_supervised_tokens(capture, tmp_path):
    bad = tmp_path / "cap"
    shutil.copytree(capture, bad)
    for shard in (bad / "train").glob("*.safetensors"):
        t = load_file(str(shard))
        t["loss_mask"] = torch.zeros_like(t["loss_mask"])
        save_file(t, str(shard), metadata={"layer_ids": "1,3,5,6"})
    _fails(bad, tmp_path / "o", "no supervised tokens")


def test_resume_from_checkpoint_of_another_configuration(capture, trained, tmp_path):
    out = tmp_path / "o"
    _fails(capture, out, "another configuration", resume=str(trained / "checkpoints" / "step-00000016"), ttt_steps=2)


def test_flex_on_cpu_is_refused(capture, tmp_path):
    _fails(capture, tmp_path / "o", "CUDA only", attention="flex")


def test_existing_checkpoints_need_resume(capture, trained, tmp_path):
    out = tmp_path / "o"  # an interrupted run: a train folder with checkpoints and no manifest yet
    shutil.copytree(trained, out, ignore=shutil.ignore_patterns("manifest.json"))
    with pytest.raises(NestlingError, match="--resume"):
        train(capture, out, TrainSettings(**{**TINY, "steps": 24}))


def test_gpu_code_path_on_cpu_bf16_flex_padded(capture, tmp_path):
    """The CUDA defaults (bf16 autocast, fixed-size padded rows), run on the CPU (flex attention has no
    CPU backward; its forward is held equal to the mask path in test_train_ttt)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = train(
            capture,
            tmp_path / "o",
            TrainSettings(
                **{**TINY, "steps": 3, "eval_batches": 2}, dtype="bfloat16", attention="mask", pad_to_budget=True
            ),
        )
    assert m["final_eval"]["tokens"] > 0 and m["final_train"]["loss"] > 0
    w = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.float32  # fp32 master weights


def test_a_capture_of_the_pre_norm_final_state_is_refused(capture, tmp_path):
    """The teacher reads the target's output, so the final state must be post-norm; the pre-norm
    path is gone and such a store is refused before anything trains."""
    cap = tmp_path / "capture"
    shutil.copytree(capture, cap)
    m = json.loads((cap / "manifest.json").read_text())
    m["final_state"] = "pre_norm"
    (cap / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(NestlingError, match="post-norm final state"):
        train(cap, tmp_path / "train", TrainSettings(steps=1, **TINY))
    assert not (tmp_path / "train" / "manifest.json").exists()


def _target_without(target: Path, copy: Path, tensor: str) -> Path:
    """A copy of `target` whose checkpoint lacks `tensor`: a target made differently from the usual."""
    shutil.copytree(target, copy)
    (weights,) = copy.glob("*.safetensors")
    t = load_file(str(weights))
    del t[tensor]
    save_file(t, str(weights), metadata={"format": "pt"})
    return copy


def test_a_target_without_a_final_norm_tensor_trains_and_vllm_capture_refuses_it(capture, tiny_target, tmp_path):
    """The trainer reads only the target's embedding and lm_head (the capture stores the post-norm final
    state), so a target whose checkpoint has no final norm tensor still trains; the vllm capture backend,
    which applies the final norm itself, refuses it with a clear error."""
    from nestling.capture.vllm import final_norm
    from nestling.targets.load import target_fingerprint

    target = _target_without(tiny_target("llama"), tmp_path / "target", "model.norm.weight")
    cap = tmp_path / "capture"  # the standard capture, recorded as made from the norm-less copy
    shutil.copytree(capture, cap)
    m = json.loads((cap / "manifest.json").read_text())
    m["inputs"]["target"], m["target"] = target_fingerprint(target), str(target)
    (cap / "manifest.json").write_text(json.dumps(m))
    out = train(cap, tmp_path / "train", TrainSettings(**{**TINY, "steps": 2}))
    assert out["steps"] == 2 and (tmp_path / "train" / "model.safetensors").exists()
    with pytest.raises(NestlingError, match="no final norm weight"):
        final_norm(target, json.loads((target / "config.json").read_text()))


def test_a_target_without_an_embedding_tensor_is_refused_by_name(tiny_target, tmp_path):
    from nestling.train.head import read_head

    target = _target_without(tiny_target("llama"), tmp_path / "target", "model.embed_tokens.weight")
    with pytest.raises(NestlingError, match="cannot find the embedding tensor .*model.embed_tokens.weight"):
        read_head(target, 49152, 128)


def test_many_passes_over_the_data_suggest_more_text(capture, tmp_path, capsys):
    from nestling.train.run import PASSES_HINT, passes_hint

    assert passes_hint(PASSES_HINT) is None and passes_hint(5.0) is None
    assert "sampled=1" in (passes_hint(10.0) or "")
    train(capture, tmp_path / "few", TrainSettings(**{**TINY, "epochs": 1.0}))
    assert "passes over the same training data" not in capsys.readouterr().err
    train(capture, tmp_path / "many", TrainSettings(**{**TINY, "epochs": 8.0}))
    assert "8.0 passes over the same training data" in capsys.readouterr().err
