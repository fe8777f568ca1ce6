"""`nestling plan`'s vLLM line: whether the vLLM installed here can serve an EAGLE-3 draft beside the
target, asked of the real vLLM (its model registry; the CPU build's MLA limits in targets/vllm_rules.py),
and what plan says where vLLM cannot be imported or the user asked for no check. Gemma-3 is served
through nestling's vLLM plugin (export/vllm_plugin.py); with the plugin off (VLLM_PLUGINS=) it is the
case of a class vLLM cannot serve a draft beside.

Plan runs in a process of its own here (vLLM keeps global state); the targets are config.json-only
folders of the tiny test targets' configs (targets/tiny.py): plan reads nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nestling.targets.tiny import ARCH_CONFIGS, VOCAB
from test_plan import W4A16

# Runs `nestling plan` (table, then --json) on each target after PRELUDE; writes what it printed and the
# vllm modules it imported to the file named last (vLLM logs to stdout, so not there).
SCRIPT = """
import contextlib, io, json, sys
{prelude}
from nestling.cli import main
*targets, flags, result = sys.argv[1:]
out = {{}}
for t in targets:
    for fmt in ([], ["--json"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["plan", t, "--tokens", "1000", *json.loads(flags), *fmt]) == 0
        out[t + "".join(fmt)] = buf.getvalue()
out["vllm_modules"] = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] == "vllm" and mod is not None)
{registry}
open(result, "w").write(json.dumps(out))
"""
REGISTRY = """
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_eagle3
import vllm
out["version"] = vllm.__version__
out["gemma3_supports_eagle3"] = supports_eagle3(ModelRegistry._try_load_model_cls("Gemma3ForCausalLM"))
"""


def config_only(tmp_path: Path, arch: str, **extra) -> str:
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**ARCH_CONFIGS[arch], "vocab_size": VOCAB, **extra}))
    return str(d)


def run_plan(
    tmp_path: Path, targets: list[str], flags=(), prelude: str = "", registry: str = "", env: dict | None = None
) -> dict:
    result = tmp_path / "result.json"
    code = SCRIPT.format(prelude=prelude, registry=registry)
    cmd = [sys.executable, "-c", code, *targets, json.dumps(list(flags)), str(result)]
    subprocess.run(cmd, check=True, timeout=600, env={**os.environ, **(env or {})})
    return json.loads(result.read_text())


def vllm_line(table: str) -> str:
    lines = [line for line in table.splitlines() if line.startswith("vLLM ")]
    assert len(lines) == 1 and table.rstrip().endswith(lines[0]), table
    return lines[0]


@pytest.mark.vllm
def test_plan_says_which_targets_the_installed_vllm_serves_an_eagle3_draft_beside(tmp_path):
    import torch

    gemma3, llama = config_only(tmp_path, "gemma3"), config_only(tmp_path, "llama")
    mla = config_only(tmp_path, "deepseek_v3")
    int4_moe = config_only(tmp_path, "qwen3_moe", quantization_config=W4A16)  # Kimi-K2.5's INT4 experts
    no_plugin = {"VLLM_PLUGINS": ""}  # vLLM's own classes
    out = run_plan(tmp_path, [gemma3, llama, mla, int4_moe], registry=REGISTRY, env=no_plugin)
    if out["gemma3_supports_eagle3"]:
        pytest.skip("this vLLM serves EAGLE-3 beside Gemma-3: no case for plan to report")
    version, on_cpu = out["version"], not torch.cuda.is_available()
    head = f"vLLM        {version} installed here"

    # Gemma-3: vLLM's registry says its class lacks SupportsEagle3; eval falls back to the reference decoder
    why = (
        f"vLLM {version}'s Gemma3ForCausalLM does not implement SupportsEagle3: it cannot serve an EAGLE-3 draft "
        "(nestling's vLLM plugin adds the interface, but vLLM did not load it here: VLLM_PLUGINS leaves out "
        "`nestling`, or nestling is not installed as a package: pip install -e .)"
    )
    dtype = "float32" if on_cpu else "bfloat16"  # what eval's dtype auto picks here
    fallback = f"eval falls back to nestling's reference decoder ({dtype}; docs/eval.md)"
    assert vllm_line(out[gemma3]) == f"{head} cannot serve an EAGLE-3 draft beside this target: {why}; {fallback}"
    js = json.loads(out[gemma3 + "--json"])["vllm"]
    assert js == {
        "installed": True,
        "version": version,
        "checked": True,
        "dtype": dtype,
        "serves_eagle3": False,
        "why": why,
        "eval": fallback,
    }

    # a Llama (SmolLM2's architecture) is served
    serves = f"{head} serves an EAGLE-3 draft beside this target: eval measures in vLLM (engine auto)"
    assert vllm_line(out[llama]) == serves
    js = json.loads(out[llama + "--json"])["vllm"]
    assert js["serves_eagle3"] is True and js["why"] is None and js["eval"] == "eval measures in vLLM (engine auto)"

    # Gemma-3 with nestling's plugin on, as vLLM loads it by default: served
    on = run_plan(tmp_path, [gemma3])
    assert vllm_line(on[gemma3]) == serves and json.loads(on[gemma3 + "--json"])["vllm"]["serves_eagle3"] is True

    if on_cpu:  # the CPU build's limits, in targets/vllm_rules.py's words
        line = vllm_line(out[mla])
        assert "cannot serve an EAGLE-3 draft beside this target: " in line and line.endswith(fallback)
        assert "CPU build serves an EAGLE-3 draft beside an MLA target only in bfloat16" in line
        assert json.loads(out[mla + "--json"])["vllm"]["serves_eagle3"] is False
        line = vllm_line(out[int4_moe])  # eval does not fall back from this one: engine_options refuses it
        assert "CPU build cannot run this qwen3_moe target's int-quantized routed experts" in line
        assert "Capture it" not in line and line.endswith(
            "eval stops there: run it with engine=reference (nestling's reference decoder; docs/eval.md)"
        )


@pytest.mark.parametrize("case", ["vllm_unimportable", "no_vllm_check"])
def test_plan_without_asking_vllm_imports_none_of_it(tmp_path, case):
    """Where vLLM cannot be imported plan still runs and says eval uses the reference decoder; with
    --no-vllm-check it does not import an installed vLLM (that takes seconds)."""
    from nestling.engines import vllm_installed

    gemma3 = config_only(tmp_path, "gemma3")
    if case == "vllm_unimportable":
        out = run_plan(tmp_path, [gemma3], prelude="sys.modules['vllm'] = None  # import vllm raises ImportError")
        installed = False
    else:
        out = run_plan(tmp_path, [gemma3], flags=["--no-vllm-check"])
        installed = vllm_installed()
    assert out["vllm_modules"] == []
    js = json.loads(out[gemma3 + "--json"])["vllm"]
    assert js["installed"] is installed and js["checked"] is False and js["serves_eagle3"] is None
    line = vllm_line(out[gemma3])
    if installed:
        assert line == (
            f"vLLM        {js['version']} installed here; not asked whether it serves an EAGLE-3 draft beside this "
            "target (vllm_check off)"
        )
    else:
        reference = "eval measures with nestling's reference decoder (engine auto; docs/eval.md)"
        assert line == f"vLLM        not installed here: {reference}" and js["eval"] == reference
