"""Batched TTT equals the engine's step-by-step drafting, for every position and step, packed too."""

from __future__ import annotations

import warnings

import pytest
import torch
from capture_fixture import one_thread  # noqa: F401 (autouse)

from nestling.draft.model import NORM_OPTIONS, DraftConfig, Eagle3Draft
from nestling.train.loss import Teacher, supervised, ttt_loss
from nestling.train.ttt import PackedBatch, reference_logits, shift_in_doc, ttt_hidden

STEPS = 4


# the draft norm options (DraftConfig fields): none, EAGLE-3.1's two, and all of them
NORMS = {"plain": {}, "eagle31": {"fc_norm": True, "norm_output": True}, "all": {k: True for k in NORM_OPTIONS}}


def _model(seed: int = 0, layers: int = 1, norms: str = "plain") -> Eagle3Draft:
    torch.manual_seed(seed)
    c = DraftConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        draft_vocab_size=20,
        aux_layer_ids=[1, 2, 3],
        num_target_layers=5,
        num_hidden_layers=layers,
        **NORMS[norms],
    )
    m = Eagle3Draft(c).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)  # large weights so that a wrong mask or position shows
    return m


def _samples(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 50, (n,), generator=g), torch.randn(n, 96, generator=g)) for n in lengths]


def _pack(samples, pad: int = 0) -> PackedBatch:
    ids = torch.cat([s[0] for s in samples] + [torch.zeros(pad, dtype=torch.long)])
    aux = torch.cat([s[1] for s in samples] + [torch.zeros(pad, 96)])
    doc = torch.cat([torch.full((len(s[0]),), i) for i, s in enumerate(samples)] + [torch.full((pad,), len(samples))])
    pos = torch.cat([torch.arange(len(s[0])) for s in samples] + [torch.arange(pad)])
    return PackedBatch(ids[None], torch.ones_like(ids, dtype=torch.bool)[None], doc[None], pos[None], aux[None])


def _batched_logits(m, batch, backend="mask"):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.stack([m.logits(h) for h in ttt_hidden(m, batch, STEPS, backend)], dim=2)[0]  # [L, K, V]


def _assert_matches_reference(m, samples, got):
    start = 0
    for ids, aux in samples:
        ref = reference_logits(m, ids, aux, STEPS)
        defined = ~ref.isnan().any(-1)
        assert int(defined.sum()) >= len(ids)  # every anchor with a next token, all steps that exist
        torch.testing.assert_close(got[start : start + len(ids)][defined], ref[defined], atol=1e-4, rtol=1e-4)
        start += len(ids)


@pytest.mark.parametrize("norms", list(NORMS))
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("backend", ["mask", "flex", "concat"])
def test_batched_ttt_equals_stepwise_reference_single_sample(backend, layers, norms):
    m = _model(layers=layers, norms=norms)
    samples = _samples([13])
    _assert_matches_reference(m, samples, _batched_logits(m, _pack(samples), backend))


@pytest.mark.parametrize("norms", list(NORMS))
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("backend", ["mask", "flex", "concat"])
def test_batched_ttt_equals_reference_in_packed_batch(backend, layers, norms):
    m = _model(layers=layers, norms=norms)
    samples = _samples([7, 11, 3, 9])
    _assert_matches_reference(m, samples, _batched_logits(m, _pack(samples, pad=5), backend))


@pytest.mark.parametrize("option", NORM_OPTIONS)
def test_each_norm_option_changes_the_draft(option):
    """Guard for the tests above: with the same weights, switching one option on changes the logits
    (norm_output from step 1 on, the others from step 0), batched and stepwise alike, so the equality
    cannot hold by both sides ignoring it."""
    on = _model(layers=2, norms="all")
    off = _model(layers=2, norms="all")
    setattr(off.config, option, False)
    samples = _samples([10])
    first = 1 if option == "norm_output" else 0
    for a, b in (
        (_batched_logits(on, _pack(samples)), _batched_logits(off, _pack(samples))),
        (reference_logits(on, *samples[0], STEPS), reference_logits(off, *samples[0], STEPS)),
    ):
        assert torch.equal(a[:6, :first], b[:6, :first])
        for j in range(first, STEPS):
            assert (a[:6, j] - b[:6, j]).abs().max() > 1e-2, (option, j)


def test_second_layer_takes_part_in_every_step():
    """Guard for the 2-layer test above: layer 1 changes every step's logits, batched and stepwise,
    so the equality cannot hold by skipping it in both."""
    m = _model(layers=2)
    samples = _samples([10])
    before = _batched_logits(m, _pack(samples))
    ref_before = reference_logits(m, samples[0][0], samples[0][1], STEPS)
    with torch.no_grad():
        m.layers["1"].mlp.down_proj.weight.mul_(2.0)
    after = _batched_logits(m, _pack(samples))
    ref_after = reference_logits(m, samples[0][0], samples[0][1], STEPS)
    for j in range(STEPS):
        assert (after[:6, j] - before[:6, j]).abs().max() > 1e-2
        assert (ref_after[:6, j] - ref_before[:6, j]).abs().max() > 1e-2


