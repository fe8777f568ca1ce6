"""Reading the user's files: one place that turns a file nestling cannot use into a NestlingError.

Every file a stage reads (data, templates, prompts, configs, manifests, indexes, checkpoints, weights)
comes from outside and may be anything: a named pipe that blocks a reader forever, bytes that are not
UTF-8, JSON that is not a mapping or holds a number too long for Python's int, a safetensors file cut
off or with a header that claims gigabytes. These helpers check what the file promises before anyone
uses it and say what is wrong with which file and what to do, so no stage meets such a file with a
traceback, a hang or garbage.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
import sys
from pathlib import Path
from typing import Any

from nestling.errors import NestlingError


def regular_file(path: str | Path, what: str) -> Path:
    """`path` as a Path when it is a regular file; a missing path, a folder, a named pipe, a device or a
    socket is refused (reading a pipe or a terminal blocks until someone writes to it: forever)."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise NestlingError(f"{what} {p} does not exist") from None
    except OSError as e:
        raise NestlingError(f"{what} {p} cannot be read ({e.strerror or e})") from None
    if stat.S_ISDIR(mode):
        raise NestlingError(f"{what} {p} is a folder; give the file itself")
    if not stat.S_ISREG(mode):
        kind = "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a device or socket"
        raise NestlingError(
            f"{what} {p} is {kind}, not a regular file: nestling reads inputs whole and would wait on it "
            "forever; save the content to a file and give that"
        )
    return p


def read_text(path: str | Path, what: str) -> str:
    """A regular file's text, which must be UTF-8 (a leading byte-order mark is dropped)."""
    p = regular_file(path, what)
    data = p.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise NestlingError(
            f"{what} {p} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None


# Python refuses to turn more than this many digits into an int (CVE-2020-10735's guard): JSON that holds
# such a number (in a field nobody reads) is still JSON, so it becomes a float (inf beyond 1e308).
INT_DIGITS = sys.get_int_max_str_digits() or 4300


def parse_json_int(s: str) -> int | float:
    """A JSON integer's value: an int, or a float where the digits pass Python's limit."""
    return int(s) if len(s) < INT_DIGITS else float(s)


def json_loads(text: str) -> Any:
    """json.loads that also reads integers longer than Python's int-string limit (as floats)."""
    return json.loads(text, parse_int=parse_json_int)


def read_json(path: str | Path, what: str, expect: type | tuple[type, ...] = dict, hint: str = "") -> Any:
    """A regular UTF-8 JSON file whose top level is of type `expect` (a mapping by default); anything else
    (not JSON, nested too deeply, a list where a mapping belongs) is an error naming the file, with `hint`
    (what to do) appended."""
    p = Path(path)
    text = read_text(p, what)
    tail = f"; {hint}" if hint else ""
    try:
        obj = json_loads(text)
    except ValueError as e:
        raise NestlingError(f"{what} {p} is not valid JSON ({str(e)[:200]}){tail}") from None
    except RecursionError:
        raise NestlingError(f"{what} {p} is nested too deeply to parse{tail}") from None
    if not isinstance(obj, expect):
        want = "a mapping" if expect is dict else "a list" if expect is list else "/".join(t.__name__ for t in expect)  # type: ignore[union-attr]
        raise NestlingError(f"{what} {p} holds {type(obj).__name__} at its top level, not {want}{tail}")
    return obj


# ---- safetensors -------------------------------------------------------------------------------------------

# safetensors' own bound on the header (its "header too large" error); a larger claim is a damaged file.
MAX_SAFETENSORS_HEADER = 100_000_000
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1, "F6_E2M3": 1, "F6_E3M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def safetensors_header(path: str | Path, what: str, hint: str) -> dict:
    """The header of a safetensors file, checked against the file: its length within the file and
    safetensors' bound, valid JSON, and every tensor's bytes inside the file and of its shape's size.
    Reads the header only (no tensor data). A file cut off or damaged is an error naming it, with `hint`."""
    p = regular_file(path, what)
    size = p.stat().st_size

    def bad(why: str) -> NestlingError:
        return NestlingError(f"{what} {p} is cut off or damaged ({why}); {hint}")

    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_SAFETENSORS_HEADER, size - 8):
            raise bad(f"its header claims {n:,} bytes, the file has {size:,}")
        raw = f.read(n)
    try:
        header = json_loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise bad("its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a mapping")
    data = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = (int(x) for x in t["data_offsets"])
            count = math.prod(int(x) for x in t["shape"])
            width = DTYPE_BYTES.get(t["dtype"])
        except (TypeError, KeyError, ValueError):
            raise bad(f"tensor {name!r} has no valid dtype, shape and data_offsets") from None
        if not 0 <= lo <= hi <= data:
            raise bad(f"tensor {name!r} lies at bytes {lo:,}-{hi:,}, past the end of its {data:,} data bytes")
        if width is not None and hi - lo != count * width:
            raise bad(f"tensor {name!r} of shape {t['shape']} {t['dtype']} has {hi - lo:,} bytes")
    return header


