"""The benchmark scripts: each takes paths, says how long it takes (`--help`), and runs on any host.

The shell drivers are checked with a `python3` that records its arguments instead of running nestling
(what the GPU work itself measures is in docs/results/); the Python benchmarks' helpers run for real on
a tiny target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


SHELL_BENCHMARKS = ["gpu_recipe.sh", "regen_flash.sh", "regen_idle.sh", "w4a16_capture.sh"]


@pytest.mark.parametrize("script", [f"benchmarks/{s}" for s in SHELL_BENCHMARKS])
def test_shell_benchmarks_have_help_that_says_their_time_and_result(script):
    r = subprocess.run(["bash", script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: bash " + script), r.stdout[:200]
    assert "Time" in r.stdout and "Result" in r.stdout, r.stdout


@pytest.mark.parametrize("script", ["regen_flash.sh", "regen_idle.sh", "w4a16_capture.sh"])
def test_gpu_scripts_need_an_output_folder_and_refuse_unknown_arguments(tmp_path, script):
    path = ROOT / "benchmarks" / script
    r = subprocess.run(["bash", str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--out DIR is required" in r.stderr
    r = subprocess.run(["bash", str(path), "--out", "o", "--bogus"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2 and "--bogus" in r.stderr and not (tmp_path / "o").exists()


def test_copy_draft_runs_no_shell_on_a_hostile_work_path(tmp_path, monkeypatch):
    """Benchmarks copy a trained draft next to their results (`--return`); the work folder is a user's
    --work path, so a name with shell syntax in it must stay a name. An earlier copy is replaced."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("quality", None)
    import quality

    work = tmp_path / "w; touch PWNED #"
    (work / "export-a").mkdir(parents=True)
    payload = os.urandom(5000)
    (work / "export-a" / "model.safetensors").write_bytes(payload)
    out = tmp_path / "out"
    (out / "draft-a").mkdir(parents=True)
    (out / "draft-a" / "stale.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    dest = quality.copy_draft(work, "export-a", out, "draft-a")
    assert dest == out / "draft-a" and not list(tmp_path.rglob("PWNED"))
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"]
    assert (dest / "model.safetensors").read_bytes() == payload


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
    with pytest.raises(SystemExit, match="regen-pilot 0"):
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

    # a later run: the sampled set (only its manifest and messages) copied into a fresh work folder,
    # and the run trains on it without sampling again
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
    # a parallel run's own folder (`{work}-{name}`) links the copied set in, and finds it there
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


def _fake_python(tmp_path: Path, vllm: bool) -> Path:
    """An interpreter that records its arguments instead of running anything; `-c "import vllm"` answers
    whether vLLM is installed, and mix_source.py writes its --out file."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/calls\n'
        f'[ "$1" = -c ] && exit {0 if vllm else 1}\n'
        'case "$1" in *mix_source.py) mkdir -p "$(dirname "$3")" && echo "{}" > "$3" ;; esac\n'
    )
    fake.chmod(0o755)
    return fake


def _calls(tmp_path: Path) -> list[str]:
    lines = (tmp_path / "calls").read_text().splitlines()
    return [line.replace(str(ROOT) + "/", "") for line in lines if not line.startswith("-c ")]


@pytest.mark.parametrize("vllm", [False, True])
def test_gpu_recipe_builds_the_input_runs_the_recipe_and_measures_its_draft(tmp_path, vllm):
    """`gpu_recipe.sh --out DIR KEY=VALUE -- FLAGS`: the chat input (ShareGPT outside the held-out
    prompts) once, `nestling run examples/gpu.yaml` on it in builtin:sharegpt's place beside the built-in
    maths and code inputs, with the settings and flags, then the quality benchmark on the exported draft
    on every domain: in vLLM where it is installed, else the reference decoder on the GPU."""
    env = {**os.environ, "PYTHON": str(_fake_python(tmp_path, vllm))}
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_recipe.sh"), "--out", "o", "--k", "3", "train.steps=10"]
    r = subprocess.run(cmd + ["--", "--until", "export"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    engines = "--engines vllm" if vllm else "--engines reference --no-ngram --device cuda"
    assert _calls(tmp_path) == [
        "benchmarks/mix_source.py --out o/input/sharegpt-train.jsonl --chat 1000000 --maths 0",
        "-m nestling run examples/gpu.yaml run_dir=o/run"
        " inputs=o/input/sharegpt-train.jsonl,builtin:maths,builtin:code train.steps=10 --until export",
        f"benchmarks/quality.py --budget full --draft o/run/export {engines} --max-prompts 24 --k 3"
        " --domains chat code maths --out o/quality",
    ]
    (tmp_path / "calls").unlink()  # a rerun reuses the input it built
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and not _calls(tmp_path)[0].startswith("benchmarks/mix_source.py")


def test_gpu_recipe_takes_an_input_and_refuses_what_it_does_not_know(tmp_path):
    env = {**os.environ, "PYTHON": str(_fake_python(tmp_path, False))}
    script = ["bash", str(ROOT / "benchmarks" / "gpu_recipe.sh")]
    for bad, says in (
        (["--bogus"], "unknown option --bogus"),
        (["steps"], "neither an option"),
        (
            ["--input", "none.jsonl"],
            "none.jsonl: no such file",
        ),
    ):
        r = subprocess.run(script + bad, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == 2 and says in r.stderr and not (tmp_path / "calls").exists()
    (tmp_path / "chat.jsonl").write_text("{}\n")
    cmd = script + ["--input", "chat.jsonl", "--domains", "chat", "--max-prompts", "36", "--no-quality"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _calls(tmp_path) == [
        "-m nestling run examples/gpu.yaml run_dir=runs/gpu-recipe/run inputs=chat.jsonl,builtin:maths,builtin:code"
    ]


@pytest.mark.slow
def test_regen_flash_smoke_runs_on_a_cpu(tmp_path):
    """The GPU script's own commands on a 2-layer, 128-wide model on the CPU (about a minute)."""
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    cmd = ["bash", str(ROOT / "benchmarks" / "regen_flash.sh"), "--out", str(tmp_path), "--device", "cpu", "--smoke"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == [f"regen_{s}_{a}.json" for s in ("llama8b", "smollm2") for a in ("auto", "matmul")]
    assert "regen_smollm2_auto" in r.stdout and (tmp_path / "regen_flash.log").exists()


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
