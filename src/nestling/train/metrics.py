"""metrics.jsonl (one JSON object per line, flushed), TensorBoard events when installed, and the
end-of-run plot of loss and simulated acceptance length."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from nestling.progress import log


class MetricsLog:
    def __init__(self, out: Path, main: bool, truncate_after: int = 0):
        self.path = Path(out) / "metrics.jsonl"
        self.main = main
        self.records: list[dict] = []
        self.tb = None
        if not main:
            return
        if self.path.exists():  # a resumed run: keep what the checkpoint's steps had produced
            kept = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            self.records = [r for r in kept if r.get("step", 0) <= truncate_after]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.f = open(self.path, "a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(out) / "tensorboard"))
        except Exception:  # tensorboard is optional
            self.tb = None

    def write(self, rec: dict) -> None:
        if not self.main:
            return
        self.records.append(rec)
        self.f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None:
                    self.tb.add_scalar(f"{rec['split']}/{k}", v, rec["step"])

    def last(self, split: str) -> dict | None:
        return next((r for r in reversed(self.records) if r.get("split") == split), None)

    def close(self) -> None:
        if self.main:
            self.f.close()
            if self.tb is not None:
                self.tb.close()


def ttt_metrics(tot: torch.Tensor, decay: float) -> dict:
    """`loss`, `loss_j` and `acc_j` from summed [loss sums, correct, count] x K (one place for the
    training log and the held-out evaluation, so the two always weigh steps alike)."""
    cnt = tot[2].clamp(min=1)
    loss_j, acc_j = (tot[0] / cnt).tolist(), (tot[1] / cnt).tolist()
    return {
        "loss": sum(decay**j * v for j, v in enumerate(loss_j)),
        **{f"loss_{j}": v for j, v in enumerate(loss_j)},
        **{f"acc_{j}": v for j, v in enumerate(acc_j)},
    }


def plot(metrics_path: Path, png: Path) -> None:
    """Loss (train and held-out) and simulated acceptance length against the step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("[train] matplotlib is not installed: no plot.png")
        return
    recs = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    tr = [r for r in recs if r["split"] == "train"]
    ev = [r for r in recs if r["split"] == "heldout"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot([r["step"] for r in tr], [r["loss"] for r in tr], label="train")
    if ev:
        a1.plot([r["step"] for r in ev], [r["loss"] for r in ev], "o-", label="held-out")
        a2.plot([r["step"] for r in ev], [r["sim_accept_len"] for r in ev], "o-")
    a1.set_xlabel("step"), a1.set_ylabel("TTT loss (Σ 0.8^j loss_j)"), a1.legend()
    a2.set_xlabel("step"), a2.set_ylabel("simulated acceptance length")
    a2.set_title("1 + Σ_k Π_{j≤k} acc_j (held-out)")
    fig.tight_layout()
    tmp = Path(png).with_name(f".{Path(png).name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(png)
