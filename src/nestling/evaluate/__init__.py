"""nestling eval stage: acceptance length by a reference decoder and the real vLLM engine
(`nestling.evaluate` is `run.evaluate`)."""

from nestling.evaluate.run import EvalSettings, evaluate

__all__ = ["EvalSettings", "evaluate"]
