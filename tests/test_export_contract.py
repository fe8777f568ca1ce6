"""Export: the folder holds exactly the contract's tensors and config, in both layouts; the layer
ids are written in each engine's convention; a checkpoint from another target is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from eagle_helpers import make_train_dir, new_draft
from nestling.errors import NestlingError
from nestling.export.run import export
from nestling.export.settings import ExportSettings
from nestling.export import contract

AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def train_dir(tiny_target, tmp_path_factory):
    draft = new_draft(tiny_target("llama"), AUX, draft_vocab_size=512, vocab_tokens=torch.arange(1000, 3000))
    return make_train_dir(draft, tmp_path_factory.mktemp("train") / "t")


def test_native_folder_matches_contract(train_dir, tiny_target, tmp_path):
    out = export(train_dir, tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    target_cfg = json.loads((tiny_target("llama") / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == 49152 and cfg["draft_vocab_size"] == 512
    assert cfg["max_position_embeddings"] == target_cfg["max_position_embeddings"]
    assert cfg["rope_parameters"] == target_cfg["rope_parameters"]
    assert cfg["rope_theta"] == target_cfg["rope_parameters"]["rope_theta"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM: HF hidden_states ids
    t = load_file(str(out / "model.safetensors"))
    want = contract.expected_tensors(contract.draft_config_from_native(cfg), torch.bfloat16)
    assert {k: (tuple(v.shape), v.dtype) for k, v in t.items()} == want
    assert t["fc.weight"].shape == (128, 3 * 128) and t["midlayer.self_attn.q_proj.weight"].shape == (128, 256)
    assert torch.equal(torch.arange(512) + t["d2t"], torch.arange(1000, 1512))
    assert not any("embed" in k for k in t)
    m = json.loads((out / "manifest.json").read_text())
    assert m["stage"] == "export" and m["sglang_layer_ids"] == [0, 2, 3]
    assert m["sglang_caveat"] is None  # a plain 1-layer draft: SGLang serves it as vLLM does


def test_sglang_loading_rules(train_dir, tmp_path):
    """SGLang does not run here; this reads the folder the way SGLang's EAGLE-3 loader does
    (docs/architecture.md, "The export contract"): `eagle_config.eagle_aux_hidden_state_layer_ids` + SGLang's own +1 (it captures at the *input* of
    layer id+1), `d2t` as offsets (hot_token_id = arange + d2t), `t2d` ignored."""
    out = export(train_dir, tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    sg_ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    layers_to_capture = [v + 1 for v in sg_ids]  # sglang: set_eagle3_layers_to_capture
    # captured as hidden_states + residual before layer i runs == HF hidden_states[i]
    assert layers_to_capture == AUX
    t = load_file(str(out / "model.safetensors"))
    hot = torch.arange(t["d2t"].numel()) + t["d2t"]  # sglang maps draft ids with d2t only
    assert hot.tolist() == list(range(1000, 1512)) and t["d2t"].dtype == torch.int64
    sglang_needs = {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
    }
    assert sglang_needs <= set(t)
    assert cfg["draft_vocab_size"] == t["lm_head.weight"].shape[0]


def test_speculators_layout(train_dir, tiny_target, tmp_path):
    out = export(train_dir, tmp_path / "s", ExportSettings(format="speculators", num_speculative_tokens=2))
    cfg = json.loads((out / "config.json").read_text())
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    spec = SpeculatorsConfig.extract_vllm_speculative_config(cfg)  # vLLM's own reader of the layout
    assert spec == {"method": "eagle3", "num_speculative_tokens": 2}
    layer = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(cfg)))
    assert layer["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert layer["eagle_aux_hidden_state_layer_ids"] == AUX and layer["draft_vocab_size"] == 512
    assert layer["norm_before_residual"] is False  # speculators defaults to True; our layer is not that
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target("llama").resolve())
    t = load_file(str(out / "model.safetensors"))
    assert set(t) == set(contract.expected_tensors(contract.read_draft_folder(out)[1], torch.bfloat16))


# ---- a draft of several decoder layers ---------------------------------------------------------------
# vLLM 0.32 builds `num_hidden_layers` layers and loads them as `layers.N.*` (tests/test_export_vllm.py
# serves one); a 1-layer draft keeps `midlayer.*`.


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_two_layer_folder_uses_vllm_layer_names(tiny_target, tmp_path, fmt):
    from nestling.evaluate.specdec import load_draft
    from nestling.targets.load import load_model

    draft = new_draft(
        tiny_target("llama"), AUX, draft_vocab_size=512, vocab_tokens=torch.arange(1000, 3000), seed=3, layers=2
    )
    out = export(make_train_dir(draft, tmp_path / "t"), tmp_path / "d", ExportSettings(format=fmt, dtype="float32"))
    raw, cfg, t = contract.read_draft_folder(out)
    assert (raw.get("transformer_layer_config") or raw)["num_hidden_layers"] == 2 and cfg.num_hidden_layers == 2
    assert {k: (tuple(v.shape), v.dtype) for k, v in t.items()} == contract.expected_tensors(cfg, torch.float32)
    assert not any(k.startswith("midlayer.") for k in t)
    assert t["layers.0.self_attn.q_proj.weight"].shape == (128, 256)  # embedding + hidden
    assert t["layers.1.self_attn.q_proj.weight"].shape == (128, 128)  # hidden only
    assert "layers.0.hidden_norm.weight" in t and "layers.1.hidden_norm.weight" not in t
    assert torch.equal(t["layers.0.mlp.up_proj.weight"], draft.midlayer.mlp.up_proj.weight)
    assert torch.equal(t["layers.1.mlp.up_proj.weight"], draft.layers["1"].mlp.up_proj.weight)
    loaded = load_draft(out, load_model(tiny_target("llama"), dtype="float32"))  # the reference decoder's loader
    want = draft.export_state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.export_state_dict().items())


# ---- the draft norms (fc_norm, norm_output, norm_before_residual) -----------------------------------

NORMS = {"fc_norm": True, "norm_output": True, "norm_before_residual": True}


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_draft_norms_are_written_as_vllm_reads_them(tiny_target, tmp_path, fmt):
    """The config keys where vLLM 0.32 reads them (native: top level, read by getattr; speculators:
    top level, copied by vLLM's own `update_eagle3`), fc_norm's weights as `fc_norm.{i}.weight`, and
    nestling's loader reads the options and weights back."""
    from nestling.evaluate.specdec import load_draft
    from nestling.targets.load import load_model

    draft = new_draft(tiny_target("llama"), AUX, draft_vocab_size=512, vocab_tokens=torch.arange(1000, 3000), seed=4)
    for k, v in NORMS.items():
        setattr(draft.config, k, v)
    on = type(draft)(draft.config)  # built with the options: it has fc_norm modules
    on.load_state_dict(draft.state_dict(), strict=False)
    with torch.no_grad():
        for i, n in enumerate(on.fc_norm):
            n.weight.fill_(0.5 + i)
    out = export(make_train_dir(on, tmp_path / "t"), tmp_path / "d", ExportSettings(format=fmt, dtype="float32"))
    raw, cfg, t = contract.read_draft_folder(out)
    if fmt == "speculators":
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

        raw = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    assert {k: raw[k] for k in NORMS} == NORMS
    assert {k: getattr(cfg, k) for k in NORMS} == NORMS
    assert {k: (tuple(v.shape), v.dtype) for k, v in t.items()} == contract.expected_tensors(cfg, torch.float32)
    assert [float(t[f"fc_norm.{i}.weight"][0]) for i in range(3)] == [0.5, 1.5, 2.5]
    loaded = load_draft(out, load_model(tiny_target("llama"), dtype="float32"))
    assert {k: getattr(loaded.config, k) for k in NORMS} == NORMS
    want = on.export_state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.export_state_dict().items())


