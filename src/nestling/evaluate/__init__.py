"""nestling eval stage: acceptance length by a reference decoder and the real vLLM engine
(`nestling.evaluate` is `run.evaluate`)."""

from nestling.evaluate.run import EvalSettings, evaluate

__all__ = ["EvalSettings", "evaluate"]

from nestling.stage import make_callable  # noqa: E402

make_callable(__name__, "nestling.evaluate.run:evaluate")
