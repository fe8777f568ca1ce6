"""A full disk (issue 57, case 6): the device fills while capture writes a shard, while training writes a
checkpoint, while export writes the draft; and a file-size limit (RLIMIT_FSIZE) on one shard. Each ends in
one message that says how much space the stage needs and what is free; what was written stays
consistent (finished shards and the earlier checkpoint kept, no half-written file, an earlier draft left
whole), and once there is room the rerun completes.

The disk is a real small filesystem (a tmpfs mounted for the test, filled by the test at the stage's
progress line); where mounting is not allowed (not root) those tests are skipped, and the file-size-limit
test, which needs no mount, still runs."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest
from capture_fixture import TINY_TRAIN, tiny_llama, tiny_llama_capture  # noqa: F401 (fixtures)
from fault_helpers import Child, temp_files
from hostile_helpers import cli, fails_cleanly, hostile_data_dir, hostile_trained  # noqa: F401 (fixtures)

from nestling.capture.store import shard_key
from nestling.capture.verify import verify


class SmallDisk:
    """A tmpfs of `size` bytes at `path`; `fill(leave)` takes all but `leave` bytes of it."""

    def __init__(self, path: Path, size: int):
        self.path, self.filler = path, path / "filler"
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.decode().strip()[:100]})")

    def free(self) -> int:
        return shutil.disk_usage(self.path).free

    def fill(self, leave: int) -> None:
        with open(self.filler, "ab") as f:
            with contextlib.suppress(OSError):
                f.write(b"\0" * max(self.free() - leave, 0))

    def empty(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture()
def disk(tmp_path):
    d = SmallDisk(tmp_path / "disk", 16 << 20)
    yield d
    d.close()


def test_the_disk_fills_during_a_capture_shard(disk, data_dir, tiny):
    out = disk.path / "capture"
    args = ["capture", data_dir, "--target", tiny, "--out", out, "--dtype", "float32", "shard_size=20KB"]
    child = Child([*args, "progress_interval=0"], stop_at=r"^\[capture train\] 1/")
    try:
        child.wait_stopped(240)
        disk.fill(leave=4096)  # another writer took the disk after capture's own check of the space
        child.resume()
        assert child.finish(120) == 1, child.text[-3000:]
    finally:
        child.kill()
    msg = child.lines[-1]
    assert msg.startswith("nestling capture: error: the disk is full while writing "), child.text[-3000:]
    assert "The capture still needs " in msg and "unfinished shard(s) (the largest " in msg, msg
    assert f"is free on {out} now; " in msg and "shard(s) finished in this run are kept." in msg, msg
    assert temp_files(out) == [] and not (out / "manifest.json").exists()
    finished = sorted(out.glob("*/shard-*.safetensors"))
    assert all(shard_key(f) is not None for f in finished)  # whole shards only

    disk.empty()
    child = Child(args)
    assert child.finish(240) == 0, child.text[-3000:]
    assert verify(out) == []


def test_the_disk_fills_during_a_checkpoint(disk, capture):
    out = disk.path / "train"
    args = ["train", capture, "--out", out, "--steps", "3", "checkpoint_every=1", *TINY_TRAIN]
    child = Child([*args, "progress_interval=0"], stop_at=r"^\[train\] 2/3 steps")
    try:
        child.wait_stopped(240)
        disk.fill(leave=4096)
        child.resume()
        assert child.finish(120) == 1, child.text[-3000:]
    finally:
        child.kill()
    msg = "\n".join(child.lines[-2:])
    assert "could not write checkpoint step-00000002 in" in msg and "(No space left on device)" in msg, msg
    assert "step-00000001 is kept. A checkpoint needs about " in msg and "(its largest file " in msg, msg
    assert "is free there." in msg and "--resume to continue" in msg, msg
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000001"]  # no partial folder

    disk.empty()
    child = Child([*args, "--resume"])
    assert child.finish(240) == 0, child.text[-3000:]
    assert (out / "manifest.json").is_file()


def test_the_disk_fills_during_an_export_and_the_earlier_draft_stays(disk, trained, capsys):
    out = disk.path / "draft"
    rc, err = cli(capsys, "export", trained, "--out", out)
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    disk.fill(leave=64 << 10)
    msg = fails_cleanly(capsys, "export", trained, "--out", out)
    size = (out / "model.safetensors").stat().st_size
    assert f"could not write the draft in {out} (No space left on device): it needs " in msg, msg
    assert f"nothing in {out} was replaced" in msg
    need = float(msg.split("it needs ")[1].split(" ")[0])
    assert need * (1024 if " KiB" in msg.split("it needs ")[1][:15] else 1 << 20) >= size * 0.9
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # whole, untouched
    assert temp_files(out) == []


class file_size_limit:
    """RLIMIT_FSIZE for this process (Python ignores SIGXFSZ: a write past it fails with EFBIG)."""

    def __init__(self, limit: int):
        self.limit = limit

    def __enter__(self):
        self.saved = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.saved[1]))

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_FSIZE, self.saved)


def test_a_file_size_limit_on_a_capture_shard(data_dir, tiny, tmp_path, capsys):
    out = tmp_path / "capture"
    args = ["capture", data_dir, "--target", tiny, "--out", out, "--dtype", "float32", "shard_size=50KB"]
    with file_size_limit(30_000):
        msg = fails_cleanly(capsys, *args)
    assert "a file-size limit (`ulimit -f`, or the filesystem's own) stopped the write of " in msg, msg
    assert "The capture still needs " in msg and "(the largest " in msg, msg
    assert temp_files(out) == [] and not (out / "manifest.json").exists()
    rc, err = cli(capsys, *args)
    assert rc == 0, err
    assert verify(out) == []
    assert os.path.isdir(out / "train")
