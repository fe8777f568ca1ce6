"""tests/greedy_tie.py, which the vLLM tests use to call greedy outputs unchanged on any CPU: a near-tie
may part two decodes, a token the target never ranked near the top may not."""

from __future__ import annotations

import torch

from greedy_tie import tie_gap
from nestling.targets.load import load_model


def test_equal_outputs_pass_and_a_far_token_fails(tiny_target):
    model = load_model(tiny_target("llama"), dtype="float32")
    prompt = [5, 6, 7, 8]
    want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=4)[0, 4:].tolist()
    assert tie_gap(model, prompt, want, want) is None
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + want[:1]])).logits[0, -1]
    far = int(logits.argmin())  # the target's least likely token at position 1
    why = tie_gap(model, prompt, want[:1] + [far] + want[2:], want)
    assert why is not None and "not a near-tie" in why and "token 1" in why
    assert "prefix" in tie_gap(model, prompt, want[:2], want)


def test_an_exact_tie_may_part_the_outputs(tiny_target):
    model = load_model(tiny_target("llama"), dtype="float32")
    prompt = [5, 6, 7, 8]
    want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=3)[0, 4:].tolist()
    twin = (want[0] + 1) % model.config.vocab_size
    with torch.no_grad():  # the twin's head row equals the winner's: their logits tie exactly
        model.get_output_embeddings().weight[twin] = model.get_output_embeddings().weight[want[0]]
    assert tie_gap(model, prompt, [twin, 1, 2], want) is None
