"""How far nestling's vLLM engine configurations get with the installed vLLM, without a device.

    python benchmarks/vllm_configs.py --target DIR --draft DIR --out JSON [--build] [--modes auto,cpu,cpu_ray]

For a vLLM release that exists only as a CUDA build (0.33, 0.34), on a machine without a GPU: import it,
then build every engine configuration nestling builds, up to where a device is needed, and record per
case `ok` or the exception (type, message, the vLLM file:line it came from) and how far it got.

The cases run nestling's own code (not a copy of its keyword arguments): the capture backend
(`capture/vllm.py`, `_Engine`), eval's worker with an EAGLE-3 draft (`evaluate/vllm_worker.run`, and the
target alone as `eval_baseline`), regenerate (`regenerate/vllm_engine.VLLMEngine`) and the ngram baseline of
`benchmarks/vllm_speed.py`. Each reaches the real `vllm.LLM.__init__`, which builds its `EngineArgs`; the
one stub is `LLMEngine.from_engine_args` in `vllm.entrypoints.llm`, which hands the `EngineArgs` back here
instead of starting an engine. Then `EngineArgs.create_engine_config(UsageContext.LLM_CLASS)` runs as
`LLMEngine.from_engine_args` would run it, and `Executor.get_class` after it; the steps
`create_engine_config` entered (its direct callees, in order) are recorded, so a failure says how far it got.
No vLLM file is changed.

Besides the cases:
- imports: vLLM's extension modules and the modules nestling reads (ok / exception with file:line);
- the platform vLLM detects (`vllm.platforms.current_platform`);
- nestling's detection: `vllm_compat.hidden_cache_is_token_major()`, `cpu_mla_support()`,
  `has_v1_rejection_sampler()`, `evaluate.vllm_worker.eagle3_unsupported(target)`;
- the capture connector: `NestlingHiddenStatesConnector` a concrete subclass of `KVConnectorBase_V1`
  (`inspect.isabstract`), the base's abstract methods, and the hooks whose parameters differ from the base's;
- the draft's config as vLLM reads it (`vllm.transformers_utils.config.get_config`, the path ModelConfig
  takes), and what `llama_eagle3` derives from it (aux-state count, fc input size, draft vocabulary, norms)
  against the exported weights' shapes; where case `eval` built its SpeculativeConfig, the aux layer ids
  vLLM's EAGLE-3 runner takes from it (`get_eagle3_aux_layers_from_config`).

Modes (one child process each, since vLLM fixes its platform once per process): `auto` (vLLM's own
detection; on a machine without a GPU the CUDA build finds no platform) and `cpu` (`VLLM_TARGET_DEVICE=cpu`,
the switch vLLM documents for CPU-only jobs that reuse an accelerator wheel: it selects vLLM's CpuPlatform,
whose config checks then apply instead of CUDA's; a result there is not what a GPU would give), and
`cpu_ray` (`cpu` plus `CUDA_VISIBLE_DEVICES=""`: vLLM's Triton check, `vllm/triton_utils/importing.py`, keeps
Triton on with no active driver where that variable is empty, its rule for Ray actors; without it the CPU
platform of 0.34's CUDA wheel stops at "vLLM on x86 CPUs requires Triton (triton-cpu)". It lets the rest of
`VllmConfig.__post_init__` run -- KV-transfer, hybrid-KV-cache and aux-output checks -- on the CPU platform;
0.33's CPU platform has no such check, and there `cpu` already gets as far).

Run with one venv per release (the release's torch pin, its wheel, nestling installed -e); results go to
benchmarks/results/vllm_configs_<release>.json.

`--build` writes what is missing: the target (nestling's tiny random Llama, SmolLM2 tokenizer) and the
draft (a random nestling draft through `nestling export`, the layout vLLM loads). Needs torch,
transformers and nestling importable in this interpreter; vLLM only in the children. A few seconds per
mode plus vLLM's import.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(BENCH))

AUX = [1, 3, 4]  # the draft's aux layers (HF hidden_states ids) on the 6-layer tiny Llama
K = 3


# ---- what an exception says -----------------------------------------------------------------------


def _site(path: str) -> str | None:
    """`vllm/...py` for a file inside the vllm package, else None."""
    parts = Path(path).parts
    if "vllm" in parts:
        i = len(parts) - 1 - parts[::-1].index("vllm")
        return "/".join(parts[i:])
    return None


def _short(path: str) -> str:
    site = _site(path)
    if site:
        return site
    parts = Path(path).parts
    for root in ("nestling", "benchmarks"):
        if root in parts:
            return "/".join(parts[parts.index(root) :])
    return path


def describe(e: BaseException) -> dict:
    """Type, message, the innermost vLLM frame (file:line, function), the innermost frame of all, and the
    chain of frames (vLLM and nestling ones) that led there; the cause too, when one is chained."""
    tb = traceback.extract_tb(e.__traceback__)
    frames = [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in tb]
    vllm_frames = [f for f in tb if _site(f.filename)]
    out = {
        "type": f"{type(e).__module__}.{type(e).__qualname__}",
        "message": str(e)[:2000],
        "vllm_site": f"{_site(vllm_frames[-1].filename)}:{vllm_frames[-1].lineno} ({vllm_frames[-1].name})"
        if vllm_frames
        else None,
        "vllm_source_line": vllm_frames[-1].line if vllm_frames else None,
        "raised_at": frames[-1] if frames else None,
        "frames": [f for f in frames if f.startswith(("vllm/", "nestling/", "benchmarks/"))][-25:],
    }
    cause = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    if cause is not None and cause is not e:
        out["cause"] = describe(cause)
    return out


def attempt(fn, *args, **kwargs) -> dict:
    try:
        return {"ok": True, "value": fn(*args, **kwargs)}
    except BaseException as e:  # noqa: BLE001 -- the point is to record it
        if isinstance(e, KeyboardInterrupt):
            raise
        return {"ok": False, "error": describe(e)}


def jsonable(x, depth: int = 0):
    if depth > 6:
        return repr(x)[:200]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [jsonable(v, depth + 1) for v in x]
    return repr(x)[:300]


# ---- the child: one mode ----------------------------------------------------------------------------

IMPORTS = [
    "vllm",
    "vllm._C",  # the name up to 0.32; 0.33 and 0.34 ship _C_stable_libtorch
    "vllm._C_stable_libtorch",
    "vllm._moe_C_stable_libtorch",
    "vllm.engine.arg_utils",
    "vllm.entrypoints.llm",
    "vllm.config.kv_transfer",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.model_executor.models.llama_eagle3",
    "vllm.model_executor.models.extract_hidden_states",
    "vllm.model_executor.layers.attention.mla_attention",
    "vllm.v1.attention.backends.registry",
    "vllm.v1.sample.rejection_sampler",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
    "vllm.v1.worker.cpu_model_runner",
    "nestling.capture.vllm_connector",
]


class Captured(Exception):
    """Raised by the stubbed `LLMEngine.from_engine_args`: carries the EngineArgs `vllm.LLM` built."""

    def __init__(self, engine_args, usage_context):
        super().__init__("engine args captured")
        self.engine_args = engine_args
        self.usage_context = usage_context


def install_stubs(record: dict) -> None:
    """Record the keyword arguments nestling passes to `vllm.LLM`, and stop `LLM.__init__` where it would
    start the engine: `LLMEngine.from_engine_args` (looked up in `vllm.entrypoints.llm`) hands back the
    EngineArgs instead."""
    import vllm
    import vllm.entrypoints.llm as llm_mod

    real_llm = llm_mod.LLM

    class RecordingLLM(real_llm):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs):
            record["llm_args"] = list(args)
            record["llm_kwargs"] = kwargs
            super().__init__(*args, **kwargs)

    class StubEngine:
        @classmethod
        def from_engine_args(cls, engine_args, usage_context=None, **kw):
            raise Captured(engine_args, usage_context)

    vllm.LLM = RecordingLLM  # `from vllm import LLM` in nestling's code finds this
    llm_mod.LLMEngine = StubEngine


def traced_create(engine_args, usage_context) -> tuple[dict, object]:
    """`create_engine_config` with its direct callees recorded in order (how far it got)."""
    fn = type(engine_args).create_engine_config
    code = fn.__code__
    steps: list[str] = []

    def prof(frame, event, arg):
        if event != "call" or frame.f_back is None or frame.f_back.f_code is not code:
            return
        c = frame.f_code
        name = c.co_qualname if hasattr(c, "co_qualname") else c.co_name
        obj = frame.f_locals.get(c.co_varnames[0]) if c.co_name == "__init__" and c.co_varnames else None
        if obj is not None and type(obj).__module__.startswith("vllm."):
            # a vLLM config built, whether by its own __init__ or pydantic's dataclass wrapper
            steps.append(f"arg_utils.py:{frame.f_back.f_lineno} {type(obj).__name__}(...)")
        elif _site(c.co_filename) and not name.startswith("<"):
            # vLLM's own steps only (not typing.cast, copy.deepcopy)
            steps.append(f"arg_utils.py:{frame.f_back.f_lineno} {name} ({_site(c.co_filename)})")

    sys.setprofile(prof)
    try:
        t0 = time.perf_counter()
        res = attempt(engine_args.create_engine_config, usage_context)
    finally:
        sys.setprofile(None)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    # successive duplicates (a property read twice) are one step
    dedup = [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s]
    res["steps_entered"] = dedup
    config = res.pop("value", None)
    return res, config


def summarize_config(cfg) -> dict:
    """What the built VllmConfig holds that nestling relies on."""

    def g(obj, *names):
        for n in names:
            if obj is None:
                return None
            obj = getattr(obj, n, None)
        return obj

    spec = cfg.speculative_config
    kvt = cfg.kv_transfer_config
    out = {
        "device": str(g(cfg, "device_config", "device")),
        "model_dtype": str(g(cfg, "model_config", "dtype")),
        "max_model_len": g(cfg, "model_config", "max_model_len"),
        "architectures": g(cfg, "model_config", "architectures"),
        "enforce_eager": g(cfg, "model_config", "enforce_eager"),
        "enable_prefix_caching": g(cfg, "cache_config", "enable_prefix_caching"),
        "block_size": g(cfg, "cache_config", "block_size"),
        "enable_chunked_prefill": g(cfg, "scheduler_config", "enable_chunked_prefill"),
        "max_num_batched_tokens": g(cfg, "scheduler_config", "max_num_batched_tokens"),
        "max_num_seqs": g(cfg, "scheduler_config", "max_num_seqs"),
        "stream_interval": g(cfg, "scheduler_config", "stream_interval"),
        "compilation_mode": str(g(cfg, "compilation_config", "mode")),
        "cudagraph_mode": str(g(cfg, "compilation_config", "cudagraph_mode")),
        "attention_backend": str(g(cfg, "attention_config", "backend")),
        "disable_hybrid_kv_cache_manager": g(cfg, "scheduler_config", "disable_hybrid_kv_cache_manager"),
    }
    # which model runner the engine would take (0.33: V1 or V2; a property that reads the platform and Triton)
    if hasattr(type(cfg), "use_v2_model_runner"):
        r = attempt(lambda: cfg.use_v2_model_runner)
        out["use_v2_model_runner"] = r["value"] if r["ok"] else r
    else:
        out["use_v2_model_runner"] = "no such property: this release has one GPU runner (v1/worker/gpu/)"
    get_unsupported = getattr(cfg, "_get_v2_model_runner_unsupported_features", None)
    if get_unsupported is not None:
        r = attempt(get_unsupported)
        out["v2_model_runner_unsupported"] = r["value"] if r["ok"] else r
    if spec is not None:
        out["speculative"] = {
            "method": g(spec, "method"),
            "num_speculative_tokens": g(spec, "num_speculative_tokens"),
            "model": g(spec, "model"),
            "draft_architectures": g(spec, "draft_model_config", "architectures"),
            "draft_hf_eagle_aux_hidden_state_layer_ids": jsonable(
                g(spec, "draft_model_config", "hf_config", "eagle_aux_hidden_state_layer_ids")
            ),
            "prompt_lookup_max": g(spec, "prompt_lookup_max"),
            "prompt_lookup_min": g(spec, "prompt_lookup_min"),
        }
    if kvt is not None:
        out["kv_transfer"] = {
            "kv_connector": g(kvt, "kv_connector"),
            "kv_connector_module_path": g(kvt, "kv_connector_module_path"),
            "kv_role": g(kvt, "kv_role"),
            "extra_config_keys": sorted((g(kvt, "kv_connector_extra_config") or {}).keys()),
        }
    return jsonable(out)


def run_case(name: str, call) -> tuple[dict, object]:
    """Run nestling's code for one case up to `vllm.LLM`, then build the config from its EngineArgs."""
    record: dict = {}
    install_stubs(record)
    case: dict = {"case": name}
    t0 = time.perf_counter()
    try:
        ret = call()
        case["reached_llm"] = "llm_kwargs" in record
        case["stage"] = "nestling returned without starting an engine"
        case["returned"] = jsonable(ret)
        case["ok"] = False
        return case, None
    except Captured as c:
        engine_args, usage = c.engine_args, c.usage_context
    except BaseException as e:  # noqa: BLE001
        case["llm_kwargs"] = jsonable(record.get("llm_kwargs"))
        case["ok"] = False
        case["stage"] = (
            "vllm.LLM.__init__ (before EngineArgs)" if "llm_kwargs" in record else "nestling, before vllm.LLM"
        )
        case["error"] = describe(e)
        return case, None
    case["llm_kwargs"] = jsonable(record.get("llm_kwargs"))
    case["engine_args_built_s"] = round(time.perf_counter() - t0, 2)
    res, config = traced_create(engine_args, usage)
    case["create_engine_config"] = res
    if config is None:
        case["ok"] = False
        case["stage"] = "EngineArgs.create_engine_config"
        case["error"] = res.get("error")
        return case, None
    case["config"] = summarize_config(config)
    from vllm.v1.executor import Executor

    ex = attempt(Executor.get_class, config)
    case["executor"] = {"ok": True, "class": jsonable(ex["value"])} if ex["ok"] else ex
    case["ok"] = True
    case["stage"] = "config built" + ("; Executor.get_class ok" if ex["ok"] else "; Executor.get_class failed")
    return case, config


