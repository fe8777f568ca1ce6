"""The data stage's speed paths must not change a token or a mask bit.

- the head start (workers begin on a tokenizer read from the target's files while AutoTokenizer loads)
  is used only when AutoTokenizer's tokenizer and template are identical, and its output equals a
  one-process run; when AutoTokenizer builds something else (Qwen2Tokenizer adds an NFC normalizer)
  the workers start over with AutoTokenizer's;
- once that identity is verified, it is remembered for those exact tokenizer files and versions, and
  later runs never import transformers' AutoTokenizer (nor torch) in the main process, with the same
  output; a changed tokenizer file means verifying again;
- the piece cache (short pieces tokenized once per process) gives the uncached ids.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from nestling.data.chat import FileTokenizer, chat_format, encode_conversations, format_key
from nestling.data.normalize import normalize_record
from nestling.data.run import prepare_data
from nestling.data.readers import read_input
from nestling.data.settings import DataSettings

N = 130  # ShareGPT records: three worker chunks of 64


def tables(folder) -> list:
    return [pq.read_table(f) for f in sorted(folder.glob("*.parquet"))]


def assert_same_output(a, b, ma: dict, mb: dict) -> None:
    ta, tb = tables(a), tables(b)
    assert len(ta) == len(tb) > 0
    assert all(x.equals(y) for x, y in zip(ta, tb))
    for key in ("counts", "examples", "splits", "fingerprint", "mask_method"):
        assert ma[key] == mb[key], key


@pytest.mark.slow
def test_head_start_output_equals_one_process(tmp_path, smollm2_dir, sharegpt_path, capsys):
    from transformers import AutoTokenizer

    assert format_key(chat_format(FileTokenizer(smollm2_dir))) == format_key(
        chat_format(AutoTokenizer.from_pretrained(smollm2_dir))
    )
    kw = dict(limit=N, held_out=0.1, max_length=512)
    one = prepare_data([sharegpt_path], smollm2_dir, tmp_path / "one", DataSettings(workers=1, **kw))
    capsys.readouterr()
    two = prepare_data([sharegpt_path], smollm2_dir, tmp_path / "two", DataSettings(workers=2, **kw))
    assert "start over" not in capsys.readouterr().err
    assert one["counts"]["kept"] > N // 2
    assert_same_output(tmp_path / "one", tmp_path / "two", one, two)


@pytest.fixture()
def qwen2_target(tmp_path):
    from nestling.assets import cache_dir

    from test_data_chat import gguf_tokenizer

    gguf_tokenizer("qwen2")  # makes sure the saved tokenizer folder exists
    target = tmp_path / "qwen2-target"
    shutil.copytree(cache_dir() / "vocab-tokenizers" / "qwen2", target)
    (target / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return target


@pytest.mark.slow
def test_head_start_is_discarded_when_autotokenizer_differs(tmp_path, qwen2_target, sharegpt_path, capsys):
    from transformers import AutoTokenizer

    real = chat_format(AutoTokenizer.from_pretrained(qwen2_target))
    assert format_key(chat_format(FileTokenizer(qwen2_target))) != format_key(real)  # the NFC normalizer
    kw = dict(limit=N, max_length=512)
    one = prepare_data([sharegpt_path], qwen2_target, tmp_path / "one", DataSettings(workers=1, **kw))
    capsys.readouterr()
    two = prepare_data([sharegpt_path], qwen2_target, tmp_path / "two", DataSettings(workers=2, **kw))
    assert "start over" in capsys.readouterr().err
    assert_same_output(tmp_path / "one", tmp_path / "two", one, two)


RUN = """
import json, sys
from nestling.data.run import prepare_data
from nestling.data.settings import DataSettings
m = prepare_data([sys.argv[1]], sys.argv[2], sys.argv[3], DataSettings(limit=int(sys.argv[4]), max_length=512, workers=2))
print(json.dumps({"torch": "torch" in sys.modules, "autotokenizer": "transformers.models.auto" in sys.modules}))
"""


def _run_data(source, target, out, cache) -> tuple[dict, dict, str]:
    env = {**os.environ, "NESTLING_CACHE": str(cache)}
    res = subprocess.run(
        [sys.executable, "-c", RUN, str(source), str(target), str(out), str(N)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), json.loads((out / "manifest.json").read_text()), res.stderr


@pytest.mark.slow
def test_verified_tokenizer_match_is_remembered(tmp_path, smollm2_dir, sharegpt_path):
    target = tmp_path / "target"  # a copy, so a tokenizer file can be changed below
    shutil.copytree(smollm2_dir, target, ignore=shutil.ignore_patterns("*.safetensors"))
    cache = tmp_path / "cache"
    first, m1, _ = _run_data(sharegpt_path, target, tmp_path / "a", cache)
    assert first["autotokenizer"] and len(list((cache / "tokenizer-match").glob("*.json"))) == 1
    second, m2, err = _run_data(sharegpt_path, target, tmp_path / "b", cache)
    assert not second["torch"] and not second["autotokenizer"] and "verified earlier, cached" in err
    assert_same_output(tmp_path / "a", tmp_path / "b", m1, m2)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 4096  # any change to a tokenizer file: verify again
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    third, m3, err = _run_data(sharegpt_path, target, tmp_path / "c", cache)
    assert third["autotokenizer"] and "verified earlier" not in err
    assert len(list((cache / "tokenizer-match").glob("*.json"))) == 2
    assert_same_output(tmp_path / "a", tmp_path / "c", m1, m3)


@pytest.mark.slow
def test_a_damaged_or_unusable_match_record_only_costs_the_speed_up(
    tmp_path, smollm2_dir, sharegpt_path, monkeypatch, capsys
):
    """A corrupt record, a record for another tokenizer guess, or a cache that cannot be written:
    the run verifies with AutoTokenizer as if there were no record, and the output is unchanged."""
    from nestling.data.headstart import match_record

    kw = dict(limit=N, max_length=512, workers=2)
    monkeypatch.setenv("NESTLING_CACHE", str(tmp_path / "cache"))
    ref = prepare_data([sharegpt_path], smollm2_dir, tmp_path / "ref", DataSettings(**kw))
    record = match_record(smollm2_dir, None)
    assert record is not None and record.exists()
    for i, damage in enumerate(["{not json", json.dumps({"tokenizer_fingerprint": "x", "format_hash": "stale"})]):
        record.write_text(damage)
        capsys.readouterr()
        m = prepare_data([sharegpt_path], smollm2_dir, tmp_path / f"d{i}", DataSettings(**kw))
        assert "verified earlier" not in capsys.readouterr().err
        assert_same_output(tmp_path / "ref", tmp_path / f"d{i}", ref, m)
        assert json.loads(record.read_text())["tokenizer_fingerprint"] == ref["inputs"]["tokenizer"]  # rewritten
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("NESTLING_CACHE", str(blocked / "cache"))
    m = prepare_data([sharegpt_path], smollm2_dir, tmp_path / "ro", DataSettings(**kw))
    assert_same_output(tmp_path / "ref", tmp_path / "ro", ref, m)


@pytest.mark.slow
def test_piece_cache_gives_uncached_ids(smollm2_dir, sharegpt_path):
    from transformers import AutoTokenizer

    recs, _ = read_input(sharegpt_path, 100)
    convs = [m for m in (normalize_record(r.data).messages for r in recs if r.data is not None) if m]
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    fmt = chat_format(tok)
    first = encode_conversations(fmt, convs)
    assert len(fmt.piece_cache) > 10  # role headers, "\n", the default system prompt were remembered
    again = encode_conversations(fmt, convs)  # now mostly from the cache
    fresh = encode_conversations(chat_format(tok), convs[::-1])[::-1]  # other batch order, empty cache
    for a, b, c in zip(first, again, fresh):
        assert a.drop == b.drop == c.drop
        if a.drop is None:
            assert list(a.input_ids) == list(b.input_ids) == list(c.input_ids)
            assert list(a.loss_mask) == list(b.loss_mask) == list(c.loss_mask)
