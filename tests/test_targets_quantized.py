"""compressed-tensors targets (W4A16 pack-quantized, as Kimi-K2.5 ships) load wherever nestling runs the
target: capture (hf backend), online training features, the hf regeneration engine and the reference
evaluator, all through `targets.load.load_model`, which dequantizes them to dense weights at load.

The quantized checkpoints are made by the compressed-tensors library itself (tests/quant_fixture.py) from
a tiny random Llama and a tiny random DeepSeek-V3 (MLA + MoE, experts quantized one by one). Besides the
quantized folder, the fixture decompresses it with compressed-tensors into a plain dense float32 folder:
the weights the quantized target must compute with, loaded with no quantizer at all.
"""

from __future__ import annotations

import json

import pytest
import torch
from capture_fixture import one_thread  # noqa: F401 (autouse: one thread for tiny shapes)
from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

from capture_data import make_data_dir
from nestling.capture.run import capture
from nestling.capture.settings import CaptureSettings
from nestling.capture.store import CaptureDataset
from nestling.targets.load import head_tensor_names, load_model, quantized_load_kwargs
from quant_fixture import GROUP, quantized_target
from test_capture_parity import close, reference

# transformers_model passes dequantize=True on purpose: its "the model's quantization_config will be used" is noise
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")

ARCHS = ["llama", "deepseek_v3"]
# (b): relative error ||h_quant - h_dense|| / ||h_dense|| over all tokens, per captured layer id. Measured
# at most 0.44 (Llama) and 0.61 (DeepSeek-V3, whose top-2-of-4 routing flips for some tokens), largest at
# id L (after the final norm). It is large because the tiny targets are random N(0, 0.05) matrices with no
# outliers: int4 in groups of 32 moves every weight by up to scale / 2 (~9% of the weights' RMS, checked
# below) and 6 random layers compound that; real checkpoints lose far less. The same measure between the
# dense target and an unrelated one of the same shape (another seed) is asserted > 1.2 (measured ~1.4), so
# the bound still tells "the same model, quantized" from garbage (a wrong nibble order, scale layout or
# expert order).
REL_BOUND = {"llama": 0.55, "deepseek_v3": 0.8}


@pytest.fixture(scope="module")
def targets(tiny_target):
    """arch -> (dense original, W4A16 checkpoint, that checkpoint decompressed to a dense folder)."""
    return {
        a: (tiny_target(a), quantized_target(tiny_target(a)), quantized_target(tiny_target(a), "dequantized"))
        for a in ARCHS
    }


