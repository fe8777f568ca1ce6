"""Exported drafts in the real vLLM engine (CPU build), on a tiny fp32 target, in one subprocess:
the target alone, then the target with a full-vocabulary nestling draft, while the engine's
`combine_hidden_states` input is recorded (tests/vllm_layer_probe.py).

- A draft over the whole target vocabulary loads (vLLM 0.32 has no `draft_id_to_target_id` for it,
  so the folder holds no d2t) and greedy outputs with it equal those without it.
- A 2-layer draft (`draft_layers=2`: `num_hidden_layers: 2`, weights `layers.0.*` / `layers.1.*`),
  briefly fitted, loads; greedy outputs with it equal those without it, and vLLM's acceptance counts
  equal the reference decoder's exactly (which a layer vLLM read differently would break).
- A draft with the optional norms on (`fc_norm`, `norm_output`, `norm_before_residual`: EAGLE-3.1's
  two plus the residual one), briefly fitted, loads (its `fc_norm.{i}` weights included); greedy
  outputs unchanged and acceptance counts equal to the reference decoder's, which drafts with the
  options as nestling trains them (counts that change when the reference ignores the options); and
  the prefill vLLM computes inside the draft (combine, the sampled and the fed-back hidden states)
  equals nestling's, each option checked on its own.
- Layer ids, proven directly: the aux states vLLM feeds the draft at serving time equal nestling's hf
  capture of the same prompt at the draft's ids, and differ from the capture at ids shifted by +-1.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle_helpers import PROMPTS, fit_step0, make_train_dir, new_draft, render
from vllm_probe import layer_id_errors, rel, run_probe
from nestling.export.run import export
from nestling.export.settings import ExportSettings

pytestmark = pytest.mark.vllm

AUX = [1, 3, 4]  # tiny llama: 6 layers, so ids -1 ([0, 2, 3]) and +1 ([2, 4, 5]) exist too
K = 3
NEW = 24
NORMS = {"fc_norm": True, "norm_output": True, "norm_before_residual": True}  # the draft norms (draft/model.py)


@pytest.fixture(scope="module")
def probe(tiny_target, tmp_path_factory):
    target = tiny_target("llama")
    root = tmp_path_factory.mktemp("probe")
    full = new_draft(target, AUX, draft_vocab_size=49152, seed=3)  # the whole vocabulary
    draft = export(make_train_dir(full, root / "train"), root / "draft", ExportSettings(dtype="float32"))
    prompts = render(target, PROMPTS[:3])
    deep = fit_step0(target, prompts, AUX, steps=150, new_tokens=NEW, layers=2)
    deep_dir = export(make_train_dir(deep, root / "train2"), root / "draft2", ExportSettings(dtype="float32"))
    normed = fit_step0(target, prompts, AUX, steps=150, new_tokens=NEW, norms=NORMS)
    normed_dir = export(make_train_dir(normed, root / "train3"), root / "draft3", ExportSettings(dtype="float32"))
    res = run_probe(target, [draft, deep_dir, normed_dir], prompts, root, K, NEW)
    return dict(
        target=target,
        draft=draft,
        deep=deep_dir,
        normed=normed_dir,
        prompts=prompts,
        res=res,
        states=root / "states.safetensors",
    )


def test_full_vocab_draft_loads_and_greedy_outputs_are_unchanged(probe):
    from safetensors.torch import load_file

    assert "d2t" not in load_file(str(probe["draft"] / "model.safetensors"))
    base = probe["res"]["baseline"]["outputs"]
    d = probe["res"]["drafts"][0]
    assert d["metrics"]["num_drafts"] > 0  # the draft really ran
    assert all(len(o) == NEW for o in base)
    print(f"[full vocab] drafts {d['metrics']['num_drafts']}, combine calls {probe['res']['combine_calls'][:6]}")
    assert_unchanged(probe, d["outputs"], base)  # fp32 greedy: with and without the draft


def assert_unchanged(probe, outputs: list[list[int]], base: list[list[int]]) -> None:
    """Equal, or parted at an fp32 near-tie that another CPU's kernels may flip (tests/greedy_tie.py)."""
    from greedy_tie import tie_gap

    from nestling.targets.load import load_model

    if outputs == base:
        return
    model = load_model(probe["target"], dtype="float32")
    for prompt, got, want in zip(probe["prompts"], outputs, base):
        assert tie_gap(model, prompt, got, want) is None


def _reference_stats(probe, draft):
    from nestling.evaluate.specdec import SpecDecoder, SpecStats
    from nestling.targets.load import load_model

    model = load_model(probe["target"], dtype="float32")
    dec = SpecDecoder(model, draft(model), k=K)  # no EOS: the engine ran with ignore_eos
    ref = SpecStats(K)
    for prompt, want in zip(probe["prompts"], probe["res"]["baseline"]["outputs"]):
        out, st = dec.generate(prompt, NEW)
        assert out == want
        ref.add(st)
    return ref


