"""Recipe options of the trainer (docs/train.md, "Recipe options"): a frozen lm_head, Muon, noise on
the hidden states, equal step weights and the derived default lr, each on a tiny target's capture."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil

import pytest
import torch
from capture_fixture import assert_same_weights, cached_capture, one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file

from nestling.errors import NestlingError
from nestling.train.run import train
from nestling.train.settings import TrainSettings

TINY = dict(batch_tokens=64, draft_vocab_size=100, ttt_steps=3, lr=3e-3, progress_interval=100.0, log_every=1)


@pytest.fixture(scope="module")
def capture(tiny_target):
    return cached_capture(tiny_target("llama"))


def _initial_draft(capture, s: TrainSettings):
    """The draft as the loop builds it before step 1 (same seed, same vocabulary)."""
    from nestling.draft.model import DraftConfig
    from nestling.train.head import read_head
    from nestling.train.inputs import check_inputs, make_vocab
    from nestling.train.build import build_draft

    inp = check_inputs(capture, s)
    d2t, t2d = make_vocab(inp, s, capture / "nowhere", 49152)
    cfg = DraftConfig.from_target(inp.hf_config, 100, inp.aux_layer_ids)
    torch.manual_seed(s.seed)
    head = read_head(inp.target, 49152, 128)
    return build_draft(cfg, head, d2t, t2d, s.lm_head_init, s.head_frozen), head, d2t


@pytest.mark.parametrize(
    "kw, frozen",
    [({}, True), (dict(lm_head_init="random"), False), (dict(freeze_lm_head=False), False)],
)
def test_lm_head_is_frozen_by_default_when_it_starts_at_the_target_rows(kw, frozen):
    from nestling.config import from_dict

    assert from_dict(TrainSettings, kw).head_frozen is frozen  # lm_head_init=random alone is no error


def test_frozen_lm_head_stays_at_the_target_rows_and_is_exported(capture, tmp_path, capsys):
    """The default (freeze_lm_head unset, lm_head_init=target) freezes the head."""
    from nestling.draft.vocab import draft_ids_to_target
    from nestling.export.run import export

    s = TrainSettings(steps=4, ttt_decay=1.0, eval_batches=1, **TINY)
    m = train(capture, tmp_path / "t", s)
    init, head, d2t = _initial_draft(capture, s)
    rows = head.lm_head[draft_ids_to_target(d2t)].float()
    w = load_file(str(tmp_path / "t" / "model.safetensors"))
    assert torch.equal(w["lm_head.weight"], rows)  # bit for bit: never stepped (no weight decay either)
    assert torch.equal(init.lm_head.weight.data, rows) and not torch.equal(w["fc.weight"], init.fc.weight.data)
    assert not torch.equal(w["midlayer.mlp.up_proj.weight"], init.midlayer.mlp.up_proj.weight.data)
    assert "lm_head frozen" in capsys.readouterr().err
    # ttt_decay 1.0: every step counts equally in the reported loss
    r = m["final_train"]
    torch.testing.assert_close(r["loss"], sum(r[f"loss_{j}"] for j in range(3)))
    out = export(tmp_path / "t", tmp_path / "d")  # in the export dtype (bf16)
    exported = load_file(str(out / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(exported, rows.to(exported.dtype))


def test_muon_splits_hidden_matrices_trains_and_saves_both_states(capture, tmp_path):
    from nestling.draft.model import DraftConfig, Eagle3Draft
    from nestling.train.optim import muon_split

    cfg = DraftConfig(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=50,
        draft_vocab_size=20,
        aux_layer_ids=[1, 2, 3],
        num_target_layers=4,
    )
    d = Eagle3Draft(cfg)
    named = list(d.named_parameters())
    muon, adamw = muon_split(named)
    name = {id(p): n for n, p in named}
    assert sorted(name[id(p)] for p in muon) == sorted(
        ["fc.weight"]
        + [f"midlayer.self_attn.{x}_proj.weight" for x in "qkvo"]
        + [f"midlayer.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    )
    assert sorted(name[id(p)] for p in adamw) == sorted(
        ["lm_head.weight", "norm.weight"]
        + [f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
    )

    m = train(capture, tmp_path / "m", TrainSettings(steps=16, optimizer="muon", eval_every=0, eval_batches=0, **TINY))
    recs = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    first, last = [r["loss"] for r in recs[:4]], [r["loss"] for r in recs[-4:]]
    assert sum(last) < 0.93 * sum(first), (first, last)  # 11.6 -> 10.4 measured
    assert m["lr"] == 3e-3 and m["lr_reason"] == "given"
    st = torch.load(tmp_path / "m" / "checkpoints" / "step-00000016" / "optimizer.pt", weights_only=True)
    assert set(st) == {"muon", "adamw"}
    assert len(st["muon"]["state"]) == 8 and all("momentum_buffer" in v for v in st["muon"]["state"].values())
    assert all("exp_avg_sq" in v for v in st["adamw"]["state"].values())


@pytest.mark.parametrize(
    "norms",
    [
        {"draft_fc_norm": False, "draft_norm_output": False},
        {"draft_fc_norm": True, "draft_norm_output": True, "draft_norm_before_residual": True},
    ],
    ids=["plain", "draft_norms"],
)
def test_resume_is_exact_with_muon_noise_and_a_frozen_head(capture, tmp_path, norms):
    """A run resumed from its step-4 checkpoint ends bit for bit where the straight run does: both
    optimizers' states and the schedule come back, and the noise is a function of (seed, microbatch).
    With the draft norms on too (their weights, fc_norm.*, are in the checkpoint)."""
    s = TrainSettings(
        steps=8,
        optimizer="muon",
        hidden_noise=0.05,
        freeze_lm_head=True,
        checkpoint_every=4,
        eval_every=4,
        eval_batches=1,
        **TINY,
        **norms,
    )
    straight = tmp_path / "straight"
    train(capture, straight, s)
    resumed = tmp_path / "resumed"  # a new folder, resumed from the straight run's checkpoint (--resume-from)
    train(capture, resumed, s, resume=straight / "checkpoints" / "step-00000004")
    assert_same_weights(straight, resumed)
    assert ("fc_norm.2.weight" in load_file(str(straight / "model.safetensors"))) == norms["draft_fc_norm"]
    sa, sb = (
        torch.load(p / "checkpoints" / "step-00000008" / "optimizer.pt", weights_only=True) for p in (straight, resumed)
    )
    for part in ("muon", "adamw"):
        for i, v in sa[part]["state"].items():
            assert all(torch.equal(v[k], sb[part]["state"][i][k]) for k in v if torch.is_tensor(v[k]))

    def losses(p):
        return [
            (r["step"], r["split"], r["loss"]) for r in map(json.loads, (p / "metrics.jsonl").read_text().splitlines())
        ]

    assert [x for x in losses(straight) if x[0] > 4] == losses(resumed)  # (metrics.jsonl was not copied)


def test_noise_is_uniform_derived_from_seed_and_microbatch_and_training_only(capture):
    from nestling.train.objective import TTTObjective
    from nestling.train.loss import supervised_counts, teacher
    from nestling.train.noise import add_uniform_noise, microbatch_seed

    assert microbatch_seed(0, 5) == microbatch_seed(0, 5) != microbatch_seed(0, 6) != microbatch_seed(1, 6)
    n = add_uniform_noise(torch.zeros(200, 300), 0.05, microbatch_seed(0, 1))
    assert n.abs().max() <= 0.05 and abs(n.mean()) < 1e-3 and abs(n.std() - 0.05 / math.sqrt(3)) < 1e-3
    assert torch.equal(n, add_uniform_noise(torch.zeros(200, 300), 0.05, microbatch_seed(0, 1)))

    from nestling.train.data import capture_dataset, collate

    s = TrainSettings(**TINY)
    draft, head, d2t = _initial_draft(capture, s)
    ds = capture_dataset(capture, "train")
    b = collate([ds[0], ds[1]], 64, None)
    from nestling.train.head import teacher_rows

    w_draft, w_rest = teacher_rows(head, d2t, draft.t2d)
    t = teacher(b.final, w_draft, w_rest)
    denom = supervised_counts(b, 3)
    plain, noisy = TTTObjective(draft, 3, 0.8, "mask"), TTTObjective(draft, 3, 0.8, "mask", hidden_noise=0.05)
    base = plain(b, t, denom, 7)[0]
    assert noisy(b, t, denom, 7)[0] != base  # training forwards see the noise...
    assert noisy(b, t, denom, 7)[0] == noisy(b, t, denom, 7)[0]  # ...the same for the same microbatch
    assert noisy(b, t, denom)[0] == base  # no seed (evaluation): no noise
    noisy.eval()
    assert noisy(b, t, denom, 7)[0] == base  # eval mode: no noise


def test_default_lr_rule_and_log(capture, tmp_path, capsys):
    from nestling.train.settings import default_lr

    assert default_lr(576, 100) == pytest.approx(2e-3) and default_lr(135, 100) == pytest.approx(2e-3)
    assert default_lr(4096, 100) == pytest.approx(1e-4) and default_lr(8192, 100) == pytest.approx(1e-4)
    assert default_lr(1536, 100) == pytest.approx(math.sqrt(2e-3 * 1e-4), rel=1e-3)  # log-linear in between
    kw = {**TINY}
    del kw["lr"]
    m = train(capture, tmp_path / "d", TrainSettings(steps=1, eval_batches=0, **kw))
    assert m["lr"] == pytest.approx(2e-3) and m["settings"]["lr"] is None  # the tiny target's hidden is 128
    assert "lr 0.002 (default for hidden size 128" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(optimizer="sgd"), "optimizer"),
        (dict(hidden_noise=-0.1), "hidden_noise"),
        (dict(lr=0.0), "lr must"),
        (dict(muon_lr=-1.0), "muon_lr"),
        (dict(ttt_decay=0.0), "ttt_decay"),
        (dict(muon_momentum=1.0), "muon_momentum"),
        (dict(freeze_lm_head=True, lm_head_init="random"), "lm_head_init=target"),
    ],
)
def test_bad_recipe_settings(kw, match):
    from nestling.config import from_dict

    with pytest.raises(NestlingError, match=match):
        from_dict(TrainSettings, kw)


def test_vocab_coverage_is_reported_and_a_small_vocabulary_gets_a_hint(capture, tmp_path, capsys):
    """A supervised token outside the draft vocabulary is never drafted (SmolLM2: 98% coverage cost ~0.06
    tokens per target forward in vLLM), so the run states the share covered and, under 99%, says what to do;
    the share is counted on the held-out split (the training split's own tokens are all inside whenever it
    shows fewer distinct tokens than the vocabulary holds)."""
    from nestling.train.inputs import check_inputs, supervised_token_counts

    s = TrainSettings(steps=1, eval_batches=0, **{**TINY, "draft_vocab_size": 20})
    m = train(capture, tmp_path / "small", s)
    err = capsys.readouterr().err
    held = supervised_token_counts(check_inputs(capture, s), 49152, "heldout")
    t2d = load_file(str(tmp_path / "small" / "vocab.safetensors"))["t2d"]
    want = float(held[t2d].sum()) / float(held.sum())
    assert held.sum() > 0 and 0 < want < 0.99
    assert m["vocab_coverage"] == {"share": pytest.approx(want, abs=1e-6), "split": "heldout"}
    assert f"draft vocab 20 ({100 * want:.2f}% of the heldout split's supervised tokens)" in err
    assert "a token outside it is never drafted" in err and "up to 49152, the whole vocabulary" in err
    m = train(capture, tmp_path / "all", TrainSettings(steps=1, eval_batches=0, **{**TINY, "draft_vocab_size": 49152}))
    assert m["vocab_coverage"]["share"] == 1.0 and "never drafted" not in capsys.readouterr().err


def test_the_automatic_vocabulary_is_chosen_logged_and_kept_on_resume(capture, tmp_path, capsys):
    """draft_vocab_size 0 (the default) sizes the vocabulary from the data's coverage (unit rule:
    test_draft_model); the run says what it chose, and a resumed run rebuilds the same size."""
    s = TrainSettings(steps=1, eval_batches=0, **{**TINY, "draft_vocab_size": 0})
    train(capture, tmp_path / "t", s)
    err = capsys.readouterr().err
    t2d = load_file(str(tmp_path / "t" / "vocab.safetensors"))["t2d"]
    assert int(t2d.sum()) == 32000  # the tiny capture's few distinct tokens: the floor decides
    assert "draft_vocab_size auto: 32000 tokens, the fewest that cover 99% of the training split" in err
    for name in ("same", "other"):  # a run interrupted after its vocabulary was saved
        (tmp_path / name).mkdir()
        for f in ("vocab.safetensors", ".nestling-stage.json"):
            shutil.copy(tmp_path / "t" / f, tmp_path / name / f)
    train(capture, tmp_path / "same", s)
    with pytest.raises(NestlingError, match="the settings ask for draft_vocab_size 100"):
        train(capture, tmp_path / "other", TrainSettings(steps=1, eval_batches=0, **TINY))


def test_full_vocabulary_copy_of_a_frozen_head_draft(capture, tmp_path, monkeypatch):
    """benchmarks/vocab_coverage.py extend: a frozen head's draft gets every target row (no d2t / t2d, as
    the engines load a whole-vocabulary draft); a trained head is refused (mixing measured 0.36 worse)."""
    import argparse
    import sys
    from pathlib import Path

    from nestling.export.run import export
    from nestling.train.head import read_head
    from nestling.train.inputs import check_inputs

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    sys.modules.pop("vocab_coverage", None)
    import vocab_coverage as vc

    target = check_inputs(capture, TrainSettings(**TINY)).target
    for frozen in (True, False):
        s = TrainSettings(steps=2, freeze_lm_head=frozen, eval_batches=0, **{**TINY, "lr": 0.1})
        train(capture, tmp_path / f"t{frozen}", s)  # lr 0.1: a trained head moves past bf16 rounding in 2 steps
        d = export(tmp_path / f"t{frozen}", tmp_path / f"d{frozen}")
        args = argparse.Namespace(draft=str(d), target=str(target), out=str(tmp_path / f"full{frozen}"))
        if not frozen:
            with pytest.raises(NestlingError, match="it was trained"):
                vc.extend(args)
            assert not (tmp_path / "fullFalse").exists()
            continue
        vc.extend(args)
        w = load_file(str(tmp_path / "fullTrue" / "model.safetensors"))
        before = load_file(str(d / "model.safetensors"))
        assert "d2t" not in w and "t2d" not in w
        rows = read_head(target, 49152, 128).lm_head.to(w["lm_head.weight"].dtype)
        assert torch.equal(w["lm_head.weight"], rows)  # every row the target's (the frozen ones were already)
        assert all(torch.equal(w[k], before[k]) for k in before if k not in ("lm_head.weight", "d2t", "t2d"))
        cfg = json.loads((tmp_path / "fullTrue" / "config.json").read_text())
        assert cfg["draft_vocab_size"] == 49152 == cfg["vocab_size"]


def _muon_steps(make, steps: int = 4, state: dict | None = None):
    """Two matrices (one wide, one tall) stepped `steps` times on seeded gradients; `state`: an
    optimizer state to load first."""
    ps = [torch.nn.Parameter(torch.randn(24, 40, generator=torch.Generator().manual_seed(s))) for s in (1, 2)]
    ps[1] = torch.nn.Parameter(ps[1].detach().reshape(40, 24).clone())
    opt = make(ps)
    if state is not None:
        opt.load_state_dict(copy.deepcopy(state))  # loading keeps the given tensors, which steps change
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("rule", ["match_rms_adamw", "original"])
def test_muon_in_bf16_is_torchs_muon_step_for_step(rule):
    """nestling's Muon with bf16 iterations (GPUs, CPUs with bf16 units) computes what torch.optim.Muon
    does, bit for bit, under either lr rule, and each continues the other's state (a checkpoint
    moves between them)."""
    from nestling.train.muon import Muon

    kw = dict(lr=2e-3, momentum=0.95, weight_decay=0.1, ns_steps=5, adjust_lr_fn=rule)

    def theirs(ps):
        return torch.optim.Muon(ps, **kw)

    def ours(ps):
        return Muon(ps, ns_dtype=torch.bfloat16, **kw)

    (t, t_opt), (o, o_opt) = _muon_steps(theirs), _muon_steps(ours)
    assert all(torch.equal(a, b) for a, b in zip(t, o))
    for state in (t_opt.state_dict(), o_opt.state_dict()):  # torch's state, then ours
        (t2, _), (o2, _) = _muon_steps(theirs, 2, state), _muon_steps(ours, 2, state)
        assert all(torch.equal(a, b) for a, b in zip(t2, o2))


def test_muon_steps_with_its_float32_iterations():
    """A float32 Muon step is momentum, then `orthogonalize` in float32 (not torch's bf16), then
    weight decay and the AdamW-matched lr."""
    import math

    from nestling.train.muon import Muon, orthogonalize

    w, g = torch.randn(24, 40), torch.randn(24, 40)
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    Muon([p], lr=2e-3, momentum=0.95, weight_decay=0.1, ns_steps=5, ns_dtype=torch.float32).step()
    update = orthogonalize(g.lerp(g * 0.05, 0.95), 5, torch.float32)  # nesterov over a fresh buffer
    expected = w * (1 - 2e-3 * 0.1) - 2e-3 * (0.2 * math.sqrt(40)) * update
    torch.testing.assert_close(p.detach(), expected, atol=1e-7, rtol=1e-6)
    bf16 = orthogonalize(g.lerp(g * 0.05, 0.95), 5, torch.bfloat16).float()
    assert (update - bf16).abs().max() > 1e-3  # the dtype shows


def test_muon_orthogonalizes_in_float32_on_a_cpu_without_bf16_units(capture, tmp_path, capsys):
    """torch's Muon iterates in bf16, which a CPU without bf16 units runs on a slow path (the demo
    trained at 61 tok/s against ~770 with bf16 units): there nestling's Muon iterates in float32."""
    from nestling.train.muon import orthogonalize
    from nestling.train.optim import cpu_bf16_matmul, muon_ns_dtype

    def asked() -> bool:
        raise AssertionError("only a CPU is asked")

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert muon_ns_dtype(cpu, lambda: False) == torch.float32
    assert muon_ns_dtype(cpu, lambda: True) == torch.bfloat16 == muon_ns_dtype(cuda, asked)
    # the tests pin oneDNN to AVX2 (conftest), where its bf16 path is the slow one: the check sees it
    assert os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" and not cpu_bf16_matmul()
    g = torch.randn(48, 80, generator=torch.Generator().manual_seed(0))
    exact = orthogonalize(g.double(), 5, torch.float64)
    err32 = (orthogonalize(g, 5, torch.float32) - exact).abs().max().item()
    err16 = (orthogonalize(g, 5, torch.bfloat16).double() - exact).abs().max().item()
    assert err32 < 1e-5 < 1e-3 < err16, (err32, err16)
    # the trainer under the pin: float32 iterations, said once
    train(capture, tmp_path / "m", TrainSettings(steps=2, optimizer="muon", eval_every=0, eval_batches=0, **TINY))
    assert capsys.readouterr().err.count("Newton-Schulz iterations run in float32") == 1
