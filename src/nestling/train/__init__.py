"""The train stage: an EAGLE-3 draft trained with TTT. Callable: `nestling.train(...)` runs `run.train`."""

from nestling.stage import make_callable

make_callable(__name__, "nestling.train.run:train")