def load_safetensors(path: str | Path, what: str, hint: str) -> dict:
    """All tensors of a safetensors file whose header was checked first (`safetensors_header`)."""
    from safetensors.torch import load_file

    safetensors_header(path, what, hint)
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors' error types vary: a damaged file, whatever the cause
        raise NestlingError(f"{what} {path} cannot be read ({type(e).__name__}: {str(e)[:200]}); {hint}") from None


_OS_ERROR = re.compile(r"os error (\d+)")


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, whose failed writes (a full disk, a file-size limit) become the OSError
    they are, so the one error path names the file and the fix, and callers clean up as for any write
    error (safetensors raises its own SafetensorError for them)."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError is not exported under a stable name
        m = _OS_ERROR.search(str(e))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


# ---- names that are not local paths ------------------------------------------------------------------------

# "https://...", "hf://...", "s3://...": a scheme, then "//". Checked on the string as given: pathlib
# would fold the "//" into "/" and the URL would read as a missing relative path.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_HF_MODEL_URL = re.compile(r"^(?:hf://|https?://(?:www\.)?huggingface\.co/)(?!datasets/|spaces/)([\w.-]+/[\w.-]+)")
ACCEPTS = {
    "target": "a local model folder (config.json + .safetensors weights) or a .gguf file",
    "default": "a local file or folder",
}


def is_url(value: str | Path) -> bool:
    return isinstance(value, str) and bool(_URL.match(value))


def looks_like_hub_id(value: str | Path) -> bool:
    """`org/name` (a model hub id) that is no local path: nestling never resolves it on a hub."""
    v = str(value)
    return (
        isinstance(value, str)
        and v.count("/") == 1
        and not v.startswith((".", "/", "~"))
        and not v.endswith("/")
        and not Path(v).exists()
    )


def refuse_remote(value: str | Path, what: str, kind: str = "default") -> None:
    """Refuse a URL (any kind) or, for a target, a model hub id, at once: nestling reads local files only
    and never waits on a network (machines that train drafts often have none). The message names what
    nestling accepts and how to get the local copy."""
    accepts = ACCEPTS.get(kind, ACCEPTS["default"])
    if is_url(value):
        m = _HF_MODEL_URL.match(str(value))
        how = (
            f"`huggingface-cli download {m.group(1)} --local-dir DIR` on a machine with hub access, then pass DIR"
            if m and kind == "target"
            else "download it on a machine with access (e.g. `curl -L -o FILE URL`), then pass the local path"
        )
        raise NestlingError(
            f"{what} {value} is a URL: nestling reads only local paths and never downloads (no hub or web "
            f"access at run time); it takes {accepts}. Get a local copy first: {how}"
        )
    if kind == "target" and looks_like_hub_id(value):
        raise NestlingError(
            f"{what} {value!r} is not a local folder; it looks like a model hub id, and nestling never downloads "
            f"(no hub access at run time): it takes {accepts}. Get a local copy first "
            f"(`huggingface-cli download {value} --local-dir DIR` on a machine with hub access) and pass DIR"
        )


def check_argv_names(command: str, argv: list[str]) -> None:
    """Refuse URLs (and, for a target, hub ids) in a command line before any module loads or any work
    starts: `--target X`, `--target=X`, `target=X`, positional inputs (and `nestling plan`'s target)."""
    seen_command = False
    for i, tok in enumerate(argv):
        if not seen_command:
            seen_command = tok == command
            continue
        name, value = None, tok
        if tok.startswith("--") and "=" in tok:
            name, value = tok.split("=", 1)
        elif tok.startswith("-"):
            continue
        elif not is_url(tok) and "=" in tok:  # key=value override
            name, value = tok.split("=", 1)
        elif i > 0 and argv[i - 1].startswith("--") and argv[i - 1] not in ("--debug",):
            name = argv[i - 1]
        key = (name or "").lstrip("-").replace("-", "_")
        is_target = key == "target" or (name is None and command == "plan")
        if is_target:
            refuse_remote(value, "target", kind="target")
        elif is_url(value):
            refuse_remote(value, f"--{key.replace('_', '-')}" if name and name.startswith("--") else key or "input")