def test_draft_norms_are_held_to_the_config():
    """A config that does not say the draft's norms, or weights without fc_norm's, break the contract;
    a speculators config without norm_before_residual means True (vLLM's default there)."""
    c = contract.draft_config_from_native({**_min_config(), **NORMS})
    plain = contract.draft_config_from_native(_min_config())
    assert not any(getattr(plain, k) for k in NORMS) and all(getattr(c, k) for k in NORMS)
    assert contract.draft_config_from_native({**_min_config(), "speculators_config": {}}).norm_before_residual
    with pytest.raises(NestlingError, match="fc_norm=None"):
        contract.check_native_config(
            {k: v for k, v in contract.native_config(c, {}, "float32").items() if k != "fc_norm"}, c
        )
    tensors = {k: torch.zeros(shape) for k, (shape, _) in contract.expected_tensors(plain, torch.float32).items()}
    with pytest.raises(NestlingError, match="missing fc_norm.0.weight"):
        contract.check_tensors(tensors, c, torch.float32)


def _min_config() -> dict:
    return dict(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        draft_vocab_size=100,
        eagle_aux_hidden_state_layer_ids=AUX,
    )


def test_layer_count_is_held_to_the_weights(tiny_target):
    """The config's num_hidden_layers and the tensors must agree (the check after writing)."""
    c2 = new_draft(tiny_target("llama"), AUX, draft_vocab_size=512, layers=2).config
    c1 = new_draft(tiny_target("llama"), AUX, draft_vocab_size=512).config
    one = contract.native_config(c1, json.loads((tiny_target("llama") / "config.json").read_text()), "float32")
    with pytest.raises(NestlingError, match="num_hidden_layers=1"):
        contract.check_native_config(one, c2)
    tensors = {k: torch.zeros(shape) for k, (shape, _) in contract.expected_tensors(c2, torch.float32).items()}
    with pytest.raises(NestlingError, match="unexpected layers.1"):
        contract.check_tensors(tensors, c1, torch.float32)


