"""The capture store: byte-sized safetensors shards, an index per split, and a memory-mapped reader.

Layout (docs/formats.md): `{split}/shard-XXXXX.safetensors` with `hidden [T, n_ids, H]`,
`input_ids [T] int32`, `loss_mask [T] uint8`, and `{split}/index.json` (sample -> shard, offset, length).

Why we write the safetensors file ourselves: the shard plan fixes every tensor's shape before the
first forward, so the header can be written first and `hidden` streamed batch by batch. Memory stays
bounded by the queue, not by the shard size, and disk writes overlap compute continuously. The result
is an ordinary safetensors file (`safe_open` reads it); it is a pure function of the plan, so a
resumed run writes byte-identical shards.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from nestling.data.dataset import Sample
from nestling.errors import NestlingError
from nestling.manifest import atomic_write_bytes, atomic_write_json, hash_json

ST_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def store_dtype(name: str) -> torch.dtype:
    """The stored dtype of capture setting `dtype` (resolved: bfloat16, float32 or float8)."""
    return FP8 if name == "float8" else getattr(torch, name)


def quantize_fp8(h: torch.Tensor, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] -> (float8_e4m3fn [..., H], float32 scale [...]): each vector divided by amax / 448, so
    its largest entry lands on fp8's largest value and the rest keep 3 mantissa bits of relative
    precision. An all-zero vector gets scale 1. Deterministic (round to nearest even), so a resumed
    capture writes the same bytes. Done `chunk` rows at a time: the fp32 temporaries of a whole 16k-token
    batch of a 7168-wide target would take ~4 GB beside the weights."""
    q = torch.empty(h.shape, dtype=FP8, device=h.device)
    scale = torch.empty(h.shape[:-1], dtype=torch.float32, device=h.device)
    for a in range(0, max(h.shape[0], 1), chunk):
        x = h[a : a + chunk].float()
        amax = x.abs().amax(-1)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q[a : a + chunk] = (x / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        scale[a : a + chunk] = s
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_fp8`, in the dtype the reader wants."""
    return (q.float() * scale[..., None].float()).to(dtype)


INDEX = "index.json"
CHECKSUMS = "checksums.jsonl"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def bytes_per_token(n_ids: int, hidden_size: int, dtype: torch.dtype) -> int:
    """hidden + input_ids (int32) + loss_mask (uint8); float8 adds one float32 scale per token and slot."""
    scale = n_ids * 4 if dtype == torch.float8_e4m3fn else 0
    return n_ids * hidden_size * dtype.itemsize + scale + 4 + 1


@dataclass
class ShardPlan:
    """Which samples go into shard `index`, in stored order; `key` identifies the planned content."""

    index: int
    samples: list[Sample]
    key: str

    @property
    def tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.samples)


def plan_shards(samples: list[Sample], bpt: int, shard_bytes: int, run_key: str) -> list[ShardPlan]:
    """Longest samples first (an out-of-memory batch fails in the first seconds, not at the end), then
    consecutive runs of at most `shard_bytes` (at least one sample per shard)."""
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].input_ids), i))
    groups: list[list[Sample]] = []
    size = 0
    for i in order:
        b = len(samples[i].input_ids) * bpt
        if not groups or size + b > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(samples[i])
        size += b
    return [
        ShardPlan(k, g, hash_json([run_key, k, [(s.sample_id, len(s.input_ids)) for s in g]]))
        for k, g in enumerate(groups)
    ]


def batches(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Consecutive runs of (length-sorted) samples whose padded size B x max_len fits the budget."""
    out: list[list[Sample]] = []
    longest = 0
    for s in samples:
        n = len(s.input_ids)
        if out and (len(out[-1]) + 1) * max(longest, n) <= token_budget:
            out[-1].append(s)
            longest = max(longest, n)
        else:
            out.append([s])
            longest = n
    return out


def _header(plan: ShardPlan, n_ids: int, hidden_size: int, dtype: torch.dtype, meta: dict) -> bytes:
    """hidden, then (float8 only) hidden_scale, input_ids, loss_mask: in that order in the data."""
    T = plan.tokens
    nh = T * n_ids * hidden_size * dtype.itemsize
    head = {
        "__metadata__": {k: str(v) for k, v in meta.items()},
        "hidden": {"dtype": ST_DTYPES[dtype], "shape": [T, n_ids, hidden_size], "data_offsets": [0, nh]},
    }
    if dtype == FP8:
        head["hidden_scale"] = {"dtype": "F32", "shape": [T, n_ids], "data_offsets": [nh, nh + 4 * T * n_ids]}
        nh += 4 * T * n_ids
    head |= {
        "input_ids": {"dtype": "I32", "shape": [T], "data_offsets": [nh, nh + 4 * T]},
        "loss_mask": {"dtype": "U8", "shape": [T], "data_offsets": [nh + 4 * T, nh + 5 * T]},
    }
    js = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    js += b" " * (-(len(js) + 8) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(js)) + js


def shard_key(path: Path) -> str | None:
    """The plan key of a complete shard on disk (None when unreadable)."""
    try:
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return (f.metadata() or {}).get("plan")
    except Exception:
        return None


def file_crc32(path: Path, chunk: int = 1 << 26) -> tuple[str, int]:
    """(crc32 as 8 hex digits, size) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return f"{crc:08x}", size


def record_checksum(split_dir: Path, shard: str, plan_key: str, crc: str, size: int) -> None:
    """Append a completed shard's checksum to `{split}/checksums.jsonl` (fsynced): written as the shard
    completes, so a resumed run keeps the checksums of the shards it keeps without rereading them."""
    line = json.dumps({"shard": shard, "plan": plan_key, "crc32": crc, "bytes": size}, sort_keys=True) + "\n"
    with open(Path(split_dir) / CHECKSUMS, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_checksums(split_dir: Path) -> dict[str, dict] | None:
    """shard name -> its last recorded `{plan, crc32, bytes}`; None when the split records none (a store
    written before checksums existed). A torn last line (a crash mid-append) is skipped."""
    path = Path(split_dir) / CHECKSUMS
    if not path.exists():
        return None
    out: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
            out[e["shard"]] = e
        except (ValueError, KeyError, TypeError):
            continue
    return out


def finish_checksums(split_dir: Path, plans: list["ShardPlan"]) -> None:
    """Rewrite `checksums.jsonl` with exactly one line per planned shard, in order. A complete shard
    without a current entry (the run died between its rename and the append, or the store predates
    checksums) is read once now."""
    split_dir = Path(split_dir)
    known = read_checksums(split_dir) or {}
    lines = []
    for p in plans:
        name = shard_name(p.index)
        e = known.get(name)
        if e is None or e.get("plan") != p.key:
            crc, size = file_crc32(split_dir / name)
            e = {"shard": name, "plan": p.key, "crc32": crc, "bytes": size}
        lines.append(json.dumps(e, sort_keys=True))
    atomic_write_bytes(split_dir / CHECKSUMS, ("\n".join(lines) + "\n").encode())


def _raw(t: torch.Tensor):
    return t.contiguous().view(torch.uint8).numpy()


class ShardWriter:
    """Background thread that streams batches into shard files, so disk writes overlap the forward.

    The queue is bounded: when the disk is slower than the model, compute waits instead of RAM filling.
    Items carry an optional CUDA event that the writer waits on before reading a pinned host copy.
    """

    def __init__(self, queue_size: int = 4):
        self.q: queue.Queue = queue.Queue(maxsize=queue_size)
        self.error: BaseException | None = None
        self.bytes_written = 0
        self._abort = False
        self._thread = threading.Thread(target=self._run, name="nestling-shard-writer", daemon=True)
        self._thread.start()

    def _put(self, item) -> None:
        while True:
            self._check()
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def begin(self, path: Path, plan: ShardPlan, n_ids: int, hidden_size: int, dtype: torch.dtype, meta: dict) -> None:
        self._put(("begin", Path(path), plan, _header(plan, n_ids, hidden_size, dtype, {**meta, "plan": plan.key})))

    def write(self, hidden: torch.Tensor, event=None, release=None) -> None:
        """Queue one batch; `release` (if given) is called once its bytes are written."""
        self._put(("hidden", hidden, event, release))

    def write_scale(self, scale: torch.Tensor, event=None, release=None) -> None:
        """Queue one batch's float8 scales [B, n_ids]; kept in memory (4 bytes per token and slot) and
        written after the shard's last hidden row, where the header puts them."""
        self._put(("scale", scale, event, release))

    def end(self) -> None:
        self._put(("end",))

    def close(self) -> None:
        """Wait for all queued work; re-raise the writer's error here, in the main thread."""
        if self._thread.is_alive():
            self._put(None)
            self._thread.join()
        self._check()

    def _check(self) -> None:
        if self.error is not None:
            e = self.error
            if isinstance(e, OSError) and e.errno in OUT_OF_SPACE:
                raise OutOfSpace(e.errno, getattr(e, "filename", None)) from None
            if isinstance(e, OSError):
                raise NestlingError(f"cannot write capture shards: {e}") from None
            raise e

    def abort(self) -> None:
        """Stop without finishing the shard in flight (its temporary file is removed)."""
        self._abort = True
        self._thread.join()

    def _run(self) -> None:
        f = tmp = plan = path = None
        crc = 0
        scales: list[bytes] = []
        try:
            while True:
                try:
                    item = self.q.get(timeout=0.2)
                except queue.Empty:
                    if self._abort:
                        raise _Aborted from None
                    continue
                if self._abort:
                    raise _Aborted
                if item is None:
                    return
                if item[0] == "begin":
                    _, path, plan, header = item
                    tmp = path.with_name(f".{path.name}.tmp")
                    f = open(tmp, "wb")
                    f.write(header)
                    crc = zlib.crc32(header)
                    scales = []
                    self.bytes_written += len(header)
                elif item[0] == "hidden":
                    _, hidden, event, release = item
                    if event is not None:
                        event.synchronize()
                    raw = _raw(hidden)
                    f.write(raw)
                    crc = zlib.crc32(raw, crc)
                    self.bytes_written += hidden.numel() * hidden.element_size()
                    if release is not None:
                        release()
                elif item[0] == "scale":
                    _, scale, event, release = item
                    if event is not None:
                        event.synchronize()
                    scales.append(_raw(scale).tobytes())
                    if release is not None:
                        release()
                else:
                    ids = torch.tensor([t for s in plan.samples for t in s.input_ids], dtype=torch.int32)
                    mask = torch.tensor([t for s in plan.samples for t in s.loss_mask], dtype=torch.uint8)
                    for t in (b"".join(scales), _raw(ids), _raw(mask)):
                        f.write(t)
                        crc = zlib.crc32(t, crc)
                    f.flush()
                    os.fsync(f.fileno())
                    size = f.tell()
                    f.close()
                    f = None
                    record_checksum(path.parent, path.name, plan.key, f"{crc:08x}", size)
                    os.replace(tmp, path)
                    tmp = None
                    self.bytes_written += 5 * len(ids) + sum(map(len, scales))
        except BaseException as e:  # surfaced in the main thread by _check
            if not isinstance(e, _Aborted):
                self.error = e
                if isinstance(e, OSError) and e.filename is None:
                    e.filename = str(tmp)
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)  # a partial shard frees its space; the rerun redoes it


class _Aborted(Exception):
    pass


OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class OutOfSpace(NestlingError):
    """A shard write stopped by a full disk, a quota or a file-size limit (capture/run.py adds how much
    the capture still needs)."""

    def __init__(self, code: int, filename: str | None):
        self.errno, self.filename = code, filename
        what = {errno.EFBIG: "a file-size limit (`ulimit -f`, or the filesystem's own) stopped the write of"}
        super().__init__(
            f"{what.get(code, 'the disk is full while writing')} {filename or 'a shard'}: free space or point "
            "--out at a larger disk, then run the same command again (complete shards are kept)."
        )


def write_index(split_dir: Path, samples: list[Sample], plans: list[ShardPlan]) -> list[dict]:
    """Index in the data stage's sample order: each sample's shard, token offset and length."""
    where: dict[str, tuple[str, int]] = {}
    for p in plans:
        off = 0
        for s in p.samples:
            where[s.sample_id] = (shard_name(p.index), off)
            off += len(s.input_ids)
    index = [
        {
            "sample_id": s.sample_id,
            "shard": where[s.sample_id][0],
            "offset": where[s.sample_id][1],
            "length": len(s.input_ids),
        }
        for s in samples
    ]
    atomic_write_json(Path(split_dir) / INDEX, index)
    return index


def read_index(capture_dir: Path, split: str) -> list[dict]:
    from nestling.inputs import read_json

    path = Path(capture_dir) / split / INDEX
    if not path.exists():
        raise NestlingError(f"{capture_dir} has no '{split}' split ({path} is missing)")
    index = read_json(path, "capture index", expect=list, hint=REDO_CAPTURE)
    check_index(path, index)
    return index


REDO_CAPTURE = "capture again into a new --out folder"


def check_index(path: Path, index: list) -> None:
    """An index as capture writes it: entries of (sample_id, shard, offset, length), and in each shard the
    samples back to back from row 0 (in any order in the index, which follows the data stage's). An
    edited offset or length would read one sample's states as another's (training on misaligned samples,
    with no error): refused here, by the index alone; the train stage checks the shards' row counts
    against `shard_rows(index)`."""
    by_shard: dict[str, list[tuple[int, int, str]]] = {}
    for i, e in enumerate(index):
        ok = isinstance(e, dict) and isinstance(e.get("shard"), str) and "sample_id" in e
        off, n = (e.get("offset"), e.get("length")) if isinstance(e, dict) else (None, None)
        if not ok or type(off) is not int or type(n) is not int or n < 1:
            raise NestlingError(
                f"capture index {path}: entry {i} is not a sample entry ({str(e)[:100]}); {REDO_CAPTURE}"
            )
        by_shard.setdefault(e["shard"], []).append((off, n, str(e["sample_id"])))
    for shard, entries in by_shard.items():
        end = 0
        for off, n, sid in sorted(entries):
            if off != end:
                raise NestlingError(
                    f"capture index {path}: sample {sid} starts at row {off} of {shard}, where the samples "
                    f"before it end at row {end}: the index was edited or is damaged; {REDO_CAPTURE}"
                )
            end = off + n


def shard_rows(index: list[dict]) -> dict[str, int]:
    """Rows (tokens) each shard holds by a checked index: its last sample's end."""
    out: dict[str, int] = {}
    for e in index:
        out[e["shard"]] = max(out.get(e["shard"], 0), e["offset"] + e["length"])
    return out


class CaptureDataset(torch.utils.data.Dataset):
    """Per-sample tensors read through memory-mapped shards (`safe_open` + `get_slice`), never a whole shard.

    Items: `{"sample_id", "input_ids" long [T], "loss_mask" bool [T], "aux" [T, n_aux*H], "final" [T, H]}`.
    File handles open lazily per process (safe with DataLoader workers) and at most `max_open` stay open.
    """

    def __init__(self, capture_dir: Path, split: str = "train", max_open: int = 64):
        from nestling.manifest import read_manifest

        self.dir = Path(capture_dir)
        self.manifest = read_manifest(self.dir, "capture")
        self.split = split
        self.index = read_index(self.dir, split)
        self.max_open = max_open
        self._open: OrderedDict = OrderedDict()
        # a float8 store reads back in the dtype the target ran in, as a bf16 or fp32 store would
        self.fp8 = self.manifest.get("dtype") == "float8"
        self.read_dtype = getattr(torch, self.manifest.get("compute_dtype") or "bfloat16")

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self):
        return {**self.__dict__, "_open": OrderedDict()}

    def _handle(self, shard: str):
        from safetensors import safe_open

        h = self._open.get(shard)
        if h is None:
            h = safe_open(self.dir / self.split / shard, "pt")
            self._open[shard] = h
            if len(self._open) > self.max_open:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(shard)
        return h

    def __getitem__(self, i: int) -> dict:
        e = self.index[i]
        f = self._handle(e["shard"])
        a, b = e["offset"], e["offset"] + e["length"]
        hidden = f.get_slice("hidden")[a:b]
        if self.fp8:
            hidden = dequantize_fp8(hidden, f.get_slice("hidden_scale")[a:b], self.read_dtype)
        T = hidden.shape[0]
        return {
            "sample_id": e["sample_id"],
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
            "aux": hidden[:, :-1].reshape(T, -1),
            "final": hidden[:, -1],
        }