@pytest.fixture(scope="module")
def data_dir(smollm2_dir, tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return make_data_dir(
        tmp_path_factory.mktemp("data"), tok, smollm2_dir, n_train=4, n_heldout=2, seed=3, max_words=14
    )


def transformers_model(folder, quantized: bool):
    """The plain transformers load, not nestling's: dequantized at load (the packed model cannot run its
    decoder stack alone: it decompresses in a pre-hook of the CausalLM module's forward only)."""
    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if quantized else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


def test_checkpoints_are_really_packed(targets):
    from safetensors import safe_open

    for arch in ARCHS:
        _, w4, _ = targets[arch]
        with safe_open(next(w4.glob("*.safetensors")), "pt") as f:
            keys = set(f.keys())
            packed = [k for k in keys if k.endswith("weight_packed")]
            assert f.get_tensor(packed[0]).dtype == torch.int32
        assert "lm_head.weight" in keys and not any(k.startswith("lm_head.weight_") for k in keys)
        assert all(k[: -len("packed")] + "scale" in keys and k[: -len("packed")] + "shape" in keys for k in packed)
        if arch == "deepseek_v3":  # MLA projections and every routed expert, one by one
            assert {
                "model.layers.1.self_attn.kv_b_proj.weight_packed",
                "model.layers.1.mlp.experts.3.down_proj.weight_packed",
            } <= keys
            assert "model.layers.1.mlp.gate.weight" in keys  # the router stays dense
        assert quantized_load_kwargs(w4) and not quantized_load_kwargs(targets[arch][0])
        assert head_tensor_names(w4) == head_tensor_names(targets[arch][0])  # trainer reads the dense head


@pytest.mark.parametrize("arch", ARCHS)
def test_loaded_weights_are_the_checkpoint_dequantized(arch, targets):
    """Every quantized matrix loads as compressed-tensors' own decompression of it (exactly) and within
    int4 rounding (scale / 2 of its group, scale = group amax / 7.5) of the original; the rest is untouched."""
    dense, w4, deq = targets[arch]
    got = dict(load_model(w4, dtype="float32").named_parameters())
    orig = dict(transformers_model(dense, False).named_parameters())
    ref = dict(transformers_model(deq, False).named_parameters())
    assert set(orig) <= set(got)  # plus the kept weight_scale / weight_shape
    n_quant, rel = 0, []
    for name, w in orig.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], ref[name]), name
        if "proj" not in name:  # embeddings, norms, lm_head, the router
            assert torch.equal(got[name], w), name
            continue
        n_quant += 1
        g = w.unflatten(-1, (-1, GROUP))
        # the group max clamps from 7.5 to 7 steps: exactly scale / 2 off, plus fp32 rounding of amax (1e-5)
        half_step = (g.abs().amax(-1, keepdim=True) / 7.5 / 2 * (1 + 1e-5)).expand_as(g).flatten(-2)
        assert ((got[name] - w).abs() <= half_step).all(), name
        rel.append(((got[name] - w).norm() / w.norm()).item())
    assert n_quant >= (7 if arch == "llama" else 8) * 6 - 3 * (arch == "deepseek_v3")
    assert 0.05 < min(rel) and max(rel) < 0.12, rel  # really quantized, by ~9% of the weights' RMS


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_of_quantized_target(arch, targets, data_dir, tmp_path, tiny_target):
    """(a) the capture store (hf backend, padded batches) equals transformers' own `output_hidden_states`
    of the quantized checkpoint, one sample at a time, within 1e-5 x the token's RMS (fp32; the same
    bound as tests/test_capture_parity.py: batching changes GEMM shapes, nothing else), and equals the
    dense decompressed folder the same way; (b) it stays within REL_BOUND of the unquantized model."""
    dense, w4, deq = targets[arch]
    capture(
        data_dir,
        w4,
        tmp_path / "cap",
        CaptureSettings(dtype="float32", device="cpu", token_budget=60, progress_interval=60),
    )
    models = {
        k: transformers_model(f, k == "w4")
        for k, f in (("w4", w4), ("deq", deq), ("dense", dense), ("other", tiny_target(arch, seed=1)))
    }
    man = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    ids, H = man["layer_ids"], man["hidden_size"]
    diff, num, den, num_other = 0.0, torch.zeros(len(ids)), torch.zeros(len(ids)), torch.zeros(len(ids))
    for split in ("train", "heldout"):
        ds = CaptureDataset(tmp_path / "cap", split)
        for i in range(len(ds)):
            item = ds[i]
            T = len(item["input_ids"])
            got = torch.cat([item["aux"].view(T, -1, H), item["final"][:, None]], 1)
            ref, _ = reference(models["w4"], item["input_ids"], ids)
            close(got, ref, "float32")
            close(got, reference(models["deq"], item["input_ids"], ids)[0], "float32")
            diff = max(diff, (got - ref).abs().max().item())
            unq, _ = reference(models["dense"], item["input_ids"], ids)
            num += (got - unq).pow(2).sum((0, 2))
            den += unq.pow(2).sum((0, 2))
            num_other += (reference(models["other"], item["input_ids"], ids)[0] - unq).pow(2).sum((0, 2))
    rel, other = (num / den).sqrt(), (num_other / den).sqrt()
    print(
        f"{arch}: capture vs transformers max abs diff {diff:.3g}; relative error vs unquantized per id "
        f"{dict(zip(ids, [round(x, 3) for x in rel.tolist()]))}, another seed's {[round(x, 3) for x in other.tolist()]}"
    )
    assert (other > 1.2).all(), other
    assert (rel[1:] > 0.05).all()  # the quantization really changed the states (id 0 is the dense embedding)
    assert (rel < REL_BOUND[arch]).all(), rel


# ---- (c) every other stage that runs the target gets it through the same loader ----------------------


@pytest.fixture(scope="module")
def llama(targets):
    _, w4, deq = targets["llama"]
    return w4, deq, transformers_model(deq, False)


def test_online_features_run_the_quantized_target(llama, tmp_path):
    """train --online: the states the loop hands the draft are the dequantized target's."""
    from nestling.train import features
    from nestling.train.settings import TrainSettings

    w4, _, deq_model = llama
    data = make_data_dir(
        tmp_path / "data", AutoTokenizer.from_pretrained(w4), w4, n_train=2, n_heldout=1, seed=4, max_words=10
    )
    s = TrainSettings(online=True, target=str(w4), batch_tokens=64)
    inp = features.online_inputs(data, s)
    states = features.target_states(inp, s, torch.device("cpu"))
    seqs = [[5, 900, 31, 7, 1200], [44, 45]]
    got = states.backend.capture(seqs)
    states.close()
    ref = torch.cat([reference(deq_model, torch.tensor(q), inp.online.layer_ids)[0] for q in seqs])
    close(got, ref, "float32")