def test_packed_sample_sees_nothing_of_its_neighbours():
    m = _model()
    samples = _samples([9, 12, 6])
    packed = _batched_logits(m, _pack(samples, pad=3))[9:21]
    alone = _batched_logits(m, _pack(samples[1:2]))
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_same_positions_for_every_step_would_differ():
    """Guard against the classic bug: the rotary position must advance with the step."""
    m = _model()
    samples = _samples([10])
    batch = _pack(samples)
    good = _batched_logits(m, batch)
    ref = reference_logits(m, samples[0][0], samples[0][1], STEPS)
    # the reference disagrees with step 1 computed at step-0 positions
    from nestling.train import ttt

    orig = ttt.ttt_hidden

    def same_pos(model, b, steps, backend="mask"):
        b2 = PackedBatch(b.input_ids, b.loss_mask, b.doc, b.pos, b.aux)
        hidden = model.combine(b2.aux)
        ks, vs, out = [], [], []
        for j in range(steps):
            q, k, v = model.qkv(0, shift_in_doc(b2.input_ids, b2.doc, 1 + j), hidden, b2.pos)
            ks.append(k), vs.append(v)
            hidden = model.finish(
                0, model.attend(q, torch.cat(ks, 2), torch.cat(vs, 2), ttt.ttt_mask(b2.doc, j)), hidden
            )
            out.append(hidden)
        return out

    with torch.no_grad():
        bad = torch.stack([m.logits(h) for h in same_pos(m, batch, STEPS)], 2)[0]
    assert orig is ttt.ttt_hidden
    torch.testing.assert_close(good[:8, 1], ref[:8, 1], atol=1e-4, rtol=1e-4)
    assert (bad[:8, 1] - ref[:8, 1]).abs().max() > 1e-2


def test_loss_counts_only_supervised_in_sample_positions():
    m = _model()
    samples = _samples([6, 5])
    batch = _pack(samples)
    batch.loss_mask[0, 3] = False  # predicted token 3 of sample 0: anchor 1 at step 0, anchor 0 at step 1
    sup0 = supervised(batch, 0)[0]
    assert sup0.tolist() == [True, False, True, True, False, False, True, True, True]  # 2 cross-sample
    vd = m.config.draft_vocab_size
    L = batch.input_ids.shape[1]
    probs = torch.softmax(torch.randn(1, L, vd), -1)
    t = Teacher(probs, probs.argmax(-1), torch.ones(1, L, dtype=torch.bool))
    hiddens = ttt_hidden(m, batch, STEPS)
    denom = torch.tensor([float(supervised(batch, j).sum()) for j in range(STEPS)])
    loss, stats = ttt_loss(m, hiddens, t, batch, denom)
    assert stats.count.tolist() == denom.tolist()
    # hand-computed step-0 term
    logp = torch.log_softmax(m.logits(hiddens[0])[0].float(), -1)
    ce = -(probs[0, 1 : L - 1] * logp[: L - 2]).sum(-1)
    torch.testing.assert_close(stats.loss_sum[0].float(), (ce * sup0).sum().double().float())
    loss.backward()
    assert m.fc.weight.grad is not None and m.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("layers", [1, 2])
def test_mask_path_gradients_equal_concatenated_attention(layers):
    """The log-sum-exp merged attention trains exactly what one softmax over all keys does."""
    samples = _samples([7, 10])
    batch = _pack(samples, pad=2)
    grads = []
    for backend in ("mask", "concat"):
        m = _model(layers=layers)
        m.zero_grad()
        hs = ttt_hidden(m, batch, STEPS, backend)
        sum((m.logits(h) ** 2).mean() * (j + 1) for j, h in enumerate(hs)).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-4, rtol=1e-4, msg=n)


def test_flex_mask_reads_document_ids_only_inside_the_row():
    """Flex kernels evaluate the mask on the padded tail of the last 128-wide block before discarding
    it; the mask must not read `doc` there (an out-of-bounds load where a row is not a multiple of
    128 long), and inside the row it is the causal same-sample mask."""
    from nestling.train.ttt import doc_causal_mask, flex_block_mask

    L = 200  # not a multiple of 128: the kernel's grid runs to 256
    doc = torch.zeros(2, L, dtype=torch.long)
    doc[0, 70:] = 1
    doc[1, 150:] = 3
    mask_mod = flex_block_mask(doc).mask_mod
    q, kv = torch.arange(256)[:, None], torch.arange(256)[None, :]
    for b in range(2):
        full = mask_mod(torch.tensor(b), torch.tensor(0), q, kv)  # the unguarded mask raised IndexError here
        assert torch.equal(full[:L, :L], doc_causal_mask(doc)[b])
        assert not full[:L, L:].any()  # no real query sees a padded key