def connector_check() -> dict:
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from nestling.capture.vllm_connector import NestlingHiddenStatesConnector as C

    out: dict = {
        "subclass": issubclass(C, KVConnectorBase_V1),
        "isabstract": inspect.isabstract(C),
        "abstract_left": sorted(getattr(C, "__abstractmethods__", ())),
        "base_abstract": sorted(getattr(KVConnectorBase_V1, "__abstractmethods__", ())),
        "base_init": str(inspect.signature(KVConnectorBase_V1.__init__)),
    }
    differ = {}
    for name, member in vars(C).items():
        base = getattr(KVConnectorBase_V1, name, None)
        if name.startswith("__") or not callable(member) or base is None or not callable(base):
            continue
        try:
            a, b = inspect.signature(member), inspect.signature(base)
        except (TypeError, ValueError):
            continue
        pa = [(p.name, p.kind) for p in a.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        pb = [(p.name, p.kind) for p in b.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if pa != pb:
            differ[name] = {"nestling": str(a), "vllm": str(b)}
    out["signatures_differ"] = differ
    # the base's hooks nestling does not override (default behaviour applies)
    out["base_hooks_not_overridden"] = sorted(
        n for n, m in vars(KVConnectorBase_V1).items() if callable(m) and not n.startswith("_") and n not in vars(C)
    )
    # what the connector reads from vLLM besides the base's hooks (vllm_connector.py)
    names: dict = {}
    try:
        import dataclasses

        from vllm.v1.core.sched import output as so

        fields = {f.name for f in dataclasses.fields(so.NewRequestData)}
        names["NewRequestData_fields_missing"] = sorted(
            {"req_id", "prompt_token_ids", "sampling_params", "block_ids", "num_computed_tokens"} - fields
        )
        sfields = {f.name for f in dataclasses.fields(so.SchedulerOutput)}
        names["SchedulerOutput_fields_missing"] = sorted({"scheduled_new_reqs", "num_scheduled_tokens"} - sfields)
    except BaseException as e:  # noqa: BLE001
        names["scheduler_output"] = {"ok": False, "error": describe(e)}
    try:
        import vllm.v1.kv_cache_interface as kci

        names["HiddenStateCacheSpec"] = hasattr(kci, "HiddenStateCacheSpec")
        names["UniformTypeKVCacheSpecs"] = hasattr(kci, "UniformTypeKVCacheSpecs")
    except BaseException as e:  # noqa: BLE001
        names["kv_cache_interface"] = {"ok": False, "error": describe(e)}
    try:
        import vllm.distributed.parallel_state as ps

        names["get_tensor_model_parallel_rank"] = hasattr(ps, "get_tensor_model_parallel_rank")
    except BaseException as e:  # noqa: BLE001
        names["parallel_state"] = {"ok": False, "error": describe(e)}
    src = inspect.getsource(KVConnectorBase_V1.__init__)
    names["base_sets_kv_transfer_config"] = "self._kv_transfer_config" in src
    names["base_sets_kv_cache_config"] = "self._kv_cache_config" in src
    names["base_has_get_connector_metadata"] = hasattr(KVConnectorBase_V1, "_get_connector_metadata")
    out["names_read"] = names
    # how vLLM resolves the connector by module path
    try:
        from vllm.config.kv_transfer import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        kvt = KVTransferConfig(
            kv_connector="NestlingHiddenStatesConnector",
            kv_connector_module_path="nestling.capture.vllm_connector",
            kv_role="kv_producer",
        )
        get = getattr(KVConnectorFactory, "get_connector_class", None) or getattr(
            KVConnectorFactory, "_get_connector_class", None
        )
        if get is not None:
            r = attempt(get, kvt)
            out["factory_resolves"] = {"ok": True, "class": jsonable(r["value"])} if r["ok"] else r
        hma = getattr(KVConnectorFactory, "supports_hma_config", None)
        if hma is not None:  # False: VllmConfig turns the hybrid KV cache manager off for this connector
            r = attempt(hma, kvt)
            out["supports_hma_config"] = r["value"] if r["ok"] else r
        else:
            out["factory_resolves"] = "no get_connector_class in KVConnectorFactory"
    except BaseException as e:  # noqa: BLE001
        out["factory_resolves"] = {"ok": False, "error": describe(e)}
    return out


def api_check() -> dict:
    """The vLLM names nestling calls once an engine runs (capture/vllm.py, evaluate/vllm_worker.py,
    regenerate/vllm_engine.py): present, and taking the parameters nestling passes."""
    import importlib
    import inspect

    def params(obj) -> list[str]:
        return list(inspect.signature(obj).parameters)

    checks = {
        "LLMEngine.add_request(request_id, prompt, params)": lambda: (
            {"request_id", "prompt", "params"}
            <= set(params(importlib.import_module("vllm.v1.engine.llm_engine").LLMEngine.add_request))
        ),
        "LLMEngine.step / has_unfinished_requests": lambda: all(
            hasattr(importlib.import_module("vllm.v1.engine.llm_engine").LLMEngine, n)
            for n in ("step", "has_unfinished_requests")
        ),
        "LLMEngine sets self.engine_core (close: engine_core.shutdown)": lambda: (
            "self.engine_core"
            in inspect.getsource(importlib.import_module("vllm.v1.engine.llm_engine").LLMEngine.__init__)
        ),
        "LLM.generate(prompts, sampling_params, use_tqdm)": lambda: (
            {"prompts", "sampling_params", "use_tqdm"} <= set(params(importlib.import_module("vllm").LLM.generate))
        ),
        "LLM.get_metrics": lambda: hasattr(importlib.import_module("vllm").LLM, "get_metrics"),
        "SamplingParams fields (max_tokens, temperature, seed, detokenize, extra_args, ignore_eos, top_p, top_k)": (
            lambda: (
                sorted(
                    {"max_tokens", "temperature", "seed", "detokenize", "extra_args", "ignore_eos", "top_p", "top_k"}
                    - set(getattr(importlib.import_module("vllm").SamplingParams, "__struct_fields__", ()))
                )
                or True
            )  # the missing ones, else True
        ),
        "SamplingParams.clone": lambda: hasattr(importlib.import_module("vllm").SamplingParams, "clone"),
        "RequestOutputKind.DELTA": lambda: hasattr(
            importlib.import_module("vllm.sampling_params").RequestOutputKind, "DELTA"
        ),
        "vllm.inputs.TokensPrompt": lambda: hasattr(importlib.import_module("vllm.inputs"), "TokensPrompt"),
        "ModelRegistry._try_load_model_cls": lambda: hasattr(
            importlib.import_module("vllm.model_executor.models").ModelRegistry, "_try_load_model_cls"
        ),
        "interfaces.supports_eagle3": lambda: hasattr(
            importlib.import_module("vllm.model_executor.models.interfaces"), "supports_eagle3"
        ),
        "plugins.load_general_plugins": lambda: hasattr(
            importlib.import_module("vllm.plugins"), "load_general_plugins"
        ),
        "SchedulerConfig.stream_interval": lambda: (
            "stream_interval"
            in {
                f.name for f in __import__("dataclasses").fields(importlib.import_module("vllm.config").SchedulerConfig)
            }
        ),
    }
    out = {}
    for name, fn in checks.items():
        r = attempt(fn)
        out[name] = r["value"] if r["ok"] else r
    return out


def draft_config_check(draft: Path, target: Path, spec_config) -> dict:
    """The draft's config.json through vLLM's config path, and what llama_eagle3 derives from it."""
    from safetensors import safe_open
    from vllm.transformers_utils.config import get_config

    raw = json.loads((draft / "config.json").read_text())
    out: dict = {"config_keys": sorted(raw)}
    r = attempt(get_config, str(draft), trust_remote_code=False)
    if not r["ok"]:
        out["get_config"] = r
        return out
    hf = r["value"]
    out["get_config"] = {"ok": True, "class": type(hf).__name__, "architectures": getattr(hf, "architectures", None)}
    eagle = getattr(hf, "eagle_config", None) or {}
    # llama_eagle3.py (vLLM 0.33 / 0.34): Eagle3LlamaModel.__init__ and Eagle3LlamaForCausalLM.__init__
    n_aux = getattr(hf, "num_aux_hidden_states", None)
    if n_aux is None:
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        n_aux = len(ids) if ids else 3
    target_hidden = getattr(hf, "target_hidden_size", hf.hidden_size)
    draft_vocab = getattr(hf, "draft_vocab_size", None) or hf.vocab_size
    derived = {
        "use_aux_hidden_state": eagle.get("use_aux_hidden_state", True) if isinstance(eagle, dict) else True,
        "num_aux_hidden_states": n_aux,
        "target_hidden_size": target_hidden,
        "fc_input_size": target_hidden * n_aux,
        "draft_vocab_size": draft_vocab,
        "num_hidden_layers": hf.num_hidden_layers,
        "norm_before_fc": bool(eagle.get("norm_before_fc", getattr(hf, "norm_before_fc", False)))
        if isinstance(eagle, dict)
        else bool(getattr(hf, "norm_before_fc", False)),
        "fc_norm": bool(getattr(hf, "fc_norm", False)),
        "norm_output": bool(getattr(hf, "norm_output", False)),
        "norm_before_residual": bool(getattr(hf, "norm_before_residual", False)),
        "top_level_eagle_aux_hidden_state_layer_ids": jsonable(getattr(hf, "eagle_aux_hidden_state_layer_ids", None)),
        "eagle_config": jsonable(eagle),
    }
    out["llama_eagle3_reads"] = derived
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    fc = shapes.get("fc.weight")
    lm = shapes.get("lm_head.weight")
    out["weights"] = {"fc.weight": fc, "lm_head.weight": lm, "d2t": shapes.get("d2t"), "n_tensors": len(shapes)}
    out["fc_matches"] = fc == [hf.hidden_size, derived["fc_input_size"]] if fc else None
    out["lm_head_matches"] = lm == [draft_vocab, hf.hidden_size] if lm else None
    out["nestling_aux_ids"] = raw.get("nestling", {}).get("aux_layer_ids")
    if spec_config is not None:
        try:
            from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

            out["runner_aux_layer_ids"] = jsonable(get_eagle3_aux_layers_from_config(spec_config))
        except BaseException as e:  # noqa: BLE001
            out["runner_aux_layer_ids"] = {"ok": False, "error": describe(e)}
        out["runner_ids_equal_nestling_vllm_ids"] = out.get("runner_aux_layer_ids") == raw.get(
            "eagle_aux_hidden_state_layer_ids"
        )
    return out


def child(mode: str, target: Path, draft: Path) -> dict:
    import importlib
    import importlib.metadata as md
    import platform

    res: dict = {
        "mode": mode,
        "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE"),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    env = {"python": platform.python_version()}
    for dist in (
        "torch",
        "vllm",
        "transformers",
        "torchvision",
        "torchaudio",
        "flashinfer-python",
        "compressed-tensors",
    ):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = None
    import torch

    env["torch_cuda"] = torch.version.cuda
    env["torch_cuda_available"] = torch.cuda.is_available()
    res["environment"] = env

    imports = {}
    for mod in IMPORTS:
        t0 = time.perf_counter()
        r = attempt(importlib.import_module, mod)
        r.pop("value", None)
        r["seconds"] = round(time.perf_counter() - t0, 2)
        if not r["ok"] and r["error"]["type"] == "builtins.ModuleNotFoundError":
            r["missing"] = True
        imports[mod] = r
    res["imports"] = imports
    if not imports["vllm"]["ok"]:
        return res

    def plat():
        from vllm.platforms import current_platform as p

        return {
            "class": f"{type(p).__module__}.{type(p).__qualname__}",
            "device_type": getattr(p, "device_type", None),
            "device_name": getattr(p, "device_name", None),
            "is_cpu": p.is_cpu(),
            "is_cuda": p.is_cuda(),
            "HAS_TRITON": getattr(importlib.import_module("vllm.triton_utils"), "HAS_TRITON", None),
        }

    res["platform"] = attempt(plat)

    from nestling import vllm_compat as C

    det = {}
    for name in ("hidden_cache_is_token_major", "cpu_mla_support", "has_v1_rejection_sampler"):
        det[name] = attempt(getattr(C, name))
        if det[name]["ok"]:
            det[name]["value"] = jsonable(det[name]["value"])
    det["require"] = attempt(C.require)

    def e3u():
        from nestling.evaluate.vllm_worker import eagle3_unsupported

        return eagle3_unsupported(str(target))

    det["eagle3_unsupported(target)"] = attempt(e3u)
    res["detection"] = det
    res["connector"] = attempt(connector_check)
    res["api"] = attempt(api_check)

    # ---- the cases ----
    from nestling.capture.settings import CaptureSettings
    from nestling.capture.vllm import VLLMBackend
    from nestling.regenerate.settings import RegenerateSettings
    from nestling.regenerate.vllm_engine import VLLMEngine
    from nestling.targets.vllm_rules import engine_options

    cases = []
    configs = {}

    def capture():
        # the GPU path (these releases are CUDA builds): device cuda, bfloat16; layer ids as nestling's default
        from nestling.targets.layers import default_aux_layers

        n = json.loads((target / "config.json").read_text())["num_hidden_layers"]
        ids = sorted(set(default_aux_layers(n)) | {n})
        return VLLMBackend(target, ids, CaptureSettings(device="cuda", dtype="bfloat16"))

    def eval_spec(baseline: bool) -> dict:
        # eval's settings as `choose` resolves them on a GPU machine with vLLM (dtype auto: bfloat16), and
        # the spec as run_vllm (evaluate/vllm_engine.py) writes it for vllm_worker.run
        from nestling.evaluate.settings import EvalSettings, choose

        s, _ = choose(EvalSettings(), vllm=True, cuda=True)
        return dict(
            target=str(target),
            drafts=[] if baseline else [str(draft)],
            k=s.k,
            prompts=[[1, 2, 3]],
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            dtype=s.dtype,
            max_model_len=s.max_model_len,
            seed=s.seed,
            baseline=baseline,
            draft_sample_method=s.draft_sample_method,
            engine_options=engine_options(target, s.dtype),
        )

    def eval_draft():
        from nestling.evaluate.vllm_worker import run

        return run(eval_spec(False))

    def eval_baseline():
        from nestling.evaluate.vllm_worker import run

        return run({**eval_spec(True), "drafts": None, "draft": None})

    def regenerate():
        return VLLMEngine(target, RegenerateSettings(), 2048)

    def ngram():
        import vllm_speed

        return vllm_speed.one_case(
            dict(method="ngram", concurrency=1, target=str(target), k=K, max_model_len=2048, prompts=[[1, 2, 3]])
        )

    for name, fn in (
        ("capture", capture),
        ("eval_eagle3", eval_draft),
        ("eval_baseline", eval_baseline),
        ("regenerate", regenerate),
        ("ngram", ngram),
    ):
        case, config = run_case(name, fn)
        cases.append(case)
        configs[name] = config
    res["cases"] = cases
    eagle = configs.get("eval_eagle3")
    res["draft_config"] = attempt(
        draft_config_check, draft, target, eagle.speculative_config if eagle is not None else None
    )
    return res


# ---- the parent -------------------------------------------------------------------------------------


def build_inputs(target: Path, draft: Path) -> None:
    """The tiny random Llama (nestling's, SmolLM2 tokenizer) and a random nestling draft exported for it."""
    from nestling.targets.tiny import build_tiny_target

    if not (target / "config.json").exists():
        tok = Path.home() / ".cache/nestling/models/SmolLM2-135M-Instruct"
        build_tiny_target("llama", target, tokenizer_dir=tok if tok.exists() else None)
    if (draft / "config.json").exists():
        return
    import tempfile

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from nestling.draft.model import DraftConfig, Eagle3Draft
    from nestling.draft.vocab import build_vocab, count_tokens, save_vocab
    from nestling.export.run import export
    from nestling.export.settings import ExportSettings
    from nestling.manifest import write_manifest
    from nestling.targets.load import target_fingerprint

    hf = AutoConfig.from_pretrained(target)
    cfg = DraftConfig.from_target(
        hf, min(1024, hf.vocab_size), AUX, target=str(target), target_fingerprint=target_fingerprint(target)
    )
    torch.manual_seed(0)
    d = Eagle3Draft(cfg)
    d2t, t2d = build_vocab(count_tokens([torch.arange(cfg.vocab_size)], cfg.vocab_size), cfg.draft_vocab_size)
    d.d2t.copy_(d2t)
    d.t2d.copy_(t2d)
    with tempfile.TemporaryDirectory(prefix="nestling-vllm-configs-") as tmp:
        train = Path(tmp) / "train"
        train.mkdir()
        cfg.save(train / "draft_config.json")
        save_vocab(train / "vocab.safetensors", d.d2t, d.t2d)
        save_file({k: v.contiguous() for k, v in d.export_state_dict().items()}, str(train / "model.safetensors"))
        write_manifest(
            train,
            "train",
            {"helper": "benchmarks/vllm_configs.py"},
            inputs={"target": cfg.target_fingerprint},
            target=str(target),
        )
        export(train, draft, ExportSettings(dtype="bfloat16"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="target folder (HF layout)")
    ap.add_argument("--draft", type=Path, required=True, help="draft folder written by `nestling export`")
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    ap.add_argument("--build", action="store_true", help="build the tiny target and a random draft where missing")
    ap.add_argument(
        "--modes",
        default="auto,cpu,cpu_ray",
        help="auto (vLLM's own platform detection), cpu (VLLM_TARGET_DEVICE=cpu), cpu_ray (cpu + CUDA_VISIBLE_DEVICES='')",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mode")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    target, draft = args.target.resolve(), args.draft.resolve()
    if args.child:
        res = child(args.child, target, draft)
        args.out.write_text(json.dumps(res, indent=1, default=repr))
        return
    if args.build:
        build_inputs(target, draft)
    results = {
        "target": str(target),
        "draft": str(draft),
        "draft_config_json": json.loads((draft / "config.json").read_text()),
        "modes": {},
    }
    for mode in args.modes.split(","):
        env = dict(os.environ)
        env.pop("VLLM_TARGET_DEVICE", None)
        if mode in ("cpu", "cpu_ray"):
            env["VLLM_TARGET_DEVICE"] = "cpu"
        if mode == "cpu_ray":
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        part = args.out.with_suffix(f".{mode}.part.json")
        cmd = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--out",
            str(part),
        ]
        t0 = time.time()
        print(f"[vllm_configs] mode {mode} ...", flush=True)
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-6000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e.stdout or "")[-3000:] + str(e.stderr or "")[-3000:]
        entry = json.loads(part.read_text()) if part.exists() else {}
        part.unlink(missing_ok=True)
        entry["child_rc"] = rc
        entry["wall_s"] = round(time.time() - t0, 1)
        entry["child_output_tail"] = tail
        results["modes"][mode] = entry
        for c in entry.get("cases", []):
            where = c.get("error", {}).get("vllm_site") if c.get("error") else ""
            print(f"  {c['case']:14} {'ok' if c['ok'] else 'FAIL'}  {c['stage']}  {where or ''}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=repr) + "\n")
    print(f"[vllm_configs] wrote {args.out}")


if __name__ == "__main__":
    main()
