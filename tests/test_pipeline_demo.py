"""The embedded demo end to end on a small subset: real SmolLM2, ~50 ShareGPT conversations, a few steps."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from nestling.pipeline.demo import demo, demo_config_path, summary

SMALL = [
    "data.limit=50",
    "data.max_length=128",
    "data.held_out=0.1",
    "train.steps=4",
    "train.batch_tokens=1024",
    "train.eval_batches=1",
    "train.checkpoint_every=2",
    "eval.max_prompts=1",
    "eval.max_new_tokens=16",
]


def test_shipped_demo_config_is_the_example():
    root = Path(__file__).resolve().parents[1]
    assert demo_config_path().read_text() == (root / "examples" / "demo.yaml").read_text()
    cfg = yaml.safe_load(demo_config_path().read_text())
    assert cfg["target"] == "builtin:smollm2" and cfg["inputs"] == ["builtin:sharegpt"]


def test_summary_says_what_the_figure_is_measured_against(tmp_path):
    """Beside the draft's figure the demo prints what no speculation (1.0) and a perfect draft (K + 1) give."""
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.json").write_text(
        json.dumps({"k": 5, "engines": {"vllm": {"acceptance_length": 1.8}}})
    )
    text = summary(tmp_path, "T", 3)
    assert "acceptance length (vllm, K=5): 1.800" in text
    assert "no speculation gives 1.000, a perfect draft 6.000 (K + 1)" in text


def test_demo_config_holds_only_real_settings(tmp_path):
    """Every key of the shipped config is a field of the real stages' settings (no typo hides)."""
    from nestling.pipeline.settings import load_run_config
    from nestling.pipeline.stages import STAGES

    cfg = load_run_config(demo_config_path(), STAGES, [f"run_dir={tmp_path}"])
    assert cfg.settings["regenerate"] is None
    assert cfg.settings["train"].ttt_steps == cfg.settings["eval"].k == 3
    # the measured demo budget (examples/demo.yaml: 1.392 tokens per forward in vLLM against 1.228 for 160 x 100)
    assert (cfg.settings["data"].limit, cfg.settings["train"].steps) == (400, 300)
    assert cfg.settings["capture"].device == cfg.settings["train"].device == cfg.settings["eval"].device == "cpu"


@pytest.mark.slow
@pytest.mark.vllm
def test_demo_end_to_end_on_a_subset(tmp_path, smollm2_dir, sharegpt_path, capsys):
    out = tmp_path / "demo"
    text = demo(out=out, overrides=SMALL + ["eval.engine=both", "eval.baseline=false"])
    printed = capsys.readouterr().out
    assert text and text in printed
    report = json.loads((out / "eval" / "report.json").read_text())
    assert set(report["engines"]) == {"reference", "vllm"} and report["k"] == 3
    for engine, r in report["engines"].items():
        assert 1.0 <= r["acceptance_length"] <= 4.0
        assert f"acceptance length ({engine}, K=3): {r['acceptance_length']:.3f}" in text
    assert "no speculation gives 1.000, a perfect draft 4.000 (K + 1)" in text
    assert f"per-position acceptance plot: {out / 'eval' / 'acceptance.png'}" in text
    assert (out / "eval" / "acceptance.png").stat().st_size > 0
    draft = out / "export"
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert f"draft folder: {draft}" in text
    serve = text.strip().splitlines()[-1].strip()
    argv = shlex.split(serve)
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(smollm2_dir)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    # every stage recorded as complete; a second demo run skips them all
    text2 = demo(out=out, overrides=SMALL + ["eval.engine=both", "eval.baseline=false"])
    assert text2 == text
    log = (out / "run.log").read_text()
    for stage in ("data", "capture", "train", "export", "eval"):
        assert f"[run] {stage}: complete" in log
