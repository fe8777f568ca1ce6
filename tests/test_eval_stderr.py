"""The standard error beside every tokens-per-target-forward figure: the ratio estimator's over the prompts
(nestling.evaluate.standard_error), carried from the per-prompt counts into vLLM's summary, the eval
report, benchmarks/quality.py's rows and table, and benchmarks/vllm_cpu_sampling.py's --eagle result.

The worked example: three prompts of 4, 6, 9 tokens in 2, 2, 3 forwards. R = 19 / 7; the residuals
t - R f are -10/7, 4/7, 6/7, whose squares sum to 152/49; SE = sqrt(152/49 / (3 * 2)) / (7 / 3)."""

from __future__ import annotations

import math

import pytest

from nestling.evaluate.standard_error import plus_minus, ratio_standard_error

TOKENS, FORWARDS = [4, 6, 9], [2, 2, 3]
R = 19 / 7
SE = math.sqrt(152 / 49 / 6) / (7 / 3)  # 0.308


def _worker_result() -> dict:
    """What vllm_worker.as_result and its counters give for the worked example's three prompts (K = 3)."""
    metrics = {
        "num_drafts": 4.0,
        "num_draft_tokens": 12.0,
        "num_accepted_tokens": 12.0,
        "num_accepted_tokens_per_pos": [4.0, 4.0, 4.0],
    }
    outputs = [[7] * t for t in TOKENS]
    return {"metrics": metrics, "outputs": outputs, "forwards": FORWARDS, "target_forwards": 7, "tokens": 19}


def test_ratio_standard_error_matches_the_worked_example():
    assert ratio_standard_error(TOKENS, FORWARDS) == pytest.approx(SE, rel=1e-12)
    assert ratio_standard_error(TOKENS[::-1], FORWARDS[::-1]) == pytest.approx(SE, rel=1e-12)  # order is no matter


def test_ratio_standard_error_is_none_below_two_prompts_and_zero_for_equal_ratios():
    assert ratio_standard_error([], []) is None
    assert ratio_standard_error([5], [2]) is None
    assert ratio_standard_error([0, 0], [0, 0]) is None  # no forwards: no ratio
    assert ratio_standard_error([2, 4, 6], [1, 2, 3]) == 0.0  # every prompt 2 tokens per forward
    with pytest.raises(ValueError, match="2 token counts for 3 forward counts"):
        ratio_standard_error([1, 2], [1, 1, 1])


def test_plus_minus_shows_the_error_only_where_there_is_one():
    assert plus_minus(3.00449, 0.0412) == "3.004 ± 0.041"
    assert plus_minus(3.00449, None) == "3.004"


def test_vllm_summary_carries_the_standard_error_of_its_per_prompt_counts():
    from nestling.evaluate.vllm_engine import summarize_run

    s = summarize_run(_worker_result(), 3)
    assert s["mean_tokens_per_target_forward"] == pytest.approx(R)
    assert s["tokens_per_forward_se"] == pytest.approx(SE, rel=1e-12)
    one = {**_worker_result(), "outputs": [[7] * 4], "forwards": [2], "target_forwards": 2}
    assert summarize_run(one, 3)["tokens_per_forward_se"] is None


def _quality(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import quality

    return quality


def test_quality_rows_carry_the_standard_error_and_the_table_shows_it(monkeypatch, capsys):
    """Both row builders carry `tokens_per_forward_se` from their engine's result; the table prints it
    in its own column, and "-" for a row from a result written before it (no key)."""
    from nestling.evaluate.vllm_engine import summarize_run

    q = _quality(monkeypatch)
    ngram = q.ngram_row({**summarize_run(_worker_result(), 3), "tokens": 19, "tokens_per_s": 9.0}, "code", 3)
    assert ngram["tokens_per_forward"] == pytest.approx(R)
    assert ngram["tokens_per_forward_se"] == pytest.approx(SE, rel=1e-12)
    engine = {
        "acceptance_length": 4.0,
        "per_position": [1.0, 1.0, 1.0],
        "mean_tokens_per_target_forward": R,
        "tokens_per_forward_se": SE,
    }
    eagle = q.eagle_row(engine, "chat", "reference", 3, 0.0, "greedy")
    assert (eagle["tokens_per_forward"], eagle["tokens_per_forward_se"]) == (R, SE)
    old = {k: v for k, v in eagle.items() if k != "tokens_per_forward_se"}
    old["tokens_per_forward"] = 2.5
    q.print_rows("t", [eagle, ngram, old], {})
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| chat") or x.startswith("| code")]
    assert "| 2.714 | 0.308 |" in lines[0] and "| 2.714 | 0.308 |" in lines[1]
    assert "| 2.500 | - |" in lines[2]


def test_vllm_cpu_sampling_eagle_result_carries_the_standard_error(monkeypatch):
    _quality(monkeypatch)
    import vllm_cpu_sampling

    r = vllm_cpu_sampling.eagle_result(_worker_result(), 3)
    assert r["tokens_per_forward"] == pytest.approx(R)
    assert r["tokens_per_forward_se"] == pytest.approx(SE, rel=1e-12)


def test_report_md_shows_the_standard_error_beside_tokens_per_forward():
    """report.md: "2.714 ± 0.308" and a line saying what ± is; a report without it shows the figure alone."""
    from nestling.evaluate.report import SE_NOTE, markdown

    r = {"acceptance_length": 4.0, "per_position": [1.0], "tokens_per_s": 1.0}
    r.update(mean_tokens_per_target_forward=R, tokens_per_forward_se=SE)
    rep = {"draft": "d", "target": "t", "k": 1, "num_prompts": 3, "max_new_tokens": 8, "temperature": 0.0}
    md = markdown({**rep, "engines": {"vllm": r}})
    assert "| vllm | 4.000 | 2.714 ± 0.308 |" in md and SE_NOTE in md
    md = markdown({**rep, "engines": {"vllm": {**r, "tokens_per_forward_se": None}}})
    assert "| vllm | 4.000 | 2.714 |" in md and SE_NOTE not in md
