"""The reference speculative decoder: its output is the target's own output (greedy: token-identical
in fp32; sampling: the same distribution), and it refuses a draft from another target."""

from __future__ import annotations

import pytest
import torch

from eagle_helpers import make_train_dir, new_draft
from nestling.errors import NestlingError
from nestling.evaluate.specdec import SpecDecoder, load_draft, target_generate, verify_sampled
from nestling.export import ExportSettings, export
from nestling.target.load import load_model

AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return tiny_target("llama")


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny, dtype="float32")


def _top_tokens(model, prompt, n):
    with torch.no_grad():
        lg = model(torch.tensor([prompt])).logits[0]
    return lg.topk(8, dim=-1).indices.flatten().unique()[:n]


@pytest.fixture(scope="module")
def draft_dir(tiny, model, tmp_path_factory):
    """A draft whose vocab holds the target's likely tokens and whose head is flat (lm_head = 0):
    q is uniform over the draft vocab, so drafts are sometimes accepted and sometimes rejected."""
    prompt = list(range(100, 120))
    draft = new_draft(tiny, AUX, draft_vocab_size=64, vocab_tokens=_top_tokens(model, prompt, 64))
    with torch.no_grad():
        draft.lm_head.weight.zero_()
    root = tmp_path_factory.mktemp("spec")
    return export(make_train_dir(draft, root / "train"), root / "draft", ExportSettings(dtype="float32"))


def test_greedy_equals_target(model, draft_dir):
    torch.manual_seed(0)
    draft = load_draft(draft_dir, model)
    with torch.no_grad():  # a random head, so drafts are mostly rejected: both paths run
        draft.lm_head.weight.normal_(0, 0.5)
    for k, p in ((1, [5, 6, 7, 8]), (3, list(range(200, 230)))):
        dec = SpecDecoder(model, draft, k=k)
        out, st = dec.generate(p, 16)
        ref, _ = target_generate(model, p, 16)
        assert out == ref
        assert st.new_tokens == 16 and st.num_draft_tokens <= k * st.num_drafts


def test_greedy_with_perfect_draft_accepts_everything(model, tiny, tmp_path):
    """A draft that 'predicts' by running the target (a cheat) must be accepted at every position:
    checks the bookkeeping of positions and caches against acceptance, not only output equality."""
    draft = load_draft(export(make_train_dir(new_draft(tiny, AUX, 64), tmp_path / "t"), tmp_path / "d",
                              ExportSettings(dtype="float32")), model)
    dec = SpecDecoder(model, draft, k=3)
    prompt = [5, 6, 7, 8]
    ref, _ = target_generate(model, prompt, 24 + 3)  # the last draft reaches past the budget (as vLLM's)

    # the chain is replaced by the true continuation: draft id j -> the token at absolute index j
    full = prompt + ref
    dec.draft_targets = torch.tensor(full + [0] * 8)  # draft id j -> target token at absolute index j
    positions = []
    orig_step = draft.step

    def step(ids, hidden, pos, cache):
        positions.append(int(pos[0, -1]))
        return orig_step(ids, hidden, pos, cache)

    draft.step = step
    def fake_logits(h):
        nxt = positions[-1] + 2  # the draft at position t predicts the token at t + 2
        out = torch.full((1, 1, len(dec.draft_targets)), -1e9)
        out[0, 0, nxt] = 0
        return out
    draft.logits = fake_logits
    out, st = dec.generate(prompt, 24)
    assert out == ref[:24]
    assert st.num_accepted_tokens == st.num_draft_tokens == 3 * st.num_drafts  # every draft accepted, K each
    assert st.acceptance_length == 1 + 3


def test_rejection_sampling_is_exact():
    """Output distribution of one verification step equals p, for a q that differs from p."""
    g = torch.Generator().manual_seed(0)
    V = 6
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = torch.tensor([0.1, 0.5, 0.0, 0.3, 0.1, 0.0])  # zero off its vocab, like a draft vocab
    counts = torch.zeros(V)
    n = 20000
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        m, y = verify_sampled(torch.stack([p, p]), q[None], [d], g)
        counts[d if m == 1 else y] += 1
    tv = 0.5 * (counts / n - p).abs().sum()
    assert tv < 0.015  # ~4 sigma for n=20000 over 6 outcomes


def test_sampling_matches_target_distribution(model, draft_dir):
    """Chi-square homogeneity of the 2nd and 3rd sampled tokens: spec decoding vs the target alone,
    over many seeds (the 1st token comes from the prefill in both, so it tests nothing)."""
    draft = load_draft(draft_dir, model)
    T = 0.15  # peaked enough that a few hundred samples cover the support
    dec = SpecDecoder(model, draft, k=2, temperature=T)
    prompt = list(range(100, 120))
    spec, base, accepted = [], [], 0
    for s in range(200):
        o, st = dec.generate(prompt, 3, seed=s)
        spec.append(tuple(o[1:3]))
        accepted += st.num_accepted_tokens
        b, _ = target_generate(model, prompt, 3, temperature=T, seed=10_000 + s)
        base.append(tuple(b[1:3]))
    assert accepted > 10  # the acceptance path ran, not only the residual path
    for pos in (0, 1):
        a = [x[pos] for x in spec]
        b = [x[pos] for x in base]
        cats = sorted(set(a) | set(b), key=lambda t: -(a.count(t) + b.count(t)))
        big = [c for c in cats if a.count(c) + b.count(c) >= 10]
        rows = [[a.count(c), b.count(c)] for c in big]
        rows.append([len(a) - sum(r[0] for r in rows), len(b) - sum(r[1] for r in rows)])
        rows = [r for r in rows if sum(r) > 0]
        obs = torch.tensor(rows, dtype=torch.float64)
        exp = obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        dof = len(rows) - 1
        # chi-square critical value at p=0.001 ~ dof + 3.1*sqrt(2 dof) + 6 for small dof (conservative)
        assert chi2 < dof + 3.1 * (2 * dof) ** 0.5 + 6, (pos, chi2, dof, rows)


def test_eval_refuses_draft_of_another_target(tiny_target, draft_dir, tmp_path):
    from nestling.evaluate import EvalSettings, evaluate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with pytest.raises(NestlingError, match="another target|its own target"):
        evaluate(draft_dir, tiny_target("llama", seed=1), prompts, tmp_path / "e", EvalSettings(max_new_tokens=4))


def test_eval_reference_report(tiny, draft_dir, tmp_path):
    from nestling.evaluate import EvalSettings, evaluate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "Say hello."}]}\n{"prompt": "Count to five."}\n')
    rep = evaluate(draft_dir, tiny, prompts, tmp_path / "e", EvalSettings(max_new_tokens=12, k=2))
    r = rep["engines"]["reference"]
    assert r["identical_share"] == 1.0  # greedy fp32: same as the target alone
    assert r["acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
    assert len(r["per_position"]) == 2
    for f in ("report.json", "report.md", "acceptance.png", "manifest.json"):
        assert (tmp_path / "e" / f).exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(NestlingError, match="bad.jsonl:1"):
        evaluate(draft_dir, tiny, bad, tmp_path / "e2", EvalSettings(max_new_tokens=4))
