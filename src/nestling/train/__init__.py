"""nestling train stage: `nestling.train.train(capture_dir, out, settings)` (see loop.py)."""

from nestling.train.loop import train
from nestling.train.settings import TrainSettings

__all__ = ["train", "TrainSettings"]

from nestling.stage import make_callable  # noqa: E402

make_callable(__name__, "nestling.train.loop:train")
