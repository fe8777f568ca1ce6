"""nestling's vLLM plugin (export/vllm_plugin.py) in the real engine (CPU build): an EAGLE-3 draft beside
a tiny random-weight Gemma-3, whose vLLM 0.32 class lacks SupportsEagle3.

- With the plugin (installed with nestling, loaded by vLLM itself), the engine serves the draft: greedy
  outputs equal the target's alone, and vLLM's acceptance counts equal nestling's reference decoder's
  exactly (which a wrong layer, embedding scale or rope inside the engine would break).
- The states vLLM hands the draft at serving time are nestling's hf capture at the draft's layer ids,
  and not the capture at ids shifted by one (the plugin's layer numbering is nestling's).
What `nestling plan` says with the plugin on and off: tests/test_plan_serving.py.
"""

from __future__ import annotations

import json

import pytest

from eagle_helpers import PROMPTS, fit_step0, make_train_dir, render
from vllm_probe import layer_id_errors, run_probe
from nestling.export.run import export
from nestling.export.settings import ExportSettings

pytestmark = pytest.mark.vllm

AUX = [1, 3, 4]  # the tiny Gemma-3 has 6 layers: ids shifted by -1 and +1 exist too
K = 3
NEW = 24


@pytest.fixture(scope="module")
def probe(tiny_target, tmp_path_factory):
    target = tiny_target("gemma3")
    root = tmp_path_factory.mktemp("gemma3")
    prompts = render(target, PROMPTS[:3])
    fitted = fit_step0(target, prompts, AUX, steps=150, new_tokens=NEW)
    draft = export(make_train_dir(fitted, root / "train"), root / "draft", ExportSettings(dtype="float32"))
    res = run_probe(target, [draft], prompts, root, K, NEW)
    return dict(target=target, draft=draft, prompts=prompts, res=res, states=root / "states.safetensors")


def test_vllm_serves_the_draft_beside_gemma3_and_accepts_as_the_reference_decoder(probe):
    from nestling.evaluate.specdec import SpecDecoder, SpecStats, load_draft
    from nestling.evaluate.vllm_engine import summarize_metrics
    from nestling.targets.load import load_model

    assert "cannot_serve" not in probe["res"], probe["res"].get("cannot_serve")
    base = probe["res"]["baseline"]["outputs"]
    d = probe["res"]["drafts"][0]
    assert all(len(o) == NEW for o in base)
    assert d["outputs"] == base  # fp32 greedy: the draft changes nothing
    model = load_model(probe["target"], dtype="float32")
    dec = SpecDecoder(model, load_draft(probe["draft"], model), k=K)
    ref = SpecStats(K)
    for prompt, want in zip(probe["prompts"], base):
        out, st = dec.generate(prompt, NEW)
        assert out == want
        ref.add(st)
    v = summarize_metrics(d["metrics"], K)
    print(f"[gemma3] vLLM {v['acceptance_length']:.3f} {v['accepted_per_pos']}, reference {ref.accepted_per_pos}")
    assert v["acceptance_length"] > 1.3  # the fitted draft was read and fed the right states
    assert (v["num_drafts"], v["accepted_per_pos"]) == (ref.num_drafts, ref.accepted_per_pos)


def test_the_states_vllm_feeds_the_draft_are_nestlings_layer_ids(probe):
    from safetensors.torch import load_file

    fed = load_file(str(probe["states"]))["prefill"]  # [T, 3H] in eagle_aux_hidden_state_layer_ids order
    prompt = probe["prompts"][0]
    H = json.loads((probe["target"] / "config.json").read_text())["hidden_size"]
    fed = fed.view(len(prompt), len(AUX), H)
    same = layer_id_errors(probe["target"], prompt, fed, AUX)
    print(f"[gemma3 layer ids] relative error at {AUX}: {same}")
    assert max(same) < 1e-4, same
    for shift in (-1, 1):
        errs = layer_id_errors(probe["target"], prompt, fed, [i + shift for i in AUX])
        assert min(errs) > 1e-2, (shift, errs)
