"""`nestling demo`: the whole job on the embedded assets, on CPU, in about 10 minutes on 2 cores.

SmolLM2-135M-Instruct and ShareGPT come from the package index (nestling.assets; never a model hub).
The config is the package's `configs/demo.yaml` (also in examples/), run by the ordinary pipeline,
so the demo is exactly what `nestling run` does, with a small budget.
"""

from __future__ import annotations

import json
import shlex
from importlib import resources
from pathlib import Path
from typing import Sequence

from nestling.config import load_yaml
from nestling.errors import NestlingError


def demo_config_path() -> Path:
    return Path(str(resources.files("nestling") / "configs" / "demo.yaml"))


def demo_config(out: Path, overrides: Sequence[str] = ()):
    """The demo RunConfig with `run_dir` = out (relative to the current directory)."""
    from nestling.pipeline.settings import load_run_config
    from nestling.pipeline.stages import STAGES

    data = load_yaml(demo_config_path())
    data["run_dir"] = str(Path(out).absolute())
    return load_run_config(None, STAGES, list(overrides), base_data=data)


def read_report(eval_dir: Path) -> dict:
    """The eval stage's report.json (acceptance length and per-position rates per engine)."""
    p = Path(eval_dir) / "report.json"
    if not p.exists():
        raise NestlingError(f"{eval_dir} holds no evaluation report ({p.name} is missing)")
    return json.loads(p.read_text())


def serve_command(target: str, draft: Path, k: int) -> str:
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": k})
    return (
        f"python -m vllm.entrypoints.openai.api_server --model {shlex.quote(str(target))} "
        f"--speculative-config {shlex.quote(spec)}"
    )


def summary(run_dir: Path, target: str, k: int) -> str:
    """What the demo prints: acceptance length per engine, the plot, the draft, the serving command."""
    report = read_report(run_dir / "eval")
    k = int(report.get("k", k))
    acc = {engine: r["acceptance_length"] for engine, r in report["engines"].items()}
    plot = run_dir / "eval" / "acceptance.png"  # evaluate/report.py writes it beside report.json
    lines = [""]
    for engine, value in acc.items():
        lines.append(f"acceptance length ({engine}, K={k}): {value:.3f}")
    if acc:  # the figure alone means little to a new user: say what it is measured against
        lines.append(
            f"  = tokens per target forward with this draft; no speculation gives 1.000, a perfect "
            f"draft {k + 1:.3f} (K + 1); serving speed-up is roughly this figure minus the draft's cost"
        )
    if plot.exists():
        lines.append(f"per-position acceptance plot: {plot}")
    lines.append(f"draft folder: {run_dir / 'export'}")
    lines.append("serve the target with it in vLLM (GPU: `vllm serve TARGET --speculative-config ...`):")
    lines.append(f"  {serve_command(target, run_dir / 'export', k)}")
    return "\n".join(lines)


def demo(out: Path = Path("nestling-demo"), overrides: Sequence[str] = (), dry_run: bool = False) -> str | None:
    from nestling.pipeline.dryrun import dry_run as _dry
    from nestling.pipeline.run import resolve_paths, run_config
    from nestling.engines import vllm_installed
    from nestling.pipeline.stages import STAGES

    # The acceptance length from vLLM too, when it is installed (the YAML stays valid without it).
    if vllm_installed() and not any(o.startswith("eval.engine=") for o in overrides):
        overrides = ["eval.engine=both", *overrides]
    config = demo_config(out, overrides)
    if dry_run:
        _dry(config, stages=STAGES)
        return None
    run_config(config, stages=STAGES, header="nestling demo")
    target, _, _ = resolve_paths(config)
    text = summary(Path(config.run_dir), target, int(config.settings["eval"].k))
    print(text, flush=True)
    return text