@pytest.mark.parametrize("which", ["deep", "normed"])
def test_fitted_draft_loads_and_accepts_as_the_reference_decoder(probe, which):
    """`deep`: 2 layers (`layers.0.*`, `layers.1.*`); `normed`: the draft norms on (NORMS)."""
    from safetensors.torch import load_file

    from nestling.evaluate.specdec import load_draft
    from nestling.evaluate.vllm_engine import summarize_metrics

    folder = probe[which]
    cfg, weights = json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))
    if which == "deep":
        assert cfg["num_hidden_layers"] == 2 and "layers.1.mlp.down_proj.weight" in weights
    else:
        assert {k: cfg[k] for k in NORMS} == NORMS and "fc_norm.2.weight" in weights
    base = probe["res"]["baseline"]["outputs"]
    d = probe["res"]["drafts"][1 if which == "deep" else 2]
    v = summarize_metrics(d["metrics"], K)
    assert_unchanged(probe, d["outputs"], base)  # fp32 greedy: with and without the draft
    ref = _reference_stats(probe, lambda model: load_draft(folder, model))
    print(
        f"[{which}] vLLM {v['acceptance_length']:.3f} {v['accepted_per_pos']}, "
        f"reference {ref.acceptance_length:.3f} {ref.accepted_per_pos}"
    )
    assert v["acceptance_length"] > 1.3  # the fitted weights were read (a random draft accepts ~nothing)
    assert (v["num_drafts"], v["accepted_per_pos"]) == (ref.num_drafts, ref.accepted_per_pos)
    if which == "normed":  # the equality says something: ignoring the options changes the counts

        def plain(model):
            draft = load_draft(folder, model)
            for k in NORMS:
                setattr(draft.config, k, False)
            return draft

        off = _reference_stats(probe, plain)
        print(f"[{which}] reference with the options ignored {off.acceptance_length:.3f} {off.accepted_per_pos}")
        assert (off.num_drafts, off.accepted_per_pos) != (ref.num_drafts, ref.accepted_per_pos)


def test_draft_norms_compute_what_vllm_computes(probe):
    """The normed draft's prefill of prompt 0 inside vLLM, recomputed by nestling's draft from vLLM's
    own inputs: `combine` (fc_norm) = vLLM's `combine_hidden_states`; `norm(h)` (norm_before_residual
    shapes h) = the hidden state vLLM samples from; `next_hidden(h)` (norm_output) = the one vLLM feeds
    the next step. Each option switched off in nestling breaks its match (so the test can fail: the
    acceptance counts alone barely move when only fc_norm or norm_output is ignored)."""
    from safetensors.torch import load_file

    from nestling.draft.model import KVCache
    from nestling.evaluate.specdec import load_draft
    from nestling.targets.load import load_model

    st = load_file(str(probe["states"]))
    v = {k.split(".", 1)[1]: t for k, t in st.items() if k.startswith("draft2.")}  # the third draft: NORMS
    assert {"combine_in", "combine_out", "ids", "positions", "hidden_in", "hidden_out", "aux_out"} <= set(v), sorted(st)
    assert torch.equal(v["hidden_in"], v["combine_out"])  # the prefill's hidden input is combine's output
    model = load_model(probe["target"], dtype="float32")

    def nestling(off: str | None = None) -> dict[str, float]:
        draft = load_draft(probe["normed"], model)
        if off:
            setattr(draft.config, off, False)
        with torch.no_grad():
            h = draft.step(v["ids"][None], v["hidden_in"][None], v["positions"][None], KVCache())[0]
            return {
                "fc_norm": rel(draft.combine(v["combine_in"]), v["combine_out"]),
                "norm_before_residual": rel(draft.norm(h), v["hidden_out"]),
                "norm_output": rel(draft.next_hidden(h), v["aux_out"]),
            }

    errs = nestling()
    print(f"[normed] relative error against vLLM: {errs}")
    assert max(errs.values()) < 1e-4, errs
    for option in NORMS:
        wrong = nestling(off=option)
        print(f"[normed] ... with {option} ignored: {wrong}")
        assert wrong[option] > 1e-2, (option, wrong)


def test_layer_ids_vllm_feeds_the_trained_layers_direct(probe):
    """What vLLM hands the draft for prompt 0's prefill == nestling's hf capture at the draft's ids
    (slot by slot, fp32), and != the capture at ids shifted by -1 or +1 (so the test can fail)."""
    from safetensors.torch import load_file

    assert probe["states"].exists(), f"no prefill call recorded; calls: {probe['res']['combine_calls']}"
    fed = load_file(str(probe["states"]))["prefill"]  # [T, 3H] in eagle_aux_hidden_state_layer_ids order
    prompt = probe["prompts"][0]
    T, H = len(prompt), 128
    assert fed.shape == (T, len(AUX) * H)
    fed = fed.view(T, len(AUX), H)
    same = layer_id_errors(probe["target"], prompt, fed, AUX)
    print(f"[layer ids] relative error at nestling's ids {AUX}: {same}")
    assert max(same) < 1e-4, same
    for shift in (-1, 1):
        errs = layer_id_errors(probe["target"], prompt, fed, [i + shift for i in AUX])
        print(f"[layer ids] ... at ids {[i + shift for i in AUX]}: {errs}")
        assert min(errs) > 1e-2, (shift, errs)  # every slot is clearly another layer
