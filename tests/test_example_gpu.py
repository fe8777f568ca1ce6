"""examples/gpu.yaml, the recipe that measured best on one GPU: it loads as the pipeline reads it, and
its stage chain (regenerate every input -> data -> online train -> export -> eval) runs end to end on
real SmolLM2 when shrunk to a few conversations per input and a few steps."""

from __future__ import annotations

import json
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
    assert cfg.inputs == ["builtin:sharegpt", "builtin:maths", "builtin:code"]  # the mix, at the built sizes
    assert cfg.settings["data"].weights == {}
    assert t.steps * t.batch_tokens == 3000 * 32768  # the 98M training tokens the docs report
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
        "regenerate.limit=2",  # per input
        "regenerate.max_turns=1",
        "regenerate.max_new_tokens=4",
        "data.held_out=0.5",
        "train.steps=1",
        "train.batch_tokens=512",
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
    for name in ("0-sharegpt", "1-maths", "2-code"):  # every input, greedy and sampled
        for sub in (regen / name, regen / name / "sampled"):
            assert len((sub / "messages.jsonl").read_text().splitlines()) == 2, sub
    data = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert data["counts"]["read"] == 3 * 2 * 2
    export = tmp_path / "run" / "export"
    assert (export / "config.json").exists() and (export / "model.safetensors").exists()
    assert (tmp_path / "run" / "eval" / "report.json").exists()