def test_refuses_checkpoint_of_another_target(train_dir, tiny_target, tmp_path):
    other = tiny_target("llama", seed=1)  # same shapes, different weights -> another fingerprint
    with pytest.raises(NestlingError, match="fingerprint"):
        export(train_dir, tmp_path / "x", ExportSettings(target=str(other)))
    assert not (tmp_path / "x").exists()


def test_refuses_weights_that_break_the_contract(train_dir, tmp_path):
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(train_dir, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, :256].contiguous()  # two aux layers' worth instead of three
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(NestlingError, match="fc.weight"):
        export(bad, tmp_path / "x")


def test_cli_export(train_dir, tmp_path):
    from nestling.cli import main

    assert main(["export", str(train_dir), "dtype=float32", "--out", str(tmp_path / "c")]) == 0
    assert load_file(str(tmp_path / "c" / "model.safetensors"))["norm.weight"].dtype == torch.float32
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "c2")]) == 1


# ---- a draft over the whole target vocabulary --------------------------------------------------------
# vLLM 0.32 has no draft_id_to_target_id parameter when draft_vocab_size == the target's vocabulary,
# so such a folder must hold no d2t (tests/test_export_vllm.py loads it in the real engine).

FULL = 49152  # the tiny target's vocabulary


@pytest.fixture(scope="module")
def full_draft(tiny_target):
    return new_draft(tiny_target("llama"), AUX, draft_vocab_size=FULL, seed=2)


