"""The capture stage: prefill the target and store aux + final hidden states. Callable: runs `run.capture`."""

from nestling.stage import make_callable

make_callable(__name__, "nestling.capture.run:capture")
