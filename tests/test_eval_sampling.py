"""The reference decoder's rejection sampling keeps the target's distribution, and counts acceptance
as vLLM does: statistical tests with a stated significance level and power, computed in the test.

Setup: the tiny random-weight Llama target at temperature T = 0.05 (peaked: a few continuations hold
most of the mass), a fixed 20-token prompt, K = 2, 3 new tokens per run, N seeded runs. The draft
has a flat head (lm_head = 0) over a vocabulary of the D = 8 tokens the target most often emits at
positions 2-3, so its law is uniform over those 8 tokens in every context. Both of vLLM's
draft_sample_methods are tested, each with its own q (the law verification divides by):
- probabilistic: q uniform, drafts sampled from it: it overlaps p (a draft is accepted in ~23% of
  first rounds) without equalling it;
- greedy (vLLM's default): the draft's argmax, the first of the tied 8 (the token the target emits
  most there), every time: q one-hot at that token d, accepted with p(d).
Token 1 is the target's own sample; tokens 2
and 3 each come out of one verification step against a fresh flat draft, whichever round produced
them, so under any verification rule r(p, q) the law of (x1, x2, x3) is p(x1) r(x2|x1) r(x3|x1, x2):
exact for the correct rule (r = p) and for each wrong rule below, from the target's probabilities.

Tests, each at significance alpha = 0.001 (a correct decoder fails once in 1,000 seed sets):
- goodness of fit: Pearson chi-square of the N joint 3-token outcomes against the exact law (cells
  expecting >= 5 runs, the rest pooled);
- acceptance: the share of first rounds that accept draft 1 (vLLM's num_accepted_tokens_per_pos[0]
  over num_drafts, counted by the decoder's SpecStats) against its exact value
  E_x1[sum_y min(p(y|x1), q(y))], two-sided normal test.
Power, computed below from each wrong rule's exact law (chi-square: 2,000 simulated sets of N runs;
acceptance: normal approximation) and asserted where it is high. With N = 160, probabilistic (values
of the last run):
- always accepting the draft (r = q): chi-square 1.00, acceptance 1.00 (asserted > 0.99);
- accepting with probability p(d), as if q(d) were 1 (an ngram-style rule): chi-square 0.98
  (asserted > 0.9), acceptance 0.49 (asserted > 0.4);
- resampling a rejection from p instead of the residual (p - q)+: chi-square 0.38 (not asserted: a
  small deviation where p is peaked).
Greedy (values of the last run; first-round acceptance 101/160 against an exact 0.634): always
accepting the draft: chi-square 1.00, acceptance 1.00 (asserted > 0.99); accepting with
min(1, p(d) / (1/8)), the sampled law's ratio used on a greedy draft: chi-square 0.05, acceptance 0.19
(not asserted: the draft's token mostly has p(d) >= 1/8 here, where that rule is right).
The simulated rejection rate of the correct rule is ~0.0015 (the level, asserted < 0.01).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from capture_fixture import one_thread  # noqa: F401 (autouse: one thread for tiny shapes)

from eagle_helpers import make_train_dir, new_draft
from nestling.evaluate.specdec import SpecDecoder, load_draft
from nestling.export.run import export
from nestling.export.settings import ExportSettings
from nestling.targets.load import load_model

AUX = [1, 3, 4]
T = 0.05
K = 2
D = 8
N = 160
ALPHA_Z = 3.0902  # one-sided normal quantile at 0.001 (chi-square); two-sided 0.001 is 3.2905
PROMPT = list(range(100, 120))

Rule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (p, q) -> law of the emitted token


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = torch.clamp(p - q, min=0)
    return r / r.sum()


def _soft_ratio(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A greedy draft d (q one-hot) accepted with min(1, p(d) / (1/D)): the sampled law's ratio."""
    a = torch.clamp(p * D, max=1.0) * q
    return a + (1 - a.sum()) * _residual(p, q)


RULES: dict[str, Rule] = {
    "exact": lambda p, q: p,
    "always accepts": lambda p, q: q,
    "accepts with p(d)": lambda p, q: q * p + (1 - (q * p).sum()) * _residual(p, q),
    "resamples from p": lambda p, q: torch.minimum(p, q) + (1 - torch.minimum(p, q).sum()) * p,
    "accepts with min(1, D p(d))": _soft_ratio,
}
# wrong rules per method: (name, least chi-square power, least acceptance power); None: printed only
WRONG: dict[str, list[tuple[str, float | None, float | None]]] = {
    "probabilistic": [("always accepts", 0.99, 0.99), ("accepts with p(d)", 0.9, 0.4)],
    "greedy": [("always accepts", 0.99, 0.99), ("accepts with min(1, D p(d))", None, None)],
}


