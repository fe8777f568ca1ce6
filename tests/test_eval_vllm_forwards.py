"""Tokens per target forward in the real vLLM engine (CPU build, subprocess, no mocks), counted per
prompt by the worker (`vllm_worker.generate_counted`), on the tiny random-weight Llama and a briefly
fitted draft (tests/eagle_helpers.py), as tests/test_export_vllm.py builds them.

The count is checked against what vLLM's own counters imply where they cannot be wrong: with an
EAGLE-3 draft every decode forward verifies one draft, so a prompt takes 1 (the prefill) + its drafts
forwards, and the whole run len(prompts) + num_drafts. The old reading, tokens / (tokens - accepted),
counts a draft token accepted past max_tokens as emitted: at max_tokens = 2 every prompt takes exactly
two forwards (the prefill's token, then one step whose first token ends it), so the figure is 1.0
whatever the draft accepts, while the counters read more.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle_helpers import PROMPTS, fit_step0, make_train_dir, render
from nestling.errors import NestlingError
from nestling.evaluate.standard_error import ratio_standard_error
from nestling.evaluate.vllm_engine import run_vllm
from nestling.export.run import export
from nestling.export.settings import ExportSettings

AUX = [1, 3, 4]  # the tiny Llama has 6 layers
K = 3
NEW = 24


@pytest.fixture(scope="module")
def fitted(tiny_target, tmp_path_factory):
    """The tiny target, its six rendered prompts and a draft fitted on them (accepts well above chance)."""
    target = tiny_target("llama")
    root = tmp_path_factory.mktemp("forwards")
    prompts = render(target, PROMPTS)
    draft = fit_step0(target, prompts, AUX, steps=150, new_tokens=NEW)
    folder = export(make_train_dir(draft, root / "train"), root / "draft", ExportSettings(dtype="float32"))
    return target, folder, prompts


def _run(fitted, max_new_tokens: int) -> dict:
    target, folder, prompts = fitted
    res = run_vllm(target, [folder], prompts, K, max_new_tokens, dtype="float32", max_model_len=512, baseline=False)
    return res["drafts"][0]


def _quality():
    """benchmarks/quality.py, whose `per_forward` is the figure the quality tables print."""
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import quality

    return quality


@pytest.mark.vllm
def test_forwards_counted_per_prompt_equal_the_drafts_verified(fitted):
    """24 new tokens: each prompt's count is 1 + its drafts in all (the total equals prompts + vLLM's
    num_drafts), the figure is tokens / forwards, no prompt and no total exceeds K + 1, and the
    counter reading can only be higher (forwards >= tokens - accepted)."""
    d = _run(fitted, NEW)
    prompts = fitted[2]
    assert d["num_drafts"] > 0 and d["num_accepted_tokens"] > 0  # the draft ran and was accepted
    assert len(d["forwards"]) == len(prompts) and d["target_forwards"] == sum(d["forwards"])
    assert d["target_forwards"] == len(prompts) + d["num_drafts"]
    assert d["mean_tokens_per_target_forward"] == d["tokens"] / (len(prompts) + d["num_drafts"])
    for out, n in zip(d["outputs"], d["forwards"]):
        assert n <= len(out) <= n * (K + 1)
    assert 1.0 < d["mean_tokens_per_target_forward"] <= K + 1
    assert d["mean_tokens_per_target_forward"] <= _quality().per_forward_from_counters(d)
    assert _quality().per_forward(d) == d["mean_tokens_per_target_forward"]
    se = ratio_standard_error([len(o) for o in d["outputs"]], d["forwards"])  # over these prompts' counts
    assert se is not None and d["tokens_per_forward_se"] == se == _quality().per_forward_se(d)


@pytest.mark.vllm
def test_a_short_max_tokens_counts_the_forwards_the_counters_overshoot(fitted):
    """max_tokens = 2: two forwards per prompt, so 1.0 token per forward; the counters' reading is
    above it by every draft token accepted past the budget, and the figure the benchmark and the
    eval stage report is the counted one."""
    d = _run(fitted, 2)
    n = len(fitted[2])
    assert d["tokens"] == 2 * n and d["num_accepted_tokens"] > 0  # accepted, never emitted
    assert _quality().per_forward(d) == 1.0  # the benchmark's figure (from the counters it read 4.0 here)
    assert d["forwards"] == [2] * n and d["mean_tokens_per_target_forward"] == 1.0  # the eval stage's
    assert d["tokens_per_forward_se"] == 0.0  # every prompt the same 1.0: no spread
    old = _quality().per_forward_from_counters(d)
    print(f"[max_tokens 2] counted 1.000, from the counters {old:.3f}")
    assert old > 1.0


def test_a_count_outside_one_to_k_plus_one_tokens_per_forward_is_refused():
    """A forward emits 1 to K + 1 tokens: a count that says otherwise is refused, not reported."""
    from nestling.evaluate.vllm_engine import tokens_per_forward

    assert tokens_per_forward([[1, 2, 3], [4]], [1, 1], k=2) == 2.0
    with pytest.raises(NestlingError, match="prompt 0: 4 tokens from 1 target forwards at k=2"):
        tokens_per_forward([[1, 2, 3, 4]], [1], k=2)
    with pytest.raises(NestlingError, match="prompt 1: 1 tokens from 2 target forwards"):
        tokens_per_forward([[1], [2]], [1, 2], k=2)
