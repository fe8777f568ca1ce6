"""Tensor parallelism for the hf backend: transformers' own plan, under torchrun, rank 0 writing.

`torchrun --nproc-per-node N -m nestling capture ... --tensor-parallel-size N` starts N copies of
the command. Each loads its slice of the target through `from_pretrained(distributed_config=
DistributedConfig(tp_size=N))` (the model's `base_model_tp_plan`), and every forward needs all N,
because the plan's row-parallel layers all-reduce. Only rank 0 reads the data, plans, checks the
disk and writes the store; the others follow it: before each forward rank 0 sends the batch's token
ids over a gloo group, and a final message tells them to stop (carrying the manifest or the error).
So the store is written once, by one process, exactly as without TP, and resume works the same.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from nestling.capture.backend import Backend
from nestling.capture.settings import CaptureSettings
from nestling.errors import NestlingError

TORCHRUN_HINT = (
    "torchrun --nproc-per-node N -m nestling capture DATA_DIR --target MODEL --out DIR --tensor-parallel-size N"
)
# Attention projections a tensor-parallel plan splits by heads: the head counts must divide by the TP degree
# (transformers does not check; a split head fails later in a reshape, or on an even split, silently).
HEAD_SPLITS = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads", "v_proj": "num_key_value_heads"}

_ctrl: Any = None  # the gloo group that carries rank 0's messages


def world() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them; (0, 1) outside torchrun."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def enabled(settings: CaptureSettings) -> bool:
    """Whether this capture runs the hf backend tensor-parallel."""
    return settings.backend == "hf" and settings.tensor_parallel_size > 1


def check_settings(settings: CaptureSettings) -> None:
    """Refuse a launch that would run the wrong number of processes or let several write the store."""
    rank, n = world()
    tp = settings.tensor_parallel_size
    if settings.backend == "vllm":
        if n > 1:
            raise NestlingError(
                f"the vllm backend starts its own workers (tensor_parallel_size={tp}); run "
                f"`nestling capture` once, not under torchrun ({n} processes were started)"
            )
        return
    if n > 1 and tp == 1:
        raise NestlingError(
            f"torchrun started {n} processes but tensor_parallel_size is 1: each would write the "
            f"same store. Pass --tensor-parallel-size {n} to split the target over them, or run "
            f"without torchrun"
        )
    if tp > 1 and n != tp:
        raise NestlingError(
            f"--tensor-parallel-size {tp} with the hf backend needs {tp} processes started by torchrun (this is "
            f"{n}): {TORCHRUN_HINT.replace('N', str(tp))}"
        )
    if tp > 1 and settings.device_map:
        raise NestlingError(
            f"device_map={settings.device_map} and tensor_parallel_size={tp} exclude each other: "
            f"TP places each rank's slice itself; drop --device-map"
        )
    if tp > 1 and settings.device not in ("cpu", "cuda"):
        raise NestlingError(
            f"with tensor_parallel_size={tp}, each rank uses cuda:LOCAL_RANK (or the CPU): give "
            f"--device cuda, cpu or auto, not {settings.device}"
        )
    if tp > 1 and settings.device == "cpu" and torch.cuda.is_available():
        raise NestlingError(
            "transformers places tensor-parallel slices on the accelerator it finds (CUDA here); "
            "use --device cuda for TP, or run without TP on the CPU"
        )


def check_target(config: Any, tp: int) -> None:
    """Refuse, from the config alone, a target transformers cannot split `tp` ways."""
    text = getattr(config, "text_config", None) or config
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None) or {}
    kind = getattr(text, "model_type", "?")
    q = getattr(config, "quantization_config", None) or getattr(text, "quantization_config", None)
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    if str(method).replace("_", "-") == "compressed-tensors":
        raise NestlingError(
            f"transformers {_transformers_version()} cannot load a compressed-tensors checkpoint tensor-parallel: "
            "sharding the per-expert quantized tensors fails (transformers/distributed/sharding_utils.py, "
            "IndexError: list index out of range; tried on a W4A16 DeepSeek-V3). Capture it with --device-map auto, "
            "or dequantize it to a dense folder first"
        )
    if not plan:
        raise NestlingError(
            f"transformers has no tensor-parallel plan for {kind} targets; capture with "
            f"--device-map auto (layers spread over the GPUs) instead of --tensor-parallel-size"
        )
    for key, style in plan.items():
        attr = HEAD_SPLITS.get(key.rsplit(".", 1)[-1])
        if attr and "colwise" in style:
            heads = getattr(text, attr, None) or text.num_attention_heads
            if heads % tp:
                raise NestlingError(
                    f"{kind} target has {attr}={heads}, which tensor_parallel_size={tp} does not "
                    f"divide (its plan splits {key} by heads); use a TP degree that divides it"
                )


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _send(msg: dict | None) -> dict:
    import torch.distributed as dist

    box: list[Any] = [msg]
    dist.broadcast_object_list(box, src=0, group=_ctrl)
    return box[0]


def init() -> None:
    """Join the process group (nccl on GPUs, gloo on the CPU) and make the gloo group for messages,
    before transformers loads anything: it reuses an initialized group."""
    global _ctrl
    import torch.distributed as dist

    if _ctrl is not None:
        return
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    _ctrl = dist.new_group(backend="gloo")


class Leader(Backend):
    """Rank 0's backend: tells the followers which tokens to run, then runs them itself."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.layer_ids, self.hidden_size = inner.layer_ids, inner.hidden_size
        self.dtype, self.device = inner.dtype, inner.device

    def capture(self, seqs: list[list[int]]) -> torch.Tensor:
        _send({"op": "capture", "seqs": seqs})
        return self.inner.capture(seqs)

    def close(self) -> None:
        self.inner.close()


def load_on_followers(target: Path, layer_ids: list[int], settings: CaptureSettings) -> None:
    """Rank 0, right before it loads its own slice: the followers load theirs."""
    import dataclasses

    _send({"op": "load", "target": str(target), "layer_ids": list(layer_ids), "settings": dataclasses.asdict(settings)})


@contextmanager
def leading() -> Iterator[dict]:
    """Rank 0's capture: whatever happens, the followers are told to stop (with the manifest, or the error)."""
    result: dict = {}
    try:
        yield result
    except BaseException as e:
        _send({"op": "stop", "error": str(e) or type(e).__name__})
        raise
    _send({"op": "stop", "manifest": result.get("manifest")})


def follow() -> dict:
    """A rank other than 0: load when told, run every batch rank 0 runs, return rank 0's manifest."""
    from nestling.capture.hf import HFBackend

    backend: HFBackend | None = None
    try:
        while True:
            msg = _send(None)
            if msg["op"] == "load":
                backend = HFBackend(Path(msg["target"]), msg["layer_ids"], CaptureSettings(**msg["settings"]))
            elif msg["op"] == "capture":
                assert backend is not None, "rank 0 sent a batch before loading"
                backend.capture(msg["seqs"])
            else:
                if "error" in msg:
                    raise NestlingError(f"tensor-parallel rank {world()[0]} stopped: rank 0 failed ({msg['error']})")
                return msg.get("manifest") or {}
    finally:
        if backend is not None:
            backend.close()


def finish() -> None:
    """Leave the process group (every rank, at the end of the capture)."""
    global _ctrl
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _ctrl = None
