"""The draft's optimizer: AdamW, or Muon for the hidden matrices plus AdamW for the rest.

`optimizer=muon` follows speculators 0.9.0 (`speculators/train/optimizers.py`): Muon (torch's, with the
Newton-Schulz dtype chosen per device: muon.py) over
every trainable 2-D weight with both sides > 1 except the embedding and lm_head (fc, q/k/v/o_proj,
gate/up/down_proj), with momentum 0.95, weight decay 0.1, 5 Newton-Schulz steps and
`adjust_lr_fn="match_rms_adamw"` (Muon's update scaled to AdamW's RMS, so one lr serves both); AdamW
over the rest (norms, lm_head when it is trained). Both follow the same warmup + cosine schedule.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from nestling.train.muon import Muon
from nestling.train.settings import TrainSettings

MUON_NS_STEPS = 5
ADAMW_ONLY = ("embed_tokens", "lm_head")  # 2-D, but Muon is for hidden matrices (Keller Jordan's rule)


def muon_split(named: list[tuple[str, nn.Parameter]]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon params, AdamW params) of the trainable parameters, names as `named_parameters` gives them."""
    muon: list[nn.Parameter] = []
    adamw: list[nn.Parameter] = []
    for name, p in named:
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_ONLY)
        (muon if hidden_matrix else adamw).append(p)
    return muon, adamw


class Optimizers:
    """One or two torch optimizers stepped as one, each with its LambdaLR schedule.

    `state_dict` holds only tensors and plain values (loads with torch.load(weights_only=True)): the
    AdamW state dict itself when AdamW is the only optimizer (the format of earlier checkpoints),
    else {"muon": ..., "adamw": ...}."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer], lr_lambda: Callable[[int], float]):
        self.parts = parts
        self.schedulers = {n: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for n, o in parts.items()}

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.parts.values())

    def step(self) -> None:
        for o in self.parts.values():
            o.step()
        for s in self.schedulers.values():
            s.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts.values():
            o.zero_grad(set_to_none=set_to_none)

    def last_lr(self) -> float:
        """The current lr of the first optimizer (Muon's when there is one: it drives the matrices)."""
        return next(iter(self.schedulers.values())).get_last_lr()[0]

    def state_dict(self) -> dict:
        return _one_or_named({n: o.state_dict() for n, o in self.parts.items()})

    def load_state_dict(self, state: dict) -> None:
        for n, o in self.parts.items():
            o.load_state_dict(state if len(self.parts) == 1 else state[n])

    def scheduler_state(self) -> dict:
        return _one_or_named({n: s.state_dict() for n, s in self.schedulers.items()})

    def load_scheduler_state(self, state: dict) -> None:
        for n, s in self.schedulers.items():
            s.load_state_dict(state if len(self.schedulers) == 1 else state[n])


def cpu_bf16_matmul() -> bool:
    """Whether this CPU runs bf16 matmuls in hardware (AVX512_BF16 or AMX, as oneDNN reports it);
    False where torch cannot say: float32 iterations cost little where bf16 would have been fast, and
    bf16 ones cost ~12x where it is not."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def muon_ns_dtype(device: torch.device, bf16_matmul: Callable[[], bool] = cpu_bf16_matmul) -> torch.dtype:
    """Where Muon orthogonalizes: bf16 (torch's choice) on GPUs and on CPUs with bf16 units, fp32 on a
    CPU without them, where bf16 matmuls take a slow path (the demo trained at 61 tok/s against ~770
    with bf16 units; muon.py)."""
    return torch.float32 if device.type == "cpu" and not bf16_matmul() else torch.bfloat16


def _one_or_named(d: dict) -> dict:
    return next(iter(d.values())) if len(d) == 1 else d


def build_optimizer(
    model: nn.Module, s: TrainSettings, lr: float, lr_lambda: Callable[[int], float], device: torch.device
) -> Optimizers:
    """The optimizer(s) of `s.optimizer` over the trainable parameters of `model`."""
    betas = tuple(s.betas) if s.betas else (0.9, 0.95)
    fused = device.type == "cuda"
    named = list(model.named_parameters())
    if s.optimizer == "adamw":
        params = [p for _, p in named if p.requires_grad]
        return Optimizers(
            {"adamw": torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=s.weight_decay, fused=fused)},
            lr_lambda,
        )
    muon, adamw = muon_split(named)
    parts: dict[str, torch.optim.Optimizer] = {}
    if muon:
        parts["muon"] = Muon(
            muon,
            lr=s.muon_lr if s.muon_lr is not None else lr,
            momentum=s.muon_momentum,
            weight_decay=s.muon_weight_decay,
            ns_steps=MUON_NS_STEPS,
            ns_dtype=muon_ns_dtype(device),
        )
    if adamw:
        parts["adamw"] = torch.optim.AdamW(adamw, lr=lr, betas=betas, weight_decay=s.weight_decay, fused=fused)
    return Optimizers(parts, lr_lambda)
