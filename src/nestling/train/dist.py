"""Data parallelism under `torchrun`: DDP (gloo on CPU, nccl on GPU) or FSDP2, and the few
collectives the loop needs. Without torchrun everything here is a no-op on one process."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init(device_type: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local)
    return Dist(tdist.get_rank(), tdist.get_world_size(), local)


def all_sum(x: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum over ranks (returns a new tensor; the input's device is kept)."""
    if not d.enabled:
        return x
    y = x.clone()
    tdist.all_reduce(y)
    return y


def wrap(model: torch.nn.Module, d: Dist, parallel: str, device: torch.device) -> torch.nn.Module:
    if not d.enabled:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)  # one group: the loop enters through the root's forward only
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def full_state(model: torch.nn.Module, optimizer, d: Dist, parallel: str) -> tuple[dict, dict]:
    """Whole (unsharded) weights of the draft (`model.draft`) under the export names and the
    optimizer state, on CPU."""
    inner = unwrap(model)
    if d.enabled and parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(model, options=opts)
        osd = get_optimizer_state_dict(model, _torch_optimizers(optimizer), options=opts)
        sd = {k.removeprefix("draft."): v for k, v in sd.items()}
        return {k: v for k, v in sd.items() if not k.startswith(("embed_tokens.", "rotary."))}, osd
    return inner.draft.export_state_dict(), optimizer.state_dict()


def load_full_state(
    model: torch.nn.Module, optimizer, weights: dict, optim_state: dict, d: Dist, parallel: str
) -> None:
    inner = unwrap(model)
    if d.enabled and parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, {f"draft.{k}": v for k, v in weights.items()}, options=opts)
        set_optimizer_state_dict(model, _torch_optimizers(optimizer), optim_state, options=opts)
        return
    inner.draft.load_export_state_dict(weights)
    optimizer.load_state_dict(optim_state)


def _torch_optimizers(optimizer):
    """The torch optimizer(s) behind train/optim.py's `Optimizers` (FSDP's state-dict helpers take a list)."""
    opts = getattr(optimizer, "optimizers", [optimizer])
    return opts[0] if len(opts) == 1 else opts


def barrier(d: Dist) -> None:
    if d.enabled:
        tdist.barrier()


def shutdown(d: Dist) -> None:
    """Leave the process group. The finished model's FSDP state is cyclic garbage that still holds the
    group (23 objects per rank after a run, until the collector runs); collected first, the group goes
    now, while the interpreter is whole, and not at its teardown, where gloo now and then aborted the
    process after a finished run ("terminate called without an active exception")."""
    if d.enabled and tdist.is_initialized():
        gc.collect()
        tdist.destroy_process_group()