@torch.no_grad()
def _laws(model) -> dict[tuple[int, ...], torch.Tensor]:
    """The target's next-token law after the prompt, after every first token of probability >= 1e-3
    and after every 2-token continuation of probability >= 1e-2 (a cell the tests compare needs
    N * p >= 5, so >= 0.03; a prefix is at least as likely as its continuations)."""
    laws: dict[tuple[int, ...], torch.Tensor] = {}
    mass = {(): 1.0}
    for floor in (1e-3, 1e-2, None):
        keys = list(mass)
        batch = torch.tensor([PROMPT + list(k) for k in keys])  # equal lengths: one batched forward
        probs = torch.softmax(model(batch, logits_to_keep=1).logits[:, -1].float() / T, dim=-1)
        laws.update(zip(keys, probs))
        if floor is not None:
            mass = {
                k + (t,): mass[k] * float(pr[t])
                for k, pr in zip(keys, probs)
                for t in (pr * mass[k] >= floor).nonzero().flatten().tolist()
            }
    return laws


def _law(laws, cells: list[tuple[int, ...]], q: torch.Tensor, rule: Rule) -> torch.Tensor:
    """Probability of each 3-token cell when tokens 2 and 3 come out of `rule`, and of the rest."""
    p = torch.tensor([float(laws[()][a] * rule(laws[(a,)], q)[b] * rule(laws[(a, b)], q)[c]) for a, b, c in cells])
    return torch.cat([p, (1 - p.sum()).clamp(min=0).view(1)])


