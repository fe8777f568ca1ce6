"""Progress of the vLLM subprocess reaches the caller's log line by line (no vLLM needed here:
the forwarding and the line-printing tqdm are plain code paths the real eval runs use)."""

from __future__ import annotations

import os
import sys
import time

from nestling.evaluate.vllm_engine import run_forwarding
from nestling.evaluate.vllm_worker import PROGRESS, line_progress


def test_progress_lines_are_forwarded_and_the_rest_kept_for_errors(capsys):
    script = (
        f"print('{PROGRESS} 1/2 prompts', flush=True); print('engine noise', flush=True); "
        f"print('{PROGRESS} 2/2 prompts', flush=True); raise SystemExit(3)"
    )
    rc, other = run_forwarding([sys.executable, "-c", script], dict(os.environ), timeout=60)
    err = capsys.readouterr().err
    assert rc == 3
    assert f"{PROGRESS} 1/2 prompts" in err and f"{PROGRESS} 2/2 prompts" in err and "engine noise" not in err
    assert "engine noise" in other and PROGRESS not in other


def test_a_hung_worker_is_killed_at_the_timeout():
    t = time.monotonic()
    rc, other = run_forwarding([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), timeout=1)
    assert rc != 0 and "killed after 1 s" in other
    assert time.monotonic() - t < 30


def test_line_progress_prints_whole_lines_with_counts(capsys):
    bar = line_progress("with draft, k=3")(total=3, desc="ignored", dynamic_ncols=True, postfix="speed")
    for _ in range(3):
        bar.update(1)
    bar.close()
    bar.refresh()  # a redraw of the same state prints nothing new
    lines = [x for x in capsys.readouterr().out.splitlines() if x]
    assert lines and all(x.startswith(f"{PROGRESS} with draft, k=3: ") for x in lines)
    assert "\r" not in "".join(lines) and "3/3 prompts" in lines[-1] and len(lines) == len(set(lines))
    adding = line_progress("x")(total=3, desc="Adding requests")  # vLLM's other bar: silent
    adding.update(3)
    adding.close()
    assert capsys.readouterr().out == ""
