"""The eval stage: acceptance length by a reference decoder and the real vLLM engine. Callable:
`nestling.evaluate(...)` runs `run.evaluate`."""

from nestling.stage import make_callable

make_callable(__name__, "nestling.evaluate.run:evaluate")
