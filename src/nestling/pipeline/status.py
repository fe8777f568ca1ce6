"""`nestling status RUN_DIR`: where a (possibly remote, possibly dead) run stands, from its files only.

Reads RUN_DIR/run.json (stage order), RUN_DIR/state/<stage>.json (status, key, pid) and the
progress numbers the stages write; a `running` stage whose process is gone on this host is
reported as interrupted, one whose progress has not moved for a while as stalled.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from nestling.errors import NestlingError
from nestling.pipeline.state import RUN_LOG, pid_alive, read_json, read_progress, read_state
from nestling.progress import format_bytes, format_duration

STALLED_S = 600.0


def read_run_info(run_dir: Path) -> dict:
    """RUN_DIR/run.json, checked: a mapping whose `stages` is a list of stage names. A damaged file
    (`[]`, `{}`, a hand edit) is reported as such, never as a traceback."""
    path = Path(run_dir) / "run.json"
    info = read_json(path)
    if info is None:
        why = "it cannot be parsed as JSON" if path.exists() else "no run.json"
        raise NestlingError(
            f"{run_dir} is not a nestling run folder ({why}); start one with `nestling run CONFIG.yaml`"
        )
    stages = info.get("stages") if isinstance(info, dict) else None
    if not isinstance(stages, list) or not all(isinstance(n, str) for n in stages):
        raise NestlingError(
            f"{path} is damaged: it needs a 'stages' list of stage names; run `nestling run CONFIG.yaml` "
            f"on this run folder again to rewrite it"
        )
    return info


def _mapping(obj) -> dict:
    """A state or progress file's content, or {} when it is not a mapping (damaged: shown as pending)."""
    return obj if isinstance(obj, dict) else {}


def stage_rows(run_dir: Path) -> list[dict]:
    run_dir = Path(run_dir)
    info = read_run_info(run_dir)
    now = time.time()
    rows = []
    for name in info["stages"]:
        state = _mapping(read_state(run_dir, name))
        prog = _mapping(read_progress(run_dir, name))
        status = state.get("status", "pending")
        if status == "running":
            if state.get("host") == socket.gethostname() and not pid_alive(int(state.get("pid", 0))):
                status = "interrupted"
            elif prog and now - prog.get("updated", now) > STALLED_S:
                status = "stalled?"
        row = {"stage": name, "status": status, "wall_s": state.get("wall_s"), "error": state.get("error")}
        if prog and status != "pending":
            row.update(
                done=prog.get("done"),
                total=prog.get("total"),
                unit=prog.get("unit"),
                tokens_per_s=prog.get("tokens_per_s"),
                eta_s=prog.get("eta_s"),
                elapsed_s=prog.get("elapsed_s"),
                updated=prog.get("updated"),
                desc=prog.get("stage"),
            )
        if status in ("running", "interrupted", "stalled?") and state.get("started"):
            end = now if status == "running" else max(state.get("updated", 0.0), prog.get("updated", 0.0))
            row["wall_s"] = float(state.get("wall_s") or 0.0) + max(end - state["started"], 0.0)
        rows.append(row)
    return rows


def format_status(run_dir: Path) -> str:
    rows = stage_rows(run_dir)
    info = read_run_info(run_dir)
    lines = [f"run {run_dir}  target {info.get('target', '?')}"]
    header = f"{'stage':<11}{'status':<13}{'progress':<28}{'tokens/s':>10}  {'elapsed':>9}  {'ETA':>9}"
    lines.append(header)
    for r in rows:
        progress = ""
        if r.get("done") is not None:
            progress = f"{r['done']}/{r['total']} {r['unit']}" if r.get("total") else f"{r['done']} {r['unit']}"
            if r.get("total"):
                progress += f" ({100.0 * r['done'] / r['total']:.0f}%)"
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else ""
        elapsed = format_duration(r["wall_s"]) if r.get("wall_s") is not None else ""
        eta = ""
        if r["status"] == "running" and r.get("eta_s") is not None:
            eta = format_duration(max(0.0, r["eta_s"] - (time.time() - r.get("updated", time.time()))))
        lines.append(f"{r['stage']:<11}{r['status']:<13}{progress:<28}{tps:>10}  {elapsed:>9}  {eta:>9}")
        if r.get("error") and r["status"] in ("failed", "interrupted"):
            lines.append(f"{'':<11}error: {r['error'][:300]}")
    est = _mapping(read_json(Path(run_dir) / "dry-run" / "estimate.json"))
    if est:
        total_s = sum(float(e.get("seconds") or 0.0) for e in est.get("stages", []))
        lines.append(
            f"dry-run estimate of the full run: {format_bytes(est.get('need_bytes', 0))} disk, "
            f"{format_duration(total_s)}"
        )
    log = Path(run_dir) / RUN_LOG
    if log.exists():
        age = time.time() - log.stat().st_mtime
        lines.append(f"log {log} (last line {format_duration(age)} ago)")
    return "\n".join(lines)