def _chi2_critical(dof: int) -> float:
    """Upper critical value of chi-square at alpha = 0.001, Wilson-Hilferty (within ~1% for dof >= 2;
    no scipy here)."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + ALPHA_Z * a**0.5) ** 3


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    return ((counts - expected) ** 2 / expected).sum(-1)


@pytest.fixture(scope="module", params=["probabilistic", "greedy"])
def setup(request, tiny_target, tmp_path_factory):
    method = request.param
    tiny = tiny_target("llama")
    model = load_model(tiny, dtype="float32")
    laws = _laws(model)
    # the draft vocabulary: the D tokens with the most mass at positions 2 and 3
    emitted = torch.zeros_like(laws[()])
    for (a, b), pb in ((k, laws[k]) for k in laws if len(k) == 2):
        w = float(laws[()][a] * laws[(a,)][b])
        emitted[b] += w
        emitted += w * pb
    vocab = emitted.topk(D).indices
    second = sum(float(laws[()][a]) * laws[(a,)] for a in (k[0] for k in laws if len(k) == 1))
    best = vocab[second[vocab].argmax()]  # of the 8, the one with the most mass at position 2
    if method == "greedy":
        # the greedy draft's argmax among 8 tied logits is draft id 0, the lowest target id: the
        # vocabulary is `best` and the 7 tokens above it emitted most, so a greedy draft is often accepted
        above = emitted.clone()
        above[: int(best) + 1] = -1
        vocab = torch.cat([best.view(1), above.topk(D - 1).indices])
    draft = new_draft(tiny, AUX, draft_vocab_size=D, vocab_tokens=vocab)
    with torch.no_grad():
        draft.lm_head.weight.zero_()  # q uniform over the draft vocabulary, whatever the context
    root = tmp_path_factory.mktemp("sampling")
    d = load_draft(export(make_train_dir(draft, root / "t"), root / "d", ExportSettings(dtype="float32")), model)
    assert set(d.draft_to_target(torch.arange(D)).tolist()) == set(vocab.tolist())
    q = torch.zeros_like(laws[()])
    if method == "probabilistic":
        q[vocab] = 1.0 / D
    else:  # the argmax of 8 tied logits is the first: draft id 0, the token counted twice
        assert int(d.draft_to_target(torch.tensor([0]))[0]) == int(best)
        q[best] = 1.0
    dec = SpecDecoder(model, d, k=K, temperature=T, draft_sample_method=method)
    outcomes, first_accepted = [], 0
    for s in range(N):
        out, st = dec.generate(PROMPT, 3, seed=s)
        assert st.num_draft_tokens == K * st.num_drafts
        outcomes.append(tuple(out))
        # draft 1 of round 1 accepted <=> tokens 2-3 came from round 1 (a rejection leaves 2 tokens: round 2)
        first_accepted += st.num_drafts == 1
    return dict(method=method, laws=laws, q=q, outcomes=outcomes, first_accepted=first_accepted)


def test_sampling_keeps_target_distribution(setup):
    laws, q = setup["laws"], setup["q"]
    cells = []  # 3-token continuations the target emits in >= 5 of N runs on average
    for a, b in (k for k in laws if len(k) == 2):
        w = N * float(laws[()][a] * laws[(a,)][b])
        cells += [(a, b, c) for c in (w * laws[(a, b)] >= 5).nonzero().flatten().tolist()]
    cells.sort()
    expected = N * _law(laws, cells, q, RULES["exact"])
    assert len(cells) >= 3 and expected[-1] >= 5, expected  # cells to compare, and a pooled rest
    counts = torch.tensor([float(setup["outcomes"].count(c)) for c in cells] + [0.0])
    counts[-1] = N - counts[:-1].sum()
    crit = _chi2_critical(len(cells))
    chi2 = float(_chi2(counts, expected))
    assert chi2 < crit, (chi2, crit, list(zip(counts.tolist(), expected.tolist())))

    # the stated power: each wrong rule's exact law, 2,000 simulated sets of N runs
    g = torch.Generator().manual_seed(0)
    power = {}
    for name, rule in RULES.items():
        law = _law(laws, cells, q, rule)
        sims = torch.multinomial(law, 2000 * N, replacement=True, generator=g).view(2000, N)
        sim_counts = torch.zeros(2000, len(law)).scatter_add_(1, sims, torch.ones(2000, N))
        power[name] = float((_chi2(sim_counts, expected) >= crit).float().mean())
    assert power["exact"] < 0.01, power  # the level holds for the correct rule (~0.001)
    print(
        f"{setup['method']}: chi2 {chi2:.1f} < {crit:.1f} ({len(cells)} cells + rest); rejection rate by rule: {power}"
    )
    for name, least, _ in WRONG[setup["method"]]:
        assert least is None or power[name] > least, (name, power)


def test_acceptance_counts_as_vllm(setup):
    laws, q = setup["laws"], setup["q"]
    p1 = laws[()]
    firsts = [a for a in (k[0] for k in laws if len(k) == 1)]
    lost = 1 - float(p1[firsts].sum())  # first tokens below the floor: their acceptance is unknown
    assert lost < 0.01

    def rate(accept: Callable[[torch.Tensor], float]) -> float:
        return sum(float(p1[a]) * accept(laws[(a,)]) for a in firsts)

    # sum min(p, q): E[min(1, p/q)] under a sampled q; p(d) under a one-hot q (vLLM's greedy drafts)
    beta = rate(lambda p: float(torch.minimum(p, q).sum()))
    z = (setup["first_accepted"] - N * beta) / math.sqrt(N * beta * (1 - beta))
    assert abs(z) < 3.2905, (setup["first_accepted"], N * beta)  # two-sided, alpha = 0.001
    # power (normal approximation) against each wrong rule's rate: the mass it keeps on the draft's token
    wrong_rate = {
        "always accepts": 1 - 1e-9,
        "accepts with p(d)": rate(lambda p: float((q * p).sum())),
        "accepts with min(1, D p(d))": rate(lambda p: float((torch.clamp(p * D, max=1.0) * q).sum())),
    }
    for name, _, least in WRONG[setup["method"]]:
        power = _binomial_power(N, beta, wrong_rate[name])
        print(
            f"{setup['method']}: first-round acceptance {setup['first_accepted']}/{N}, exact {beta:.3f}; "
            f"power vs {name}: {power:.3f}"
        )
        assert least is None or power > least, (name, beta, wrong_rate[name], power)
    assert 0.1 < beta < 0.9, beta  # both outcomes common: the test can see a deviation either way


def _binomial_power(n: int, p0: float, p1: float, z: float = 3.2905) -> float:
    """P(|k - n p0| >= z sqrt(n p0 (1 - p0))) when k ~ Binomial(n, p1), normal approximation."""
    half = z * math.sqrt(n * p0 * (1 - p0))
    sd = math.sqrt(n * p1 * (1 - p1))
    tail = lambda x: 0.5 * math.erfc(x / math.sqrt(2))  # noqa: E731
    return tail((n * p0 + half - n * p1) / sd) + tail((n * p1 - n * p0 + half) / sd)
