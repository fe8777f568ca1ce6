"""Offline names (issue 57, case 5): a model hub id as the target or a URL as an input, on a machine with no
hub or web access. Every command refuses it within a second, with a message that names what nestling
takes (a local model folder or .gguf file; local files) and how to get a local copy, and never tries the
network. The network here is a proxy that accepts and never answers (`fault_helpers.blackhole`), with
HF_HUB_OFFLINE unset: a command that tried it would hang until the time bound, and the connection is
counted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fault_helpers import Child, blackhole
from hostile_helpers import fails_cleanly, within

HUB = "meta-llama/Llama-3.1-8B"
HUB_URL = "https://huggingface.co/meta-llama/Llama-3.1-8B"
DATA_URL = "https://example.com/ShareGPT_V3.json"
TARGET_TAKES = "it takes a local model folder (config.json + .safetensors weights) or a .gguf file"
FILE_TAKES = "it takes a local file or folder"


@pytest.fixture()
def offline(monkeypatch):
    """No hub, no web: every request would go to the blackhole; yields the list of connections made."""
    with blackhole() as (env, connections):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        yield connections


def refused_at_once(capsys, *args) -> str:
    t0 = time.monotonic()
    with within(10):
        msg = fails_cleanly(capsys, *args)
    assert time.monotonic() - t0 < 1.0, f"took {time.monotonic() - t0:.2f} s"
    return msg


CASES = {
    "data: hub target": (["data", "{chat}", "--target", HUB, "--out", "{out}"], [f"target '{HUB}'", TARGET_TAKES]),
    "data: URL input": (
        ["data", DATA_URL, "--target", "{t}", "--out", "{out}"],
        [f"input {DATA_URL} is a URL", FILE_TAKES],
    ),
    "data: hub URL target": (
        ["data", "{chat}", "--target", HUB_URL, "--out", "{out}"],
        [f"target {HUB_URL} is a URL", f"huggingface-cli download {HUB} --local-dir DIR"],
    ),
    "capture: hub target": (["capture", "{chat}", "--target", HUB, "--out", "{out}"], [TARGET_TAKES]),
    "capture: hf:// target": (["capture", "{chat}", "--target=hf://" + HUB, "--out", "{out}"], ["is a URL"]),
    "train online: hub target": (
        ["train", "{chat}", "--online", "--target", HUB, "--out", "{out}"],
        [f"target '{HUB}'", TARGET_TAKES],
    ),
    "eval: hub target": (
        ["eval", "{chat}", "--target", HUB, "--prompts", "{chat}", "--out", "{out}"],
        [f"huggingface-cli download {HUB} --local-dir DIR"],
    ),
    "eval: URL prompts": (
        ["eval", "{chat}", "--target", "{t}", "--prompts", DATA_URL, "--out", "{out}"],
        [f"--prompts {DATA_URL} is a URL", "curl -L -o FILE URL"],
    ),
    "regenerate: URL input": (["regenerate", DATA_URL, "--target", "{t}", "--out", "{out}"], ["is a URL"]),
    "regenerate: hub target": (["regenerate", "{chat}", "--target", HUB, "--out", "{out}"], [TARGET_TAKES]),
    "plan: hub target": (["plan", HUB, "--tokens", "1000"], [f"target '{HUB}'", TARGET_TAKES]),
    "run: hub target in the config": (["run", "{hubcfg}"], [f"target of the run config '{HUB}'", TARGET_TAKES]),
    "run: URL input in the config": (["run", "{urlcfg}"], [f"inputs[0] of the run config {DATA_URL} is a URL"]),
    "run: URL input override": (["run", "{urlcfg}", f"inputs={DATA_URL}"], [f"inputs {DATA_URL} is a URL"]),
    "run: hub target override": (["run", "{urlcfg}", f"target={HUB}"], [f"target '{HUB}'"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hub_id_or_url_is_refused_at_once_without_the_network(case, offline, tiny_target, tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n')
    (tmp_path / "hub.yaml").write_text(f"target: {HUB}\ninputs: [{chat}]\nrun_dir: {tmp_path / 'r'}\n")
    (tmp_path / "url.yaml").write_text(
        f"target: {tiny_target('llama')}\ninputs: [{DATA_URL}]\nrun_dir: {tmp_path / 'r'}\n"
    )
    names = dict(chat=chat, out=tmp_path / "out", t=tiny_target("llama"), hubcfg=tmp_path / "hub.yaml")
    names["urlcfg"] = tmp_path / "url.yaml"
    args, expect = CASES[case]
    msg = refused_at_once(capsys, *(a.format(**names) for a in args))
    for e in expect:
        assert e in msg, msg
    assert "never downloads" in msg
    assert offline == []  # no connection was even tried
    assert not (tmp_path / "out").exists() and not (tmp_path / "r").exists()  # nothing written


def test_the_python_api_refuses_them_too(offline, tiny_target, tmp_path):
    import nestling
    from nestling.errors import NestlingError

    with within(10):
        with pytest.raises(NestlingError, match="is a URL: nestling reads only local paths"):
            nestling.prepare_data(DATA_URL, tiny_target("llama"), tmp_path / "out")
        with pytest.raises(NestlingError, match="looks like a model hub id"):
            (tmp_path / "x.jsonl").write_text("{}\n")
            nestling.prepare_data(tmp_path / "x.jsonl", HUB, tmp_path / "out")
    assert offline == []


def test_a_local_folder_named_like_a_hub_id_is_still_a_folder(tiny_target, tmp_path, monkeypatch):
    """`org/model` that exists here is a local path: no refusal."""
    import shutil

    from nestling.targets.load import resolve_target

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_target("llama"), tmp_path / "meta-llama" / "Llama-3.1-8B")
    assert resolve_target(HUB) == Path(HUB)


def test_a_fresh_process_answers_within_seconds_and_never_connects(offline, tmp_path):
    """The whole command in a new interpreter (imports included), networking a blackhole: no wait."""
    t0 = time.monotonic()
    child = Child(
        ["eval", tmp_path / "draft", "--target", HUB, "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "o"]
    )
    assert child.finish(30) == 1, child.text
    assert time.monotonic() - t0 < 15  # an interpreter start; a network attempt would hang for good
    assert child.lines[-1].startswith(f"nestling eval: error: target '{HUB}' is not a local folder"), child.text
    assert offline == []
