"""The real vLLM engine (CPU build here, the ordinary package on GPUs), run in a subprocess.

`vllm_worker.py` does the work; this side writes its spec, starts it with the environment the
CPU build needs, and turns vLLM's spec-decode counters and the worker's count of target forwards
into the report's numbers.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from nestling.errors import NestlingError
from nestling.evaluate.standard_error import ratio_standard_error
from nestling.evaluate.vllm_worker import PROGRESS
from nestling.progress import log
from nestling.targets.vllm_rules import engine_options


class CannotServe(NestlingError):
    """The installed vLLM cannot run an EAGLE-3 draft beside this target (vllm_worker.eagle3_unsupported)."""


def run_vllm(
    target: Path,
    draft: Path | list[Path],
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    dtype: str = "float32",
    max_model_len: int = 2048,
    seed: int = 0,
    baseline: bool = True,
    kv_cache_gib: float = 1.0,
    timeout: float = 1800,
    draft_sample_method: str = "greedy",
) -> dict:
    """Run target alone (if `baseline`) and target + each draft: {"baseline": ..., "drafts": [...]}."""
    from nestling.evaluate.vllm_sampling import check_vllm_sampling
    from nestling.vllm_compat import require

    require("measure with --engine reference (nestling's own decoder)")
    check_vllm_sampling(temperature)  # a figure from an unsound sampler is refused, not reported
    drafts = [str(d) for d in (draft if isinstance(draft, list) else [draft])]
    spec = dict(
        target=str(target),
        drafts=drafts,
        k=k,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        baseline=baseline,
        draft_sample_method=draft_sample_method,
        engine_options=engine_options(Path(target), dtype),
    )
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_cache_gib))))  # vLLM takes whole GiB only
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="nestling-vllm-") as tmp:
        spec_path, res_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        log(f"[eval] starting vLLM ({'baseline + ' if baseline else ''}draft, k={k}) in a subprocess ...")
        rc, tail = run_forwarding(
            [sys.executable, "-m", "nestling.evaluate.vllm_worker", str(spec_path), str(res_path)], env, timeout
        )
        if rc != 0 or not res_path.exists():
            raise NestlingError(worker_failed(rc, tail))
        res = json.loads(res_path.read_text())
    if res.get("cannot_serve"):
        raise CannotServe(res["cannot_serve"])
    for d in res["drafts"]:
        d.update(summarize_run(d, k))
    return res


def worker_failed(rc: int, tail: str) -> str:
    """The message for a vLLM subprocess that failed: which process died when one did (a worker killed, out
    of memory; named by the roster of this command's processes, in the order they ended, else by vLLM's
    log, whose wording depends on which of its processes noticed first), else vLLM's own last lines."""
    import re
    import signal

    from nestling.faults import who_died

    dead = re.findall(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+)\)", tail)
    if dead or rc < 0 or "EngineDeadError" in tail:
        name, code = dead[-1] if dead else ("nestling.evaluate.vllm_worker", str(rc))
        how = f"exit code {code}"
        if int(code) < 0 and -int(code) in signal.valid_signals():
            how = f"killed by {signal.Signals(-int(code)).name}"
        return (
            f"the vLLM engine stopped: {who_died() or f'its process {name} died ({how})'} (killed, or out of "
            "memory: check `dmesg`); nothing of this eval was written: run the same command again"
        )
    return "vLLM failed (is vllm installed? on CPU: the vllm-cpu package):\n" + tail[-4000:]


def _stop(proc: subprocess.Popen) -> None:
    """End the worker and every engine process it started (its own process group): SIGTERM, then SIGKILL
    for what is left after 10 s; returns once the whole group is gone."""
    import signal
    import time

    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reap the worker itself; its orphaned children are reaped by init
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
    proc.poll()


def run_forwarding(cmd: list[str], env: dict, timeout: float, prefix: str = PROGRESS) -> tuple[int, str]:
    """Run `cmd`, log its lines that start with `prefix` as they come (progress of a long
    generate), keep the rest for the error message; kill it after `timeout` s. -> (rc, other output)."""
    # its own process group, so the engine processes it starts stop with it (`_stop`)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True
    )
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        _stop(proc)

    timer = threading.Timer(timeout, kill)
    timer.start()
    other: collections.deque[str] = collections.deque(maxlen=400)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                log(line.rstrip())
            else:
                other.append(line)
        rc = proc.wait()
    except BaseException:  # Ctrl-C, SIGTERM (nestling.interrupt): the worker and its engine stop with us
        _stop(proc)
        raise
    finally:
        timer.cancel()
    if killed.is_set():
        other.append(f"(killed after {timeout:.0f} s)\n")
    return rc, "".join(other)


def summarize_metrics(m: dict, k: int) -> dict:
    """vLLM's counters -> acceptance length (1 + accepted / drafts) and per-position rates."""
    drafts = m.get("num_drafts", 0.0)
    if not drafts:
        raise NestlingError(f"vLLM reported no spec-decode drafts (metrics: {sorted(m)}); was the draft loaded?")
    per_pos = m.get("num_accepted_tokens_per_pos", [0.0] * k)
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(m.get("num_draft_tokens", 0)),
        "num_accepted_tokens": int(m.get("num_accepted_tokens", 0)),
        "accepted_per_pos": [int(x) for x in per_pos],
        "acceptance_length": 1.0 + m.get("num_accepted_tokens", 0.0) / drafts,
        "per_position": [x / drafts for x in per_pos],
    }


def summarize_run(d: dict, k: int) -> dict:
    """One pass with a draft (the worker's `as_result` and counters) -> `summarize_metrics` plus tokens
    per target forward over every decode step, with its standard error over the prompts."""
    return {
        **summarize_metrics(d["metrics"], k),
        "target_forwards": d["target_forwards"],
        "mean_tokens_per_target_forward": tokens_per_forward(d["outputs"], d["forwards"], k),
        "tokens_per_forward_se": ratio_standard_error([len(o) for o in d["outputs"]], d["forwards"]),
    }


def tokens_per_forward(outputs: list[list[int]], forwards: list[int], k: int) -> float:
    """Tokens per target forward from the forwards counted per prompt (vllm_worker.generate_counted).
    Every counted forward emits 1 to k + 1 tokens, so a prompt outside those bounds means the count is
    broken: refused rather than reported as a figure above k + 1."""
    for i, (out, n) in enumerate(zip(outputs, forwards)):
        if not n <= len(out) <= n * (k + 1):
            raise NestlingError(f"prompt {i}: {len(out)} tokens from {n} target forwards at k={k}; the count is broken")
    return sum(map(len, outputs)) / max(sum(forwards), 1)