def test_reference_evaluator_runs_the_quantized_target(llama, tmp_path):
    """eval (reference decoder): greedy output is the dequantized target's own, draft or no draft."""
    from eagle_helpers import make_train_dir, new_draft
    from nestling.evaluate.run import run_reference
    from nestling.evaluate.settings import EvalSettings
    from nestling.evaluate.specdec import target_generate
    from nestling.export.run import export
    from nestling.export.settings import ExportSettings

    w4, _, deq_model = llama
    draft_dir = export(
        make_train_dir(new_draft(w4, [1, 3, 4], draft_vocab_size=64), tmp_path / "train"),
        tmp_path / "draft",
        ExportSettings(dtype="float32"),
    )
    prompts = [[5, 6, 7, 8], list(range(200, 212))]
    res = run_reference(w4, draft_dir, prompts, EvalSettings(k=2, max_new_tokens=6, baseline=False))
    assert res["outputs"] == [target_generate(deq_model, p, 6)[0] for p in prompts]


def test_hf_regeneration_runs_the_quantized_target(llama):
    """regenerate (hf engine, fast decode loop): greedy answers equal `generate` on the dequantized target."""
    from nestling.regenerate.settings import RegenerateSettings
    from nestling.regenerate.engine import Request
    from nestling.regenerate.hf_engine import HFEngine

    w4, _, deq_model = llama
    engine = HFEngine(w4, RegenerateSettings(engine="hf", hf_batch_size=2, max_new_tokens=5))
    assert engine.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    reqs = [Request([10, 20, 30], 5, 0), Request(list(range(300, 309)), 5, 0)]
    with torch.inference_mode():
        want = [
            deq_model.generate(
                torch.tensor([r.prompt_ids]),
                do_sample=False,
                max_new_tokens=5,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=engine.eos,
                pad_token_id=engine.eos[0],
            )[0, len(r.prompt_ids) :].tolist()
            for r in reqs
        ]
    assert [c.token_ids for c in engine.generate(reqs)] == want


def test_online_auto_counts_the_dequantized_weights(targets):
    """`online: auto` sizes the target as load_model holds it: dense, not as its packed files."""
    from nestling.targets.load import dense_parameter_count
    from nestling.train.features import target_weight_bytes

    for arch in ARCHS:
        dense, w4, _ = targets[arch]
        n = sum(v.numel() for v in transformers_model(dense, False).state_dict().values())  # + the router bias buffer
        assert dense_parameter_count(w4) == dense_parameter_count(dense) == n
        assert target_weight_bytes(w4, "float32") == 4 * n
        size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
        assert size(w4) < size(dense) - 3 * 4 * (n - 2 * 49152 * 128) // 4  # the projections are 8x smaller


def test_a_quantized_lm_head_is_refused_not_read_as_the_embedding(targets, tmp_path):
    """The trainer reads lm_head raw: packed (lm_head.weight absent) it must not fall back to the embedding."""
    import shutil

    from safetensors.torch import load_file, save_file

    from nestling.errors import NestlingError

    _, w4, _ = targets["llama"]
    bad = tmp_path / "bad"
    shutil.copytree(w4, bad)
    f = next(bad.glob("*.safetensors"))
    sd = load_file(str(f))
    sd["lm_head.weight_packed"] = sd.pop("lm_head.weight")[:, :16].to(torch.int32)  # the name is what counts
    save_file(sd, str(f))
    with pytest.raises(NestlingError, match="quantized lm_head or embedding .*lm_head.weight_packed"):
        head_tensor_names(bad)


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "W8A8"])
def test_w8a8_targets_capture_like_transformers(preset, tiny_target, data_dir, tmp_path):
    """W8A8 (FP8 or int8, per-channel weights, dynamic per-token activations) on the CPU: the weights are
    dequantized at load and compressed-tensors still quantizes each layer's input per token in the
    forward, as the serving engine does. The capture (two padded sequences in one batch) equals
    transformers' forward one sequence at a time within 1e-5 x RMS (measured max abs diff 1.4e-6) and
    stays within 0.2 of the unquantized states (measured up to 0.085 FP8, 0.025 int8: 8 bits lose far
    less than int4's 0.44)."""
    dense = tiny_target("llama")
    target = quantized_target(dense, preset)
    backend_ids = [2, 3, 6]
    from nestling.capture.hf import HFBackend

    backend = HFBackend(target, backend_ids, CaptureSettings(dtype="float32", device="cpu"))
    assert backend.model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    seqs = [[5, 900, 31, 7, 1200, 44, 9], [300, 301]]
    got = backend.capture(seqs)
    backend.close()
    q, d = transformers_model(target, True), transformers_model(dense, False)
    ref = torch.cat([reference(q, torch.tensor(s), backend_ids)[0] for s in seqs])
    unq = torch.cat([reference(d, torch.tensor(s), backend_ids)[0] for s in seqs])
    close(got, ref, "float32")
    rel = (got - unq).norm(dim=(0, 2)) / unq.norm(dim=(0, 2))
    print(
        f"{preset}: capture vs transformers max abs diff {(got - ref).abs().max().item():.3g}; relative error "
        f"vs unquantized per id {[round(x, 4) for x in rel.tolist()]}"
    )
    assert (rel[1:] > 1e-3).all() and (rel < 0.2).all(), rel
