"""The draft module's shapes, names and vocabulary mapping (contract with the engines)."""

from __future__ import annotations

import pytest
import torch

from nestling.draft.model import NORM_OPTIONS, DraftConfig, Eagle3Draft, KVCache
from nestling.draft.vocab import (
    AUTO_ROUND,
    auto_size,
    build_vocab,
    count_tokens,
    draft_ids_to_target,
    resolve_size,
    target_to_draft_index,
)


def _cfg(**kw) -> DraftConfig:
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=100,
        draft_vocab_size=20,
        aux_layer_ids=[1, 2, 3],
        num_target_layers=5,
    )
    return DraftConfig(**{**base, **kw})


def test_export_names_and_shapes():
    m = Eagle3Draft(_cfg())
    sd = m.export_state_dict()
    assert sd["fc.weight"].shape == (64, 192)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # 2H input
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (32, 128)
    assert sd["lm_head.weight"].shape == (20, 64)
    assert sd["d2t"].dtype == torch.long and sd["t2d"].shape == (100,)
    assert not any(k.startswith("embed_tokens") for k in sd)
    assert not m.embed_tokens.weight.requires_grad


def test_later_layers_are_plain_llama_layers_of_width_h():
    """vLLM 0.32 builds layers 1..N-1 with q/k/v over H (no embedding) and loads them as `layers.N.*`."""
    m = Eagle3Draft(_cfg(num_hidden_layers=3))
    sd = m.export_state_dict()
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # layer 0: 2H input
    for i in (1, 2):
        assert sd[f"layers.{i}.self_attn.q_proj.weight"].shape == (64, 64)
        assert sd[f"layers.{i}.self_attn.k_proj.weight"].shape == (32, 64)
        assert sd[f"layers.{i}.input_layernorm.weight"].shape == (64,)
        assert f"layers.{i}.hidden_norm.weight" not in sd
    assert not any(k.startswith("layers.0.") or k.startswith("layers.3.") for k in sd)


def test_norm_options_add_vllm_names_and_stay_out_of_the_key_when_off():
    """fc_norm adds one RMSNorm per aux state under vLLM's `fc_norm.{i}` names; the other options
    add no weight. Options that are off are not in the run's key (older runs keep theirs)."""
    plain, on = _cfg(), _cfg(fc_norm=True, norm_output=True, norm_before_residual=True)
    assert set(Eagle3Draft(on).export_state_dict()) - set(Eagle3Draft(plain).export_state_dict()) == {
        "fc_norm.0.weight",
        "fc_norm.1.weight",
        "fc_norm.2.weight",
    }
    assert Eagle3Draft(on).export_state_dict()["fc_norm.1.weight"].shape == (64,)
    assert not set(NORM_OPTIONS) & set(plain.key_fields())
    assert all(on.key_fields()[k] is True for k in NORM_OPTIONS)
    assert {k: v for k, v in on.key_fields().items() if k not in NORM_OPTIONS} == plain.key_fields()


@pytest.mark.parametrize("kw", [{}, {"fc_norm": True, "num_hidden_layers": 2}])
def test_trainable_params_counts_the_module(kw):
    c = _cfg(**kw)
    m = Eagle3Draft(c)
    assert c.trainable_params() == sum(p.numel() for p in m.parameters() if p.requires_grad)


def test_draft_needs_a_layer():
    from nestling.errors import NestlingError

    with pytest.raises(NestlingError, match="at least one decoder layer"):
        _cfg(num_hidden_layers=0)


@pytest.mark.parametrize("layers", [1, 2])
def test_step_with_cache_equals_full_causal_pass(layers):
    torch.manual_seed(0)
    m = Eagle3Draft(_cfg(num_hidden_layers=layers)).eval()
    ids = torch.randint(0, 100, (1, 6))
    hid = torch.randn(1, 6, 64)
    pos = torch.arange(6)[None]
    full = m.step(ids, hid, pos, KVCache())
    cache = KVCache()
    first = m.step(ids[:, :4], hid[:, :4], pos[:, :4], cache)
    rest = [m.step(ids[:, t : t + 1], hid[:, t : t + 1], pos[:, t : t + 1], cache) for t in (4, 5)]
    torch.testing.assert_close(torch.cat([first, *rest], 1), full, atol=1e-5, rtol=1e-5)


def test_the_automatic_vocabulary_is_the_fewest_tokens_covering_the_share():
    """draft_vocab_size 0: the fewest most frequent tokens covering the share, rounded up to AUTO_ROUND
    rows, never under the floor, never over the vocabulary; counted here by brute force."""
    counts = torch.tensor([(i * 7919) % 1000 + 1 for i in range(1000)])  # 1000 ids, shuffled weights
    ordered, total = sorted(counts.tolist(), reverse=True), int(counts.sum())
    need = next(n for n in range(1, 1001) if sum(ordered[:n]) >= 0.9 * total)
    assert need % AUTO_ROUND != 0
    assert auto_size(counts, 0.9, floor=1) == -(-need // AUTO_ROUND) * AUTO_ROUND
    assert auto_size(counts, 0.9, floor=800) == 896  # the floor, rounded up
    assert auto_size(counts, 0.9, floor=5000) == 1000  # capped at the vocabulary
    peaked = torch.zeros(100_000, dtype=torch.long)
    peaked[:10] = 1000  # ten tokens hold everything: the floor (32,000) decides
    assert resolve_size(peaked, 0) == 32000 and resolve_size(peaked, 50) == 50
    assert resolve_size(peaked, 200_000) == 100_000


def test_vocab_topn_and_offsets():
    counts = count_tokens([torch.tensor([5, 5, 5, 3, 3, 9, 9, 1, 7])], 12)  # 1 and 7 tie below 9
    d2t, t2d = build_vocab(counts, 3)
    assert draft_ids_to_target(d2t).tolist() == [3, 5, 9]
    assert t2d.nonzero().flatten().tolist() == [3, 5, 9]
    assert target_to_draft_index(t2d)[[3, 5, 9, 1]].tolist() == [0, 1, 2, -1]