def _permuted(draft, seed: int = 0):
    """The same function with draft ids in a shuffled order (row i predicts target perm[i])."""
    import copy

    d = copy.deepcopy(draft)
    perm = torch.randperm(FULL, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        d.lm_head.weight.copy_(draft.lm_head.weight[perm])
        d.d2t.copy_(perm - torch.arange(FULL))
    return d, perm


def test_full_vocab_folder_has_no_vocab_map(full_draft, tmp_path):
    out = export(make_train_dir(full_draft, tmp_path / "t"), tmp_path / "d", ExportSettings(dtype="float32"))
    cfg = json.loads((out / "config.json").read_text())
    t = load_file(str(out / "model.safetensors"))
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == FULL
    assert "d2t" not in t and "t2d" not in t  # vLLM would fail on d2t; t2d carries nothing
    assert set(t) == set(contract.expected_tensors(contract.draft_config_from_native(cfg), torch.float32))
    assert torch.equal(t["lm_head.weight"], full_draft.lm_head.weight)  # nestling's order is the identity already
    # SGLang: without d2t no hot_token_id, draft id == target id; lm_head covers every target id
    assert t["lm_head.weight"].shape[0] == cfg["vocab_size"]


def test_full_vocab_in_shuffled_order_is_reordered_not_changed(full_draft, tiny_target, tmp_path):
    """A full vocabulary whose draft ids are not in target order: the head rows move to target order,
    so the engines (which read row i as token i) and nestling's decoder compute the same logits."""
    from nestling.evaluate.specdec import load_draft
    from nestling.targets.load import load_model

    shuffled, perm = _permuted(full_draft)
    out = export(make_train_dir(shuffled, tmp_path / "t"), tmp_path / "d", ExportSettings(dtype="float32"))
    t = load_file(str(out / "model.safetensors"))
    assert "d2t" not in t and torch.equal(t["lm_head.weight"], full_draft.lm_head.weight)
    loaded = load_draft(out, load_model(tiny_target("llama"), dtype="float32"))  # the reference decoder's loader
    assert torch.equal(loaded.d2t, torch.zeros(FULL, dtype=torch.long)) and bool(loaded.t2d.all())
    h = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        by_target_id = torch.empty(1, 5, FULL)
        by_target_id[..., perm] = shuffled.logits(h)  # shuffled draft's logits put at their target ids
        assert torch.allclose(loaded.logits(h), by_target_id, atol=1e-6)


def test_full_vocab_with_a_broken_map_is_refused(full_draft, tmp_path):
    bad, _ = _permuted(full_draft)
    with torch.no_grad():
        bad.d2t[1] = bad.d2t[0] - 1  # draft ids 0 and 1 both name the same target token
    with pytest.raises(NestlingError, match="not a permutation"):
        export(make_train_dir(bad, tmp_path / "t"), tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_full_vocab_without_a_map_is_refused(full_draft, tmp_path):
    from safetensors.torch import save_file

    train = make_train_dir(full_draft, tmp_path / "t")
    (train / "vocab.safetensors").unlink()
    t = load_file(str(train / "model.safetensors"))
    save_file({k: v for k, v in t.items() if k not in ("d2t", "t2d")}, str(train / "model.safetensors"))
    with pytest.raises(NestlingError, match="no d2t"):
        export(train, tmp_path / "d")


def test_export_names_what_sglang_may_not_serve():
    """A plain 1-layer draft has no caveat; the EAGLE-3.1 norms (the train default) and extra layers
    are named, with the settings that make an SGLang-safe draft."""
    from nestling.draft.model import DraftConfig
    from nestling.export.run import sglang_caveat

    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    base = DraftConfig(**shape, vocab_size=300, draft_vocab_size=100, aux_layer_ids=[1, 2, 3], num_target_layers=5)
    assert sglang_caveat(base) is None
    normed = sglang_caveat(dataclasses.replace(base, fc_norm=True, norm_output=True))
    assert normed and "fc_norm, norm_output" in normed and "layers" not in normed.split(";")[0]
    deep = sglang_caveat(dataclasses.replace(base, num_hidden_layers=2))
    assert deep and "2 layers" in deep and "draft_layers=1" in deep
