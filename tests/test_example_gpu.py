"""examples/gpu.yaml, the recipe that measured best on one GPU: it loads as the pipeline reads it, and
its stage chain (regenerate -> data -> online train -> export -> eval) runs end to end on real SmolLM2
when shrunk to a few conversations and steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from nestling.pipeline.run import enabled_stages, run
from nestling.pipeline.settings import load_run_config
from nestling.pipeline.stages import STAGES, train_mode
from nestling.train.settings import default_lr

GPU_YAML = Path(__file__).resolve().parents[1] / "examples" / "gpu.yaml"


def test_gpu_example_is_the_measured_recipe():
    cfg = load_run_config(GPU_YAML, STAGES, [])
    t, r = cfg.settings["train"], cfg.settings["regenerate"]
    assert (t.online, t.draft_layers, t.optimizer, t.ttt_steps) == (True, 2, "muon", 3)
    assert (t.draft_fc_norm, t.draft_norm_output, t.draft_norm_before_residual) == (True, True, False)  # EAGLE-3.1
    assert t.steps * t.batch_tokens == 2747 * 32768  # the 90M training tokens the docs report
    assert t.lr is None and default_lr(576, t.steps) == pytest.approx(2e-3)  # derived: the measured run's lr
    assert (r.max_turns, r.max_new_tokens, r.temperature) == (16, 384, 0.0)
    assert (r.sampled, r.sampled_temperature) == (1, 0.7)  # greedy plus one sampled answer, as measured
    assert cfg.settings["data"].max_length == 2048 and cfg.settings["eval"].engine == "auto"
    online, _ = train_mode(cfg, "unused")
    names = [s.name for s in enabled_stages(online, STAGES)]
    assert names == ["regenerate", "data", "train", "export", "eval"]  # online: no capture store


@pytest.mark.slow
def test_gpu_example_runs_end_to_end_when_shrunk(tmp_path):
    small = [
        f"run_dir={tmp_path / 'run'}",
        "regenerate.engine=hf",
        "regenerate.limit=4",
        "regenerate.max_turns=2",
        "regenerate.max_new_tokens=12",
        "data.held_out=0.5",
        "train.steps=2",
        "train.batch_tokens=1024",
        "train.eval_batches=1",
        "eval.engine=reference",
        "eval.max_prompts=1",
        "eval.max_new_tokens=8",
        "eval.baseline=false",
    ]
    outcomes = run(GPU_YAML, small)
    assert isinstance(outcomes, list)
    assert [o.name for o in outcomes] == ["regenerate", "data", "train", "export", "eval"]
    assert all(o.action == "ran" for o in outcomes)
    regen = tmp_path / "run" / "regenerate"
    assert (regen / "messages.jsonl").exists() and (regen / "sampled" / "messages.jsonl").exists()
    export = tmp_path / "run" / "export"
    assert (export / "config.json").exists() and (export / "model.safetensors").exists()
    assert (tmp_path / "run" / "eval" / "report.json").exists()
