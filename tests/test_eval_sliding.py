"""The reference decoder beside a target with sliding-window layers (the tiny Gemma-3: window 16, four
of six layers sliding): rejected drafts leave masked columns in the batch's cache, which must not
count against the window, and the window must not drop columns still inside it. Greedy outputs equal
the target's own (transformers' generate, its sliding cache) token for token, over prompts of unequal
length (left padding) and decodes far past the window."""

from __future__ import annotations

import pytest
from capture_fixture import one_thread  # noqa: F401 (autouse: one thread for tiny shapes)
import torch

from eagle_helpers import new_draft
from nestling.evaluate import specdec
from nestling.evaluate.specdec import SpecDecoder, sliding_window, target_generate
from nestling.targets.load import load_model

AUX = [1, 3, 4]
NEW = 48


@pytest.fixture(scope="module")
def gemma3(tiny_target):
    target = tiny_target("gemma3")
    return target, load_model(target, dtype="float32")


def _decoder(target, model) -> SpecDecoder:
    torch.manual_seed(0)
    draft = new_draft(target, AUX, draft_vocab_size=1024).eval()
    with torch.no_grad():  # a random head: most drafts are rejected, so holes sit inside every window
        draft.lm_head.weight.normal_(0, 0.5)
    return SpecDecoder(model, draft, k=3)


def test_sliding_window_is_read_from_the_config(gemma3):
    from types import SimpleNamespace as C

    assert sliding_window(gemma3[1].config) == (16, True)
    assert sliding_window(C(sliding_window=4096)) == (4096, False)  # Mistral: every layer slides
    assert sliding_window(C(sliding_window=4096, layer_types=["full_attention"] * 2)) == (None, False)  # Qwen2
    assert sliding_window(C()) == (None, False)


def test_greedy_beside_a_sliding_window_target_equals_the_target(gemma3):
    target, model = gemma3
    prompts = [list(range(200, 230)), [5, 6, 7, 8], list(range(300, 320))]
    want = [target_generate(model, p, NEW)[0] for p in prompts]
    outs, stats, _ = _decoder(target, model).generate_batch(prompts, NEW)
    assert sum(s.num_draft_tokens - s.num_accepted_tokens for s in stats) > 10  # rejected drafts: holes
    assert outs == want


def test_the_window_counted_in_columns_would_change_the_output(gemma3, monkeypatch):
    """What the test above guards: with holes counted against the window (the masks transformers builds
    by column), the same decode parts from the target's output."""
    target, model = gemma3
    prompts = [list(range(200, 230)), list(range(300, 320))]
    want = [target_generate(model, p, NEW)[0] for p in prompts]
    monkeypatch.setattr(specdec, "sliding_window", lambda config: (None, False))
    outs, _, _ = _decoder(target, model).generate_batch(prompts, NEW)
    assert outs != want
