"""benchmarks/draft_calibration.py: first-position agreement and sampled acceptance, teacher-forced."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import draft_calibration  # noqa: E402
from eagle_helpers import PROMPTS, new_draft, render  # noqa: E402


def test_a_draft_equal_to_the_target_accepts_everything_at_scale_one_only():
    """q = p: every sampled draft token is accepted at any temperature; a scaled copy accepts less at a
    temperature but keeps its argmax, so greedy agreement does not move."""
    torch.manual_seed(0)
    logits = torch.randn(7, 11) * 3
    ids = torch.arange(11)
    r = draft_calibration.first_position_sums(logits, logits.clone(), ids, [0.7, 1.0], [1.0, 2.0])
    assert r["positions"] == 7 and r["greedy"] == 7
    assert math.isclose(r["accept"]["0.7,1"], 7.0, rel_tol=1e-5) and math.isclose(r["accept"]["1,1"], 7.0, rel_tol=1e-5)
    assert r["accept"]["0.7,2"] < 6.9 and r["accept"]["1,2"] < 6.9


def test_acceptance_is_the_overlap_of_the_two_laws_on_the_draft_vocabulary():
    """By hand: target p = (0.25, 0.75, 0) over three tokens, a draft over tokens 1 and 0 (in that
    order) with q = (0.5, 0.5): overlap min(.75,.5) + min(.25,.5) = 0.75 at T = 1; the target's argmax
    (token 1) is the draft's only where the draft's own argmax maps to it."""
    p = torch.log(torch.tensor([[0.25, 0.75, 1e-30]]))
    q = torch.tensor([[0.2, 0.0]])  # draft id 0 -> target 1, draft id 1 -> target 0; argmax draft id 0
    r = draft_calibration.first_position_sums(p, q, torch.tensor([1, 0]), [1.0], [1.0])
    softq = torch.softmax(q[0], -1)
    expected = min(0.75, softq[0].item()) + min(0.25, softq[1].item())
    assert math.isclose(r["accept"]["1,1"], expected, rel_tol=1e-5) and r["greedy"] == 1


def test_teacher_forced_rows_are_the_draft_steps_the_decoder_runs(tiny_target):
    """The first drafted row is the draft's first step after the prefill in nestling's decoder (the
    first answer token from the target, then the draft predicts the next), and each row's target
    logits are the target's prediction of the same token."""
    from nestling.evaluate.specdec import BatchTarget, SpecDecoder
    from nestling.targets.load import load_model

    target = tiny_target("llama")
    model = load_model(target, dtype="float32")
    draft = new_draft(target).eval()
    prompt = render(target, PROMPTS[:1])[0]
    answer = [5, 9, 17, 33]
    zq, zp = draft_calibration.teacher_forced(model, draft, prompt, answer)
    assert zq.shape == (len(answer) - 1, draft.config.draft_vocab_size) and zp.shape[0] == len(answer) - 1

    dec = SpecDecoder(model, draft, k=1)
    bt = BatchTarget(model, dec.aux_ids)
    _, aux = bt.prefill([prompt])
    assert aux is not None
    from nestling.draft.model import SlotCache

    P = len(prompt)
    toks = torch.tensor([prompt[1:] + answer[:1]])
    h = dec._feed(toks, aux, torch.arange(P)[None], SlotCache(P + 8))
    assert torch.allclose(draft.logits(h)[0, -1].float(), zq[0], atol=1e-4)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([prompt + answer])).logits[0].float()
    assert torch.allclose(zp, full[P : P + len(answer) - 1], atol=1e-4)


def test_measure_adds_up_every_prompts_drafted_positions(tiny_target):
    """Each answer of n tokens drafts n - 1 positions (the first comes from the prefill); an answer of
    one token drafts none and adds nothing; the figures are shares of the positions."""
    from argparse import Namespace

    from nestling.targets.load import load_model

    target = tiny_target("llama")
    model = load_model(target, dtype="float32")
    draft = new_draft(target).eval()
    prompts = render(target, PROMPTS[:3])
    answers = [[5, 9, 17, 33], [7], [11, 12, 13]]
    args = Namespace(serve_temperatures=[0.7], scales=[1.0, 1.5])
    r = draft_calibration.measure(model, draft, prompts, answers, args)
    assert r["positions"] == 3 + 2
    parts = [draft_calibration.teacher_forced(model, draft, p, a) for p, a in zip(prompts, answers) if len(a) > 1]
    ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size))
    agree = sum(int((ids[zq.argmax(-1)] == zp.argmax(-1)).sum()) for zq, zp in parts)
    assert math.isclose(r["greedy_agreement"], agree / 5)
    assert set(r["acceptance"]) == {"0.7,1", "0.7,1.5"} and all(0.0 <= v <= 1.0 for v in r["acceptance"].values())


def test_answers_are_sampled_with_one_seed_per_prompt(tiny_target):
    """Prompt i is answered with seed i: the texts, and so the figures, repeat from one run to the next."""
    from nestling.evaluate.specdec import target_generate
    from nestling.targets.load import load_model

    target = tiny_target("llama")
    model = load_model(target, dtype="float32")
    prompts = render(target, PROMPTS[:3])
    answers, _ = draft_calibration.generate(model, prompts, 6, 0.7, [])
    assert answers == [target_generate(model, p, 6, 0.7, [], seed=i)[0] for i, p in enumerate(prompts)]
