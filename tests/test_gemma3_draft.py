"""A draft for a Gemma-3 target (sliding-window and full attention layers, GELU, rope parameters per
layer type) on the tiny random-weight Gemma-3: the draft derived from it is a plain Llama layer vLLM can
build (one flat rope with the full-attention layers' theta, SiLU), and where the installed vLLM cannot
serve an EAGLE-3 draft beside the target (vLLM 0.32's Gemma3ForCausalLM has no SupportsEagle3, and
nestling's plugin that adds it is turned off: VLLM_PLUGINS=), eval says so and measures with the
reference decoder instead of failing inside the engine. With the plugin: tests/test_vllm_plugin.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagle_helpers import make_train_dir, new_draft
from nestling.draft.model import DraftConfig, full_attention_rope
from nestling.export.contract import native_config

AUX = [1, 2, 3]  # the tiny Gemma-3 has 6 layers


def test_draft_of_a_gemma3_target_takes_the_full_attention_rope_and_silu(tiny_target):
    from transformers import AutoConfig

    target = tiny_target("gemma3")
    raw = json.loads((target / "config.json").read_text())
    assert set(raw["rope_parameters"]) == {"full_attention", "sliding_attention"}  # the case at hand
    full = raw["rope_parameters"]["full_attention"]
    assert full["rope_theta"] != raw["rope_parameters"]["sliding_attention"]["rope_theta"]
    c = DraftConfig.from_target(AutoConfig.from_pretrained(target), 100, AUX)
    assert c.rope_parameters == full and c.hidden_act == "silu"
    assert c.llama_config().rope_parameters["rope_theta"] == full["rope_theta"]  # what the draft trains with
    n = native_config(c, raw, "float32")  # what vLLM reads: a nested rope made it fail ("unhashable type")
    assert n["rope_parameters"] == full and n["rope_theta"] == full["rope_theta"] and n["hidden_act"] == "silu"
    flat = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    assert full_attention_rope(flat) == flat and full_attention_rope({}) == {}


def _vllm_serves_eagle3_beside(arch: str) -> bool:
    """vLLM's own answer without plugins, asked in a process of its own (vLLM keeps global state)."""
    code = (
        "import sys\nfrom vllm.model_executor.models import ModelRegistry\n"
        "from vllm.model_executor.models.interfaces import supports_eagle3\n"
        f"print(supports_eagle3(ModelRegistry._try_load_model_cls({arch!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1] == "True"


@pytest.mark.vllm
@pytest.mark.parametrize("engine", ["vllm", "both"])
def test_eval_in_vllm_beside_a_target_vllm_cannot_serve_measures_with_the_reference_decoder(
    tiny_target, tmp_path, capsys, monkeypatch, engine
):
    from nestling.evaluate.run import evaluate
    from nestling.evaluate.settings import EvalSettings
    from nestling.export.run import export
    from nestling.export.settings import ExportSettings

    if _vllm_serves_eagle3_beside("Gemma3ForCausalLM"):
        pytest.skip("this vLLM serves EAGLE-3 beside Gemma-3: nothing to fall back from")
    monkeypatch.setenv("VLLM_PLUGINS", "")  # nestling's plugin off: vLLM's own Gemma3ForCausalLM
    target = tiny_target("gemma3")
    draft = export(make_train_dir(new_draft(target, AUX), tmp_path / "t"), tmp_path / "d", ExportSettings())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Count to five."}\n{"prompt": "Say hello."}\n')
    s = EvalSettings(max_new_tokens=6, k=2, engine=engine, dtype="float32", baseline=False)
    report = evaluate(draft, target, prompts, tmp_path / "e", s)
    assert list(report["engines"]) == ["reference"] and report["num_prompts"] == 2
    assert report["engines"]["reference"]["tokens"] > 0
    err = capsys.readouterr().err
    assert "the reference decoder measures this draft instead of vLLM" in err
    assert "Gemma3ForCausalLM does not implement SupportsEagle3" in err
    assert "nestling's vLLM plugin adds the interface, but vLLM did not load it here" in err
